package fsm

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/hashicorp/raft"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/coordinator/internal/raftpb"
)

var update = flag.Bool("update", false, "rewrite golden files in testdata")

// harness applies commands to an FSM at increasing indexes, as Raft would.
type harness struct {
	t      *testing.T
	f      *FSM
	index  uint64
	now    int64
	events []Event
}

func newHarness(t *testing.T) *harness {
	t.Helper()
	h := &harness{t: t, f: New(testutil.Logger(t)), now: 1_700_000_000_000_000_000}
	h.f.SetObserver(func(_ uint64, ev []Event) { h.events = append(h.events, ev...) })
	return h
}

func (h *harness) apply(ct CommandType, cmd proto.Message) *Response {
	h.t.Helper()
	data, err := Encode(ct, cmd)
	require.NoError(h.t, err)
	h.index++
	r := h.f.Apply(&raft.Log{Index: h.index, Term: 1, Type: raft.LogCommand, Data: data})
	if r == nil {
		return nil
	}
	return r.(*Response)
}

func (h *harness) join(id string, inc uint64) {
	h.t.Helper()
	r := h.apply(CmdUpsertMember, &raftpb.UpsertMemberCommand{NowUnixNano: h.now, Member: &raftpb.MemberRecord{
		MemberId: id, Role: raftpb.MemberRole_MEMBER_ROLE_EDGE, Incarnation: inc, Address: "http://" + id,
		State: raftpb.MemberState_MEMBER_STATE_ALIVE}})
	require.NoError(h.t, r.Err)
}

func (h *harness) setState(id string, inc uint64, st raftpb.MemberState) {
	h.t.Helper()
	r := h.apply(CmdUpsertMember, &raftpb.UpsertMemberCommand{NowUnixNano: h.now, Member: &raftpb.MemberRecord{
		MemberId: id, Role: raftpb.MemberRole_MEMBER_ROLE_EDGE, Incarnation: inc, Address: "http://" + id, State: st}})
	require.NoError(h.t, r.Err)
}

func (h *harness) claim(claims ...*raftpb.Claim) []*raftpb.ClaimOutcome {
	h.t.Helper()
	r := h.apply(CmdClaimSessions, &raftpb.ClaimSessionsCommand{NowUnixNano: h.now, Claims: claims})
	require.NoError(h.t, r.Err)
	return r.Msg.(*raftpb.ClaimSessionsResult).GetOutcomes()
}

func claim(edge string, inc uint64, tenant, client, req string) *raftpb.Claim {
	return &raftpb.Claim{EdgeId: edge, Incarnation: inc, Tenant: tenant, ClientId: client, RequestId: req}
}

func TestFSM_ClaimSessions(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.join("e1", 1)
	h.join("e2", 1)

	out := h.claim(claim("e1", 1, "acme", "c1", "r1"))
	require.Equal(t, raftpb.ClaimStatus_CLAIM_STATUS_GRANTED, out[0].GetStatus())
	require.Equal(t, h.index, out[0].GetEpoch())
	require.Nil(t, out[0].GetPrevious())
	first := out[0].GetEpoch()

	out = h.claim(claim("e2", 1, "acme", "c1", "r1"))
	require.Equal(t, raftpb.ClaimStatus_CLAIM_STATUS_GRANTED, out[0].GetStatus())
	require.Greater(t, out[0].GetEpoch(), first)
	require.Equal(t, "e1", out[0].GetPrevious().GetOwnerEdgeId())
	require.Equal(t, first, out[0].GetPrevious().GetEpoch())
	require.Len(t, h.events, 3) // two joins, one takeover
	require.Equal(t, EventTakeover, h.events[2].Kind)
	require.Equal(t, "e1", h.events[2].FromEdge)

	st := h.f.State()
	require.Equal(t, 1, st.SessionCount())
	require.Equal(t, "e2", st.Session("acme", "c1").GetOwnerEdgeId())
	var owned []string
	st.SessionsOwnedBy("e2", func(r *raftpb.SessionRecord) bool { owned = append(owned, r.GetClientId()); return true })
	require.Equal(t, []string{"c1"}, owned)
	st.SessionsOwnedBy("e1", func(*raftpb.SessionRecord) bool { t.Fatal("e1 owns nothing"); return false })
}

