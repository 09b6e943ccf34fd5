package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/libs/routes"
	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
	"github.com/keelmq/keel/services/router/internal/table"
)

func toKey(tenant string, r *routerv1.Route) routes.Key {
	return routes.Key{Tenant: tenant, Filter: r.GetFilter(), Group: r.GetShareGroup()}
}

func keyOf(r *routerv1.Route) routes.Key {
	return routes.Key{Tenant: r.GetTenant(), Filter: r.GetFilter(), Group: r.GetShareGroup()}
}

// routeDeltas sends one edge's deltas to the owners of their keys (itself
// included) and returns once all are durable and notified. Deltas for one key
// keep their order; different owners are called concurrently.
func (n *Node) routeDeltas(ctx context.Context, deltas []*routerv1.EdgeDelta) ([]*routerv1.RouteReject, error) {
	type batch struct{ deltas []*routerv1.EdgeDelta }
	byOwner := map[string]*batch{}
	var order []string
	n.mu.Lock()
	members, gen, view := n.members, n.memberGen, n.view
	n.mu.Unlock()
	for _, d := range deltas {
		o, err := rendezvous(routeKey(keyOf(d.GetDelta().GetRoute())), members)
		if err != nil {
			return nil, err
		}
		b := byOwner[o]
		if b == nil {
			b = &batch{}
			byOwner[o] = b
			order = append(order, o)
		}
		b.deltas = append(b.deltas, d)
	}
	var (
		mu       sync.Mutex
		rejected []*routerv1.RouteReject
		errs     []error
		wg       sync.WaitGroup
	)
	for _, o := range order {
		b := byOwner[o]
		wg.Go(func() {
			var rej []*routerv1.RouteReject
			var err error
			if o == n.ID() {
				rej, err = n.applyOwned(ctx, gen, view, b.deltas)
			} else {
				n.m.forwards.Add(float64(len(b.deltas)))
				var c interface {
					ApplyRoutes(context.Context, *connect.Request[routerv1.ApplyRoutesRequest]) (*connect.Response[routerv1.ApplyRoutesResponse], error)
				}
				c, err = n.peer(ctx, o)
				if err == nil {
					var resp *connect.Response[routerv1.ApplyRoutesResponse]
					resp, err = c.ApplyRoutes(ctx, connect.NewRequest(&routerv1.ApplyRoutesRequest{Deltas: b.deltas, SenderNodeId: n.ID(), View: view}))
					if err == nil {
						rej = resp.Msg.GetRejected()
					}
				}
				if err != nil {
					err = fmt.Errorf("forward to %s: %w", o, err)
				}
			}
			mu.Lock()
			defer mu.Unlock()
			rejected = append(rejected, rej...)
			if err != nil {
				errs = append(errs, err)
			}
		})
	}
	wg.Wait()
	return rejected, errors.Join(errs...)
}

// otherView reports a peer's refusal of a notification made under another
// view (ErrOtherView), the one refusal Notify answers FailedPrecondition.
func otherView(err error) bool {
	return connect.CodeOf(err) == connect.CodeFailedPrecondition
}

// applyOwned applies deltas to keys this node owns, as their single writer:
// per key, under the key's lock, read, apply, write with the write quorum.
// Then it notifies every router node of what edges must learn, and returns
// once they answered. gen and view are the memberGen and view the owners
// were chosen under.
func (n *Node) applyOwned(ctx context.Context, gen, writeView uint64, deltas []*routerv1.EdgeDelta) ([]*routerv1.RouteReject, error) {
	var keys []string
	byKey := map[string][]*routerv1.EdgeDelta{}
	for _, d := range deltas {
		k := routeKey(keyOf(d.GetDelta().GetRoute()))
		if _, ok := byKey[k]; !ok {
			keys = append(keys, k)
		}
		byKey[k] = append(byKey[k], d)
	}
	invs := map[string]*routerv1.RouteInvalidation{}
	var wild []*routerv1.WildcardDelta
	var rejected []*routerv1.RouteReject
	done := n.startWrites(gen)
	for _, key := range keys {
		rej, inv, wd, err := n.applyKey(ctx, key, byKey[key])
		if err != nil {
			done()
			return nil, err
		}
		rejected = append(rejected, rej...)
		wild = append(wild, wd...)
		if inv != nil {
			if cur := invs[inv.Tenant]; cur != nil {
				cur.Anchors = append(cur.Anchors, inv.Anchors...)
				cur.NewAnchors = append(cur.NewAnchors, inv.NewAnchors...)
			} else {
				invs[inv.Tenant] = inv
			}
		}
	}
	done()
	var reqs []*routerv1.NotifyRequest
	for _, inv := range invs {
		reqs = append(reqs, &routerv1.NotifyRequest{Invalidation: inv, SenderNodeId: n.ID(), WriteView: writeView})
	}
	if len(wild) > 0 {
		reqs = append(reqs, &routerv1.NotifyRequest{Wildcard: &routerv1.WildcardDeltas{Deltas: wild}, SenderNodeId: n.ID(), WriteView: writeView})
	}
	var wg sync.WaitGroup
	for _, r := range reqs {
		wg.Go(func() { n.notifyAll(ctx, r) })
	}
	wg.Wait()
	return rejected, nil
}

