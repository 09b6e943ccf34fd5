package broker

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// claimsInTurn grants claims from a script, one grant per claim in the
// order they reach the coordinator, and counts releases.
type claimsInTurn struct {
	mu       sync.Mutex
	grants   []Grant
	released []uint64
}

func (o *claimsInTurn) Claim(context.Context, string, string) (Grant, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	g := o.grants[0]
	o.grants = o.grants[1:]
	return g, nil
}

func (o *claimsInTurn) Release(_ context.Context, _, _ string, epoch uint64) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.released = append(o.released, epoch)
	return nil
}

// blockingTakeover answers Begin with state once release is closed, and
// records the epochs of the Begins.
type blockingTakeover struct {
	state   []byte
	release chan struct{}
	mu      sync.Mutex
	begun   []uint64
	asked   chan uint64
}

func (f *blockingTakeover) Begin(ctx context.Context, _, _, _ string, newEpoch uint64, _ bool) ([]byte, error) {
	f.mu.Lock()
	f.begun = append(f.begun, newEpoch)
	f.mu.Unlock()
	f.asked <- newEpoch
	select {
	case <-f.release:
		return f.state, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (f *blockingTakeover) End(context.Context, string, string, string, uint64) (TakeoverEnded, error) {
	return TakeoverEnded{}, nil
}

func (f *blockingTakeover) begins() []uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]uint64(nil), f.begun...)
}

// A client that connects to the edge adopting its session from a draining
// edge waits for the adoption, then binds the adopted copy: the two claims
// do not both take the session over from the draining edge. Run at once,
// the older one failed and undid the newer (released its claim, or ended
// its copy), and the client's next connection found no session anywhere.
func TestBroker_ConnectWaitsForTheAdoptionOfItsSession(t *testing.T) {
	t.Parallel()
	b, st, addr := servingOnSharedStore(t)
	sc := b.mustScope(t, "default")
	id := sc.ClientID("mover")
	rec := durable.Session{ID: id, ProtocolVersion: 5, ExpiryInterval: 300}
	sub := durable.Subscription{Filter: sc.Topic("s/#"), QoS: 1}
	require.NoError(t, st.PutSession(t.Context(), rec))
	require.NoError(t, st.PutSubscription(t.Context(), id, sub))
	state, err := durable.EncodeTransfer(durable.SessionState{Session: rec, Subs: []durable.Subscription{sub}})
	require.NoError(t, err)
	tk := &blockingTakeover{state: state, release: make(chan struct{}), asked: make(chan uint64, 4)}
	own := &claimsInTurn{grants: []Grant{
		{Epoch: 9, Previous: "draining"},                     // the adoption's
		{Epoch: 10, Previous: "test", TakenFrom: "draining"}, // the client's, behind it at the coordinator
	}}
	b.SetCluster(Cluster{Routes: &fakeRoutes{add: func(string, string, string) error { return nil }}, Takeover: tk, Ownership: own})

	adopted := make(chan error, 1)
	go func() {
		_, err := b.Adopt(context.Background(), "default", "mover", "draining")
		adopted <- err
	}()
	require.Equal(t, uint64(9), <-tk.asked, "the adoption asks the draining edge")

	var connack atomic.Pointer[packets.Packet]
	connected := make(chan struct{})
	go func() {
		defer close(connected)
		c := mqtttest.Dial(t, addr, 5)
		pk := c.Connect("mover", false, persistentProps)
		connack.Store(&pk)
	}()
	select {
	case e := <-tk.asked:
		t.Fatalf("the CONNECT took the session over (epoch %d) while the adoption was under way", e)
	case <-connected:
		t.Fatal("the CONNECT was answered while the adoption was under way")
	case <-time.After(300 * time.Millisecond):
	}
	close(tk.release)
	require.NoError(t, <-adopted)
	select {
	case <-connected:
	case <-time.After(10 * time.Second):
		t.Fatal("no CONNACK after the adoption")
	}
	pk := connack.Load()
	require.Equal(t, packets.CodeSuccess.Code, pk.ReasonCode)
	require.True(t, pk.SessionPresent, "the adopted session is the client's")
	require.Equal(t, []uint64{9}, tk.begins(), "one takeover from the draining edge")
	require.Equal(t, uint64(10), waitBound(t, b, id))
	b.releases.Wait()
	own.mu.Lock()
	defer own.mu.Unlock()
	require.Empty(t, own.released, "no claim is given back")
}

// A takeover that reaches an edge while it is still taking the session in
// (from its previous owner, the store, or custody) waits until the copy is
// whole: handed on before, what the import adds after would stay behind.
func TestBroker_TakeOverWaitsForTheImport(t *testing.T) {
	t.Parallel()
	b, sc, id, st := storedSession(t, "arriving")
	require.NoError(t, b.store.ImportSession(t.Context(), st))
	s, err := b.importSession(t.Context(), sc, id, 7, st)
	require.NoError(t, err)
	type answer struct {
		owned bool
		err   error
	}
	answered := make(chan answer, 1)
	go func() {
		owned, _, _, err := b.TakeOver(t.Context(), "default", "arriving", "edge-new", 8, false)
		answered <- answer{owned, err}
	}()
	select {
	case a := <-answered:
		t.Fatalf("TakeOver answered (%+v) while the import was under way", a)
	case <-time.After(200 * time.Millisecond):
	}
	s.releaseHold()
	select {
	case a := <-answered:
		require.NoError(t, a.err)
		require.True(t, a.owned)
	case <-time.After(5 * time.Second):
		t.Fatal("TakeOver did not answer once the import ended")
	}
}

