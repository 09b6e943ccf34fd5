package tracing

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

func randomTraceID(r *rand.Rand) trace.TraceID {
	var id trace.TraceID
	for i := range id {
		id[i] = byte(r.UintN(256))
	}
	return id
}

func sampled(s sdktrace.Sampler, parent context.Context, id trace.TraceID, attrs ...attribute.KeyValue) bool {
	res := s.ShouldSample(sdktrace.SamplingParameters{ParentContext: parent, TraceID: id, Name: "x", Attributes: attrs})
	return res.Decision == sdktrace.RecordAndSample
}

func parentContext(t *testing.T, sampledFlag, remote bool) context.Context {
	t.Helper()
	cfg := trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, Remote: remote}
	if sampledFlag {
		cfg.TraceFlags = trace.FlagsSampled
	}
	return trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(cfg))
}

// A root span is kept with the configured probability.
func TestSampler_RootRatio(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(1, 2))
	for _, tc := range []struct {
		name   string
		ratio  float64
		lo, hi float64
	}{
		{"default_ten_percent", DefaultSampleRatio, 0.08, 0.12},
		{"none", 0, 0, 0},
		{"all", 1, 1, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewSampler(tc.ratio, nil)
			const n = 20000
			kept := 0
			for range n {
				if sampled(s, context.Background(), randomTraceID(r), TenantKey.String("acme")) {
					kept++
				}
			}
			got := float64(kept) / n
			require.GreaterOrEqual(t, got, tc.lo)
			require.LessOrEqual(t, got, tc.hi)
		})
	}
}

// A root span of a listed tenant is always kept; other tenants, and spans
// without a tenant, take the ratio.
func TestSampler_AlwaysTenants(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(3, 4))
	s := NewSampler(0, []string{"gold", "silver"})
	for range 1000 {
		id := randomTraceID(r)
		require.True(t, sampled(s, context.Background(), id, attribute.Int("mqtt.qos", 1), TenantKey.String("gold")))
		require.True(t, sampled(s, context.Background(), id, TenantKey.String("silver")))
		require.False(t, sampled(s, context.Background(), id, TenantKey.String("acme")))
		require.False(t, sampled(s, context.Background(), id))
	}
	require.Contains(t, s.Description(), "always=gold,silver")
}

// A span with a parent follows the parent, local or remote, whatever its
// tenant and the ratio.
func TestSampler_ParentBased(t *testing.T) {
	t.Parallel()
	id := trace.TraceID{1}
	for _, tc := range []struct {
		name          string
		ratio         float64
		parentSampled bool
		remote        bool
		tenant        string
		want          bool
	}{
		{"sampled_remote_parent_ratio_zero", 0, true, true, "acme", true},
		{"sampled_local_parent_ratio_zero", 0, true, false, "acme", true},
		{"unsampled_remote_parent_ratio_one", 1, false, true, "acme", false},
		{"unsampled_parent_always_tenant", 1, false, true, "gold", false},
		{"unsampled_local_parent", 1, false, false, "acme", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewSampler(tc.ratio, []string{"gold"})
			got := sampled(s, parentContext(t, tc.parentSampled, tc.remote), id, TenantKey.String(tc.tenant))
			require.Equal(t, tc.want, got)
		})
	}
}

func TestConfig_Validate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		ratio float64
		ok    bool
	}{{0, true}, {0.1, true}, {1, true}, {-0.1, false}, {1.5, false}} {
		c := Config{SampleRatio: tc.ratio}
		require.Equal(t, tc.ok, c.Validate() == nil, "ratio %v", tc.ratio)
	}
}
