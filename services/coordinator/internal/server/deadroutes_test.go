package server

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	"github.com/keelmq/keel/services/coordinator/internal/fsm"
	"github.com/keelmq/keel/services/coordinator/internal/raftpb"
)

func edgeRec(id string, inc uint64, st raftpb.MemberState) *raftpb.MemberRecord {
	return &raftpb.MemberRecord{MemberId: id, Role: raftpb.MemberRole_MEMBER_ROLE_EDGE, Incarnation: inc, State: st}
}

var (
	alive   = raftpb.MemberState_MEMBER_STATE_ALIVE
	expired = raftpb.MemberState_MEMBER_STATE_EXPIRED
	left    = raftpb.MemberState_MEMBER_STATE_LEFT
)

// TestDeadRoutes_GraceAfterAdoption: nothing is due before custody found the
// dead incarnation's sessions all adopted, and then only after the grace.
func TestDeadRoutes_GraceAfterAdoption(t *testing.T) {
	const grace = 5 * time.Second
	t0 := time.Unix(1_000_000, 0)
	d := newDeadRoutes(grace, time.Minute, time.Hour)
	d.add("edge-a", 3)
	require.Equal(t, 1, d.len())
	require.Empty(t, d.takeDue(t0.Add(time.Hour), anyLive), "not adopted yet")
	_, ok := d.next()
	require.False(t, ok)

	// A scan of a state from before the death says nothing about inc 3.
	d.adopted(edgeRec("edge-a", 3, alive), t0, 0)
	d.adopted(edgeRec("edge-a", 2, expired), t0, 0)
	require.Empty(t, d.takeDue(t0.Add(time.Hour), anyLive))

	d.adopted(edgeRec("edge-a", 3, expired), t0, 0)
	select {
	case <-d.wake:
	default:
		t.Fatal("adoption did not wake the removal loop")
	}
	at, ok := d.next()
	require.True(t, ok)
	require.Equal(t, t0.Add(grace), at)
	require.Empty(t, d.takeDue(t0.Add(grace-time.Millisecond), anyLive))
	// A later scan does not push the grace back.
	d.adopted(edgeRec("edge-a", 3, expired), t0.Add(time.Second), 0)
	require.Equal(t, []deadRoute{{edge: "edge-a", inc: 3}}, d.takeDue(t0.Add(grace), anyLive))

	d.done("edge-a", 3)
	require.Zero(t, d.len())
	// The same death seen again (a later event, a replayed scan) is no new work.
	d.add("edge-a", 3)
	d.add("edge-a", 1)
	require.Zero(t, d.len())
}

// TestDeadRoutes_Rejoin: an incarnation that died with a newer one alive is
// adopted once no dead incarnation's session is left, and its removal names
// the dead incarnation, never the live one.
func TestDeadRoutes_Rejoin(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	d := newDeadRoutes(time.Second, time.Minute, time.Hour)
	d.add("edge-a", 3)
	d.adopted(edgeRec("edge-a", 4, alive), t0, 0)
	require.Equal(t, []deadRoute{{edge: "edge-a", inc: 3}}, d.takeDue(t0.Add(time.Second), anyLive))
	d.done("edge-a", 3)
	require.Zero(t, d.len())
}

// TestDeadRoutes_NewerDeathSupersedes: a newer dead incarnation replaces an
// older pending one (its removal covers both), must be adopted afresh, and a
// removal of the older one finishing meanwhile leaves it pending.
func TestDeadRoutes_NewerDeathSupersedes(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	d := newDeadRoutes(time.Second, time.Minute, time.Hour)
	d.add("edge-a", 3)
	d.adopted(edgeRec("edge-a", 3, expired), t0, 0)
	require.Len(t, d.takeDue(t0.Add(time.Second), anyLive), 1)

	d.add("edge-a", 5) // inc 4 joined and left while the call for 3 was in flight
	d.done("edge-a", 3)
	require.Equal(t, 1, d.len())
	require.Empty(t, d.takeDue(t0.Add(time.Hour), anyLive), "inc 5 is not adopted yet")
	d.adopted(edgeRec("edge-a", 5, left), t0.Add(2*time.Second), 0)
	require.Equal(t, []deadRoute{{edge: "edge-a", inc: 5}}, d.takeDue(t0.Add(3*time.Second), anyLive))
	// A failure of the older call is not charged to the newer entry.
	require.Zero(t, d.failed("edge-a", 3, t0))
	require.Len(t, d.takeDue(t0.Add(3*time.Second), anyLive), 1)
}

