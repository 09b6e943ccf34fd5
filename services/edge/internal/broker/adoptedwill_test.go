package broker

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// A session this edge resumes from the shared store with no connection of
// its client (a takeover of it failed, and its previous owner died since:
// resumeOwned) keeps the will its last connection left there. That
// connection ended with its edge, without a DISCONNECT, and no client came
// back: the will goes out after its delay, as a custodian adopting the
// session would send it. No other edge sends it: the coordinator counts
// the session as owned here, so custody passes it by.
func TestBroker_SessionResumedWithNoConnectionPublishesItsStoredWill(t *testing.T) {
	t.Parallel()
	b, st := brokerOnStore(t, func(st *durable.Store) DurableState { return sharedLocal{st} })
	addr := serveTCP(t, b)
	b.SetCluster(Cluster{Routes: &fakeRoutes{add: func(string, string, string) error { return nil }}})
	sc := b.mustScope(t, "default")
	const client = "orphan"
	id := sc.ClientID(client)
	will := &Message{ID: MsgID{Edge: "edge-dead", Incarnation: 3, Seq: 7}, Topic: sc.Topic("gone/" + client), Payload: []byte("bye"), QoS: 1}
	require.NoError(t, st.PutSession(t.Context(), durable.Session{ID: id, ProtocolVersion: 5, ExpiryInterval: 300,
		Will: &durable.Will{Msg: will.record(), Delay: 1}}))

	watcher := willWatcher(t, addr, "gone/"+client)

	b.setUnfinished(id, unfinishedTakeover{previous: "edge-dead", epoch: 30, scope: sc, clientID: client})
	here, settled := b.resumeOwned(sc, client, 30, "edge-dead")
	require.True(t, here)
	require.True(t, settled)
	expectWillAfterItsDelay(t, watcher, st, id, "gone/"+client, "bye")
}

// waitWillWaiting waits until a will of session id waits for its delay
// (or for what ends the session) on b.
func waitWillWaiting(t *testing.T, b *Broker, id string) {
	t.Helper()
	testutil.Eventually(t, 5*time.Second, func() error {
		b.willMu.Lock()
		defer b.willMu.Unlock()
		if b.wills[id] == nil {
			return errors.New("no will waiting")
		}
		return nil
	})
}

// expectWillAfterItsDelay expects the will (topic, payload) of session id
// at watcher after a delay of about a second, not before, and then out of
// the session's stored record: out once, no custodian sends it again if
// this edge dies.
func expectWillAfterItsDelay(t *testing.T, watcher *mqtttest.Client, st *durable.Store, id, topic, payload string) {
	t.Helper()
	pk, err := watcher.Read(500 * time.Millisecond)
	require.Error(t, err, "the will went out before its delay: type %d, payload %q", pk.FixedHeader.Type, pk.Payload)
	pk = watcher.Expect(packets.Publish)
	require.Equal(t, topic, pk.TopicName)
	require.Equal(t, []byte(payload), pk.Payload)
	testutil.Eventually(t, 5*time.Second, func() error {
		got, ok, err := st.LoadSession(t.Context(), id)
		if err != nil || !ok {
			return fmt.Errorf("session record: ok %v, %v", ok, err)
		}
		if got.Session.Will != nil {
			return errors.New("the will is still in the stored record")
		}
		return nil
	})
}

