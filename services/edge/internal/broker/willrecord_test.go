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

// gatedRecords is a shared store that holds one session record write a
// test names: the putAt-th PutSession is stored, then held; the delAt-th
// DeleteSession that waits for its write is held before it is made. The
// hold closes entered and waits for open (at cleanup at the latest).
type gatedRecords struct {
	sharedLocal
	putAt, delAt int32
	puts, dels   atomic.Int32
	entered      chan struct{}
	release      chan struct{}
	open         func()
}

func newGatedRecords(t *testing.T, putAt, delAt int32) *gatedRecords {
	g := &gatedRecords{putAt: putAt, delAt: delAt, entered: make(chan struct{}), release: make(chan struct{})}
	g.open = sync.OnceFunc(func() { close(g.release) })
	t.Cleanup(g.open)
	return g
}

func (g *gatedRecords) PutSession(ctx context.Context, rec durable.Session) error {
	err := g.sharedLocal.PutSession(ctx, rec)
	if g.puts.Add(1) == g.putAt {
		close(g.entered)
		<-g.release
	}
	return err
}

func (g *gatedRecords) DeleteSession(ctx context.Context, id string, wait bool) error {
	if wait && g.dels.Add(1) == g.delAt {
		close(g.entered)
		<-g.release
	}
	return g.sharedLocal.DeleteSession(ctx, id, wait)
}

// recordGatedBroker is a broker serving MQTT on a shared store whose record
// writes g holds as newGatedRecords(t, putAt, delAt) says.
func recordGatedBroker(t *testing.T, putAt, delAt int32) (g *gatedRecords, b *Broker, st *durable.Store, addr string) {
	t.Helper()
	g = newGatedRecords(t, putAt, delAt)
	b, st = brokerOnStore(t, func(s *durable.Store) DurableState { g.sharedLocal = sharedLocal{s}; return g })
	return g, b, st, serveTCP(t, b)
}

// waitHeld waits for the store's hold.
func (g *gatedRecords) waitHeld(t *testing.T) {
	t.Helper()
	select {
	case <-g.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the record write to hold never came")
	}
}

// signalAtWill closes the returned channel when the end of the connection
// of the internal client ID id comes to its will (OnDisconnect), without
// holding it.
func signalAtWill(b *Broker, id string) <-chan struct{} {
	at := make(chan struct{})
	var once sync.Once
	f := func(cl *mqtt.Client) {
		if cl.ID == id {
			once.Do(func() { close(at) })
		}
	}
	b.atWill.Store(&f)
	return at
}

// connectNewer sends the CONNECT of the newer connection: no Clean Start,
// Session Expiry 600, a will whose payload is "newer". Its CONNACK comes on
// the returned channel.
func connectNewer(t *testing.T, addr, client string) <-chan packets.Packet {
	t.Helper()
	c := mqtttest.Dial(t, addr, 5)
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
		Properties: packets.Properties{SessionExpiryInterval: 600, SessionExpiryIntervalFlag: true},
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Keepalive: 30, ClientIdentifier: client,
			WillFlag: true, WillTopic: "gone/" + client, WillQos: 1, WillPayload: []byte("newer"),
			WillProperties: packets.Properties{WillDelayInterval: 60}}})
	acks := make(chan packets.Packet, 1)
	go func() {
		pk, err := c.Read(10 * time.Second)
		if err == nil {
			acks <- pk
		}
		close(acks)
	}()
	return acks
}

// expectConnack waits for the CONNACK of connectNewer, successful.
func expectConnack(t *testing.T, acks <-chan packets.Packet) {
	t.Helper()
	pk, ok := <-acks
	require.True(t, ok, "no CONNACK for the newer connection")
	require.Equal(t, packets.Connack, pk.FixedHeader.Type)
	require.Equal(t, packets.CodeSuccess.Code, pk.ReasonCode)
}

// waitPuts waits up to a second for the store to have taken n PutSession
// calls, and reports whether it did.
func waitPuts(g *gatedRecords, n int32) bool {
	deadline := time.Now().Add(time.Second)
	for time.Now().Before(deadline) {
		if g.puts.Load() >= n {
			return true
		}
		time.Sleep(5 * time.Millisecond)
	}
	return false
}

