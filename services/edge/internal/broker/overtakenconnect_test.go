package broker

import (
	"sync/atomic"
	"testing"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// recordWaiters is how many holders and waiters the record lock of id has.
func recordWaiters(b *Broker, id string) int {
	b.recordWrites.mu.Lock()
	defer b.recordWrites.mu.Unlock()
	if sl := b.recordWrites.byID[id]; sl != nil {
		return sl.refs
	}
	return 0
}

// overtaken is the race of the tests below, set up to the point where the
// record writes are let go: A's stored-will drop is held with the record
// lock, B (no Clean Start, Session Expiry 600, will "newer") waits for the
// lock behind it, and C (Clean Start, no Session Expiry, no will), which
// stopped waiting for B's establishment after ConnectTimeout and ended
// the copy, waits behind B. extra, when set, is added to mochi's hooks
// before the listener opens.
type overtaken struct {
	b            *Broker
	st           *durable.Store
	g            *gatedRecords
	id           string
	c            *mqtttest.Client // C
	bAcks, cAcks <-chan packets.Packet
}

func raceOvertaken(t *testing.T, client string, extra func(*Broker) mqtt.Hook) overtaken {
	t.Helper()
	g := newGatedRecords(t, 2, 0) // the 2nd PutSession (A's will drop) is held
	cfg := DefaultConfig()
	cfg.EdgeID = "test"
	cfg.ConnectTimeout = time.Second
	b, err := New(cfg, anonymous(), testutil.Logger(t), prometheus.NewRegistry())
	require.NoError(t, err)
	st, err := durable.Open(t.TempDir(), testutil.Logger(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Close(); _ = st.Close() })
	g.sharedLocal = sharedLocal{st}
	require.NoError(t, b.Restore(g))
	if extra != nil {
		require.NoError(t, b.server.AddHook(extra(b), nil))
	}
	addr := serveTCP(t, b)
	id := b.mustScope(t, "default").ClientID(client)

	a := connectWithWill(t, addr, 5, client, "gone/"+client, false, persistentSession, 60)
	waitBound(t, b, id)
	a.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	g.waitHeld(t)

	bAcks := connectNewer(t, addr, client)
	require.Eventually(t, func() bool { return recordWaiters(b, id) == 2 }, 5*time.Second, time.Millisecond,
		"B waits for the record lock")
	c := mqtttest.Dial(t, addr, 5)
	cAcks := make(chan packets.Packet, 1)
	go func() { cAcks <- c.Connect(client, true, packets.Properties{}) }()
	require.Eventually(t, func() bool { return recordWaiters(b, id) == 3 }, 5*time.Second, time.Millisecond,
		"C waits for the record lock")
	return overtaken{b: b, st: st, g: g, id: id, c: c, bAcks: bAcks, cAcks: cAcks}
}

// An older CONNECT (B) of a client, waiting to store its session record
// behind an earlier connection's record write, is overtaken by a newer
// CONNECT (C) with Clean Start, which stopped waiting for B's
// establishment (ConnectTimeout) and ended the session's copy. With the
// copy gone nothing here says a newer claim took the session on, yet B
// must not store its record (persistent, with its will) over the session
// C started clean, nor be told its session is established: C stores
// nothing, so B's record would stay, and a custodian would resume it and
// publish B's will.
func TestBroker_OlderConnectOvertakenByACleanStartStoresNothing(t *testing.T) {
	t.Parallel()
	r := raceOvertaken(t, "overtaken", nil)
	b, st, g, id, bAcks, cAcks := r.b, r.st, r.g, r.id, r.bAcks, r.cAcks
	require.Nil(t, b.session(id), "C's Clean Start ended the copy")

	g.open()
	bAck, ok := <-bAcks
	assert.False(t, ok && bAck.FixedHeader.Type == packets.Connack,
		"B, overtaken before its record was stored, got a CONNACK (code %#x)", bAck.ReasonCode)
	select {
	case ack := <-cAcks:
		require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
		require.False(t, ack.SessionPresent)
	case <-time.After(5 * time.Second):
		t.Fatal("no CONNACK for C")
	}
	waitBound(t, b, id)

	rec, stored, err := st.LoadSession(t.Context(), id)
	require.NoError(t, err)
	if stored {
		require.Nil(t, rec.Session.Will, "B's will is stored for the session C started clean")
		require.NotEqual(t, uint32(600), rec.Session.ExpiryInterval, "B's record is stored for the session C started clean")
	}
}

// holdRefusedEstablish holds a connection the edge refused in
// OnSessionEstablish (it stopped the client) until another connection of
// the client is the one mochi knows, or a while has passed: the order in
// which a loaded machine may run the two.
type holdRefusedEstablish struct {
	mqtt.HookBase
	b          *Broker
	held, done atomic.Bool
}

func (h *holdRefusedEstablish) ID() string           { return "hold-refused" }
func (h *holdRefusedEstablish) Provides(b byte) bool { return b == mqtt.OnSessionEstablish }
func (h *holdRefusedEstablish) OnSessionEstablish(cl *mqtt.Client, _ packets.Packet) {
	if !cl.Closed() {
		return
	}
	h.held.Store(true)
	defer h.done.Store(true)
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		if cur, ok := h.b.server.Clients.Get(cl.ID); ok && cur != cl {
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// The same race, with the overtaken CONNECT (B) established by mochi only
// after the newer one (C) was: B, refused by the edge, must take nothing
// on. Taking the session on, it disconnected C with 0x8E as taken over,
// and the client had no connection left.
func TestBroker_RefusedConnectEstablishedLastLeavesTheNewerConnection(t *testing.T) {
	t.Parallel()
	var hold *holdRefusedEstablish
	r := raceOvertaken(t, "overtaken-last", func(b *Broker) mqtt.Hook {
		hold = &holdRefusedEstablish{b: b}
		return hold
	})
	b, g, id, c, bAcks, cAcks := r.b, r.g, r.id, r.c, r.bAcks, r.cAcks

	g.open()
	select {
	case ack := <-cAcks:
		require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
	case <-time.After(5 * time.Second):
		t.Fatal("no CONNACK for C")
	}
	bAck, ok := <-bAcks
	require.False(t, ok && bAck.FixedHeader.Type == packets.Connack,
		"B, overtaken, got a CONNACK (code %#x)", bAck.ReasonCode)
	// The edge closes B's connection as it refuses it, which can be
	// before mochi reaches B's establishment on a loaded machine: wait
	// for B to be refused there, and for mochi to go on with it.
	require.Eventually(t, hold.held.Load, 5*time.Second, time.Millisecond, "B was not refused in OnSessionEstablish")
	require.Eventually(t, hold.done.Load, 5*time.Second, time.Millisecond)

	// C is still the client's connection: it answers a PINGREQ, and
	// nothing came before the PINGRESP.
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
	pk, err := c.Read(2 * time.Second)
	require.NoError(t, err, "C was closed")
	require.Equal(t, packets.Pingresp, pk.FixedHeader.Type,
		"C got %s (reason %#x) instead of a PINGRESP", packets.PacketNames[pk.FixedHeader.Type], pk.ReasonCode)
	cur, ok := b.server.Clients.Get(id)
	require.True(t, ok && !cur.Closed(), "the client has no live connection")
}
