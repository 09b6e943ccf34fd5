package conformance

import (
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
	"github.com/eclipse/paho.golang/paho"
	"github.com/stretchr/testify/require"
)

// noWill is how long a test watches for a will that must not be published.
// The close that would trigger it is processed asynchronously by the server,
// so no marker message can order it.
const noWill = 500 * time.Millisecond

// TestConformance_Will checks will messages: published when the network
// connection closes without DISCONNECT or with a DISCONNECT whose Reason
// Code is not 0x00 (0x04, 0x80, ...), discarded on a normal DISCONNECT, delayed by the Will Delay Interval and cancelled by a
// reconnect within it.
func TestConformance_Will(t *testing.T) {
	t.Parallel()
	e := startEdge(t)
	willConnect := func(topic string, props *paho.WillProperties) *paho.Connect {
		cp := v5Connect("will-" + uniq())
		cp.WillMessage = &paho.WillMessage{Topic: topic, QoS: 1, Payload: []byte("gone")}
		cp.WillProperties = props
		return cp
	}
	watch := func(t *testing.T, topic string) *v5Client {
		t.Helper()
		w := connectV5(t, e.TCP, v5Connect("watch-"+uniq()))
		w.sub(t, topic, 1)
		return w
	}

	t.Run("published_on_abnormal_close", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		w := watch(t, topic)
		c := connectV5(t, e.TCP, willConnect(topic, nil))
		c.drop()
		m := w.expectPayloads(t, "gone")[0] // [MQTT-3.1.2-8]
		require.Equal(t, topic, m.Topic)
		require.Equal(t, byte(1), m.QoS)
		w.expectNothing(t, quiet) // published once
	})
	t.Run("discarded_on_normal_disconnect", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		w := watch(t, topic)
		c := connectV5(t, e.TCP, willConnect(topic, nil))
		require.NoError(t, c.Disconnect(&paho.Disconnect{ReasonCode: 0x00}))
		w.expectNothing(t, noWill) // [MQTT-3.1.2-10] [MQTT-3.14.4-3]
	})
	t.Run("published_on_disconnect_with_will_message", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		w := watch(t, topic)
		c := connectV5(t, e.TCP, willConnect(topic, nil))
		// Reason 0x04: "the Client wishes to disconnect but requires that the
		// Server also publishes its Will Message" (§3.14.2.1).
		require.NoError(t, c.Disconnect(&paho.Disconnect{ReasonCode: 0x04}))
		w.expectPayloads(t, "gone")
	})
	t.Run("published_on_disconnect_with_will_message_without_properties", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		w := watch(t, topic)
		rc := dialRaw(t, e.TCP)
		rc.sendBytes(t, v5WillConnect("will-"+uniq(), topic, "gone", 1, &packets.Properties{}))
		require.Equal(t, byte(0), rc.expect(t, packets.CONNACK).Content.(*packets.Connack).ReasonCode)
		// A DISCONNECT of Remaining Length 1: the Reason Code 0x04 alone.
		// §3.14.2.2.1: "If the Remaining Length is less than 2, a value of 0
		// is used" for the Property Length; the Reason Code is still read.
		// The connection stays open on the client's side: the server acts
		// on the packet, not on the close.
		rc.sendBytes(t, []byte{0xe0, 0x01, 0x04})
		w.expectPayloads(t, "gone") // [MQTT-3.1.2-8]: not discarded as a 0x00 would be
	})
	t.Run("published_on_disconnect_with_error_reason", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		w := watch(t, topic)
		rc := dialRaw(t, e.TCP)
		rc.sendBytes(t, v5WillConnect("will-"+uniq(), topic, "gone", 1, &packets.Properties{}))
		require.Equal(t, byte(0), rc.expect(t, packets.CONNACK).Content.(*packets.Connack).ReasonCode)
		// DISCONNECT 0x80 (Unspecified error). [MQTT-3.1.2-8]: the will is
		// deleted only on "receipt of DISCONNECT with a Reason Code of 0x00
		// (Normal disconnection)"; any other code leaves it to be published.
		rc.sendBytes(t, []byte{0xe0, 0x02, 0x80, 0x00})
		d, _ := rc.expectClosed(t, waitMsg) // [MQTT-3.14.4-1]
		require.Nil(t, d, "the server closes after the client's DISCONNECT; it does not answer with one")
		w.expectPayloads(t, "gone")
		w.expectNothing(t, quiet) // published once
	})
	t.Run("delayed_on_disconnect_with_error_reason", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		w := watch(t, topic)
		cp := willConnect(topic, &paho.WillProperties{WillDelayInterval: u32(1)})
		cp.Properties.SessionExpiryInterval = u32(10)
		c := connectV5(t, e.TCP, cp)
		start := time.Now()
		// 0x98 (Administrative action): not 0x00, so the will stays
		// [MQTT-3.1.2-8], and goes out after its Will Delay Interval
		// (§3.1.3.2.2) since the session outlives it.
		require.NoError(t, c.Disconnect(&paho.Disconnect{ReasonCode: 0x98}))
		w.expectPayloads(t, "gone")
		require.GreaterOrEqual(t, time.Since(start), 900*time.Millisecond, "will published before its delay")
		w.expectNothing(t, quiet)
	})
	t.Run("retained_will", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		cp := willConnect(topic, nil)
		cp.WillMessage.Retain = true
		c := connectV5(t, e.TCP, cp)
		w := watch(t, topic)
		c.drop()
		w.expectPayloads(t, "gone")
		late := connectV5(t, e.TCP, v5Connect("late-"+uniq()))
		late.sub(t, topic, 1)
		require.True(t, late.expectPayloads(t, "gone")[0].Retain, "[MQTT-3.1.2-15] a Will Retain 1 will is published retained")
	})
	t.Run("properties_forwarded", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		w := watch(t, topic)
		rc := dialRaw(t, e.TCP)
		rc.sendBytes(t, v5WillConnect("will-"+uniq(), topic, "gone", 1, &packets.Properties{
			ContentType:     "text/plain",
			ResponseTopic:   topic + "/reply",
			CorrelationData: []byte{1, 2, 3},
			PayloadFormat:   bytep(1),
			User:            []packets.User{{Key: "k", Value: "v"}},
		}))
		require.Equal(t, byte(0), rc.expect(t, packets.CONNACK).Content.(*packets.Connack).ReasonCode)
		require.NoError(t, rc.conn.Close())
		// §3.1.3.2: the will properties are sent with the Will Message.
		m := w.expectPayloads(t, "gone")[0]
		require.NotNil(t, m.Properties)
		require.Equal(t, "text/plain", m.Properties.ContentType)
		require.Equal(t, topic+"/reply", m.Properties.ResponseTopic)
		require.Equal(t, []byte{1, 2, 3}, m.Properties.CorrelationData)
		require.NotNil(t, m.Properties.PayloadFormat)
		require.Equal(t, byte(1), *m.Properties.PayloadFormat)
		require.Equal(t, paho.UserProperties{{Key: "k", Value: "v"}}, m.Properties.User)
	})
	t.Run("delayed", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		w := watch(t, topic)
		cp := willConnect(topic, &paho.WillProperties{WillDelayInterval: u32(1)})
		cp.Properties.SessionExpiryInterval = u32(10)
		c := connectV5(t, e.TCP, cp)
		start := time.Now()
		c.drop()
		w.expectPayloads(t, "gone")
		// §3.1.3.2.2: the Server delays publishing the Will Message until the
		// Will Delay Interval has passed (allowing for whole-second clocks).
		require.GreaterOrEqual(t, time.Since(start), 900*time.Millisecond, "will published before its delay")
	})
	t.Run("delay_cancelled_by_reconnect", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		w := watch(t, topic)
		cp := willConnect(topic, &paho.WillProperties{WillDelayInterval: u32(1)})
		cp.Properties.SessionExpiryInterval = u32(10)
		connectV5(t, e.TCP, cp).drop()
		// Setup, not an assertion: let the server see the close first (the
		// reconnect racing the close is the takeover case below).
		time.Sleep(200 * time.Millisecond)
		re := v5Connect(cp.ClientID)
		re.CleanStart = false
		re.Properties.SessionExpiryInterval = u32(10)
		require.True(t, connectV5(t, e.TCP, re).Connack.SessionPresent)
		// [MQTT-3.1.3-9]: a new connection within the delay: no will.
		w.expectNothing(t, 1500*time.Millisecond)
	})
	t.Run("delay_cancelled_by_takeover", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		w := watch(t, topic)
		cp := willConnect(topic, &paho.WillProperties{WillDelayInterval: u32(1)})
		cp.Properties.SessionExpiryInterval = u32(10)
		old := connectV5(t, e.TCP, cp)
		// The client reconnects before the server noticed its old connection
		// fail: the new connection takes the session over ([MQTT-3.1.4-3]).
		re := v5Connect(cp.ClientID)
		re.CleanStart = false
		re.Properties.SessionExpiryInterval = u32(10)
		require.True(t, connectV5(t, e.TCP, re).Connack.SessionPresent)
		select {
		case <-old.Done():
		case <-time.After(waitMsg):
			t.Fatal("the old connection stayed open")
		}
		// The old connection's will falls under its delay, within which a
		// new connection to the session exists: [MQTT-3.1.3-9] no will.
		w.expectNothing(t, 1500*time.Millisecond)
	})
	t.Run("takeover_of_a_session_that_ends", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		w := watch(t, topic)
		// Session Expiry 0: the session does not outlive its connection.
		cp := willConnect(topic, &paho.WillProperties{WillDelayInterval: u32(60)})
		old := connectV5(t, e.TCP, cp)
		re := v5Connect(cp.ClientID)
		re.CleanStart = false
		re.Properties.SessionExpiryInterval = u32(10)
		require.False(t, connectV5(t, e.TCP, re).Connack.SessionPresent, "the old session ended with its connection")
		select {
		case <-old.Done():
		case <-time.After(waitMsg):
			t.Fatal("the old connection stayed open")
		}
		// The old session ends on the takeover, so its will goes out then
		// ([MQTT-3.1.2-8]: "or the Session ends"; §3.1.4: "If the Session
		// Expiry Interval of the existing Network Connection is 0 ... it
		// will be sent because the original Session is ended on the
		// takeover"). The new connection is not to that session
		// ([MQTT-3.1.3-9] does not hold it back), even with Clean Start 0.
		w.expectPayloads(t, "gone")
		w.expectNothing(t, quiet) // once
	})
	t.Run("mqtt311_takeover_of_a_clean_session", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		w := watch(t, topic)
		id := "will-" + uniq()
		old, code := connectV311Raw(t, e.TCP, v311Conn{clientID: id, keepAlive: 30, willTopic: topic, willPayload: "gone311", willQoS: 1})
		require.Equal(t, byte(0), code)
		_, code = connectV311Raw(t, e.TCP, v311Conn{clientID: id, keepAlive: 30, persistent: true})
		require.Equal(t, byte(0), code)
		old.expectClosed(t, waitMsg) // 3.1.1 [MQTT-3.1.4-2]
		// 3.1.1 [MQTT-3.1.2-8]: the will is published when its Network
		// Connection closes other than by DISCONNECT; the clean session
		// ended with it, so nothing goes on that could hold the will back.
		w.expectPayloads(t, "gone311")
	})
	t.Run("delay_ends_with_session", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		w := watch(t, topic)
		// Session Expiry 0: the session ends when the connection closes, and
		// the will is published then, not after the 60 s delay (§3.1.3.2.2).
		c := connectV5(t, e.TCP, willConnect(topic, &paho.WillProperties{WillDelayInterval: u32(60)}))
		c.drop()
		w.expectPayloads(t, "gone")
	})
	t.Run("mqtt311_abnormal_close", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		w := watch(t, topic)
		rc, code := connectV311Raw(t, e.TCP, v311Conn{clientID: "will-" + uniq(), keepAlive: 30, willTopic: topic, willPayload: "gone311", willQoS: 1})
		require.Equal(t, byte(0), code)
		require.NoError(t, rc.conn.Close())
		w.expectPayloads(t, "gone311")
	})
	t.Run("mqtt311_normal_disconnect", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		w := watch(t, topic)
		rc, code := connectV311Raw(t, e.TCP, v311Conn{clientID: "will-" + uniq(), keepAlive: 30, willTopic: topic, willPayload: "gone311", willQoS: 1})
		require.Equal(t, byte(0), code)
		rc.sendBytes(t, []byte{0xe0, 0x00})
		rc.expectClosed(t, waitMsg) // 3.1.1 [MQTT-3.14.4-1]: the server closes after DISCONNECT
		w.expectNothing(t, noWill)  // 3.1.1 [MQTT-3.1.2-10]
	})
}
