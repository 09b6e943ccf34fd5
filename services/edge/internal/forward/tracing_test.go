package forward

import (
	"fmt"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/libs/tracing"
	"github.com/keelmq/keel/services/edge/internal/auth"
	"github.com/keelmq/keel/services/edge/internal/broker"
	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/listener"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// traceSpans installs a provider with Keel's sampler at ratio on an
// in-memory exporter until the test ends. Tests using it are not parallel:
// the provider is the process's.
func traceSpans(t *testing.T, ratio float64) *tracetest.InMemoryExporter {
	t.Helper()
	exp := tracetest.NewInMemoryExporter()
	sampler := tracing.NewSampler(ratio, nil)
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp), sdktrace.WithSampler(sampler))
	t.Cleanup(tracing.Install(tp, sampler))
	return exp
}

// startDurableEdge is startEdge with an edge-local durable store, so that
// persistent sessions store what they are sent.
func startDurableEdge(t *testing.T, id string) *edge {
	t.Helper()
	cfg := broker.DefaultConfig()
	cfg.EdgeID = id
	b, err := broker.New(cfg, auth.Anonymous{Tenant: "acme"}, testutil.Logger(t), prometheus.NewRegistry())
	require.NoError(t, err)
	st, err := durable.Open(t.TempDir(), testutil.Logger(t))
	require.NoError(t, err)
	require.NoError(t, b.Restore(st))
	l := listener.NewTCP("tcp", "127.0.0.1:0", nil)
	require.NoError(t, b.AddListener(l))
	require.NoError(t, b.Serve())
	t.Cleanup(func() { _ = b.Close(); _ = st.Close() })
	ts := serveAPI(t, &Server{Deliver: b, Logger: testutil.Logger(t)})
	return &edge{b: b, mqtt: l.Address(), api: ts}
}

// spansNamed returns the exported spans called name.
func spansNamed(spans tracetest.SpanStubs, name string) []tracetest.SpanStub {
	var out []tracetest.SpanStub
	for _, s := range spans {
		if s.Name == name {
			out = append(out, s)
		}
	}
	return out
}

// One QoS 1 publish on edge A to a persistent subscriber on edge B makes
// one trace across both edges: mqtt.publish on A, a forward span to B
// under it, and on B a deliver span under the forward span (joined by the
// frame's traceparent) with the persist span of the subscriber's stored
// copy under it.
func TestForward_TraceSpansTwoEdges(t *testing.T) {
	exp := traceSpans(t, 1)
	a, b := startEdge(t, "edge-a"), startDurableEdge(t, "edge-b")
	connectForwarder(t, a, "edge-a", Peer{ID: "edge-b", URL: b.api.URL})

	sub := mqtttest.Dial(t, b.mqtt, 4)
	sub.Connect("sub", false, packets.Properties{}) // persistent: stored copies
	sub.Subscribe(1, "t/+", 1)
	pub := mqtttest.Dial(t, a.mqtt, 4)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "t/x", 1, []byte("hello"))
	pub.Expect(packets.Puback)
	got := sub.Expect(packets.Publish)
	require.Equal(t, []byte("hello"), got.Payload)

	var publish, fwd, deliver, persist tracetest.SpanStub
	testutil.Eventually(t, 5*time.Second, func() error {
		spans := exp.GetSpans()
		for _, want := range []struct {
			name string
			into *tracetest.SpanStub
		}{{"mqtt.publish", &publish}, {"forward", &fwd}, {"deliver", &deliver}, {"persist", &persist}} {
			found := spansNamed(spans, want.name)
			if len(found) != 1 {
				return fmt.Errorf("%d %s spans, want 1", len(found), want.name)
			}
			*want.into = found[0]
		}
		return nil
	})

	traceID := publish.SpanContext.TraceID()
	require.False(t, publish.Parent.IsValid(), "the publish starts the trace")
	require.Equal(t, traceID, fwd.SpanContext.TraceID())
	require.Equal(t, traceID, deliver.SpanContext.TraceID())
	require.Equal(t, traceID, persist.SpanContext.TraceID())
	require.Equal(t, publish.SpanContext.SpanID(), fwd.Parent.SpanID(), "forward under publish (edge A)")
	require.Equal(t, fwd.SpanContext.SpanID(), deliver.Parent.SpanID(), "deliver under forward (edge B)")
	require.True(t, deliver.Parent.IsRemote(), "deliver joined from the frame")
	require.Equal(t, deliver.SpanContext.SpanID(), persist.Parent.SpanID(), "persist under deliver (edge B)")
	require.Equal(t, "edge-b", attr(t, fwd, "keel.peer.edge_id"))
	require.Equal(t, "edge-a", attr(t, deliver, "keel.from.edge_id"))
	require.Equal(t, "acme", attr(t, publish, "keel.tenant"))
	require.Equal(t, "t/x", attr(t, publish, "messaging.destination.name"))
	require.False(t, publish.EndTime.Before(fwd.EndTime), "the publish ends with its PUBACK, after B took it")

	// The subscriber's CONNECT: a root span with auth and claim under it.
	connects := map[trace.SpanID]trace.TraceID{}
	for _, c := range spansNamed(exp.GetSpans(), "mqtt.connect") {
		require.False(t, c.Parent.IsValid())
		connects[c.SpanContext.SpanID()] = c.SpanContext.TraceID()
	}
	require.Len(t, connects, 2, "publisher and subscriber")
	for _, name := range []string{"auth", "cluster.claim"} {
		children := spansNamed(exp.GetSpans(), name)
		require.Len(t, children, 2, name)
		for _, c := range children {
			require.Equal(t, connects[c.Parent.SpanID()], c.SpanContext.TraceID(), "%s under a connect", name)
		}
	}
}

// A publish whose trace is not sampled leaves nothing on either edge: no
// span, and no traceparent in the frame for the receiver to start one.
func TestForward_UnsampledLeavesNoSpans(t *testing.T) {
	exp := traceSpans(t, 0)
	a, b := startEdge(t, "edge-a"), startDurableEdge(t, "edge-b")
	connectForwarder(t, a, "edge-a", Peer{ID: "edge-b", URL: b.api.URL})

	sub := mqtttest.Dial(t, b.mqtt, 4)
	sub.Connect("sub", false, packets.Properties{})
	sub.Subscribe(1, "t/+", 1)
	pub := mqtttest.Dial(t, a.mqtt, 4)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "t/x", 1, []byte("hello"))
	pub.Expect(packets.Puback)
	sub.Expect(packets.Publish)
	require.Empty(t, exp.GetSpans())
}

func attr(t *testing.T, s tracetest.SpanStub, key string) string {
	t.Helper()
	for _, kv := range s.Attributes {
		if string(kv.Key) == key {
			return kv.Value.Emit()
		}
	}
	t.Fatalf("span %s has no attribute %s", s.Name, key)
	return ""
}
