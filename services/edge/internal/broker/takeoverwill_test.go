package broker

import (
	"context"
	"sync"
	"testing"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// holdAtWill holds the end of the connection of the internal client ID id
// as it comes to its will (OnDisconnect), once. It returns a channel closed
// when the end is held, and the func that lets it go on.
func holdAtWill(t *testing.T, b *Broker, id string) (held <-chan struct{}, release func()) {
	t.Helper()
	in, out := make(chan struct{}), make(chan struct{})
	var once sync.Once
	hold := func(cl *mqtt.Client) {
		if cl.ID == id {
			once.Do(func() { close(in); <-out })
		}
	}
	b.atWill.Store(&hold)
	release = sync.OnceFunc(func() { close(out) })
	t.Cleanup(release)
	return in, release
}

// endHeldAtWill closes old, a connection of the internal client ID id, and
// returns once its end is held at its will (holdAtWill), with the func
// that lets the end go on.
func endHeldAtWill(t *testing.T, b *Broker, id string, old *mqtttest.Client) (release func()) {
	t.Helper()
	held, release := holdAtWill(t, b, id)
	_ = old.Conn.Close()
	select {
	case <-held:
	case <-time.After(5 * time.Second):
		t.Fatal("the connection's end did not come to its will")
	}
	return release
}

// A connection that ends on its own while a newer connection of its client
// takes its session over comes to its will after the takeover decided what
// becomes of the session, whichever of the two the takeover found first.
// When the session goes on (a CONNECT without Clean Start here, or a move
// to the edge that claimed it), the will is never published, its delay
// notwithstanding: a new connection to the session came before the delay
// passed [MQTT-3.1.3-9]. When the session ends (Clean Start, or a session
// that does not outlive its connection taken by another edge), the will
// goes out at once, not after its delay: it is published when the delay
// passes or the session ends, whichever is first. Either way the old
// connection ended before the takeover could void or hasten its will
// through the connection itself.
func TestBroker_WillOfAConnectionEndingDuringATakeover_MQTT_3_1_3_9(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		elsewhere bool               // taken by another edge (TakeOver), not by a CONNECT here
		clean     bool               // the taking connection's Clean Start
		props     packets.Properties // the old connection's
		delay     uint32             // its will's
		hold      bool               // its end held at its will until the takeover is done
		will      bool               // published, at once
	}{
		{name: "resumed_here", props: persistentSession, delay: 1, hold: true},
		{name: "clean_start_here", clean: true, props: persistentSession, delay: 60, hold: true, will: true},
		{name: "moved_elsewhere", elsewhere: true, props: persistentSession, delay: 1, hold: true},
		{name: "clean_start_elsewhere", elsewhere: true, clean: true, props: persistentSession, delay: 60, hold: true, will: true},
		{name: "expiry_0_taken_elsewhere", elsewhere: true, delay: 60, will: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b, _ := brokerOnStore(t, func(s *durable.Store) DurableState { return s })
			addr := serveTCP(t, b)
			const client = "ending"
			id := b.mustScope(t, "default").ClientID(client)
			watcher := willWatcher(t, addr, "gone/"+client)

			old := connectWithWill(t, addr, 5, client, "gone/"+client, true, tc.props, tc.delay)
			epoch := waitBound(t, b, id)
			release := func() {}
			if tc.hold {
				release = endHeldAtWill(t, b, id, old)
			}
			if tc.elsewhere {
				owned, _, _, err := b.TakeOver(t.Context(), "default", client, "edge-new", epoch+1, tc.clean)
				require.NoError(t, err)
				require.True(t, owned)
			} else {
				ack := mqtttest.Dial(t, addr, 5).Connect(client, tc.clean, persistentSession)
				require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
				require.Equal(t, !tc.clean, ack.SessionPresent)
			}
			release()
			if !tc.will {
				pk, err := watcher.Read(time.Duration(tc.delay)*time.Second + 1500*time.Millisecond)
				require.Error(t, err, "the session went on, yet its old connection's will came: type %d, payload %q", pk.FixedHeader.Type, pk.Payload)
				return
			}
			ended := time.Now()
			pk, err := watcher.Read(5 * time.Second)
			require.NoError(t, err, "the session ended: its old connection's will goes out at once")
			require.Equal(t, packets.Publish, pk.FixedHeader.Type)
			require.Equal(t, client, string(pk.Payload))
			require.Less(t, time.Since(ended), 2*time.Second)
			watcher.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
			pk, err = watcher.Read(time.Second)
			require.Error(t, err, "the will is published once; got type %d, payload %q", pk.FixedHeader.Type, pk.Payload)
		})
	}
}

