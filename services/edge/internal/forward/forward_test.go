package forward

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/libs/testutil"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"
	"github.com/keelmq/keel/services/edge/internal/auth"
	"github.com/keelmq/keel/services/edge/internal/broker"
	"github.com/keelmq/keel/services/edge/internal/listener"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// serveAPI serves srv's edge API on an h2c test server until the test ends.
func serveAPI(t *testing.T, srv *Server) *httptest.Server {
	t.Helper()
	mux := http.NewServeMux()
	mux.Handle(srv.Handler())
	ts := httptest.NewUnstartedServer(mux)
	ts.Config.Protocols = rpc.ServerProtocols()
	ts.Config.HTTP2 = rpc.ServerHTTP2()
	ts.Start()
	t.Cleanup(ts.Close)
	return ts
}

type edge struct {
	b    *broker.Broker
	srv  *Server
	mqtt string
	api  *httptest.Server
}

// startEdge runs a broker with its edge API on an h2c test server.
func startEdge(t *testing.T, id string) *edge {
	t.Helper()
	return startEdgeWith(t, id, func(*broker.Config) {}, prometheus.NewRegistry())
}

// startEdgeWith is startEdge with the broker's configuration changed by set
// and its metrics in reg.
func startEdgeWith(t *testing.T, id string, set func(*broker.Config), reg *prometheus.Registry) *edge {
	t.Helper()
	cfg := broker.DefaultConfig()
	cfg.EdgeID = id
	set(&cfg)
	b, err := broker.New(cfg, auth.Anonymous{Tenant: "acme"}, testutil.Logger(t), reg)
	require.NoError(t, err)
	l := listener.NewTCP("tcp", "127.0.0.1:0", nil)
	require.NoError(t, b.AddListener(l))
	require.NoError(t, b.Serve())
	t.Cleanup(func() { _ = b.Close() })
	srv := &Server{Deliver: b, Logger: testutil.Logger(t)}
	return &edge{b: b, srv: srv, mqtt: l.Address(), api: serveAPI(t, srv)}
}

// expectClosedUnacknowledged waits, up to within, for the server to close
// pub's connection (a DISCONNECT), and fails if it acknowledges a publish
// first: no peer took it.
func expectClosedUnacknowledged(t *testing.T, pub *mqtttest.Client, within time.Duration) {
	t.Helper()
	for {
		pk, err := pub.Read(within)
		require.NoError(t, err, "expected the publisher closed without an acknowledgement")
		require.NotEqual(t, packets.Puback, pk.FixedHeader.Type, "acknowledged although no peer took it")
		if pk.FixedHeader.Type == packets.Disconnect {
			return
		}
	}
}

// staticRoutes sends every topic to the listed peers.
type staticRoutes []Peer

func (s staticRoutes) Route(context.Context, string, string) (Route, error) {
	return Route{Edges: s}, nil
}

func connectForwarder(t *testing.T, from *edge, self string, to ...Peer) *Forwarder {
	t.Helper()
	return connectForwarderBound(t, from, self, time.Second, to...)
}

func connectForwarderBound(t *testing.T, from *edge, self string, bound time.Duration, to ...Peer) *Forwarder {
	t.Helper()
	_, inc := from.b.ID()
	f := &Forwarder{Self: self, Incarnation: func() uint64 { return inc }, Resolver: staticRoutes(to), Bound: bound, Logger: testutil.Logger(t)}
	runForwarder(t, from, f)
	return f
}

// runForwarder runs f as from's forwarder until the returned stop (or the
// test's end), and returns once f is running.
func runForwarder(t *testing.T, from *edge, f *Forwarder) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = f.Run(ctx); close(done) }()
	stop = func() { cancel(); <-done }
	t.Cleanup(stop)
	require.Eventually(t, func() bool {
		f.mu.Lock()
		defer f.mu.Unlock()
		return f.ctx != nil
	}, 5*time.Second, time.Millisecond)
	from.b.SetCluster(broker.Cluster{Peers: f})
	return stop
}

// pairAcrossEdges starts edges A and B, A forwarding to B, and connects a
// subscriber to t/+ at QoS 1 on B and a publisher on A.
func pairAcrossEdges(t *testing.T) (pub, sub *mqtttest.Client) {
	t.Helper()
	a, b := startEdge(t, "edge-a"), startEdge(t, "edge-b")
	connectForwarder(t, a, "edge-a", Peer{ID: "edge-b", URL: b.api.URL})
	sub = mqtttest.Dial(t, b.mqtt, 5)
	sub.Connect("sub", true, packets.Properties{})
	sub.Subscribe(1, "t/+", 1)
	pub = mqtttest.Dial(t, a.mqtt, 4)
	pub.Connect("pub", true, packets.Properties{})
	return pub, sub
}