func TestFSM_ClaimSessions_Idempotent(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.join("e1", 1)
	a := h.claim(claim("e1", 1, "acme", "c1", "req-1"))
	b := h.claim(claim("e1", 1, "acme", "c1", "req-1"))
	require.True(t, proto.Equal(a[0], b[0]), "a retried claim returns the original grant")
	require.Equal(t, a[0].GetEpoch(), h.f.State().Session("acme", "c1").GetEpoch())

	// Another edge may use the same request ID: scopes are per edge.
	h.join("e2", 1)
	c := h.claim(claim("e2", 1, "acme", "c1", "req-1"))
	require.Greater(t, c[0].GetEpoch(), a[0].GetEpoch())

	// e1 retries its claim once more (its first answer was lost with a
	// leader, say): the grant is not e1's to act on any more, since e2
	// claimed the session after it, and answering it again would give the
	// session two owners.
	d := h.claim(claim("e1", 1, "acme", "c1", "req-1"))
	require.Equal(t, raftpb.ClaimStatus_CLAIM_STATUS_SUPERSEDED, d[0].GetStatus(), d[0].GetMessage())
	require.Equal(t, "e2", h.f.State().Session("acme", "c1").GetOwnerEdgeId(), "the retry changed nothing")

	// After the dedup window the record is pruned.
	h.now += DedupWindow + 1
	h.claim(claim("e2", 1, "acme", "other", ""))
	require.Nil(t, h.f.State().Request(scopeClaim+"e1", "req-1"))
}

// A record names the edge its owner took the session from, and keeps
// naming it through the owner's own later claims: an owner that lost the
// answer to its first claim (its takeover never ran) claims again, sees
// itself as the previous owner, and still learns whom to take over from.
func TestFSM_ClaimSessions_TakenFrom(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.join("e1", 1)
	h.join("e2", 1)
	takenFrom := func() string { return h.f.State().Session("acme", "c1").GetTakenFromEdgeId() }
	h.claim(claim("e1", 1, "acme", "c1", ""))
	require.Empty(t, takenFrom(), "a new session was taken from nobody")
	out := h.claim(claim("e2", 1, "acme", "c1", "lost-answer"))
	require.Equal(t, "e1", out[0].GetPrevious().GetOwnerEdgeId())
	require.Equal(t, "e1", takenFrom())
	out = h.claim(claim("e2", 1, "acme", "c1", ""))
	require.Equal(t, "e2", out[0].GetPrevious().GetOwnerEdgeId())
	require.Equal(t, "e1", out[0].GetPrevious().GetTakenFromEdgeId(), "carried over by the owner's own claim")
	require.Equal(t, "e1", takenFrom())
	h.claim(claim("e1", 1, "acme", "c1", ""))
	require.Equal(t, "e2", takenFrom())
	h.join("e1", 2)
	h.claim(claim("e1", 2, "acme", "c1", ""))
	require.Equal(t, "e1", takenFrom(), "another incarnation is another owner")
	require.Equal(t, uint64(1), h.f.State().Session("acme", "c1").GetTakenFromIncarnation())
}

func TestFSM_ClaimSessions_Refusals(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.join("e1", 2)
	long := string(bytes.Repeat([]byte("x"), MaxClientIDLen+1))
	for _, tc := range []struct {
		name string
		c    *raftpb.Claim
		want raftpb.ClaimStatus
	}{
		{"bad_tenant", claim("e1", 2, "ACME", "c", ""), raftpb.ClaimStatus_CLAIM_STATUS_INVALID_ARGUMENT},
		{"empty_client", claim("e1", 2, "acme", "", ""), raftpb.ClaimStatus_CLAIM_STATUS_INVALID_ARGUMENT},
		{"long_client", claim("e1", 2, "acme", long, ""), raftpb.ClaimStatus_CLAIM_STATUS_INVALID_ARGUMENT},
		{"nul_client", claim("e1", 2, "acme", "a\x00b", ""), raftpb.ClaimStatus_CLAIM_STATUS_INVALID_ARGUMENT},
		{"unknown_edge", claim("e9", 1, "acme", "c", ""), raftpb.ClaimStatus_CLAIM_STATUS_LEASE_INVALID},
		{"old_incarnation", claim("e1", 1, "acme", "c", ""), raftpb.ClaimStatus_CLAIM_STATUS_LEASE_INVALID},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := h.claim(tc.c)
			require.Equal(t, tc.want, out[0].GetStatus(), out[0].GetMessage())
		})
	}
	require.Zero(t, h.f.State().SessionCount())

	out := h.claim(claim("e1", 2, "acme", "dup", ""), claim("e1", 2, "acme", "dup", ""))
	require.Equal(t, raftpb.ClaimStatus_CLAIM_STATUS_GRANTED, out[0].GetStatus())
	require.Equal(t, raftpb.ClaimStatus_CLAIM_STATUS_CONFLICT, out[1].GetStatus())

	h.setState("e1", 2, raftpb.MemberState_MEMBER_STATE_EXPIRED)
	out = h.claim(claim("e1", 2, "acme", "late", ""))
	require.Equal(t, raftpb.ClaimStatus_CLAIM_STATUS_LEASE_INVALID, out[0].GetStatus())
}