// A takeover from another edge with Clean Start ends the session here and
// sends its waiting will from here: the stored record that also holds the
// will is ended with the session. An edge that stops between the two
// (Close: wills are held back from then on) waits for the will to be sent;
// held back there, it would be neither sent nor kept for anyone.
func TestBroker_StopDuringACleanTakeoverWaitsForItsWill(t *testing.T) {
	t.Parallel()
	b, st := brokerOnStore(t, func(s *durable.Store) DurableState { return sharedLocal{s} })
	addr := serveTCP(t, b)
	const client = "stop-at-takeover"
	id := b.mustScope(t, "default").ClientID(client)
	epoch := goneWithWill(t, b, addr, client, persistentSession)

	closed := make(chan struct{})
	waiting := make(chan struct{})
	gate := sync.OnceFunc(func() { close(waiting) })
	b.atCloseGate.Store(&gate)
	at := func() {
		go func() { _ = b.Close(); close(closed) }()
		select {
		case <-waiting: // the stop waits for this takeover
		case <-closed:
		case <-time.After(5 * time.Second):
		}
	}
	b.atTakeOverWill.Store(&at)
	owned, _, _, err := b.TakeOver(t.Context(), "default", client, "edge-new", epoch+1, true)
	require.NoError(t, err)
	require.True(t, owned)
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("the edge did not stop")
	}
	select {
	case <-waiting:
	default:
		t.Fatal("the stop did not wait for the takeover sending the will")
	}
	requireWillPublishedOrKept(t, b, st, id)
}

// requireWillPublishedOrKept checks that the will of the internal client
// ID id went out from b or stays in the stored record, not both.
func requireWillPublishedOrKept(t *testing.T, b *Broker, st *durable.Store, id string) {
	t.Helper()
	published := promtest.ToFloat64(b.m.willsPublished)
	rec, stored, err := st.LoadSession(context.Background(), id)
	require.NoError(t, err)
	kept := stored && rec.Session.Will != nil
	require.True(t, published == 1 || kept, "the will was neither published (%v) nor kept in the stored record", published)
	require.False(t, published == 1 && kept, "the will was published and kept for another edge to publish again")
}

// goneWithWill connects a persistent client with a will (delay 60 s) and
// closes its connection; it returns once the will waits for its delay.
func goneWithWill(t *testing.T, b *Broker, addr, client string, props packets.Properties) (epoch uint64) {
	t.Helper()
	id := b.mustScope(t, "default").ClientID(client)
	old := connectWithWill(t, addr, 5, client, "gone/"+client, false, props, 60)
	epoch = waitBound(t, b, id)
	_ = old.Conn.Close()
	require.Eventually(t, func() bool {
		b.willMu.Lock()
		defer b.willMu.Unlock()
		return b.wills[id] != nil
	}, 5*time.Second, time.Millisecond, "the will waits for its delay")
	return epoch
}

// Session ends that come once the edge stops, when its wills are held back
// (the stored record keeps them for the session's next holder): each one
// leaves the will in the record, or refuses.
func TestBroker_SessionEndsAfterTheStopKeepTheWillStored(t *testing.T) {
	t.Parallel()
	t.Run("takeover_finds_it_expired", func(t *testing.T) {
		t.Parallel()
		b, st := brokerOnStore(t, func(s *durable.Store) DurableState { return sharedLocal{s} })
		addr := serveTCP(t, b)
		const client = "expired-after-stop"
		epoch := goneWithWill(t, b, addr, client, packets.Properties{SessionExpiryInterval: 1, SessionExpiryIntervalFlag: true})
		require.NoError(t, b.Close())
		time.Sleep(1200 * time.Millisecond) // past the session's expiry
		owned, _, _, err := b.TakeOver(t.Context(), "default", client, "edge-new", epoch+1, false)
		require.NoError(t, err)
		require.True(t, owned)
		requireWillPublishedOrKept(t, b, st, b.mustScope(t, "default").ClientID(client))
	})
	t.Run("discard", func(t *testing.T) {
		t.Parallel()
		b, st := brokerOnStore(t, func(s *durable.Store) DurableState { return sharedLocal{s} })
		addr := serveTCP(t, b)
		const client = "discard-after-stop"
		goneWithWill(t, b, addr, client, persistentSession)
		require.NoError(t, b.Close())
		_, err := b.Kick(t.Context(), "default", client, true)
		require.ErrorIs(t, err, ErrStopping)
		requireWillPublishedOrKept(t, b, st, b.mustScope(t, "default").ClientID(client))
	})
	t.Run("single_node_drained_then_expired", func(t *testing.T) {
		t.Parallel()
		b, st := brokerOnStore(t, func(s *durable.Store) DurableState { return s })
		require.True(t, b.singleNode())
		addr := serveTCP(t, b)
		const client = "expired-after-drain"
		id := b.mustScope(t, "default").ClientID(client)
		goneWithWill(t, b, addr, client, packets.Properties{SessionExpiryInterval: 1, SessionExpiryIntervalFlag: true})
		b.Drain(t.Context())
		require.Eventually(t, func() bool { return b.session(id) == nil }, 8*time.Second, 10*time.Millisecond, "the session expires")
		require.NoError(t, b.Close())
		requireWillPublishedOrKept(t, b, st, id)
	})
}

