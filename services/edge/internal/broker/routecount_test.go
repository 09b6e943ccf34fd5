package broker

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	promtestutil "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// countingRoutes keeps the Routes contract's counts: an Add counts when it
// returns nil or an error other than ErrRouteRefused, and each counted Add
// is matched by one Remove. A Remove of a count nobody holds would, at the
// real route client, take another session's count of the same filter.
type countingRoutes struct {
	mu       sync.Mutex
	counts   map[string]int
	calls    map[string]int
	unheld   int // Removes of a count not held
	entered  chan string
	returned chan string
	// answer, given a filter and which Add of it this is (from 1), says
	// what to wait for before answering (nil: nothing) and the answer.
	answer func(filter string, call int) (wait <-chan struct{}, err error)
}

func newCountingRoutes(answer func(string, int) (<-chan struct{}, error)) *countingRoutes {
	return &countingRoutes{counts: map[string]int{}, calls: map[string]int{}, entered: make(chan string, 64),
		returned: make(chan string, 64), answer: answer}
}

// holdRouteAdd gives b a route table whose Add of filter is answered
// only once open is called (or the test ends); the others at once.
func holdRouteAdd(t *testing.T, b *Broker, filter string) (routes *countingRoutes, open func()) {
	release := make(chan struct{})
	open = sync.OnceFunc(func() { close(release) })
	t.Cleanup(open)
	routes = newCountingRoutes(func(f string, _ int) (<-chan struct{}, error) {
		if f == filter {
			return release, nil
		}
		return nil, nil
	})
	b.SetCluster(Cluster{Routes: routes})
	return routes, open
}

func (r *countingRoutes) Add(_ context.Context, _, filter, _ string) error {
	r.mu.Lock()
	r.calls[filter]++
	n := r.calls[filter]
	r.mu.Unlock()
	wait, err := r.answer(filter, n)
	r.entered <- filter
	if wait != nil {
		<-wait
	}
	if !errors.Is(err, ErrRouteRefused) {
		r.mu.Lock()
		r.counts[filter]++
		r.mu.Unlock()
	}
	r.returned <- filter
	return err
}

func (r *countingRoutes) Remove(_ context.Context, _, filter, _ string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.counts[filter] <= 0 {
		r.unheld++
	}
	r.counts[filter]--
	return nil
}

func (r *countingRoutes) state(filter string) (count, unheld int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.counts[filter], r.unheld
}

func (r *countingRoutes) waitEntered(t *testing.T, filter string) {
	t.Helper()
	waitFor(t, r.entered, filter)
}

func (r *countingRoutes) waitReturned(t *testing.T, filter string) {
	t.Helper()
	waitFor(t, r.returned, filter)
}

func waitFor(t *testing.T, ch chan string, filter string) {
	t.Helper()
	select {
	case f := <-ch:
		require.Equal(t, filter, f)
	case <-time.After(5 * time.Second):
		t.Fatalf("no Add of %s", filter)
	}
}

func sendSubscribe(c *mqtttest.Client, id uint16, filter string) {
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: id,
		Filters: packets.Subscriptions{{Filter: filter, Qos: 1}}})
}

// A session that ends while one of its routes is being added does not
// remove that route before the Add returned (at the router, that takes
// another session's count of the filter): the adder gives the count back
// once it returns, and nothing stays counted.
func TestBroker_SessionEndDuringRouteAddRemovesItOnce(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	release := make(chan struct{})
	open := sync.OnceFunc(func() { close(release) })
	t.Cleanup(open) // before the broker closes: a failed test does not hang
	routes := newCountingRoutes(func(string, int) (<-chan struct{}, error) { return release, nil })
	b.SetCluster(Cluster{Routes: routes})

	first := mqtttest.Dial(t, addr, 5)
	first.Connect("ending", false, persistentSession)
	sendSubscribe(first, 1, "ending/x")
	routes.waitEntered(t, "ending/x")

	// A new connection with a clean start ends the session the first one
	// is subscribing for.
	second := mqtttest.Dial(t, addr, 5)
	second.Connect("ending", true, packets.Properties{})
	require.Eventually(t, func() bool {
		s := b.session(b.mustScope(t, "default").ClientID("ending"))
		return s != nil && s.nsubs.Load() == 0
	}, 5*time.Second, 10*time.Millisecond)

	open()
	routes.waitReturned(t, "ending/x")
	require.Eventually(t, func() bool { n, _ := routes.state("ending/x"); return n == 0 }, 5*time.Second, 10*time.Millisecond,
		"the ended session's route is given back")
	n, unheld := routes.state("ending/x")
	require.Zero(t, unheld, "no Remove came before its Add returned")
	require.Zero(t, n)
	require.Zero(t, b.index.count.Load(), "nothing of the ended session stays in the index")
}

