package broker

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/durable"
)

// startDurable runs a broker on dir; stop closes broker and store, as a
// restart of the edge would.
func startDurable(t *testing.T, dir string) (addr string, stop func()) {
	t.Helper()
	_, addr, stop = openDurable(t, dir)
	t.Cleanup(stop)
	return addr, stop
}

// openDurable is startDurable that also returns the broker and leaves the
// stop to the caller.
func openDurable(t *testing.T, dir string) (b *Broker, addr string, stop func()) {
	t.Helper()
	return openDurableWith(t, dir, nil)
}

// openDurableWith is openDurable that runs before, when set, on the broker
// restored from dir before it serves (to set its cluster).
func openDurableWith(t *testing.T, dir string, before func(*Broker)) (b *Broker, addr string, stop func()) {
	t.Helper()
	cfg := DefaultConfig()
	cfg.EdgeID = "test"
	b, err := New(cfg, anonymous(), testutil.Logger(t), prometheus.NewRegistry())
	require.NoError(t, err)
	st, err := durable.Open(dir, testutil.Logger(t))
	require.NoError(t, err)
	require.NoError(t, b.Restore(st))
	if before != nil {
		before(b)
	}
	addr = serveTCP(t, b)
	stopped := false
	stop = func() {
		if !stopped {
			stopped = true
			_ = b.Close()
			_ = st.Close()
		}
	}
	return b, addr, stop
}

var persistentProps = packets.Properties{SessionExpiryInterval: 3600, SessionExpiryIntervalFlag: true}

// Queued QoS 1 messages, an unacknowledged in-flight message, the
// subscription and a retained message all survive a restart of the edge.
func TestBroker_RestartKeepsSessionsQueuesAndRetained(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	addr, stop := startDurable(t, dir)

	sub := mqtttest.Dial(t, addr, 5)
	require.False(t, sub.Connect("dev", false, persistentProps).SessionPresent)
	sub.Subscribe(1, "q/#", 1)
	pub := mqtttest.Dial(t, addr, 4)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "q/0", 1, seqPayload(0))
	pub.Expect(packets.Puback)
	// Received but not acknowledged: stays in flight.
	inflight := sub.Expect(packets.Publish)
	require.Equal(t, seqPayload(0), inflight.Payload)
	_ = sub.Conn.Close()

	// While offline, more messages queue up, and one retained message.
	for i := 1; i <= 5; i++ {
		pub.Publish(uint16(i+1), "q/x", 1, seqPayload(i))
		pub.Expect(packets.Puback)
	}
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1, Retain: true}, PacketID: 9, TopicName: "r/keep", Payload: []byte("kept")})
	pub.Expect(packets.Puback)
	stop()

	addr, _ = startDurable(t, dir)
	sub = mqtttest.Dial(t, addr, 5)
	ack := sub.Connect("dev", false, persistentProps)
	require.True(t, ack.SessionPresent, "session restored")
	// The in-flight message comes again first, same packet ID, DUP set.
	again := sub.Expect(packets.Publish)
	require.Equal(t, seqPayload(0), again.Payload)
	require.Equal(t, inflight.PacketID, again.PacketID)
	require.True(t, again.FixedHeader.Dup)
	sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: again.PacketID})
	for i := 1; i <= 5; i++ {
		got := sub.Expect(packets.Publish)
		require.Equal(t, seqPayload(i), got.Payload, "queued message %d in order", i)
		require.Equal(t, "q/x", got.TopicName)
		sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
	}
	// The subscription itself survived: a new message reaches the session.
	pub = mqtttest.Dial(t, addr, 4)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "q/new", 1, []byte("after"))
	pub.Expect(packets.Puback)
	require.Equal(t, []byte("after"), sub.Expect(packets.Publish).Payload)

	fresh := mqtttest.Dial(t, addr, 4)
	fresh.Connect("fresh", true, packets.Properties{})
	fresh.Subscribe(1, "r/#", 1)
	got := fresh.Expect(packets.Publish)
	require.Equal(t, []byte("kept"), got.Payload)
	require.True(t, got.FixedHeader.Retain)
}

