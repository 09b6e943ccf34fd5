package server_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	client "github.com/keelmq/keel/libs/routerclient"
	"github.com/keelmq/keel/libs/testutil"
)

// BenchmarkCluster_Devices is the devices scenario scaled to one process:
// three router nodes, three edges, KEEL_ROUTER_BENCH_DEVICES devices
// (default 30,000) each subscribed to devices/<id>/cmd/# on one edge
// (KEEL_ROUTER_BENCH_CONC concurrent subscribers per edge, default 64), then publishes to
// devices/<id>/telemetry from random edges. It reports SUBACK latency
// (Subscribe until the router's ack) and the share of publishes that needed
// a Lookup RPC after one warm-up pass.
func BenchmarkCluster_Devices(b *testing.B) {
	devices := envInt("KEEL_ROUTER_BENCH_DEVICES", 30_000)
	conc := envInt("KEEL_ROUTER_BENCH_CONC", 64)
	edges := benchEdges(b)
	ctx := context.Background()
	var mu sync.Mutex
	var lat []time.Duration
	var wg sync.WaitGroup
	start := time.Now()
	for e := range edges {
		for w := range conc {
			wg.Go(func() {
				var mine []time.Duration
				for id := e*conc + w; id < devices; id += 3 * conc {
					t0 := time.Now()
					if err := edges[e].Subscribe(ctx, "t1", fmt.Sprintf("devices/%d/cmd/#", id)); err != nil {
						b.Error(err)
						return
					}
					mine = append(mine, time.Since(t0))
				}
				mu.Lock()
				lat = append(lat, mine...)
				mu.Unlock()
			})
		}
	}
	wg.Wait()
	subTime := time.Since(start)
	slices.Sort(lat)

	rng := rand.New(rand.NewPCG(1, 2))
	publish := func(n int) (looked int) {
		for range n {
			e, id := rng.IntN(3), rng.IntN(devices)
			r, err := edges[e].Route(ctx, "t1", fmt.Sprintf("devices/%d/telemetry", id))
			if err != nil {
				b.Fatal(err)
			}
			if r.Looked {
				looked++
			}
		}
		return looked
	}
	publish(devices) // warm-up
	looked := 0
	for b.Loop() {
		looked += publish(1)
	}
	b.ReportMetric(100*float64(looked)/float64(b.N), "rpc-%")
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "suback-p50-ms")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "suback-p99-ms")
	b.ReportMetric(float64(devices)/subTime.Seconds(), "subscribes/s")
}

// BenchmarkCluster_SubackPaced offers subscribes at a fixed rate
// (KEEL_ROUTER_BENCH_RATE per second across three edges, default 2,000;
// open loop: a slow SUBACK does not slow the offered load) to three router
// nodes, each a new devices/<id>/cmd/# filter, and reports the SUBACK
// latency a subscriber sees at that load. BenchmarkCluster_Devices
// saturates the cluster instead, so its latency is mostly queueing.
//
//	go test -run '^$' -bench BenchmarkCluster_SubackPaced -benchtime 20000x ./internal/server/
func BenchmarkCluster_SubackPaced(b *testing.B) {
	edges := benchEdges(b)
	testutil.Paced(b, envInt("KEEL_ROUTER_BENCH_RATE", 2000), 1, "subscribes/s", "suback-", func(i int) error {
		return edges[i%3].Subscribe(context.Background(), "t1", fmt.Sprintf("devices/%d/cmd/#", i))
	})
}

// benchEdges starts three router nodes and an edge client on each.
func benchEdges(b *testing.B) []*client.Client {
	nodes := startClusterB(b, 3)
	edges := make([]*client.Client, 3)
	for i := range edges {
		edges[i] = startEdgeCfg(b, client.Config{URL: nodes[i].url, EdgeID: fmt.Sprintf("edge-%d", i), Incarnation: 1})
	}
	return edges
}

// envInt reads a benchmark's setting from the environment.
func envInt(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return n
	}
	return def
}
