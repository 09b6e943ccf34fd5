package broker

import (
	"bytes"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// startBrokerAlone is startBroker with every delivery to an idle writer
// written alone, however short its idleness.
func startBrokerAlone(t *testing.T, mutate func(*Config)) (*Broker, string) {
	t.Helper()
	return startBrokerPrepared(t, mutate, func(b *Broker) { b.aloneAfter = 0 })
}

// subAndPub connects a subscriber "sub" to filter at qos, with props, and
// a publisher "pub".
func subAndPub(t *testing.T, addr, filter string, qos byte, props packets.Properties) (sub, pub *mqtttest.Client) {
	t.Helper()
	sub = mqtttest.Dial(t, addr, 5)
	sub.Connect("sub", true, props)
	sub.Subscribe(1, filter, qos)
	pub = mqtttest.Dial(t, addr, 5)
	pub.Connect("pub", true, packets.Properties{})
	return sub, pub
}

func alone(b *Broker, outcome int) int {
	return int(promtest.ToFloat64(b.mAlone[outcome]))
}

// A message to a subscriber whose writer is idle is written by its
// publisher's read loop, at QoS 0, 1 and 2, and the QoS 1 and 2 ones
// complete as any other: the packet IDs, the client's receive window and
// the acknowledgements are the writer's.
func TestBroker_QuietDeliveriesAreWrittenByTheirPublisher(t *testing.T) {
	b, addr := startBrokerAlone(t, nil)
	sub, pub := subAndPub(t, addr, "q/#", 2, packets.Properties{ReceiveMaximum: 1})

	const rounds = 30
	ids := map[uint16]bool{}
	for i := range rounds {
		qos := byte(i % 3)
		payload := fmt.Appendf(nil, "m%d", i)
		pub.Publish(uint16(i+1), "q/x", qos, payload)
		pk := sub.Expect(packets.Publish)
		require.Equal(t, payload, pk.Payload, "in order")
		require.Equal(t, qos, pk.FixedHeader.Qos)
		switch qos {
		case 1:
			pub.Expect(packets.Puback)
			require.False(t, ids[pk.PacketID], "a packet ID in use again")
			sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
		case 2:
			pub.Expect(packets.Pubrec)
			pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: uint16(i + 1)})
			pub.Expect(packets.Pubcomp)
			sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: pk.PacketID})
			sub.Expect(packets.Pubrel)
			sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: pk.PacketID})
		}
		if qos > 0 {
			// With a receive window of one, the next QoS 1/2 delivery waits
			// for this one's acknowledgement: it must have been counted.
			ids[pk.PacketID] = true
			s := b.session(b.mustScope(t, "default").ClientID("sub"))
			require.Eventually(t, func() bool {
				s.mu.Lock()
				defer s.mu.Unlock()
				return s.inflight == 0 && atomic.LoadInt64(&b.server.Info.Inflight) == 0
			}, 5*time.Second, time.Millisecond)
		}
	}
	// Each went alone; a write finds the subscriber's lock busy now and
	// then (mochi finishing a write to it) and leaves it to the writer.
	require.Equal(t, rounds, alone(b, aloneWhole)+alone(b, aloneRefused), "every delivery went alone")
	require.Greater(t, alone(b, aloneWhole), rounds/2)
	require.Zero(t, alone(b, alonePartial))
}