// A session that ended (clean start) is gone after a restart too.
func TestBroker_RestartForgetsEndedSessions(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	addr, stop := startDurable(t, dir)
	c := mqtttest.Dial(t, addr, 5)
	c.Connect("dev", false, persistentProps)
	c.Subscribe(1, "x", 1)
	_ = c.Conn.Close()
	c = mqtttest.Dial(t, addr, 5)
	require.False(t, c.Connect("dev", true, packets.Properties{}).SessionPresent)
	_ = c.Conn.Close()
	time.Sleep(50 * time.Millisecond) // the async delete commits with the next batch or on close
	stop()
	addr, _ = startDurable(t, dir)
	c = mqtttest.Dial(t, addr, 5)
	require.False(t, c.Connect("dev", false, persistentProps).SessionPresent)
}

// A QoS 2 message acknowledged with PUBREC is not delivered again when its
// publisher resends it after a restart of the edge ([MQTT-4.3.3-9]).
func TestBroker_RestartKeepsInboundQoS2State(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	addr, stop := startDurable(t, dir)
	sub := mqtttest.Dial(t, addr, 5)
	sub.Connect("sub", false, persistentProps)
	sub.Subscribe(1, "q2", 2)
	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("pub", false, persistentProps)
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2}, PacketID: 42, TopicName: "q2", Payload: []byte("once")})
	pub.Expect(packets.Pubrec)
	got := sub.Expect(packets.Publish)
	require.Equal(t, []byte("once"), got.Payload)
	sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: got.PacketID})
	sub.Expect(packets.Pubrel)
	sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: got.PacketID})
	stop()

	addr, _ = startDurable(t, dir)
	sub = mqtttest.Dial(t, addr, 5)
	require.True(t, sub.Connect("sub", false, persistentProps).SessionPresent)
	pub = mqtttest.Dial(t, addr, 5)
	require.True(t, pub.Connect("pub", false, persistentProps).SessionPresent)
	// The publisher saw PUBREC but sent no PUBREL: it resends with DUP.
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2, Dup: true}, PacketID: 42, TopicName: "q2", Payload: []byte("once")})
	require.Equal(t, packets.CodeSuccess.Code, pub.Expect(packets.Pubrec).ReasonCode)
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 42})
	require.Equal(t, packets.CodeSuccess.Code, pub.Expect(packets.Pubcomp).ReasonCode)
	// A fresh message proves the subscriber is live; the resend never came.
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2}, PacketID: 43, TopicName: "q2", Payload: []byte("next")})
	pub.Expect(packets.Pubrec)
	require.Equal(t, []byte("next"), sub.Expect(packets.Publish).Payload)
}

// A client that got its PUBREC before the edge stopped sends the PUBREL
// when it resumes the session; the flow completes as it would have on the
// first edge [MQTT-4.3.3-11].
func TestBroker_RestartCompletesAPubrelOfAnEarlierPubrec(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	addr, stop := startDurable(t, dir)
	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("pub", false, persistentProps)
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2}, PacketID: 7, TopicName: "q2", Payload: []byte("x")})
	pub.Expect(packets.Pubrec)
	stop()

	addr, _ = startDurable(t, dir)
	pub = mqtttest.Dial(t, addr, 5)
	require.True(t, pub.Connect("pub", false, persistentProps).SessionPresent)
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 7})
	require.Equal(t, packets.CodeSuccess.Code, pub.Expect(packets.Pubcomp).ReasonCode)
}

// An edge killed while it routes a QoS 2 publish, after its PUBREC state
// was stored and before the PUBREC, loses nothing: the session's next
// holder takes the client's resend for a message still to deliver, not
// for one delivered, and routes it (under the same msgID).
func TestBroker_KilledWhileRoutingAQoS2PublishLosesNothing(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	peers := newHeldPeers()
	_, addr, stop := openDurableWith(t, dir, func(b *Broker) { b.SetCluster(Cluster{Peers: peers}) })
	t.Cleanup(stop)
	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("pub", false, persistentProps)
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2}, PacketID: 42, TopicName: "q2", Payload: []byte("once")})
	require.Eventually(t, func() bool { return peers.routes("once") == 1 }, 5*time.Second, time.Millisecond,
		"the publish is stored and waits on another edge")
	// The store as the edge, killed now, would leave it: every write the
	// edge waited for is on disk.
	killed := t.TempDir()
	data, err := os.ReadFile(filepath.Join(dir, "edge.db"))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(killed, "edge.db"), data, 0o600))
	stop()

	addr, _ = startDurable(t, killed)
	sub := mqtttest.Dial(t, addr, 5)
	sub.Connect("sub", true, packets.Properties{})
	sub.Subscribe(1, "q2", 2)
	pub = mqtttest.Dial(t, addr, 5)
	require.True(t, pub.Connect("pub", false, persistentProps).SessionPresent)
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2, Dup: true}, PacketID: 42, TopicName: "q2", Payload: []byte("once")})
	require.Equal(t, packets.CodeSuccess.Code, pub.Expect(packets.Pubrec).ReasonCode)
	require.Equal(t, []byte("once"), sub.Expect(packets.Publish).Payload)
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 42})
	require.Equal(t, packets.CodeSuccess.Code, pub.Expect(packets.Pubcomp).ReasonCode)
}

