package routerclient

import (
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/libs/routes"
	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
)

// FuzzClient_ApplyFrames feeds router frames (wildcard deltas, invalidations,
// Bloom chunks) to the edge's state and then routes a topic locally: nothing
// a router sends may crash the edge.
func FuzzClient_ApplyFrames(f *testing.F) {
	bl := routes.NewBloom(64, 0.01)
	bl.Add("a")
	bits, m, k := bl.Bits()
	for _, msg := range []*routerv1.RouteSyncResponse{
		{Msg: &routerv1.RouteSyncResponse_Wildcard{Wildcard: &routerv1.WildcardDeltas{Reset_: true, Deltas: []*routerv1.WildcardDelta{
			{Route: &routerv1.Route{Tenant: "t1", Filter: "+/b"}, EdgeId: "e", Op: routerv1.RouteOp_ROUTE_OP_ADD, Incarnation: 1},
			{Route: &routerv1.Route{Tenant: "t1", Filter: "#", ShareGroup: "g"}, EdgeId: "e", Op: routerv1.RouteOp_ROUTE_OP_ADD, Incarnation: 1}}}}},
		{Msg: &routerv1.RouteSyncResponse_Wildcard{Wildcard: &routerv1.WildcardDeltas{Deltas: []*routerv1.WildcardDelta{
			{Route: &routerv1.Route{Tenant: "t1", Filter: "+/b"}, EdgeId: "e", Op: routerv1.RouteOp_ROUTE_OP_REMOVE, Incarnation: 1}}}}},
		{Msg: &routerv1.RouteSyncResponse_Invalidation{Invalidation: &routerv1.RouteInvalidation{Tenant: "t1", Anchors: []string{"a"}, NewAnchors: []string{"a/b"},
			DeadEdges: []*routerv1.DeadEdge{{EdgeId: "e", Incarnation: 1}}}}},
		{Msg: &routerv1.RouteSyncResponse_Bloom{Bloom: &routerv1.BloomChunk{Tenant: "t1", Version: 1, BitCount: m, HashCount: k, Bits: bits, Last: true}}},
		{Msg: &routerv1.RouteSyncResponse_Bloom{Bloom: &routerv1.BloomChunk{Tenant: "t1", Version: 2, BitCount: 128, HashCount: 2, Offset: ^uint64(0), Bits: []byte{1}, Last: true}}},
	} {
		b, err := proto.Marshal(msg)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b, "a/b")
	}
	f.Fuzz(func(t *testing.T, frame []byte, topic string) {
		var msg routerv1.RouteSyncResponse
		if proto.Unmarshal(frame, &msg) != nil {
			return
		}
		c, err := New(Config{URL: "http://127.0.0.1:1", EdgeID: "e0", Incarnation: 1})
		if err != nil {
			t.Fatal(err)
		}
		for range 2 { // twice: a second chunk or delta meets the state the first left
			switch m := msg.GetMsg().(type) {
			case *routerv1.RouteSyncResponse_Wildcard:
				c.applyWildcard(m.Wildcard)
			case *routerv1.RouteSyncResponse_Invalidation:
				c.invalidate(m.Invalidation)
			case *routerv1.RouteSyncResponse_Bloom:
				c.applyBloom(m.Bloom)
			}
		}
		c.mu.Lock()
		c.ready, c.lastHB, c.lease = true, time.Now(), time.Hour
		c.bloomBuf = map[string]*bloomAsm{}
		c.mu.Unlock()
		if routes.ValidateTopic("t1", topic, routes.DefaultLimits) != nil {
			return
		}
		// Answer locally when the Bloom filter allows; a miss would need an
		// RPC to a closed port, so only probe the local state.
		c.mu.Lock()
		if w := c.wild["t1"]; w != nil {
			w.Match(topic, func(wildVal) bool { return true })
		}
		if b := c.blooms["t1"]; b != nil {
			routes.ProbeAnchors(topic, func(a string) bool { b.MayContain(a); return true })
		}
		c.mu.Unlock()
	})
}
