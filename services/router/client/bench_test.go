package client

import (
	"context"
	"fmt"
	"testing"
	"time"

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
