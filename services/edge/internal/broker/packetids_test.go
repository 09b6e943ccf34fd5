package broker

import (
	"testing"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// The client and the server assign packet identifiers independently (MQTT
// 5 §2.2.1, MQTT 3.1.1 §2.3.1): a client whose own PUBLISH or SUBSCRIBE
// takes the ID of a delivery it has not acknowledged yet neither loses
// that delivery nor is refused.
func TestBroker_ClientPacketIDsAreApartFromTheEdges(t *testing.T) {
	t.Parallel()
	for _, version := range []byte{4, 5} {
		t.Run(map[byte]string{4: "3.1.1", 5: "5"}[version], func(t *testing.T) {
			t.Parallel()
			_, addr := startBroker(t, nil)
			sub := mqtttest.Dial(t, addr, version)
			sub.Connect("sub", false, persistentProps)
			sub.Subscribe(1, "t", 1)
			pub := mqtttest.Dial(t, addr, version)
			pub.Connect("pub", true, packets.Properties{})
			pub.Publish(1, "t", 1, []byte("m1"))
			pub.Expect(packets.Puback)
			got := sub.Expect(packets.Publish)
			id := got.PacketID

			// The client's own flows under the delivery's ID.
			sub.Publish(id, "elsewhere", 1, []byte("own"))
			require.Equal(t, id, sub.Expect(packets.Puback).PacketID)
			sub.Publish(id, "elsewhere", 2, []byte("own2"))
			rec := sub.Expect(packets.Pubrec)
			require.Equal(t, id, rec.PacketID)
			require.Less(t, rec.ReasonCode, byte(0x80))
			sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: id})
			require.Equal(t, packets.CodeSuccess.Code, sub.Expect(packets.Pubcomp).ReasonCode)
			ack := sub.Subscribe(id, "u", 1)
			require.Equal(t, []byte{1}, ack.ReasonCodes, "SUBACK under the delivery's packet ID")

			// Not acknowledged, the delivery is sent again when the session
			// resumes [MQTT-4.4.0-1].
			_ = sub.Conn.Close()
			sub = mqtttest.Dial(t, addr, version)
			require.True(t, sub.Connect("sub", false, persistentProps).SessionPresent)
			again := sub.Expect(packets.Publish)
			require.Equal(t, []byte("m1"), again.Payload)
			require.True(t, again.FixedHeader.Dup)
			sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: again.PacketID})
		})
	}
}