// A claim that names the owner it expects is granted only while the session
// has that owner: a custodian adopting a draining edge's session does not take
// it from the edge its client moved to meanwhile.
func TestFSM_ClaimSessions_ExpectedOwner(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.join("drain", 1)
	h.join("custodian", 1)
	h.join("other", 1)
	expecting := func(c *raftpb.Claim, owner string) *raftpb.Claim { c.ExpectedOwner = owner; return c }

	out := h.claim(expecting(claim("custodian", 1, "acme", "c1", "r1"), "drain"))
	require.Equal(t, raftpb.ClaimStatus_CLAIM_STATUS_OWNER_CHANGED, out[0].GetStatus(), "no owner yet")
	h.claim(claim("drain", 1, "acme", "c1", "r0"))
	// The client moves on to another edge before the custodian's claim.
	h.claim(claim("other", 1, "acme", "c1", "r2"))
	out = h.claim(expecting(claim("custodian", 1, "acme", "c1", "r3"), "drain"))
	require.Equal(t, raftpb.ClaimStatus_CLAIM_STATUS_OWNER_CHANGED, out[0].GetStatus())
	require.Contains(t, out[0].GetMessage(), `"other"`)
	require.Equal(t, "other", h.f.State().Session("acme", "c1").GetOwnerEdgeId(), "the refused claim changed nothing")
	// Refusals are not remembered: the request ID may be used again.
	h.claim(claim("drain", 1, "acme", "c1", "r4"))
	out = h.claim(expecting(claim("custodian", 1, "acme", "c1", "r3"), "drain"))
	require.Equal(t, raftpb.ClaimStatus_CLAIM_STATUS_GRANTED, out[0].GetStatus())
	require.Equal(t, "drain", out[0].GetPrevious().GetOwnerEdgeId())

	out = h.claim(expecting(claim("custodian", 1, "acme", "c2", ""), "bad id\x00"))
	require.Equal(t, raftpb.ClaimStatus_CLAIM_STATUS_INVALID_ARGUMENT, out[0].GetStatus())
}

func TestFSM_ReleaseSession(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.join("e1", 1)
	ep := h.claim(claim("e1", 1, "acme", "c1", ""))[0].GetEpoch()

	rel := func(epoch uint64, req string) *Response {
		return h.apply(CmdReleaseSession, &raftpb.ReleaseSessionCommand{NowUnixNano: h.now, RequestId: req,
			Tenant: "acme", ClientId: "c1", Epoch: epoch, EdgeId: "e1", Incarnation: 1})
	}
	require.ErrorIs(t, rel(ep-1, "").Err, ErrStaleEpoch)
	r := rel(ep, "rel-1")
	require.NoError(t, r.Err)
	require.True(t, r.Msg.(*raftpb.ReleaseSessionResult).GetReleased())
	require.Zero(t, h.f.State().SessionCount())
	require.True(t, rel(ep, "rel-1").Msg.(*raftpb.ReleaseSessionResult).GetReleased(), "retry answers the same")
	require.False(t, rel(ep, "").Msg.(*raftpb.ReleaseSessionResult).GetReleased())

	// Epochs stay monotonic after a release: the next claim gets a higher one.
	require.Greater(t, h.claim(claim("e1", 1, "acme", "c1", ""))[0].GetEpoch(), ep)
}

