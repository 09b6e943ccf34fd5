package server

import (
	"context"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	"github.com/keelmq/keel/libs/logging"
	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
	"github.com/keelmq/keel/proto/gen/keel/router/v1/routerv1connect"
)

// A route key has one writer only while every router node agrees on the
// membership. While they do not (a node joined or left and not every node
// has seen it yet), two nodes may each take themselves for a key's owner,
// and one's read-modify-write can drop a route the other just acknowledged.
// Olric also moves partitions then. The edges' route sets repair the table,
// but only when they are re-sent after the nodes agree again.
//
// So a node is unsettled from the moment it sees a membership change (in
// its own member list, or in a peer's request made under another view)
// until the change is over: its edges send every publish to every edge
// (RouteSettle, LookupResponse.unsettled), which costs fan-out for a few
// seconds but misses no subscriber. The node settles in phases:
//
//	waiting:   the membership held still for SettleDelay and every member
//	           reports the same view;
//	resyncing: every edge on this node was asked for its route set, and the
//	           node waits for each to be applied (or for its stream to end);
//	resynced:  every member reports its edges resynced under the same view.
//
// Any change on the way starts again from waiting.
type settlePhase int

const (
	phaseSettled settlePhase = iota
	phaseWaiting
	phaseResyncing
	phaseResynced
)

// DefaultSettleDelay is how long the membership must hold still before the
// edges are asked for their route sets: a departure or arrival is seen by
// the nodes within a few memberlist probe rounds of each other.
const DefaultSettleDelay = time.Second

type settleState struct {
	phase  settlePhase
	gen    uint64    // bumped by every unsettle
	since  time.Time // last unsettle
	reason string
	// waiting: the edges asked for their route set in this round, with the
	// number of snapshots each had begun when asked.
	waiting map[*edgeConn]uint64
}

// applyGen returns the memberGen and view route writes start under now.
func (n *Node) applyGen() (gen, view uint64) {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.memberGen, n.view
}

// unsettle is unsettleLocked for callers without n.mu.
func (n *Node) unsettle(reason string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.unsettleLocked(reason)
}

// foreignGen marks route writes forwarded under another view: stale until
// done, whatever the membership generation.
const foreignGen = math.MaxUint64

// unsettleEverywhere unsettles this node and tells every other member to,
// at most every hintInterval: a node whose view agrees with a writer's
// would otherwise stay settled while another owner writes over its routes.
// It returns once each answered or a second passed.
func (n *Node) unsettleEverywhere(ctx context.Context, reason string) {
	n.mu.Lock()
	n.unsettleLocked(reason)
	members := n.members
	if time.Since(n.hinted) < hintInterval {
		n.mu.Unlock()
		return
	}
	n.hinted = time.Now()
	n.mu.Unlock()
	n.eachPeer(ctx, members, func(ctx context.Context, m string, c routerv1connect.RouterServiceClient) bool {
		if _, err := c.Notify(ctx, connect.NewRequest(&routerv1.NotifyRequest{SenderNodeId: n.ID(), Unsettle: true})); err != nil {
			n.logger.Debug("telling a router node to unsettle failed", "node", m, logging.Err(err))
		}
		return true
	})
}

const hintInterval = 500 * time.Millisecond

// startWrites counts route writes under gen in flight until done is called.
func (n *Node) startWrites(gen uint64) (done func()) {
	n.mu.Lock()
	n.applying[gen]++
	n.mu.Unlock()
	return func() {
		n.mu.Lock()
		if n.applying[gen]--; n.applying[gen] <= 0 {
			delete(n.applying, gen)
		}
		n.mu.Unlock()
	}
}

// staleWritesLocked reports route writes in flight that started under an
// earlier membership. n.mu must be held.
func (n *Node) staleWritesLocked() bool {
	for g := range n.applying {
		if g < n.memberGen || g == foreignGen {
			return true
		}
	}
	return false
}

// View returns the identifier of this node's current membership.
func (n *Node) View() uint64 {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.view
}

// Settled reports whether this node's answers are complete.
func (n *Node) Settled() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.settle.phase == phaseSettled
}

// unsettleLocked starts the settle phases again from waiting, telling the
// edges first if the node was settled.
//
// n.mu must be held.
func (n *Node) unsettleLocked(reason string) {
	s := &n.settle
	if s.phase == phaseSettled {
		n.logger.Info("route answers unsettled: edges send every publish to every edge until the router's answers are complete again", "reason", reason)
		n.m.unsettled.Inc()
		n.m.settled.Set(0)
		msg := &routerv1.RouteSettle{Settled: false, Reason: reason}
		for _, c := range n.conns {
			c.send(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Settle{Settle: msg}})
		}
	}
	s.phase, s.gen, s.since, s.reason, s.waiting = phaseWaiting, s.gen+1, time.Now(), reason, nil
}

