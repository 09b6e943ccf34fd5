// Package tracing is Keel's OpenTelemetry tracing: one provider per process,
// installed by [Setup] only when an OTLP endpoint is configured, a sampler
// that keeps a fraction of root traces (all of them for listed tenants), W3C
// trace context carried in Connect headers ([Interceptor]) and in forwarded
// frames ([Traceparent], [ContextFromTraceparent]).
//
// With no provider installed, [Tracer.Start] returns a span that does
// nothing and allocates nothing, and [Enabled] is false: hot paths check it
// before they build any attribute.
package tracing

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync/atomic"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/keelmq/keel/libs/config"
)

// Defaults of [Config].
const (
	DefaultSampleRatio = 0.1
)

// Attribute keys Keel's spans share. The sampler reads [TenantKey] on root
// spans.
const (
	TenantKey = attribute.Key("keel.tenant")
)

// Config is the tracing configuration of a service.
type Config struct {
	// SampleRatio is the fraction of root traces kept; a span with a
	// parent follows its parent's decision.
	SampleRatio float64 `yaml:"sample_ratio"`
	// AlwaysTenants are tenants whose root traces are all kept.
	AlwaysTenants config.StringList `yaml:"always_tenants"`
	// Exporter replaces the OTLP exporter (tests); with it Setup installs
	// a provider whatever the environment says.
	Exporter sdktrace.SpanExporter `yaml:"-"`
}

// RegisterFlags registers the flags of c under prefix (e.g. "tracing.").
func (c *Config) RegisterFlags(fs *flag.FlagSet, prefix string) {
	fs.Float64Var(&c.SampleRatio, prefix+"sample-ratio", DefaultSampleRatio,
		"fraction of root traces sampled when OTEL_EXPORTER_OTLP_ENDPOINT is set (a span with a parent follows its parent)")
	fs.Var(&c.AlwaysTenants, prefix+"always-tenants", "comma-separated tenants whose publishes and connects are always traced")
}

// Validate checks c.
func (c *Config) Validate() error {
	if c.SampleRatio < 0 || c.SampleRatio > 1 {
		return fmt.Errorf("tracing.sample-ratio %v: want 0 to 1", c.SampleRatio)
	}
	return nil
}

// Env names the OTLP exporter reads; see the OpenTelemetry SDK
// environment variable specification.
const (
	envEndpoint       = "OTEL_EXPORTER_OTLP_ENDPOINT"
	envTracesEndpoint = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
	envTracesExporter = "OTEL_TRACES_EXPORTER"
)

// configured reports whether the environment asks for traces to be
// exported over OTLP.
func configured(getenv func(string) string) bool {
	switch strings.TrimSpace(getenv(envTracesExporter)) {
	case "none":
		return false
	case "otlp":
		return true
	}
	return getenv(envEndpoint) != "" || getenv(envTracesEndpoint) != ""
}

// Setup installs the process's tracer provider for service when the
// environment configures an OTLP exporter (OTEL_EXPORTER_OTLP_ENDPOINT,
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_TRACES_EXPORTER=otlp; the
// exporter reads the other OTEL_EXPORTER_OTLP_* variables itself) or
// cfg.Exporter is set; otherwise tracing stays off. The returned function
// flushes and removes the provider; it is never nil.
func Setup(ctx context.Context, service string, cfg Config, logger *slog.Logger) (shutdown func(context.Context) error, err error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	off := func(context.Context) error { return nil }
	if err := cfg.Validate(); err != nil {
		return off, err
	}
	exp := cfg.Exporter
	if exp == nil {
		if !configured(os.Getenv) {
			logger.Debug("tracing off: no OTLP endpoint")
			return off, nil
		}
		exp, err = otlptracegrpc.New(ctx)
		if err != nil {
			return off, fmt.Errorf("otlp trace exporter: %w", err)
		}
	}
	res, err := resource.New(ctx, resource.WithFromEnv(), resource.WithTelemetrySDK(),
		resource.WithAttributes(attribute.String("service.name", service)))
	if err != nil && !errors.Is(err, resource.ErrPartialResource) {
		logger.Warn("tracing resource incomplete", "error", err)
	}
	sampler := NewSampler(cfg.SampleRatio, cfg.AlwaysTenants)
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp),
		sdktrace.WithSampler(sampler),
		sdktrace.WithResource(res),
	)
	restore := Install(tp, sampler)
	logger.Info("tracing on", "sample_ratio", cfg.SampleRatio, "always_tenants", len(cfg.AlwaysTenants))
	return func(ctx context.Context) error {
		restore()
		return tp.Shutdown(ctx)
	}, nil
}