// A SUBSCRIBE from a newer connection of the same session, while an
// earlier SUBSCRIBE of the same filter is still adding its route, adds the
// route itself and waits for it: the earlier one may be refused, and its
// SUBACK then promised a route that nobody holds.
func TestBroker_ResubscribeDuringRouteAddAddsItsOwn(t *testing.T) {
	for _, first := range []error{fmt.Errorf("%w: injected", ErrRouteRefused), nil} {
		t.Run(fmt.Sprintf("first=%v", first), func(t *testing.T) {
			t.Parallel()
			b, addr := startBroker(t, nil)
			release := make(chan struct{})
			open := sync.OnceFunc(func() { close(release) })
			t.Cleanup(open)
			routes := newCountingRoutes(func(_ string, call int) (<-chan struct{}, error) {
				if call == 1 {
					return release, first
				}
				return nil, nil
			})
			b.SetCluster(Cluster{Routes: routes})

			old := mqtttest.Dial(t, addr, 5)
			old.Connect("again", false, persistentSession)
			sendSubscribe(old, 1, "again/x")
			routes.waitEntered(t, "again/x")

			// The same session, resumed by a newer connection.
			newer := mqtttest.Dial(t, addr, 5)
			newer.Connect("again", false, persistentSession)
			ack := newer.Subscribe(1, "again/x", 1)
			require.Equal(t, []byte{1}, ack.ReasonCodes)
			routes.waitEntered(t, "again/x")
			routes.waitReturned(t, "again/x")

			open()
			routes.waitReturned(t, "again/x")
			// The earlier adder gives its count back after its Add returned.
			require.Eventually(t, func() bool {
				n, _ := routes.state("again/x")
				return n == 1
			}, 5*time.Second, 10*time.Millisecond)
			n, unheld := routes.state("again/x")
			require.Equal(t, 1, n, "the granted subscription's route is counted once")
			require.Zero(t, unheld)
			require.EqualValues(t, 1, b.index.count.Load())

			newer.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Unsubscribe, Qos: 1}, PacketID: 2,
				Filters: packets.Subscriptions{{Filter: "again/x"}}})
			newer.Expect(packets.Unsuback)
			n, unheld = routes.state("again/x")
			require.Zero(t, n)
			require.Zero(t, unheld)
		})
	}
}

// A client that gives up before its CONNACK could be written leaves
// nothing of its connection behind: no claim in flight (relays for the
// session would be refused for good), no connection record, and no copy
// of a session that ends with the connection, also one it resumed.
func TestBroker_ConnackNotWrittenLeavesNoConnection(t *testing.T) {
	for _, resumes := range []bool{false, true} {
		t.Run(fmt.Sprintf("resumes=%v", resumes), func(t *testing.T) {
			t.Parallel()
			b, addr := startBroker(t, nil)
			claimed, answer := make(chan struct{}), make(chan struct{})
			var epochs atomic.Uint64
			var gate atomic.Bool
			own := &releaseRecorder{fakeOwnership: fakeOwnership{claim: func(_, clientID string) (uint64, string, error) {
				if gate.Load() {
					close(claimed)
					<-answer
				}
				return epochs.Add(1), "", nil
			}}, released: make(chan uint64, 8)}
			b.SetCluster(Cluster{Routes: &fakeRoutes{add: func(string, string, string) error { return nil }}, Ownership: own})
			id := b.mustScope(t, "default").ClientID("gives-up")
			if resumes {
				// A persistent session, offline here.
				first := mqtttest.Dial(t, addr, 5)
				first.Connect("gives-up", false, persistentSession)
				first.Subscribe(1, "gives-up/#", 1)
				first.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
				require.Eventually(t, func() bool { s := b.session(id); return s != nil && !s.online.Load() }, 5*time.Second, 10*time.Millisecond)
				require.Empty(t, own.released, "a persistent session stays claimed")
			}
			gate.Store(true)

			// Resumed with no expiry, the session ends with this connection.
			c := mqtttest.Dial(t, addr, 5)
			c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
				Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: !resumes, ClientIdentifier: "gives-up", Keepalive: 30}})
			<-claimed
			// Reset, so that the CONNACK write fails rather than fill a buffer.
			require.NoError(t, c.Conn.(*net.TCPConn).SetLinger(0))
			require.NoError(t, c.Conn.Close())
			time.Sleep(100 * time.Millisecond)
			close(answer)

			require.Eventually(t, func() bool {
				conns := 0
				b.conns.Range(func(any, any) bool { conns++; return true })
				return conns == 0 && !b.connecting(id, epochs.Load()) && b.session(id) == nil
			}, 5*time.Second, 10*time.Millisecond, "the connection, its claim and the session are gone")
			require.Zero(t, b.index.count.Load())
			if resumes {
				select {
				case e := <-own.released:
					require.Equal(t, epochs.Load(), e, "given back under the claim the coordinator holds")
				case <-time.After(5 * time.Second):
					t.Fatal("the ended session's claim was not given back")
				}
			}
		})
	}
}

