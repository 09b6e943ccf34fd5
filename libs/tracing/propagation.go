package tracing

import (
	"context"
	"strings"

	"connectrpc.com/connect"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// traceparentHeader is the W3C trace context header.
const traceparentHeader = "traceparent"

// oneHeader carries only the traceparent header.
type oneHeader struct{ v string }

func (c *oneHeader) Get(key string) string {
	if key == traceparentHeader {
		return c.v
	}
	return ""
}

func (c *oneHeader) Set(key, value string) {
	if key == traceparentHeader {
		c.v = value
	}
}

func (c *oneHeader) Keys() []string { return []string{traceparentHeader} }

// Traceparent returns the W3C traceparent of sc ("" when sc is invalid),
// for carrying a span's context inside a message (a forwarded frame).
func Traceparent(sc trace.SpanContext) string {
	if !sc.IsValid() {
		return ""
	}
	var c oneHeader
	propagator.Inject(trace.ContextWithSpanContext(context.Background(), sc), &c)
	return c.v
}

// ContextFromTraceparent returns ctx carrying the remote span context that
// traceparent names, or ctx itself when traceparent is empty or invalid.
func ContextFromTraceparent(ctx context.Context, traceparent string) context.Context {
	if traceparent == "" {
		return ctx
	}
	return propagator.Extract(ctx, &oneHeader{v: traceparent})
}

var rpcTracer = NewTracer("github.com/keelmq/keel/libs/tracing")

// Interceptor propagates trace context over Connect calls, in the
// traceparent header, on clients and handlers, unary and streaming. A
// unary handler runs in a server span (a root one, sampled as any, when
// the caller sent no context); a unary client call made inside a sampled
// span gets a client span. Streams only carry the context: Keel's streams
// live as long as the processes, longer than any trace. With tracing off
// it does nothing.
func Interceptor() connect.Interceptor { return interceptor{} }

type interceptor struct{}

func (interceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if !Enabled() {
			return next(ctx, req)
		}
		spec := req.Spec()
		if spec.IsClient {
			parent := trace.SpanFromContext(ctx)
			if !parent.SpanContext().IsValid() {
				return next(ctx, req)
			}
			var span trace.Span
			if parent.IsRecording() {
				ctx, span = rpcTracer.Start(ctx, spanName(spec.Procedure),
					trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(rpcAttrs(spec.Procedure)...))
			}
			propagator.Inject(ctx, propagation.HeaderCarrier(req.Header()))
			res, err := next(ctx, req)
			if span != nil {
				endRPC(span, err)
			}
			return res, err
		}
		ctx = propagator.Extract(ctx, propagation.HeaderCarrier(req.Header()))
		ctx, span := rpcTracer.Start(ctx, spanName(spec.Procedure),
			trace.WithSpanKind(trace.SpanKindServer), trace.WithAttributes(rpcAttrs(spec.Procedure)...))
		res, err := next(ctx, req)
		endRPC(span, err)
		return res, err
	}
}

func (interceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		if Enabled() && trace.SpanContextFromContext(ctx).IsValid() {
			propagator.Inject(ctx, propagation.HeaderCarrier(conn.RequestHeader()))
		}
		return conn
	}
}

func (interceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		if Enabled() {
			ctx = propagator.Extract(ctx, propagation.HeaderCarrier(conn.RequestHeader()))
		}
		return next(ctx, conn)
	}
}

// spanName is the procedure without its leading slash:
// "keel.persistence.v1.PersistenceService/Write".
func spanName(procedure string) string { return strings.TrimPrefix(procedure, "/") }

func rpcAttrs(procedure string) []attribute.KeyValue {
	svc, method, _ := strings.Cut(strings.TrimPrefix(procedure, "/"), "/")
	return []attribute.KeyValue{
		attribute.String("rpc.system", "connect_rpc"),
		attribute.String("rpc.service", svc),
		attribute.String("rpc.method", method),
	}
}

func endRPC(span trace.Span, err error) {
	if err != nil && span.IsRecording() {
		code := connect.CodeOf(err)
		span.SetAttributes(attribute.String("rpc.connect_rpc.error_code", code.String()))
		span.SetStatus(codes.Error, code.String())
	}
	span.End()
}
