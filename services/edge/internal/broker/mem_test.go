package broker

import (
	"net"
	"runtime"
	"testing"

	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// BenchmarkIdleClientMemory reports the memory one idle connected client
// costs the edge: heap and goroutine stacks, after the connects settle and a
// collection has had the chance to shrink stacks.
func BenchmarkIdleClientMemory(b *testing.B) {
	const n = 2000
	_, addr := startBroker(&testing.T{}, nil)
	for b.Loop() {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		conns := make([]net.Conn, 0, n)
		for i := 0; i < n; i++ {
			c := mqtttest.Dial(b, addr, 4)
			c.Connect("", true, packets.Properties{})
			conns = append(conns, c.Conn)
		}
		runtime.GC()
		runtime.GC()
		runtime.ReadMemStats(&after)
		b.ReportMetric(float64(after.StackInuse-before.StackInuse)/n, "stack-B/client")
		b.ReportMetric(float64(after.HeapInuse-before.HeapInuse)/n, "heap-B/client")
		b.ReportMetric(float64(runtime.NumGoroutine())/n, "goroutines/client")
		for _, c := range conns {
			_ = c.Close()
		}
	}
}