// A batch of releases applies each as an entry of its own would, in order:
// one refused leaves the others applied, and a request ID answered alone is
// answered the same in a batch.
func TestFSM_ReleaseSessions(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.join("e1", 1)
	h.join("e2", 1)
	epochs := map[string]uint64{}
	for _, c := range []string{"a", "b", "c", "d", "e"} {
		epochs[c] = h.claim(claim("e1", 1, "acme", c, ""))[0].GetEpoch()
	}
	rel := func(client string, epoch uint64, edge, req string) *raftpb.ReleaseSessionCommand {
		return &raftpb.ReleaseSessionCommand{NowUnixNano: h.now, RequestId: req, Tenant: "acme", ClientId: client, Epoch: epoch, EdgeId: edge, Incarnation: 1}
	}
	// "d" is released alone first; its request comes again in the batch.
	require.True(t, h.apply(CmdReleaseSession, rel("d", epochs["d"], "e1", "rel-d")).Msg.(*raftpb.ReleaseSessionResult).GetReleased())

	r := h.apply(CmdReleaseSessions, &raftpb.ReleaseSessionsCommand{NowUnixNano: h.now, Releases: []*raftpb.ReleaseSessionCommand{
		rel("a", epochs["a"], "e1", "rel-a"),
		rel("b", epochs["b"]-1, "e1", "rel-b"),
		rel("c", epochs["c"], "e2", "rel-c"),
		rel("d", epochs["d"], "e1", "rel-d"),
		rel("never", 1, "e1", "rel-never"),
		rel("bad id\x00", 1, "e1", "rel-bad"),
		rel("e", epochs["e"], "e1", "rel-e"),
		rel("e", epochs["e"], "e1", "rel-e2"),
	}})
	require.NoError(t, r.Err)
	var got []raftpb.ReleaseStatus
	for _, o := range r.Msg.(*raftpb.ReleaseSessionsResult).GetOutcomes() {
		got = append(got, o.GetStatus())
	}
	require.Equal(t, []raftpb.ReleaseStatus{
		raftpb.ReleaseStatus_RELEASE_STATUS_RELEASED,
		raftpb.ReleaseStatus_RELEASE_STATUS_STALE_EPOCH,
		raftpb.ReleaseStatus_RELEASE_STATUS_NOT_OWNER,
		raftpb.ReleaseStatus_RELEASE_STATUS_RELEASED, // remembered from the release alone
		raftpb.ReleaseStatus_RELEASE_STATUS_ABSENT,
		raftpb.ReleaseStatus_RELEASE_STATUS_INVALID_ARGUMENT,
		raftpb.ReleaseStatus_RELEASE_STATUS_RELEASED,
		raftpb.ReleaseStatus_RELEASE_STATUS_ABSENT, // released earlier in the entry
	}, got)
	require.Nil(t, h.f.State().Session("acme", "a"))
	require.NotNil(t, h.f.State().Session("acme", "b"), "a stale release leaves the session")
	require.NotNil(t, h.f.State().Session("acme", "c"), "another edge's release leaves it")
	require.Nil(t, h.f.State().Session("acme", "e"))

	// Answered in a batch, answered the same alone; refusals are not
	// remembered, so "b" is released under its epoch with the same ID.
	require.True(t, h.apply(CmdReleaseSession, rel("a", epochs["a"], "e1", "rel-a")).Msg.(*raftpb.ReleaseSessionResult).GetReleased())
	require.True(t, h.apply(CmdReleaseSession, rel("b", epochs["b"], "e1", "rel-b")).Msg.(*raftpb.ReleaseSessionResult).GetReleased())
	require.Equal(t, 1, h.f.State().SessionCount())
}

func TestFSM_ReassignSessions(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.join("dead", 1)
	h.join("live", 1)
	h.claim(claim("dead", 1, "acme", "a", ""), claim("dead", 1, "acme", "b", ""))
	// "b" reconnects to live before the custody command lands.
	h.claim(claim("live", 1, "acme", "b", ""))
	h.setState("dead", 1, raftpb.MemberState_MEMBER_STATE_EXPIRED)
	h.events = nil

	r := h.apply(CmdReassignSessions, &raftpb.ReassignSessionsCommand{NowUnixNano: h.now, FromEdgeId: "dead", FromIncarnation: 1,
		Assignments: []*raftpb.Reassignment{
			{Tenant: "acme", ClientId: "a", ToEdgeId: "live", ToIncarnation: 1},
			{Tenant: "acme", ClientId: "b", ToEdgeId: "live", ToIncarnation: 1},
		}})
	res := r.Msg.(*raftpb.ReassignSessionsResult)
	require.Equal(t, []bool{true, false}, res.GetApplied())
	a := h.f.State().Session("acme", "a")
	require.Equal(t, "live", a.GetOwnerEdgeId())
	require.Equal(t, raftpb.OwnerKind_OWNER_KIND_CUSTODY, a.GetOwnerKind())
	require.Equal(t, h.index, a.GetEpoch())
	require.Len(t, h.events, 1)
	require.Equal(t, EventCustody, h.events[0].Kind)
	require.Equal(t, []SessionEpoch{{"acme", "a", h.index}}, h.events[0].Sessions)

	// Applying the same plan again changes nothing: exactly once.
	r = h.apply(CmdReassignSessions, &raftpb.ReassignSessionsCommand{NowUnixNano: h.now, FromEdgeId: "dead", FromIncarnation: 1,
		Assignments: []*raftpb.Reassignment{{Tenant: "acme", ClientId: "a", ToEdgeId: "live", ToIncarnation: 1}}})
	require.Equal(t, []bool{false}, r.Msg.(*raftpb.ReassignSessionsResult).GetApplied())

	// The custody origin is the edge whose death started the custody, and
	// stays when the session passes on from a custodian that died.
	origin := func() (string, uint64) { return CustodyOrigin(h.f.State().Session("acme", "a")) }
	e, inc := origin()
	require.Equal(t, "dead", e)
	require.Equal(t, uint64(1), inc)
	h.join("next", 1)
	h.setState("live", 1, raftpb.MemberState_MEMBER_STATE_EXPIRED)
	r = h.apply(CmdReassignSessions, &raftpb.ReassignSessionsCommand{NowUnixNano: h.now, FromEdgeId: "live", FromIncarnation: 1,
		Assignments: []*raftpb.Reassignment{{Tenant: "acme", ClientId: "a", ToEdgeId: "next", ToIncarnation: 1}}})
	require.Equal(t, []bool{true}, r.Msg.(*raftpb.ReassignSessionsResult).GetApplied())
	require.Equal(t, "live", h.f.State().Session("acme", "a").GetTakenFromEdgeId())
	e, _ = origin()
	require.Equal(t, "dead", e, "passed on from a dead custodian, the origin stays")
	// A connection's claim ends the custody, and its origin with it.
	h.claim(claim("next", 1, "acme", "a", ""))
	e, _ = origin()
	require.Empty(t, e)
	// A record written before the field existed: taken_from stands for it.
	old := &raftpb.SessionRecord{OwnerKind: raftpb.OwnerKind_OWNER_KIND_CUSTODY, TakenFromEdgeId: "x", TakenFromIncarnation: 4}
	e, inc = CustodyOrigin(old)
	require.Equal(t, "x", e)
	require.Equal(t, uint64(4), inc)
}

