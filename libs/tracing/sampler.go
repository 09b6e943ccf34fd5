package tracing

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// Sampler is Keel's sampler. A span with a parent (local, or remote from a
// Connect header or a forwarded frame) follows its parent's decision, so a
// trace is kept or dropped whole. A root span is kept when its start
// attributes name one of the always-traced tenants under [TenantKey], and
// otherwise with the configured probability, decided from the trace ID.
//
// Installed with its provider ([Install]), it also decides the roots of
// [Tracer.StartRoot] before any span is made, so a message that is not
// sampled costs a random number and nothing else.
type Sampler struct {
	ratio  sdktrace.Sampler
	bound  uint64 // StartRoot keeps a root when a random 53-bit number is below it
	always map[string]struct{}
	desc   string
}

var _ sdktrace.Sampler = (*Sampler)(nil)

// NewSampler returns a sampler keeping a ratio of root traces and every
// root trace of alwaysTenants.
func NewSampler(ratio float64, alwaysTenants []string) *Sampler {
	ratio = min(max(ratio, 0), 1)
	s := &Sampler{ratio: sdktrace.TraceIDRatioBased(ratio), bound: uint64(ratio * (1 << 53))}
	if len(alwaysTenants) > 0 {
		s.always = make(map[string]struct{}, len(alwaysTenants))
		for _, t := range alwaysTenants {
			s.always[t] = struct{}{}
		}
	}
	s.desc = fmt.Sprintf("KeelSampler{parent,root=%s,always=%s}", s.ratio.Description(), strings.Join(alwaysTenants, ","))
	return s
}

// presampledKey marks the context of a root that StartRoot already decided
// to keep.
type presampledKey struct{}

// ShouldSample implements [sdktrace.Sampler].
func (s *Sampler) ShouldSample(p sdktrace.SamplingParameters) sdktrace.SamplingResult {
	psc := trace.SpanContextFromContext(p.ParentContext)
	if psc.IsValid() {
		d := sdktrace.Drop
		if psc.IsSampled() {
			d = sdktrace.RecordAndSample
		}
		return sdktrace.SamplingResult{Decision: d, Tracestate: psc.TraceState()}
	}
	if p.ParentContext != nil && p.ParentContext.Value(presampledKey{}) != nil {
		return sdktrace.SamplingResult{Decision: sdktrace.RecordAndSample}
	}
	if s.always != nil {
		for _, kv := range p.Attributes {
			if kv.Key != TenantKey {
				continue
			}
			if _, ok := s.always[kv.Value.AsString()]; ok {
				return sdktrace.SamplingResult{Decision: sdktrace.RecordAndSample}
			}
			break
		}
	}
	return s.ratio.ShouldSample(p)
}

// Description implements [sdktrace.Sampler].
func (s *Sampler) Description() string { return s.desc }

// keepRoot decides a root span of tenant ahead of the SDK.
func (s *Sampler) keepRoot(tenant string) bool {
	if s.always != nil {
		if _, ok := s.always[tenant]; ok {
			return true
		}
	}
	switch s.bound {
	case 0:
		return false
	case 1 << 53:
		return true
	}
	return rand.Uint64()>>11 < s.bound
}

// presampled returns ctx marked as holding a root already kept.
func presampled(ctx context.Context) context.Context {
	return context.WithValue(ctx, presampledKey{}, true)
}
