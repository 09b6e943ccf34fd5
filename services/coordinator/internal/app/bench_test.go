package app

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/keelmq/keel/libs/testutil"
	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
)

// BenchmarkCluster_Claims measures claims/s and p99 claim latency on a 3-node
// loopback cluster with production Raft timeouts and fsync on every log write:
// single (one ClaimSession per call, many concurrent callers, batched into
// entries by the leader) and batched (ClaimSessions of size claims per call).
//
//	go test -run '^$' -bench BenchmarkCluster_Claims -benchtime 20000x ./internal/app/
func BenchmarkCluster_Claims(b *testing.B) {
	c := startCluster(b, 3, clusterOpts{leaseTTL: 10 * time.Second})
	l := c.waitLeader(10 * time.Second)
	join(b, l.client(), "bench-edge", 1, 10*time.Second)
	var seq atomic.Int64
	for _, bc := range []struct {
		name        string
		size        int // claims per call
		parallelism int // callers per GOMAXPROCS
		rate        int // calls per second, open loop; 0: closed loop (as fast as the callers go)
	}{
		{"mode=single/callers=64", 1, 32, 0},
		{"mode=batched/size=100/callers=16", 100, 8, 0},
		// The closed-loop runs saturate the cluster, so their latency is
		// mostly queueing (Little's law: claims in flight / claims per
		// second). This one offers a fixed 20,000 claims/s, the throughput
		// target, and reports the latency a call sees at that load.
		{"mode=batched/size=50/rate=20000claims/s", 50, 0, 400},
	} {
		b.Run(bc.name, func(b *testing.B) {
			if bc.rate > 0 {
				benchPaced(b, l.client(), &seq, bc.size, bc.rate)
				return
			}
			cl := l.client()
			var mu sync.Mutex
			var lat []time.Duration
			b.ReportAllocs()
			b.SetParallelism(bc.parallelism)
			start := time.Now()
			b.RunParallel(func(pb *testing.PB) {
				var mine []time.Duration
				for pb.Next() {
					t0 := time.Now()
					var err error
					if bc.size == 1 {
						n := seq.Add(1)
						_, err = cl.ClaimSession(context.Background(), connect.NewRequest(&coordinatorv1.ClaimSessionRequest{
							Session: sk("bench", fmt.Sprintf("c%d", n)), EdgeId: "bench-edge", Incarnation: 1}))
					} else {
						req := &coordinatorv1.ClaimSessionsRequest{EdgeId: "bench-edge", Incarnation: 1}
						for range bc.size {
							req.Claims = append(req.Claims, &coordinatorv1.SessionClaim{Session: sk("bench", fmt.Sprintf("c%d", seq.Add(1)))})
						}
						_, err = cl.ClaimSessions(context.Background(), connect.NewRequest(req))
					}
					if err != nil {
						b.Error(err)
						return
					}
					mine = append(mine, time.Since(t0))
				}
				mu.Lock()
				lat = append(lat, mine...)
				mu.Unlock()
			})
			elapsed := time.Since(start)
			slices.Sort(lat)
			if len(lat) > 0 {
				b.ReportMetric(float64(len(lat)*bc.size)/elapsed.Seconds(), "claims/s")
				b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
				b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
			}
		})
	}
}

// benchPaced issues b.N ClaimSessions calls of size claims at rate calls per
// second, open loop (testutil.Paced).
func benchPaced(b *testing.B, cl client, seq *atomic.Int64, size, rate int) {
	testutil.Paced(b, rate, size, "claims/s", "", func(int) error {
		req := &coordinatorv1.ClaimSessionsRequest{EdgeId: "bench-edge", Incarnation: 1}
		for range size {
			req.Claims = append(req.Claims, &coordinatorv1.SessionClaim{Session: sk("bench", fmt.Sprintf("c%d", seq.Add(1)))})
		}
		_, err := cl.ClaimSessions(context.Background(), connect.NewRequest(req))
		return err
	})
}