func TestFSM_UpsertMember(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.join("e1", 5)
	up := func(inc uint64, st raftpb.MemberState) *Response {
		return h.apply(CmdUpsertMember, &raftpb.UpsertMemberCommand{NowUnixNano: h.now, Member: &raftpb.MemberRecord{
			MemberId: "e1", Role: raftpb.MemberRole_MEMBER_ROLE_EDGE, Incarnation: inc, Address: "http://e1", State: st}})
	}
	require.False(t, up(5, raftpb.MemberState_MEMBER_STATE_ALIVE).Msg.(*raftpb.UpsertMemberResult).GetChanged())
	require.ErrorIs(t, up(4, raftpb.MemberState_MEMBER_STATE_ALIVE).Err, ErrStaleIncarnation)
	require.NoError(t, up(5, raftpb.MemberState_MEMBER_STATE_EXPIRED).Err)
	require.ErrorIs(t, up(5, raftpb.MemberState_MEMBER_STATE_ALIVE).Err, ErrStaleIncarnation, "a dead incarnation stays dead")
	require.NoError(t, up(6, raftpb.MemberState_MEMBER_STATE_ALIVE).Err)
	require.ErrorIs(t, up(7, raftpb.MemberState_MEMBER_STATE_UNSPECIFIED).Err, ErrInvalidArgument)
}

// A member that left or expired long enough ago goes from the state with
// the next membership change that asks for it, unless a session is still
// owned by it or it holds a promotion lease.
func TestFSM_UpsertMember_PrunesDeadMembers(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.join("gone", 1)
	h.join("owner", 1)
	h.join("promoter", 1)
	h.join("alive", 1)
	h.claim(claim("owner", 1, "acme", "dev", "r1"))
	r := h.apply(CmdAcquirePromotionLeaseV2, &raftpb.AcquirePromotionLeaseCommand{NowUnixNano: h.now, GroupId: 0,
		MemberId: "promoter", Incarnation: 1, TtlNanos: 5e9})
	require.NoError(t, r.Err)
	for _, id := range []string{"gone", "owner", "promoter"} {
		h.setState(id, 1, raftpb.MemberState_MEMBER_STATE_EXPIRED)
	}
	died := h.now
	h.now += 3600e9

	upsert := func(before int64) *raftpb.UpsertMemberResult {
		r := h.apply(CmdUpsertMember, &raftpb.UpsertMemberCommand{NowUnixNano: h.now, PruneDeadBeforeUnixNano: before,
			Member: &raftpb.MemberRecord{MemberId: "new", Role: raftpb.MemberRole_MEMBER_ROLE_EDGE, Incarnation: 1,
				Address: "http://new", State: raftpb.MemberState_MEMBER_STATE_ALIVE}})
		require.NoError(t, r.Err)
		return r.Msg.(*raftpb.UpsertMemberResult)
	}
	require.Empty(t, upsert(0).GetPruned(), "no pruning unless asked")
	require.Empty(t, upsert(died).GetPruned(), "dead for less than the retention")
	require.Equal(t, []string{"gone"}, upsert(died+1).GetPruned())
	st := h.f.State()
	require.Nil(t, st.Member("gone"))
	require.NotNil(t, st.Member("owner"), "still owns a session")
	require.NotNil(t, st.Member("promoter"), "holds a promotion lease")
	require.NotNil(t, st.Member("alive"))

	// Once its session is in a custodian's hands, the owner goes too.
	r = h.apply(CmdReassignSessions, &raftpb.ReassignSessionsCommand{NowUnixNano: h.now, FromEdgeId: "owner", FromIncarnation: 1,
		Assignments: []*raftpb.Reassignment{{Tenant: "acme", ClientId: "dev", ToEdgeId: "alive", ToIncarnation: 1}}})
	require.NoError(t, r.Err)
	require.Equal(t, []string{"owner"}, upsert(died+1).GetPruned())
}