// A will due at once, of a session adopted with no connection, may match
// the session's own subscriptions: it is published once the adopted
// copy's hold is released, or its delivery to the session would wait for
// the hold that the adoption, waiting for the delivery, never releases
// (and the client's claim lock with it).
func TestBroker_AdoptedWillDueAtOnceReachesItsOwnSession(t *testing.T) {
	t.Parallel()
	b, st := brokerOnStore(t, func(st *durable.Store) DurableState { return sharedLocal{st} })
	serveTCP(t, b)
	b.SetCluster(Cluster{Routes: &fakeRoutes{add: func(string, string, string) error { return nil }}})
	sc := b.mustScope(t, "default")
	const client = "self-subscribed"
	id := sc.ClientID(client)
	will := &Message{ID: MsgID{Edge: "edge-dead", Incarnation: 3, Seq: 8}, Topic: sc.Topic("gone/" + client), Payload: []byte("bye"), QoS: 1}
	require.NoError(t, st.PutSession(t.Context(), durable.Session{ID: id, ProtocolVersion: 5, ExpiryInterval: 300,
		Will: &durable.Will{Msg: will.record()}}))
	require.NoError(t, st.PutSubscription(t.Context(), id, durable.Subscription{Filter: sc.Topic("gone/#"), QoS: 1}))
	b.setUnfinished(id, unfinishedTakeover{previous: "edge-dead", epoch: 30, scope: sc, clientID: client})
	done := make(chan struct{})
	go func() { b.resumeOwned(sc, client, 30, "edge-dead"); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the adoption waits for the delivery of its own will")
	}
	s := b.session(id)
	require.NotNil(t, s)
	testutil.Eventually(t, 3*time.Second, func() error {
		s.mu.Lock()
		defer s.mu.Unlock()
		if n := s.queue.len(); n != 1 {
			return fmt.Errorf("%d queued for the session", n)
		}
		return nil
	})
}

// A session adopted from a draining edge, its client disconnected without
// a DISCONNECT and its will waiting for its delay there, keeps the will:
// the draining edge voids it as the session leaves, so the adopting edge,
// which gets no connection with the session, sends it when the delay has
// passed, unless the client comes back first. A rolling restart must not
// lose it.
func TestBroker_SessionAdoptedFromADrainingEdgeKeepsItsWill(t *testing.T) {
	t.Parallel()
	const client = "drained"
	b, st, watcher := adoptFromDrainingEdge(t, client, time.Time{}, 300, 1)
	expectWillAfterItsDelay(t, watcher, st, b.mustScope(t, "default").ClientID(client), "gone/"+client, "bye")
}

// adoptFromDrainingEdge has a new edge adopt, with no connection, the
// session of client as a draining edge hands it over: Session Expiry
// expiry, a will ("bye" on gone/<client>) of delay willDelay, and the end
// of its last connection (zero: not known). A watcher subscribes to the
// will's topic first.
func adoptFromDrainingEdge(t *testing.T, client string, ended time.Time, expiry, willDelay uint32) (*Broker, *durable.Store, *mqtttest.Client) {
	t.Helper()
	b, st, addr := servingOnSharedStore(t)
	sc := b.mustScope(t, "default")
	id := sc.ClientID(client)
	will := &Message{ID: MsgID{Edge: "draining", Incarnation: 2, Seq: 5}, Topic: sc.Topic("gone/" + client), Payload: []byte("bye"), QoS: 1}
	rec := durable.Session{ID: id, ProtocolVersion: 5, ExpiryInterval: expiry, Will: &durable.Will{Msg: will.record(), Delay: willDelay}}
	if !ended.IsZero() {
		rec.Disconnected = ended.UnixNano()
	}
	require.NoError(t, st.PutSession(t.Context(), rec))
	state, err := durable.EncodeTransfer(durable.SessionState{Session: rec})
	require.NoError(t, err)
	watcher := willWatcher(t, addr, "gone/"+client) // before the cluster: its CONNECT claims nothing
	tk := &scriptedTakeover{begin: func(uint64) ([]byte, error) { return state, nil }}
	b.SetCluster(Cluster{Routes: &fakeRoutes{add: func(string, string, string) error { return nil }}, Takeover: tk,
		Ownership: grantsInOrder([]Grant{{Epoch: 9, Previous: "draining"}})})

	adopted, err := b.Adopt(t.Context(), "default", client, "draining")
	require.NoError(t, err)
	require.True(t, adopted)
	require.NotNil(t, b.session(id))
	return b, st, watcher
}