// epochLedger is a shared store that keeps, as the persistence client
// does, the epoch each session's writes go under: Deactivate forgets it
// unless a newer one was activated.
type epochLedger struct {
	sharedLocal
	mu     sync.Mutex
	active map[string]uint64
}

func (e *epochLedger) Activate(_ context.Context, id string, epoch uint64) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.active == nil {
		e.active = map[string]uint64{}
	}
	e.active[id] = max(e.active[id], epoch)
	return nil
}

func (e *epochLedger) Deactivate(id string, epoch uint64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if cur, ok := e.active[id]; ok && cur <= epoch {
		delete(e.active, id)
	}
}

func (e *epochLedger) epoch(id string) (uint64, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	v, ok := e.active[id]
	return v, ok
}

// A copy replaced by one imported under the same claim (a failed takeover
// resumed from the store) neither takes the replacement's store epoch with
// it, which would leave the new copy refused on every write, nor gives the
// claim back at the coordinator, which would make the client's next
// connection start a session of its own beside the stored one.
func TestBroker_ReplacedCopyLeavesTheClaimAndEpoch(t *testing.T) {
	t.Parallel()
	ledger := &epochLedger{}
	b, _ := brokerOnStore(t, func(st *durable.Store) DurableState { ledger.sharedLocal = sharedLocal{st}; return ledger })
	own := &releaseCounter{}
	b.SetCluster(Cluster{Ownership: own, Routes: &fakeRoutes{add: func(string, string, string) error { return nil }}})
	sc := b.mustScope(t, "default")
	id := sc.ClientID("twice")
	st := durable.SessionState{Session: durable.Session{ID: id, ProtocolVersion: 5, ExpiryInterval: 300}}

	first, err := b.importSession(t.Context(), sc, id, 9, st)
	require.NoError(t, err)
	first.releaseHold()
	require.NoError(t, ledger.Activate(t.Context(), id, 9))
	// Resumed again under the same claim: activated first, then imported.
	require.NoError(t, ledger.Activate(t.Context(), id, 9))
	second, err := b.importSession(t.Context(), sc, id, 9, st)
	require.NoError(t, err)
	second.releaseHold()
	epoch, ok := ledger.epoch(id)
	require.True(t, ok, "the replacing copy can still write")
	require.Equal(t, uint64(9), epoch)

	// A copy forgotten after a failed takeover does not give the claim back
	// either: the edge still owns the session and resumes or retries it.
	b.forgetCopy(second, 9)
	require.Nil(t, b.session(id))
	b.releases.Wait()
	own.mu.Lock()
	defer own.mu.Unlock()
	require.Empty(t, own.released)
}

// A client whose session is stored while the coordinator names no owner of
// it (an owner gave its claim back without ending the session) resumes
// that session, with what is queued for it: starting a new one beside it
// would lose the messages acknowledged to their publishers.
func TestBroker_StoredSessionWithoutOwnerIsResumed(t *testing.T) {
	t.Parallel()
	b, st, addr := servingOnSharedStore(t)
	sc := b.mustScope(t, "default")
	id := sc.ClientID("orphan")
	require.NoError(t, st.PutSession(t.Context(), durable.Session{ID: id, ProtocolVersion: 5, ExpiryInterval: 300}))
	require.NoError(t, st.PutSubscription(t.Context(), id, durable.Subscription{Filter: sc.Topic("s/#"), QoS: 1}))
	msg := &durable.Message{ID: "other/1/1", Topic: sc.Topic("s/kept"), Payload: []byte("acknowledged"), QoS: 1, Created: time.Now().UnixNano()}
	require.NoError(t, st.Enqueue(id, durable.Entry{Seq: 1, MsgID: msg.ID, QoS: 1, Msg: msg}).Wait(t.Context()))
	b.SetCluster(Cluster{Routes: &fakeRoutes{add: func(string, string, string) error { return nil }},
		Ownership: grantOwnership(func() Grant { return Grant{Epoch: 4} })})

	c := mqtttest.Dial(t, addr, 5)
	ack := c.Connect("orphan", false, persistentProps)
	require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
	require.True(t, ack.SessionPresent, "the stored session is the client's")
	pk := c.Expect(packets.Publish)
	require.Equal(t, "s/kept", pk.TopicName)
	require.Equal(t, "acknowledged", string(pk.Payload))
	require.Equal(t, 1.0, promtest.ToFloat64(b.m.resumedFromStore))

	// A client starting clean does not read the store.
	fresh := mqtttest.Dial(t, addr, 5)
	require.False(t, fresh.Connect("newcomer", true, persistentProps).SessionPresent)
	require.Equal(t, 1.0, promtest.ToFloat64(b.m.resumedFromStore))
}
