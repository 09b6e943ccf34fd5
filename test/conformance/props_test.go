package conformance

import (
	"fmt"
	"sort"
	"testing"

	"github.com/eclipse/paho.golang/packets"
	"github.com/eclipse/paho.golang/paho"
	"github.com/stretchr/testify/require"
)

// TestConformance_PublishProperties publishes messages carrying user
// properties (repeated keys, in a set order), a content type, a response
// topic, correlation data and a payload format indicator, and checks that
// subscribers receive them unaltered, live and as retained messages.
func TestConformance_PublishProperties(t *testing.T) {
	t.Parallel()
	e := startEdge(t)
	props := func(topic string) *paho.PublishProperties {
		return &paho.PublishProperties{
			ContentType:     "application/json; charset=utf-8",
			ResponseTopic:   topic + "/reply",
			CorrelationData: []byte{0x00, 0x01, 0xfe, 0xff},
			PayloadFormat:   bytep(1),
			User: paho.UserProperties{
				{Key: "k", Value: "v1"},
				{Key: "a", Value: "b"},
				{Key: "k", Value: "v2"},
				{Key: "unicode", Value: "ñ✓ 漢字"},
			},
		}
	}
	check := func(t *testing.T, want, got *paho.PublishProperties) {
		t.Helper()
		require.NotNil(t, got)
		require.Equal(t, want.ContentType, got.ContentType, "[MQTT-3.3.2-20] Content Type unaltered")
		require.Equal(t, want.ResponseTopic, got.ResponseTopic, "[MQTT-3.3.2-15] Response Topic unaltered")
		require.Equal(t, want.CorrelationData, got.CorrelationData, "[MQTT-3.3.2-16] Correlation Data unaltered")
		require.NotNil(t, got.PayloadFormat, "[MQTT-3.3.2-4] Payload Format Indicator unaltered")
		require.Equal(t, *want.PayloadFormat, *got.PayloadFormat, "[MQTT-3.3.2-4] Payload Format Indicator unaltered")
		require.Equal(t, want.User, got.User, "[MQTT-3.3.2-17] [MQTT-3.3.2-18] user properties unaltered, in order")
	}
	for _, qos := range []byte{0, 1, 2} {
		t.Run(fmt.Sprintf("qos%d", qos), func(t *testing.T) {
			t.Parallel()
			topic := topicFor(t)
			sub := connectV5(t, e.TCP, v5Connect("sub-"+uniq()))
			sub.sub(t, topic, 2)
			old := connectV3(t, v3Options("tcp://"+e.TCP, "old-"+uniq()))
			old.sub(t, topic, 2)
			pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
			want := props(topic)
			pub.publish(t, &paho.Publish{Topic: topic, QoS: qos, Payload: []byte(`{"x":1}`), Properties: want})
			check(t, want, sub.expectPayloads(t, `{"x":1}`)[0].Properties)
			old.expectPayloads(t, `{"x":1}`) // an MQTT 3.1.1 subscriber gets the message without properties
		})
	}
	t.Run("retained", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
		want := props(topic)
		pub.publish(t, &paho.Publish{Topic: topic, QoS: 1, Retain: true, Payload: []byte("r"), Properties: want})
		sub := connectV5(t, e.TCP, v5Connect("sub-"+uniq()))
		sub.sub(t, topic, 1)
		check(t, want, sub.expectPayloads(t, "r")[0].Properties)
	})
}

// TestConformance_SubscriptionIdentifier checks that messages carry the
// Subscription Identifiers of the subscriptions they match: one, none, both
// of two overlapping ones, and the new one after a subscription is replaced.
// A raw client reads them, since paho keeps only the last identifier.
func TestConformance_SubscriptionIdentifier(t *testing.T) {
	t.Parallel()
	e := startEdge(t)
	base := topicFor(t)
	rc, ca := connectRaw(t, e.TCP, rawConnect("subid-"+uniq()))
	if ca.Properties != nil && ca.Properties.SubIDAvailable != nil && *ca.Properties.SubIDAvailable == 0 {
		t.Skip("the server does not support subscription identifiers")
	}
	var packetID uint16
	subscribe := func(filter string, subID *int) {
		t.Helper()
		packetID++
		rc.send(t, &packets.Subscribe{PacketID: packetID, Properties: &packets.Properties{SubscriptionIdentifier: subID},
			Subscriptions: []packets.SubOptions{{Topic: filter, QoS: 1}}})
		sa := rc.expect(t, packets.SUBACK).Content.(*packets.Suback)
		require.Less(t, sa.Reasons[0], byte(0x80), "SUBACK for %q", filter)
	}
	// received returns the identifiers of each message up to the "end" one.
	received := func() map[string][][]int {
		t.Helper()
		got := map[string][][]int{}
		for {
			p, raw := rc.expectPublish(t)
			if p.QoS > 0 {
				rc.send(t, &packets.Puback{PacketID: p.PacketID, Properties: &packets.Properties{}})
			}
			ids := publishSubIDs(t, raw)
			sort.Ints(ids)
			got[string(p.Payload)] = append(got[string(p.Payload)], ids)
			if string(p.Payload) == "end" {
				return got
			}
		}
	}
	subscribe(base+"/single", intp(7))
	subscribe(base+"/none", nil)
	subscribe(base+"/multi/+", intp(1))
	subscribe(base+"/multi/#", intp(268435455)) // the largest identifier
	pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
	pub.pub(t, base+"/single", 1, "single")
	pub.pub(t, base+"/none", 1, "none")
	pub.pub(t, base+"/multi/x", 1, "multi")
	pub.pub(t, base+"/none", 1, "end")
	got := received()
	require.Equal(t, [][]int{{7}}, got["single"], "[MQTT-3.3.4-3] the subscription's identifier")
	require.Equal(t, [][]int{nil}, got["none"], "no identifier for a subscription without one")
	switch len(got["multi"]) {
	case 1: // [MQTT-3.3.4-4]: one message carries both identifiers
		require.Equal(t, []int{1, 268435455}, got["multi"][0])
	case 2: // [MQTT-3.3.4-5]: one message per subscription, each with its own
		require.ElementsMatch(t, [][]int{{1}, {268435455}}, got["multi"])
	default:
		t.Fatalf("overlapping subscriptions: %d messages %v", len(got["multi"]), got["multi"])
	}

	subscribe(base+"/single", intp(9)) // [MQTT-3.8.4-3]: replaces the subscription
	pub.pub(t, base+"/single", 1, "single")
	pub.pub(t, base+"/none", 1, "end")
	got = received()
	require.Equal(t, [][]int{{9}}, got["single"], "the replacing subscription's identifier")
}