// A session handed to another edge carries the will of its last
// connection only when that will was waiting for its delay (the
// connection gone without a DISCONNECT): a new owner with no connection
// (a drain's adopter) sends it then; so does a will of a connection a
// drain closed (TestBroker_DrainedConnectionsWillFollowsTheServersClose).
// The will of a connection that was live at the handover, closed by the
// takeover, is void: the client came back elsewhere. A will due while the
// edge stops (drains) waits for the handover, and goes on with the
// session as a waiting one does.
func TestBroker_HandoverCarriesOnlyAWaitingWill(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		gone     bool // the client's connection ended before the handover
		stopping bool // the edge stops (drains), and the will's delay passes before the handover
		carried  bool
	}{
		{"connected", false, false, false},
		{"gone_with_its_will_waiting", true, false, true},
		{"due_while_the_edge_stops", true, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b, _, addr := servingOnSharedStore(t)
			client := "handed-" + tc.name
			id := b.mustScope(t, "default").ClientID(client)
			watcher := willWatcher(t, addr, "gone/"+client)
			delay := uint32(60)
			if tc.stopping {
				delay = 1
			}
			c := connectWithWill(t, addr, 5, client, "gone/"+client, false, persistentSession, delay)
			epoch := waitBound(t, b, id)
			if tc.gone {
				_ = c.Conn.Close()
				waitWillWaiting(t, b, id)
			}
			if tc.stopping {
				b.stopping.Store(true)
				time.Sleep(time.Duration(delay)*time.Second + 500*time.Millisecond)
			}
			owned, _, state, err := b.TakeOver(t.Context(), "default", client, "edge-new", epoch+1, false)
			require.NoError(t, err)
			require.True(t, owned)
			st, err := durable.DecodeTransfer(state)
			require.NoError(t, err)
			require.Equal(t, tc.carried, st.Session.Will != nil, "will in the handed-over record")
			pk, err := watcher.Read(time.Second)
			require.Error(t, err, "a will went out from the edge that handed the session over: type %d, payload %q", pk.FixedHeader.Type, pk.Payload)
		})
	}
}

// A session handed over offline (a drain) carries when its connection
// ended, and the adopting edge counts the session's expiry and its will's
// delay from then: handed from edge to edge in a rolling restart, a
// session of Session Expiry 60 would otherwise live for 60 s after the
// last hand-over, and its will wait its delay again at every one
// ([MQTT-3.1.3-9], §3.1.2.11.2).
func TestBroker_SessionHandedOverOfflineCountsFromItsConnectionsEnd(t *testing.T) {
	t.Parallel()
	t.Run("the_handover_carries_the_end", func(t *testing.T) {
		t.Parallel()
		b, _, addr := servingOnSharedStore(t)
		const client = "went"
		id := b.mustScope(t, "default").ClientID(client)
		c := connectWithWill(t, addr, 5, client, "gone/"+client, false, persistentSession, 60)
		epoch := waitBound(t, b, id)
		closed := time.Now()
		_ = c.Conn.Close()
		waitWillWaiting(t, b, id) // the connection's end is seen
		time.Sleep(300 * time.Millisecond)
		_, _, state, err := b.TakeOver(t.Context(), "default", client, "edge-new", epoch+1, false)
		require.NoError(t, err)
		st, err := durable.DecodeTransfer(state)
		require.NoError(t, err)
		require.WithinDuration(t, closed, st.Session.DisconnectedAt(), 200*time.Millisecond,
			"the handed-over record says when the connection ended, not when it was handed over")
	})
	t.Run("a_connected_session_carries_none", func(t *testing.T) {
		t.Parallel()
		b, _, addr := servingOnSharedStore(t)
		const client = "here"
		id := b.mustScope(t, "default").ClientID(client)
		connectWithWill(t, addr, 5, client, "gone/"+client, false, persistentSession, 60)
		epoch := waitBound(t, b, id)
		_, _, state, err := b.TakeOver(t.Context(), "default", client, "edge-new", epoch+1, false)
		require.NoError(t, err)
		st, err := durable.DecodeTransfer(state)
		require.NoError(t, err)
		require.Zero(t, st.Session.Disconnected, "the new owner's connection takes the session on")
	})
	t.Run("the_adopter_counts_from_it", func(t *testing.T) {
		t.Parallel()
		const client = "drained-long-ago"
		ended := time.Now().Add(-1500 * time.Millisecond)
		b, _, watcher := adoptFromDrainingEdge(t, client, ended, 2, 60)
		cl, ok := b.server.Clients.Get(b.mustScope(t, "default").ClientID(client))
		require.True(t, ok)
		require.WithinDuration(t, ended, cl.StoppedAt(), 100*time.Millisecond, "the session's expiry counts from its connection's end")
		// The will waits for the session's end (Session Expiry 2 < its
		// delay of 60), which is half a second away, not two seconds.
		pk, err := watcher.Read(1200 * time.Millisecond)
		require.NoError(t, err, "no will within the session's remaining expiry")
		require.Equal(t, packets.Publish, pk.FixedHeader.Type)
		require.Equal(t, []byte("bye"), pk.Payload)
		require.WithinDuration(t, ended.Add(2*time.Second), time.Now(), 700*time.Millisecond)
	})
	t.Run("the_will_waits_what_is_left_of_its_delay", func(t *testing.T) {
		t.Parallel()
		const client = "will-half-waited"
		ended := time.Now().Add(-1500 * time.Millisecond)
		b, _, watcher := adoptFromDrainingEdge(t, client, ended, 300, 2)
		pk, err := watcher.Read(1200 * time.Millisecond)
		require.NoError(t, err, "no will within what was left of its delay")
		require.Equal(t, []byte("bye"), pk.Payload)
		require.WithinDuration(t, ended.Add(2*time.Second), time.Now(), 700*time.Millisecond)
		require.NotNil(t, b.session(b.mustScope(t, "default").ClientID(client)), "the session goes on: only its will's delay has passed")
	})
}

