package forward

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
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
// the payload "fail" reports a failure (and stores nothing).
type flakyStore struct {
	*durable.Store
	failed atomic.Bool
}

func (s *flakyStore) Enqueue(id string, e durable.Entry) *durable.Pending {
	if e.Msg != nil && string(e.Msg.Payload) == "fail" && s.failed.CompareAndSwap(false, true) {
		return durable.DonePending(fmt.Errorf("injected store failure"))
	}
	return s.Store.Enqueue(id, e)
}

// A frame's durable writes are submitted together and waited for after:
// a message whose write fails leaves the frame unacknowledged, and on the
// resend only that message is delivered again: the messages stored the
// first time are not (a QoS 2 message arrives once).
func TestServer_DeferredWritesPerMessage(t *testing.T) {
	t.Parallel()
	cfg := broker.DefaultConfig()
	cfg.EdgeID = "b"
	b, err := broker.New(cfg, auth.Anonymous{Tenant: "acme"}, testutil.Logger(t), prometheus.NewRegistry())
	require.NoError(t, err)
	st, err := durable.Open(t.TempDir(), testutil.Logger(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = st.Close() })
	require.NoError(t, b.Restore(&flakyStore{Store: st}))
	l := listener.NewTCP("tcp", "127.0.0.1:0", nil)
	require.NoError(t, b.AddListener(l))
	require.NoError(t, b.Serve())
	t.Cleanup(func() { _ = b.Close() })
	ts := serveAPI(t, &Server{Deliver: b, Logger: testutil.Logger(t)})

	sub := mqtttest.Dial(t, l.Address(), 5)
	sub.Connect("sub", true, packets.Properties{SessionExpiryInterval: 300, SessionExpiryIntervalFlag: true})
	require.Equal(t, []byte{2}, sub.Subscribe(1, "t", 2).ReasonCodes)

	frame := &edgev1.ForwardRequest{EdgeId: "a", Incarnation: 1, Seq: 1}
	for i, p := range []string{"one", "fail", "three"} {
		frame.Messages = append(frame.Messages, &edgev1.ForwardMessage{Message: &commonv1.Message{
			Id: &commonv1.MsgID{EdgeId: "a", Incarnation: 1, Seq: uint64(i + 1)}, Tenant: "acme", Topic: "t",
			Payload: []byte(p), Qos: 2, IngressUnixNano: time.Now().UnixNano()}})
	}
	send := func() error {
		l := NewLink("a", 1, "b", ts.URL, testutil.Logger(t), nil)
		st := l.client.Forward(t.Context())
		defer func() { _ = st.CloseRequest(); _ = st.CloseResponse() }()
		require.NoError(t, st.Send(frame))
		_, err := st.Receive()
		return err
	}
	require.Equal(t, connect.CodeUnavailable, connect.CodeOf(send()))
	require.NoError(t, send())

	counts := map[string]int{}
	for {
		pk, err := sub.Read(time.Second)
		if err != nil {
			break
		}
		switch pk.FixedHeader.Type {
		case packets.Publish:
			counts[string(pk.Payload)]++
			sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: pk.PacketID})
		case packets.Pubrel:
			sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: pk.PacketID})
		}
	}
	require.Equal(t, 1, counts["one"], "stored the first time: delivered once (%v)", counts)
	require.Equal(t, 1, counts["three"], "stored the first time: delivered once (%v)", counts)
	require.GreaterOrEqual(t, counts["fail"], 1, "the failed message comes with the resend (%v)", counts)
}