// TestConformance_NoLocal checks that a No Local subscription does not get
// the client's own messages, and that No Local on a shared subscription is a
// Protocol Error.
func TestConformance_NoLocal(t *testing.T) {
	t.Parallel()
	e := startEdge(t)
	t.Run("own_messages_not_delivered", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		c := connectV5(t, e.TCP, v5Connect("nl-"+uniq()))
		c.subscribe(t, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: topic, QoS: 1, NoLocal: true}}})
		other := connectV5(t, e.TCP, v5Connect("other-"+uniq()))
		other.sub(t, topic, 1)
		c.pub(t, topic, 1, "own")
		other.pub(t, topic, 1, "other")
		c.expectPayloads(t, "other") // [MQTT-3.8.3-3]: "own" is not sent back
		other.expectPayloads(t, "own", "other")
	})
	t.Run("shared_subscription_is_protocol_error", func(t *testing.T) {
		t.Parallel()
		rc, _ := connectRaw(t, e.TCP, rawConnect("nl-"+uniq()))
		rc.send(t, &packets.Subscribe{PacketID: 1, Properties: &packets.Properties{},
			Subscriptions: []packets.SubOptions{{Topic: "$share/g/" + topicFor(t), QoS: 1, NoLocal: true}}})
		// [MQTT-3.8.3-4] No Local on a shared subscription is a Protocol
		// Error: [MQTT-4.13.1-1] the server closes the connection.
		d, _ := rc.expectClosed(t, waitMsg)
		requireReason(t, e, d, 0x82)
	})
}

// TestConformance_AssignedClientID checks connections with an empty client
// ID: MQTT 5 assigns a unique one and returns it in CONNACK; MQTT 3.1.1
// accepts it for a clean session only.
func TestConformance_AssignedClientID(t *testing.T) {
	t.Parallel()
	e := startEdge(t)
	t.Run("mqtt5", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		c1 := connectV5(t, e.TCP, v5Connect(""))
		c2 := connectV5(t, e.TCP, v5Connect(""))
		// [MQTT-3.1.3-6] [MQTT-3.1.3-7] [MQTT-3.2.2-16]
		require.NotNil(t, c1.Connack.Properties)
		require.NotNil(t, c2.Connack.Properties)
		id1, id2 := c1.Connack.Properties.AssignedClientID, c2.Connack.Properties.AssignedClientID
		require.NotEmpty(t, id1, "Assigned Client Identifier")
		require.NotEmpty(t, id2, "Assigned Client Identifier")
		require.NotEqual(t, id1, id2, "assigned client IDs are unique")
		c1.sub(t, topic, 1)
		c2.pub(t, topic, 1, "hello")
		c1.expectPayloads(t, "hello")
	})
	t.Run("mqtt311_clean_session", func(t *testing.T) {
		t.Parallel()
		rc, code := connectV311Raw(t, e.TCP, v311Conn{keepAlive: 30})
		require.Equal(t, byte(0), code, "3.1.1 [MQTT-3.1.3-6]: a zero-byte client ID with clean session 1 is accepted")
		rc.expectOpen(t)
	})
	t.Run("mqtt311_persistent_session", func(t *testing.T) {
		t.Parallel()
		rc, code := connectV311Raw(t, e.TCP, v311Conn{keepAlive: 30, persistent: true})
		require.Equal(t, byte(2), code, "3.1.1 [MQTT-3.1.3-8]: identifier rejected")
		rc.expectClosed(t, waitMsg)
	})
}