// A draining edge of a cluster is a member still, and routes: a session
// that ends on it during the drain publishes the will of its last
// connection from there, for no handover carries a session that ended,
// and the end removes the stored record that holds the will. It ends so
// when its expiry passes (mochi's tick, or the custodian's takeover
// finding it expired), or when its client starts clean on another edge.
// The will goes out once, and leaves the store.
func TestBroker_SessionEndingOnADrainingEdgePublishesItsWill(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		end  func(t *testing.T, b *Broker, client string, epoch uint64)
	}{
		{"expired", func(t *testing.T, b *Broker, client string, epoch uint64) {
			time.Sleep(1200 * time.Millisecond) // past the session's expiry of 1 s
			// The custodian's takeover finds it expired, if mochi's tick
			// has not ended it yet.
			_, _, state, err := b.TakeOver(t.Context(), "default", client, "edge-custodian", epoch+1, false)
			require.NoError(t, err)
			require.Empty(t, state, "an expired session is handed over")
		}},
		{"clean_start_elsewhere", func(t *testing.T, b *Broker, client string, epoch uint64) {
			owned, _, state, err := b.TakeOver(t.Context(), "default", client, "edge-new", epoch+1, true)
			require.NoError(t, err)
			require.True(t, owned)
			require.Empty(t, state)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b, st, addr := servingOnSharedStore(t)
			client := "ending-" + tc.name
			id := b.mustScope(t, "default").ClientID(client)
			watcher := willWatcher(t, addr, "will/"+client)
			c := connectExpiringWithWill(t, addr, client, 1, 60, 1)
			epoch := waitBound(t, b, id)
			_ = c.Conn.Close()
			waitWillWaiting(t, b, id)
			// The drain has begun; the watcher stays connected to see
			// what the edge publishes.
			b.draining.Store(true)
			b.stopping.Store(true)
			tc.end(t, b, client, epoch)

			pk := watcher.Expect(packets.Publish)
			require.Equal(t, "will/"+client, pk.TopicName)
			require.Equal(t, []byte(client), pk.Payload)
			watcher.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
			pk, err := watcher.Read(1500 * time.Millisecond)
			require.Error(t, err, "a second will: type %d, payload %q", pk.FixedHeader.Type, pk.Payload)
			testutil.Eventually(t, 5*time.Second, func() error {
				if _, ok, err := st.LoadSession(t.Context(), id); err != nil || ok {
					return fmt.Errorf("the ended session's record is still stored (%v)", err)
				}
				return nil
			})
		})
	}
}