func (n *Node) applyKey(ctx context.Context, key string, deltas []*routerv1.EdgeDelta) ([]*routerv1.RouteReject, *routerv1.RouteInvalidation, []*routerv1.WildcardDelta, error) {
	l := n.lockKey(key)
	l.Lock()
	defer l.Unlock()
	set, err := n.loadSet(ctx, key)
	if err != nil {
		return nil, nil, nil, err
	}
	isWild := key[:len(prefixWild)] == prefixWild
	var rejected []*routerv1.RouteReject
	var wild []*routerv1.WildcardDelta
	var inv *routerv1.RouteInvalidation
	changed := false
	var again *routerv1.RouteInvalidation // the key's anchor, announced again
	for _, ed := range deltas {
		d := ed.GetDelta()
		r := d.GetRoute()
		route := table.Route{Filter: r.GetFilter(), Group: r.GetShareGroup()}
		op := table.OpAdd
		if d.GetOp() == routerv1.RouteOp_ROUTE_OP_REMOVE {
			op = table.OpRemove
		}
		if isWild && op == table.OpAdd && set.Routes[route] == nil && set.Len() >= n.cfg.WildcardCap {
			n.m.wildcardRejects.Inc()
			rejected = append(rejected, &routerv1.RouteReject{Seq: d.GetSeq(), Reason: ErrWildcardCap.Error(), Route: r})
			continue
		}
		// A retry: the edge re-sent a delta this key already reflects, after
		// its stream broke. The owner that applied it may have died before
		// notifying the router nodes, so notify again (cheap, idempotent).
		// A re-sent route set's remove of a route the key lacks counts too
		// (its owner may have died the same way); dead-edge removes carry
		// seq MaxUint64 and are no retries.
		cur, has := set.Routes[route][ed.GetEdgeId()]
		retry := d.GetSeq() != math.MaxUint64 && (op == table.OpAdd && has && cur.Inc == ed.GetIncarnation() && cur.Seq == d.GetSeq() ||
			op == table.OpRemove && !has)
		// A route the key already holds for this incarnation, re-sent with
		// the edge's route set after a membership change, is announced
		// again: a node that loaded its replicas by scanning Olric while
		// partitions moved can have missed the key, and without the
		// announcement its Bloom filters (and its edges') would rule the
		// anchor out, or its wildcard replica lack the route, for good.
		// The settle round waits for these re-sent sets, so every node
		// holds them before it settles.
		resent := op == table.OpAdd && has && cur.Inc == ed.GetIncarnation()
		res := set.Apply(table.Delta{Edge: ed.GetEdgeId(), Inc: ed.GetIncarnation(), Seq: d.GetSeq(), Op: op, Route: route, Count: d.GetCount()})
		if !res.Changed && !retry && !resent {
			continue
		}
		if !res.Changed {
			if isWild {
				wild = append(wild, &routerv1.WildcardDelta{Route: r, EdgeId: ed.GetEdgeId(), Op: d.GetOp(), Incarnation: ed.GetIncarnation(), Seq: d.GetSeq()})
				continue
			}
			if !retry {
				if again == nil {
					again = &routerv1.RouteInvalidation{Tenant: r.GetTenant(), NewAnchors: []string{routes.Key{Filter: r.GetFilter()}.Anchor()}}
				}
				continue
			}
			if inv == nil {
				inv = &routerv1.RouteInvalidation{Tenant: r.GetTenant(), Anchors: []string{routes.Key{Filter: r.GetFilter()}.Anchor()}}
			}
			continue
		}
		changed = true
		kind := "anchored"
		switch {
		case route.Group != "":
			kind = "shared"
		case isWild:
			kind = "wildcard"
		}
		opName := "add"
		if op == table.OpRemove {
			opName = "remove"
		}
		n.m.routes.WithLabelValues(kind, opName).Inc()
		if isWild {
			wild = append(wild, &routerv1.WildcardDelta{Route: r, EdgeId: ed.GetEdgeId(), Op: d.GetOp(), Incarnation: ed.GetIncarnation(), Seq: d.GetSeq()})
			continue
		}
		if inv == nil {
			inv = &routerv1.RouteInvalidation{Tenant: r.GetTenant(), Anchors: []string{routes.Key{Filter: r.GetFilter()}.Anchor()}}
		}
	}
	if !changed {
		if inv == nil {
			// Announced as new only: nothing changed that a cached answer
			// lacks.
			inv = again
		} else {
			inv.NewAnchors = inv.Anchors // see below
		}
		return rejected, inv, wild, nil
	}
	if set.Len() == 0 {
		err = n.st.Delete(ctx, key)
	} else {
		var b []byte
		if b, err = set.Marshal(); err == nil {
			err = n.st.Put(ctx, key, b)
		}
	}
	if err != nil {
		return nil, nil, nil, fmt.Errorf("store route key: %w", err)
	}
	if inv != nil {
		// Every change announces the key's anchor, not only the one that
		// made the key non-empty: that one's notification can still be on
		// its way to a node (notifications leave the key's lock) when a
		// later change to the key is acknowledged, and until it lands the
		// node and its edges rule the anchor out. A node that holds the
		// anchor already passes the announcement on to its cachers only.
		inv.NewAnchors = inv.Anchors
	}
	return rejected, inv, wild, nil
}