// state is the installed provider.
type state struct {
	tp      trace.TracerProvider
	sampler *Sampler // tp's, when known
}

var current atomic.Pointer[state]

// Install makes tp the provider of every [Tracer] and of OpenTelemetry's
// global API (with the W3C trace context propagator), and returns a
// function that puts the previous provider back. sampler, when not nil,
// must be the sampler of tp: [Tracer.StartRoot] then decides roots with it
// before making any span. Setup calls Install; tests call it with a
// provider on an in-memory exporter.
func Install(tp trace.TracerProvider, sampler *Sampler) (restore func()) {
	prev := current.Swap(&state{tp: tp, sampler: sampler})
	prevGlobal := otel.GetTracerProvider()
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagator)
	return func() {
		current.Store(prev)
		otel.SetTracerProvider(prevGlobal)
	}
}

// Enabled reports whether a provider is installed. Check it before
// building span attributes on a hot path.
func Enabled() bool { return current.Load() != nil }

// propagator is the W3C trace context format of every Keel hop.
var propagator = propagation.TraceContext{}

// noopSpan is returned while tracing is off; boxed once.
var noopSpan trace.Span = noop.Span{}

// Tracer starts spans on the provider installed at the time (none: a span
// that does nothing). Unlike a tracer obtained from the otel package, it
// follows every [Install], not only the first.
type Tracer struct {
	name   string
	cached atomic.Pointer[cachedTracer]
}

type cachedTracer struct {
	st *state
	tr trace.Tracer
}

// NewTracer returns a tracer named for the instrumented package.
func NewTracer(name string) *Tracer { return &Tracer{name: name} }

// Start starts a span; see [trace.Tracer]. With tracing off it returns ctx
// unchanged and a span that does nothing.
func (t *Tracer) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	tr := t.tracer()
	if tr == nil {
		return ctx, noopSpan
	}
	return tr.Start(ctx, name, opts...)
}

// StartRoot starts a root span of tenant (recorded under [TenantKey]) and
// returns it when its trace is sampled, or a nil span when it is not or
// tracing is off. With the installed provider's [Sampler] known, a root
// that is not sampled costs no allocation: the decision comes first.
func (t *Tracer) StartRoot(ctx context.Context, name string, kind trace.SpanKind, tenant string) (context.Context, trace.Span) {
	st := current.Load()
	if st == nil {
		return ctx, nil
	}
	if st.sampler != nil {
		if !st.sampler.keepRoot(tenant) {
			return ctx, nil
		}
		ctx = presampled(ctx)
	}
	ctx, span := t.tracerOf(st).Start(ctx, name, trace.WithSpanKind(kind), trace.WithAttributes(TenantKey.String(tenant)))
	if !span.SpanContext().IsSampled() {
		span.End()
		return ctx, nil
	}
	return ctx, span
}

func (t *Tracer) tracer() trace.Tracer {
	st := current.Load()
	if st == nil {
		return nil
	}
	return t.tracerOf(st)
}

func (t *Tracer) tracerOf(st *state) trace.Tracer {
	if c := t.cached.Load(); c != nil && c.st == st {
		return c.tr
	}
	tr := st.tp.Tracer(t.name)
	t.cached.Store(&cachedTracer{st: st, tr: tr})
	return tr
}
