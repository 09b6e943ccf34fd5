package app

import (
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/coordinator/internal/raftpb"
)

const (
	removalsMetric = "keel_coordinator_dead_edge_route_removals_total"
	pendingMetric  = "keel_coordinator_dead_edge_routes_pending"
)

// removals sums the successful RemoveEdge calls of every running node.
func (c *cluster) removals(t *testing.T) float64 {
	var n float64
	for _, tn := range c.nodes {
		if tn.running() {
			n += counter(t, tn.a().reg, removalsMetric, "ok")
		}
	}
	return n
}

// waitGone polls the router until edge no longer routes (tenant, topic) and
// returns when that was first seen.
func waitGone(t *testing.T, r *routerProc, edge, tenant, topic string, within time.Duration) time.Time {
	t.Helper()
	var goneAt time.Time
	testutil.Eventually(t, within, func() error {
		edges, err := r.lookup(t.Context(), tenant, topic)
		if err != nil {
			return err
		}
		if slices.Contains(edges, edge) {
			return fmt.Errorf("%s still routed: %v", edge, edges)
		}
		goneAt = time.Now()
		return nil
	})
	return goneAt
}

// custodyTime returns when the leader reassigned the session to a custodian
// (on its clock, which is this process's), failing if it was not reassigned
// away from the dead incarnation.
func custodyTime(t *testing.T, l *testNode, edge string, inc uint64, tenant, client string) time.Time {
	t.Helper()
	rec := l.a().FSM().State().Session(tenant, client)
	require.NotNil(t, rec)
	require.Equal(t, raftpb.OwnerKind_OWNER_KIND_CUSTODY, rec.GetOwnerKind())
	require.False(t, rec.GetOwnerEdgeId() == edge && rec.GetOwnerIncarnation() == inc, "still owned by the dead incarnation")
	return time.Unix(0, rec.GetGrantedAtUnixNano())
}

// TestCluster_DeadEdgeRoutesRemoved: an edge whose lease expires loses its
// routes in the real router once its session was adopted and the grace has
// passed, never earlier; an edge that keeps renewing keeps its routes.
func TestCluster_DeadEdgeRoutesRemoved(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a router process")
	}
	t.Parallel()
	const ttl, grace = time.Second, time.Second
	r := startRouter(t)
	c := startCluster(t, 3, clusterOpts{fast: true, leaseTTL: ttl, routerURL: r.url, routeGrace: grace})
	l := c.waitLeader(5 * time.Second)
	stopA := join(t, l.client(), "edge-a", 1, ttl)
	join(t, l.client(), "edge-b", 1, ttl)
	// edge-a owns a session, so its routes must wait for the custodian.
	_, err := claimOne(t.Context(), l.client(), "edge-a", 1, "t1", "c1", "req-1")
	require.NoError(t, err)

	a, stopRoutesA := edgeRoutes(t, r, "edge-a", 1)
	b, _ := edgeRoutes(t, r, "edge-b", 1)
	subscribe(t, a, "t1", "a/b", "+/x")
	subscribe(t, b, "t1", "a/b", "b/#")
	// edge-a's process dies: its stream ends, its routes stay.
	stopRoutesA()
	require.Equal(t, []string{"edge-a", "edge-b"}, r.mustLookup(t, "t1", "a/b"))
	require.Equal(t, []string{"edge-a"}, r.mustLookup(t, "t1", "q/x"))
	require.Zero(t, c.removals(t))

	stopA()
	goneAt := waitGone(t, r, "edge-a", "t1", "a/b", 10*ttl+grace+10*time.Second)
	l = c.waitLeader(5 * time.Second)
	require.Equal(t, raftpb.MemberState_MEMBER_STATE_EXPIRED, memberState(l, "edge-a"))
	adopted := custodyTime(t, l, "edge-a", 1, "t1", "c1")
	require.GreaterOrEqual(t, goneAt.Sub(adopted), grace, "routes removed before the custodian's grace ran out")

	require.Empty(t, r.mustLookup(t, "t1", "q/x"), "the wildcard-first route went too")
	require.Equal(t, []string{"edge-b"}, r.mustLookup(t, "t1", "a/b"))
	require.Equal(t, []string{"edge-b"}, r.mustLookup(t, "t1", "b/c"))
	// The router hides the routes before it deletes them and answers.
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := c.removals(t); n < 1 {
			return fmt.Errorf("%v successful removals counted", n)
		}
		if p := gauge(t, c.waitLeader(5*time.Second).a().reg, pendingMetric); p != 0 {
			return fmt.Errorf("%v removals pending", p)
		}
		return nil
	})
	require.Equal(t, 2.0, r.metric(t, `keel_router_route_changes_total{kind="anchored",op="remove"}`)+
		r.metric(t, `keel_router_route_changes_total{kind="wildcard",op="remove"}`), "exactly edge-a's two routes were removed")

	// Long after, the live edge still holds its routes.
	time.Sleep(2 * ttl)
	require.Equal(t, raftpb.MemberState_MEMBER_STATE_ALIVE, memberState(c.waitLeader(5*time.Second), "edge-b"))
	require.Equal(t, []string{"edge-b"}, r.mustLookup(t, "t1", "a/b"))
	require.Equal(t, []string{"edge-b"}, r.mustLookup(t, "t1", "b/c"))
}

