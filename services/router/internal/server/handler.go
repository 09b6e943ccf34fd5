package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/libs/routes"
	"github.com/keelmq/keel/libs/topic"
	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
	"github.com/keelmq/keel/proto/gen/keel/router/v1/routerv1connect"
	"github.com/keelmq/keel/services/router/internal/store"
	"github.com/keelmq/keel/services/router/internal/table"
)

var _ routerv1connect.RouterServiceHandler = (*Node)(nil)

const maxEdgeID = 256

func (n *Node) loadEdge(ctx context.Context, id string) (edgeRecord, error) {
	var rec edgeRecord
	b, err := n.st.Get(ctx, prefixEdge+id)
	if errors.Is(err, store.ErrNotFound) {
		return rec, nil
	}
	if err != nil {
		return rec, err
	}
	if err := json.Unmarshal(b, &rec); err != nil {
		return rec, fmt.Errorf("decode edge record: %w", err)
	}
	return rec, nil
}

func (n *Node) storeEdge(ctx context.Context, id string, rec edgeRecord) error {
	b, _ := json.Marshal(rec)
	return n.st.Put(ctx, prefixEdge+id, b)
}

// RouteSync serves one edge's stream.
func (n *Node) RouteSync(ctx context.Context, stream *connect.BidiStream[routerv1.RouteSyncRequest, routerv1.RouteSyncResponse]) error {
	return connectError(n.routeSync(ctx, stream))
}

func (n *Node) routeSync(ctx context.Context, stream *connect.BidiStream[routerv1.RouteSyncRequest, routerv1.RouteSyncResponse]) error {
	first, err := stream.Receive()
	if err != nil {
		return err
	}
	hello, err := checkHello(first)
	if err != nil {
		return err
	}
	if !n.loaded.Load() {
		return ErrLoading
	}
	id, inc := hello.GetEdgeId(), hello.GetIncarnation()
	rec, err := n.loadEdge(ctx, id)
	if err != nil {
		return err
	}
	if rec.Inc > inc || rec.DeadInc >= inc {
		return fmt.Errorf("%w: edge %s incarnation %d, router has %d", ErrStaleIncarnation, id, inc, rec.Inc)
	}
	if rec.Inc < inc {
		old := rec.Inc
		// A new incarnation starts with no routes: the router's copy of its
		// set is complete under the present view.
		rec = edgeRecord{Inc: inc, DeadInc: max(rec.DeadInc, old), SnapView: n.View()}
		if err := n.storeEdge(ctx, id, rec); err != nil {
			return err
		}
		if old > 0 {
			n.notifyAll(ctx, &routerv1.NotifyRequest{SenderNodeId: n.ID(), Invalidation: &routerv1.RouteInvalidation{
				DeadEdges: []*routerv1.DeadEdge{{EdgeId: id, Incarnation: old}}}})
		}
	}
	c := newEdgeConn(ctx, id, inc, n.cfg.SendQueue)
	c.applied = rec.Seq
	c.digest = routes.Digest{Count: rec.Count, Sum: rec.Sum}
	c.snapView, c.deadInc = rec.SnapView, rec.DeadInc
	n.mu.Lock()
	old := n.conns[id]
	n.conns[id] = c
	// Routes the router holds for this edge were last re-sent under another
	// membership (its stream ended during a settle round, or before the
	// change): another owner may have written over them since, and a
	// matching digest would not say so.
	predates := rec.Count > 0 && rec.SnapView != n.view
	if predates {
		n.unsettleLocked(fmt.Sprintf("edge %s last sent its route set under another router membership", id))
	}
	n.sendInitialLocked(c)
	if predates {
		n.requestResyncLocked(c)
	}
	n.m.edges.Set(float64(len(n.conns)))
	n.mu.Unlock()
	if old != nil {
		old.close(errors.New("replaced by a new stream"))
	}
	defer func() {
		n.mu.Lock()
		if n.conns[id] == c {
			delete(n.conns, id)
		}
		n.m.edges.Set(float64(len(n.conns)))
		n.mu.Unlock()
		c.close(context.Canceled)
	}()
	n.logger.Debug("edge stream open", logging.KeyEdgeID, id, "incarnation", inc)

	work := make(chan *routerv1.RouteSyncRequest, 64)
	var wg sync.WaitGroup
	n.wg.Add(1)
	defer n.wg.Done()
	wg.Go(func() { _ = c.sender(stream.Send, n.cfg.Heartbeat, n.cfg.CacheLease) })
	wg.Go(func() {
		for {
			select {
			case <-c.ctx.Done():
				return
			case req := <-work:
				for req != nil {
					var next *routerv1.RouteSyncRequest
					req, next = mergeDeltas(req, work)
					if err := n.handleEdgeRequest(c, req); err != nil {
						// The edge sees the stream end (EOF unless the
						// request was invalid) and re-sends on a new one.
						if c.ctx.Err() == nil {
							n.logger.Warn("edge request failed; closing the stream", logging.KeyEdgeID, c.id, logging.Err(err))
						}
						c.close(err)
						return
					}
					req = next
				}
			}
		}
	})
	go func() {
		// Receive runs until the stream breaks; it cannot be interrupted, so
		// it is not waited for (the handler returning ends the stream).
		for {
			req, err := stream.Receive()
			if err != nil {
				c.close(err)
				return
			}
			if a := req.GetAck(); a != nil {
				c.onAck(a.GetRouterSeq())
				if ec := a.GetEdgeClock(); ec > 0 {
					c.edgeClock.Store(ec)
				}
				continue
			}
			select {
			case work <- req:
			case <-c.ctx.Done():
				return
			}
		}
	}()
	<-c.ctx.Done()
	wg.Wait()
	cause := context.Cause(c.ctx)
	if errors.Is(cause, ErrInvalid) || errors.Is(cause, ErrSlowEdge) {
		return cause
	}
	return nil
}

