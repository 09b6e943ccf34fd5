package server

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/keelmq/keel/libs/logging"
	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
	"github.com/keelmq/keel/proto/gen/keel/router/v1/routerv1connect"
)

// fakePeer is another router node's API as far as Notify goes: it refuses
// calls while down and records the anchors of those it took, in order.
type fakePeer struct {
	routerv1connect.RouterServiceClient

	mu   sync.Mutex
	down bool
	code connect.Code // refusal code while down
	got  []string
}

func (p *fakePeer) Notify(_ context.Context, req *connect.Request[routerv1.NotifyRequest]) (*connect.Response[routerv1.NotifyResponse], error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.down {
		return nil, connect.NewError(p.code, errors.New("peer down"))
	}
	p.got = append(p.got, req.Msg.GetInvalidation().GetNewAnchors()...)
	return connect.NewResponse(&routerv1.NotifyResponse{}), nil
}

func (p *fakePeer) set(down bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = down
}

func (p *fakePeer) received() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.got)
}

// newPeeredNode returns a node over a memStore whose membership also holds
// "peer-1", reached through the returned fake.
func newPeeredNode(t *testing.T) (*Node, *fakePeer) {
	t.Helper()
	n, err := New(Config{AdvertiseURL: "http://127.0.0.1:1", Heartbeat: 20 * time.Millisecond, CacheLease: 200 * time.Millisecond,
		LeaseGrace: 50 * time.Millisecond}, newMemStore(), nil, logging.Discard())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.stopLife)
	p := &fakePeer{code: connect.CodeUnavailable}
	n.members = []string{"mem-0", "peer-1"}
	n.peers["peer-1"] = p
	return n, p
}

func newAnchor(a string) *routerv1.NotifyRequest {
	return &routerv1.NotifyRequest{SenderNodeId: "mem-0", Invalidation: &routerv1.RouteInvalidation{Tenant: "t1", Anchors: []string{a}, NewAnchors: []string{a}}}
}

func eventually(t *testing.T, d time.Duration, f func() error) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A peer that misses a notification for longer than the lease gets it once
// it answers again, in the order the notifications were sent, the later
// ones included; the sender waits out the lease for each, no longer.
func TestNotify_UndeliveredQueuedInOrder(t *testing.T) {
	n, p := newPeeredNode(t)
	ctx := t.Context()
	lease := n.cfg.CacheLease + n.cfg.LeaseGrace

	p.set(true)
	for _, a := range []string{"a1", "a2"} {
		start := time.Now()
		n.notifyAll(ctx, newAnchor(a))
		if d := time.Since(start); d < lease-10*time.Millisecond || d > lease+500*time.Millisecond {
			t.Fatalf("notify %s returned after %v, want about the lease (%v)", a, d, lease)
		}
	}
	if q := n.NotifyBacklog(); q != 2 {
		t.Fatalf("backlog %d, want 2", q)
	}
	p.set(false)
	// Sent while the backlog drains: after it, not before.
	n.notifyAll(ctx, newAnchor("a3"))
	eventually(t, 5*time.Second, func() error {
		if q := n.NotifyBacklog(); q != 0 {
			return fmt.Errorf("backlog %d", q)
		}
		return nil
	})
	if got, want := p.received(), []string{"a1", "a2", "a3"}; !slices.Equal(got, want) {
		t.Fatalf("peer got %v, want %v", got, want)
	}
	// Its own state has all of them (the node notified itself at once).
	for _, a := range []string{"a1", "a2", "a3"} {
		if _, ok := n.blooms["t1"].anchors[a]; !ok {
			t.Fatalf("own Bloom state lacks %s", a)
		}
	}
}

// A short outage within the lease is retried, not queued.
func TestNotify_RetriedWithinLease(t *testing.T) {
	n, p := newPeeredNode(t)
	p.set(true)
	time.AfterFunc(60*time.Millisecond, func() { p.set(false) })
	start := time.Now()
	n.notifyAll(t.Context(), newAnchor("a1"))
	if d := time.Since(start); d >= n.cfg.CacheLease {
		t.Fatalf("notify returned after %v: not retried", d)
	}
	if q := n.NotifyBacklog(); q != 0 {
		t.Fatalf("backlog %d", q)
	}
	if got := p.received(); !slices.Equal(got, []string{"a1"}) {
		t.Fatalf("peer got %v", got)
	}
}