func TestFSM_RedisPrimary(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	acquire := func(member string, inc uint64) *raftpb.AcquirePromotionLeaseResult {
		r := h.apply(CmdAcquirePromotionLeaseV2, &raftpb.AcquirePromotionLeaseCommand{NowUnixNano: h.now, GroupId: 0,
			MemberId: member, Incarnation: inc, TtlNanos: 5e9})
		require.NoError(t, r.Err)
		return r.Msg.(*raftpb.AcquirePromotionLeaseResult)
	}
	cas := func(member string, expected uint64, primary, req string) *raftpb.CompareAndSetRedisPrimaryResult {
		r := h.apply(CmdCompareAndSetRedis, &raftpb.CompareAndSetRedisPrimaryCommand{NowUnixNano: h.now, RequestId: req,
			MemberId: member, Incarnation: 1, ExpectedRecordEpoch: expected, GroupId: 0, PrimaryAddress: primary})
		require.NoError(t, r.Err)
		return r.Msg.(*raftpb.CompareAndSetRedisPrimaryResult)
	}

	require.False(t, cas("p1", 0, "r1:6379", "").GetSwapped(), "no lease, no swap")
	l := acquire("p1", 1)
	require.True(t, l.GetAcquired())
	require.False(t, acquire("p2", 1).GetAcquired(), "two promoters never both hold the lease")
	require.Equal(t, l.GetLease().GetLeaseEpoch(), acquire("p1", 1).GetLease().GetLeaseEpoch(), "renewal keeps the epoch")

	res := cas("p1", 0, "r1:6379", "x")
	require.True(t, res.GetSwapped())
	ep := res.GetGroup().GetRecordEpoch()
	require.Equal(t, h.index, ep)
	require.True(t, cas("p1", 0, "r1:6379", "x").GetSwapped(), "a retry answers the same")
	require.False(t, cas("p1", 0, "r2:6379", "").GetSwapped(), "stale expected epoch")

	h.now += 6e9 // p1's lease expires
	require.True(t, acquire("p2", 1).GetAcquired())
	require.False(t, cas("p1", ep, "r3:6379", "").GetSwapped())
	res = cas("p2", ep, "r2:6379", "")
	require.True(t, res.GetSwapped())
	require.Equal(t, "r2:6379", h.f.State().RedisGroup(0).GetPrimaryAddress())
}

func TestFSM_ConfigACLSlots(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	r := h.apply(CmdSetConfig, &raftpb.SetConfigCommand{Set: []*raftpb.ConfigEntry{{Key: "lease_ttl", Value: "10s"}, {Key: "x", Value: "1"}}})
	require.NoError(t, r.Err)
	h.apply(CmdSetConfig, &raftpb.SetConfigCommand{Delete: []string{"x"}})
	st := h.f.State()
	require.Equal(t, h.index, st.ConfigVersion())
	require.Len(t, st.Config(), 1)

	r = h.apply(CmdBumpAclVersion, &raftpb.BumpAclVersionCommand{Tenant: "acme"})
	require.Equal(t, h.index, r.Msg.(*raftpb.BumpAclVersionResult).GetAclVersion().GetVersion())
	require.ErrorIs(t, h.apply(CmdBumpAclVersion, &raftpb.BumpAclVersionCommand{Tenant: "A B"}).Err, ErrInvalidArgument)

	r = h.apply(CmdSetSlotTable, &raftpb.SetSlotTableCommand{SlotGroups: []uint32{0, 0, 1, 1}})
	v := r.Msg.(*raftpb.SetSlotTableResult).GetTable().GetVersion()
	require.False(t, h.apply(CmdSetSlotTable, &raftpb.SetSlotTableCommand{SlotGroups: []uint32{1}}).Msg.(*raftpb.SetSlotTableResult).GetSwapped())
	require.True(t, h.apply(CmdSetSlotTable, &raftpb.SetSlotTableCommand{ExpectedVersion: v, SlotGroups: []uint32{1}}).Msg.(*raftpb.SetSlotTableResult).GetSwapped())
}

