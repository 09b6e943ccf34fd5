package broker

import (
	"net"
	"runtime"
	"runtime/debug"
	"testing"

	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// BenchmarkIdleClientMemory reports the memory one idle connected client
// costs the edge: heap and goroutine stacks, after the connects settle and a
// collection has had the chance to shrink stacks. A client that has sent a
// packet since its CONNECT (as every live client does, a PINGREQ per keep
// alive at least) is measured apart: its read loop has been through mochi's
// packet handling, which is where stacks grow.
func BenchmarkIdleClientMemory(b *testing.B) {
	for _, bc := range []struct {
		name  string
		after func(c *mqtttest.Client)
	}{
		{"connected", func(*mqtttest.Client) {}},
		{"pinged", func(c *mqtttest.Client) {
			c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
			c.Expect(packets.Pingresp)
		}},
		{"published", func(c *mqtttest.Client) {
			c.Publish(1, "idle/memory", 1, []byte("x"))
			c.Expect(packets.Puback)
		}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			const n = 2000
			_, addr := startBroker(&testing.T{}, nil)
			for b.Loop() {
				var before, grown, after runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&before)
				// No collection while the clients connect, as on an edge
				// whose heap is below its floor: what the packets grew stays.
				gcPercent := debug.SetGCPercent(-1)
				conns := make([]net.Conn, 0, n)
				for i := 0; i < n; i++ {
					c := mqtttest.Dial(b, addr, 4)
					c.Connect("", true, packets.Properties{})
					bc.after(c)
					conns = append(conns, c.Conn)
				}
				// Stacks as the packets left them, before a collection
				// halves those that are less than a quarter used: an edge
				// whose clients ping more often than it collects keeps them
				// at this size.
				runtime.ReadMemStats(&grown)
				debug.SetGCPercent(gcPercent)
				runtime.GC()
				runtime.GC()
				runtime.ReadMemStats(&after)
				b.ReportMetric(float64(grown.StackInuse-before.StackInuse)/n, "grown-stack-B/client")
				b.ReportMetric(float64(after.StackInuse-before.StackInuse)/n, "stack-B/client")
				b.ReportMetric(float64(after.HeapInuse-before.HeapInuse)/n, "heap-B/client")
				b.ReportMetric(float64(runtime.NumGoroutine())/n, "goroutines/client")
				for _, c := range conns {
					_ = c.Close()
				}
			}
		})
	}
}
