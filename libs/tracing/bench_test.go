package tracing

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

type discardSpans struct{}

func (discardSpans) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (discardSpans) Shutdown(context.Context) error                             { return nil }

// BenchmarkTracer_StartRoot is the cost of deciding and, when kept,
// recording a root span with a few attributes through the batch span
// processor (to an exporter that drops them).
func BenchmarkTracer_StartRoot(b *testing.B) {
	for _, tc := range []struct {
		name  string
		ratio float64
	}{{"sampled=none", 0}, {"sampled=10pct", 0.1}, {"sampled=all", 1}} {
		b.Run(tc.name, func(b *testing.B) {
			s := NewSampler(tc.ratio, nil)
			tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(discardSpans{}), sdktrace.WithSampler(s))
			defer Install(tp, s)()
			defer func() { _ = tp.Shutdown(context.Background()) }()
			tr := NewTracer("bench")
			b.ReportAllocs()
			for b.Loop() {
				_, span := tr.StartRoot(context.Background(), "mqtt.publish", trace.SpanKindServer, "acme")
				if span != nil {
					span.SetAttributes(attribute.Int("mqtt.qos", 1), attribute.String("messaging.message.id", "edge-a/1764445000000000000/123456"),
						attribute.String("messaging.destination.name", "sensors/room-1/temperature"))
					span.End()
				}
			}
		})
	}
}
