package broker

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/keelmq/keel/libs/tracing"
)

// discardSpans is an exporter that drops what it is given: the benchmark
// counts the edge's cost of tracing, batching included, not a collector's.
type discardSpans struct{}

func (discardSpans) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (discardSpans) Shutdown(context.Context) error                             { return nil }

// BenchmarkBroker_PublishTracing is the publish path of one edge with
// tracing off (no provider: what runs without OTEL_EXPORTER_OTLP_ENDPOINT)
// and on with Keel's sampler at 10 % (the default) and 100 %, spans going
// through the batch span processor to an exporter that drops them. Each
// publisher sends QoS 1 PUBLISHes over loopback TCP with up to 64
// unacknowledged, and one subscriber takes them at QoS 0; ns/op is the
// wall time per message at the edge's throughput.
func BenchmarkBroker_PublishTracing(b *testing.B) {
	for _, tc := range []struct {
		name  string
		on    bool
		ratio float64
	}{
		{"tracing=off", false, 0},
		{"tracing=10pct", true, tracing.DefaultSampleRatio},
		{"tracing=100pct", true, 1},
	} {
		for _, pubs := range []int{1, 4} {
			b.Run(fmt.Sprintf("%s/publishers=%d", tc.name, pubs), func(b *testing.B) {
				if tc.on {
					sampler := tracing.NewSampler(tc.ratio, nil)
					tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(discardSpans{}),
						sdktrace.WithSampler(sampler))
					restore := tracing.Install(tp, sampler)
					b.Cleanup(func() { restore(); _ = tp.Shutdown(context.Background()) })
				}
				benchPublish(b, pubs)
			})
		}
	}
}

func benchPublish(b *testing.B, publishers int) {
	cfg := DefaultConfig()
	cfg.EdgeID = "bench"
	brk, err := New(cfg, anonymous(), nil, nil)
	if err != nil {
		b.Fatal(err)
	}
	l := newTCP("127.0.0.1:0")
	if err := brk.AddListener(l); err != nil {
		b.Fatal(err)
	}
	if err := brk.Serve(); err != nil {
		b.Fatal(err)
	}
	var conns []net.Conn
	b.Cleanup(func() {
		// Clients gone before the broker closes: mochi v2.7.9 can deadlock
		// when a client leaves during Close (Clients.GetByListener takes
		// its read lock twice).
		for _, c := range conns {
			_ = c.Close()
		}
		for deadline := time.Now().Add(5 * time.Second); brk.server.Clients.Len() > 0 && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
		_ = brk.Close()
	})

	sub := benchDial(b, l.Address(), "sub")
	benchWrite(b, sub, packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: 1,
		Filters: packets.Subscriptions{{Filter: "bench/#"}}})
	suback := make([]byte, 5)
	if _, err := io.ReadFull(sub, suback); err != nil {
		b.Fatal(err)
	}
	go func() { _, _ = io.Copy(io.Discard, sub) }()
	conns = append(conns, sub)
	pubs := make([]net.Conn, publishers)
	for i := range pubs {
		pubs[i] = benchDial(b, l.Address(), fmt.Sprintf("pub-%d", i))
	}
	conns = append(conns, pubs...)
	payload := bytes.Repeat([]byte{'x'}, 64)
	b.SetBytes(int64(len(payload)))
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	for i, c := range pubs {
		n := b.N / publishers
		if i < b.N%publishers {
			n++
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := pipelineTopics(c, []string{fmt.Sprintf("bench/room-%d/temperature", i)}, payload, n, 64); err != nil {
				b.Error(err)
			}
		}()
	}
	wg.Wait()
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "msgs/s")
}

// benchDial connects an MQTT 3.1.1 client.
func benchDial(b *testing.B, addr, id string) net.Conn {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		b.Fatal(err)
	}
	benchWrite(b, c, packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: true, Keepalive: 60, ClientIdentifier: id}})
	connack := make([]byte, 4)
	if _, err := io.ReadFull(c, connack); err != nil {
		b.Fatal(err)
	}
	return c
}

func benchWrite(b *testing.B, c net.Conn, pk packets.Packet) {
	pk.ProtocolVersion = 4
	var buf bytes.Buffer
	var err error
	switch pk.FixedHeader.Type {
	case packets.Connect:
		err = pk.ConnectEncode(&buf)
	case packets.Subscribe:
		err = pk.SubscribeEncode(&buf)
	}
	if err == nil {
		_, err = c.Write(buf.Bytes())
	}
	if err != nil {
		b.Fatal(err)
	}
}
