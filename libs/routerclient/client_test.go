package routerclient

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/keelmq/keel/libs/routes"
	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
)

func TestNew_Validation(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"no_url", Config{EdgeID: "e", Incarnation: 1}},
		{"no_edge", Config{URL: "http://x", Incarnation: 1}},
		{"no_incarnation", Config{URL: "http://x", EdgeID: "e"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(tc.cfg)
			require.Error(t, err)
		})
	}
	reg := prometheus.NewRegistry()
	_, err := New(Config{URL: "http://x", EdgeID: "e", Incarnation: 1, Registerer: reg})
	require.NoError(t, err)
	_, err = New(Config{URL: "http://x", EdgeID: "e", Incarnation: 1, Registerer: reg})
	require.Error(t, err, "registering twice in one registry must fail")
}

func TestClient_SubscribeAggregates(t *testing.T) {
	t.Parallel()
	f := startFake(t, time.Second)
	c := startClient(t, nil, f.url)
	ctx := t.Context()
	require.NoError(t, c.Subscribe(ctx, "t1", "a/+"))
	require.NoError(t, c.Subscribe(ctx, "t1", "a/+")) // second local subscriber: no delta
	require.NoError(t, c.Subscribe(ctx, "t1", "$share/g1/a/#"))
	require.NoError(t, c.Subscribe(ctx, "t1", "$queue/q"))
	require.NoError(t, c.Unsubscribe(ctx, "t1", "a/+")) // one subscriber left: no delta
	require.NoError(t, c.Unsubscribe(ctx, "t1", "a/+"))
	require.NoError(t, c.Unsubscribe(ctx, "t1", "never/subscribed")) // nothing to remove
	_, ds, _ := f.received()
	type d struct {
		seq                   uint64
		op                    routerv1.RouteOp
		tenant, filter, group string
	}
	var got []d
	for _, x := range ds {
		got = append(got, d{x.GetSeq(), x.GetOp(), x.GetRoute().GetTenant(), x.GetRoute().GetFilter(), x.GetRoute().GetShareGroup()})
	}
	require.Equal(t, []d{
		{1, routerv1.RouteOp_ROUTE_OP_ADD, "t1", "a/+", ""},
		{2, routerv1.RouteOp_ROUTE_OP_ADD, "t1", "a/#", "g1"},
		{3, routerv1.RouteOp_ROUTE_OP_ADD, "t1", "q", "$queue"},
		{4, routerv1.RouteOp_ROUTE_OP_REMOVE, "t1", "a/+", ""},
	}, got)
	// Invalid input never reaches the router.
	for _, bad := range []struct{ tenant, filter string }{{"T1", "a"}, {"t1", "a/#/b"}, {"t1", "$share//a"}, {"t1", ""}} {
		require.Error(t, c.Subscribe(ctx, bad.tenant, bad.filter), "%v", bad)
	}
	_, ds, _ = f.received()
	require.Len(t, ds, 4)
}

func TestClient_SubscribeRejected(t *testing.T) {
	t.Parallel()
	f := startFake(t, time.Second)
	f.reject = func(d *routerv1.RouteDelta) string {
		if d.GetRoute().GetFilter() == "#" {
			return "wildcard cap"
		}
		return ""
	}
	c := startClient(t, nil, f.url)
	err := c.Subscribe(t.Context(), "t1", "#")
	require.ErrorIs(t, err, ErrRejected)
	// The refused route is not held locally: the next subscriber tries again.
	require.ErrorIs(t, c.Subscribe(t.Context(), "t1", "#"), ErrRejected)
	_, ds, _ := f.received()
	require.Len(t, ds, 2)
	require.Equal(t, routerv1.RouteOp_ROUTE_OP_ADD, ds[1].GetOp())
}

// TestClient_ConcurrentSubscribesInSeqOrder: deltas of concurrent
// subscribers reach the router in seq order. The router skips any delta at
// or below the last seq it applied, so a delta overtaken by a later one
// would be acked (cumulatively) without ever being stored.
func TestClient_ConcurrentSubscribesInSeqOrder(t *testing.T) {
	t.Parallel()
	f := startFake(t, time.Second)
	c := startClient(t, nil, f.url)
	var wg sync.WaitGroup
	const n = 300
	for i := range n {
		wg.Go(func() { require.NoError(t, c.Subscribe(t.Context(), "t1", fmt.Sprintf("dev/%d/cmd", i))) })
	}
	wg.Wait()
	_, ds, _ := f.received()
	require.Len(t, ds, n)
	for i, d := range ds {
		require.EqualValues(t, i+1, d.GetSeq(), "delta %d arrived out of order", i)
	}
}