// A peer that leaves the membership is no longer owed anything (it reloads
// its replicas when it comes back); a refusal of the request itself is not
// retried.
func TestNotify_BacklogDroppedWhenPeerLeaves(t *testing.T) {
	n, p := newPeeredNode(t)
	p.set(true)
	n.notifyAll(t.Context(), newAnchor("a1"))
	if q := n.NotifyBacklog(); q != 1 {
		t.Fatalf("backlog %d, want 1", q)
	}
	n.mu.Lock()
	n.members = []string{"mem-0"}
	n.mu.Unlock()
	eventually(t, 5*time.Second, func() error {
		n.mu.Lock()
		defer n.mu.Unlock()
		if len(n.outbox) > 0 {
			return errors.New("outbox still there")
		}
		return nil
	})

	n.mu.Lock()
	n.members = []string{"mem-0", "peer-1"}
	n.mu.Unlock()
	p.mu.Lock()
	p.code = connect.CodeInvalidArgument
	p.mu.Unlock()
	start := time.Now()
	n.notifyAll(t.Context(), newAnchor("a2"))
	if d := time.Since(start); d >= n.cfg.CacheLease {
		t.Fatalf("refused notification retried for %v", d)
	}
	if q := n.NotifyBacklog(); q != 0 {
		t.Fatalf("refused notification queued: backlog %d", q)
	}
}

// TestNode_RefusesBeforeLoaded: until the node loaded its replicas, an edge
// stream would be sent an empty wildcard table and no Bloom filters, marked
// ready, and a Lookup would leave out wildcard-first routes: both are
// refused with Unavailable, and the callers retry.
func TestNode_RefusesBeforeLoaded(t *testing.T) {
	n, _ := newMemNode(t)
	n.loaded.Store(false)
	_, err := n.lookup(t.Context(), &routerv1.LookupRequest{Tenant: "t1", Topic: "a/b"})
	if !errors.Is(err, ErrLoading) || connect.CodeOf(connectError(err)) != connect.CodeUnavailable {
		t.Fatalf("lookup before loaded: %v, want Unavailable (%v)", err, ErrLoading)
	}
	n.loaded.Store(true)
	if _, err = n.lookup(t.Context(), &routerv1.LookupRequest{Tenant: "t1", Topic: "a/b"}); err != nil {
		t.Fatal(err)
	}
}

// TestNotify_LateWildcardChangesAreIgnored: a wildcard-first route key's
// owner changes with the membership, so the old owner's notification can
// reach a node after the new owner's. A replica keeps, per (route, edge),
// the latest change by the edge's (incarnation, seq): a late remove must
// not drop an acknowledged add (a loss), and a late add must not bring
// back a removed route. Lookups read the replica.
func TestNotify_LateWildcardChangesAreIgnored(t *testing.T) {
	n, _ := newMemNode(t)
	ctx := t.Context()
	wild := func(op routerv1.RouteOp, inc, seq uint64) {
		t.Helper()
		_, err := n.Notify(ctx, connect.NewRequest(&routerv1.NotifyRequest{SenderNodeId: "mem-0", Wildcard: &routerv1.WildcardDeltas{
			Deltas: []*routerv1.WildcardDelta{{Route: &routerv1.Route{Tenant: "t1", Filter: "+/kw"}, EdgeId: "edge-a", Op: op, Incarnation: inc, Seq: seq}}}}))
		if err != nil {
			t.Fatal(err)
		}
	}
	dead := func(inc uint64) {
		t.Helper()
		_, err := n.Notify(ctx, connect.NewRequest(&routerv1.NotifyRequest{SenderNodeId: "mem-0", Invalidation: &routerv1.RouteInvalidation{
			Tenant: "t1", DeadEdges: []*routerv1.DeadEdge{{EdgeId: "edge-a", Incarnation: inc}}}}))
		if err != nil {
			t.Fatal(err)
		}
	}
	routed := func(step string, want bool) {
		t.Helper()
		l, err := n.lookup(ctx, &routerv1.LookupRequest{Tenant: "t1", Topic: "x/kw"})
		if err != nil {
			t.Fatal(err)
		}
		if got := slices.Contains(l.GetEdgeIds(), "edge-a"); got != want {
			t.Fatalf("%s: routed to edge-a %v, want %v", step, got, want)
		}
	}
	add, remove := routerv1.RouteOp_ROUTE_OP_ADD, routerv1.RouteOp_ROUTE_OP_REMOVE
	wild(add, 1, 5)
	routed("add 5", true)
	wild(remove, 1, 4)
	routed("late remove 4 after add 5", true)
	wild(add, 1, 5)
	routed("add 5 again (a retried notification)", true)
	wild(remove, 1, 6)
	routed("remove 6", false)
	wild(add, 1, 5)
	routed("late add 5 after remove 6", false)
	wild(add, 1, 7)
	routed("add 7", true)
	// A re-sent route set (seq 7) that lacks the route removes it at 8; the
	// edge's next change is an add at seq 8, which is not older.
	wild(remove, 1, 8)
	routed("route set at 7 without it", false)
	wild(add, 1, 8)
	routed("add 8", true)
	wild(remove, 1, 8)
	routed("the route set's remove, late", true)
	dead(1)
	routed("incarnation 1 dead", false)
	wild(add, 1, 9)
	routed("late add of the dead incarnation", false)
	wild(add, 2, 1)
	routed("incarnation 2 adds", true)
	wild(remove, 1, 10)
	routed("a remove of incarnation 1", true)
	// A sender without seqs (seq 0): the latest notification wins, as
	// before, and the seq known stays.
	wild(remove, 2, 0)
	routed("remove without seq", false)
	wild(add, 2, 0)
	routed("add without seq", true)
	wild(add, 2, 5)
	wild(add, 2, 0)
	wild(remove, 2, 3)
	routed("late remove 3 after add 5 and a re-notified add without seq", true)
	// An older router removes what a re-sent route set lacks at max uint64:
	// the incarnation is not dead, and its next add holds.
	wild(remove, 2, math.MaxUint64)
	routed("route set from an older router without it", false)
	wild(add, 2, 6)
	routed("add 6 after it", true)
}

