package conformance

import (
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"github.com/stretchr/testify/require"
)

// TestConformance_MessageExpiry queues messages with and without a Message
// Expiry Interval for an offline persistent session and as retained
// messages, waits past the short expiry, and checks that expired messages are
// not delivered and that the others carry a decremented expiry.
func TestConformance_MessageExpiry(t *testing.T) {
	t.Parallel()
	e := startEdge(t)
	topic, id := topicFor(t), "exp-"+uniq()
	connect := func(cleanStart bool) *v5Client {
		cp := v5Connect(id)
		cp.CleanStart = cleanStart
		cp.Properties.SessionExpiryInterval = u32(60)
		return connectV5(t, e.TCP, cp)
	}
	sub := connect(true)
	sub.sub(t, topic+"/queued", 1)
	live := connectV5(t, e.TCP, v5Connect("live-"+uniq()))
	live.sub(t, topic+"/live", 1)
	require.NoError(t, sub.Disconnect(&paho.Disconnect{ReasonCode: 0}))

	pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
	send := func(topic, payload string, expiry *uint32, retain bool) {
		pub.publish(t, &paho.Publish{Topic: topic, QoS: 1, Retain: retain, Payload: []byte(payload),
			Properties: &paho.PublishProperties{MessageExpiry: expiry}})
	}
	send(topic+"/queued", "short", u32(1), false)
	send(topic+"/queued", "long", u32(60), false)
	send(topic+"/queued", "forever", nil, false)
	send(topic+"/retained-short", "short", u32(1), true)
	send(topic+"/retained-long", "long", u32(60), true)

	send(topic+"/live", "now", u32(60), false)
	m := live.expectPayloads(t, "now")[0]
	require.NotNil(t, m.Properties.MessageExpiry, "[MQTT-3.3.2-6] the expiry is forwarded")
	require.LessOrEqual(t, *m.Properties.MessageExpiry, uint32(60))
	require.GreaterOrEqual(t, *m.Properties.MessageExpiry, uint32(58))

	// The one-second expiries must pass; nothing can be polled meanwhile
	// without consuming the queue under test.
	time.Sleep(2100 * time.Millisecond)

	sub = connect(false)
	require.True(t, sub.Connack.SessionPresent)
	// [MQTT-3.3.2-5]: "short" expired and is not delivered, unless its
	// onward delivery had started: the server may take the publishes before
	// it has read the DISCONNECT sent on another connection, and send
	// "short" to the leaving client. It then goes again, as a redelivery.
	first := sub.next(t)
	if string(first.Payload) == "short" {
		require.True(t, first.Duplicate(), "[MQTT-3.3.2-5] an expired message is delivered only as the resend of one already sent")
		first = sub.next(t)
	}
	require.Equal(t, "long", string(first.Payload))
	got := append([]*paho.Publish{first}, sub.expectPayloads(t, "forever")...)
	require.NotNil(t, got[0].Properties.MessageExpiry)
	// [MQTT-3.3.2-6]: the expiry sent is the received one minus the time the
	// message waited (at least 2 s here).
	require.LessOrEqual(t, *got[0].Properties.MessageExpiry, uint32(58), "expiry not decremented")
	require.Positive(t, *got[0].Properties.MessageExpiry)
	require.Nil(t, got[1].Properties.MessageExpiry, "a message without expiry gains none")

	fresh := connectV5(t, e.TCP, v5Connect("fresh-"+uniq()))
	fresh.sub(t, topic+"/retained-short", 1)
	fresh.sub(t, topic+"/retained-long", 1)
	r := fresh.expectPayloads(t, "long")[0] // the expired retained message is gone
	require.True(t, r.Retain)
	require.NotNil(t, r.Properties.MessageExpiry)
	require.LessOrEqual(t, *r.Properties.MessageExpiry, uint32(58), "retained expiry not decremented")
	pub.pub(t, topic+"/retained-short", 1, "marker")
	fresh.expectPayloads(t, "marker")
}