// A drain closes its connections as a server does, and their wills follow
// [MQTT-3.1.2-8]. A will with no delay goes out from the draining edge at
// once, although the session goes on with a custodian, and leaves the
// stored record: the handover does not carry it for the custodian to send
// again. A will with a delay waits for it, and the handover carries it
// with the time the drain closed the connection, from which the custodian
// counts the delay (TestBroker_SessionHandedOverOfflineCountsFromItsConnectionsEnd).
func TestBroker_DrainedConnectionsWillFollowsTheServersClose(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		delay uint32
	}{{"no_delay", 0}, {"delayed", 60}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b, st, addr := servingOnSharedStore(t)
			client := "drained-" + tc.name
			id := b.mustScope(t, "default").ClientID(client)
			watcher := willWatcher(t, addr, "gone/"+client) // stays connected: only the client is drained
			connectWithWill(t, addr, 5, client, "gone/"+client, false, persistentSession, tc.delay)
			epoch := waitBound(t, b, id)
			cl, ok := b.server.Clients.Get(id)
			require.True(t, ok)
			b.draining.Store(true)
			b.stopping.Store(true)
			closed := time.Now()
			b.disconnectDraining(cl, "")
			if tc.delay == 0 {
				pk := watcher.Expect(packets.Publish)
				require.Equal(t, "gone/"+client, pk.TopicName)
				require.Equal(t, []byte(client), pk.Payload)
				watcher.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
				testutil.Eventually(t, 5*time.Second, func() error {
					got, ok, err := st.LoadSession(t.Context(), id)
					if err != nil || !ok || got.Session.Will != nil {
						return fmt.Errorf("the session's record still holds the will, or is gone (ok %v, %v)", ok, err)
					}
					return nil
				})
			} else {
				waitWillWaiting(t, b, id)
			}
			_, _, state, err := b.TakeOver(t.Context(), "default", client, "edge-custodian", epoch+1, false)
			require.NoError(t, err)
			handed, err := durable.DecodeTransfer(state)
			require.NoError(t, err)
			require.Equal(t, tc.delay > 0, handed.Session.Will != nil, "the will in the handed-over record")
			if tc.delay > 0 {
				require.WithinDuration(t, closed, handed.Session.DisconnectedAt(), drainWriteWait,
					"the custodian counts the will's delay from the drain's close")
			}
			pk, err := watcher.Read(time.Second)
			require.Error(t, err, "a will went out from the draining edge (again): type %d, payload %q", pk.FixedHeader.Type, pk.Payload)
		})
	}
}

// willCheckingCustody accepts every handover, noting whether the will of
// session id was waiting here when the handover was asked for.
type willCheckingCustody struct {
	b       *Broker
	id      string
	calls   atomic.Int32
	waiting atomic.Bool
}

func (c *willCheckingCustody) Handover(context.Context, string, string) error {
	c.b.willMu.Lock()
	c.waiting.Store(c.b.wills[c.id] != nil)
	c.b.willMu.Unlock()
	c.calls.Add(1)
	return nil
}

// A drain hands a session over only once its connection's end decided the
// will: a session goes offline within that end, before the will is
// decided, and handed over in between it would leave without the will,
// which the end then parks with the move, where it is void.
func TestBroker_DrainHandsOverOnlyOnceTheConnectionsEndDecidedItsWill(t *testing.T) {
	t.Parallel()
	_, _, custody, releaseEnd, drained := drainWithEndHeld(t, "slow-end", drainOfflineWait)
	time.Sleep(300 * time.Millisecond)
	require.Zero(t, custody.calls.Load(), "the session was handed over before its connection's end decided its will")
	releaseEnd()
	select {
	case <-drained:
	case <-time.After(10 * time.Second):
		t.Fatal("the drain did not end")
	}
	require.Equal(t, int32(1), custody.calls.Load())
	require.True(t, custody.waiting.Load(), "the will was waiting for its delay, for the handover to carry, when the session was handed over")
}