// An MQTT 5 DISCONNECT that changes the session expiry interval changes it
// in the stored session too [MQTT-3.14.2-2]: a restart, or a custodian,
// expires the session when the client last asked.
func TestBroker_DisconnectExpiryIsStored(t *testing.T) {
	t.Parallel()
	b, addr, stop := openDurable(t, t.TempDir())
	t.Cleanup(stop)
	c := mqtttest.Dial(t, addr, 5)
	c.Connect("shrinking", false, packets.Properties{SessionExpiryInterval: 300, SessionExpiryIntervalFlag: true})
	id := b.mustScope(t, "default").ClientID("shrinking")
	waitBound(t, b, id)
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect},
		Properties: packets.Properties{SessionExpiryInterval: 7, SessionExpiryIntervalFlag: true}})
	require.Eventually(t, func() bool {
		st, ok, err := b.store.LoadSession(t.Context(), id)
		return err == nil && ok && st.Session.ExpiryInterval == 7
	}, 5*time.Second, 10*time.Millisecond, "the stored session keeps the interval of the DISCONNECT")
}

// An edge that keeps its sessions in its own store and joins a cluster
// registers the routes of the sessions it restored: otherwise what other
// edges publish to them would never come here. One the router does not
// confirm at once (it is not connected yet) lands later: the rest are
// registered all the same.
func TestBroker_RestoredSessionsAreRouted(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	addr, stop := startDurable(t, dir)
	sub := mqtttest.Dial(t, addr, 5)
	sub.Connect("dev", false, persistentProps)
	sub.Subscribe(1, "q/#", 1)
	sub.Subscribe(2, "$share/g/s/+", 1)
	_ = sub.Conn.Close()
	stop()

	b, _, stop2 := openDurable(t, dir)
	t.Cleanup(stop2)
	routes := &recordingRoutes{failAt: 1, err: context.DeadlineExceeded}
	b.SetCluster(Cluster{Routes: routes})
	routes.mu.Lock()
	defer routes.mu.Unlock()
	require.ElementsMatch(t, []string{"q/#", "s/+"}, routes.added)
}

// A single-node edge that stops closes its clients' connections: that is
// not a normal DISCONNECT, so each will goes out after its delay unless
// the client comes back first [MQTT-3.1.2-8] [MQTT-3.1.3-9], the edge's
// restart between them. The will of a session that ended with the stop (a
// 3.1.1 clean session) goes out when the edge is back; so does one whose
// delay passed while it was down; one whose client comes back in time
// never does.
func TestBroker_RestartPublishesTheWillsOfConnectionsItsStopClosed_MQTT_3_1_2_8(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	addr, stop := startDurable(t, dir)
	subscribeWillWatcher(t, addr)

	// QoS 1 wills: they are queued for the watcher, offline.
	withWill := func(addr, id string, delay uint32) *mqtttest.Client {
		return connectExpiringWithWill(t, addr, id, 3600, delay, 1)
	}
	withWill(addr, "due", 0)
	withWill(addr, "later", 1)
	withWill(addr, "back", 3)
	clean := mqtttest.Dial(t, addr, 4)
	clean.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: true, Keepalive: 30, ClientIdentifier: "clean",
			WillFlag: true, WillTopic: "will/clean", WillQos: 1, WillPayload: []byte("clean")}})
	clean.Expect(packets.Connack)
	// A normal DISCONNECT discards its will [MQTT-3.1.2-10].
	left := withWill(addr, "left", 0)
	left.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	time.Sleep(50 * time.Millisecond)
	stop()

	addr, _ = startDurable(t, dir)
	withWill(addr, "back", 3)
	watcher := mqtttest.Dial(t, addr, 5)
	require.True(t, watcher.Connect("watcher", false, persistentProps).SessionPresent)
	got := map[string]bool{}
	for len(got) < 3 {
		pk, err := watcher.Read(5 * time.Second)
		require.NoError(t, err, "wills so far: %v", got)
		require.False(t, got[pk.TopicName], "will %s twice", pk.TopicName)
		got[pk.TopicName] = true
		if pk.PacketID != 0 {
			watcher.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
		}
	}
	require.Equal(t, map[string]bool{"will/due": true, "will/clean": true, "will/later": true}, got)
	// "back" came back within its delay, and "left" said goodbye.
	pk, err := watcher.Read(3500 * time.Millisecond)
	require.Error(t, err, "unexpected %s %s", packets.PacketNames[pk.FixedHeader.Type], pk.TopicName)
}