// A session that expires on an edge that stops (a takeover from another
// edge finds it expired) ends all the same: its will, held back here, goes
// out once from the edge the client connects to next, and the client,
// with or without Clean Start, does not get the expired session back.
func TestBroker_SessionExpiredAsTheEdgeStopsEndsForItsNextHolder(t *testing.T) {
	t.Parallel()
	for _, clean := range []bool{false, true} {
		t.Run(map[bool]string{false: "resume", true: "clean_start"}[clean], func(t *testing.T) {
			t.Parallel()
			a, st := brokerOnStore(t, func(s *durable.Store) DurableState { return sharedLocal{s} })
			addrA := serveTCP(t, a)
			bb := newEdgeB(t, sharedLocal{st})

			const client = "expires-as-a-stops"
			epoch := goneWithWill(t, a, addrA, client, packets.Properties{SessionExpiryInterval: 1, SessionExpiryIntervalFlag: true})
			require.NoError(t, a.Close())
			time.Sleep(1200 * time.Millisecond) // past the session's expiry

			takesFrom(bb, a, client, epoch, clean)
			addrB := serveTCP(t, bb)
			watch := watchWills(t, addrB, "watch", client)
			ack := mqtttest.Dial(t, addrB, 5).Connect(client, clean, persistentSession)
			require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
			require.False(t, ack.SessionPresent, "the expired session was resumed")
			require.Equal(t, 1, countPublishes(t, watch, 2*time.Second), "wills of the expired session published")
		})
	}
}

// A CONNECT that would end the session here (Clean Start, or a session
// that does not outlive its connection taking over one whose will waits)
// and reaches its establishment as the edge stops is refused, and leaves
// the session and its stored will as they were.
func TestBroker_ConnectRefusedAsTheEdgeStopsLeavesTheWillStored(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		clean bool
		props packets.Properties
	}{
		{"clean_start_expiry_0", true, packets.Properties{}},
		{"resume_expiry_0", false, packets.Properties{}},
		{"clean_start_persistent", true, persistentSession},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b, st := brokerOnStore(t, func(s *durable.Store) DurableState { return sharedLocal{s} })
			addr := serveTCP(t, b)
			client := "refused-" + tc.name
			id := b.mustScope(t, "default").ClientID(client)
			goneWithWill(t, b, addr, client, persistentSession)
			closed := make(chan struct{})
			at := func() {
				go func() { _ = b.Close(); close(closed) }()
				assert.Eventually(t, b.willsHeldBack, 5*time.Second, time.Millisecond)
			}
			b.atSessionEstablish.Store(&at)
			c := mqtttest.Dial(t, addr, 5)
			c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, Properties: tc.props,
				Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: tc.clean, Keepalive: 30, ClientIdentifier: client}})
			pk, err := c.Read(3 * time.Second)
			require.False(t, err == nil && pk.FixedHeader.Type == packets.Connack && pk.ReasonCode == packets.CodeSuccess.Code,
				"the CONNECT was accepted as the edge stopped")
			select {
			case <-closed:
			case <-time.After(10 * time.Second):
				t.Fatal("the edge did not stop")
			}
			requireWillPublishedOrKept(t, b, st, id)
		})
	}
}
