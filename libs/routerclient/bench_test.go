package routerclient

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/keelmq/keel/libs/routes"
	"github.com/keelmq/keel/libs/topic"
	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
)

// BenchmarkClient_RouteWildcard measures Route answered locally (trie +
// Bloom, no RPC) with 10,000 wildcard-first filters held for one tenant.
func BenchmarkClient_RouteWildcard(b *testing.B) {
	c, err := New(Config{URL: "http://127.0.0.1:1", EdgeID: "e", Incarnation: 1})
	if err != nil {
		b.Fatal(err)
	}
	var ds []*routerv1.WildcardDelta
	for i := range 10000 {
		f := fmt.Sprintf("+/dev%d/#", i)
		if i%2 == 1 {
			f = fmt.Sprintf("+/+/metric%d", i)
		}
		ds = append(ds, &routerv1.WildcardDelta{Route: &routerv1.Route{Tenant: "t1", Filter: f}, EdgeId: fmt.Sprintf("edge-%d", i%16), Op: routerv1.RouteOp_ROUTE_OP_ADD, Incarnation: 1})
	}
	c.applyWildcard(&routerv1.WildcardDeltas{Reset_: true, Deltas: ds})
	c.applyBloom(&routerv1.BloomChunk{Tenant: "t1", Version: 1, BitCount: 8192, HashCount: 4, Bits: make([]byte, 1024), Last: true})
	c.mu.Lock()
	c.ready, c.lastHB, c.lease = true, time.Now(), time.Hour
	c.mu.Unlock()
	ctx := context.Background()
	topics := []string{"site/dev42/temp", "site/x/metric77", "a/b/c/d"}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		r, err := c.Route(ctx, "t1", topics[i%len(topics)])
		if err != nil || r.Looked {
			b.Fatal("needed an RPC", err)
		}
		i++
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "routes/s")
}

// BenchmarkClient_TrieMatch measures the bare wildcard trie match on the
// edge with 10,000 wildcard-first filters (what Route adds on top is
// validation, anchor probes and result building).
func BenchmarkClient_TrieMatch(b *testing.B) {
	var tr topic.Trie[wildVal]
	for i := range 10000 {
		f := fmt.Sprintf("+/dev%d/#", i)
		if i%2 == 1 {
			f = fmt.Sprintf("+/+/metric%d", i)
		}
		tr.Add(f, wildVal{edge: fmt.Sprintf("edge-%d", i%16), filter: f})
	}
	topics := []string{"site/dev42/temp", "site/x/metric77", "a/b/c/d"}
	i, n := 0, 0
	for b.Loop() {
		tr.Match(topics[i%len(topics)], func(wildVal) bool { n++; return true })
		i++
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "matches/s")
}

// BenchmarkClient_MemoryPerDevice measures what one device costs an edge in
// the devices scenario: its local route (devices/<id>/cmd/#), its anchor in
// the tenant's Bloom filter (sized as the router sizes it), and after
// warm-up nothing in the cache (Bloom negatives need no entry).
// KEEL_ROUTER_BENCH_DEVICES sets the count (default 100,000).
func BenchmarkClient_MemoryPerDevice(b *testing.B) {
	devices := 100_000
	if v, err := strconv.Atoi(os.Getenv("KEEL_ROUTER_BENCH_DEVICES")); err == nil && v > 0 {
		devices = v
	}
	for b.Loop() {
		runtime.GC()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		c, err := New(Config{URL: "http://127.0.0.1:1", EdgeID: "e", Incarnation: 1})
		if err != nil {
			b.Fatal(err)
		}
		bl := routes.NewBloom(4*devices, 0.01)
		for i := range devices {
			f := fmt.Sprintf("devices/%d/cmd/#", i)
			c.local[routes.Key{Tenant: "t1", Filter: f}] = 1
			bl.Add(fmt.Sprintf("devices/%d/cmd", i))
		}
		c.blooms["t1"] = bl
		runtime.GC()
		runtime.ReadMemStats(&after)
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(devices), "B/device")
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/(1<<20), "MiB")
		runtime.KeepAlive(c)
	}
}