// TestClient_ReconnectResends: deltas not acked when a stream breaks are
// re-sent on the next stream, after the hello and before the digest, to the
// next router URL; a digest mismatch makes the client send its whole set.
func TestClient_ReconnectResends(t *testing.T) {
	t.Parallel()
	f1 := startFake(t, time.Second)
	f2 := startFake(t, time.Second)
	f2.match.Store(false)
	c := startClient(t, nil, f1.url, f2.url)
	f1.waitReady(t, c)
	require.NoError(t, c.Subscribe(t.Context(), "t1", "keep/me"))
	f1.ackOn.Store(false)
	errc := make(chan error, 1)
	go func() { errc <- c.Subscribe(t.Context(), "t1", "pending/one") }()
	eventually(t, func() bool { _, ds, _ := f1.received(); return len(ds) == 2 })
	f1.breakStream()
	require.NoError(t, <-errc) // acked by f2, on the re-sent delta or the snapshot
	// The ack can come before f2 read the digest sent behind the delta.
	eventually(t, func() bool { msgs, _, _ := f2.received(); return len(msgs) >= 2 })
	msgs, ds, hellos := f2.received()
	require.Len(t, hellos, 1)
	require.EqualValues(t, 1, hellos[0].GetAckedSeq())
	require.Equal(t, []uint64{2}, []uint64{ds[0].GetSeq()})
	require.IsType(t, &routerv1.RouteSyncRequest_Deltas{}, msgs[0].GetMsg())
	require.IsType(t, &routerv1.RouteSyncRequest_Digest{}, msgs[1].GetMsg())
	require.EqualValues(t, 2, msgs[1].GetDigest().GetRouteCount())
	eventually(t, func() bool { f2.mu.Lock(); defer f2.mu.Unlock(); return len(f2.snapshots) == 1 })
	f2.mu.Lock()
	snap := f2.snapshots[0]
	f2.mu.Unlock()
	require.True(t, snap.GetLast())
	require.EqualValues(t, 2, snap.GetSeq())
	var filters []string
	for _, r := range snap.GetRoutes() {
		filters = append(filters, r.GetFilter())
	}
	require.ElementsMatch(t, []string{"keep/me", "pending/one"}, filters)
	// Lookups follow the stream to the second router.
	f2.waitReady(t, c)
	_, err := c.Route(t.Context(), "t1", "x/y")
	require.NoError(t, err)
	require.Equal(t, 1, f2.lookupCount())
	require.Zero(t, f1.lookupCount())
}

