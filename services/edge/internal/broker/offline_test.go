package broker

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// An offline persistent session's queue is bounded by count
// (--mqtt.offline-queue-len) and by bytes (--mqtt.offline-queue-bytes).
// Past a bound, the newest message is refused, or with drop-oldest the
// oldest ones make room for it; a message larger than the byte bound is
// refused either way. Every drop is counted, and what is kept comes back
// in order when the client does, from the store as from memory.
func TestBroker_OfflineQueueBounds(t *testing.T) {
	t.Parallel()
	const payload = 100
	for _, tc := range []struct {
		name       string
		count      int
		bytes      func(topicLen int) int
		dropOldest bool
		publish    []int // payload sizes (payload: the default)
		want       []int // the indexes delivered
	}{
		{name: "count_refuse_newest", count: 3, publish: []int{payload, payload, payload, payload, payload}, want: []int{0, 1, 2}},
		{name: "count_drop_oldest", count: 3, dropOldest: true, publish: []int{payload, payload, payload, payload, payload}, want: []int{2, 3, 4}},
		{name: "bytes_refuse_newest", count: 100, bytes: func(n int) int { return 3*(n+payload+64) + 10 },
			publish: []int{payload, payload, payload, payload}, want: []int{0, 1, 2}},
		{name: "bytes_drop_oldest_makes_room", count: 100, dropOldest: true, bytes: func(n int) int { return 3*(n+payload+64) + 10 },
			publish: []int{payload, payload, payload, 2*payload + 64}, want: []int{2, 3}},
		{name: "bytes_larger_than_the_bound", count: 100, dropOldest: true, bytes: func(n int) int { return 3*(n+payload+64) + 10 },
			publish: []int{payload, 4 * payload * 3}, want: []int{0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			topic := "q/" + tc.name
			b, _ := brokerOnStore(t, func(st *durable.Store) DurableState { return st })
			b.cfg.OfflineQueueLen, b.cfg.OfflineDropOldest = tc.count, tc.dropOldest
			b.cfg.OfflineQueueBytes = 0
			if tc.bytes != nil {
				b.cfg.OfflineQueueBytes = tc.bytes(len(b.mustScope(t, "default").Topic(topic)))
			}
			addr := serveTCP(t, b)

			sub := mqtttest.Dial(t, addr, 5)
			sub.Connect("offline", false, persistentSession)
			sub.Subscribe(1, topic, 1)
			require.NoError(t, sub.Conn.Close())
			require.Eventually(t, func() bool {
				s := b.session(b.mustScope(t, "default").ClientID("offline"))
				s.mu.Lock()
				defer s.mu.Unlock()
				return s.client == nil
			}, 5*time.Second, 10*time.Millisecond, "the session goes offline")

			pub := mqtttest.Dial(t, addr, 5)
			pub.Connect("pub", true, packets.Properties{})
			for i, n := range tc.publish {
				pub.Publish(uint16(i+1), topic, 1, []byte(fmt.Sprintf("%03d", i)+strings.Repeat("x", n-3)))
				pub.Expect(packets.Puback)
			}
			dropped := promtest.ToFloat64(b.m.dropped.WithLabelValues("offline_queue_full"))
			require.Equal(t, float64(len(tc.publish)-len(tc.want)), dropped, "every drop counted")

			back := mqtttest.Dial(t, addr, 5)
			require.Equal(t, byte(0), back.Connect("offline", false, persistentSession).ReasonCode)
			for _, want := range tc.want {
				got := back.Expect(packets.Publish)
				require.Equal(t, fmt.Sprintf("%03d", want), string(got.Payload[:3]))
				back.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
			}
			_, err := back.Read(200 * time.Millisecond)
			require.Error(t, err, "nothing more")
		})
	}
}

// A connection's session is bound after its CONNACK is written, so a
// client reconnecting at once can have its newer connection bound first;
// the older connection, taken over, must not bind the session after it.
func TestBroker_LateBindOfATakenOverConnectionKeepsTheNewer(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	_, oldCl, oldConn := boundConnection(t, b, addr, "late")
	id := oldCl.ID

	newer := mqtttest.Dial(t, addr, 5)
	newer.Connect("late", false, persistentSession)
	newCl, ok := b.server.Clients.Get(id)
	require.True(t, ok)
	require.NotSame(t, oldCl, newCl)
	s := b.session(id)
	require.Eventually(t, func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.client == newCl
	}, 5*time.Second, time.Millisecond)

	require.False(t, b.bindEstablished(oldCl, oldConn), "the older connection's hook, run late")
	s.mu.Lock()
	bound := s.client
	s.mu.Unlock()
	require.Same(t, newCl, bound)

	newer.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: 1,
		Filters: packets.Subscriptions{{Filter: "late/x", Qos: 1}}})
	require.Equal(t, []byte{1}, newer.Expect(packets.Suback).ReasonCodes)
	require.NoError(t, b.Publish("default", "late/x", []byte("p"), 1, false))
	require.Equal(t, []byte("p"), newer.Expect(packets.Publish).Payload, "the session delivers to the newer connection")
}

// putSessionGate holds the n-th PutSession (counted from 1) until release.
type putSessionGate struct {
	*durable.Store
	n       int
	calls   atomic.Int32
	entered chan struct{}
	release chan struct{}
	open    func() // closes release, once
}