// A newer SUBSCRIBE that fails does not put back a subscription it
// replaced while that one's route was still being added: its adder gave
// the count back on finding it replaced, and put back it would be in
// force with no route.
func TestBroker_FailedResubscribeKeepsNoUnroutedSubscription(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	first, second := make(chan struct{}), make(chan struct{})
	openFirst, openSecond := sync.OnceFunc(func() { close(first) }), sync.OnceFunc(func() { close(second) })
	t.Cleanup(openFirst)
	t.Cleanup(openSecond)
	routes := newCountingRoutes(func(_ string, call int) (<-chan struct{}, error) {
		if call == 1 {
			return first, nil
		}
		return second, fmt.Errorf("%w: injected", ErrRouteRefused)
	})
	b.SetCluster(Cluster{Routes: routes})

	old := mqtttest.Dial(t, addr, 5)
	old.Connect("undone", false, persistentSession)
	sendSubscribe(old, 1, "undone/x")
	routes.waitEntered(t, "undone/x")
	newer := mqtttest.Dial(t, addr, 5)
	newer.Connect("undone", false, persistentSession)
	sendSubscribe(newer, 1, "undone/x")
	routes.waitEntered(t, "undone/x")

	openFirst() // the older Add returns and finds its subscription replaced
	routes.waitReturned(t, "undone/x")
	require.Eventually(t, func() bool { n, _ := routes.state("undone/x"); return n == 0 }, 5*time.Second, 10*time.Millisecond)
	openSecond() // the newer one is refused
	ack := newer.Expect(packets.Suback)
	require.Equal(t, []byte{packets.ErrUnspecifiedError.Code}, ack.ReasonCodes)

	s := b.session(b.mustScope(t, "default").ClientID("undone"))
	require.NotNil(t, s)
	require.Zero(t, s.nsubs.Load(), "no subscription without a route is left in force")
	require.Zero(t, b.index.count.Load())
	n, unheld := routes.state("undone/x")
	require.Zero(t, n)
	require.Zero(t, unheld)
}

// releaseRecorder is fakeOwnership that reports the epochs released.
type releaseRecorder struct {
	fakeOwnership
	released chan uint64
}

func (r *releaseRecorder) Release(_ context.Context, _, _ string, epoch uint64) error {
	r.released <- epoch
	return nil
}

// A SUBSCRIBE read from a connection before a newer connection took its
// session over, and handled after, changes nothing of the session: the
// newer connection's subscription of the same filter keeps the options it
// was granted (here QoS 0, not the stale QoS 1), and a filter only the
// stale SUBSCRIBE names is not added. What that SUBSCRIBE added while its
// connection still held the session stays, as any subscription made
// before the takeover does.
func TestBroker_StaleSubscribeLeavesTheSessionAlone(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	routes, open := holdRouteAdd(t, b, "stale/first")

	old := mqtttest.Dial(t, addr, 5)
	old.Connect("stale", false, persistentSession)
	old.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: 1,
		Filters: packets.Subscriptions{{Filter: "stale/first", Qos: 1}, {Filter: "stale/second", Qos: 1}, {Filter: "stale/never", Qos: 1}}})
	routes.waitEntered(t, "stale/first")

	// A newer connection takes the session over while the old one's
	// SUBSCRIBE waits on its first route, and subscribes at QoS 0.
	newer := mqtttest.Dial(t, addr, 5)
	newer.Connect("stale", false, persistentSession)
	require.Equal(t, []byte{0}, newer.Subscribe(1, "stale/second", 0).ReasonCodes)
	routes.waitEntered(t, "stale/second")
	routes.waitReturned(t, "stale/second")

	open() // the old connection's SUBSCRIBE goes on
	require.Eventually(t, func() bool {
		return promtestutil.ToFloat64(b.m.disconnects.WithLabelValues("taken_over")) == 1
	}, 5*time.Second, 10*time.Millisecond, "the old connection's SUBSCRIBE was handled and its connection ended")

	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "stale/never", 1, []byte("not subscribed"))
	pub.Expect(packets.Puback)
	pub.Publish(2, "stale/second", 1, []byte("second"))
	pub.Expect(packets.Puback)
	got := newer.Expect(packets.Publish)
	require.Equal(t, "stale/second", got.TopicName, "nothing on a filter only the stale SUBSCRIBE named")
	require.Equal(t, byte(0), got.FixedHeader.Qos, "at the QoS the newer connection was granted")

	s := b.session(b.mustScope(t, "default").ClientID("stale"))
	require.NotNil(t, s)
	require.EqualValues(t, 2, s.nsubs.Load(), "stale/first, from before the takeover, and stale/second")
	for _, f := range []string{"stale/first", "stale/second", "stale/never"} {
		n, unheld := routes.state(f)
		want := 1
		if f == "stale/never" {
			want = 0
		}
		require.Equal(t, want, n, f)
		require.Zero(t, unheld)
	}
}