// TestClient_RouteLocalAndLookup walks the answer sources: wildcard trie,
// Bloom negative, Lookup then cache hit, invalidation, and lease expiry when
// heartbeats stop (the stalled-stream path).
func TestClient_RouteLocalAndLookup(t *testing.T) {
	t.Parallel()
	f := startFake(t, 400*time.Millisecond)
	reg := prometheus.NewRegistry()
	c := startClient(t, func(cfg *Config) { cfg.Registerer = reg }, f.url)
	f.waitReady(t, c)
	ctx := t.Context()

	// Not known: no Bloom for the tenant, so a Lookup.
	f.lookup = nil
	r, err := c.Route(ctx, "t1", "a/b")
	require.NoError(t, err)
	require.True(t, r.Looked)
	require.Empty(t, r.Edges)

	bl := routes.NewBloom(1024, 0.01)
	bl.Add("dev/1")
	bits, m, k := bl.Bits()
	f.push(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Bloom{Bloom: &routerv1.BloomChunk{Tenant: "t1", Version: 1, BitCount: m, HashCount: k, Bits: bits, Last: true}}})
	f.push(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Wildcard{Wildcard: &routerv1.WildcardDeltas{Deltas: []*routerv1.WildcardDelta{
		{Route: &routerv1.Route{Tenant: "t1", Filter: "+/+/status"}, EdgeId: "e2", Op: routerv1.RouteOp_ROUTE_OP_ADD, Incarnation: 1},
		{Route: &routerv1.Route{Tenant: "t1", Filter: "#", ShareGroup: "g"}, EdgeId: "e3", Op: routerv1.RouteOp_ROUTE_OP_ADD, Incarnation: 1},
	}}}})
	eventually(t, func() bool { c.mu.Lock(); defer c.mu.Unlock(); return c.blooms["t1"] != nil && c.wild["t1"] != nil })

	held, ok, err := c.RouteAtOnce("t1", "x/y/status")
	require.NoError(t, err)
	require.True(t, ok, "held: no lookup needed")
	r, err = c.Route(ctx, "t1", "x/y/status")
	require.Equal(t, r, held, "RouteAtOnce answers as Route does")
	require.NoError(t, err)
	require.False(t, r.Looked, "wildcard + Bloom negatives answer locally")
	require.Equal(t, []string{"e2"}, r.Edges)
	require.Equal(t, []Group{{Name: "g", Filter: "#", Edges: []string{"e3"}}}, r.Groups)
	r, err = c.Route(ctx, "t1", "$SYS/y/status")
	require.NoError(t, err)
	require.False(t, r.Looked)
	require.Empty(t, r.Edges, "wildcard-first filters never match $ topics")
	require.Empty(t, r.Groups)
	r, err = c.Route(ctx, "t2", "x/y/status")
	require.NoError(t, err)
	require.Empty(t, r.Edges, "tenant isolation")

	// Bloom says dev/1 may exist: Lookup, then cached.
	lookups := f.lookupCount()
	f.mu.Lock()
	f.lookup = func(req *routerv1.LookupRequest) (*routerv1.LookupResponse, error) {
		return &routerv1.LookupResponse{EdgeIds: []string{"e9"}, CacheLease: durationpb.New(time.Hour), Anchors: []*routerv1.AnchorRoutes{
			{Anchor: "dev"}, {Anchor: "dev/1", Routes: []*routerv1.AnchorRoute{{Filter: "dev/1/#", EdgeIds: []string{"e9"}}}}, {Anchor: "dev/1/temp"}}}, nil
	}
	f.mu.Unlock()
	_, ok, _ = c.RouteAtOnce("t1", "dev/1/temp")
	require.False(t, ok)
	r, err = c.Route(ctx, "t1", "dev/1/temp")
	require.NoError(t, err)
	require.True(t, r.Looked)
	require.Equal(t, []string{"e9"}, r.Edges)
	held, ok, _ = c.RouteAtOnce("t1", "dev/1/temp")
	require.True(t, ok)
	require.Equal(t, []string{"e9"}, held.Edges)
	r, err = c.Route(ctx, "t1", "dev/1/temp")
	require.NoError(t, err)
	require.False(t, r.Looked, "cached")
	require.Equal(t, []string{"e9"}, r.Edges)
	require.Equal(t, lookups+1, f.lookupCount())

	// Invalidation drops the anchor; the next Route asks again.
	f.push(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Invalidation{Invalidation: &routerv1.RouteInvalidation{Tenant: "t1", Anchors: []string{"dev/1"}}}})
	eventually(t, func() bool { c.mu.Lock(); defer c.mu.Unlock(); return c.cache[[2]string{"t1", "dev/1"}] == nil })
	_, ok, _ = c.RouteAtOnce("t1", "dev/1/temp")
	require.False(t, ok)
	r, err = c.Route(ctx, "t1", "dev/1/temp")
	require.NoError(t, err)
	require.True(t, r.Looked)

	// Heartbeats stop: within one lease nothing local is trusted any more.
	f.hbOn.Store(false)
	eventually(t, func() bool { return !c.Ready() })
	_, ok, _ = c.RouteAtOnce("t1", "x/y/status")
	require.False(t, ok)
	r, err = c.Route(ctx, "t1", "x/y/status")
	require.NoError(t, err)
	require.True(t, r.Looked, "no valid lease: Lookup even for wildcard-only answers")
	f.hbOn.Store(true)
	eventually(t, func() bool { return c.Ready() })

	st := c.Stats()
	require.Positive(t, st.Local)
	require.Positive(t, st.BloomNegatives)
	require.Positive(t, st.CacheHits)
	require.Positive(t, st.Misses)
	require.Equal(t, st.Routes, st.Local+st.Lookups)
	mfs, err := reg.Gather()
	require.NoError(t, err)
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			name := mf.GetName()
			for _, l := range m.GetLabel() {
				name += "{" + l.GetValue() + "}"
			}
			switch {
			case m.GetCounter() != nil:
				got[name] = m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				got[name] = m.GetGauge().GetValue()
			case m.GetHistogram() != nil:
				got[name] = float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	require.Equal(t, float64(st.Routes), got["keel_edge_route_requests_total"])
	require.Equal(t, float64(st.Local), got["keel_edge_route_local_answers_total"])
	require.Equal(t, float64(st.Lookups), got["keel_edge_route_lookups_total"])
	require.Equal(t, float64(st.CacheHits), got["keel_edge_route_anchor_probes_total{cache_hit}"])
	require.Equal(t, float64(st.BloomNegatives), got["keel_edge_route_anchor_probes_total{bloom_negative}"])
	require.Equal(t, float64(st.Misses), got["keel_edge_route_anchor_probes_total{miss}"])
	require.Equal(t, float64(st.Lookups), got["keel_edge_route_lookup_seconds"])
	require.Equal(t, 1.0, got["keel_edge_route_ready"])
}

