package testutil

import (
	"slices"
	"sync"
	"testing"
	"time"
)

// Paced runs call b.N times at rate calls per second, each on its own
// goroutine (open loop: a slow call does not slow the offered load), and
// reports the achieved rate as unit (for example "claims/s", counting
// perCall of them per call) and the latency quantiles as prefix-p50-ms and
// prefix-p99-ms. A closed loop at saturation measures queueing; this
// measures the latency a caller sees at a stated load.
func Paced(b *testing.B, rate, perCall int, unit, prefix string, call func(i int) error) {
	b.Helper()
	lat := make([]time.Duration, b.N)
	var wg sync.WaitGroup
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	b.ResetTimer()
	start := time.Now()
	for i := range b.N {
		<-tick.C
		wg.Go(func() {
			t0 := time.Now()
			if err := call(i); err != nil {
				b.Error(err)
			}
			lat[i] = time.Since(t0)
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	slices.Sort(lat)
	b.ReportMetric(float64(b.N*perCall)/elapsed.Seconds(), unit)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, prefix+"p50-ms")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, prefix+"p99-ms")
}
