package tracing

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

func TestConfigured(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		env  map[string]string
		want bool
	}{
		{"nothing", nil, false},
		{"endpoint", map[string]string{envEndpoint: "http://collector:4317"}, true},
		{"traces_endpoint", map[string]string{envTracesEndpoint: "http://collector:4317"}, true},
		{"exporter_otlp", map[string]string{envTracesExporter: "otlp"}, true},
		{"exporter_none_wins", map[string]string{envTracesExporter: "none", envEndpoint: "http://collector:4317"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, configured(func(k string) string { return tc.env[k] }))
		})
	}
}

// Without an OTLP endpoint nothing is installed, and a tracer's spans do
// nothing and cost no allocation.
func TestSetup_OffWithoutEndpoint(t *testing.T) {
	t.Setenv(envEndpoint, "")
	t.Setenv(envTracesEndpoint, "")
	t.Setenv(envTracesExporter, "")
	shutdown, err := Setup(t.Context(), "test", Config{SampleRatio: 1}, nil)
	require.NoError(t, err)
	require.False(t, Enabled())
	tr := NewTracer("test")
	ctx := context.Background()
	allocs := testing.AllocsPerRun(100, func() {
		c, span := tr.Start(ctx, "x")
		span.End()
		_ = c
	})
	require.Zero(t, allocs)
	require.NoError(t, shutdown(t.Context()))
}

// keptSpans is an in-memory exporter whose spans survive its shutdown.
type keptSpans struct{ *tracetest.InMemoryExporter }

func (keptSpans) Shutdown(context.Context) error { return nil }

// With an exporter Setup installs a provider with Keel's sampler; its
// shutdown flushes and removes it.
func TestSetup_WithExporter(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	shutdown, err := Setup(t.Context(), "keel-test", Config{SampleRatio: 0, AlwaysTenants: []string{"gold"}, Exporter: keptSpans{exp}}, nil)
	require.NoError(t, err)
	require.True(t, Enabled())
	tr := NewTracer("test")
	_, span := tr.Start(context.Background(), "gold", trace.WithAttributes(TenantKey.String("gold")))
	span.End()
	_, span = tr.Start(context.Background(), "acme", trace.WithAttributes(TenantKey.String("acme")))
	span.End()
	require.NoError(t, shutdown(t.Context()))
	require.False(t, Enabled())
	spans := exp.GetSpans()
	require.Len(t, spans, 1, "ratio 0: only the always-traced tenant")
	require.Equal(t, "gold", spans[0].Name)
	svc, ok := spans[0].Resource.Set().Value("service.name")
	require.True(t, ok)
	require.Equal(t, "keel-test", svc.AsString())
}

// A tracer follows every Install, not only the first (unlike the otel
// package's global delegation).
func TestTracer_FollowsInstall(t *testing.T) {
	tr := NewTracer("test")
	for range 2 {
		exp := tracetest.NewInMemoryExporter()
		tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
		restore := Install(tp, nil)
		_, span := tr.Start(context.Background(), "x")
		span.End()
		restore()
		require.Len(t, exp.GetSpans(), 1)
	}
	require.False(t, Enabled())
}

func TestTraceparent_RoundTrip(t *testing.T) {
	t.Parallel()
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{0xab, 1}, SpanID: trace.SpanID{0xcd, 2}, TraceFlags: trace.FlagsSampled})
	tp := Traceparent(sc)
	require.Equal(t, "00-ab010000000000000000000000000000-cd02000000000000-01", tp)
	got := trace.SpanContextFromContext(ContextFromTraceparent(context.Background(), tp))
	require.True(t, got.IsRemote())
	require.True(t, got.IsSampled())
	require.Equal(t, sc.TraceID(), got.TraceID())
	require.Equal(t, sc.SpanID(), got.SpanID())

	require.Empty(t, Traceparent(trace.SpanContext{}))
	ctx := context.Background()
	require.Equal(t, ctx, ContextFromTraceparent(ctx, ""))
	require.False(t, trace.SpanContextFromContext(ContextFromTraceparent(ctx, "garbage")).IsValid())
}

// StartRoot decides before making a span: an unsampled root costs no
// allocation, the roots it keeps are the ones the provider records, at the
// configured ratio, and every root of an always-traced tenant is kept.
func TestTracer_StartRoot(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	sampler := NewSampler(0.25, []string{"gold"})
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp), sdktrace.WithSampler(sampler))
	t.Cleanup(Install(tp, sampler))
	tr := NewTracer("test")

	const n = 8000
	kept := 0
	for range n {
		if _, span := tr.StartRoot(context.Background(), "x", trace.SpanKindServer, "acme"); span != nil {
			require.True(t, span.SpanContext().IsSampled())
			span.End()
			kept++
		}
	}
	require.InDelta(t, 0.25, float64(kept)/n, 0.03)
	require.Len(t, exp.GetSpans(), kept, "the provider records what StartRoot keeps")
	for range 100 {
		_, span := tr.StartRoot(context.Background(), "x", trace.SpanKindServer, "gold")
		require.NotNil(t, span)
		span.End()
	}

	never := NewSampler(0, nil)
	t.Cleanup(Install(sdktrace.NewTracerProvider(sdktrace.WithSampler(never)), never))
	allocs := testing.AllocsPerRun(1000, func() {
		if _, span := tr.StartRoot(context.Background(), "x", trace.SpanKindServer, "acme"); span != nil {
			t.Fatal("sampled at ratio 0")
		}
	})
	require.Zero(t, allocs)
}