// blockingRemove is countingRoutes whose removals of one filter wait for
// release.
type blockingRemove struct {
	*countingRoutes
	filter  string
	entered chan struct{}
	release <-chan struct{}
}

func (r *blockingRemove) Remove(ctx context.Context, tenant, filter, group string) error {
	if filter == r.filter {
		r.entered <- struct{}{}
		<-r.release
	}
	return r.countingRoutes.Remove(ctx, tenant, filter, group)
}

// An UNSUBSCRIBE read from a connection before a newer connection took its
// session over, and handled after, does not remove the newer connection's
// subscription of a filter it names.
func TestBroker_StaleUnsubscribeLeavesTheSessionAlone(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	release := make(chan struct{})
	open := sync.OnceFunc(func() { close(release) })
	t.Cleanup(open)
	routes := &blockingRemove{countingRoutes: newCountingRoutes(func(string, int) (<-chan struct{}, error) { return nil, nil }),
		filter: "stale/a", entered: make(chan struct{}, 1), release: release}
	b.SetCluster(Cluster{Routes: routes})

	old := mqtttest.Dial(t, addr, 5)
	old.Connect("unsub", false, persistentSession)
	old.Subscribe(1, "stale/a", 1)
	old.Subscribe(2, "stale/b", 1)
	old.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Unsubscribe, Qos: 1}, PacketID: 3,
		Filters: packets.Subscriptions{{Filter: "stale/a"}, {Filter: "stale/b"}}})
	select {
	case <-routes.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("no removal of stale/a")
	}

	newer := mqtttest.Dial(t, addr, 5)
	newer.Connect("unsub", false, persistentSession)
	require.Equal(t, []byte{1}, newer.Subscribe(1, "stale/b", 1).ReasonCodes)
	open() // the old connection's UNSUBSCRIBE goes on
	require.Eventually(t, func() bool {
		return promtestutil.ToFloat64(b.m.disconnects.WithLabelValues("taken_over")) == 1
	}, 5*time.Second, 10*time.Millisecond, "the old connection's UNSUBSCRIBE was handled and its connection ended")

	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "stale/b", 1, []byte("b"))
	pub.Expect(packets.Puback)
	require.Equal(t, "stale/b", newer.Expect(packets.Publish).TopicName, "the newer connection's subscription stands")
	n, unheld := routes.state("stale/b")
	require.Equal(t, 1, n)
	require.Zero(t, unheld)
}

// A SUBSCRIBE whose route is refused after a newer connection took the
// session over (or, starting clean, replaced it) and subscribed the same
// filter leaves mochi's record of the filter, which is keyed by client ID
// and is the newer connection's now: removed, the newer connection's
// UNSUBSCRIBE would be answered "no subscription existed" (0x11) for a
// subscription it was granted.
func TestBroker_RefusedStaleSubscribeLeavesTheNewerConnectionsRecord(t *testing.T) {
	for _, clean := range []bool{false, true} {
		t.Run(fmt.Sprintf("clean=%v", clean), func(t *testing.T) {
			t.Parallel()
			b, addr := startBroker(t, nil)
			release := make(chan struct{})
			open := sync.OnceFunc(func() { close(release) })
			t.Cleanup(open)
			routes := newCountingRoutes(func(_ string, call int) (<-chan struct{}, error) {
				if call == 1 {
					return release, fmt.Errorf("%w: injected", ErrRouteRefused)
				}
				return nil, nil
			})
			b.SetCluster(Cluster{Routes: routes})

			old := mqtttest.Dial(t, addr, 5)
			old.Connect("record", false, persistentSession)
			sendSubscribe(old, 1, "record/x")
			routes.waitEntered(t, "record/x")
			newer := mqtttest.Dial(t, addr, 5)
			newer.Connect("record", clean, persistentSession)
			require.Equal(t, []byte{1}, newer.Subscribe(1, "record/x", 1).ReasonCodes)
			routes.waitEntered(t, "record/x")
			routes.waitReturned(t, "record/x")

			open() // the old connection's Add is refused
			routes.waitReturned(t, "record/x")
			require.Eventually(t, func() bool {
				return promtestutil.ToFloat64(b.m.disconnects.WithLabelValues("taken_over")) == 1
			}, 5*time.Second, 10*time.Millisecond, "the old connection's SUBSCRIBE was handled and its connection ended")

			newer.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Unsubscribe, Qos: 1}, PacketID: 2,
				Filters: packets.Subscriptions{{Filter: "record/x"}}})
			require.Equal(t, []byte{packets.CodeSuccess.Code}, newer.Expect(packets.Unsuback).ReasonCodes,
				"the granted subscription existed")
			n, unheld := routes.state("record/x")
			require.Zero(t, n)
			require.Zero(t, unheld)
		})
	}
}

