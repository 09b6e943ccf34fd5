package conformance

import (
	"errors"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
	"github.com/eclipse/paho.golang/paho"
	"github.com/stretchr/testify/require"
)

// TestConformance_Session checks session state: Clean Start, the Session
// Present flag, Session Expiry, and a persistent session that resumes with
// the QoS 1 messages queued while it was offline.
func TestConformance_Session(t *testing.T) {
	t.Parallel()
	e := startEdge(t)
	sessionConnect := func(id string, expiry uint32, cleanStart bool) *paho.Connect {
		cp := v5Connect(id)
		cp.CleanStart = cleanStart
		if expiry > 0 {
			cp.Properties.SessionExpiryInterval = u32(expiry)
		}
		return cp
	}

	t.Run("resume_delivers_queued_qos1", func(t *testing.T) {
		t.Parallel()
		topic, id := topicFor(t), "sess-"+uniq()
		c := connectV5(t, e.TCP, sessionConnect(id, 60, true))
		require.False(t, c.Connack.SessionPresent, "[MQTT-3.2.2-2] Clean Start 1: Session Present 0")
		c.sub(t, topic, 1)
		require.NoError(t, c.Disconnect(&paho.Disconnect{ReasonCode: 0}))

		pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
		want := payloads("queued", 5)
		for _, p := range want {
			pub.pub(t, topic, 1, p)
		}
		// [MQTT-3.1.2-23] the server keeps the session state, including QoS 1
		// messages pending for the client; [MQTT-3.1.2-5] Clean Start 0 resumes it.
		c = connectV5(t, e.TCP, sessionConnect(id, 60, false))
		require.True(t, c.Connack.SessionPresent, "[MQTT-3.2.2-3] resumed session: Session Present 1")
		c.expectPayloads(t, want...)
		pub.pub(t, topic, 1, "live") // the subscription is part of the session
		c.expectPayloads(t, "live")
	})
	t.Run("clean_start_discards_session", func(t *testing.T) {
		t.Parallel()
		topic, id := topicFor(t), "sess-"+uniq()
		c := connectV5(t, e.TCP, sessionConnect(id, 60, true))
		c.sub(t, topic, 1)
		require.NoError(t, c.Disconnect(&paho.Disconnect{ReasonCode: 0}))
		pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
		pub.pub(t, topic, 1, "stale")

		c = connectV5(t, e.TCP, sessionConnect(id, 60, true))
		require.False(t, c.Connack.SessionPresent, "[MQTT-3.1.2-4] [MQTT-3.2.2-2] Clean Start 1 discards the session")
		c.sub(t, topic+"/marker", 1)
		pub.pub(t, topic, 1, "after") // the old subscription is gone
		pub.pub(t, topic+"/marker", 1, "marker")
		c.expectPayloads(t, "marker") // neither "stale" nor "after"
	})
	t.Run("expiry_zero_ends_session_with_connection", func(t *testing.T) {
		t.Parallel()
		id := "sess-" + uniq()
		c := connectV5(t, e.TCP, sessionConnect(id, 0, true))
		c.sub(t, topicFor(t), 1)
		require.NoError(t, c.Disconnect(&paho.Disconnect{ReasonCode: 0}))
		// §3.1.2.11.2: an absent Session Expiry Interval is 0; the session ends
		// when the network connection closes.
		eventually(t, waitMsg, func() error {
			c := connectV5(t, e.TCP, sessionConnect(id, 0, false))
			defer func() { _ = c.Disconnect(&paho.Disconnect{}) }()
			if c.Connack.SessionPresent {
				return errors.New("session still present after disconnect with Session Expiry 0")
			}
			return nil
		})
	})
	t.Run("expired_session", func(t *testing.T) {
		t.Parallel()
		topic, id := topicFor(t), "sess-"+uniq()
		c := connectV5(t, e.TCP, sessionConnect(id, 1, true))
		c.sub(t, topic, 1)
		require.NoError(t, c.Disconnect(&paho.Disconnect{ReasonCode: 0}))
		pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
		pub.pub(t, topic, 1, "queued")
		// The session expires one second after the disconnect; probing it any
		// earlier would resume it and restart the clock, so wait it out,
		// allowing a whole-second expiry clock up to two seconds.
		time.Sleep(3 * time.Second)
		c = connectV5(t, e.TCP, sessionConnect(id, 1, false))
		require.False(t, c.Connack.SessionPresent, "§3.1.2.11.2: the session expired")
		c.sub(t, topic+"/marker", 1)
		pub.pub(t, topic+"/marker", 1, "marker")
		c.expectPayloads(t, "marker")
	})
	t.Run("unacknowledged_qos1_resent_with_dup", func(t *testing.T) {
		t.Parallel()
		topic, id := topicFor(t), "sess-"+uniq()
		cp := rawConnect(id)
		cp.Properties.SessionExpiryInterval = u32(60)
		rc, _ := connectRaw(t, e.TCP, cp)
		rc.send(t, &packets.Subscribe{PacketID: 1, Properties: &packets.Properties{},
			Subscriptions: []packets.SubOptions{{Topic: topic, QoS: 1}}})
		rc.expect(t, packets.SUBACK)
		pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
		pub.pub(t, topic, 1, "p1")
		first, _ := rc.expectPublish(t)
		require.False(t, first.Duplicate)
		require.NoError(t, rc.conn.Close()) // no PUBACK

		cp.CleanStart = false
		rc2, ca := connectRaw(t, e.TCP, cp)
		require.True(t, ca.SessionPresent)
		// [MQTT-4.4.0-1] unacknowledged PUBLISH packets are resent with their
		// original packet identifiers; [MQTT-3.3.1-1] with DUP set to 1.
		again, _ := rc2.expectPublish(t)
		require.Equal(t, "p1", string(again.Payload))
		require.Equal(t, first.PacketID, again.PacketID)
		require.True(t, again.Duplicate, "[MQTT-3.3.1-1] DUP 1 on a re-delivery")
		rc2.send(t, &packets.Puback{PacketID: again.PacketID, Properties: &packets.Properties{}})
		pub.pub(t, topic, 1, "p2")
		next, _ := rc2.expectPublish(t)
		require.Equal(t, "p2", string(next.Payload))
		require.False(t, next.Duplicate)
	})
	t.Run("unacknowledged_qos1_resent_in_order", func(t *testing.T) {
		t.Parallel()
		topic, id := topicFor(t), "sess-"+uniq()
		cp := rawConnect(id)
		cp.Properties.SessionExpiryInterval = u32(60)
		rc, _ := connectRaw(t, e.TCP, cp)
		rc.send(t, &packets.Subscribe{PacketID: 1, Properties: &packets.Properties{},
			Subscriptions: []packets.SubOptions{{Topic: topic, QoS: 1}}})
		rc.expect(t, packets.SUBACK)
		pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
		want := payloads("m", 20)
		for _, p := range want {
			pub.pub(t, topic, 1, p)
		}
		for _, p := range want {
			got, _ := rc.expectPublish(t)
			require.Equal(t, p, string(got.Payload))
		}
		require.NoError(t, rc.conn.Close()) // none acknowledged

		cp.CleanStart = false
		rc2, ca := connectRaw(t, e.TCP, cp)
		require.True(t, ca.SessionPresent)
		// [MQTT-4.4.0-1] all twenty are resent; [MQTT-4.6.0-6] an ordered
		// topic keeps the order in which they were published (the rule the
		// client follows for its own re-sends is [MQTT-4.6.0-1]).
		var got []string
		for range want {
			p, _ := rc2.expectPublish(t)
			require.True(t, p.Duplicate)
			got = append(got, string(p.Payload))
			rc2.send(t, &packets.Puback{PacketID: p.PacketID, Properties: &packets.Properties{}})
		}
		require.Equal(t, want, got, "order of re-sent messages")
	})
	t.Run("mqtt311_persistent_session", func(t *testing.T) {
		t.Parallel()
		topic, id := topicFor(t), "sess-"+uniq()
		c := connectV3(t, v3Options("tcp://"+e.TCP, id).SetCleanSession(false))
		c.sub(t, topic, 1)
		c.Disconnect(100)
		pub := connectV3(t, v3Options("tcp://"+e.TCP, "pub-"+uniq()))
		want := payloads("queued", 3)
		for _, p := range want {
			pub.pub(t, topic, 1, false, p)
		}
		opts := v3Options("tcp://"+e.TCP, id).SetCleanSession(false)
		c = connectV3(t, opts)
		c.expectPayloads(t, want...)
	})
	t.Run("mqtt311_session_present", func(t *testing.T) {
		t.Parallel()
		id := "sess-" + uniq()
		connack := func(persistent bool) []byte {
			rc := dialRaw(t, e.TCP)
			rc.sendBytes(t, v311Conn{clientID: id, keepAlive: 30, persistent: persistent}.bytes())
			raw, err := rc.readFrame(waitMsg)
			require.NoError(t, err)
			rc.sendBytes(t, []byte{0xe0, 0x00})
			rc.expectClosed(t, waitMsg)
			return raw
		}
		// 3.1.1 [MQTT-3.2.2-1] [MQTT-3.2.2-2] [MQTT-3.2.2-3].
		require.Equal(t, []byte{0x20, 0x02, 0x00, 0x00}, connack(true), "new persistent session: Session Present 0")
		require.Equal(t, []byte{0x20, 0x02, 0x01, 0x00}, connack(true), "resumed session: Session Present 1")
		require.Equal(t, []byte{0x20, 0x02, 0x00, 0x00}, connack(false), "clean session: Session Present 0")
		require.Equal(t, []byte{0x20, 0x02, 0x00, 0x00}, connack(true), "a clean session ended the old one")
	})
}

// MQTT 3.1 has no Session Present flag: the first byte of its CONNACK's
// variable header is reserved and not used (MQTT V3.1 §3.2, "Topic Name
// Compression Response: Reserved values. Not used."); the flag is new in
// 3.1.1 (§3.2.2.2). A 3.1 client resuming its session reads 0 there.
func TestConformance_MQTT31ConnackHasNoSessionPresent(t *testing.T) {
	t.Parallel()
	e := startEdge(t)
	id := "v31-" + uniq()
	connect := func() []byte {
		body := appendStr(nil, "MQIsdp")
		body = append(body, 3, 0x00, 0, 30) // clean session 0, keep alive 30
		return frame(0x10, appendStr(body, id))
	}
	for i := range 2 {
		rc := dialRaw(t, e.TCP)
		rc.sendBytes(t, connect())
		raw, err := rc.readFrame(waitMsg)
		require.NoError(t, err, "waiting for CONNACK")
		require.Equal(t, []byte{0x20, 0x02, 0x00, 0x00}, raw, "CONNACK %d", i)
		require.NoError(t, rc.conn.Close())
		time.Sleep(100 * time.Millisecond) // the close seen before the next CONNECT
	}
}