// A newer connection of a client stores its session record before its
// CONNACK, and is bound to the session only after it. An older connection
// of the client whose end writes the stored record in that window (it
// drops its will from it, or stores its DISCONNECT's expiry) must not put
// its own record back over the newer one's, nor delete it: the store would
// hold, after the newer connection's CONNACK, the older connection's
// record, without the newer connection's will (a custodian would never
// publish it if this edge died) and with the older expiry, or no record
// at all.
func TestBroker_OlderConnectionsEndLeavesTheNewerStoredRecord(t *testing.T) {
	t.Parallel()
	const client = "records"

	// The newer connection's record, as its CONNECT stored it.
	requireNewer := func(t *testing.T, st *durable.Store, id string) {
		t.Helper()
		time.Sleep(300 * time.Millisecond) // the older connection's end is done
		rec, ok, err := st.LoadSession(t.Context(), id)
		require.NoError(t, err)
		require.True(t, ok, "the newer connection's record is stored")
		require.NotNil(t, rec.Session.Will, "the newer connection's will is in the stored record")
		require.Equal(t, "newer", string(rec.Session.Will.Msg.Payload))
		require.Equal(t, uint32(600), rec.Session.ExpiryInterval)
	}

	t.Run("will_voided_by_the_newer_connect", func(t *testing.T) {
		// The older connection is live when the newer CONNECT comes: its
		// will is void, and its end (before its bind) drops it from the
		// stored record.
		t.Parallel()
		g, b, st, addr := recordGatedBroker(t, 2, 0)
		id := b.mustScope(t, "default").ClientID(client)
		old := connectWithWill(t, addr, 5, client, "gone/"+client, false, persistentSession, 60)
		waitBound(t, b, id)
		atWill := signalAtWill(b, id)

		acks := connectNewer(t, addr, client)
		g.waitHeld(t) // the newer record stored; not bound yet
		_ = old.Conn.Close()
		<-atWill
		waitPuts(g, 3) // the older end's write, if it makes one
		g.open()
		expectConnack(t, acks)
		waitBound(t, b, id)
		requireNewer(t, st, id)
	})

	t.Run("will_decided_after_the_newer_connect", func(t *testing.T) {
		// The older connection ended before the newer CONNECT, and comes to
		// its will after it: the session was resumed, so the will is void
		// and dropped from the stored record.
		t.Parallel()
		g, b, st, addr := recordGatedBroker(t, 2, 0)
		id := b.mustScope(t, "default").ClientID(client)
		old := connectWithWill(t, addr, 5, client, "gone/"+client, false, persistentSession, 60)
		waitBound(t, b, id)
		release := endHeldAtWill(t, b, id, old)

		acks := connectNewer(t, addr, client)
		g.waitHeld(t)
		release()
		waitPuts(g, 3)
		g.open()
		expectConnack(t, acks)
		waitBound(t, b, id)
		requireNewer(t, st, id)
	})

	t.Run("expiry_of_the_older_disconnect", func(t *testing.T) {
		// The older connection, without a will, sends a DISCONNECT that
		// changes its Session Expiry while the newer CONNECT is stored.
		t.Parallel()
		g, b, st, addr := recordGatedBroker(t, 2, 0)
		id := b.mustScope(t, "default").ClientID(client)
		old := mqtttest.Dial(t, addr, 5)
		require.Equal(t, packets.CodeSuccess.Code, old.Connect(client, false, persistentSession).ReasonCode)
		waitBound(t, b, id)

		acks := connectNewer(t, addr, client)
		g.waitHeld(t)
		old.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect},
			Properties: packets.Properties{SessionExpiryInterval: 900, SessionExpiryIntervalFlag: true}})
		waitPuts(g, 3) // the DISCONNECT's expiry stored, if it is
		g.open()
		expectConnack(t, acks)
		waitBound(t, b, id)
		requireNewer(t, st, id)
	})

	t.Run("older_record_deleted", func(t *testing.T) {
		// The older session does not outlive its connection: the normal
		// DISCONNECT that discards its will deletes its record, which
		// holds nothing else. The delete is on its way to the store when
		// the newer CONNECT comes.
		t.Parallel()
		g, b, st, addr := recordGatedBroker(t, 0, 1)
		id := b.mustScope(t, "default").ClientID(client)
		old := connectWithWill(t, addr, 5, client, "gone/"+client, false, packets.Properties{}, 60)
		waitBound(t, b, id)

		old.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
		g.waitHeld(t)
		acks := connectNewer(t, addr, client)
		select {
		case <-acks: // the newer record stored, or the CONNECT failed
		case <-time.After(time.Second): // it waits for the older write
		}
		g.open()
		waitBound(t, b, id)
		requireNewer(t, st, id)
	})
}

// stopDuringWillStore is an edge's store whose first queueing for session
// watcher fails as if the edge's stop had begun during it: stop runs
// first, and the write fails. shared makes it a cluster's shared store.
type stopDuringWillStore struct {
	*durable.Store
	watcher string
	stop    func()
	once    sync.Once
	shared  bool
}

func (s *stopDuringWillStore) Shared() bool { return s.shared }

func (s *stopDuringWillStore) Enqueue(id string, e durable.Entry) *durable.Pending {
	failed := false
	if id == s.watcher {
		s.once.Do(func() {
			s.stop()
			failed = true
		})
	}
	if failed {
		return durable.DonePending(errors.New("store write cut short by the stop"))
	}
	return s.Store.Enqueue(id, e)
}