// A delivery written alone that the subscriber's socket takes only in
// part keeps the client's lock until a writer wrote the rest: the
// messages queued behind it, and the packets mochi writes to the client,
// go after it, and the subscriber reads every packet whole and in order.
// The publisher is not held up meanwhile.
func TestBroker_DeliveryWrittenAloneInPartLeavesTheRestToTheWriter(t *testing.T) {
	// Past the largest send buffer TCP gives a socket here (tcp_wmem's
	// 4 MiB): one write that does not wait cannot take it whole.
	const big = 8 << 20
	b, addr := startBrokerAlone(t, func(c *Config) { c.MaxPacketSize = 16 << 20 })
	sub, pub := subAndPub(t, addr, "big/#", 1, packets.Properties{})

	// The subscriber reads nothing now.
	payloads := [][]byte{bytes.Repeat([]byte{'a'}, big)}
	for i := range 3 {
		payloads = append(payloads, bytes.Repeat([]byte{byte('b' + i)}, 64<<10))
	}
	// mochi may be finishing its SUBACK: the write would find the lock
	// busy and leave the message to the writer.
	cl, ok := b.server.Clients.Get(b.mustScope(t, "default").ClientID("sub"))
	require.True(t, ok)
	require.Eventually(t, func() bool {
		if cl.TryLock() {
			cl.Unlock()
			return true
		}
		return false
	}, 5*time.Second, time.Millisecond)
	pub.Publish(0, "big/x", 0, payloads[0])
	require.Eventually(t, func() bool { return alone(b, alonePartial) == 1 }, 5*time.Second, time.Millisecond)
	for _, p := range payloads[1:] {
		pub.Publish(0, "big/x", 0, p)
	}
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	pub.Expect(packets.Pingresp)
	// mochi's answer to the subscriber goes after the rest, not into it.
	sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})

	var got [][]byte
	pings := 0
	for len(got) < len(payloads) || pings == 0 {
		pk, err := sub.Read(10 * time.Second)
		require.NoError(t, err)
		switch pk.FixedHeader.Type {
		case packets.Publish:
			got = append(got, pk.Payload)
		case packets.Pingresp:
			require.NotEmpty(t, got, "the PINGRESP after the message being written")
			pings++
		default:
			t.Fatalf("unexpected packet type %d", pk.FixedHeader.Type)
		}
	}
	for i, p := range payloads {
		require.True(t, bytes.Equal(p, got[i]), "payload %d whole and in order", i)
	}
	// The client and the session go on as usual.
	pub.Publish(0, "big/x", 0, []byte("after"))
	require.Equal(t, []byte("after"), sub.Expect(packets.Publish).Payload)
}

// Messages read together go to an idle subscriber through its writer, in
// one batch: only the last of them, with nothing behind it, may go alone.
func TestBroker_MessagesReadTogetherGoThroughTheWriter(t *testing.T) {
	b, addr := startBrokerAlone(t, nil)
	sub, pub := subAndPub(t, addr, "t", 0, packets.Properties{})

	const n = 10
	var burst bytes.Buffer
	for i := range n {
		pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish}, TopicName: "t",
			Payload: fmt.Appendf(nil, "m%d", i), ProtocolVersion: 5}
		require.NoError(t, pk.PublishEncode(&burst))
	}
	_, err := pub.Conn.Write(burst.Bytes())
	require.NoError(t, err)
	for i := range n {
		require.Equal(t, fmt.Appendf(nil, "m%d", i), sub.Expect(packets.Publish).Payload)
	}
	require.LessOrEqual(t, alone(b, aloneWhole), 1)
}

// A quiet message goes alone to maxAlonePerMessage idle sessions at most;
// writer goroutines write it to the others.
func TestBroker_AQuietMessageGoesAloneToAFewSessions(t *testing.T) {
	b, addr := startBrokerAlone(t, nil)
	const subs = maxAlonePerMessage + 4
	var clients []*mqtttest.Client
	for i := range subs {
		c := mqtttest.Dial(t, addr, 5)
		c.Connect(fmt.Sprintf("sub%d", i), true, packets.Properties{})
		c.Subscribe(1, "fan", 0)
		clients = append(clients, c)
	}
	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(0, "fan", 0, []byte("x"))
	for _, c := range clients {
		require.Equal(t, []byte("x"), c.Expect(packets.Publish).Payload)
	}
	// Whole, most often; refused when a subscriber's lock was busy then.
	require.Equal(t, maxAlonePerMessage, alone(b, aloneWhole)+alone(b, aloneRefused))
}

// A delivery that finds its subscriber's lock held (another write to the
// subscriber waits for its socket) does not wait for it: the publisher
// goes on, and the subscriber's writer delivers the message once the lock
// is free.
func TestBroker_WriteAloneDoesNotWaitForTheSubscribersLock(t *testing.T) {
	b, addr := startBrokerAlone(t, nil)
	sub, pub := subAndPub(t, addr, "t", 0, packets.Properties{})
	cl, ok := b.server.Clients.Get(b.mustScope(t, "default").ClientID("sub"))
	require.True(t, ok)

	cl.Lock()
	locked := true
	defer func() {
		if locked {
			cl.Unlock()
		}
	}()
	pub.Publish(0, "t", 0, []byte("held"))
	require.Eventually(t, func() bool { return alone(b, aloneRefused) == 1 }, 5*time.Second, time.Millisecond)
	start := time.Now()
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	pub.Expect(packets.Pingresp)
	require.Less(t, time.Since(start), time.Second, "the publisher is not held up")
	locked = false
	cl.Unlock()
	require.Equal(t, []byte("held"), sub.Expect(packets.Publish).Payload)
}