// TestCluster_DeadEdgeRoutesWaitForCustodyReport: a dead edge's routes stay
// past the grace while its custodian has not reported the adopted session
// done (its routes registered), and go once it reports it.
func TestCluster_DeadEdgeRoutesWaitForCustodyReport(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a router process")
	}
	t.Parallel()
	var through atomic.Uint64
	e := startRoutedEdge(t, func(l *testNode) { joinReporting(t, l.client(), "edge-b", 1, deadTTL, through.Load) })
	r := e.r

	e.stopA()
	epoch := e.ownedBy("edge-b")
	// Well past the grace: edge-b has not reported c1 adopted.
	time.Sleep(deadGrace + 2*deadTTL)
	require.Equal(t, []string{"edge-a"}, r.mustLookup(t, "t1", "a/b"), "routes removed before the custodian reported")
	through.Store(epoch - 1)
	time.Sleep(deadTTL)
	require.Equal(t, []string{"edge-a"}, r.mustLookup(t, "t1", "a/b"), "an epoch below c1's is not c1")

	reported := time.Now()
	through.Store(epoch)
	waitGone(t, r, "edge-a", "t1", "a/b", 10*time.Second)
	t.Logf("routes removed %v after the custodian reported", time.Since(reported).Round(time.Millisecond))
	for _, tn := range e.c.nodes {
		if tn.running() {
			require.Zero(t, counter(t, tn.a().reg, removalsMetric, "unconfirmed"))
		}
	}
}

const deadTTL, deadGrace = time.Second, 500 * time.Millisecond

// routedEdge is a router and a 3-node cluster with a fast lease TTL, in
// which edge-a holds session t1/c1 and routes a/b to itself.
type routedEdge struct {
	t     *testing.T
	r     *routerProc
	c     *cluster
	stopA func() // edge-a stops renewing its lease
}

// startRoutedEdge starts a routedEdge; others joins the other edges, once
// the cluster has a leader and before edge-a claims c1.
func startRoutedEdge(t *testing.T, others func(l *testNode)) *routedEdge {
	t.Helper()
	r := startRouter(t)
	c := startCluster(t, 3, clusterOpts{fast: true, leaseTTL: deadTTL, routerURL: r.url, routeGrace: deadGrace, adoptionWait: time.Minute})
	l := c.waitLeader(5 * time.Second)
	stopA := join(t, l.client(), "edge-a", 1, deadTTL)
	others(l)
	_, err := claimOne(t.Context(), l.client(), "edge-a", 1, "t1", "c1", "req-1")
	require.NoError(t, err)
	a, stopRoutesA := edgeRoutes(t, r, "edge-a", 1)
	subscribe(t, a, "t1", "a/b")
	stopRoutesA()
	return &routedEdge{t: t, r: r, c: c, stopA: stopA}
}