// drainResult is what a drain reports.
type drainResult struct{ moved, stayed int }

// drainWithEndHeld serves an edge on a shared store whose custody notes
// its handovers, connects client (a persistent session, a will of delay
// 60 s), holds its connection's end at the will (holdEndAtWill) and
// drains with offlineWait: it returns once the drain closed the
// connection, with the drain's result to come on drained.
func drainWithEndHeld(t *testing.T, client string, offlineWait time.Duration) (b *Broker, st *durable.Store,
	custody *willCheckingCustody, releaseEnd func(), drained <-chan drainResult) {
	t.Helper()
	b, st, addr := servingOnSharedStore(t)
	b.offlineWait = offlineWait
	id := b.mustScope(t, "default").ClientID(client)
	custody = &willCheckingCustody{b: b, id: id}
	b.SetCluster(Cluster{Custody: custody})
	connectWithWill(t, addr, 5, client, "gone/"+client, false, persistentSession, 60)
	waitBound(t, b, id)
	entered, releaseEnd := holdEndAtWill(t, b, id)
	results := make(chan drainResult, 1)
	go func() {
		moved, stayed := b.DrainWith(context.Background(), DrainOptions{})
		results <- drainResult{moved, stayed}
	}()
	select {
	case <-entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the drain did not close the connection")
	}
	return b, st, custody, releaseEnd, results
}

// holdEndAtWill holds the end of session id's connection on b where it
// comes to the will, until releaseEnd; entered is closed once it got there.
func holdEndAtWill(t *testing.T, b *Broker, id string) (entered <-chan struct{}, releaseEnd func()) {
	t.Helper()
	in, release := make(chan struct{}), make(chan struct{})
	var enter, let sync.Once
	releaseEnd = func() { let.Do(func() { close(release) }) }
	t.Cleanup(releaseEnd) // before the broker's close, which waits for the end
	hold := func(cl *mqtt.Client) {
		if cl.ID == id {
			enter.Do(func() { close(in) })
			<-release
		}
	}
	b.atWill.Store(&hold)
	return in, releaseEnd
}

// A CONNECT admitted as a drain began (past the drain's check) is
// disconnected once established, as the drain's other clients were: the
// drain's disconnects may have missed it, and it would hold the drain's
// wait for every session to go offline until a handover closed it with
// 0x8E, its will void.
func TestBroker_ConnectEstablishedAsADrainBeganIsDisconnected(t *testing.T) {
	t.Parallel()
	b, _, addr := servingOnSharedStore(t)
	const client = "late"
	id := b.mustScope(t, "default").ClientID(client)
	ref := "elsewhere:1883"
	b.drainReference.Store(&ref)
	begin := func(got string) {
		if got == id {
			b.draining.Store(true) // the drain begins between the CONNECT's check and its bind
		}
	}
	b.atBind.Store(&begin)
	c := mqtttest.Dial(t, addr, 5)
	require.Equal(t, packets.CodeSuccess.Code, c.Connect(client, false, persistentSession).ReasonCode)
	pk := c.Expect(packets.Disconnect)
	require.Equal(t, packets.ErrUseAnotherServer.Code, pk.ReasonCode)
	require.Equal(t, ref, pk.Properties.ServerReference)
}