// checkHello returns the hello that must open every stream.
func checkHello(first *routerv1.RouteSyncRequest) (*routerv1.RouteSyncHello, error) {
	hello := first.GetHello()
	if hello == nil || hello.GetEdgeId() == "" || len(hello.GetEdgeId()) > maxEdgeID || hello.GetIncarnation() == 0 {
		return nil, fmt.Errorf("%w: first message must be a hello with edge_id and incarnation", ErrInvalid)
	}
	return hello, nil
}

// maxDeltaBatch bounds how many queued deltas one apply round takes.
const maxDeltaBatch = 1024

// mergeDeltas returns req, and when it carries deltas, with the deltas of the
// delta messages queued right behind it appended (up to maxDeltaBatch): one
// apply round, one write per route key and one notification per tenant
// instead of one per subscribe. next is the first queued message that is
// not a delta batch, to handle after.
func mergeDeltas(req *routerv1.RouteSyncRequest, work <-chan *routerv1.RouteSyncRequest) (merged, next *routerv1.RouteSyncRequest) {
	ds := req.GetDeltas().GetDeltas()
	if ds == nil {
		return req, nil
	}
	for len(ds) < maxDeltaBatch {
		select {
		case r := <-work:
			more := r.GetDeltas()
			if more == nil {
				next = r
			} else {
				ds = append(slices.Clip(ds), more.GetDeltas()...)
				continue
			}
		default:
		}
		break
	}
	if next == nil && len(ds) == len(req.GetDeltas().GetDeltas()) {
		return req, nil
	}
	return &routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Deltas{Deltas: &routerv1.RouteDeltas{Deltas: ds}}}, next
}

