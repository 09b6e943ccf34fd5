package app

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/coordinator/internal/raftpb"

	"google.golang.org/protobuf/proto"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
)

func memberState(tn *testNode, id string) raftpb.MemberState {
	return tn.a().FSM().State().Member(id).GetState()
}

// TestCluster_LeaseExpiry checks that a member that stops renewing is declared
// dead only once its TTL has passed on the leader's clock, and that a leader
// change in between grants a full TTL again instead of expiring it early.
func TestCluster_LeaseExpiry(t *testing.T) {
	t.Parallel()
	const ttl = 1500 * time.Millisecond
	c := startCluster(t, 3, clusterOpts{fast: true, leaseTTL: ttl})
	l := c.waitLeader(5 * time.Second)

	stop1 := join(t, l.client(), "quiet", 1, ttl)
	stop2 := join(t, l.client(), "moved", 1, ttl)
	stop1()
	lastRenew := time.Now() // at most this late; the lease may have been renewed up to TTL/3 earlier
	stop2()

	// "quiet" expires on this leader after its TTL, never before.
	var expiredAt time.Time
	// The bounds of these waits are generous: a leader change on a loaded
	// machine (200 ms election timeouts) rightly grants a full TTL again.
	testutil.Eventually(t, 10*ttl, func() error {
		if memberState(l, "quiet") != raftpb.MemberState_MEMBER_STATE_EXPIRED {
			return errors.New("not expired yet")
		}
		expiredAt = time.Now()
		return nil
	})
	require.GreaterOrEqual(t, expiredAt.Sub(lastRenew), ttl-ttl/3, "expired before its TTL")

	// Now rejoin "moved" with a fresh lease, move leadership at 2/3 of its
	// TTL and check the new leader gives it a full TTL from its own start.
	join(t, l.client(), "moved", 2, ttl)()
	renewed := time.Now()
	time.Sleep(ttl * 2 / 3)
	// The new leader starts its full TTL when it takes over, which is after
	// the transfer began: measure from there (not from when the call
	// returned, which may come after the new leader's start).
	transferred := time.Now()
	require.NoError(t, l.a().Node().Raft().LeadershipTransfer().Error())
	nl := c.waitLeader(5 * time.Second)
	require.NotEqual(t, l.id, nl.id)
	testutil.Eventually(t, 10*ttl, func() error {
		if nl.a().FSM().State().Member("moved").GetIncarnation() == 2 && memberState(nl, "moved") == raftpb.MemberState_MEMBER_STATE_EXPIRED {
			expiredAt = time.Now()
			return nil
		}
		return errors.New("not expired yet")
	})
	require.GreaterOrEqual(t, expiredAt.Sub(transferred), ttl, "new leader expired the lease early (renewed %v before transfer)", transferred.Sub(renewed))

	// An expired incarnation cannot renew; it must rejoin with a higher one.
	_, err := nl.client().RenewLease(t.Context(), connect.NewRequest(&coordinatorv1.RenewLeaseRequest{MemberId: "quiet",
		Role: coordinatorv1.MemberRole_MEMBER_ROLE_EDGE, Incarnation: 1, State: coordinatorv1.MemberState_MEMBER_STATE_ALIVE}))
	require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err))
}

// TestCluster_Custody lets an edge owning many sessions die and checks that
// every one of its sessions is reassigned exactly once, with a new epoch, to
// the live edges, and that each custodian hears of its own sessions on its
// WatchCluster stream.
func TestCluster_Custody(t *testing.T) {
	t.Parallel()
	const ttl = time.Second
	c := startCluster(t, 3, clusterOpts{fast: true, leaseTTL: ttl})
	l := c.waitLeader(5 * time.Second)
	stopDead := join(t, l.client(), "dead", 1, ttl)
	join(t, c.nodes[0].client(), "live-a", 1, ttl)
	join(t, c.nodes[1].client(), "live-b", 1, ttl)

	const n = 600
	old := map[string]uint64{}
	for start := 0; start < n; start += 200 {
		req := &coordinatorv1.ClaimSessionsRequest{EdgeId: "dead", Incarnation: 1}
		for i := start; i < start+200; i++ {
			req.Claims = append(req.Claims, &coordinatorv1.SessionClaim{Session: sk("acme", fmt.Sprintf("s%d", i))})
		}
		resp, err := retry(t.Context(), 5*time.Second, func(ctx context.Context) (*connect.Response[coordinatorv1.ClaimSessionsResponse], error) {
			return c.nodes[2].client().ClaimSessions(ctx, connect.NewRequest(req))
		})
		require.NoError(t, err)
		for _, r := range resp.Msg.GetResults() {
			require.NotNil(t, r.GetGrant(), r.GetError().GetMessage())
			old[r.GetGrant().GetSession().GetClientId()] = r.GetGrant().GetEpoch()
		}
	}

	// Each custodian watches from the current index.
	var mu sync.Mutex
	seen := map[string]int{}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var wg sync.WaitGroup
	for i, edge := range []string{"live-a", "live-b"} {
		stream, err := c.nodes[i].client().WatchCluster(ctx, connect.NewRequest(&coordinatorv1.WatchClusterRequest{
			MemberId: edge, Role: coordinatorv1.MemberRole_MEMBER_ROLE_EDGE, Incarnation: 1}))
		require.NoError(t, err)
		require.True(t, stream.Receive(), "snapshot first")
		require.NotNil(t, stream.Msg().GetSnapshot())
		wg.Add(1)
		go func() {
			defer wg.Done()
			for stream.Receive() {
				if cu := stream.Msg().GetCustody(); cu != nil {
					mu.Lock()
					if cu.GetToEdgeId() != edge {
						seen["wrong custodian "+cu.GetToEdgeId()]++
					}
					for _, s := range cu.GetSessions() {
						seen[s.GetSession().GetClientId()]++
					}
					mu.Unlock()
				}
			}
		}()
	}

	stopDead()
	testutil.Eventually(t, 10*time.Second, func() error {
		mu.Lock()
		defer mu.Unlock()
		if len(seen) != n {
			return fmt.Errorf("custodians heard of %d sessions", len(seen))
		}
		return nil
	})
	cancel()
	wg.Wait()
	st := c.waitLeader(5 * time.Second).a().FSM().State()
	owners := map[string]int{}
	for id, ep := range old {
		require.Equal(t, 1, seen[id], "%s reassigned once", id)
		rec := st.Session("acme", id)
		require.Greater(t, rec.GetEpoch(), ep)
		require.Equal(t, raftpb.OwnerKind_OWNER_KIND_CUSTODY, rec.GetOwnerKind())
		owners[rec.GetOwnerEdgeId()]++
	}
	require.Len(t, owners, 2, "rendezvous hashing spreads sessions over both live edges: %v", owners)
	require.Zero(t, owners["dead"])
}