// A QoS 1 message published on edge A reaches a subscriber on edge B, and
// the publisher's PUBACK comes once B took it.
func TestForward_AcrossEdges(t *testing.T) {
	t.Parallel()
	pub, sub := pairAcrossEdges(t)
	const n = 100
	for i := range n {
		pub.Publish(uint16(i+1), "t/x", 1, []byte{byte(i)})
	}
	for range n {
		pub.Expect(packets.Puback)
	}
	for i := range n {
		got := sub.Expect(packets.Publish)
		require.Equal(t, []byte{byte(i)}, got.Payload, "in order")
		require.Equal(t, "t/x", got.TopicName)
		sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
	}
}

// QoS 0 and QoS 1 messages of one publisher, forwarded across edges (the
// QoS 0 ones in runs of their own, sendPlain), reach the subscriber in the
// order they were published.
func TestForward_AcrossEdgesQoS0AndQoS1InOrder(t *testing.T) {
	t.Parallel()
	pub, sub := pairAcrossEdges(t)
	const n = 600
	acks := 0
	for i := range n {
		qos := byte(0)
		if i%50 == 49 {
			qos = 1
			acks++
		}
		pub.Publish(uint16(i+1), "t/x", qos, []byte(fmt.Sprint(i)))
	}
	for range acks {
		pub.Expect(packets.Puback)
	}
	for i := range n {
		got := sub.Expect(packets.Publish)
		require.Equal(t, fmt.Sprint(i), string(got.Payload), "in order")
		if got.FixedHeader.Qos > 0 {
			sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
		}
	}
}

// When the peer cannot take a QoS 1 message within the bound, the publisher
// gets no PUBACK: it is disconnected and sends the message again.
func TestForward_PeerGoneNoAck(t *testing.T) {
	t.Parallel()
	a, b := startEdge(t, "edge-a"), startEdge(t, "edge-b")
	url := b.api.URL
	b.api.Close() // the peer's API is gone
	connectForwarder(t, a, "edge-a", Peer{ID: "edge-b", URL: url})

	pub := mqtttest.Dial(t, a.mqtt, 5)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "t/x", 1, []byte("x"))
	expectClosedUnacknowledged(t, pub, 5*time.Second)
}

type countingDeliverer struct{ n int }

func (c *countingDeliverer) DeliverForwarded(context.Context, *commonv1.Message, broker.SharedChoice) error {
	c.n++
	return nil
}

func (c *countingDeliverer) DeliverRelayed(context.Context, *commonv1.Message, []broker.RelayTarget) error {
	c.n++
	return nil
}

func (c *countingDeliverer) RedispatchShared(*commonv1.Message, broker.GroupKey, string) {}

// A frame resent after a reconnect is acknowledged again but delivered once:
// the receiver keeps the highest frame sequence per sending incarnation.
func TestServer_FramesDeliveredOnce(t *testing.T) {
	t.Parallel()
	d := &countingDeliverer{}
	srv := &Server{Deliver: d}
	ts := serveAPI(t, srv)
	frame := &edgev1.ForwardRequest{EdgeId: "a", Incarnation: 1, Seq: 1,
		Messages: []*edgev1.ForwardMessage{{Message: &commonv1.Message{Tenant: "acme", Topic: "t"}}}}
	for range 2 { // two streams, as after a reconnect
		l := NewLink("a", 1, "b", ts.URL, testutil.Logger(t), nil)
		st := l.client.Forward(t.Context())
		require.NoError(t, st.Send(frame))
		resp, err := st.Receive()
		require.NoError(t, err)
		require.Equal(t, uint64(1), resp.GetTakenSeq())
		require.NoError(t, st.CloseRequest())
		require.NoError(t, st.CloseResponse())
	}
	require.Equal(t, 1, d.n)

	// Garbage: a frame without sequence, or without its sender, is refused.
	for _, bad := range []*edgev1.ForwardRequest{{EdgeId: "a"}, {Seq: 2, Messages: frame.GetMessages()}} {
		l := NewLink("a", 1, "b", ts.URL, testutil.Logger(t), nil)
		st := l.client.Forward(t.Context())
		require.NoError(t, st.Send(bad))
		_, err := st.Receive()
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
		_ = st.CloseRequest()
		_ = st.CloseResponse()
	}
}

