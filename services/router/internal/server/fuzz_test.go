package server

import (
	"context"
	"errors"
	"maps"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/libs/routes"
	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
	"github.com/keelmq/keel/services/router/internal/table"
)

// syncFrames are RouteSync requests from edges, valid and not, shared by the
// fuzz seeds and the unit tests.
var syncFrames = []*routerv1.RouteSyncRequest{
	hello("e1", 1),
	hello("", 1),
	hello("e1", 0),
	hello(strings.Repeat("e", 300), 1),
	{Msg: &routerv1.RouteSyncRequest_Ack{Ack: &routerv1.RouteSyncAck{RouterSeq: 3}}},
	{},
	deltaFrame(&routerv1.RouteDelta{Seq: 1, Op: routerv1.RouteOp_ROUTE_OP_ADD, Route: &routerv1.Route{Tenant: "t1", Filter: "a/b"}}),
	deltaFrame(&routerv1.RouteDelta{Seq: 1, Op: routerv1.RouteOp_ROUTE_OP_ADD, Route: &routerv1.Route{Tenant: "t1", Filter: "+/b/#"}},
		&routerv1.RouteDelta{Seq: 2, Op: routerv1.RouteOp_ROUTE_OP_ADD, Route: &routerv1.Route{Tenant: "t1", Filter: "a/#", ShareGroup: "g"}},
		&routerv1.RouteDelta{Seq: 3, Op: routerv1.RouteOp_ROUTE_OP_REMOVE, Route: &routerv1.Route{Tenant: "t1", Filter: "a/b"}}),
	deltaFrame(&routerv1.RouteDelta{Seq: 2, Op: routerv1.RouteOp_ROUTE_OP_ADD, Route: &routerv1.Route{Tenant: "t1", Filter: "x"}},
		&routerv1.RouteDelta{Seq: 2, Op: routerv1.RouteOp_ROUTE_OP_ADD, Route: &routerv1.Route{Tenant: "t1", Filter: "y"}}), // seq not increasing
	deltaFrame(&routerv1.RouteDelta{Seq: 1, Op: routerv1.RouteOp_ROUTE_OP_ADD, Route: &routerv1.Route{Tenant: "t1", Filter: "a/#/b"}}),
	deltaFrame(&routerv1.RouteDelta{Seq: 1, Op: routerv1.RouteOp_ROUTE_OP_ADD, Route: &routerv1.Route{Tenant: "BAD", Filter: "a"}}),
	deltaFrame(&routerv1.RouteDelta{Seq: 1, Op: routerv1.RouteOp_ROUTE_OP_ADD, Route: &routerv1.Route{Tenant: "t1", Filter: "$share/g/x"}}),
	deltaFrame(&routerv1.RouteDelta{Seq: 1, Op: routerv1.RouteOp_ROUTE_OP_ADD, Route: &routerv1.Route{Tenant: "t1", Filter: "a", ShareGroup: "g/h"}}),
	deltaFrame(&routerv1.RouteDelta{Seq: 1, Route: &routerv1.Route{Tenant: "t1", Filter: "a"}}),
	deltaFrame(&routerv1.RouteDelta{Seq: 1, Op: routerv1.RouteOp_ROUTE_OP_ADD}),
	{Msg: &routerv1.RouteSyncRequest_Digest{Digest: &routerv1.RouteSetDigest{Seq: 1, RouteCount: 1, Digest: 42}}},
	{Msg: &routerv1.RouteSyncRequest_Snapshot{Snapshot: &routerv1.RouteSetSnapshot{Seq: 4, Last: true, Routes: []*routerv1.Route{
		{Tenant: "t1", Filter: "s/1"}, {Tenant: "t2", Filter: "#"}, {Tenant: "t1", Filter: "s/1"}}}}},
	{Msg: &routerv1.RouteSyncRequest_Snapshot{Snapshot: &routerv1.RouteSetSnapshot{Seq: 4, Routes: []*routerv1.Route{{Tenant: "t1", Filter: "s/2"}}}}},
	{Msg: &routerv1.RouteSyncRequest_Snapshot{Snapshot: &routerv1.RouteSetSnapshot{Seq: 4, Last: true, Routes: []*routerv1.Route{{Tenant: "t1", Filter: ""}}}}},
}