func TestClient_RouteRetriesLookup(t *testing.T) {
	t.Parallel()
	f := startFake(t, time.Second)
	c := startClient(t, nil, f.url)
	var calls int
	f.mu.Lock()
	f.lookup = func(req *routerv1.LookupRequest) (*routerv1.LookupResponse, error) {
		calls++
		if calls < 3 {
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("member quorum"))
		}
		return &routerv1.LookupResponse{EdgeIds: []string{"e1"}}, nil
	}
	f.mu.Unlock()
	r, err := c.Route(t.Context(), "t1", "a")
	require.NoError(t, err, "never drops for lack of an answer")
	require.Equal(t, []string{"e1"}, r.Edges)
	require.EqualValues(t, 2, c.Stats().LookupErrors)

	f.mu.Lock()
	f.lookup = func(*routerv1.LookupRequest) (*routerv1.LookupResponse, error) {
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("down"))
	}
	f.mu.Unlock()
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	_, err = c.Route(ctx, "t1", "a")
	require.ErrorIs(t, err, context.DeadlineExceeded)

	f.mu.Lock()
	f.lookup = func(*routerv1.LookupRequest) (*routerv1.LookupResponse, error) {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("bad"))
	}
	f.mu.Unlock()
	_, err = c.Route(t.Context(), "t1", "a")
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	_, err = c.Route(t.Context(), "t1", "a/+")
	require.Error(t, err, "wildcards in a topic name are refused locally")
}

func TestClient_RunEndsPending(t *testing.T) {
	t.Parallel()
	f := startFake(t, time.Second)
	f.ackOn.Store(false)
	c, err := New(Config{URL: f.url, EdgeID: "e", Incarnation: 1, HTTPClient: h2cClient()})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	errc := make(chan error, 1)
	go func() { errc <- c.Subscribe(t.Context(), "t1", "a") }()
	eventually(t, func() bool { _, ds, _ := f.received(); return len(ds) == 1 })
	cancel()
	<-done
	require.ErrorIs(t, <-errc, ErrClosed)
}

func TestClient_ApplyWildcardAndDeadEdges(t *testing.T) {
	t.Parallel()
	c, err := New(Config{URL: "http://x", EdgeID: "e", Incarnation: 1})
	require.NoError(t, err)
	add := func(edge string, inc uint64, filter string, op routerv1.RouteOp) *routerv1.WildcardDelta {
		return &routerv1.WildcardDelta{Route: &routerv1.Route{Tenant: "t1", Filter: filter}, EdgeId: edge, Op: op, Incarnation: inc}
	}
	match := func(topic string) []string {
		var out []string
		c.wild["t1"].Match(topic, func(v wildVal) bool { out = append(out, v.edge); return true })
		return out
	}
	c.applyWildcard(&routerv1.WildcardDeltas{Deltas: []*routerv1.WildcardDelta{
		add("x", 1, "#", routerv1.RouteOp_ROUTE_OP_ADD), add("y", 3, "+/a", routerv1.RouteOp_ROUTE_OP_ADD)}})
	require.ElementsMatch(t, []string{"x", "y"}, match("q/a"))
	// A remove from an older incarnation does not undo a newer add.
	c.applyWildcard(&routerv1.WildcardDeltas{Deltas: []*routerv1.WildcardDelta{add("y", 2, "+/a", routerv1.RouteOp_ROUTE_OP_REMOVE)}})
	require.ElementsMatch(t, []string{"x", "y"}, match("q/a"))
	// Dead edge y incarnation 2: its incarnation 3 routes stay.
	c.cache[[2]string{"t1", "k"}] = &cacheEntry{until: time.Now().Add(time.Hour)}
	c.invalidate(&routerv1.RouteInvalidation{DeadEdges: []*routerv1.DeadEdge{{EdgeId: "y", Incarnation: 2}, {EdgeId: "x", Incarnation: 1}}})
	require.Equal(t, []string{"y"}, match("q/a"))
	require.Empty(t, c.cache, "a dead edge clears the cache")
	c.applyWildcard(&routerv1.WildcardDeltas{Reset_: true})
	require.Nil(t, c.wild["t1"])
}