// staticMembers is a membership that does not change.
type staticMembers map[string]uint64

func (m staticMembers) Incarnation(id string) (uint64, bool) { inc, ok := m[id]; return inc, ok }
func (staticMembers) Refresh(context.Context) error          { return nil }

// A stream or a takeover from an edge incarnation that is not live (a
// fenced edge, one that rejoined since, or no member at all) is refused,
// and nothing it sent is delivered.
func TestServer_RefusesExpiredIncarnations(t *testing.T) {
	t.Parallel()
	d := &countingDeliverer{}
	srv := &Server{Deliver: d, Members: staticMembers{"a": 2}, Sessions: refusingSessions{t}}
	ts := serveAPI(t, srv)
	send := func(edge string, inc uint64) error {
		l := NewLink(edge, inc, "b", ts.URL, testutil.Logger(t), nil)
		st := l.client.Forward(t.Context())
		defer func() { _ = st.CloseRequest(); _ = st.CloseResponse() }()
		if err := st.Send(&edgev1.ForwardRequest{EdgeId: edge, Incarnation: inc, Seq: 1,
			Messages: []*edgev1.ForwardMessage{{Message: &commonv1.Message{Tenant: "acme", Topic: "t"}}}}); err != nil {
			return err
		}
		_, err := st.Receive()
		return err
	}
	require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(send("a", 1)), "an older incarnation")
	require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(send("z", 1)), "not a member")
	require.Zero(t, d.n)
	require.NoError(t, send("a", 2))
	require.Equal(t, 1, d.n)

	client := NewLink("a", 1, "b", ts.URL, testutil.Logger(t), nil).client
	_, err := client.TakeoverBegin(t.Context(), connect.NewRequest(&edgev1.TakeoverBeginRequest{
		Session: &commonv1.SessionKey{Tenant: "acme", ClientId: "c"}, NewEpoch: 9, NewOwnerEdgeId: "a", NewOwnerIncarnation: 1}))
	require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err), "a takeover from an expired incarnation: %v", err)
}

// refusingSessions fails the test if a takeover reaches it.
type refusingSessions struct{ t *testing.T }

func (r refusingSessions) TakeOver(context.Context, string, string, string, uint64, bool) (bool, bool, []byte, error) {
	r.t.Error("takeover reached the sessions")
	return false, false, nil, nil
}

func (r refusingSessions) TakeoverEnd(context.Context, string, string, uint64) ([]byte, error) {
	r.t.Error("takeover end reached the sessions")
	return nil, nil
}

// failingDeliverer takes messages but fails once at the given position.
type failingDeliverer struct {
	failAt int
	calls  int
	got    []string
}

func (d *failingDeliverer) DeliverForwarded(_ context.Context, m *commonv1.Message, _ broker.SharedChoice) error {
	d.calls++
	if d.calls == d.failAt {
		return errors.New("store unavailable")
	}
	d.got = append(d.got, m.GetTopic())
	return nil
}

func (d *failingDeliverer) DeliverRelayed(ctx context.Context, m *commonv1.Message, _ []broker.RelayTarget) error {
	return d.DeliverForwarded(ctx, m, broker.SharedChoice{})
}

func (d *failingDeliverer) RedispatchShared(*commonv1.Message, broker.GroupKey, string) {}

// A frame that fails part-way is resent whole, and the messages taken
// before the failure are not delivered again: a QoS 2 message arrives once.
func TestServer_FrameFailingPartWay(t *testing.T) {
	t.Parallel()
	d := &failingDeliverer{failAt: 3}
	srv := &Server{Deliver: d}
	ts := serveAPI(t, srv)
	frame := &edgev1.ForwardRequest{EdgeId: "a", Incarnation: 1, Seq: 1}
	for _, topic := range []string{"t1", "t2", "t3", "t4"} {
		frame.Messages = append(frame.Messages, &edgev1.ForwardMessage{Message: &commonv1.Message{Tenant: "acme", Topic: topic, Qos: 2}})
	}
	require.ErrorIs(t, sendFrame(t, ts.URL, frame), errResend)
	require.NoError(t, sendFrame(t, ts.URL, frame))
	require.Equal(t, []string{"t1", "t2", "t3", "t4"}, d.got)
}

// sendFrame sends frame on a stream of its own to the edge API at url, and
// returns nil once it is acknowledged, errResend when the peer asks for it
// again, or the stream's error.
func sendFrame(t *testing.T, url string, frame *edgev1.ForwardRequest) error {
	t.Helper()
	return sendFrames(t, url, frame)
}