// TestApply_EveryChangeAnnouncesItsAnchor: the change that makes an anchored
// key non-empty announces the anchor, and its notification leaves the key's
// lock: a later change to the key can be notified, and acknowledged (its
// subscriber SUBACKed), while the first is still on its way to a node. Were
// only the first to announce the anchor, that node and every edge on it
// would rule the anchor out meanwhile and send the later subscriber
// nothing. Every change announces it; a node that holds it already passes
// it on to its cachers only.
func TestApply_EveryChangeAnnouncesItsAnchor(t *testing.T) {
	n, _ := newMemNode(t)
	ctx := t.Context()
	for i, f := range []string{"k/+/1", "k/+/2", "k/#"} {
		_, inv, _, err := n.applyKey(ctx, anchorKey("t1", "k"), []*routerv1.EdgeDelta{{EdgeId: "edge-a", Incarnation: 1,
			Delta: &routerv1.RouteDelta{Seq: uint64(i + 1), Op: routerv1.RouteOp_ROUTE_OP_ADD, Route: &routerv1.Route{Tenant: "t1", Filter: f}}}})
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Contains(inv.GetNewAnchors(), "k") || !slices.Contains(inv.GetAnchors(), "k") {
			t.Fatalf("add of %s: invalidation %v, want anchor k invalidated and announced", f, inv)
		}
	}
	// A node that missed the first announcement learns the anchor from a
	// later one.
	m, _ := newMemNode(t)
	_, err := m.Notify(ctx, connect.NewRequest(&routerv1.NotifyRequest{SenderNodeId: "mem-0",
		Invalidation: &routerv1.RouteInvalidation{Tenant: "t1", Anchors: []string{"k"}, NewAnchors: []string{"k"}}}))
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := m.blooms["t1"].anchors["k"]; !ok {
		t.Fatal("the node's Bloom state lacks k")
	}
}

// TestNotify_WaitsForTheEdgesToTakeEarlierChanges: a notification that
// finds the node up to date (the anchor it announces came with an earlier
// one) sends an edge nothing, but must not answer before every edge took
// the earlier one, still on its way: acknowledged at once, its change
// would reach the subscriber's SUBACK while the edge still ruled the
// anchor out and sent a publish nowhere.
func TestNotify_WaitsForTheEdgesToTakeEarlierChanges(t *testing.T) {
	n, _ := newMemNode(t)
	ctx := t.Context()
	c := newEdgeConn(ctx, "edge-x", 1, 64)
	n.mu.Lock()
	n.conns[c.id] = c
	n.mu.Unlock()
	notify := func() <-chan struct{} {
		done := make(chan struct{})
		go func() {
			defer close(done)
			if _, err := n.Notify(ctx, connect.NewRequest(newAnchor("k"))); err != nil {
				t.Error(err)
			}
		}()
		return done
	}
	first := notify()
	var last uint64
	select {
	case m := <-c.out: // the new filter, or the invalidation that brings k
		last = m.GetSeq()
	case <-time.After(5 * time.Second):
		t.Fatal("the first notification sent the edge nothing")
	}
	eventually(t, 5*time.Second, func() error {
		n.mu.Lock()
		defer n.mu.Unlock()
		if _, ok := n.blooms["t1"].anchors["k"]; !ok {
			return errors.New("k not taken yet")
		}
		return nil
	})
	second := notify()
	select {
	case <-second:
		t.Fatal("the second notification answered while the edge had not taken the first")
	case <-time.After(300 * time.Millisecond):
	}
	for len(c.out) > 0 {
		last = (<-c.out).GetSeq()
	}
	c.onAck(last)
	for _, done := range []<-chan struct{}{first, second} {
		select {
		case <-done:
		case <-time.After(time.Second):
			t.Fatal("a notification still waits after the edge took everything")
		}
	}
}
