package broker

import (
	"context"
	"errors"
	"io"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// incomingGate is a real durable store whose DeleteIncoming the test holds
// (until release is closed) or fails (while fail is set).
type incomingGate struct {
	*durable.Store
	entered chan uint16
	release chan struct{}
	once    sync.Once
	fail    atomic.Bool
}

func (s *incomingGate) open() { s.once.Do(func() { close(s.release) }) }

func (s *incomingGate) DeleteIncoming(ctx context.Context, id string, packetID uint16) error {
	s.entered <- packetID
	<-s.release
	if s.fail.Load() {
		return errors.New("injected store failure")
	}
	return s.Store.DeleteIncoming(ctx, id, packetID)
}

// The PUBREC state of an inbound QoS 2 message is gone from the store
// before the PUBCOMP leaves: the client may reuse the packet ID as soon as
// it has the PUBCOMP, and a record that outlived a crash of the edge (or a
// store failover) would make its next PUBLISH under that ID look like a
// resend of the completed one, answered and never delivered. When the
// store cannot remove it, no PUBCOMP goes out; the client's PUBREL, sent
// again on a new connection, completes the flow.
func TestBroker_IncomingStateGoesBeforePubcomp(t *testing.T) {
	t.Parallel()
	gate := &incomingGate{entered: make(chan uint16, 16), release: make(chan struct{})}
	b, st := brokerOnStore(t, func(st *durable.Store) DurableState { gate.Store = st; return gate })
	t.Cleanup(gate.open)
	addr := serveTCP(t, b)
	id := b.mustScope(t, "default").ClientID("q2")
	incoming := func() []durable.Incoming {
		t.Helper()
		state, ok, err := st.LoadSession(t.Context(), id)
		require.NoError(t, err)
		require.True(t, ok)
		return state.Incoming
	}
	sub := mqtttest.Dial(t, addr, 5)
	sub.Connect("q2-sub", true, packets.Properties{})
	sub.Subscribe(1, "q2/#", 2)

	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("q2", false, persistentSession)
	pub.Publish(7, "q2/a", 2, []byte("first"))
	require.Equal(t, uint16(7), pub.Expect(packets.Pubrec).PacketID)
	require.Len(t, incoming(), 1)

	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 7})
	select {
	case got := <-gate.entered:
		require.Equal(t, uint16(7), got)
	case <-time.After(5 * time.Second):
		t.Fatal("the PUBREC state was never removed")
	}
	_, err := pub.Read(300 * time.Millisecond)
	require.Error(t, err, "no PUBCOMP while the PUBREC state is still stored")
	gate.open()
	require.Equal(t, uint16(7), pub.Expect(packets.Pubcomp).PacketID)
	require.Empty(t, incoming(), "gone before the PUBCOMP left")

	// The packet ID, reused at once, carries a new message.
	pub.Publish(7, "q2/a", 2, []byte("second"))
	pub.Expect(packets.Pubrec)
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 7})
	<-gate.entered
	pub.Expect(packets.Pubcomp)
	for _, want := range []string{"first", "second"} {
		got := sub.Expect(packets.Publish)
		require.Equal(t, want, string(got.Payload))
		sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: got.PacketID})
		sub.Expect(packets.Pubrel)
		sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: got.PacketID})
	}

	// A removal that fails: no PUBCOMP, the connection ends, the state
	// stays, and the PUBREL sent again completes the flow.
	pub.Publish(8, "q2/a", 2, []byte("third"))
	pub.Expect(packets.Pubrec)
	gate.fail.Store(true)
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 8})
	<-gate.entered
	for {
		pk, err := pub.Read(5 * time.Second)
		if err != nil {
			require.ErrorIs(t, err, io.EOF, "the connection ends")
			break
		}
		require.NotEqual(t, packets.Pubcomp, pk.FixedHeader.Type, "no PUBCOMP when the state was not removed")
	}
	require.Len(t, incoming(), 1)
	gate.fail.Store(false)
	again := mqtttest.Dial(t, addr, 5)
	require.Equal(t, byte(0), again.Connect("q2", false, persistentSession).ReasonCode)
	again.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 8})
	<-gate.entered
	require.Equal(t, uint16(8), again.Expect(packets.Pubcomp).PacketID)
	require.Empty(t, incoming())
	got := sub.Expect(packets.Publish)
	require.Equal(t, "third", string(got.Payload))
}