func hello(id string, inc uint64) *routerv1.RouteSyncRequest {
	return &routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Hello{Hello: &routerv1.RouteSyncHello{EdgeId: id, Incarnation: inc}}}
}

func deltaFrame(ds ...*routerv1.RouteDelta) *routerv1.RouteSyncRequest {
	return &routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Deltas{Deltas: &routerv1.RouteDeltas{Deltas: ds}}}
}

func mustMarshal(tb testing.TB, m proto.Message) []byte {
	b, err := proto.Marshal(m)
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

// checkStored fails unless every route key in st decodes and holds only
// routes that pass validation under the key's tenant.
func checkStored(t *testing.T, st *memStore) {
	t.Helper()
	for _, k := range st.keys("") {
		if !strings.HasPrefix(k, prefixAnchor) && !strings.HasPrefix(k, prefixWild) {
			continue
		}
		b, _ := st.Get(context.Background(), k)
		s, err := table.Unmarshal(b)
		if err != nil {
			t.Fatalf("stored %s does not decode: %v", k, err)
		}
		tenant, _, _ := strings.Cut(k[2:], "/")
		s.Edges(func(r table.Route, e string, _ table.Entry) {
			if err := routes.Validate(routes.Key{Tenant: tenant, Filter: r.Filter, Group: r.Group}, routes.DefaultLimits); err != nil {
				t.Fatalf("stored invalid route %q under %s: %v", r, k, err)
			}
			if got := routeKey(routes.Key{Tenant: tenant, Filter: r.Filter}); got != k {
				t.Fatalf("route %q stored under %s, belongs under %s", r, k, got)
			}
		})
	}
}

// FuzzNode_RouteSyncFrames feeds a hello and two more frames, as an edge
// would send them, through the stream's validation and apply path over an
// in-memory store. A refused frame must be refused as invalid input and
// leave the store as it was; whatever is stored must be valid.
func FuzzNode_RouteSyncFrames(f *testing.F) {
	for i, a := range syncFrames {
		b := syncFrames[(i+7)%len(syncFrames)]
		f.Add(mustMarshal(f, hello("e1", 1)), mustMarshal(f, a), mustMarshal(f, b))
		f.Add(mustMarshal(f, a), mustMarshal(f, b), []byte{})
	}
	f.Add([]byte{0xff, 0x01}, []byte("garbage"), []byte{0x12, 0x00})
	f.Fuzz(func(t *testing.T, h, f1, f2 []byte) {
		var first routerv1.RouteSyncRequest
		if proto.Unmarshal(h, &first) != nil {
			return // the Connect codec refuses the frame before us
		}
		hl, err := checkHello(&first)
		if err != nil {
			if !errors.Is(err, ErrInvalid) || connect.CodeOf(connectError(err)) != connect.CodeInvalidArgument {
				t.Fatalf("bad hello refused with %v", err)
			}
			return
		}
		n, st := newMemNode(t)
		c := newEdgeConn(t.Context(), hl.GetEdgeId(), hl.GetIncarnation(), 64)
		defer c.close(context.Canceled)
		for _, fr := range [][]byte{f1, f2} {
			var req routerv1.RouteSyncRequest
			if proto.Unmarshal(fr, &req) != nil {
				return
			}
			if req.GetAck() != nil {
				continue // handled by the receive loop, never stored
			}
			before := maps.Clone(st.m)
			if err := n.handleEdgeRequest(c, &req); err != nil {
				if !errors.Is(err, ErrInvalid) || connect.CodeOf(connectError(err)) != connect.CodeInvalidArgument {
					t.Fatalf("frame refused with %v, want invalid argument", err)
				}
				if !maps.EqualFunc(before, st.m, func(a, b []byte) bool { return string(a) == string(b) }) {
					t.Fatal("a refused frame changed the store")
				}
				return
			}
			checkStored(t, st)
		}
	})
}

// FuzzNode_Lookup: any Lookup request is answered or refused as invalid.
func FuzzNode_Lookup(f *testing.F) {
	for _, s := range []struct{ tenant, topic, edge string }{
		{"t1", "a/b", "e1"}, {"t1", "$SYS/x", ""}, {"T!", "a", ""}, {"t1", "a/+", "e"}, {"t1", "", ""},
		{"t1", "/", ""}, {"t1", "a//b", ""}, {"t1", strings.Repeat("a/", 40), ""}, {"t1", "a", strings.Repeat("e", 300)},
	} {
		f.Add(s.tenant, s.topic, s.edge)
	}
	f.Fuzz(func(t *testing.T, tenant, topic, edge string) {
		n, _ := newMemNode(t)
		c := newEdgeConn(t.Context(), "e0", 1, 64)
		if err := n.handleEdgeRequest(c, syncFrames[7]); err != nil {
			t.Fatal(err)
		}
		resp, err := n.lookup(t.Context(), &routerv1.LookupRequest{Tenant: tenant, Topic: topic, EdgeId: edge, Incarnation: 1})
		if err != nil {
			if connect.CodeOf(connectError(err)) != connect.CodeInvalidArgument {
				t.Fatalf("lookup failed with %v", err)
			}
			return
		}
		for _, e := range resp.GetEdgeIds() {
			if e != "e0" || tenant != "t1" {
				t.Fatalf("lookup %s %q answered edge %s", tenant, topic, e)
			}
		}
	})
}

// FuzzNode_PeerRequests: ApplyRoutes and Notify come from other router nodes
// over the network; garbage must be refused or applied validly, never crash.
func FuzzNode_PeerRequests(f *testing.F) {
	f.Add(mustMarshal(f, &routerv1.ApplyRoutesRequest{Deltas: []*routerv1.EdgeDelta{{EdgeId: "e1", Incarnation: 1, Delta: syncFrames[6].GetDeltas().GetDeltas()[0]}}}),
		mustMarshal(f, &routerv1.NotifyRequest{Invalidation: &routerv1.RouteInvalidation{Tenant: "t1", Anchors: []string{"a"}, NewAnchors: []string{"a"},
			DeadEdges: []*routerv1.DeadEdge{{EdgeId: "e1", Incarnation: 1}}}}))
	f.Add(mustMarshal(f, &routerv1.ApplyRoutesRequest{Deltas: []*routerv1.EdgeDelta{{EdgeId: "", Delta: &routerv1.RouteDelta{}}}}),
		mustMarshal(f, &routerv1.NotifyRequest{Wildcard: &routerv1.WildcardDeltas{Deltas: []*routerv1.WildcardDelta{
			{Route: &routerv1.Route{Tenant: "t1", Filter: "#"}, EdgeId: "e1", Op: routerv1.RouteOp_ROUTE_OP_ADD, Incarnation: 1},
			{Route: &routerv1.Route{Tenant: "t1", Filter: "a/#/b"}, EdgeId: "e1", Op: routerv1.RouteOp_ROUTE_OP_REMOVE}}}}))
	f.Fuzz(func(t *testing.T, apply, notify []byte) {
		n, st := newMemNode(t)
		var ar routerv1.ApplyRoutesRequest
		if proto.Unmarshal(apply, &ar) == nil {
			if _, err := n.ApplyRoutes(t.Context(), connect.NewRequest(&ar)); err != nil && connect.CodeOf(err) != connect.CodeInvalidArgument {
				t.Fatalf("apply routes: %v", err)
			}
			checkStored(t, st)
		}
		var nr routerv1.NotifyRequest
		if proto.Unmarshal(notify, &nr) == nil {
			if _, err := n.Notify(t.Context(), connect.NewRequest(&nr)); err != nil && connect.CodeOf(err) != connect.CodeInvalidArgument {
				t.Fatalf("notify: %v", err)
			}
		}
		if _, err := n.lookup(t.Context(), &routerv1.LookupRequest{Tenant: "t1", Topic: "a/b"}); err != nil {
			t.Fatal(err)
		}
	})
}

// TestNode_WildcardCap: a wildcard-first add past the tenant's cap is
// refused with its own seq and stored nowhere, and the deltas beside it
// are taken. A re-sent route set whose wildcard-first route is refused
// (the cap reached since the edge's add was taken) answers no refusal
// under the set's seq, which the edge would take for its own delta at
// that seq; the node leaves the route out of what it holds for the edge,
// so the edge's next digest differs and re-sends the set.
func TestNode_WildcardCap(t *testing.T) {
	n, st := newMemNode(t)
	n.cfg.WildcardCap = 2
	ack := func(c *edgeConn) *routerv1.RouteAck {
		t.Helper()
		for {
			select {
			case m := <-c.out:
				if a := m.GetAck(); a != nil {
					return a
				}
			default:
				t.Fatal("no ack queued")
			}
		}
	}
	add := func(seq uint64, filter string) *routerv1.RouteDelta {
		return &routerv1.RouteDelta{Seq: seq, Op: routerv1.RouteOp_ROUTE_OP_ADD, Route: &routerv1.Route{Tenant: "t1", Filter: filter}}
	}
	routedTo := func(topic string) []string {
		t.Helper()
		l, err := n.lookup(t.Context(), &routerv1.LookupRequest{Tenant: "t1", Topic: topic})
		if err != nil {
			t.Fatal(err)
		}
		return l.GetEdgeIds()
	}
	c1 := newEdgeConn(t.Context(), "e1", 1, 64)
	defer c1.close(context.Canceled)
	if err := n.handleEdgeRequest(c1, deltaFrame(add(1, "+/a"), add(2, "+/b"), add(3, "+/c"), add(4, "x/y"))); err != nil {
		t.Fatal(err)
	}
	a := ack(c1)
	if a.GetSeq() != 4 || len(a.GetRejected()) != 1 || a.GetRejected()[0].GetSeq() != 3 {
		t.Fatalf("ack %v: want seq 4 with seq 3 refused", a)
	}
	if got := routedTo("q/c"); len(got) != 0 {
		t.Fatalf("refused +/c routed to %v", got)
	}
	if got := routedTo("x/y"); len(got) != 1 || got[0] != "e1" {
		t.Fatalf("x/y routed to %v, want [e1]", got)
	}
	checkStored(t, st)

	c2 := newEdgeConn(t.Context(), "e2", 1, 64)
	defer c2.close(context.Canceled)
	snap := []*routerv1.Route{{Tenant: "t1", Filter: "+/d"}, {Tenant: "t1", Filter: "k/1"}}
	if err := n.handleEdgeRequest(c2, &routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Snapshot{Snapshot: &routerv1.RouteSetSnapshot{Seq: 5, Last: true, Routes: snap}}}); err != nil {
		t.Fatal(err)
	}
	if a := ack(c2); a.GetSeq() != 5 || len(a.GetRejected()) != 0 {
		t.Fatalf("route set ack %v: want seq 5 and no refusal under it", a)
	}
	if got := routedTo("k/1"); len(got) != 1 || got[0] != "e2" {
		t.Fatalf("k/1 routed to %v, want [e2]", got)
	}
	if got := routedTo("q/d"); len(got) != 0 {
		t.Fatalf("refused +/d routed to %v", got)
	}
	var dig routes.Digest
	for _, r := range snap {
		dig.Add(keyOf(r))
	}
	if err := n.handleEdgeRequest(c2, &routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Digest{Digest: &routerv1.RouteSetDigest{Seq: 5, RouteCount: dig.Count, Digest: dig.Sum}}}); err != nil {
		t.Fatal(err)
	}
	if m := <-c2.out; m.GetDigestResult() == nil || m.GetDigestResult().GetMatch() {
		t.Fatalf("digest of the set with the refused route answered %v, want a mismatch", m)
	}
}
