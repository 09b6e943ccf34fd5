package broker

import (
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// connectExpiringWithWill connects id (MQTT 5, Clean Start 0) with the Session
// Expiry Interval expiry and a will of the given delay and QoS on will/<id>.
func connectExpiringWithWill(t *testing.T, addr, id string, expiry, delay uint32, qos byte) *mqtttest.Client {
	t.Helper()
	c := mqtttest.Dial(t, addr, 5)
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
		Properties: packets.Properties{SessionExpiryInterval: expiry, SessionExpiryIntervalFlag: true},
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Keepalive: 30, ClientIdentifier: id,
			WillFlag: true, WillTopic: "will/" + id, WillQos: qos, WillPayload: []byte(id),
			WillProperties: packets.Properties{WillDelayInterval: delay}}})
	require.Equal(t, packets.CodeSuccess.Code, c.Expect(packets.Connack).ReasonCode)
	return c
}

// §3.1.2.11.2: the session ends when its Session Expiry Interval has passed
// after the connection closed, and a CONNECT after that finds no session
// (Session Present 0, [MQTT-3.2.2-3]) — at once, not at a later tick of a
// whole-second clock (Mosquitto's 05-session-expiry-v5 reconnected 2 s
// after a 1 s expiry and was told the session was present). The session's
// will, waiting for a longer delay, goes out then, once: the will is
// published when the delay passes or the session ends, whichever is first
// ([MQTT-3.1.3-9]). A session whose expiry has not passed is resumed, with
// what was queued for it.
func TestBroker_SessionExpiredAtConnect_MQTT_3_2_2_3(t *testing.T) {
	t.Parallel()
	_, addr := startBroker(t, nil)
	watcher := mqtttest.Dial(t, addr, 5)
	watcher.Connect("expiry-watcher", true, packets.Properties{})
	watcher.Subscribe(1, "will/#", 1)

	// Not expired: resumed, and the message queued meanwhile delivered.
	kept := mqtttest.Dial(t, addr, 5)
	kept.Connect("expiry-kept", false, packets.Properties{SessionExpiryInterval: 3, SessionExpiryIntervalFlag: true})
	kept.Subscribe(1, "kept/#", 1)
	_ = kept.Conn.Close()

	expired := connectExpiringWithWill(t, addr, "expiry-gone", 1, 60, 0)
	expired.Subscribe(1, "gone/#", 1)
	closed := time.Now()
	_ = expired.Conn.Close()

	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("expiry-pub", true, packets.Properties{})
	pub.Publish(1, "kept/a", 1, []byte("queued"))
	pub.Expect(packets.Puback)

	// Past the 1 s expiry; before mochi's tick would have seen it.
	time.Sleep(time.Until(closed.Add(1100 * time.Millisecond)))
	again := mqtttest.Dial(t, addr, 5)
	ack := again.Connect("expiry-gone", false, packets.Properties{SessionExpiryInterval: 60, SessionExpiryIntervalFlag: true})
	require.False(t, ack.SessionPresent, "the session expired 1 s after its connection closed [MQTT-3.2.2-3]")
	will := watcher.Expect(packets.Publish)
	require.Equal(t, "will/expiry-gone", will.TopicName)
	require.Less(t, time.Since(closed), 2*time.Second, "the will goes out when the session ends, not after its 60 s delay")
	// Nothing of the expired session: its subscription is gone.
	pub.Publish(2, "gone/a", 1, []byte("x"))
	pub.Expect(packets.Puback)
	pk, err := again.Read(300 * time.Millisecond)
	require.Error(t, err, "the expired session's subscription went with it; got packet type %d", pk.FixedHeader.Type)

	back := mqtttest.Dial(t, addr, 5)
	ack = back.Connect("expiry-kept", false, packets.Properties{SessionExpiryInterval: 3, SessionExpiryIntervalFlag: true})
	require.True(t, ack.SessionPresent, "3 s have not passed")
	require.Equal(t, "queued", string(back.Expect(packets.Publish).Payload))

	// The will went out once.
	pk, err = watcher.Read(1500 * time.Millisecond)
	require.Error(t, err, "the will is published once; got packet type %d", pk.FixedHeader.Type)
}

// [MQTT-3.1.3-9]: a will goes out when its delay passes or the session
// ends, whichever is first. The CONNECT's expiry bounds the delay already;
// a DISCONNECT that keeps the will (Reason Code 0x80, [MQTT-3.1.2-8]) and
// shortens the Session Expiry Interval ([MQTT-3.14.2-2]) brings the end of
// the session, and the will, forward.
func TestBroker_WillAtSessionExpiryBeforeItsDelay_MQTT_3_1_3_9(t *testing.T) {
	t.Parallel()
	_, addr := startBroker(t, nil)
	watcher := mqtttest.Dial(t, addr, 5)
	watcher.Connect("expiry-watcher", true, packets.Properties{})
	watcher.Subscribe(1, "will/#", 1)
	c := connectExpiringWithWill(t, addr, "expiry-will", 60, 30, 0)
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}, ReasonCode: packets.ErrUnspecifiedError.Code,
		Properties: packets.Properties{SessionExpiryInterval: 1, SessionExpiryIntervalFlag: true}})
	closed := time.Now()
	will := watcher.Expect(packets.Publish)
	require.Equal(t, "will/expiry-will", will.TopicName)
	require.GreaterOrEqual(t, time.Since(closed), 900*time.Millisecond, "not before the session ends")
	pk, err := watcher.Read(2 * time.Second)
	require.Error(t, err, "the will is published once; got packet type %d", pk.FixedHeader.Type)
}

// In a cluster a CONNECT on another edge takes the session over from this
// one: a session that expired here before the claim came does not move
// (the new connection gets Session Present 0, [MQTT-3.2.2-3]); it ends
// here, its will goes out once, and its stored state goes.
func TestBroker_ExpiredSessionIsNotTakenOver_MQTT_3_2_2_3(t *testing.T) {
	t.Parallel()
	b, st, addr := servingOnSharedStore(t)
	watcher := mqtttest.Dial(t, addr, 5)
	watcher.Connect("expiry-watcher", true, packets.Properties{})
	watcher.Subscribe(1, "will/#", 1)
	id := b.mustScope(t, "default").ClientID("expiry-moving")
	c := connectExpiringWithWill(t, addr, "expiry-moving", 1, 60, 0)
	c.Subscribe(1, "moving/#", 1)
	var s *session
	require.Eventually(t, func() bool { s = b.session(id); return s != nil }, 5*time.Second, time.Millisecond)
	s.mu.Lock()
	epoch := s.epoch
	s.mu.Unlock()
	closed := time.Now()
	_ = c.Conn.Close()
	waitUnbound(t, s)

	time.Sleep(time.Until(closed.Add(1100 * time.Millisecond)))
	owned, connected, state, err := b.TakeOver(t.Context(), "default", "expiry-moving", "other", epoch+1, false)
	require.NoError(t, err)
	require.True(t, owned)
	require.False(t, connected)
	require.Nil(t, state, "an expired session does not move")
	require.Nil(t, b.session(id))
	_, ok, err := st.LoadSession(t.Context(), id)
	require.NoError(t, err)
	require.False(t, ok, "its stored state went with it")
	require.Equal(t, "will/expiry-moving", watcher.Expect(packets.Publish).TopicName)
	pk, err := watcher.Read(1500 * time.Millisecond)
	require.Error(t, err, "the will is published once; got packet type %d", pk.FixedHeader.Type)
}