// TestCluster_ConditionalClaim: a claim that names the owner it expects
// (SessionClaim.expected_owner) is granted only while that edge owns the
// session, and otherwise answered CLAIM_ERROR_CODE_OWNER_CHANGED with nothing
// changed, through any node.
func TestCluster_ConditionalClaim(t *testing.T) {
	t.Parallel()
	c := startCluster(t, 3, clusterOpts{fast: true})
	l := c.waitLeader(5 * time.Second)
	for _, e := range []string{"drain", "custodian", "other"} {
		join(t, l.client(), e, 1, 2*time.Second)
	}
	claimAs := func(edge, owner string) *coordinatorv1.ClaimResult {
		t.Helper()
		req := &coordinatorv1.ClaimSessionsRequest{EdgeId: edge, Incarnation: 1, Claims: []*coordinatorv1.SessionClaim{
			{RequestId: fmt.Sprintf("%s-%d", edge, time.Now().UnixNano()), Session: sk("acme", "moving"), ExpectedOwner: owner}}}
		resp, err := retry(t.Context(), 5*time.Second, func(ctx context.Context) (*connect.Response[coordinatorv1.ClaimSessionsResponse], error) {
			return c.nodes[1].client().ClaimSessions(ctx, connect.NewRequest(req))
		})
		require.NoError(t, err)
		return resp.Msg.GetResults()[0]
	}
	require.NotNil(t, claimAs("drain", "").GetGrant())
	require.NotNil(t, claimAs("other", "").GetGrant(), "the client moved on before the handover")
	r := claimAs("custodian", "drain")
	require.Equal(t, coordinatorv1.ClaimErrorCode_CLAIM_ERROR_CODE_OWNER_CHANGED, r.GetError().GetCode(), "%v", r)
	require.Equal(t, "other", getSession(t, l.client(), "acme", "moving").GetOwnerEdgeId())
	g := claimAs("custodian", "other").GetGrant()
	require.NotNil(t, g)
	require.Equal(t, "other", g.GetPrevious().GetOwnerEdgeId())

	// A claim retried under its request ID after another edge claimed the
	// session (its first answer was lost) is superseded, not granted again:
	// through ClaimSessions an error code, through ClaimSession Aborted.
	replay := &coordinatorv1.ClaimSessionsRequest{EdgeId: "drain", Incarnation: 1,
		Claims: []*coordinatorv1.SessionClaim{{RequestId: "drain-replayed", Session: sk("acme", "replayed")}}}
	for i, edge := range []string{"drain", "other", "drain"} {
		req := proto.Clone(replay).(*coordinatorv1.ClaimSessionsRequest)
		req.EdgeId = edge
		resp, err := retry(t.Context(), 5*time.Second, func(ctx context.Context) (*connect.Response[coordinatorv1.ClaimSessionsResponse], error) {
			return c.nodes[i].client().ClaimSessions(ctx, connect.NewRequest(req))
		})
		require.NoError(t, err)
		if r := resp.Msg.GetResults()[0]; i < 2 {
			require.NotNil(t, r.GetGrant(), "%v", r)
		} else {
			require.Equal(t, coordinatorv1.ClaimErrorCode_CLAIM_ERROR_CODE_SUPERSEDED, r.GetError().GetCode(), "%v", r)
		}
	}
	require.Equal(t, "other", getSession(t, l.client(), "acme", "replayed").GetOwnerEdgeId())
	one := &coordinatorv1.ClaimSessionRequest{RequestId: "drain-replayed-one", Session: sk("acme", "replayed-one"), EdgeId: "drain", Incarnation: 1}
	_, err := l.client().ClaimSession(t.Context(), connect.NewRequest(one))
	require.NoError(t, err)
	_, err = l.client().ClaimSession(t.Context(), connect.NewRequest(&coordinatorv1.ClaimSessionRequest{RequestId: "x",
		Session: sk("acme", "replayed-one"), EdgeId: "other", Incarnation: 1}))
	require.NoError(t, err)
	_, err = l.client().ClaimSession(t.Context(), connect.NewRequest(one))
	require.Equal(t, connect.CodeAborted, connect.CodeOf(err), "%v", err)
}
