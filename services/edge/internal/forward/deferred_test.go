package forward

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"
	"github.com/keelmq/keel/services/edge/internal/auth"
	"github.com/keelmq/keel/services/edge/internal/broker"
	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/listener"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// flakyStore is a real durable store whose first Enqueue of a message with
// the payload "fail" reports a failure (and stores nothing), and whose
// writes of messages with a payload starting "slow" complete only once gate
// is closed (nil: at once). It records the payloads enqueued, in order.
type flakyStore struct {
	*durable.Store
	failed atomic.Bool
	gate   chan struct{}
	mu     sync.Mutex
	queued []string
	// sendFails makes the send of the "fail" message fail once too: a
	// member sent it before its failed queueing was known would otherwise
	// have it stored in flight, which counts as taken.
	sendFails, sendFailed atomic.Bool
}

func (s *flakyStore) Send(id string, entries []durable.Entry) *durable.Pending {
	if s.sendFails.Load() {
		for _, e := range entries {
			if e.Msg != nil && string(e.Msg.Payload) == "fail" && s.sendFailed.CompareAndSwap(false, true) {
				return durable.DonePending(fmt.Errorf("injected store failure"))
			}
		}
	}
	return s.Store.Send(id, entries)
}

func (s *flakyStore) Enqueue(id string, e durable.Entry) *durable.Pending {
	if e.Msg != nil {
		s.mu.Lock()
		s.queued = append(s.queued, string(e.Msg.Payload))
		s.mu.Unlock()
	}
	if e.Msg != nil && string(e.Msg.Payload) == "fail" && s.failed.CompareAndSwap(false, true) {
		return durable.DonePending(fmt.Errorf("injected store failure"))
	}
	p := s.Store.Enqueue(id, e)
	if e.Msg == nil || s.gate == nil || !strings.HasPrefix(string(e.Msg.Payload), "slow") {
		return p
	}
	done := make(chan error, 1)
	go func() {
		<-s.gate
		done <- p.Wait(context.Background())
	}()
	return durable.NewPending(done)
}

func (s *flakyStore) enqueued() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.queued)
}

// storedEdge is a broker on a flakyStore with its edge API.
type storedEdge struct {
	b    *broker.Broker
	api  string // URL of the edge API
	mqtt string // address of the MQTT listener
}

// startStoredEdge runs a broker on store with its edge API, and a
// persistent subscriber of "t" at qos.
func startStoredEdge(t *testing.T, store *flakyStore, qos byte) (api string, sub *mqtttest.Client) {
	t.Helper()
	e, sub := startStoredEdgeAt(t, store, qos)
	return e.api, sub
}

func startStoredEdgeAt(t *testing.T, store *flakyStore, qos byte) (*storedEdge, *mqtttest.Client) {
	t.Helper()
	e := serveStored(t, "b", store, false)
	sub := mqtttest.Dial(t, e.mqtt, 5)
	// One delivery in flight: until the test reads, the later messages stay
	// queued, so a queueing the store fails is known before the writer
	// could send the message. One the writer sent, and its send stored, is
	// taken whatever became of its queueing.
	props := sessionProps
	props.ReceiveMaximum = 1
	sub.Connect("sub", true, props)
	require.Equal(t, []byte{qos}, sub.Subscribe(1, "t", qos).ReasonCodes)
	return e, sub
}

// serveStored runs broker id on store, a real durable store, with its
// edge API. With shared, the store says it is shared by the cluster (as
// the persistence service is), and the broker reports the outcomes of
// group messages to their origins through its API.
func serveStored(t *testing.T, id string, store *flakyStore, shared bool) *storedEdge {
	t.Helper()
	cfg := broker.DefaultConfig()
	cfg.EdgeID = id
	b, err := broker.New(cfg, auth.Anonymous{Tenant: "acme"}, testutil.Logger(t), prometheus.NewRegistry())
	require.NoError(t, err)
	st, err := durable.Open(t.TempDir(), testutil.Logger(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = st.Close() })
	store.Store = st
	var state broker.DurableState = store
	if shared {
		state = sharedFlakyStore{store}
	}
	require.NoError(t, b.Restore(state))
	l := listener.NewTCP("tcp", "127.0.0.1:0", nil)
	require.NoError(t, b.AddListener(l))
	srv := &Server{Deliver: b, Logger: testutil.Logger(t)}
	if shared {
		b.SetCluster(broker.Cluster{Reports: srv})
	}
	require.NoError(t, b.Serve())
	t.Cleanup(func() { _ = b.Close() })
	ts := serveAPI(t, srv)
	return &storedEdge{b: b, api: ts.URL, mqtt: l.Address()}
}

