package server

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/keelmq/keel/libs/routes"
	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
)

// edgeConn is one edge's RouteSync stream on this node.
type edgeConn struct {
	id  string
	inc uint64
	out chan *routerv1.RouteSyncResponse

	ctx    context.Context
	cancel context.CancelCauseFunc

	mu    sync.Mutex
	seq   uint64        // last router message seq assigned; guarded by mu
	acked uint64        // highest seq the edge acknowledged; guarded by mu
	ackCh chan struct{} // closed and replaced on every ack; guarded by mu
	// routeSeq is the seq of the last message that changes the edge's
	// answers (invalidation, wildcard deltas, Bloom filter); guarded by mu.
	routeSeq uint64

	// snapshotsBegun and snapshots count the full route sets begun and
	// applied (settle waits for one begun after its request).
	snapshotsBegun, snapshots atomic.Uint64
	// snapView is the view of the last snapshot applied under one view
	// (edgeRecord.SnapView). Owned by the stream's apply worker.
	snapView  uint64
	snapStart uint64 // view when the snapshot being received began
	deadInc   uint64 // edgeRecord.DeadInc, kept in every record written
	// edgeClock is the edge clock of the latest ack, echoed by heartbeats.
	edgeClock atomic.Int64

	// Owned by the stream's apply worker.
	applied uint64 // highest delta seq durably applied
	routes  map[routes.Key]uint32
	digest  routes.Digest
	snap    []*routerv1.Route
}

func newEdgeConn(ctx context.Context, id string, inc uint64, queue int) *edgeConn {
	ctx, cancel := context.WithCancelCause(ctx)
	return &edgeConn{id: id, inc: inc, out: make(chan *routerv1.RouteSyncResponse, queue), ctx: ctx, cancel: cancel,
		ackCh: make(chan struct{}), routes: map[routes.Key]uint32{}}
}

// send numbers msg and queues it; it never blocks. A full queue closes the
// stream (the edge reconnects and resyncs): one slow edge never stalls others.
func (c *edgeConn) send(msg *routerv1.RouteSyncResponse) uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.seq++
	msg.Seq = c.seq
	select {
	case c.out <- msg:
	default:
		c.cancel(ErrSlowEdge)
	}
	return c.seq
}

// sendRoute is send for a message that changes the edge's answers: a
// notification is acknowledged only once the edge took every such message
// (unackedRoute).
func (c *edgeConn) sendRoute(msg *routerv1.RouteSyncResponse) uint64 {
	seq := c.send(msg)
	c.mu.Lock()
	c.routeSeq = max(c.routeSeq, seq)
	c.mu.Unlock()
	return seq
}

// unackedRoute returns the seq of the last message changing the edge's
// answers if the edge has not acknowledged it yet, else 0.
func (c *edgeConn) unackedRoute() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.routeSeq > c.acked {
		return c.routeSeq
	}
	return 0
}

func (c *edgeConn) close(cause error) { c.cancel(cause) }

func (c *edgeConn) onAck(seq uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if seq > c.acked && seq <= c.seq {
		c.acked = seq
		close(c.ackCh)
		c.ackCh = make(chan struct{})
	}
}

// waitAck waits until the edge acknowledged seq or deadline passed (its cache
// lease has then expired). It reports whether the edge acknowledged.
func (c *edgeConn) waitAck(ctx context.Context, seq uint64, deadline time.Time) bool {
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	for {
		c.mu.Lock()
		acked, ch := c.acked, c.ackCh
		c.mu.Unlock()
		if acked >= seq {
			return true
		}
		select {
		case <-ch:
		case <-timer.C:
			return false
		case <-ctx.Done():
			return false
		}
	}
}

// sender writes queued messages and heartbeats to the stream until the
// stream ends.
func (c *edgeConn) sender(sendFn func(*routerv1.RouteSyncResponse) error, hb, lease time.Duration) error {
	t := time.NewTicker(hb)
	defer t.Stop()
	leasePB := durationpb.New(lease)
	for {
		select {
		case <-c.ctx.Done():
			return context.Cause(c.ctx)
		case msg := <-c.out:
			if err := sendFn(msg); err != nil {
				c.cancel(err)
				return err
			}
		case <-t.C:
			c.send(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Heartbeat{Heartbeat: &routerv1.RouteHeartbeat{CacheLease: leasePB, Echo: c.edgeClock.Load()}}})
		}
	}
}