// sessionGatedBroker serves MQTT from a broker whose store holds its n-th
// PutSession until gate.open.
func sessionGatedBroker(t *testing.T, n int) (*Broker, *putSessionGate, string) {
	t.Helper()
	gate := &putSessionGate{n: n, entered: make(chan struct{}), release: make(chan struct{})}
	gate.open = sync.OnceFunc(func() { close(gate.release) })
	b, _ := brokerOnStore(t, func(st *durable.Store) DurableState { gate.Store = st; return gate })
	t.Cleanup(gate.open) // before the broker closes: a failed test does not hang
	return b, gate, serveTCP(t, b)
}

func (g *putSessionGate) PutSession(ctx context.Context, rec durable.Session) error {
	if int(g.calls.Add(1)) == g.n {
		close(g.entered)
		<-g.release
	}
	return g.Store.PutSession(ctx, rec)
}

// The older connection's bind can come while the newer connection, having
// taken the session from it, stores the session before its own bind: the
// older one must not bind then either, or the session's messages drain
// into a connection mochi has closed, and the newer one's bind finds none
// to resend.
func TestBroker_LateBindWhileTheNewerConnectionStoresItsSessionIsRefused(t *testing.T) {
	t.Parallel()
	b, gate, addr := sessionGatedBroker(t, 2)
	old, oldCl, oldConn := boundConnection(t, b, addr, "late")
	old.Subscribe(1, "late/x", 1)
	id := oldCl.ID
	s := b.session(id)
	require.True(t, s.unbind(oldCl), "as if its bind were still to come")

	newer := mqtttest.Dial(t, addr, 5)
	connected := make(chan struct{})
	go func() {
		defer close(connected)
		newer.Connect("late", false, persistentSession)
	}()
	<-gate.entered // the newer connection took the session and stores it

	require.False(t, b.bindEstablished(oldCl, oldConn), "the older connection's bind, come late")
	s.mu.Lock()
	bound := s.client
	s.mu.Unlock()
	require.Nil(t, bound)

	gate.open()
	<-connected
	require.Eventually(t, func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.client != nil && s.client != oldCl
	}, 5*time.Second, time.Millisecond)
	require.NoError(t, b.Publish("default", "late/x", []byte("p"), 1, false))
	require.Equal(t, []byte("p"), newer.Expect(packets.Publish).Payload)
}

// A connection closed before its bind came (a newer CONNECT of the client
// took it over, or the client went) does not bind the session: it would
// take the session's resends and queue into a closed socket.
func TestBroker_LateBindOfAClosedConnectionIsRefused(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	old, oldCl, oldConn := boundConnection(t, b, addr, "closed")
	id := oldCl.ID
	s := b.session(id)
	require.True(t, s.unbind(oldCl), "as if its bind were still to come")
	require.NoError(t, old.Conn.Close())
	require.Eventually(t, oldCl.Closed, 5*time.Second, time.Millisecond)

	require.False(t, b.bindEstablished(oldCl, oldConn))
	s.mu.Lock()
	defer s.mu.Unlock()
	require.Nil(t, s.client)
}

// boundConnection connects client with a persistent session and returns
// its connection once the session is bound to it, as the broker sees it.
func boundConnection(t *testing.T, b *Broker, addr, client string) (*mqtttest.Client, *mqtt.Client, *conn) {
	t.Helper()
	c := mqtttest.Dial(t, addr, 5)
	c.Connect(client, false, persistentSession)
	id := b.mustScope(t, "default").ClientID(client)
	waitBound(t, b, id)
	cl, ok := b.server.Clients.Get(id)
	require.True(t, ok)
	cn := b.conn(cl)
	require.NotNil(t, cn)
	return c, cl, cn
}

// A CONNECT of a client whose earlier CONNECT is still being established
// (storing its session, before its CONNACK and bind) waits for it: run at
// once, mochi's takeover of the earlier one, when it came, picked the
// newer connection as the one to close, and neither kept the session.
func TestBroker_ConnectWaitsForTheClientsConnectBeingEstablished(t *testing.T) {
	t.Parallel()
	b, gate, addr := sessionGatedBroker(t, 2)
	first := mqtttest.Dial(t, addr, 5)
	first.Connect("twice", false, persistentSession)
	first.Subscribe(1, "twice/x", 1)

	second := mqtttest.Dial(t, addr, 5)
	go second.Write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, ProtocolVersion: 5,
		Connect:    packets.ConnectParams{ProtocolName: []byte("MQTT"), ClientIdentifier: "twice", Keepalive: 30},
		Properties: persistentSession})
	<-gate.entered // the second CONNECT stores its session
	third := mqtttest.Dial(t, addr, 5)
	connected := make(chan struct{})
	go func() {
		defer close(connected)
		third.Connect("twice", false, persistentSession)
	}()
	time.Sleep(200 * time.Millisecond) // the third CONNECT is in
	gate.open()
	<-connected
	for { // the second connection is taken over by the third, and closed
		if _, err := second.Read(5 * time.Second); err != nil {
			break
		}
	}

	id := b.mustScope(t, "default").ClientID("twice")
	require.Eventually(t, func() bool {
		s := b.session(id)
		s.mu.Lock()
		defer s.mu.Unlock()
		cl, ok := b.server.Clients.Get(id)
		return ok && s.client == cl
	}, 5*time.Second, time.Millisecond, "the session is bound to the newest connection")
	require.NoError(t, b.Publish("default", "twice/x", []byte("p"), 1, false))
	require.Equal(t, []byte("p"), third.Expect(packets.Publish).Payload, "the newest connection holds the session")
}