func TestClient_ApplyBloomChunks(t *testing.T) {
	t.Parallel()
	c, err := New(Config{URL: "http://x", EdgeID: "e", Incarnation: 1})
	require.NoError(t, err)
	bl := routes.NewBloom(5000, 0.01)
	bl.Add("a/b")
	bits, m, k := bl.Bits()
	require.Greater(t, len(bits), 2000)
	half := len(bits) / 2
	chunk := func(v uint64, off int, b []byte, last bool) *routerv1.BloomChunk {
		return &routerv1.BloomChunk{Tenant: "t1", Version: v, BitCount: m, HashCount: k, Offset: uint64(off), Bits: b, Last: last}
	}
	c.applyBloom(chunk(1, 0, bits[:half], false))
	require.Nil(t, c.blooms["t1"], "not usable before the last chunk")
	c.applyBloom(chunk(1, half, bits[half:], true))
	require.NotNil(t, c.blooms["t1"])
	require.True(t, c.blooms["t1"].MayContain("a/b"))
	// New anchors announced by an invalidation join the filter.
	c.invalidate(&routerv1.RouteInvalidation{Tenant: "t1", NewAnchors: []string{"c/d"}})
	require.True(t, c.blooms["t1"].MayContain("c/d"))
	// A chunk of a newer version discards a half-assembled older one.
	c.applyBloom(chunk(2, 0, bits[:half], false))
	c.applyBloom(chunk(3, 0, make([]byte, len(bits)), true))
	require.False(t, c.blooms["t1"].MayContain("a/b"))
	// Garbage is ignored: out-of-range offsets, absurd sizes, bad parameters.
	before := c.blooms["t1"]
	c.applyBloom(&routerv1.BloomChunk{Tenant: "t1", Version: 4, BitCount: 1 << 40, HashCount: 3, Last: true})
	c.applyBloom(&routerv1.BloomChunk{Tenant: "t1", Version: 5, BitCount: 64, HashCount: 0, Bits: make([]byte, 8), Last: true})
	c.applyBloom(&routerv1.BloomChunk{Tenant: "t1", Version: 6, BitCount: 64, HashCount: 2, Offset: 1 << 62, Bits: make([]byte, 8), Last: true})
	c.applyBloom(&routerv1.BloomChunk{Tenant: "t1", Version: 7, BitCount: 128, HashCount: 2, Bits: make([]byte, 8)})
	c.applyBloom(&routerv1.BloomChunk{Tenant: "t1", Version: 7, BitCount: 128, HashCount: 2, Offset: ^uint64(0), Bits: make([]byte, 8), Last: true})
	c.applyBloom(&routerv1.BloomChunk{Tenant: "t1", Version: 8, BitCount: 128, HashCount: 2, Bits: make([]byte, 8), Last: true}) // short
	c.applyBloom(&routerv1.BloomChunk{Tenant: "t1", Version: 9, BitCount: 64, HashCount: 2, Bits: make([]byte, 9), Last: true})  // long
	require.True(t, before == c.blooms["t1"], "a broken filter replaced the previous one")
}