// sendInitialLocked queues the full wildcard table, every Bloom filter and
// the ready mark on a new stream.
//
// n.mu must be held, so that later notifications queue after it.
func (n *Node) sendInitialLocked(c *edgeConn) {
	var deltas []*routerv1.WildcardDelta
	for tenant, w := range n.wild {
		w.set.Edges(func(r table.Route, e string, en table.Entry) {
			if n.dead[e] >= en.Inc {
				return
			}
			deltas = append(deltas, &routerv1.WildcardDelta{Route: &routerv1.Route{Tenant: tenant, Filter: r.Filter, ShareGroup: r.Group},
				EdgeId: e, Op: routerv1.RouteOp_ROUTE_OP_ADD, Incarnation: en.Inc, Seq: en.Seq})
		})
	}
	c.send(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Wildcard{Wildcard: &routerv1.WildcardDeltas{Reset_: true, Deltas: deltas}}})
	for tenant, bs := range n.blooms {
		n.sendBloomLocked(c, tenant, bs)
	}
	n.settleNewConnLocked(c)
	c.send(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Ready{Ready: &routerv1.RouteReady{}}})
}

const bloomChunk = 64 << 10

func (n *Node) sendBloomLocked(c *edgeConn, tenant string, bs *bloomState) {
	bits, m, k := bs.bloom.Bits()
	for off := 0; off < len(bits); off += bloomChunk {
		end := min(off+bloomChunk, len(bits))
		c.sendRoute(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Bloom{Bloom: &routerv1.BloomChunk{
			Tenant: tenant, Version: bs.version, BitCount: m, HashCount: k, Offset: uint64(off),
			Bits: slices.Clone(bits[off:end]), Last: end == len(bits)}}})
	}
}

func (n *Node) validRoute(r *routerv1.Route) error {
	if r == nil {
		return fmt.Errorf("%w: missing route", ErrInvalid)
	}
	if err := routes.Validate(keyOf(r), n.cfg.Limits); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return nil
}