// settleNewConnLocked brings a new stream into the settle round: it hears
// the node is unsettled (before its ready), and once route sets are being
// collected its own is asked for too: its digest may match an edge record
// whose routes were written over.
//
// n.mu must be held.
func (n *Node) settleNewConnLocked(c *edgeConn) {
	s := &n.settle
	if s.phase == phaseSettled {
		return
	}
	c.send(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Settle{Settle: &routerv1.RouteSettle{Reason: s.reason}}})
	if s.phase >= phaseResyncing {
		n.requestResyncLocked(c)
		s.phase = phaseResyncing
	}
}

func (n *Node) requestResyncLocked(c *edgeConn) {
	if n.settle.waiting == nil {
		n.settle.waiting = map[*edgeConn]uint64{}
	}
	// A snapshot already under way may predate what it must repair: only one
	// begun after this request counts.
	n.settle.waiting[c] = c.snapshotsBegun.Load()
	c.send(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Resync{Resync: &routerv1.RouteResync{Reason: "router membership settled"}}})
}

// advanceSettle moves the settle phases on by at most one step; Run's
// settle goroutine calls it every membership poll interval.
func (n *Node) advanceSettle(ctx context.Context) {
	n.mu.Lock()
	s := &n.settle
	phase, gen, since, view := s.phase, s.gen, s.since, n.view
	members := n.members
	if phase == phaseResyncing {
		for c, at := range s.waiting {
			if c.ctx.Err() != nil || c.snapshots.Load() > at {
				// Done, or the stream ended: the edge's next stream, on
				// any node, sees its last snapshot predates this view
				// (edgeRecord.SnapView) and re-sends then.
				delete(s.waiting, c)
			}
		}
		if len(s.waiting) == 0 {
			s.phase = phaseResynced
			n.logger.Debug("edges re-sent their route sets", "view", view)
		}
	}
	n.mu.Unlock()
	switch phase {
	case phaseWaiting:
		if time.Since(since) < n.cfg.SettleDelay || time.Now().UnixNano() < n.rebuildUntil.Load() ||
			!n.peersAt(ctx, members, view, false) {
			return
		}
		n.mu.Lock()
		if s.gen == gen && n.view == view && !n.staleWritesLocked() {
			s.phase = phaseResyncing
			for _, c := range n.conns {
				n.requestResyncLocked(c)
			}
		}
		n.mu.Unlock()
	case phaseResynced:
		if !n.peersAt(ctx, members, view, true) {
			return
		}
		n.mu.Lock()
		if s.gen == gen && n.view == view && s.phase == phaseResynced {
			s.phase = phaseSettled
			n.m.settled.Set(1)
			n.logger.Info("route answers settled", "after", time.Since(since).Round(time.Millisecond), "reason", s.reason)
			for _, c := range n.conns {
				c.send(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Settle{Settle: &routerv1.RouteSettle{Settled: true}}})
			}
		}
		n.mu.Unlock()
	}
}

// peersAt reports whether every other member reports membership view with
// no write from an earlier one in flight (and, if resynced, that its edges
// re-sent their route sets under it). A member
// that does not answer holds the node unsettled: its edges may hold routes
// nobody has re-sent.
func (n *Node) peersAt(ctx context.Context, members []string, view uint64, resynced bool) bool {
	return n.eachPeer(ctx, members, func(ctx context.Context, m string, c routerv1connect.RouterServiceClient) bool {
		st, err := c.Status(ctx, connect.NewRequest(&routerv1.StatusRequest{}))
		if err != nil {
			n.logger.Debug("settle: router node status failed", "node", m, logging.Err(err))
			return false
		}
		if st.Msg.GetView() == 0 {
			return true // a router from before settling: it takes no part
		}
		return st.Msg.GetView() == view && !st.Msg.GetStaleWrites() && (!resynced || st.Msg.GetResynced())
	})
}

// eachPeer calls fn for every member but this node at once, each with its
// API client and a second to answer, and reports whether every call
// returned true (a member whose address is unknown counts as false).
func (n *Node) eachPeer(ctx context.Context, members []string, fn func(ctx context.Context, m string, c routerv1connect.RouterServiceClient) bool) bool {
	var failed atomic.Bool
	var wg sync.WaitGroup
	for _, m := range members {
		if m == n.ID() {
			continue
		}
		wg.Go(func() {
			cctx, cancel := context.WithTimeout(ctx, time.Second)
			defer cancel()
			c, err := n.peer(cctx, m)
			if err != nil {
				n.logger.Debug("router node address unknown", "node", m, logging.Err(err))
				failed.Store(true)
				return
			}
			if !fn(cctx, m, c) {
				failed.Store(true)
			}
		})
	}
	wg.Wait()
	return !failed.Load()
}