// After the edge rejoined under a new incarnation, the client opens its
// stream again under it, and the router (which has no routes for the new
// incarnation, digest mismatch) gets the whole route set in a snapshot.
func TestClient_SetIncarnationReopensStream(t *testing.T) {
	t.Parallel()
	f := startFake(t, time.Second)
	c := startClient(t, nil, f.url)
	f.waitReady(t, c)
	require.NoError(t, c.Subscribe(t.Context(), "t1", "keep/me"))
	f.match.Store(false)
	c.SetIncarnation(c.cfg.Incarnation + 5)
	c.SetIncarnation(c.cfg.Incarnation) // older: ignored
	eventually(t, func() bool { _, _, hellos := f.received(); return len(hellos) == 2 })
	_, _, hellos := f.received()
	require.Equal(t, c.cfg.Incarnation+5, hellos[1].GetIncarnation())
	eventually(t, func() bool { f.mu.Lock(); defer f.mu.Unlock(); return len(f.snapshots) == 1 })
	f.mu.Lock()
	snap := f.snapshots[0]
	f.mu.Unlock()
	require.Len(t, snap.GetRoutes(), 1)
	require.Equal(t, "keep/me", snap.GetRoutes()[0].GetFilter())
	// Lookups carry the new incarnation too.
	f.waitReady(t, c)
	_, err := c.Route(t.Context(), "t1", "x/y")
	require.NoError(t, err)
}

// TestClient_UnsettledRoutesToEveryEdge: while the router says its answers
// may miss routes, every answer asks for every edge and Lookup answers are
// not cached; a new stream starts settled, and the router's word ends it.
func TestClient_UnsettledRoutesToEveryEdge(t *testing.T) {
	t.Parallel()
	f := startFake(t, time.Second)
	reg := prometheus.NewRegistry()
	c := startClient(t, func(cfg *Config) { cfg.Registerer = reg }, f.url)
	f.waitReady(t, c)
	ctx := t.Context()
	bl := routes.NewBloom(1024, 0.01)
	bl.Add("dev/1")
	bits, m, k := bl.Bits()
	bloom := &routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Bloom{Bloom: &routerv1.BloomChunk{Tenant: "t1", Version: 1, BitCount: m, HashCount: k, Bits: bits, Last: true}}}
	wild := &routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Wildcard{Wildcard: &routerv1.WildcardDeltas{Deltas: []*routerv1.WildcardDelta{
		{Route: &routerv1.Route{Tenant: "t1", Filter: "+/status"}, EdgeId: "e2", Op: routerv1.RouteOp_ROUTE_OP_ADD, Incarnation: 1}}}}}
	f.push(bloom)
	f.push(wild)
	eventually(t, func() bool { c.mu.Lock(); defer c.mu.Unlock(); return c.wild["t1"] != nil && c.blooms["t1"] != nil })
	r, err := c.Route(ctx, "t1", "x/status")
	require.NoError(t, err)
	require.False(t, r.All)

	f.push(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Settle{Settle: &routerv1.RouteSettle{Reason: "test"}}})
	eventually(t, func() bool { r, _, _ := c.RouteAtOnce("t1", "x/status"); return r.All })
	require.Equal(t, []string{"e2"}, r.Edges, "what the edge knows is kept beside All")

	// A Lookup answer marked unsettled is used once, not cached.
	f.mu.Lock()
	f.lookup = func(*routerv1.LookupRequest) (*routerv1.LookupResponse, error) {
		return &routerv1.LookupResponse{EdgeIds: []string{"e9"}, CacheLease: durationpb.New(time.Hour), Unsettled: true,
			Anchors: []*routerv1.AnchorRoutes{{Anchor: "dev"}, {Anchor: "dev/1"}}}, nil
	}
	f.mu.Unlock()
	lookups := f.lookupCount()
	for range 2 {
		r, err = c.Route(ctx, "t1", "dev/1")
		require.NoError(t, err)
		require.True(t, r.All)
		require.True(t, r.Looked)
		require.Equal(t, []string{"e9"}, r.Edges)
	}
	require.Equal(t, lookups+2, f.lookupCount(), "unsettled answers are not cached")

	f.push(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Settle{Settle: &routerv1.RouteSettle{Settled: true}}})
	eventually(t, func() bool { r, _, _ := c.RouteAtOnce("t1", "x/status"); return !r.All })
	require.Positive(t, c.Stats().Unsettled)

	// A new stream forgets the old node's word: it starts settled.
	f.push(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Settle{Settle: &routerv1.RouteSettle{Reason: "test"}}})
	eventually(t, func() bool { r, _, _ := c.RouteAtOnce("t1", "x/status"); return r.All })
	f.mu.Lock()
	opened := f.opened
	f.mu.Unlock()
	f.breakStream()
	<-opened
	f.push(wild) // the new stream's reset emptied the table
	eventually(t, func() bool { r, ok, _ := c.RouteAtOnce("t1", "x/status"); return ok && !r.All && len(r.Edges) == 1 })
}