// A stored subscription whose route the router refused (restored from the
// edge's store when it joined a cluster), dropped by a replacement that
// fails too, leaves no record in the store: kept there, it came back on
// the session's next load, though the client was told its SUBSCRIBE
// failed and the session had let the subscription go.
func TestBroker_FailedReplacementOfAnUnroutedSubscriptionLeavesNoRecord(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	_, addr, stop := openDurable(t, dir)
	c := mqtttest.Dial(t, addr, 5)
	c.Connect("unrouted", false, persistentSession)
	require.Equal(t, []byte{1}, c.Subscribe(1, "unrouted/x", 1).ReasonCodes)
	_ = c.Conn.Close()
	stop()

	// Joining a cluster whose router refuses the filter: restored, stored,
	// and not routed.
	routes := newCountingRoutes(func(string, int) (<-chan struct{}, error) {
		return nil, fmt.Errorf("%w: injected", ErrRouteRefused)
	})
	b, addr, stop := openDurableWith(t, dir, func(b *Broker) { b.SetCluster(Cluster{Routes: routes}) })
	id := b.mustScope(t, "default").ClientID("unrouted")
	c = mqtttest.Dial(t, addr, 5)
	require.True(t, c.Connect("unrouted", false, persistentSession).SessionPresent)
	require.Equal(t, []byte{packets.ErrUnspecifiedError.Code}, c.Subscribe(2, "unrouted/x", 1).ReasonCodes)
	require.Zero(t, b.session(id).nsubs.Load(), "the session let the subscription go")
	st, ok, err := b.store.LoadSession(t.Context(), id)
	require.NoError(t, err)
	require.True(t, ok)
	require.Empty(t, st.Subs, "and so does its stored state")
	_ = c.Conn.Close()
	stop()

	b, _, stop = openDurable(t, dir)
	t.Cleanup(stop)
	require.Zero(t, b.session(id).nsubs.Load(), "it does not come back")
}

// lockRefs is how many hold or wait for the claim lock of id.
func lockRefs(b *Broker, id string) int {
	b.claiming.mu.Lock()
	defer b.claiming.mu.Unlock()
	if sl := b.claiming.byID[id]; sl != nil {
		return sl.refs
	}
	return 0
}

// connectAs sends a CONNECT of id that resumes its session and expires
// with the connection (MQTT 5, no session expiry).
func connectAs(t *testing.T, addr, id string) *mqtttest.Client {
	c := mqtttest.Dial(t, addr, 5)
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), ClientIdentifier: id, Keepalive: 30}})
	return c
}

// The session copy of a connection that gave up before its CONNACK, and
// that expires with it, is left to a newer CONNECT of the client that is
// in flight then; when that CONNECT is refused, the copy ends after all
// (and its claim is given back), rather than stay with nobody to end it.
func TestBroker_AbandonedCopyEndsWhenTheNewerConnectIsRefused(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	var calls atomic.Int32
	claimedA, gateA, claimedC, gateC := make(chan struct{}), make(chan struct{}), make(chan struct{}), make(chan struct{})
	openA, openC := sync.OnceFunc(func() { close(gateA) }), sync.OnceFunc(func() { close(gateC) })
	t.Cleanup(openA)
	t.Cleanup(openC)
	unavailable := errors.New("coordinator unavailable")
	own := &releaseRecorder{fakeOwnership: fakeOwnership{claim: func(string, string) (uint64, string, error) {
		switch calls.Add(1) {
		case 1: // the session's first connection
			return 1, "", nil
		case 2: // A, which gives up
			close(claimedA)
			<-gateA
			return 2, "", nil
		case 3: // C, refused while A's end waits for the claim lock
			close(claimedC)
			<-gateC
			return 0, "", unavailable
		}
		return 0, "", unavailable // B, in flight when A's end runs, refused
	}}, released: make(chan uint64, 8)}
	b.SetCluster(Cluster{Routes: &fakeRoutes{add: func(string, string, string) error { return nil }}, Ownership: own})
	id := b.mustScope(t, "default").ClientID("gives-up")

	first := mqtttest.Dial(t, addr, 5)
	first.Connect("gives-up", false, persistentSession)
	first.Subscribe(1, "gives-up/#", 1)
	first.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	require.Eventually(t, func() bool { s := b.session(id); return s != nil && !s.online.Load() }, 5*time.Second, 10*time.Millisecond)

	// A resumes the session, expiring with its connection, and resets it
	// while its claim waits, so that its CONNACK is not written.
	a := connectAs(t, addr, "gives-up")
	<-claimedA
	require.NoError(t, a.Conn.(*net.TCPConn).SetLinger(0))
	require.NoError(t, a.Conn.Close())
	c := connectAs(t, addr, "gives-up")
	require.Eventually(t, func() bool { return lockRefs(b, id) == 2 }, 5*time.Second, time.Millisecond, "C waits for A's claim")
	openA()
	<-claimedC
	require.Eventually(t, func() bool { return lockRefs(b, id) == 2 }, 5*time.Second, time.Millisecond, "A's end waits for C's claim")
	bb := connectAs(t, addr, "gives-up")
	require.Eventually(t, func() bool { return lockRefs(b, id) == 3 }, 5*time.Second, time.Millisecond, "B waits behind A's end")
	openC()
	require.Equal(t, packets.ErrServerUnavailable.Code, c.Expect(packets.Connack).ReasonCode)
	require.Equal(t, packets.ErrServerUnavailable.Code, bb.Expect(packets.Connack).ReasonCode)

	require.Eventually(t, func() bool { return b.session(id) == nil }, 5*time.Second, 10*time.Millisecond,
		"the copy A resumed ends once no newer CONNECT is in flight")
	select {
	case e := <-own.released:
		require.Equal(t, uint64(2), e, "given back under A's claim")
	case <-time.After(5 * time.Second):
		t.Fatal("the ended session's claim was not given back")
	}
}