// TestDeadRoutes_Backoff: failed calls are retried with doubling waits up to
// the cap.
func TestDeadRoutes_Backoff(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	d := newDeadRoutes(0, time.Minute, time.Hour)
	d.add("edge-a", 1)
	d.add("edge-b", 1)
	d.adopted(edgeRec("edge-a", 1, expired), t0, 0)
	d.adopted(edgeRec("edge-b", 1, expired), t0, 0)
	require.Equal(t, []deadRoute{{edge: "edge-a", inc: 1}, {edge: "edge-b", inc: 1}}, d.takeDue(t0, anyLive))

	now := t0
	want := removeBackoffMin
	for attempt := 1; attempt <= 10; attempt++ {
		wait := d.failed("edge-a", 1, now)
		require.Equal(t, min(want, removeBackoffMax), wait, "attempt %d", attempt)
		require.Equal(t, []deadRoute{{edge: "edge-b", inc: 1}}, d.takeDue(now.Add(wait-time.Millisecond), anyLive))
		now = now.Add(wait)
		require.Equal(t, []deadRoute{{edge: "edge-a", inc: 1, attempts: attempt}, {edge: "edge-b", inc: 1}}, d.takeDue(now, anyLive))
		want *= 2
	}
	d.done("edge-a", 1)
	d.done("edge-b", 1)
	require.Zero(t, d.len())
}

// TestLeaderTerm_ObserveDeadEdges: the FSM's member events make an edge
// pending for route removal when it expires or leaves, and when it rejoins
// under a new incarnation before the old one expired; other roles and a
// first join do not.
func TestLeaderTerm_ObserveDeadEdges(t *testing.T) {
	term := &leaderTerm{kick: make(chan struct{}, 1), dirty: map[string]uint64{}, incs: map[string]uint64{"known": 7},
		routes: newDeadRoutes(time.Second, time.Minute, time.Hour)}
	member := func(r *raftpb.MemberRecord) fsm.Event { return fsm.Event{Kind: fsm.EventMember, Member: r} }
	router := &raftpb.MemberRecord{MemberId: "r1", Role: raftpb.MemberRole_MEMBER_ROLE_ROUTER, Incarnation: 1, State: expired}

	term.observe(10, []fsm.Event{member(edgeRec("fresh", 1, alive)), member(router)})
	require.Zero(t, term.routes.len(), "a first join and a router leave nothing behind")
	require.Equal(t, map[string]uint64{"fresh": 10}, term.dirty)

	term.observe(11, []fsm.Event{member(edgeRec("fresh", 1, expired))})
	term.observe(12, []fsm.Event{member(edgeRec("known", 9, alive))})
	term.observe(13, []fsm.Event{member(edgeRec("gone", 4, left))})
	require.Equal(t, map[string]uint64{"fresh": 11, "known": 12, "gone": 13}, term.dirty)
	now := time.Unix(1_000_000, 0)
	term.routes.adopted(edgeRec("fresh", 1, expired), now, 0)
	term.routes.adopted(edgeRec("known", 9, alive), now, 0)
	term.routes.adopted(edgeRec("gone", 4, left), now, 0)
	require.Equal(t, []deadRoute{{edge: "fresh", inc: 1}, {edge: "gone", inc: 4}, {edge: "known", inc: 7}},
		term.routes.takeDue(now.Add(time.Second), anyLive))

	// The rejoin after an expiry: the expired incarnation is already pending.
	term.observe(14, []fsm.Event{member(edgeRec("fresh", 2, alive))})
	require.Equal(t, 3, term.routes.len())
	term.routes.done("fresh", 1)
	term.observe(15, []fsm.Event{member(edgeRec("fresh", 3, alive))})
	require.Equal(t, []deadRoute{{edge: "gone", inc: 4}, {edge: "known", inc: 7}}, term.routes.takeDue(now.Add(time.Second), anyLive))
	require.Equal(t, []deadRoute{{edge: "fresh", inc: 2}}, pendingOnly(term.routes, "fresh"),
		"a rejoin after the expired incarnation's removal makes the one in between pending")
}