// TestClient_LeaseRunsFromEchoedClock: a heartbeat extends the cache lease
// from the edge clock it echoes (when the edge sent the ack), not from when
// it was read: one that waited in a buffer while the edge stalled leaves
// the lease expired, so the invalidations queued behind it cannot be
// overtaken by an answer from a stale cache entry. A router that does not
// echo keeps the lease running from receipt.
func TestClient_LeaseRunsFromEchoedClock(t *testing.T) {
	c, err := New(Config{URL: "http://127.0.0.1:1", EdgeID: "e", Incarnation: 1})
	require.NoError(t, err)
	lease := 400 * time.Millisecond
	hb := func(echo int64) *routerv1.RouteSyncResponse {
		return &routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Heartbeat{Heartbeat: &routerv1.RouteHeartbeat{
			CacheLease: durationpb.New(lease), Echo: echo}}}
	}
	c.mu.Lock()
	c.ready = true
	c.mu.Unlock()

	require.NoError(t, c.handle(nil, hb(0)))
	require.True(t, c.Ready(), "no echo: the lease runs from receipt")

	// A stall longer than the lease: the last heartbeat read, and the last
	// ack the router got, are that old.
	stall := lease + 50*time.Millisecond
	c.mu.Lock()
	c.clockOrigin = c.clockOrigin.Add(-time.Hour)
	c.lastHB = c.lastHB.Add(-stall)
	c.mu.Unlock()
	stalledAt := c.clock() - int64(stall)
	require.NoError(t, c.handle(nil, hb(stalledAt)))
	require.False(t, c.Ready(), "a heartbeat read after the stall echoes a clock older than the lease")
	require.NoError(t, c.handle(nil, hb(0)))
	require.False(t, c.Ready(), "once the stream echoes, a heartbeat without an echo extends nothing")

	require.NoError(t, c.handle(nil, hb(c.clock())))
	require.True(t, c.Ready(), "a fresh echo renews the lease")
	require.NoError(t, c.handle(nil, hb(stalledAt)))
	require.True(t, c.Ready(), "an older echo never shortens it")
}

// TestClient_LaterSubscriberWaitsForTheADD: a second local subscriber of a
// filter whose ADD the router has not acked is not told it is routed before
// the first is. Its SUBACK would otherwise promise messages published while
// the route is still on its way, which no edge would receive.
func TestClient_LaterSubscriberWaitsForTheADD(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		reject bool
	}{{"acked", false}, {"refused", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := startFake(t, time.Second)
			f.ackOn.Store(false)
			c := startClient(t, nil, f.url)
			f.waitReady(t, c)
			errs := make(chan error, 2)
			go func() { errs <- c.Subscribe(t.Context(), "t1", "a/+") }()
			eventually(t, func() bool { _, ds, _ := f.received(); return len(ds) == 1 })
			go func() { errs <- c.Subscribe(t.Context(), "t1", "a/+") }()
			select {
			case err := <-errs:
				t.Fatalf("a subscriber returned (%v) before the router acked its route", err)
			case <-time.After(100 * time.Millisecond):
			}
			ack := &routerv1.RouteAck{Seq: 1}
			if tc.reject {
				ack.Rejected = []*routerv1.RouteReject{{Seq: 1, Reason: "cap"}}
			}
			f.push(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Ack{Ack: ack}})
			for range 2 {
				err := <-errs
				if tc.reject {
					require.ErrorIs(t, err, ErrRejected)
				} else {
					require.NoError(t, err)
				}
			}
			_, ds, _ := f.received()
			require.Len(t, ds, 1, "one ADD stands for both subscribers")
			// Refused: neither is counted, so the next subscriber asks again.
			// Acked: both are, so two unsubscribes make one REMOVE.
			f.ackOn.Store(true)
			if tc.reject {
				require.NoError(t, c.Subscribe(t.Context(), "t1", "a/+"))
				_, ds, _ = f.received()
				require.Len(t, ds, 2)
				require.Equal(t, routerv1.RouteOp_ROUTE_OP_ADD, ds[1].GetOp())
				return
			}
			require.NoError(t, c.Unsubscribe(t.Context(), "t1", "a/+"))
			_, ds, _ = f.received()
			require.Len(t, ds, 1)
			require.NoError(t, c.Unsubscribe(t.Context(), "t1", "a/+"))
			_, ds, _ = f.received()
			require.Len(t, ds, 2)
			require.Equal(t, routerv1.RouteOp_ROUTE_OP_REMOVE, ds[1].GetOp())
		})
	}
}