// subRecordWrites is a real durable store that fails the first write of a
// subscription record and counts every write of one.
type subRecordWrites struct {
	*durable.Store
	failed atomic.Bool
	writes atomic.Int32
}

func (s *subRecordWrites) PutSubscription(ctx context.Context, id string, sub durable.Subscription) error {
	defer s.writes.Add(1)
	if s.failed.CompareAndSwap(false, true) {
		return errors.New("injected store failure")
	}
	return s.Store.PutSubscription(ctx, id, sub)
}

func (s *subRecordWrites) DeleteSubscription(ctx context.Context, id, filter string) error {
	defer s.writes.Add(1)
	return s.Store.DeleteSubscription(ctx, id, filter)
}

// A SUBSCRIBE whose record the store did not keep takes its filter's
// record out of the store only while the session holds no subscription of
// it: a newer connection of the session that subscribed the same filter
// while the failed one was removing its route keeps its stored record,
// and with it its subscription when the session is next loaded (after a
// restart, or on the edge that takes it over).
func TestBroker_FailedSubscribeLeavesTheNewerConnectionsStoredRecord(t *testing.T) {
	t.Parallel()
	st := &subRecordWrites{}
	b, _ := brokerOnStore(t, func(ds *durable.Store) DurableState { st.Store = ds; return st })
	addr := serveTCP(t, b)
	release := make(chan struct{})
	open := sync.OnceFunc(func() { close(release) })
	t.Cleanup(open)
	routes := &blockingRemove{countingRoutes: newCountingRoutes(func(string, int) (<-chan struct{}, error) { return nil, nil }),
		filter: "rec/x", entered: make(chan struct{}, 1), release: release}
	b.SetCluster(Cluster{Routes: routes})
	id := b.mustScope(t, "default").ClientID("rec")

	old := mqtttest.Dial(t, addr, 5)
	old.Connect("rec", false, persistentSession)
	sendSubscribe(old, 1, "rec/x") // routed, not stored: undone
	select {
	case <-routes.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the failed SUBSCRIBE did not remove its route")
	}

	newer := mqtttest.Dial(t, addr, 5)
	newer.Connect("rec", false, persistentSession)
	require.Equal(t, []byte{1}, newer.Subscribe(1, "rec/x", 1).ReasonCodes)
	open() // the failed SUBSCRIBE goes on to its record
	require.Eventually(t, func() bool { return st.writes.Load() >= 3 }, 5*time.Second, 5*time.Millisecond,
		"the failed SUBSCRIBE's write of its filter's record")
	stored, ok, err := b.store.LoadSession(t.Context(), id)
	require.NoError(t, err)
	require.True(t, ok)
	require.Len(t, stored.Subs, 1, "the newer connection's subscription is stored")
	require.Equal(t, b.mustScope(t, "default").Topic("rec/x"), stored.Subs[0].Filter)
}

// sessionPutGate is a real durable store whose PutSession waits, while
// hold is set, until release is closed.
type sessionPutGate struct {
	*durable.Store
	hold    atomic.Bool
	entered chan struct{}
	release chan struct{}
}

func (s *sessionPutGate) PutSession(ctx context.Context, rec durable.Session) error {
	if s.hold.Load() {
		s.entered <- struct{}{}
		<-s.release
	}
	return s.Store.PutSession(ctx, rec)
}

// abandonedLeft reports whether an abandoned connection's copy of id is
// left to a CONNECT in flight.
func abandonedLeft(b *Broker, id string) bool {
	b.claims.mu.Lock()
	defer b.claims.mu.Unlock()
	_, ok := b.claims.abandoned[id]
	return ok
}