// sendFrames is sendFrame for several frames, in order, on one stream: nil
// once the last is acknowledged.
func sendFrames(t *testing.T, url string, frames ...*edgev1.ForwardRequest) error {
	t.Helper()
	last := frames[len(frames)-1]
	l := NewLink(last.GetEdgeId(), last.GetIncarnation(), "b", url, testutil.Logger(t), nil)
	st := l.client.Forward(t.Context())
	defer func() { _ = st.CloseRequest(); _ = st.CloseResponse() }()
	for _, f := range frames {
		require.NoError(t, st.Send(f))
	}
	for {
		resp, err := st.Receive()
		switch {
		case err != nil:
			return err
		case resp.GetResend():
			return errResend
		case resp.GetTakenSeq() >= last.GetSeq():
			return nil
		}
	}
}

// When the peer leaves the membership, what waits for it fails at once,
// well before the forward bound: its publisher is closed unacknowledged.
func TestForward_PeerGoneFailsAtOnce(t *testing.T) {
	t.Parallel()
	a, b := startEdge(t, "edge-a"), startEdge(t, "edge-b")
	url := b.api.URL
	b.api.Close() // the peer stopped answering
	f := connectForwarderBound(t, a, "edge-a", time.Minute, Peer{ID: "edge-b", URL: url})

	pub := mqtttest.Dial(t, a.mqtt, 5)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "t/x", 1, []byte("x"))
	_, err := pub.Read(300 * time.Millisecond)
	require.Error(t, err, "nothing while the peer may still take it")
	gone := time.Now()
	f.PeerGone("edge-b")
	expectClosedUnacknowledged(t, pub, 5*time.Second)
	require.Less(t, time.Since(gone), 5*time.Second)
}

// A link made again to a peer (it left the membership and came back)
// numbers its frames above the old link's: the peer, which remembers the
// highest frame it took from this edge's incarnation, delivers them
// instead of taking them for resends it has seen.
func TestForward_NewLinkAfterPeerCameBack(t *testing.T) {
	t.Parallel()
	a, b := startEdge(t, "edge-a"), startEdge(t, "edge-b")
	f := connectForwarder(t, a, "edge-a", Peer{ID: "edge-b", URL: b.api.URL})
	sub := mqtttest.Dial(t, b.mqtt, 5)
	sub.Connect("sub", true, packets.Properties{})
	sub.Subscribe(1, "t/+", 1)
	pub := mqtttest.Dial(t, a.mqtt, 5)
	pub.Connect("pub", true, packets.Properties{})
	for i := range 5 {
		pub.Publish(uint16(i+1), "t/x", 1, []byte{byte(i)})
		pub.Expect(packets.Puback)
	}
	for i := range 5 {
		got := sub.Expect(packets.Publish)
		require.Equal(t, []byte{byte(i)}, got.Payload)
		sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
	}
	f.PeerGone("edge-b") // as when its lease expired; it is back at once
	pub.Publish(6, "t/x", 1, []byte("after"))
	pub.Expect(packets.Puback)
	got := sub.Expect(packets.Publish)
	require.Equal(t, "after", string(got.Payload), "delivered, not taken for a resend")
}

// Reconnects back off while streams fail, and start over after a stream
// the peer acknowledged frames on.
func TestReconnectWait(t *testing.T) {
	var waits []time.Duration
	w := time.Duration(0)
	for _, acked := range []bool{false, false, false, true, false} {
		w = reconnectWait(w, acked)
		waits = append(waits, w)
	}
	require.Equal(t, []time.Duration{50 * time.Millisecond, 100 * time.Millisecond, 200 * time.Millisecond,
		50 * time.Millisecond, 100 * time.Millisecond}, waits)
	for range 10 {
		w = reconnectWait(w, false)
	}
	require.Equal(t, 2*time.Second, w)
}

// movingRoutes sends every topic to one peer, whose incarnation the test
// changes.
type movingRoutes struct {
	peer Peer
	inc  atomic.Uint64
}

func (r *movingRoutes) Route(context.Context, string, string) (Route, error) {
	p := r.peer
	p.Incarnation = r.inc.Load()
	return Route{Edges: []Peer{p}}, nil
}

