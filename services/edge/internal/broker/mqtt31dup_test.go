package broker

import (
	"errors"
	"net"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// MQTT 3.1 sets the DUP flag on a PUBREL, SUBSCRIBE or UNSUBSCRIBE it sends
// again (MQTT V3.1 §2.1, DUP flag: "This flag is set when the client or
// server attempts to re-deliver a PUBLISH, PUBREL, SUBSCRIBE or UNSUBSCRIBE
// message"): an MQTT 3.1 client's packet with the flag is processed as
// without it. In 3.1.1 the flags of those packets are fixed (0010), and any
// other value is a malformed packet that closes the connection
// ([MQTT-3.6.1-1], [MQTT-3.8.1-1], [MQTT-3.10.1-1], [MQTT-2.2.2-2]).
func TestBroker_MQTT31DupFlagOnPubrelSubscribeUnsubscribe(t *testing.T) {
	t.Parallel()
	_, addr := startBroker(t, nil)
	c := mqtttest.Dial(t, addr, 3)
	c.Connect("dup31", false, packets.Properties{})
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1, Dup: true}, PacketID: 1,
		Filters: packets.Subscriptions{{Filter: "dup31/#", Qos: 2}}})
	require.Equal(t, uint16(1), c.Expect(packets.Suback).PacketID)
	c.Publish(2, "dup31/a", 2, []byte("x"))
	require.Equal(t, uint16(2), c.Expect(packets.Pubrec).PacketID)
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1, Dup: true}, PacketID: 2})
	require.Equal(t, uint16(2), c.Expect(packets.Pubcomp).PacketID)
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Unsubscribe, Qos: 1, Dup: true}, PacketID: 3,
		Filters: packets.Subscriptions{{Filter: "dup31/#"}}})
	require.Equal(t, uint16(3), c.Expect(packets.Unsuback).PacketID)

	// 3.1.1: malformed.
	c4 := mqtttest.Dial(t, addr, 4)
	c4.Connect("dup311", true, packets.Properties{})
	c4.Publish(2, "dup311/a", 2, []byte("x"))
	require.Equal(t, uint16(2), c4.Expect(packets.Pubrec).PacketID)
	c4.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1, Dup: true}, PacketID: 2})
	for {
		pk, err := c4.Read(5 * time.Second)
		if err != nil {
			var ne net.Error
			require.False(t, errors.As(err, &ne) && ne.Timeout(), "the connection is closed")
			return
		}
		require.NotEqual(t, packets.Pubcomp, pk.FixedHeader.Type, "a 3.1.1 PUBREL with DUP set is malformed")
	}
}