// ownedBy waits until edge owns c1, and returns the session's epoch.
func (e *routedEdge) ownedBy(edge string) (epoch uint64) {
	e.t.Helper()
	testutil.Eventually(e.t, 10*deadTTL, func() error {
		rec := e.c.waitLeader(5*time.Second).a().FSM().State().Session("t1", "c1")
		if rec.GetOwnerEdgeId() != edge {
			return fmt.Errorf("c1 owned by %s", rec.GetOwnerEdgeId())
		}
		epoch = rec.GetEpoch()
		return nil
	})
	return epoch
}

// TestCluster_DeadEdgeRoutesFollowCustodyOn: the custodian of a dead
// edge's session dies before it reports the session adopted, so nothing
// but the dead edge's routes reaches the session. They stay while custody
// passes the custodian's sessions to another edge, and until that edge
// reports the session adopted.
func TestCluster_DeadEdgeRoutesFollowCustodyOn(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a router process")
	}
	t.Parallel()
	var stopB func()
	e := startRoutedEdge(t, func(l *testNode) {
		stopB = joinReporting(t, l.client(), "edge-b", 1, deadTTL, func() uint64 { return 0 })
	})
	e.stopA()
	e.ownedBy("edge-b")
	// edge-c joins; edge-b dies without having adopted c1.
	var through atomic.Uint64
	joinReporting(t, e.c.waitLeader(5*time.Second).client(), "edge-c", 1, deadTTL, through.Load)
	stopB()
	epoch := e.ownedBy("edge-c")
	time.Sleep(deadGrace + 2*deadTTL)
	require.Equal(t, []string{"edge-a"}, e.r.mustLookup(t, "t1", "a/b"),
		"edge-a's routes removed while c1's custodian had not reported it adopted")

	reported := time.Now()
	through.Store(epoch)
	waitGone(t, e.r, "edge-a", "t1", "a/b", 10*time.Second)
	t.Logf("routes removed %v after the second custodian reported", time.Since(reported).Round(time.Millisecond))
}

// TestCluster_DeadEdgeRoutesRejoin: an edge that rejoins under a new
// incarnation before the old one's lease ran out leaves no EXPIRED record of
// the old one; the leader still removes the old incarnation's routes, after
// custody of its sessions (by the other edge: the FSM never moves a session
// to its own edge), and never the new incarnation's.
func TestCluster_DeadEdgeRoutesRejoin(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a router process")
	}
	t.Parallel()
	// The lease outlasts the rejoin by far: incarnation 1 must not expire
	// between its last renewal and the join of incarnation 2, however
	// loaded the machine.
	const ttl, grace = 5 * time.Second, 500 * time.Millisecond
	r := startRouter(t)
	c := startCluster(t, 3, clusterOpts{fast: true, leaseTTL: ttl, routerURL: r.url, routeGrace: grace})
	l := c.waitLeader(5 * time.Second)
	stopA1 := join(t, l.client(), "edge-a", 1, ttl)
	join(t, l.client(), "edge-b", 1, ttl)
	// Enough sessions that rendezvous hashing over the live edges would pick
	// the rejoined edge-a itself for some, which the FSM refuses.
	const sessions = 20
	for i := range sessions {
		_, err := claimOne(t.Context(), l.client(), "edge-a", 1, "t1", fmt.Sprintf("c%d", i), fmt.Sprintf("req-%d", i))
		require.NoError(t, err)
	}
	a1, stopRoutesA1 := edgeRoutes(t, r, "edge-a", 1)
	b, _ := edgeRoutes(t, r, "edge-b", 1)
	subscribe(t, a1, "t1", "a/b", "old/x")
	subscribe(t, b, "t1", "a/b")
	stopRoutesA1()

	// edge-a fenced itself and comes back as incarnation 2 at once. Its
	// route set reaches the router first here, so that the removal of
	// incarnation 1, whenever it comes, meets a/b held by incarnation 2.
	a2, _ := edgeRoutes(t, r, "edge-a", 2)
	subscribe(t, a2, "t1", "a/b")
	stopA1()
	join(t, l.client(), "edge-a", 2, ttl)
	require.Equal(t, uint64(2), l.a().FSM().State().Member("edge-a").GetIncarnation())

	// The router hides incarnation 1 at once (the new stream's hello); the
	// coordinator's removal is what deletes its stored route.
	const removed = `keel_router_route_changes_total{kind="anchored",op="remove"}`
	var removedAt time.Time
	testutil.Eventually(t, 15*time.Second, func() error {
		if n := r.metric(t, removed); n < 1 {
			return fmt.Errorf("%v anchored routes removed", n)
		}
		removedAt = time.Now()
		return nil
	})
	l = c.waitLeader(5 * time.Second)
	for i := range sessions {
		adopted := custodyTime(t, l, "edge-a", 1, "t1", fmt.Sprintf("c%d", i))
		require.GreaterOrEqual(t, removedAt.Sub(adopted), grace, "routes removed before the custodian's grace ran out")
	}
	testutil.Eventually(t, 5*time.Second, func() error {
		if n := c.removals(t); n < 1 {
			return errors.New("no removal counted")
		}
		return nil
	})
	require.Equal(t, 1.0, r.metric(t, removed), "only old/x of incarnation 1 was removed")
	require.Equal(t, []string{"edge-a", "edge-b"}, r.mustLookup(t, "t1", "a/b"), "incarnation 2 keeps its route")
	require.Empty(t, r.mustLookup(t, "t1", "old/x"))
	require.Equal(t, raftpb.MemberState_MEMBER_STATE_ALIVE, memberState(l, "edge-a"))
	for _, tn := range c.nodes {
		require.Zero(t, counter(t, tn.a().reg, "keel_coordinator_leases_expired_total", ""), "incarnation 1 was never recorded EXPIRED")
	}
}

