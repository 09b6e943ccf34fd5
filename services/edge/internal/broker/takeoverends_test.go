package broker

import (
	"fmt"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// connectWithWill connects id with a will on willTopic (payload id) and
// returns the client.
func connectWithWill(t *testing.T, addr string, version byte, id, willTopic string, clean bool, props packets.Properties, willDelay uint32) *mqtttest.Client {
	t.Helper()
	c := mqtttest.Dial(t, addr, version)
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, Properties: props,
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: clean, Keepalive: 30, ClientIdentifier: id,
			WillFlag: true, WillTopic: willTopic, WillQos: 1, WillPayload: []byte(id),
			WillProperties: packets.Properties{WillDelayInterval: willDelay}}})
	ack := c.Expect(packets.Connack)
	require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
	require.False(t, ack.SessionPresent)
	return c
}

// expectClosed waits for the server to close c's connection.
func expectClosed(t *testing.T, c *mqtttest.Client) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		pk, err := c.Read(time.Until(deadline))
		if err != nil {
			return
		}
		require.Equal(t, packets.Disconnect, pk.FixedHeader.Type, "only a DISCONNECT before the close")
	}
	t.Fatal("the connection stayed open")
}

// expectWillsOnce reads the wills the watcher gets: want, once, and nothing
// more for a while.
func expectWillsOnce(t *testing.T, watcher *mqtttest.Client, want string) {
	t.Helper()
	will := watcher.Expect(packets.Publish)
	require.Equal(t, want, string(will.Payload))
	watcher.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: will.PacketID})
	if pk, err := watcher.Read(time.Second); err == nil {
		t.Fatalf("a second packet after the will: type %d, payload %q", pk.FixedHeader.Type, pk.Payload)
	}
}

// A CONNECT without Clean Start that takes over a live connection whose
// session does not outlive it (MQTT 5 Session Expiry 0, a 3.1.1 clean
// session) ends that session: the takeover closes its connection
// (§3.1.2.11.2; 3.1.1 [MQTT-3.1.2-6]). The new connection starts a new
// session (Session Present 0 [MQTT-3.2.2-3], nothing of the old
// subscriptions), and the old connection's will goes out at once, whatever
// its delay, and once ([MQTT-3.1.2-8] "or the Session ends", §3.1.4).
func TestBroker_TakeoverEndsASessionThatDoesNotOutliveItsConnection(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	for _, tc := range []struct {
		name      string
		version   byte
		props     packets.Properties // the old connection's
		willDelay uint32
	}{
		{"mqtt5_expiry_0", 5, packets.Properties{}, 0},
		{"mqtt5_expiry_0_will_delay", 5, packets.Properties{}, 60},
		{"mqtt5_expiry_0_set_explicitly", 5, packets.Properties{SessionExpiryIntervalFlag: true}, 30},
		{"mqtt311_clean_session", 4, packets.Properties{}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			id := "ends-" + tc.name
			watcher := watchWills(t, addr, "watch-"+id, id)

			old := connectWithWill(t, addr, tc.version, id, "gone/"+id, true, tc.props, tc.willDelay)
			require.Equal(t, []byte{1}, old.Subscribe(1, "data/"+id, 1).ReasonCodes)

			newer := mqtttest.Dial(t, addr, tc.version)
			var props packets.Properties
			if tc.version == 5 {
				props = persistentSession
			}
			ack := newer.Connect(id, false, props)
			require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
			require.False(t, ack.SessionPresent, "the old session ended with its connection")
			expectClosed(t, old)
			expectWillsOnce(t, watcher, id)

			// Nothing of the old session's subscriptions came along.
			s := b.session(b.mustScope(t, "default").ClientID(id))
			require.NotNil(t, s)
			require.Zero(t, s.nsubs.Load())
			pub := mqtttest.Dial(t, addr, 5)
			pub.Connect("pub-"+id, true, packets.Properties{})
			pub.Publish(1, "data/"+id, 1, []byte("after"))
			pub.Expect(packets.Puback)
			if pk, err := newer.Read(500 * time.Millisecond); err == nil {
				t.Fatalf("the new session got type %d, payload %q", pk.FixedHeader.Type, pk.Payload)
			}
		})
	}
}