// subscribeWillWatcher subscribes the persistent session "watcher" to
// will/# at QoS 1 and leaves it offline: what it gets while the edge is
// down or restarting waits for it.
func subscribeWillWatcher(t *testing.T, addr string) {
	t.Helper()
	watcher := mqtttest.Dial(t, addr, 5)
	watcher.Connect("watcher", false, persistentProps)
	require.Equal(t, []byte{1}, watcher.Subscribe(1, "will/#", 1).ReasonCodes)
	_ = watcher.Conn.Close()
}

// A will's delay and a session's expiry count from when the connection
// ended, across a restart of a single-node edge too [MQTT-3.1.3-9]
// (§3.1.2.11.2): a will still waiting for its delay when the edge stopped
// goes out after what was left of it, and a session whose expiry passed
// while the edge was down is gone, its will published.
func TestBroker_RestartCountsWillDelayAndExpiryFromTheEnd(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	addr, stop := startDurable(t, dir)
	subscribeWillWatcher(t, addr)

	pending := connectExpiringWithWill(t, addr, "pending", 3600, 3, 1)
	_ = pending.Conn.Close() // its will waits 3 s from here
	connectExpiringWithWill(t, addr, "short", 1, 10, 1)
	stop()
	time.Sleep(1500 * time.Millisecond) // the edge is down

	addr, _ = startDurable(t, dir)
	restarted := time.Now()
	// "short" ended a second after the stop closed its connection: its
	// session is gone...
	c := mqtttest.Dial(t, addr, 5)
	require.False(t, c.Connect("short", false, persistentProps).SessionPresent)
	watcher := mqtttest.Dial(t, addr, 5)
	require.True(t, watcher.Connect("watcher", false, persistentProps).SessionPresent)
	got := map[string]time.Duration{}
	for len(got) < 2 {
		pk, err := watcher.Read(5 * time.Second)
		require.NoError(t, err, "wills so far: %v", got)
		got[pk.TopicName] = time.Since(restarted)
		watcher.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
	}
	// ...and its will went out with it; "pending" had about 1.5 s left.
	require.Contains(t, got, "will/short")
	require.Contains(t, got, "will/pending")
	require.Less(t, got["will/pending"], 2600*time.Millisecond, "the whole delay again after the restart")
}

// A session that expires while a single-node edge stops is not ended by
// the stop, which would delete its record and the will its end publishes
// and the stop keeps: the edge started again finds it expired, ends it, and
// publishes the will once [MQTT-3.1.2-8].
func TestBroker_SessionExpiringAsTheEdgeStopsKeepsItsWill(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	b, addr, stop := openDurable(t, dir)
	t.Cleanup(stop)
	subscribeWillWatcher(t, addr)

	id := b.mustScope(t, "default").ClientID("expiring")
	c := connectExpiringWithWill(t, addr, "expiring", 1, 30, 1)
	_ = c.Conn.Close()
	waitWillWaiting(t, b, id)
	b.stopping.Store(true)              // the stop has begun
	time.Sleep(2200 * time.Millisecond) // mochi's tick, once a second, comes past the session's expiry
	stop()

	addr, _ = startDurable(t, dir)
	watcher := mqtttest.Dial(t, addr, 5)
	require.True(t, watcher.Connect("watcher", false, persistentProps).SessionPresent)
	pk, err := watcher.Read(5 * time.Second)
	require.NoError(t, err, "the will of the session that expired as the edge stopped")
	require.Equal(t, "will/expiring", pk.TopicName)
	watcher.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
	_, err = watcher.Read(time.Second)
	require.Error(t, err, "the will goes out once")
	c = mqtttest.Dial(t, addr, 5)
	require.False(t, c.Connect("expiring", false, persistentProps).SessionPresent, "the session ended")
}