// notifyAll tells every router node about req and waits for each to answer.
//
// A node that does not answer is retried until one cache lease (plus grace)
// has passed, after which its edges' cached answers have expired, and the
// notification is then queued for it (see notifyPeer): what it carries is
// not only invalidations, which a lapsed lease makes moot, but state the
// node keeps without a lease (new anchors for its Bloom filters and its
// edges', wildcard-first routes, dead edges). A node that missed a new
// anchor skipped it in every later Lookup, and so did its edges.
func (n *Node) notifyAll(ctx context.Context, req *routerv1.NotifyRequest) {
	expired := time.Now().Add(n.cfg.CacheLease + n.cfg.LeaseGrace)
	notified := map[string]bool{}
	// A node that joined while the others were being notified (they refuse
	// the notification until this node sees it too) loaded its replicas
	// before the change: it is notified once it is seen.
	for {
		n.mu.Lock()
		ms, view := n.members, n.view
		n.mu.Unlock()
		var wg sync.WaitGroup
		for _, m := range ms {
			if notified[m] {
				continue
			}
			notified[m] = true
			wg.Go(func() {
				if m == n.ID() {
					n.handleNotify(ctx, req)
					return
				}
				n.notifyPeer(ctx, m, req, expired)
			})
		}
		wg.Wait()
		if n.View() == view || ctx.Err() != nil {
			return
		}
	}
}

// Notify retry backoff.
const (
	notifyBackoffMin = 25 * time.Millisecond
	notifyBackoffMax = time.Second
)