// pendingOnly returns the entries of d not yet adopted, for edges.
func pendingOnly(d *deadRoutes, edges ...string) []deadRoute {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []deadRoute
	for _, e := range edges {
		if p := d.pending[e]; p != nil && !p.adopted {
			out = append(out, deadRoute{edge: e, inc: p.inc})
		}
	}
	return out
}

// anyLive takes every edge incarnation for a lease holder.
func anyLive(string, uint64) bool { return true }

// The routes of a dead edge wait, past the grace, until every live
// custodian given its sessions reported them adopted with its lease
// renewal; a custodian that died is not waited for, and the adoption wait
// bounds the rest.
func TestDeadRoutes_WaitForCustodiansToReportAdoption(t *testing.T) {
	t0 := time.Unix(1000, 0)
	d := newDeadRoutes(time.Second, time.Minute, time.Hour)
	d.add("edge-a", 3)
	d.assigned("edge-a", 3, "edge-b", 7, 100)
	d.assigned("edge-a", 3, "edge-c", 8, 101)
	d.assigned("edge-a", 3, "edge-b", 7, 104)
	d.adopted(&raftpb.MemberRecord{MemberId: "edge-a", Incarnation: 3, State: raftpb.MemberState_MEMBER_STATE_EXPIRED}, t0, 0)
	require.Empty(t, d.takeDue(t0.Add(time.Second), anyLive), "no custodian reported yet")
	d.reported("edge-b", 7, &coordinatorv1.CustodyProgress{AdoptedThrough: 101})
	d.reported("edge-c", 8, &coordinatorv1.CustodyProgress{AdoptedThrough: 101})
	require.Empty(t, d.takeDue(t0.Add(2*time.Second), anyLive), "edge-b reported only the first of its two batches")
	d.reported("edge-b", 6, &coordinatorv1.CustodyProgress{AdoptedThrough: 200}) // an older incarnation says nothing of incarnation 7
	require.Empty(t, d.takeDue(t0.Add(3*time.Second), anyLive))
	d.reported("edge-b", 7, &coordinatorv1.CustodyProgress{AdoptedThrough: 104})
	require.Equal(t, []deadRoute{{edge: "edge-a", inc: 3}}, d.takeDue(t0.Add(4*time.Second), anyLive))

	// A custodian whose lease is gone is not waited for once custody has
	// passed its own sessions on (here it had none left); until its death
	// is recorded here, it is.
	d = newDeadRoutes(time.Second, time.Minute, time.Hour)
	d.add("edge-a", 3)
	d.assigned("edge-a", 3, "edge-b", 7, 100)
	d.adopted(&raftpb.MemberRecord{MemberId: "edge-a", Incarnation: 3, State: raftpb.MemberState_MEMBER_STATE_EXPIRED}, t0, 0)
	require.Empty(t, d.takeDue(t0.Add(time.Second), anyLive))
	dead := func(id string, inc uint64) bool { return id != "edge-b" }
	require.Empty(t, d.takeDue(t0.Add(2*time.Second), dead), "edge-b's death not recorded yet")
	d.add("edge-b", 7)
	d.adopted(&raftpb.MemberRecord{MemberId: "edge-b", Incarnation: 7, State: raftpb.MemberState_MEMBER_STATE_EXPIRED}, t0.Add(2*time.Second), 0)
	require.Equal(t, []deadRoute{{edge: "edge-a", inc: 3}}, d.takeDue(t0.Add(2500*time.Millisecond), dead))

	// Past the adoption wait the routes go anyway, naming who did not report.
	d = newDeadRoutes(time.Second, time.Minute, time.Hour)
	d.add("edge-a", 3)
	d.assigned("edge-a", 3, "edge-b", 7, 100)
	d.adopted(&raftpb.MemberRecord{MemberId: "edge-a", Incarnation: 3, State: raftpb.MemberState_MEMBER_STATE_EXPIRED}, t0, 0)
	require.Empty(t, d.takeDue(t0.Add(time.Minute-time.Millisecond), anyLive))
	require.Equal(t, []deadRoute{{edge: "edge-a", inc: 3, unsettled: []string{"edge-b"}}}, d.takeDue(t0.Add(time.Minute), anyLive))

	// A custodian that never reports (an edge of an earlier version) is
	// waited for a lease TTL, then taken for one that does not report.
	d = newDeadRoutes(time.Second, time.Minute, 10*time.Second)
	d.add("edge-a", 3)
	d.assigned("edge-a", 3, "edge-b", 7, 100)
	d.adopted(&raftpb.MemberRecord{MemberId: "edge-a", Incarnation: 3, State: raftpb.MemberState_MEMBER_STATE_EXPIRED}, t0, 0)
	require.Empty(t, d.takeDue(t0.Add(5*time.Second), anyLive))
	require.Equal(t, []deadRoute{{edge: "edge-a", inc: 3}}, d.takeDue(t0.Add(10*time.Second), anyLive))

	// One that reported once, even nothing adopted, is known to report.
	d = newDeadRoutes(time.Second, time.Minute, 10*time.Second)
	d.add("edge-a", 3)
	d.assigned("edge-a", 3, "edge-b", 7, 100)
	d.reported("edge-b", 7, &coordinatorv1.CustodyProgress{AdoptedThrough: 0})
	d.adopted(&raftpb.MemberRecord{MemberId: "edge-a", Incarnation: 3, State: raftpb.MemberState_MEMBER_STATE_EXPIRED}, t0, 0)
	require.Empty(t, d.takeDue(t0.Add(20*time.Second), anyLive))
}

