package broker

import (
	"testing"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// A connection's packets are decoded into packets of a pool (the mochi
// patch that passes them by pointer): nothing of one packet may show in
// the next one read into the same packet. A PUBLISH with every property a
// publisher can set, then one with none, then a PINGREQ and another bare
// PUBLISH: the subscriber sees the properties on the first only
// [MQTT-3.3.2-16] (properties forwarded unaltered, and only those sent).
func TestBroker_PacketsReadIntoAPoolCarryNothingOver(t *testing.T) {
	t.Parallel()
	_, addr := startBroker(t, nil)
	sub := mqtttest.Dial(t, addr, 5)
	sub.Connect("pool-sub", true, packets.Properties{})
	sub.Subscribe(1, "pool/+", 1)
	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("pool-pub", true, packets.Properties{})

	full := packets.Properties{
		PayloadFormat: 1, PayloadFormatFlag: true,
		MessageExpiryInterval: 60,
		ContentType:           "text/plain",
		ResponseTopic:         "pool/reply",
		CorrelationData:       []byte("corr"),
		User:                  []packets.UserProperty{{Key: "k", Val: "v"}},
	}
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1}, PacketID: 1,
		TopicName: "pool/a", Payload: []byte("first"), Properties: full,
		Mods: packets.Mods{AllowResponseInfo: true}}) // or mochi's encoder leaves the response topic out
	pub.Expect(packets.Puback)
	pub.Publish(2, "pool/b", 1, []byte("second"))
	pub.Expect(packets.Puback)
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	pub.Expect(packets.Pingresp)
	pub.Publish(3, "pool/c", 1, []byte("third"))
	pub.Expect(packets.Puback)

	first := sub.Expect(packets.Publish)
	require.Equal(t, "pool/a", first.TopicName)
	require.Equal(t, "first", string(first.Payload))
	require.Equal(t, "text/plain", first.Properties.ContentType)
	require.Equal(t, "pool/reply", first.Properties.ResponseTopic)
	require.Equal(t, []byte("corr"), first.Properties.CorrelationData)
	require.Equal(t, []packets.UserProperty{{Key: "k", Val: "v"}}, first.Properties.User)
	require.True(t, first.Properties.PayloadFormatFlag)

	for _, want := range []struct{ topic, payload string }{{"pool/b", "second"}, {"pool/c", "third"}} {
		got := sub.Expect(packets.Publish)
		require.Equal(t, want.topic, got.TopicName)
		require.Equal(t, want.payload, string(got.Payload))
		require.Empty(t, got.Properties.ContentType, "content type of an earlier packet")
		require.Empty(t, got.Properties.ResponseTopic, "response topic of an earlier packet")
		require.Empty(t, got.Properties.CorrelationData, "correlation data of an earlier packet")
		require.Empty(t, got.Properties.User, "user properties of an earlier packet")
		require.False(t, got.Properties.PayloadFormatFlag, "payload format of an earlier packet")
		require.Zero(t, got.Properties.MessageExpiryInterval, "message expiry of an earlier packet")
	}
}