// notifyPeer delivers req to router node m, retrying until expired (the
// edges' leases on m have then run out) and returns once m answered or
// expired passed. Undelivered by then, req joins m's outbox, which a
// goroutine delivers in order until m answers or leaves the membership;
// while m has an outbox, later notifications queue behind it, so that m
// applies them in the order they were sent (a late add must not overtake
// the remove that followed it).
func (n *Node) notifyPeer(ctx context.Context, m string, req *routerv1.NotifyRequest, expired time.Time) {
	n.mu.Lock()
	if ob := n.outbox[m]; ob != nil {
		it := ob.push(req)
		n.mu.Unlock()
		it.wait(ctx, expired)
		return
	}
	n.mu.Unlock()
	backoff := notifyBackoffMin
	var err error
	for attempt := 1; ; attempt++ {
		if err = n.sendNotify(ctx, m, req, expired.Add(time.Second)); err == nil {
			if attempt > 1 {
				n.logger.Info("notified router node after retrying", "node", m, "attempts", attempt)
			}
			return
		}
		if permanent(err) {
			n.logger.Warn("router node refused a notification", "node", m, logging.Err(err))
			return
		}
		if otherView(err) {
			// m sees another membership: an owner its view chooses may
			// write over this change. Every node stops trusting its
			// answers before the change is acknowledged (below, at the
			// latest when the lease has passed), and none settles before
			// the views agree and the edges re-sent their route sets.
			n.unsettleEverywhere(ctx, fmt.Sprintf("router node %s has another membership view", m))
		}
		wait := min(backoff, time.Until(expired))
		if wait <= 0 || ctx.Err() != nil || !n.isMember(m) {
			break
		}
		n.logger.Debug("notify router node failed; retrying", "node", m, "attempt", attempt, logging.Err(err))
		select {
		case <-time.After(wait):
		case <-ctx.Done():
		}
		backoff = min(2*backoff, notifyBackoffMax)
	}
	n.mu.Lock()
	var it *outboxItem
	// A node that left needs no queue: it reloads its replicas from the
	// store when it comes back.
	if slices.Contains(n.members, m) {
		it = n.outboxLocked(m).push(req)
	}
	n.mu.Unlock()
	if it != nil {
		level := slog.LevelWarn
		if ctx.Err() != nil {
			level = slog.LevelDebug // the caller went away (its stream ended)
		}
		n.logger.Log(ctx, level, "notify router node failed; waiting out the cache lease, delivery goes on in the background", "node", m, logging.Err(err))
		it.wait(ctx, expired)
		return
	}
	n.logger.Warn("notify router node failed; it left, waiting out the cache lease", "node", m, logging.Err(err))
	select {
	case <-time.After(time.Until(expired)):
	case <-ctx.Done():
	}
}

// permanent reports a Notify error that retrying cannot cure: the node
// refused the request itself.
func permanent(err error) bool {
	return connect.CodeOf(err) == connect.CodeInvalidArgument
}

// sendNotify calls Notify on router node m, resolving its address first.
func (n *Node) sendNotify(ctx context.Context, m string, req *routerv1.NotifyRequest, deadline time.Time) error {
	c, err := n.peer(ctx, m)
	if err != nil {
		return err
	}
	cctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	// Under the view of now: a node that refused the notification for
	// another view takes it once the two agree.
	_, err = c.Notify(cctx, connect.NewRequest(&routerv1.NotifyRequest{Invalidation: req.GetInvalidation(), Wildcard: req.GetWildcard(),
		SenderNodeId: req.GetSenderNodeId(), View: n.View(), WriteView: req.GetWriteView()}))
	return err
}

func (n *Node) isMember(m string) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return slices.Contains(n.members, m)
}

// maxOutbox bounds the notifications kept for one router node: one that
// stays a member but does not answer for long must not exhaust memory.
const maxOutbox = 1 << 16

// peerOutbox holds the notifications a router node has not answered yet,
// oldest first.
type peerOutbox struct {
	logger  *slog.Logger
	items   []*outboxItem // guarded by Node.mu
	dropped int           // notifications not queued for want of room; guarded by Node.mu
}

type outboxItem struct {
	req  *routerv1.NotifyRequest
	done chan struct{} // closed once delivered, or once the node left
}

// push queues req, unless the outbox is full (the item returned is then
// never done). Node.mu must be held.
func (ob *peerOutbox) push(req *routerv1.NotifyRequest) *outboxItem {
	it := &outboxItem{req: req, done: make(chan struct{})}
	if len(ob.items) >= maxOutbox {
		if ob.dropped++; ob.dropped == 1 {
			ob.logger.Error("router node misses notifications: its outbox is full")
		}
		return it
	}
	ob.items = append(ob.items, it)
	return it
}

// wait returns once it was delivered, expired passed, or ctx ended.
func (it *outboxItem) wait(ctx context.Context, expired time.Time) {
	t := time.NewTimer(time.Until(expired))
	defer t.Stop()
	select {
	case <-it.done:
	case <-t.C:
	case <-ctx.Done():
	}
}