// stoppingDuringWill starts an edge on a stopDuringWillStore (a single
// node's, or a cluster's shared one), with the persistent session
// "watcher" subscribed to will/# and offline, and connects client with a
// persistent session and a QoS 1 will of delay willDelay; it returns the
// edge, its store, the client and its session's ID.
func stoppingDuringWill(t *testing.T, client string, willDelay uint32, shared bool) (*Broker, *durable.Store, *mqtttest.Client, string) {
	t.Helper()
	var b *Broker
	store := &stopDuringWillStore{shared: shared}
	b, st := brokerOnStore(t, func(st *durable.Store) DurableState {
		store.Store = st
		return store
	})
	sc := b.mustScope(t, "default")
	store.watcher = sc.ClientID("watcher")
	store.stop = func() { b.stopping.Store(true) }
	addr := serveTCP(t, b)
	subscribeWillWatcher(t, addr)
	c := connectExpiringWithWill(t, addr, client, 3600, willDelay, 1)
	id := sc.ClientID(client)
	waitBound(t, b, id)
	return b, st, c, id
}

// A will whose delay passes just before a single-node edge stops, and
// whose writes the stop cuts short, is kept for the restart as a will
// still waiting at the stop is [MQTT-3.1.2-8], not dropped: the restart
// publishes it, with the same msgID, which a recipient that took it
// already stores once.
func TestBroker_WillCutShortByTheStopIsKeptForTheRestart(t *testing.T) {
	t.Parallel()
	_, st, c, id := stoppingDuringWill(t, "cut", 1, false)
	_ = c.Conn.Close()
	testutil.Eventually(t, 5*time.Second, func() error {
		got, ok, err := st.LoadSession(t.Context(), id)
		if err != nil || !ok || got.Session.Will == nil {
			return fmt.Errorf("no will kept for the restart in the session's record (ok %v, %v)", ok, err)
		}
		return nil
	})
}

// A will published at once as its connection ends (a DISCONNECT 0x04 that
// ends the stored session with it), whose writes a stop that began
// meanwhile cuts short, is kept for the restart after the session's end,
// which removes the stored record: kept before it, it would go with the
// record.
//
// On an edge of a cluster, the record that holds the will stays in the
// shared store, for the custodian that adopts the session once the edge
// is gone: the session's end leaves it there (forCustody), as the end of
// a connection that the stop closes does.
func TestBroker_WillCutShortAsItsSessionEndsIsKept(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		shared bool
	}{{"single_node", false}, {"cluster", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b, st, c, id := stoppingDuringWill(t, "ending", 0, tc.shared)
			// A DISCONNECT that keeps the will (0x04) and ends the stored
			// session with its connection (Session Expiry 0).
			c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}, ReasonCode: packets.CodeDisconnectWillMessage.Code,
				Properties: packets.Properties{SessionExpiryInterval: 0, SessionExpiryIntervalFlag: true}})
			testutil.Eventually(t, 5*time.Second, func() error {
				if b.session(id) != nil || b.disconnecting.Load() != 0 {
					return errors.New("the connection's end is still under way")
				}
				return nil
			})
			time.Sleep(200 * time.Millisecond) // the end's record removal, if queued
			requireWillStored(t, st, id, "ending")
		})
	}
}

// slowWillStore is a single-node edge's store whose first queueing for
// session watcher waits until release is closed, then fails.
type slowWillStore struct {
	*durable.Store
	watcher string
	entered chan struct{}
	release chan struct{}
	once    sync.Once
}

func (s *slowWillStore) Enqueue(id string, e durable.Entry) *durable.Pending {
	first := false
	if id == s.watcher {
		s.once.Do(func() { first = true })
	}
	if !first {
		return s.Store.Enqueue(id, e)
	}
	close(s.entered)
	<-s.release
	return durable.DonePending(errors.New("store write cut short by the stop"))
}

// The stop of a single-node edge waits for a will its timer is
// publishing, so that one the stop cuts short is kept for the restart
// while the store is still open.
func TestBroker_CloseWaitsForAWillBeingPublished(t *testing.T) {
	t.Parallel()
	store := &slowWillStore{entered: make(chan struct{}), release: make(chan struct{})}
	var let sync.Once
	release := func() { let.Do(func() { close(store.release) }) }
	t.Cleanup(release)
	b, st := brokerOnStore(t, func(st *durable.Store) DurableState {
		store.Store = st
		return store
	})
	sc := b.mustScope(t, "default")
	store.watcher = sc.ClientID("watcher")
	addr := serveTCP(t, b)
	subscribeWillWatcher(t, addr)
	c := connectExpiringWithWill(t, addr, "timed", 3600, 1, 1)
	id := sc.ClientID("timed")
	waitBound(t, b, id)
	_ = c.Conn.Close()
	select {
	case <-store.entered: // the will's delay passed, and it is being stored
	case <-time.After(5 * time.Second):
		t.Fatal("the will did not go out")
	}
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		_ = b.Close()
	}()
	select {
	case <-closed:
		t.Fatal("the stop ended while a will was being published")
	case <-time.After(300 * time.Millisecond):
	}
	release()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("the stop did not end")
	}
	got, ok, err := st.LoadSession(t.Context(), id)
	require.NoError(t, err)
	require.True(t, ok)
	require.NotNil(t, got.Session.Will, "the will cut short by the stop is kept for the restart")
}