// Frames meant for an earlier incarnation of a peer (it restarted, and its
// sessions went to other edges with that incarnation's end) are refused
// there: taken, they would reach none of those sessions and their
// publishers would be acknowledged for nothing. The publish is not
// acknowledged; routed to the incarnation the membership names now, the
// next one is taken.
func TestForward_RestartedPeerRefusesFramesForItsEarlierIncarnation(t *testing.T) {
	t.Parallel()
	a, b := startEdge(t, "edge-a"), startEdge(t, "edge-b")
	b.srv.Incarnation = func() uint64 { return 2 }
	routes := &movingRoutes{peer: Peer{ID: "edge-b", URL: b.api.URL}}
	routes.inc.Store(1) // the membership has not heard of the restart yet
	_, inc := a.b.ID()
	f := &Forwarder{Self: "edge-a", Incarnation: func() uint64 { return inc }, Resolver: routes, Bound: time.Minute, Logger: testutil.Logger(t)}
	runForwarder(t, a, f)
	sub := mqtttest.Dial(t, b.mqtt, 5)
	sub.Connect("sub", true, packets.Properties{})
	sub.Subscribe(1, "t/+", 1)

	pub := mqtttest.Dial(t, a.mqtt, 5)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "t/x", 1, []byte("for the earlier incarnation"))
	expectClosedUnacknowledged(t, pub, 5*time.Second)
	_, err := sub.Read(200 * time.Millisecond)
	require.Error(t, err, "nothing reached the restarted peer's subscriber")

	routes.inc.Store(2)
	again := mqtttest.Dial(t, a.mqtt, 5)
	again.Connect("pub", true, packets.Properties{})
	again.Publish(1, "t/x", 1, []byte("for the live incarnation"))
	again.Expect(packets.Puback)
	require.Equal(t, "for the live incarnation", string(sub.Expect(packets.Publish).Payload))
}

// gatedDeliverer holds the first message delivered until gate closes, and
// records every message's topic in order.
type gatedDeliverer struct {
	gate    chan struct{}
	holding chan struct{} // closed once the first message is held
	mu      sync.Mutex
	topics  []string
}

func (g *gatedDeliverer) DeliverForwarded(_ context.Context, m *commonv1.Message, _ broker.SharedChoice) error {
	g.mu.Lock()
	first := len(g.topics) == 0
	g.topics = append(g.topics, m.GetTopic())
	g.mu.Unlock()
	if first {
		close(g.holding)
		<-g.gate
	}
	return nil
}

func (g *gatedDeliverer) DeliverRelayed(context.Context, *commonv1.Message, []broker.RelayTarget) error {
	return nil
}

func (g *gatedDeliverer) RedispatchShared(*commonv1.Message, broker.GroupKey, string) {}

func (g *gatedDeliverer) delivered() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.topics)
}

// While the peer has sendWindow frames unacknowledged, what is published
// gathers into the next frame instead of going out a frame per message;
// every message still arrives, in order.
func TestLink_MessagesGatherWhileFramesAreUnacknowledged(t *testing.T) {
	t.Parallel()
	d := &gatedDeliverer{gate: make(chan struct{}), holding: make(chan struct{})}
	ts := serveAPI(t, &Server{Deliver: d})
	m := NewMetrics(prometheus.NewRegistry())
	l := NewLink("a", 1, "b", ts.URL, testutil.Logger(t), m)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = l.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })

	msg := func(i int) *edgev1.ForwardMessage {
		return &edgev1.ForwardMessage{Message: &commonv1.Message{Tenant: "acme", Topic: fmt.Sprintf("t/%d", i)}}
	}
	first := &pending{msg: msg(0), waits: true}
	l.send(first)
	<-d.holding // frame 1 is held in delivery: unacknowledged
	l.send(&pending{msg: msg(1)})
	testutil.Eventually(t, 5*time.Second, func() error {
		if n := promtest.ToFloat64(m.frames); n != 2 {
			return fmt.Errorf("%v frames sent", n)
		}
		return nil
	})
	const later = 100
	for i := range later {
		l.send(&pending{msg: msg(2 + i)})
		time.Sleep(100 * time.Microsecond) // the send loop wakes for each
	}
	require.Equal(t, 2.0, promtest.ToFloat64(m.frames), "a frame went out with the window full")
	close(d.gate)
	require.NoError(t, waitOne(context.Background(), time.Now().Add(5*time.Second), 5*time.Second, first))
	testutil.Eventually(t, 5*time.Second, func() error {
		if n := len(d.delivered()); n != 2+later {
			return fmt.Errorf("%d delivered", n)
		}
		return nil
	})
	want := make([]string, 2+later)
	for i := range want {
		want[i] = fmt.Sprintf("t/%d", i)
	}
	require.Equal(t, want, d.delivered())
	require.Equal(t, 3.0, promtest.ToFloat64(m.frames), "the messages published meanwhile go in one frame")
}