// outboxLocked returns m's outbox, creating it and starting its delivery
// when there is none.
//
// n.mu must be held.
func (n *Node) outboxLocked(m string) *peerOutbox {
	ob := n.outbox[m]
	if ob == nil {
		ob = &peerOutbox{logger: n.logger.With("node", m)}
		n.outbox[m] = ob
		n.m.notifyOutboxes.Inc()
		go n.drainOutbox(m, ob)
	}
	return ob
}

// drainOutbox delivers ob's notifications to router node m in order, each
// retried until m answers, and ends once ob is empty, m left the membership
// (it reloads its replicas when it comes back) or the node stops.
func (n *Node) drainOutbox(m string, ob *peerOutbox) {
	backoff := notifyBackoffMin
	for {
		n.mu.Lock()
		if len(ob.items) == 0 || !slices.Contains(n.members, m) || n.life.Err() != nil {
			if len(ob.items) > 0 && n.life.Err() == nil {
				n.logger.Warn("router node left with notifications undelivered", "node", m, "count", len(ob.items))
			}
			if ob.dropped > 0 {
				n.logger.Error("router node missed notifications: its outbox was full", "node", m, "dropped", ob.dropped)
			}
			for _, it := range ob.items {
				close(it.done)
			}
			ob.items = nil
			delete(n.outbox, m)
			n.m.notifyOutboxes.Dec()
			n.mu.Unlock()
			return
		}
		it := ob.items[0]
		n.mu.Unlock()
		err := n.sendNotify(n.life, m, it.req, time.Now().Add(n.cfg.CacheLease+n.cfg.LeaseGrace+time.Second))
		if err == nil {
			n.mu.Lock()
			ob.items = ob.items[1:]
			n.mu.Unlock()
			close(it.done)
			backoff = notifyBackoffMin
			continue
		}
		if permanent(err) {
			n.logger.Warn("router node refused a notification", "node", m, logging.Err(err))
			n.mu.Lock()
			ob.items = ob.items[1:]
			n.mu.Unlock()
			close(it.done)
			continue
		}
		n.logger.Debug("queued notification not delivered; retrying", "node", m, logging.Err(err))
		select {
		case <-time.After(backoff):
		case <-n.life.Done():
		}
		backoff = min(2*backoff, notifyBackoffMax)
	}
}

// handleNotify applies a change to this node's replicas and passes it to the
// concerned edges, returning once each acknowledged or its lease expired.
func (n *Node) handleNotify(ctx context.Context, req *routerv1.NotifyRequest) int {
	start := time.Now()
	deadline := start.Add(n.cfg.CacheLease + n.cfg.LeaseGrace)
	type target struct {
		c   *edgeConn
		seq uint64
	}
	var targets []target
	var waitUntil time.Time
	n.mu.Lock()
	inv, wd := req.GetInvalidation(), req.GetWildcard()
	// Anchors this node's filter lacked: every edge here lacks them too
	// (its filters are this node's), so all must hear of them. Edges that
	// cached an answer for an anchor it holds already are its cachers.
	newHere := 0
	if inv != nil {
		if len(inv.GetNewAnchors()) > 0 {
			// A new or rebuilt filter goes to every edge ahead of the
			// invalidation, which they acknowledge after it.
			bs, fresh, added := n.addAnchorsLocked(inv.GetTenant(), inv.GetNewAnchors())
			if fresh {
				for _, c := range n.conns {
					n.sendBloomLocked(c, inv.GetTenant(), bs)
				}
			}
			newHere = added
		}
		for _, de := range inv.GetDeadEdges() {
			n.dead[de.GetEdgeId()] = max(n.dead[de.GetEdgeId()], de.GetIncarnation())
		}
		applyDead(n.wild, inv.GetDeadEdges(), time.Now())
	}
	// Only the wildcard deltas that changed the replica go on to the edges.
	wd = applyWild(n.wild, wd, n.dead, time.Now())
	all := newHere > 0 || len(inv.GetDeadEdges()) > 0 || wd != nil
	if n.reloading && (len(inv.GetDeadEdges()) > 0 || len(req.GetWildcard().GetDeltas()) > 0) {
		n.reloadLog = append(n.reloadLog, req)
	}
	if len(wd.GetDeltas()) > 0 {
		var wr int
		for _, w := range n.wild {
			wr += w.trie.Len()
		}
		n.m.wildcardRoutes.Set(float64(wr))
	}
	sent := 0
	send := func(c *edgeConn) {
		sent++
		if inv != nil {
			c.sendRoute(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Invalidation{Invalidation: inv}})
		}
		if wd != nil {
			c.sendRoute(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Wildcard{Wildcard: wd}})
		}
	}
	if all {
		for _, c := range n.conns {
			send(c)
		}
	}
	now := time.Now()
	for _, a := range inv.GetAnchors() {
		ck := cacheKey{inv.GetTenant(), a}
		for e, until := range n.cachers[ck] {
			if !until.After(now) {
				delete(n.cachers[ck], e)
				continue
			}
			if c := n.conns[e]; c != nil {
				if !all {
					send(c)
				}
				delete(n.cachers[ck], e)
			} else if until.After(waitUntil) {
				// A cacher without a stream here: wait out its lease. It
				// stays a cacher, so that a later change of the anchor
				// waits it out as well.
				waitUntil = until
			}
		}
		if len(n.cachers[ck]) == 0 {
			delete(n.cachers, ck)
		}
	}
	// Every edge here must have taken every change of its answers sent so
	// far, this notification's and earlier ones', before the change is
	// acknowledged: an earlier notification that first brought an anchor,
	// a route or an invalidation to an edge may still be waiting for the
	// edge's ack, and this one, finding the node up to date, sends the
	// edge nothing. Acknowledged at once, its change would reach a
	// subscriber's SUBACK while the edge still answered without it.
	for _, c := range n.conns {
		if seq := c.unackedRoute(); seq > 0 {
			targets = append(targets, target{c, seq})
		}
	}
	n.mu.Unlock()
	for _, t := range targets {
		t.c.waitAck(ctx, t.seq, deadline)
	}
	if d := time.Until(waitUntil); d > 0 {
		select {
		case <-time.After(min(d, time.Until(deadline))):
		case <-ctx.Done():
		}
	}
	return sent
}