// A custodian that dies before adopting the sessions of a dead edge holds
// nothing that reaches them: the dead edge's routes are the only ones. They
// wait until custody has passed the custodian's sessions on, then for the
// new custodian to report them adopted, as they did for the first.
func TestDeadRoutes_CustodianDiesBeforeAdopting(t *testing.T) {
	t0 := time.Unix(1000, 0)
	d := newDeadRoutes(time.Second, time.Minute, time.Hour)
	d.add("edge-a", 3)
	d.assigned("edge-a", 3, "edge-b", 7, 100)
	d.adopted(&raftpb.MemberRecord{MemberId: "edge-a", Incarnation: 3, State: raftpb.MemberState_MEMBER_STATE_EXPIRED}, t0, 0)
	require.Empty(t, d.takeDue(t0.Add(time.Second), anyLive), "edge-b has not reported")

	// edge-b's lease expires: its death is recorded before its lease goes.
	d.add("edge-b", 7)
	d.forget("edge-b", 7)
	noB := func(id string, _ uint64) bool { return id != "edge-b" }
	require.Equal(t, []string{"edge-b"}, unsettledOf(d, "edge-a", t0.Add(2*time.Second), noB),
		"custody has not passed edge-b's sessions on")
	require.Empty(t, d.takeDue(t0.Add(2*time.Second), noB))

	// Custody moves them to edge-c; one came to edge-b from edge-a.
	d.assigned("edge-b", 7, "edge-c", 9, 120)
	d.assigned("edge-a", 3, "edge-c", 9, 120)
	d.assigned("edge-z", 1, "edge-c", 9, 120) // no removal pending for edge-z: nothing to wait on
	d.adopted(&raftpb.MemberRecord{MemberId: "edge-b", Incarnation: 7, State: raftpb.MemberState_MEMBER_STATE_EXPIRED}, t0.Add(3*time.Second), 0)
	require.Equal(t, []string{"edge-c"}, unsettledOf(d, "edge-a", t0.Add(4*time.Second), noB))
	d.reported("edge-c", 9, &coordinatorv1.CustodyProgress{AdoptedThrough: 120})
	due := d.takeDue(t0.Add(5*time.Second), noB)
	require.Equal(t, []deadRoute{{edge: "edge-a", inc: 3}, {edge: "edge-b", inc: 7}}, due)

	// A session that came from an older incarnation than the one pending
	// chains; one from a newer incarnation (it rejoined since) does not.
	d = newDeadRoutes(time.Second, time.Minute, time.Hour)
	d.add("edge-a", 3)
	d.assigned("edge-a", 4, "edge-c", 9, 120)
	require.Empty(t, d.pending["edge-a"].custodians)
	d.assigned("edge-a", 2, "edge-c", 9, 120)
	require.Equal(t, map[memberInc]uint64{{"edge-c", 9}: 120}, d.pending["edge-a"].custodians)
}