// TestClient_SubscriberGivenUpStaysCounted: a Subscribe whose caller stops
// waiting leaves its subscriber counted, for the caller to unsubscribe (it
// alone knows whether its session still holds the subscription): the
// route then goes only when nobody else holds it.
func TestClient_SubscriberGivenUpStaysCounted(t *testing.T) {
	t.Parallel()
	f := startFake(t, time.Second)
	f.ackOn.Store(false)
	c := startClient(t, nil, f.url)
	f.waitReady(t, c)
	first := make(chan error, 1)
	go func() { first <- c.Subscribe(t.Context(), "t1", "a/+") }()
	eventually(t, func() bool { _, ds, _ := f.received(); return len(ds) == 1 })
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, c.Subscribe(ctx, "t1", "a/+"), context.DeadlineExceeded)
	require.NoError(t, c.Unsubscribe(t.Context(), "t1", "a/+"))
	f.push(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Ack{Ack: &routerv1.RouteAck{Seq: 1}}})
	require.NoError(t, <-first)
	_, ds, _ := f.received()
	require.Len(t, ds, 1, "the first subscriber's route stays")

	// The last subscriber given up and unsubscribed: the route goes.
	f.ackOn.Store(true)
	require.NoError(t, c.Unsubscribe(t.Context(), "t1", "a/+"))
	f.ackOn.Store(false)
	ctx, cancel = context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, c.Subscribe(ctx, "t1", "b"), context.DeadlineExceeded)
	f.ackOn.Store(true)
	require.NoError(t, c.Unsubscribe(t.Context(), "t1", "b"))
	eventually(t, func() bool { _, ds, _ := f.received(); return len(ds) == 4 })
	_, ds, _ = f.received()
	require.Equal(t, routerv1.RouteOp_ROUTE_OP_REMOVE, ds[1].GetOp())
	require.Equal(t, routerv1.RouteOp_ROUTE_OP_ADD, ds[2].GetOp())
	require.Equal(t, routerv1.RouteOp_ROUTE_OP_REMOVE, ds[3].GetOp())
	require.Equal(t, "b", ds[3].GetRoute().GetFilter())
}

// An answer held for a topic is given again only while nothing it was read
// from changed: a wildcard route added or removed, or a Bloom filter that
// now says an anchor of the topic may have routes, changes the next answer.
func TestClient_HeldAnswerFollowsEveryChange(t *testing.T) {
	t.Parallel()
	f := startFake(t, 400*time.Millisecond)
	c := startClient(t, nil, f.url)
	f.waitReady(t, c)
	wild := func(edge, filter string, op routerv1.RouteOp) {
		f.push(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Wildcard{Wildcard: &routerv1.WildcardDeltas{Deltas: []*routerv1.WildcardDelta{
			{Route: &routerv1.Route{Tenant: "t1", Filter: filter}, EdgeId: edge, Op: op, Incarnation: 1}}}}})
	}
	bloom := func(version uint64, anchors ...string) {
		bl := routes.NewBloom(1024, 0.01)
		for _, a := range anchors {
			bl.Add(a)
		}
		bits, m, k := bl.Bits()
		f.push(&routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Bloom{Bloom: &routerv1.BloomChunk{Tenant: "t1", Version: version, BitCount: m, HashCount: k, Bits: bits, Last: true}}})
	}
	answers := func(want ...string) func() bool {
		return func() bool {
			r, ok, err := c.RouteAtOnce("t1", "x/y/status")
			return err == nil && ok && slices.Equal(r.Edges, want)
		}
	}
	bloom(1, "dev/1")
	wild("e2", "+/+/status", routerv1.RouteOp_ROUTE_OP_ADD)
	eventually(t, answers("e2"))
	for range 3 {
		require.True(t, answers("e2")(), "given again while nothing changed")
	}
	wild("e4", "x/#", routerv1.RouteOp_ROUTE_OP_ADD)
	eventually(t, answers("e2", "e4"))
	wild("e2", "+/+/status", routerv1.RouteOp_ROUTE_OP_REMOVE)
	eventually(t, answers("e4"))
	// A filter whose Bloom now holds an anchor of the topic: a Lookup.
	bloom(2, "dev/1", "x/y")
	eventually(t, func() bool { _, ok, _ := c.RouteAtOnce("t1", "x/y/status"); return !ok })
}