// TestCluster_DeadEdgeRoutesNewLeader: the leader that saw an edge expire
// dies before the grace ran out; the next leader finds the expired edge in
// the FSM and removes its routes.
func TestCluster_DeadEdgeRoutesNewLeader(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a router process")
	}
	t.Parallel()
	const ttl, grace = time.Second, 3 * time.Second
	r := startRouter(t)
	c := startCluster(t, 3, clusterOpts{fast: true, leaseTTL: ttl, routerURL: r.url, routeGrace: grace})
	l := c.waitLeader(5 * time.Second)
	var other *testNode
	for _, tn := range c.nodes {
		if tn != l {
			other = tn
			break
		}
	}
	stopA := join(t, l.client(), "edge-a", 1, ttl)
	// edge-b renews through a node that survives the leader's death.
	join(t, other.client(), "edge-b", 1, ttl)
	a, stopRoutesA := edgeRoutes(t, r, "edge-a", 1)
	b, _ := edgeRoutes(t, r, "edge-b", 1)
	subscribe(t, a, "t1", "a/b")
	subscribe(t, b, "t1", "a/b")
	stopRoutesA()
	require.Equal(t, []string{"edge-a", "edge-b"}, r.mustLookup(t, "t1", "a/b"))

	stopA()
	testutil.Eventually(t, 10*ttl, func() error {
		if memberState(l, "edge-a") != raftpb.MemberState_MEMBER_STATE_EXPIRED {
			return errors.New("edge-a not expired yet")
		}
		return nil
	})
	// Within the grace the routes are still there; the leader dies with the
	// removal only planned (stopping takes seconds, so look before).
	require.Equal(t, []string{"edge-a", "edge-b"}, r.mustLookup(t, "t1", "a/b"))
	l.kill()
	require.Zero(t, counter(t, l.a().reg, removalsMetric, "ok"), "the old leader removed the routes before it died; the grace is too short for this machine")

	waitGone(t, r, "edge-a", "t1", "a/b", grace+20*time.Second)
	nl := c.waitLeader(10 * time.Second)
	require.NotEqual(t, l.id, nl.id)
	// The router hides the routes before it deletes them and answers.
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := c.removals(t); n < 1 {
			return errors.New("no removal counted")
		}
		return nil
	})
	require.Equal(t, []string{"edge-b"}, r.mustLookup(t, "t1", "a/b"))
}