func TestFSM_Apply_SkipsAppliedAndIgnorable(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.join("e1", 1)
	data, err := Encode(CmdClaimSessions, &raftpb.ClaimSessionsCommand{Claims: []*raftpb.Claim{claim("e1", 1, "acme", "c", "")}})
	require.NoError(t, err)
	require.Nil(t, h.f.Apply(&raft.Log{Index: 1, Type: raft.LogCommand, Data: data}), "index already applied")
	require.Zero(t, h.f.State().SessionCount())

	require.Nil(t, h.f.Apply(&raft.Log{Index: 2, Type: raft.LogCommand, Data: []byte{byte(IgnoreUnknownFlag | 100), 1, 2}}))
	require.Equal(t, uint64(2), h.f.State().Index())
	require.Panics(t, func() { h.f.Apply(&raft.Log{Index: 3, Type: raft.LogCommand, Data: []byte{100}}) })
}

func TestRegisterCommand_Duplicate(t *testing.T) {
	t.Parallel()
	f := New(nil)
	require.Panics(t, func() {
		RegisterCommand(f, CmdClaimSessions, func(*Tx, *raftpb.ClaimSessionsCommand) (*raftpb.ClaimSessionsResult, error) { return nil, nil })
	})
	require.Panics(t, func() {
		RegisterCommand(f, IgnoreUnknownFlag|50, func(*Tx, *raftpb.ClaimSessionsCommand) (*raftpb.ClaimSessionsResult, error) { return nil, nil })
	})
}

// goldenState builds a state touching every record kind, deterministically.
func goldenState(t *testing.T) *harness {
	t.Helper()
	h := newHarness(t)
	h.join("edge-a", 1)
	h.join("edge-b", 3)
	for i := range 5 {
		h.claim(claim("edge-a", 1, "acme", "client-"+strconv.Itoa(i), "req-"+strconv.Itoa(i)))
	}
	h.claim(claim("edge-b", 3, "globex", "sensor/1", ""), claim("edge-b", 3, "acme", "client-0", ""))
	h.apply(CmdSetConfig, &raftpb.SetConfigCommand{NowUnixNano: h.now, Set: []*raftpb.ConfigEntry{{Key: "lease_ttl", Value: "10s"}}})
	h.apply(CmdBumpAclVersion, &raftpb.BumpAclVersionCommand{Tenant: "acme"})
	h.apply(CmdAcquirePromotionLeaseV2, &raftpb.AcquirePromotionLeaseCommand{NowUnixNano: h.now, MemberId: "p1", Incarnation: 1, TtlNanos: 5e9})
	h.apply(CmdCompareAndSetRedis, &raftpb.CompareAndSetRedisPrimaryCommand{NowUnixNano: h.now, RequestId: "cas-1", MemberId: "p1",
		Incarnation: 1, PrimaryAddress: "redis-0:6379", ReplicaAddresses: []string{"redis-1:6379", "redis-2:6379"}})
	h.apply(CmdSetSlotTable, &raftpb.SetSlotTableCommand{SlotGroups: []uint32{0, 0, 0, 0}})
	return h
}

func requireSameState(t *testing.T, want, got *State) {
	t.Helper()
	var a, b bytes.Buffer
	require.NoError(t, WriteSnapshot(&a, want))
	require.NoError(t, WriteSnapshot(&b, got))
	require.Equal(t, a.Bytes(), b.Bytes())
	require.Equal(t, want.Index(), got.Index())
	require.Equal(t, want.SessionCount(), got.SessionCount())
}

func TestFSM_SnapshotRestore(t *testing.T) {
	t.Parallel()
	h := goldenState(t)
	snap, err := h.f.Snapshot()
	require.NoError(t, err)

	// Apply more after the snapshot: the snapshot must not see it.
	before := h.f.State()
	h.claim(claim("edge-a", 1, "acme", "after", ""))

	sink := &memSink{}
	require.NoError(t, snap.Persist(sink))
	require.True(t, sink.closed)

	f2 := New(testutil.Logger(t))
	require.NoError(t, f2.Restore(sink.rc()))
	requireSameState(t, before, f2.State())
	var owned int
	f2.State().SessionsOwnedBy("edge-a", func(*raftpb.SessionRecord) bool { owned++; return true })
	require.Equal(t, 4, owned, "owner index rebuilt")
	require.NotNil(t, f2.State().Request(scopeClaim+"edge-a", "req-3"), "request records survive")
}