// handleEdgeRequest runs on the stream's apply worker, in order.
func (n *Node) handleEdgeRequest(c *edgeConn, req *routerv1.RouteSyncRequest) error {
	ctx := c.ctx
	switch m := req.GetMsg().(type) {
	case *routerv1.RouteSyncRequest_Deltas:
		ds := m.Deltas.GetDeltas()
		last := uint64(0)
		for _, d := range ds {
			if d.GetSeq() <= last || (d.GetOp() != routerv1.RouteOp_ROUTE_OP_ADD && d.GetOp() != routerv1.RouteOp_ROUTE_OP_REMOVE) {
				return fmt.Errorf("%w: deltas must have increasing seqs and an op", ErrInvalid)
			}
			if err := n.validRoute(d.GetRoute()); err != nil {
				return err
			}
			last = d.GetSeq()
		}
		// Deltas at or below the seq the edge's record says was applied are
		// applied again all the same: the edge re-sends only what it was
		// never told was done, and the node that applied it may have died
		// before it notified the other nodes. applyKey takes such a delta
		// for a retry and notifies it again; skipped, it would be
		// acknowledged with nobody told.
		fresh := make([]*routerv1.EdgeDelta, 0, len(ds))
		for _, d := range ds {
			fresh = append(fresh, &routerv1.EdgeDelta{EdgeId: c.id, Incarnation: c.inc, Delta: d})
		}
		start := time.Now()
		rejected, err := n.routeDeltas(ctx, fresh)
		if err != nil {
			return err
		}
		rej := map[uint64]bool{}
		for _, r := range rejected {
			rej[r.GetSeq()] = true
		}
		for _, ed := range fresh {
			d := ed.GetDelta()
			if rej[d.GetSeq()] {
				continue
			}
			k := keyOf(d.GetRoute())
			_, has := c.routes[k]
			switch {
			case d.GetOp() == routerv1.RouteOp_ROUTE_OP_ADD && !has:
				c.routes[k] = d.GetCount()
				c.digest.Add(k)
			case d.GetOp() == routerv1.RouteOp_ROUTE_OP_REMOVE && has:
				delete(c.routes, k)
				c.digest.Remove(k)
			}
		}
		if len(fresh) > 0 {
			c.applied = max(c.applied, last)
			if err := n.storeEdge(ctx, c.id, edgeRecord{Inc: c.inc, Seq: c.applied, Count: c.digest.Count, Sum: c.digest.Sum, DeadInc: c.deadInc, SnapView: c.snapView}); err != nil {
				return err
			}
			n.m.applySeconds.Observe(time.Since(start).Seconds())
		}
		c.send(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Ack{Ack: &routerv1.RouteAck{Seq: last, Rejected: rejected}}})
	case *routerv1.RouteSyncRequest_Digest:
		d := m.Digest
		match := d.GetRouteCount() == c.digest.Count && d.GetDigest() == c.digest.Sum
		c.send(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_DigestResult{DigestResult: &routerv1.RouteDigestResult{Seq: d.GetSeq(), Match: match}}})
	case *routerv1.RouteSyncRequest_Snapshot:
		s := m.Snapshot
		for _, r := range s.GetRoutes() {
			if err := n.validRoute(r); err != nil {
				return err
			}
		}
		if len(c.snap) == 0 {
			c.snapshotsBegun.Add(1)
			c.snapStart = n.View()
		}
		c.snap = append(c.snap, s.GetRoutes()...)
		if len(c.snap) > 10_000_000 {
			return fmt.Errorf("%w: snapshot too large", ErrInvalid)
		}
		if !s.GetLast() {
			return nil
		}
		n.m.resyncs.Inc()
		var ds []*routerv1.EdgeDelta
		set := map[routes.Key]uint32{}
		var dig routes.Digest
		for _, r := range c.snap {
			k := keyOf(r)
			if _, dup := set[k]; dup {
				continue
			}
			set[k] = 1
			dig.Add(k)
			ds = append(ds, &routerv1.EdgeDelta{EdgeId: c.id, Incarnation: c.inc,
				Delta: &routerv1.RouteDelta{Seq: max(s.GetSeq(), 1), Route: r, Op: routerv1.RouteOp_ROUTE_OP_ADD}})
		}
		// Routes this node knew for the edge but missing from the snapshot.
		for k := range c.routes {
			if _, ok := set[k]; !ok {
				ds = append(ds, &routerv1.EdgeDelta{EdgeId: c.id, Incarnation: c.inc,
					Delta: &routerv1.RouteDelta{Seq: s.GetSeq() + 1, Route: &routerv1.Route{Tenant: k.Tenant, Filter: k.Filter, ShareGroup: k.Group}, Op: routerv1.RouteOp_ROUTE_OP_REMOVE}})
			}
		}
		c.snap = nil
		rejected, err := n.routeDeltas(ctx, ds)
		if err != nil {
			return err
		}
		// The routes of a re-sent set share its seq, so a refusal (the
		// wildcard cap, reached since the edge's own add was taken) cannot
		// go back under that seq: the edge would take it for its delta at
		// that seq. The routes refused are left out of what this node holds
		// for the edge, so its digest differs and the next one re-sends
		// the set.
		for _, rj := range rejected {
			k := keyOf(rj.GetRoute())
			if _, ok := set[k]; ok {
				delete(set, k)
				dig.Remove(k)
			}
			n.logger.Warn("route of a re-sent route set refused", logging.KeyEdgeID, c.id, "tenant", k.Tenant, "filter", k.Filter, "reason", rj.GetReason())
		}
		c.routes, c.digest = set, dig
		c.applied = max(c.applied, s.GetSeq())
		if v := n.View(); v == c.snapStart {
			c.snapView = v
		}
		if err := n.storeEdge(ctx, c.id, edgeRecord{Inc: c.inc, Seq: c.applied, Count: dig.Count, Sum: dig.Sum, DeadInc: c.deadInc, SnapView: c.snapView}); err != nil {
			return err
		}
		c.snapshots.Add(1)
		c.send(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Ack{Ack: &routerv1.RouteAck{Seq: s.GetSeq()}}})
	default:
		return fmt.Errorf("%w: unexpected message %T", ErrInvalid, req.GetMsg())
	}
	return nil
}

