package broker

import (
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// An edge with retained messages or shared subscriptions turned off says
// so in its CONNACK (an absent property means available, §3.2.2.3.5 and
// §3.2.2.3.13), and holds an MQTT 5 client to it: a retained PUBLISH or a
// will to retain gets 0x9A. A 3.1.1 client, told nothing, has its
// messages delivered but not retained.
func TestBroker_DisabledFeaturesAreAnnounced(t *testing.T) {
	t.Parallel()
	_, addr := startBroker(t, func(c *Config) { c.RetainDisabled, c.SharedDisabled = true, true })

	c := mqtttest.Dial(t, addr, 5)
	ack := c.Connect("v5", true, packets.Properties{})
	require.True(t, ack.Properties.RetainAvailableFlag)
	require.Zero(t, ack.Properties.RetainAvailable)
	require.True(t, ack.Properties.SharedSubAvailableFlag)
	require.Zero(t, ack.Properties.SharedSubAvailable)
	require.Equal(t, []byte{packets.ErrSharedSubscriptionsNotSupported.Code}, c.Subscribe(1, "$share/g/t", 1).ReasonCodes)
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1, Retain: true}, PacketID: 2,
		TopicName: "t", Payload: []byte("x")})
	require.Equal(t, packets.ErrRetainNotSupported.Code, c.Expect(packets.Disconnect).ReasonCode)

	w := mqtttest.Dial(t, addr, 5)
	w.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, ProtocolVersion: 5,
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: true, Keepalive: 30, ClientIdentifier: "will",
			WillFlag: true, WillTopic: "gone/will", WillQos: 1, WillRetain: true, WillPayload: []byte("bye")}})
	require.Equal(t, packets.ErrRetainNotSupported.Code, w.Expect(packets.Connack).ReasonCode)

	old := mqtttest.Dial(t, addr, 4)
	require.Equal(t, packets.CodeSuccess.Code, old.Connect("v311", true, packets.Properties{}).ReasonCode)
	require.Equal(t, []byte{1}, old.Subscribe(1, "t", 1).ReasonCodes)
	old.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1, Retain: true}, PacketID: 2,
		TopicName: "t", Payload: []byte("x")})
	old.Expect(packets.Puback)
	require.Equal(t, []byte("x"), old.Expect(packets.Publish).Payload)
	later := mqtttest.Dial(t, addr, 4)
	later.Connect("later", true, packets.Properties{})
	require.Equal(t, []byte{1}, later.Subscribe(1, "t", 1).ReasonCodes)
	_, err := later.Read(200 * time.Millisecond)
	require.Error(t, err, "nothing retained")
}