// A session that outlives its connection, taken over by a CONNECT without
// Clean Start, goes on in the new connection ([MQTT-3.1.2-5]): Session
// Present 1, its subscriptions, and the QoS 1 messages acknowledged to
// their publisher and not yet acknowledged by the client, in flight and
// queued, all delivered; the old connection's will is not published, since
// the session goes on ([MQTT-3.1.3-9]).
func TestBroker_TakeoverWithoutCleanStartKeepsAPersistentSession(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	const id = "keeps"
	watcher := mqtttest.Dial(t, addr, 5)
	watcher.Connect("watch-keeps", true, packets.Properties{})
	require.Equal(t, []byte{1}, watcher.Subscribe(1, "gone/keeps", 1).ReasonCodes)

	// A window of one: one message in flight, the rest queued.
	props := persistentSession
	props.ReceiveMaximum = 1
	old := connectWithWill(t, addr, 5, id, "gone/keeps", true, props, 0)
	require.Equal(t, []byte{1}, old.Subscribe(1, "data/keeps", 1).ReasonCodes)
	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("pub-keeps", true, packets.Properties{})
	const n = 3
	for i := range n {
		pub.Publish(uint16(i+1), "data/keeps", 1, []byte(fmt.Sprint(i)))
		pub.Expect(packets.Puback)
	}
	first := old.Expect(packets.Publish)
	require.Equal(t, "0", string(first.Payload))
	s := b.session(b.mustScope(t, "default").ClientID(id))
	require.Eventually(t, func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.queue.len() == n-1
	}, 5*time.Second, time.Millisecond, "the rest queued")

	newer := mqtttest.Dial(t, addr, 5)
	ack := newer.Connect(id, false, persistentSession)
	require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
	require.True(t, ack.SessionPresent, "the session goes on")
	expectClosed(t, old)
	for i := range n {
		pk := newer.Expect(packets.Publish)
		require.Equal(t, fmt.Sprint(i), string(pk.Payload))
		newer.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
	}
	// Its subscription came along.
	pub.Publish(n+1, "data/keeps", 1, []byte("after"))
	pub.Expect(packets.Puback)
	require.Equal(t, "after", string(newer.Expect(packets.Publish).Payload))
	// And no will.
	if pk, err := watcher.Read(time.Second); err == nil {
		t.Fatalf("the watcher got type %d, payload %q", pk.FixedHeader.Type, pk.Payload)
	}
}

// An MQTT 5 DISCONNECT that sets the Session Expiry Interval to 0 makes the
// session end with its connection [MQTT-3.14.2-2]; the session records it,
// and a takeover decided after it ends the session. One read after a
// newer claim took the session over changes it no more.
func TestSession_TakeOverDecidesFromTheSessionsOwnRecord(t *testing.T) {
	b, _ := startBroker(t, nil)
	oldCl, newCl, newest := b.server.NewClient(nil, "t", "old", false), b.server.NewClient(nil, "t", "new", false),
		b.server.NewClient(nil, "t", "newest", false)
	s := newSession(b, "x", nil)
	s.mu.Lock()
	s.client, s.epoch, s.endsWithClient = oldCl, 1, false
	s.mu.Unlock()
	s.disconnecting(oldCl, 0) // not under its claim: nothing
	s.disconnecting(newCl, 1) // not its connection: nothing
	ends, live := s.takeOver(newCl, 2)
	require.False(t, ends, "persistent: the session goes on")
	require.Nil(t, live)
	s.disconnecting(oldCl, 1) // after the takeover: nothing
	require.False(t, s.endsWithClient)

	s.mu.Lock()
	s.client, s.epoch = newCl, 2
	s.mu.Unlock()
	s.disconnecting(newCl, 2)
	require.True(t, s.endsWithClient)
	ends, live = s.takeOver(newest, 3)
	require.True(t, ends, "Session Expiry 0 since the DISCONNECT: the session ends")
	require.Same(t, newCl, live)
	require.Equal(t, uint64(2), s.epoch, "the end gives back the old connection's claim")

	s.mu.Lock()
	s.client = nil // unbound: its connection closed, its OnDisconnect ends it
	s.mu.Unlock()
	ends, live = s.takeOver(newest, 3)
	require.True(t, ends, "its connection closed: the session ends with it")
	require.Nil(t, live)

	s.mu.Lock()
	s.client, s.endsWithClient = nil, false // not bound: an abandoned connection's copy
	s.mu.Unlock()
	ends, _ = s.takeOver(newest, 3)
	require.False(t, ends, "no live connection: the session goes on")
}