// Lookup resolves a topic for an edge without a valid cache entry.
func (n *Node) Lookup(ctx context.Context, req *connect.Request[routerv1.LookupRequest]) (*connect.Response[routerv1.LookupResponse], error) {
	resp, err := n.lookup(ctx, req.Msg)
	if err != nil {
		return nil, connectError(err)
	}
	return connect.NewResponse(resp), nil
}

func (n *Node) lookup(ctx context.Context, req *routerv1.LookupRequest) (*routerv1.LookupResponse, error) {
	start := time.Now()
	tenant, name := req.GetTenant(), req.GetTopic()
	if err := routes.ValidateTopic(tenant, name, n.cfg.Limits); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if len(req.GetEdgeId()) > maxEdgeID {
		return nil, fmt.Errorf("%w: edge_id too long", ErrInvalid)
	}
	if !n.loaded.Load() {
		n.m.lookupsRefused.Inc()
		return nil, ErrLoading
	}
	if start.UnixNano() < n.rebuildUntil.Load() {
		n.m.lookupsRefused.Inc()
		return nil, ErrRebuilding
	}
	var probes []string
	routes.ProbeAnchors(name, func(a string) bool { probes = append(probes, a); return true })
	// Register the caller as a cacher before reading, so a change that lands
	// after the read is sent to it (see handleNotify).
	n.mu.Lock()
	if req.GetEdgeId() != "" {
		until := start.Add(n.cfg.CacheLease + n.cfg.LeaseGrace)
		for _, a := range probes {
			ck := cacheKey{tenant, a}
			m := n.cachers[ck]
			if m == nil {
				m = map[string]time.Time{}
				n.cachers[ck] = m
			}
			m[req.GetEdgeId()] = until
		}
	}
	bs := n.blooms[tenant]
	var want []string
	for _, a := range probes {
		if bs == nil || bs.bloom.MayContain(a) {
			want = append(want, a)
		}
	}
	dead := map[string]uint64{}
	resp := &routerv1.LookupResponse{CacheLease: durationpb.New(n.cfg.CacheLease), Unsettled: n.settle.phase != phaseSettled}
	edges := map[string]bool{}
	groups := map[[2]string]map[string]bool{}
	add := func(r table.Route, e string) {
		if r.Group == "" {
			edges[e] = true
			return
		}
		g := groups[[2]string{r.Group, r.Filter}]
		if g == nil {
			g = map[string]bool{}
			groups[[2]string{r.Group, r.Filter}] = g
		}
		g[e] = true
	}
	if w := n.wild[tenant]; w != nil {
		w.trie.Match(name, func(v wildVal) bool {
			if en := w.set.Routes[v.route][v.edge]; n.dead[v.edge] < en.Inc {
				add(v.route, v.edge)
			}
			return true
		})
	}
	for e, inc := range n.dead {
		dead[e] = inc
	}
	n.mu.Unlock()

	sets := make([]*table.Set, len(want))
	errs := make([]error, len(want))
	var wg sync.WaitGroup
	for i, a := range want {
		wg.Go(func() { sets[i], errs[i] = n.loadSet(ctx, anchorKey(tenant, a)) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	got := map[string]*table.Set{}
	for i, a := range want {
		got[a] = sets[i]
	}
	for _, a := range probes {
		ar := &routerv1.AnchorRoutes{Anchor: a}
		if s := got[a]; s != nil {
			for r, es := range s.Routes {
				rr := &routerv1.AnchorRoute{Filter: r.Filter, ShareGroup: r.Group}
				for e, en := range es {
					if dead[e] >= en.Inc {
						continue
					}
					rr.EdgeIds = append(rr.EdgeIds, e)
					if topic.Match(r.Filter, name) {
						add(r, e)
					}
				}
				if len(rr.EdgeIds) > 0 {
					slices.Sort(rr.EdgeIds)
					ar.Routes = append(ar.Routes, rr)
				}
			}
		}
		resp.Anchors = append(resp.Anchors, ar)
	}
	for e := range edges {
		resp.EdgeIds = append(resp.EdgeIds, e)
	}
	slices.Sort(resp.EdgeIds)
	for g, es := range groups {
		sg := &routerv1.SharedGroupRoute{Group: g[0], Filter: g[1]}
		for e := range es {
			sg.EdgeIds = append(sg.EdgeIds, e)
		}
		slices.Sort(sg.EdgeIds)
		resp.SharedGroups = append(resp.SharedGroups, sg)
	}
	n.m.lookups.Inc()
	n.m.lookupSeconds.Observe(time.Since(start).Seconds())
	return resp, nil
}

// Status reports this node's view.
func (n *Node) Status(ctx context.Context, _ *connect.Request[routerv1.StatusRequest]) (*connect.Response[routerv1.StatusResponse], error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	var wr uint64
	for _, w := range n.wild {
		wr += uint64(w.trie.Len())
	}
	return connect.NewResponse(&routerv1.StatusResponse{NodeId: n.ID(), RouterMembers: slices.Clone(n.members),
		ConnectedEdges: uint32(len(n.conns)), WildcardRouteCount: wr, View: n.view, StaleWrites: n.staleWritesLocked(),
		Resynced: n.settle.phase == phaseResynced || n.settle.phase == phaseSettled, Settled: n.settle.phase == phaseSettled}), nil
}

// ApplyRoutes applies deltas forwarded by another router node.
func (n *Node) ApplyRoutes(ctx context.Context, req *connect.Request[routerv1.ApplyRoutesRequest]) (*connect.Response[routerv1.ApplyRoutesResponse], error) {
	for _, d := range req.Msg.GetDeltas() {
		if d.GetEdgeId() == "" || d.GetDelta() == nil {
			return nil, connectError(fmt.Errorf("%w: delta without edge", ErrInvalid))
		}
		if err := n.validRoute(d.GetDelta().GetRoute()); err != nil {
			return nil, connectError(err)
		}
	}
	// The sender chose this node as the owner under its view. Under another
	// one this node may not be the owner, and its write could drop a route
	// an owner it does not know of wrote: it applies anyway (bouncing the
	// deltas around would stall SUBACKs for as long as the views differ,
	// which a restart under the same name stretched past 20 s), but every
	// node stops trusting its answers, and the write counts as stale, so
	// the edges re-send their route sets only after it.
	gen, view := n.applyGen()
	if v := req.Msg.GetView(); v != 0 && v != view {
		n.unsettleEverywhere(ctx, fmt.Sprintf("router node %s forwarded a change under another membership view", req.Msg.GetSenderNodeId()))
		gen = foreignGen
	}
	rej, err := n.applyOwned(ctx, gen, view, req.Msg.GetDeltas())
	if err != nil {
		return nil, connectError(err)
	}
	return connect.NewResponse(&routerv1.ApplyRoutesResponse{Applied: uint32(len(req.Msg.GetDeltas())), Rejected: rej}), nil
}

// Notify passes a change from a key owner to this node's edges.
func (n *Node) Notify(ctx context.Context, req *connect.Request[routerv1.NotifyRequest]) (*connect.Response[routerv1.NotifyResponse], error) {
	for _, d := range req.Msg.GetWildcard().GetDeltas() {
		if err := n.validRoute(d.GetRoute()); err != nil {
			return nil, connectError(err)
		}
	}
	// A notification made under another membership view is refused: the
	// sender then tells every node to unsettle before it retries, so that
	// no node trusts its answers when the change is acknowledged (another
	// owner may write over it). One written under another view is taken,
	// but this node stops trusting its answers.
	sender := req.Msg.GetSenderNodeId()
	if req.Msg.GetUnsettle() {
		n.unsettle(fmt.Sprintf("router node %s saw the membership views differ", sender))
		return connect.NewResponse(&routerv1.NotifyResponse{}), nil
	}
	n.mu.Lock()
	v, wv := req.Msg.GetView(), req.Msg.GetWriteView()
	refuse := v != 0 && v != n.view
	switch {
	case refuse:
		n.unsettleLocked(fmt.Sprintf("router node %s has another membership view", sender))
	case wv != 0 && wv != n.view:
		n.unsettleLocked(fmt.Sprintf("router node %s wrote a change under another membership view", sender))
	}
	n.mu.Unlock()
	if refuse {
		return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("%w: sender %s", ErrOtherView, sender))
	}
	return connect.NewResponse(&routerv1.NotifyResponse{Edges: uint32(n.handleNotify(ctx, req.Msg))}), nil
}

// RemoveEdge removes every route of a dead edge incarnation.
func (n *Node) RemoveEdge(ctx context.Context, req *connect.Request[routerv1.RemoveEdgeRequest]) (*connect.Response[routerv1.RemoveEdgeResponse], error) {
	id, inc := req.Msg.GetEdgeId(), req.Msg.GetIncarnation()
	if id == "" || len(id) > maxEdgeID || inc == 0 {
		return nil, connectError(fmt.Errorf("%w: edge_id and incarnation required", ErrInvalid))
	}
	removed, err := n.removeEdge(ctx, id, inc)
	if err != nil {
		return nil, connectError(err)
	}
	return connect.NewResponse(&routerv1.RemoveEdgeResponse{RoutesRemoved: removed}), nil
}

func (n *Node) removeEdge(ctx context.Context, id string, inc uint64) (uint64, error) {
	rec, err := n.loadEdge(ctx, id)
	if err != nil {
		return 0, err
	}
	if rec.DeadInc < inc {
		rec.DeadInc = inc
		if err := n.storeEdge(ctx, id, rec); err != nil {
			return 0, err
		}
	}
	// Lookups and edges stop using the routes first; removal follows.
	n.notifyAll(ctx, &routerv1.NotifyRequest{SenderNodeId: n.ID(), Invalidation: &routerv1.RouteInvalidation{
		DeadEdges: []*routerv1.DeadEdge{{EdgeId: id, Incarnation: inc}}}})
	var keys []string
	for _, p := range []string{prefixAnchor, prefixWild} {
		if err := n.st.Scan(ctx, p, func(k string) bool { keys = append(keys, k); return true }); err != nil {
			return 0, err
		}
	}
	var ds []*routerv1.EdgeDelta
	for _, k := range keys {
		s, err := n.loadSet(ctx, k)
		if err != nil {
			return 0, err
		}
		tenant := k[2:]
		if k[:2] == prefixAnchor {
			for i := 0; i < len(tenant); i++ {
				if tenant[i] == '/' {
					tenant = tenant[:i]
					break
				}
			}
		}
		s.Edges(func(r table.Route, e string, en table.Entry) {
			if e == id && en.Inc <= inc {
				ds = append(ds, &routerv1.EdgeDelta{EdgeId: id, Incarnation: inc, Delta: &routerv1.RouteDelta{Seq: math.MaxUint64,
					Route: &routerv1.Route{Tenant: tenant, Filter: r.Filter, ShareGroup: r.Group}, Op: routerv1.RouteOp_ROUTE_OP_REMOVE}})
			}
		})
	}
	if _, err := n.routeDeltas(ctx, ds); err != nil {
		return 0, err
	}
	return uint64(len(ds)), nil
}