// applyDead drops the wildcard-first routes of dead edge incarnations from
// the replicas in wild.
func applyDead(wild map[string]*wildReplica, dead []*routerv1.DeadEdge, now time.Time) {
	for _, de := range dead {
		for _, w := range wild {
			var gone []table.Route
			w.set.Edges(func(r table.Route, e string, en table.Entry) {
				if e == de.GetEdgeId() && en.Inc <= de.GetIncarnation() {
					gone = append(gone, r)
				}
			})
			for _, r := range gone {
				w.remove(r, de.GetEdgeId(), de.GetIncarnation(), math.MaxUint64, now)
			}
		}
	}
}

// applyWild applies wildcard deltas from a key owner to the replicas in wild
// and returns those that changed a replica, or nil if none did: a delta
// older than what a replica holds for its (route, edge) is not passed on
// either, so the edges' tries stay as the node's.
//
// dead holds the dead incarnation of each edge: their adds are ignored.
func applyWild(wild map[string]*wildReplica, wd *routerv1.WildcardDeltas, dead map[string]uint64, now time.Time) *routerv1.WildcardDeltas {
	var applied []*routerv1.WildcardDelta
	for _, d := range wd.GetDeltas() {
		r := d.GetRoute()
		w := wild[r.GetTenant()]
		if w == nil {
			w = &wildReplica{}
			wild[r.GetTenant()] = w
		}
		route := table.Route{Filter: r.GetFilter(), Group: r.GetShareGroup()}
		var ok bool
		if d.GetOp() == routerv1.RouteOp_ROUTE_OP_ADD {
			ok = dead[d.GetEdgeId()] < d.GetIncarnation() && w.add(route, d.GetEdgeId(), d.GetIncarnation(), d.GetSeq())
		} else {
			ok = w.remove(route, d.GetEdgeId(), d.GetIncarnation(), d.GetSeq(), now)
		}
		if ok {
			applied = append(applied, d)
		}
	}
	if len(applied) == 0 {
		return nil
	}
	if len(applied) == len(wd.GetDeltas()) {
		return wd
	}
	return &routerv1.WildcardDeltas{Deltas: applied}
}

// tombstoneTTL is how long a replica remembers a removed wildcard-first
// route, so that an add notified before the remove but arriving after it
// is ignored. A notification is late only when its key's owner changed
// with the membership (one owner's notifications arrive in order), so a
// few seconds would do; a later add past this would leave a stale route,
// which costs traffic to an edge without subscribers, never a message.
const tombstoneTTL = 2 * time.Minute

