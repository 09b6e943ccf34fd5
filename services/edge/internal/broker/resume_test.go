package broker

import (
	"fmt"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// A resumed session resends only PUBLISH and PUBREL packets
// [MQTT-4.4.0-1]: the PUBREC of an inbound QoS 2 message still awaiting
// its PUBREL is not sent again on its own. The client resends the PUBLISH
// (it gets the same PUBREC, and the message is not delivered twice
// [MQTT-4.3.3-9]) or the PUBREL (it gets the PUBCOMP), and the next packet
// after its PUBREL is the PUBCOMP, not a second PUBREC (Mosquitto's
// 03-publish-c2b-disconnect-qos2).
func TestBroker_ResumeResendsNoInboundPubrec_MQTT_4_4_0_1(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		version byte
		stored  bool // the session in a durable store
	}{{3, false}, {4, false}, {5, false}, {4, true}, {5, true}} {
		version := tc.version
		t.Run(fmt.Sprintf("v%d-stored=%v", version, tc.stored), func(t *testing.T) {
			t.Parallel()
			var addr string
			if tc.stored {
				b, _ := brokerOnStore(t, func(st *durable.Store) DurableState { return st })
				addr = serveTCP(t, b)
			} else {
				_, addr = startBroker(t, nil)
			}
			topic := fmt.Sprintf("resume/q2/v%d", version)
			sub := mqtttest.Dial(t, addr, 5)
			sub.Connect(fmt.Sprintf("resume-sub-v%d", version), true, packets.Properties{})
			sub.Subscribe(1, topic, 2)

			id := fmt.Sprintf("resume-pub-v%d", version)
			props := packets.Properties{}
			if version == 5 {
				props = packets.Properties{SessionExpiryInterval: 60, SessionExpiryIntervalFlag: true}
			}
			pub := mqtttest.Dial(t, addr, version)
			pub.Connect(id, false, props)
			publish := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2}, PacketID: 1,
				TopicName: topic, Payload: []byte("once")}
			pub.Send(publish)
			require.Equal(t, uint16(1), pub.Expect(packets.Pubrec).PacketID)
			got := sub.Expect(packets.Publish)
			require.Equal(t, "once", string(got.Payload))
			if got.FixedHeader.Qos > 0 {
				sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: got.PacketID})
				sub.Expect(packets.Pubrel)
				sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: got.PacketID})
			}
			_ = pub.Conn.Close() // as if the PUBREC had not arrived

			// Resumed, the first time resending the PUBLISH.
			pub = mqtttest.Dial(t, addr, version)
			ack := pub.Connect(id, false, props)
			if version > 3 {
				require.True(t, ack.SessionPresent)
			}
			pk, err := pub.Read(300 * time.Millisecond)
			require.Error(t, err, "nothing is resent on its own after the CONNACK; got packet type %d", pk.FixedHeader.Type)
			publish.FixedHeader.Dup = true
			pub.Send(publish)
			require.Equal(t, uint16(1), pub.Expect(packets.Pubrec).PacketID)
			pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 1})
			pk, err = pub.Read(5 * time.Second)
			require.NoError(t, err)
			require.Equal(t, packets.Pubcomp, pk.FixedHeader.Type, "the PUBREL is answered with PUBCOMP")
			require.Equal(t, uint16(1), pk.PacketID)
			_ = pub.Conn.Close() // as if the PUBCOMP had not arrived

			// Resumed again, resending the PUBREL: PUBCOMP, and nothing before it.
			pub = mqtttest.Dial(t, addr, version)
			pub.Connect(id, false, props)
			pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 1})
			pk, err = pub.Read(5 * time.Second)
			require.NoError(t, err)
			require.Equal(t, packets.Pubcomp, pk.FixedHeader.Type)

			// Delivered once.
			pk, err = sub.Read(300 * time.Millisecond)
			require.Error(t, err, "the resent PUBLISH is not delivered again; got packet type %d", pk.FixedHeader.Type)
		})
	}
}

// A message published while a resumed session's in-flight messages are
// being sent again goes after them [MQTT-4.6.0-2], [MQTT-4.6.0-6]: bind is
// the session's writer until they are written.
func TestBroker_MessagePublishedDuringTheResendGoesAfterIt(t *testing.T) {
	t.Parallel()
	for _, stored := range []bool{false, true} {
		t.Run(fmt.Sprintf("stored=%v", stored), func(t *testing.T) {
			t.Parallel()
			var b *Broker
			var addr string
			if stored {
				b, _ = brokerOnStore(t, func(st *durable.Store) DurableState { return st })
				addr = serveTCP(t, b)
			} else {
				b, addr = startBroker(t, nil)
			}
			props := packets.Properties{SessionExpiryInterval: 60, SessionExpiryIntervalFlag: true}
			sub := mqtttest.Dial(t, addr, 5)
			sub.Connect("dev", false, props)
			sub.Subscribe(1, "q", 1)
			require.NoError(t, b.Publish("default", "q", []byte("first"), 1, false))
			require.Equal(t, []byte("first"), sub.Expect(packets.Publish).Payload) // not acknowledged
			_ = sub.Conn.Close()
			require.Eventually(t, func() bool {
				s := b.session(b.mustScope(t, "default").ClientID("dev"))
				return s != nil && !s.online.Load()
			},
				5*time.Second, time.Millisecond)

			// Published as the resend is about to go out; given the time a
			// writer needs to write it first, were one started.
			out := b.mOut[1]
			hook := func() {
				before := promtest.ToFloat64(out)
				if err := b.Publish("default", "q", []byte("second"), 1, false); err != nil {
					t.Error(err)
				}
				deadline := time.Now().Add(300 * time.Millisecond)
				for promtest.ToFloat64(out) == before && time.Now().Before(deadline) {
					time.Sleep(time.Millisecond)
				}
			}
			b.atResend.Store(&hook)
			sub = mqtttest.Dial(t, addr, 5)
			require.True(t, sub.Connect("dev", false, props).SessionPresent)
			first := sub.Expect(packets.Publish)
			require.Equal(t, []byte("first"), first.Payload, "the resend first")
			require.True(t, first.FixedHeader.Dup)
			second := sub.Expect(packets.Publish)
			require.Equal(t, []byte("second"), second.Payload)
			require.False(t, second.FixedHeader.Dup)
		})
	}
}