func unsettledOf(d *deadRoutes, edge string, now time.Time, live func(string, uint64) bool) []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.unsettledLocked(edge, d.pending[edge], now, live)
}

// The routes of a dead edge also wait until every live edge that reports
// its claims has reported them settled through the index custody found the
// edge dead at, without naming it as the source of a failed takeover: a
// session claimed from it whose takeover failed is held by nobody until
// its claimant adopts it, and the dead edge's routes are the only ones
// that reach it meanwhile. Edges that do not report claims, and claimants
// whose lease is gone, are not waited for; the adoption wait bounds it.
func TestDeadRoutes_WaitForClaimantsToSettle(t *testing.T) {
	t0 := time.Unix(1000, 0)
	dead := &raftpb.MemberRecord{MemberId: "edge-a", Incarnation: 3, State: raftpb.MemberState_MEMBER_STATE_EXPIRED}
	claims := func(through uint64, unfinished ...string) *coordinatorv1.CustodyProgress {
		return &coordinatorv1.CustodyProgress{ClaimsSettledThrough: through, UnfinishedFrom: unfinished}
	}
	d := newDeadRoutes(time.Second, time.Minute, time.Hour)
	d.add("edge-a", 3)
	d.reported("edge-b", 7, claims(90))
	d.reported("edge-c", 8, claims(95, "edge-a"))
	d.reported("edge-d", 9, &coordinatorv1.CustodyProgress{}) // reports no claims
	d.reported("edge-a", 3, claims(10))                       // the dead edge itself
	d.adopted(dead, t0, 100)
	require.Empty(t, d.takeDue(t0.Add(time.Second), anyLive), "nobody reported past the death")
	d.reported("edge-b", 7, claims(100))
	require.Empty(t, d.takeDue(t0.Add(2*time.Second), anyLive), "edge-c has not")
	d.reported("edge-c", 8, claims(120, "edge-a", "edge-x"))
	require.Empty(t, d.takeDue(t0.Add(3*time.Second), anyLive), "edge-c still holds a failed takeover from edge-a")
	d.reported("edge-c", 8, claims(130, "edge-x"))
	require.Equal(t, []deadRoute{{edge: "edge-a", inc: 3}}, d.takeDue(t0.Add(4*time.Second), anyLive))

	// A claimant whose lease is gone is not waited for; the bound holds.
	d = newDeadRoutes(time.Second, time.Minute, time.Hour)
	d.add("edge-a", 3)
	d.reported("edge-b", 7, claims(50))
	d.reported("edge-c", 8, claims(50))
	d.adopted(dead, t0, 100)
	noB := func(id string, _ uint64) bool { return id != "edge-b" }
	require.Empty(t, d.takeDue(t0.Add(time.Second), noB))
	require.Equal(t, []deadRoute{{edge: "edge-a", inc: 3, unsettled: []string{"edge-c"}}}, d.takeDue(t0.Add(time.Minute), noB))

	// A claimant's lease expiring forgets its report.
	d = newDeadRoutes(time.Second, time.Minute, time.Hour)
	d.add("edge-a", 3)
	d.reported("edge-b", 7, claims(50, "edge-a"))
	d.forget("edge-b", 7)
	d.adopted(dead, t0, 100)
	require.Equal(t, []deadRoute{{edge: "edge-a", inc: 3}}, d.takeDue(t0.Add(time.Second), anyLive))
}