func TestFSM_Restore_Golden(t *testing.T) {
	t.Parallel()
	h := goldenState(t)
	var buf bytes.Buffer
	require.NoError(t, WriteSnapshot(&buf, h.f.State()))
	dir := filepath.Join("testdata", "snapshots")
	if *update {
		require.NoError(t, os.MkdirAll(dir, 0o750))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "v2.snap"), buf.Bytes(), 0o600))
	}
	// A snapshot written by an older build must still restore: v1 predates
	// the session records' taken_from fields, v2 is the current form.
	for _, name := range []string{"v1.snap", "v2.snap"} {
		t.Run(name, func(t *testing.T) {
			golden, err := os.ReadFile(filepath.Join(dir, name))
			require.NoError(t, err, "run go test -run TestFSM_Restore_Golden -update to create v2.snap")
			st, err := ReadSnapshot(bytes.NewReader(golden))
			require.NoError(t, err)
			require.Equal(t, "redis-0:6379", st.RedisGroup(0).GetPrimaryAddress())
			require.Equal(t, "edge-b", st.Session("acme", "client-0").GetOwnerEdgeId())
			if name == "v1.snap" {
				require.Equal(t, h.f.State().Index(), st.Index())
				require.Equal(t, h.f.State().SessionCount(), st.SessionCount())
				require.Empty(t, st.Session("acme", "client-0").GetTakenFromEdgeId(), "unknown before v2")
				return
			}
			requireSameState(t, h.f.State(), st)
			require.Equal(t, "edge-a", st.Session("acme", "client-0").GetTakenFromEdgeId())
		})
	}
}

func TestReadSnapshot_Corrupt(t *testing.T) {
	t.Parallel()
	h := goldenState(t)
	var buf bytes.Buffer
	require.NoError(t, WriteSnapshot(&buf, h.f.State()))
	good := buf.Bytes()
	for _, tc := range []struct {
		name string
		data []byte
	}{
		{"empty", nil},
		{"bad_magic", append([]byte("NOTASNAP"), good[8:]...)},
		{"truncated", good[:len(good)-3]},
		{"trailing", append(append([]byte(nil), good...), 0)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ReadSnapshot(bytes.NewReader(tc.data))
			require.ErrorIs(t, err, ErrCorruptSnapshot)
		})
	}
}

type memSink struct {
	bytes.Buffer
	closed, canceled bool
}

func (s *memSink) ID() string    { return "mem" }
func (s *memSink) Cancel() error { s.canceled = true; return nil }
func (s *memSink) Close() error  { s.closed = true; return nil }
func (s *memSink) rc() *readCloser {
	return &readCloser{bytes.NewReader(s.Bytes())}
}

type readCloser struct{ *bytes.Reader }

func (readCloser) Close() error { return nil }

// The promotion lease's two rules, each under its own command type: an
// entry of the first type replays by the rule it was written under (a
// holder taking the lease again keeps its epoch, renew_epoch unread), and
// the second fences writers (a failover's lease is a new epoch even for
// its holder; a renewal names its epoch). A node that knew only the first
// type stops at the second rather than apply it by the old rule.
func TestFSM_PromotionLeaseRulesByType(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		typ CommandType
		// after a bootstrap lease of p1: a failover's lease by p1, and a
		// renewal naming a wrong epoch.
		failoverKeepsEpoch, wrongRenewalTaken bool
	}{
		{CmdAcquirePromotionLease, true, true},
		{CmdAcquirePromotionLeaseV2, false, false},
	} {
		h := newHarness(t)
		acquire := func(fence bool, renew uint64) *raftpb.AcquirePromotionLeaseResult {
			r := h.apply(tc.typ, &raftpb.AcquirePromotionLeaseCommand{NowUnixNano: h.now, MemberId: "p1", Incarnation: 1,
				TtlNanos: 5e9, FenceWriters: fence, RenewEpoch: renew})
			require.NoError(t, r.Err)
			return r.Msg.(*raftpb.AcquirePromotionLeaseResult)
		}
		boot := acquire(false, 0)
		require.True(t, boot.GetAcquired())
		failover := acquire(true, 0)
		require.True(t, failover.GetAcquired())
		require.Equal(t, tc.failoverKeepsEpoch, failover.GetLease().GetLeaseEpoch() == boot.GetLease().GetLeaseEpoch(), "type %d", tc.typ)
		wrong := acquire(true, failover.GetLease().GetLeaseEpoch()+100)
		require.Equal(t, tc.wrongRenewalTaken, wrong.GetAcquired(), "type %d", tc.typ)
	}
	// A node of the first rule only, asked to apply the second type.
	old := newHarness(t)
	old.f.handlers[CmdAcquirePromotionLeaseV2] = nil
	entry, err := Encode(CmdAcquirePromotionLeaseV2, &raftpb.AcquirePromotionLeaseCommand{MemberId: "p1", TtlNanos: 5e9})
	require.NoError(t, err)
	require.Panics(t, func() { old.f.Apply(&raft.Log{Index: 1, Term: 1, Type: raft.LogCommand, Data: entry}) })
}