// A packet the edge refuses as it is read ends the connection and is never
// processed: a PUBLISH whose topic breaks the edge's limits reaches no
// subscriber, and a SUBSCRIBE with a shared filter and no-local ([MQTT-3.8.3-4])
// subscribes to nothing. mochi processes a packet whose read hook failed
// with any error other than its own rejection, so that is the form every
// refusal takes. MQTT 5 clients get the reason in a DISCONNECT; 3.1.1 has
// none to give and the connection closes.
func TestBroker_RefusedPacketIsNotProcessed(t *testing.T) {
	t.Parallel()
	_, addr := startBroker(t, func(c *Config) { c.MaxTopicLevels = 3 })
	watch := mqtttest.Dial(t, addr, 4)
	watch.Connect("watch", true, packets.Properties{})
	watch.Subscribe(1, "#", 0)

	for _, v := range []byte{4, 5} {
		pub := mqtttest.Dial(t, addr, v)
		pub.Connect("deep", true, packets.Properties{})
		pub.Publish(0, "a/b/c/d", 0, []byte("too deep"))
		pk, err := pub.Read(5 * time.Second)
		if v == 5 {
			require.NoError(t, err)
			require.Equal(t, packets.Disconnect, pk.FixedHeader.Type)
			require.Equal(t, packets.ErrTopicNameInvalid.Code, pk.ReasonCode)
			_, err = pub.Read(5 * time.Second)
		}
		require.ErrorIs(t, err, io.EOF, "v%d: the connection ends", v)
	}

	sh := mqtttest.Dial(t, addr, 5)
	sh.Connect("sharer", true, packets.Properties{})
	sh.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: 1,
		Filters: packets.Subscriptions{{Filter: "$share/g/s/x", Qos: 0, NoLocal: true}}})
	pk := sh.Expect(packets.Disconnect)
	require.Equal(t, packets.ErrProtocolViolationInvalidSharedNoLocal.Code, pk.ReasonCode)

	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("shallow", true, packets.Properties{})
	pub.Publish(0, "s/x", 0, []byte("marker"))
	got := watch.Expect(packets.Publish)
	require.Equal(t, "marker", string(got.Payload), "the refused publishes reached nobody")
	_, err := watch.Read(200 * time.Millisecond)
	require.Error(t, err, "and the refused share took nothing")
}

// A packet mochi cannot read ends its connection with the reason in a
// DISCONNECT (MQTT 5) and is counted by cause; the edge's own refusals are
// counted where they are made, not again here.
func TestBroker_UnreadablePacketCounted(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, func(c *Config) { c.MaxPacketSize = 256 })
	malformed := []byte{0x32, 0x07, 0x00, 0x10, 'a', '/', 'b', 0x00, 0x01} // topic length past the end
	for _, tc := range []struct {
		name, reason string
		send         []byte
		code         byte
	}{
		{"malformed", "malformed_packet", malformed, packets.ErrMalformedPacket.Code},
		{"too_large", "packet_too_large", append([]byte{0x30, 0x80, 0x02}, make([]byte, 256)...), packets.ErrPacketTooLarge.Code},
	} {
		c := mqtttest.Dial(t, addr, 5)
		c.Connect("unreadable-"+tc.name, true, packets.Properties{})
		_, err := c.Conn.Write(tc.send)
		require.NoError(t, err)
		pk := c.Expect(packets.Disconnect)
		require.Equal(t, tc.code, pk.ReasonCode, tc.name)
		_, err = c.Read(5 * time.Second)
		require.ErrorIs(t, err, io.EOF, "%s: the connection ends", tc.name)
		require.Eventually(t, func() bool {
			return promtest.ToFloat64(b.m.packetErrors.WithLabelValues(tc.reason)) == 1
		}, 5*time.Second, 10*time.Millisecond, tc.name)
	}
	require.Eventually(t, func() bool { return promtest.ToFloat64(b.m.disconnects.WithLabelValues("protocol_error")) == 2 },
		5*time.Second, 10*time.Millisecond, "both disconnects counted")
}