// An abandoned connection whose end comes after a newer CONNECT of its
// client took the claim, but before that CONNECT bound the session (its
// session record being stored, its CONNACK not yet written), leaves the
// copy to that CONNECT, which binds it: nothing of the abandoned
// connection stays behind once it has (the record held its client and
// connection for good).
func TestBroker_AbandonedCopyLeftToABindingConnectIsTakenOn(t *testing.T) {
	t.Parallel()
	gate := &sessionPutGate{entered: make(chan struct{}, 1), release: make(chan struct{})}
	b, _ := brokerOnStore(t, func(st *durable.Store) DurableState { gate.Store = st; return gate })
	open := sync.OnceFunc(func() { close(gate.release) })
	t.Cleanup(open)
	addr := serveTCP(t, b)
	var calls atomic.Int32
	claimedA, gateA := make(chan struct{}), make(chan struct{})
	openA := sync.OnceFunc(func() { close(gateA) })
	t.Cleanup(openA)
	b.SetCluster(Cluster{Routes: &fakeRoutes{add: func(string, string, string) error { return nil }},
		Ownership: fakeOwnership{claim: func(string, string) (uint64, string, error) {
			switch n := calls.Add(1); n {
			case 1: // the session's first connection
				return 1, "", nil
			case 2: // A, which gives up
				close(claimedA)
				<-gateA
				return 2, "", nil
			default: // B
				return uint64(n), "", nil
			}
		}}})
	id := b.mustScope(t, "default").ClientID("left")

	first := mqtttest.Dial(t, addr, 5)
	first.Connect("left", false, persistentSession)
	first.Subscribe(1, "left/#", 1)
	first.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	require.Eventually(t, func() bool { s := b.session(id); return s != nil && !s.online.Load() }, 5*time.Second, 10*time.Millisecond)

	// A resumes the session, expiring with its connection, and resets it
	// while its claim waits; B waits behind A's claim.
	a := connectAs(t, addr, "left")
	<-claimedA
	require.NoError(t, a.Conn.(*net.TCPConn).SetLinger(0))
	require.NoError(t, a.Conn.Close())
	gate.hold.Store(true)
	bb := mqtttest.Dial(t, addr, 5)
	bb.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, Properties: persistentSession,
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), ClientIdentifier: "left", Keepalive: 30}})
	require.Eventually(t, func() bool { return lockRefs(b, id) == 2 }, 5*time.Second, time.Millisecond, "B waits for A's claim")
	openA()
	// B took the claim and stores its session record; A's end comes.
	select {
	case <-gate.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("B did not store its session")
	}
	require.Eventually(t, func() bool { return abandonedLeft(b, id) }, 5*time.Second, time.Millisecond,
		"A's end leaves the copy to B, in flight")
	open()
	require.Equal(t, packets.CodeSuccess.Code, bb.Expect(packets.Connack).ReasonCode)
	waitBound(t, b, id)
	require.Eventually(t, func() bool { return !abandonedLeft(b, id) }, 2*time.Second, 10*time.Millisecond,
		"B, bound, took the copy on: nothing of A stays")
	require.NotNil(t, b.session(id), "the session goes on with B")
}

// A SUBSCRIBE read from a connection before a newer connection took its
// session over, and handled after, leaves no record in mochi of a filter
// it alone named: mochi keys its records by client ID, so the newer
// connection's UNSUBSCRIBE of that filter, which it never subscribed, was
// answered "success" rather than "no subscription existed" (0x11).
func TestBroker_StaleSubscribeLeavesNoMochiRecord(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	routes, open := holdRouteAdd(t, b, "stale/first")

	old := mqtttest.Dial(t, addr, 5)
	old.Connect("stale", false, persistentSession)
	old.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: 1,
		Filters: packets.Subscriptions{{Filter: "stale/first", Qos: 1}, {Filter: "stale/never", Qos: 1}}})
	routes.waitEntered(t, "stale/first")
	newer := mqtttest.Dial(t, addr, 5)
	newer.Connect("stale", false, persistentSession)
	open()
	require.Eventually(t, func() bool {
		return promtestutil.ToFloat64(b.m.disconnects.WithLabelValues("taken_over")) == 1
	}, 5*time.Second, 10*time.Millisecond, "the old connection's SUBSCRIBE was handled and its connection ended")

	newer.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Unsubscribe, Qos: 1}, PacketID: 2,
		Filters: packets.Subscriptions{{Filter: "stale/never"}, {Filter: "stale/first"}}})
	require.Equal(t, []byte{packets.CodeNoSubscriptionExisted.Code, packets.CodeSuccess.Code}, newer.Expect(packets.Unsuback).ReasonCodes)
}

