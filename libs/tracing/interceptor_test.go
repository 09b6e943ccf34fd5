package tracing_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/libs/tracing"
	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"
	"github.com/keelmq/keel/proto/gen/keel/edge/v1/edgev1connect"
)

// seen records the span context each handler ran under.
type seen struct {
	edgev1connect.UnimplementedEdgeServiceHandler
	unary, stream chan trace.SpanContext
}

func (s *seen) Status(ctx context.Context, _ *connect.Request[edgev1.StatusRequest]) (*connect.Response[edgev1.StatusResponse], error) {
	s.unary <- trace.SpanContextFromContext(ctx)
	return connect.NewResponse(&edgev1.StatusResponse{}), nil
}

func (s *seen) Forward(ctx context.Context, st *connect.BidiStream[edgev1.ForwardRequest, edgev1.ForwardResponse]) error {
	if _, err := st.Receive(); err != nil {
		return err
	}
	s.stream <- trace.SpanContextFromContext(ctx)
	return st.Send(&edgev1.ForwardResponse{TakenSeq: 1})
}

// The caller's trace reaches Connect handlers, unary and streaming, through
// the interceptor on both sides: a unary call gets a client span and a
// server span under it; a stream carries the context only.
func TestInterceptor_PropagatesOverConnect(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp), sdktrace.WithSampler(tracing.NewSampler(1, nil)))
	t.Cleanup(tracing.Install(tp, nil))

	h := &seen{unary: make(chan trace.SpanContext, 1), stream: make(chan trace.SpanContext, 1)}
	mux := http.NewServeMux()
	mux.Handle(edgev1connect.NewEdgeServiceHandler(h, rpc.HandlerOptions()...))
	ts := httptest.NewUnstartedServer(mux)
	ts.Config.Protocols = rpc.ServerProtocols()
	ts.Start()
	t.Cleanup(ts.Close)
	client := edgev1connect.NewEdgeServiceClient(rpc.H2CClient(), ts.URL, rpc.ClientOptions(connect.WithGRPC())...)

	ctx, caller := tracing.NewTracer("test").Start(t.Context(), "caller")
	callerSC := caller.SpanContext()

	_, err := client.Status(ctx, connect.NewRequest(&edgev1.StatusRequest{}))
	require.NoError(t, err)
	got := <-h.unary
	require.Equal(t, callerSC.TraceID(), got.TraceID(), "unary handler joins the caller's trace")

	st := client.Forward(ctx)
	require.NoError(t, st.Send(&edgev1.ForwardRequest{EdgeId: "a", Seq: 1}))
	_, err = st.Receive()
	require.NoError(t, err)
	require.NoError(t, st.CloseRequest())
	require.NoError(t, st.CloseResponse())
	got = <-h.stream
	require.True(t, got.IsRemote())
	require.Equal(t, callerSC.TraceID(), got.TraceID(), "stream handler sees the caller's trace")
	require.Equal(t, callerSC.SpanID(), got.SpanID(), "a stream has no span of its own")
	caller.End()

	spans := exp.GetSpans()
	byName := map[string]tracetest.SpanStub{}
	for _, s := range spans {
		if s.SpanKind == trace.SpanKindClient || s.SpanKind == trace.SpanKindServer {
			byName[s.SpanKind.String()] = s
		}
	}
	require.Len(t, byName, 2, "%v", spans)
	cs, ss := byName["client"], byName["server"]
	require.Equal(t, "keel.edge.v1.EdgeService/Status", cs.Name)
	require.Equal(t, callerSC.SpanID(), cs.Parent.SpanID())
	require.Equal(t, cs.SpanContext.SpanID(), ss.Parent.SpanID())
	require.True(t, ss.Parent.IsRemote())
}

// A handler error marks the server span; calls made outside any span send
// no context and get no client span.
func TestInterceptor_ErrorsAndUntracedCalls(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp), sdktrace.WithSampler(tracing.NewSampler(1, nil)))
	t.Cleanup(tracing.Install(tp, nil))

	mux := http.NewServeMux()
	mux.Handle(edgev1connect.NewEdgeServiceHandler(edgev1connect.UnimplementedEdgeServiceHandler{}, rpc.HandlerOptions()...))
	ts := httptest.NewUnstartedServer(mux)
	ts.Config.Protocols = rpc.ServerProtocols()
	ts.Start()
	t.Cleanup(ts.Close)
	client := edgev1connect.NewEdgeServiceClient(rpc.H2CClient(), ts.URL, rpc.ClientOptions()...)

	_, err := client.Drain(context.Background(), connect.NewRequest(&edgev1.DrainRequest{}))
	var cerr *connect.Error
	require.True(t, errors.As(err, &cerr))
	spans := exp.GetSpans()
	require.Len(t, spans, 1, "only the server's root span")
	require.Equal(t, trace.SpanKindServer, spans[0].SpanKind)
	require.False(t, spans[0].Parent.IsValid())
	require.Equal(t, "Error", spans[0].Status.Code.String())
}