// A connection still open when an edge of a cluster stops (its drain's
// wait for the connections to end ran out, or the stop came without one)
// is closed by the server, and its will follows [MQTT-3.1.2-8]. The edge
// can send nothing then, so the will stays in the session's stored
// record, as if the edge had died: the custodian that adopts the session
// publishes it (at once for a session that ended with the connection,
// after its delay otherwise, unless the client came back first). Taken out
// of the record, nobody would send it.
func TestBroker_StopLeavesAnOpenConnectionsWillForTheCustodian(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		version byte
		clean   bool
		props   packets.Properties
		delay   uint32
	}{
		{"clean_session", 4, true, packets.Properties{}, 0},
		{"persistent_delayed", 5, false, persistentSession, 30},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b, st, addr := servingOnSharedStore(t)
			client := "open-at-stop-" + tc.name
			id := b.mustScope(t, "default").ClientID(client)
			connectWithWill(t, addr, tc.version, client, "gone/"+client, tc.clean, tc.props, tc.delay)
			waitBound(t, b, id)
			require.NoError(t, b.Close())

			rec := requireWillStored(t, st, id, client)
			require.Equal(t, tc.delay, rec.Will.Delay)
			require.Equal(t, tc.clean, rec.ExpiryInterval == 0, "the record says whether the session ended with its connection")
		})
	}
}

// A session whose connection's end has not decided the will when the
// drain's wait for the ends runs out is not handed over: it would leave
// without the will, void where it goes. It stays in the store, will
// included, for the custodian that adopts it once the edge is gone.
func TestBroker_DrainLeavesASessionWhoseConnectionHasNotEndedForCustody(t *testing.T) {
	t.Parallel()
	const client = "stuck-end"
	b, st, custody, releaseEnd, drained := drainWithEndHeld(t, client, 300*time.Millisecond)
	closedAt := time.Now()
	id := b.mustScope(t, "default").ClientID(client)
	var got drainResult
	select {
	case got = <-drained:
	case <-time.After(10 * time.Second):
		t.Fatal("the drain did not end")
	}
	require.Equal(t, drainResult{moved: 0, stayed: 1}, got)
	// The session that stays is not waited for as one that moved on.
	require.Less(t, time.Since(closedAt), drainHeldWait, "the drain waited for the session that stays")
	require.Zero(t, custody.calls.Load(), "the session was handed over before its connection's end decided its will")
	releaseEnd()
	require.NoError(t, b.Close())
	requireWillStored(t, st, id, client)
}

// A client that starts clean on another edge while this one stops ends
// its session here (TakeOver), but this edge can send its will no more:
// the stored record that holds the will stays, for the new owner to
// publish as it starts the session clean. Removed, nobody would send it.
func TestBroker_CleanStartElsewhereAsTheEdgeStopsLeavesTheWillStored(t *testing.T) {
	t.Parallel()
	b, st, addr := servingOnSharedStore(t)
	const client = "clean-elsewhere"
	id := b.mustScope(t, "default").ClientID(client)
	connectWithWill(t, addr, 5, client, "gone/"+client, false, persistentSession, 0)
	epoch := waitBound(t, b, id)
	b.stopping.Store(true) // a stop without a drain: wills are held back
	owned, _, state, err := b.TakeOver(t.Context(), "default", client, "edge-new", epoch+1, true)
	require.NoError(t, err)
	require.True(t, owned)
	require.Empty(t, state)
	testutil.Eventually(t, 5*time.Second, func() error {
		if b.session(id) != nil || b.disconnecting.Load() != 0 {
			return errors.New("the session or its connection's end is still here")
		}
		return nil
	})
	time.Sleep(200 * time.Millisecond) // a queued record removal, if any
	requireWillStored(t, st, id, client)
}

// requireWillStored requires session id's stored record to hold its
// will, of payload, and returns the record.
func requireWillStored(t *testing.T, st *durable.Store, id, payload string) durable.Session {
	t.Helper()
	got, ok, err := st.LoadSession(t.Context(), id)
	require.NoError(t, err)
	require.True(t, ok, "the session's record left the store")
	require.NotNil(t, got.Session.Will, "the will left the stored record")
	require.Equal(t, []byte(payload), got.Session.Will.Msg.Payload)
	return got.Session
}