// sharedFlakyStore is a flakyStore that says it is shared by the cluster:
// a group message queued for a persistent member is then the receiving
// edge's to keep, and reported acknowledged to its origin once stored.
type sharedFlakyStore struct{ *flakyStore }

func (sharedFlakyStore) Shared() bool { return true }

var sessionProps = packets.Properties{SessionExpiryInterval: 300, SessionExpiryIntervalFlag: true}

// away disconnects the edge's one subscriber and waits until its session
// is offline, so what comes for it stays queued.
func (e *storedEdge) away(t *testing.T, sub *mqtttest.Client) {
	t.Helper()
	sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	testutil.Eventually(t, 5*time.Second, func() error {
		if st := e.b.Status(); st.SessionsOffline != 1 {
			return fmt.Errorf("status %+v", st)
		}
		return nil
	})
}

// back connects the subscriber again, resuming its session.
func (e *storedEdge) back(t *testing.T) *mqtttest.Client {
	t.Helper()
	sub := mqtttest.Dial(t, e.mqtt, 5)
	sub.Connect("sub", false, sessionProps)
	return sub
}

// frameOf is frame seq of edge "a" incarnation 1 carrying payloads on "t"
// at qos, with msgIDs numbered from first.
func frameOf(seq uint64, qos uint32, first uint64, payloads ...string) *edgev1.ForwardRequest {
	f := &edgev1.ForwardRequest{EdgeId: "a", Incarnation: 1, Seq: seq}
	for i, p := range payloads {
		f.Messages = append(f.Messages, &edgev1.ForwardMessage{Message: &commonv1.Message{
			Id: &commonv1.MsgID{EdgeId: "a", Incarnation: 1, Seq: first + uint64(i)}, Tenant: "acme", Topic: "t",
			Payload: []byte(p), Qos: qos, IngressUnixNano: time.Now().UnixNano()}})
	}
	return f
}

// readAll reads and acknowledges PUBLISHes until a second passes without
// one, and counts them by payload.
func readAll(sub *mqtttest.Client) map[string]int {
	counts := map[string]int{}
	for _, p := range readInOrder(sub) {
		counts[p]++
	}
	return counts
}

// readInOrder reads and acknowledges PUBLISHes until a second passes
// without one, and returns their payloads in arrival order.
func readInOrder(sub *mqtttest.Client) []string {
	var got []string
	for {
		pk, err := sub.Read(time.Second)
		if err != nil {
			return got
		}
		switch pk.FixedHeader.Type {
		case packets.Publish:
			got = append(got, string(pk.Payload))
			if pk.FixedHeader.Qos == 2 {
				sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: pk.PacketID})
			} else {
				sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
			}
		case packets.Pubrel:
			sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: pk.PacketID})
		}
	}
}