// mochi records a SUBSCRIBE's filter before the edge's hook runs, outside
// the session's lock. A failed SUBSCRIBE of an older connection that
// mirrors its session into mochi in that gap (the session holds nothing
// of the filter yet) takes the newer connection's fresh record out; the
// newer connection's SUBSCRIBE, going through, puts it back, so its
// UNSUBSCRIBE is answered "success", not 0x11. The gap is made here by
// taking mochi's step by hand.
func TestBroker_FailedSubscribeMirrorKeepsANewerRecord(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	b.SetCluster(Cluster{Routes: &fakeRoutes{add: func(string, string, string) error { return nil }}})
	sc := b.mustScope(t, "default")
	id := sc.ClientID("mirror")
	old := mqtttest.Dial(t, addr, 5)
	old.Connect("mirror", false, persistentSession)
	oldCl, ok := b.server.Clients.Get(id)
	require.True(t, ok)
	newer := mqtttest.Dial(t, addr, 5)
	newer.Connect("mirror", false, persistentSession)
	newCl, ok := b.server.Clients.Get(id)
	require.True(t, ok)
	require.NotSame(t, oldCl, newCl)
	// The session names the newer connection only once its CONNECT is
	// through the hook; until then its SUBSCRIBE would be the stale one.
	require.Eventually(t, func() bool {
		s := b.session(id)
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.client == newCl
	}, 5*time.Second, time.Millisecond)

	filter, _ := sc.Filter("mirror/x")
	sub := packets.Subscription{Filter: filter, Qos: 1}
	b.server.Topics.Subscribe(id, sub) // mochi's step of the newer connection's SUBSCRIBE
	newCl.State.Subscriptions.Add(filter, sub)
	b.mirrorSub(oldCl, filter) // the older connection's failed SUBSCRIBE
	codes := []byte{1}
	(&hook{b: b}).OnSubscribed(newCl, packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: 1,
		Filters: packets.Subscriptions{sub}}, codes)
	require.Equal(t, []byte{1}, codes)

	newer.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Unsubscribe, Qos: 1}, PacketID: 2,
		Filters: packets.Subscriptions{{Filter: "mirror/x"}}})
	require.Equal(t, []byte{packets.CodeSuccess.Code}, newer.Expect(packets.Unsuback).ReasonCodes, "the granted subscription existed")
}

// A SUBSCRIBE whose route was refused takes the record of its filter out
// of the store even when it never wrote one itself: another write of the
// filter's record may have written it meanwhile. Here an older
// connection's failed SUBSCRIBE of the same filter, putting its store in
// line after its route was removed, wrote the newer connection's record
// while that one's route Add was out; the Add is then refused, the client
// gets 0x80, and the record, kept, would bring the subscription back at
// the next load.
func TestBroker_RefusedSubscribeTakesOutARecordWrittenForIt(t *testing.T) {
	t.Parallel()
	st := &subRecordWrites{}
	b, _ := brokerOnStore(t, func(ds *durable.Store) DurableState { st.Store = ds; return st })
	addr := serveTCP(t, b)
	release, refuse := make(chan struct{}), make(chan struct{})
	open, refuseNow := sync.OnceFunc(func() { close(release) }), sync.OnceFunc(func() { close(refuse) })
	t.Cleanup(open)
	t.Cleanup(refuseNow)
	routes := &blockingRemove{countingRoutes: newCountingRoutes(func(_ string, call int) (<-chan struct{}, error) {
		if call == 2 {
			return refuse, ErrRouteRefused
		}
		return nil, nil
	}), filter: "rec/x", entered: make(chan struct{}, 1), release: release}
	b.SetCluster(Cluster{Routes: routes})
	id := b.mustScope(t, "default").ClientID("rec")

	old := mqtttest.Dial(t, addr, 5)
	old.Connect("rec", false, persistentSession)
	sendSubscribe(old, 1, "rec/x") // routed, not stored: undone
	routes.waitEntered(t, "rec/x")
	select {
	case <-routes.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the failed SUBSCRIBE did not remove its route")
	}

	newer := mqtttest.Dial(t, addr, 5)
	newer.Connect("rec", false, persistentSession)
	sendSubscribe(newer, 1, "rec/x")
	routes.waitEntered(t, "rec/x") // the newer SUBSCRIBE's Add is out
	open()                         // the failed SUBSCRIBE goes on to its record
	require.Eventually(t, func() bool { return st.writes.Load() >= 2 }, 5*time.Second, 5*time.Millisecond,
		"the failed SUBSCRIBE's write of its filter's record")
	refuseNow()
	require.Equal(t, []byte{packets.ErrUnspecifiedError.Code}, newer.Expect(packets.Suback).ReasonCodes)
	require.Eventually(t, func() bool {
		stored, ok, err := b.store.LoadSession(t.Context(), id)
		require.NoError(t, err)
		return ok && len(stored.Subs) == 0
	}, 5*time.Second, 5*time.Millisecond, "no record of a subscription the session does not hold")
}
