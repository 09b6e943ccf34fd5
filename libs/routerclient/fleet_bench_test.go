package routerclient

import (
	"context"
	"fmt"
	"testing"
	"time"

	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
)

// BenchmarkClient_RouteFleet measures Route answered locally for a fleet:
// topics devices/<n>/telemetry, each published once per round of n
// devices, all routed through one cached anchor (devices/+/telemetry
// subscribed on two edges). A fleet publishes each topic less often than
// the cache lease lasts: an answer kept per topic would be out of date by
// the topic's next publish, and keeping them cost a fleet more than it saved
// (a per-topic memo: 125 ns instead of 300 for 50 hot topics, but 500-580
// instead of 305 when every answer kept was out of date, and 100,000 of
// them held).
func BenchmarkClient_RouteFleet(b *testing.B) {
	for _, devices := range []int{50, 100_000} {
		b.Run(fmt.Sprintf("devices=%d", devices), func(b *testing.B) {
			c, err := New(Config{URL: "http://127.0.0.1:1", EdgeID: "e", Incarnation: 1})
			if err != nil {
				b.Fatal(err)
			}
			c.applyBloom(&routerv1.BloomChunk{Tenant: "t1", Version: 1, BitCount: 8192, HashCount: 4, Bits: make([]byte, 1024), Last: true})
			c.mu.Lock()
			c.ready, c.lastHB, c.lease = true, time.Now(), time.Hour
			c.cache[[2]string{"t1", "devices"}] = &cacheEntry{until: time.Now().Add(time.Hour), routes: []*routerv1.AnchorRoute{
				{Filter: "devices/+/telemetry", EdgeIds: []string{"edge-1", "edge-2"}}}}
			c.mu.Unlock()
			topics := make([]string, devices)
			for i := range topics {
				topics[i] = fmt.Sprintf("devices/%d/telemetry", i)
			}
			ctx := context.Background()
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				r, err := c.Route(ctx, "t1", topics[i%len(topics)])
				if err != nil || r.Looked || len(r.Edges) != 2 {
					b.Fatal("needed an RPC", err, r)
				}
				i++
			}
		})
	}
}