// tombstone is a removed (route, edge) of a wildcard replica.
type tombstone struct {
	inc, seq uint64
	at       time.Time
}

// routeEdge is one edge's hold on a route.
type routeEdge struct {
	route table.Route
	edge  string
}

// before reports whether change (inc, seq) of an edge's route comes
// before (curInc, curSeq): an older incarnation, or a lower seq within one.
// Seq 0 is a sender that carries none (older routers): within one
// incarnation its change is taken as the latest, the rule before seqs.
func before(inc, seq, curInc, curSeq uint64) bool {
	if inc != curInc {
		return inc < curInc
	}
	return seq != 0 && seq < curSeq
}

// add records that edge incarnation inc holds route as of its change seq,
// unless the replica holds a later change for it: a later add, or a
// remove (tombstone) with a higher seq or of a later incarnation.
// Re-applying the add it holds (a retried notification) is a change; the
// same add at a later seq of the same incarnation is not.
// (A re-sent route set removes what it lacks at its seq + 1, so the edge's
// next change, an add at that very seq, is not older than the remove.)
//
// NOTE(router): replicas are not the key's table: they are changed directly,
// not through table.Set.Apply, whose seq rule would ignore every later
// remove of an entry recorded without the edge's seq, so the set (which
// full resends are built from) kept routes the trie had dropped.
func (w *wildReplica) add(r table.Route, edge string, inc, seq uint64) bool {
	if cur, ok := w.set.Routes[r][edge]; ok && before(inc, seq, cur.Inc, cur.Seq) {
		return false
	}
	if t, ok := w.gone[routeEdge{r, edge}]; ok {
		if before(inc, seq, t.inc, t.seq) {
			return false
		}
		delete(w.gone, routeEdge{r, edge})
	}
	if w.set.Routes == nil {
		w.set.Routes = map[table.Route]map[string]table.Entry{}
	}
	es := w.set.Routes[r]
	if es == nil {
		es = map[string]table.Entry{}
		w.set.Routes[r] = es
	}
	cur, held := es[edge]
	if held && cur.Inc == inc && seq == 0 {
		seq = cur.Seq // a sender without seqs: keep the one known
	}
	es[edge] = table.Entry{Inc: inc, Seq: seq}
	w.trie.Add(r.Filter, wildVal{route: r, edge: edge})
	// Held already by this incarnation as of an earlier change (a re-sent
	// route set): the edges here have it, and need not hear of it again.
	return !held || cur.Inc != inc || seq == cur.Seq
}

// remove drops route for edge incarnation inc and older ones, unless the
// add the replica holds is not older than the remove (the same
// incarnation at the remove's seq or above: the remove was notified late),
// and leaves a tombstone against late adds. Seq max uint64 (a dead
// incarnation's remove, or a re-sent route set's from an older router)
// removes whatever seq the add had, and its tombstone holds no seq: a dead
// incarnation's adds are refused by the dead map instead, and an older
// router's route set may be followed by adds at any seq. It reports
// whether the route was dropped.
func (w *wildReplica) remove(r table.Route, edge string, inc, seq uint64, now time.Time) bool {
	es := w.set.Routes[r]
	cur, held := es[edge]
	if held && (cur.Inc > inc || cur.Inc == inc && seq != 0 && cur.Seq >= seq) {
		return false
	}
	if seq == math.MaxUint64 {
		seq = 0
	}
	if t, ok := w.gone[routeEdge{r, edge}]; !ok || t.inc < inc || t.inc == inc && t.seq < seq {
		if w.gone == nil {
			w.gone = map[routeEdge]tombstone{}
		}
		w.gone[routeEdge{r, edge}] = tombstone{inc: inc, seq: seq, at: now}
	}
	if !held {
		return false
	}
	delete(es, edge)
	if len(es) == 0 {
		delete(w.set.Routes, r)
	}
	w.trie.Remove(r.Filter, wildVal{route: r, edge: edge})
	return true
}

// sweep forgets tombstones older than tombstoneTTL.
func (w *wildReplica) sweep(now time.Time) {
	for k, t := range w.gone {
		if now.Sub(t.at) > tombstoneTTL {
			delete(w.gone, k)
		}
	}
}