// The frames of one stream are delivered as they come while the writes of
// earlier ones are still being stored, and acknowledged in order once
// stored. When one fails, the frames after it are not acknowledged either;
// on the resend, what they had taken is not delivered again.
func TestServer_FramesStoredConcurrently(t *testing.T) {
	t.Parallel()
	store := &flakyStore{gate: make(chan struct{})}
	api, sub := startStoredEdge(t, store, 1)
	l := NewLink("a", 1, "b", api, testutil.Logger(t), nil)
	st := l.client.Forward(t.Context())
	defer func() { _ = st.CloseRequest(); _ = st.CloseResponse() }()
	require.NoError(t, st.Send(frameOf(1, 1, 1, "slow1")))
	require.NoError(t, st.Send(frameOf(2, 1, 2, "two")))
	testutil.Eventually(t, 5*time.Second, func() error {
		if got := store.enqueued(); !slices.Equal(got, []string{"slow1", "two"}) {
			return fmt.Errorf("enqueued %v", got)
		}
		return nil
	})
	acks := make(chan *edgev1.ForwardResponse, 8)
	go func() {
		for {
			resp, err := st.Receive()
			if err != nil {
				close(acks)
				return
			}
			acks <- resp
		}
	}()
	select {
	case resp := <-acks:
		t.Fatalf("acknowledged %v while frame 1's write is not stored", resp)
	case <-time.After(300 * time.Millisecond):
	}
	close(store.gate)
	var taken uint64
	for taken < 2 {
		resp, ok := <-acks
		require.True(t, ok, "stream ended before frame 2 was acknowledged")
		require.False(t, resp.GetResend())
		taken = max(taken, resp.GetTakenSeq())
	}

	// Frame 3's write fails; frame 4, delivered meanwhile, is stored but not
	// acknowledged, and the resend delivers neither of its messages twice.
	require.NoError(t, st.Send(frameOf(3, 1, 3, "fail")))
	require.NoError(t, st.Send(frameOf(4, 1, 4, "four", "five")))
	for resp := range acks {
		require.Less(t, resp.GetTakenSeq(), uint64(3), "a frame at or after the failed one acknowledged")
		if resp.GetResend() {
			break
		}
	}
	require.NoError(t, sendFrames(t, api, frameOf(3, 1, 3, "fail"), frameOf(4, 1, 4, "four", "five")))
	counts := readAll(sub)
	require.GreaterOrEqual(t, counts["fail"], 1, "the failed message comes with the resend (%v)", counts)
	delete(counts, "fail")
	require.Equal(t, map[string]int{"slow1": 1, "two": 1, "four": 1, "five": 1}, counts, "each stored message once")
}

// A frame's durable writes are submitted together and waited for after:
// a message whose write fails leaves the frame unacknowledged, and on the
// resend only that message is delivered again: the messages stored the
// first time are not (a QoS 2 message arrives once).
func TestServer_DeferredWritesPerMessage(t *testing.T) {
	t.Parallel()
	api, sub := startStoredEdge(t, &flakyStore{}, 2)
	frame := frameOf(1, 2, 1, "one", "fail", "three")
	require.ErrorIs(t, sendFrame(t, api, frame), errResend)
	require.NoError(t, sendFrame(t, api, frame))
	counts := readAll(sub)
	require.Equal(t, 1, counts["one"], "stored the first time: delivered once (%v)", counts)
	require.Equal(t, 1, counts["three"], "stored the first time: delivered once (%v)", counts)
	require.GreaterOrEqual(t, counts["fail"], 1, "the failed message comes with the resend (%v)", counts)
}

// A message whose write fails comes again with the resend, and so do the
// ones of its publisher after it that its session still held, behind it,
// though their own writes were stored: a session gets each publisher's
// messages in their order, here an offline one whose queue is what it gets
// on its return. Another publisher's message keeps its place.
func TestServer_FailedWriteKeepsSessionOrder(t *testing.T) {
	t.Parallel()
	store := &flakyStore{gate: make(chan struct{})}
	e, sub := startStoredEdgeAt(t, store, 1)
	e.away(t, sub)
	frame2 := frameOf(2, 1, 4, "four", "other")
	frame2.Messages[1].Message.ClientId = "another-publisher"
	frames := []*edgev1.ForwardRequest{frameOf(1, 1, 1, "slow1", "fail", "three"), frame2}
	res := make(chan error, 1)
	go func() { res <- sendFrames(t, e.api, frames...) }()
	// Frame 2 is delivered while frame 1's writes are still being stored.
	testutil.Eventually(t, 5*time.Second, func() error {
		if got := store.enqueued(); !slices.Contains(got, "four") {
			return fmt.Errorf("enqueued %v", got)
		}
		return nil
	})
	close(store.gate)
	require.ErrorIs(t, <-res, errResend)
	require.NoError(t, sendFrames(t, e.api, frames...))
	require.Equal(t, []string{"slow1", "other", "fail", "three", "four"}, readInOrder(e.back(t)))
}
