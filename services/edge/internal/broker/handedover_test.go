package broker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/prometheus/client_golang/prometheus"
	promtestutil "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
	"github.com/keelmq/keel/services/edge/internal/tenancy"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
)

// relayingPeers records the relays asked of it and answers them with err.
type relayingPeers struct {
	mu     sync.Mutex
	relays []relayCall
	err    error
}

type relayCall struct {
	edge    string
	topic   string
	targets []RelayTarget
}

func (p *relayingPeers) Forward(context.Context, *Message, *Again) (func() error, SharedChoice, error) {
	return nil, SharedChoice{}, nil
}

func (p *relayingPeers) ForwardShared(context.Context, *Message, GroupKey, string) (func() error, error) {
	return nil, ErrNoMember
}

func (p *relayingPeers) Relay(_ context.Context, m *Message, edge string, to []RelayTarget) (func() error, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.relays = append(p.relays, relayCall{edge: edge, topic: m.Topic, targets: to})
	err := p.err
	return func() error { return err }, nil
}

func (p *relayingPeers) calls() []relayCall {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.relays)
}

// waitBound waits until the client's session is bound here and returns its
// epoch.
func waitBound(t *testing.T, b *Broker, id string) uint64 {
	t.Helper()
	var epoch uint64
	require.Eventually(t, func() bool {
		s := b.session(id)
		if s == nil {
			return false
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		epoch = s.epoch
		return s.client != nil
	}, 5*time.Second, time.Millisecond)
	return epoch
}

// waitUnbound waits until the session copy s has no connection bound.
func waitUnbound(t *testing.T, s *session, msgAndArgs ...any) {
	t.Helper()
	require.NotNil(t, s)
	require.Eventually(t, func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.client == nil
	}, 5*time.Second, time.Millisecond, msgAndArgs...)
}

func forwardedMsg(seq uint64, topic string, qos uint32, published time.Time) *commonv1.Message {
	return &commonv1.Message{Id: &commonv1.MsgID{EdgeId: "other", Incarnation: 1, Seq: seq}, Tenant: "default",
		Topic: topic, Qos: qos, Payload: []byte(topic), IngressUnixNano: published.UnixNano()}
}

// A persistent session handed over to another edge (TakeOver, then
// TakeoverEnd) leaves its subscriptions behind for a while: a forwarded
// QoS 1/2 message on them that was published before the handover is
// relayed to the new owner for that session alone (and counts as taken only
// once the new owner took it), besides going to the local subscribers as
// usual; one published after the handover, a QoS 0 one, and one on another
// topic are not relayed.
func TestBroker_HandedOverSessionRelaysEarlierMessages(t *testing.T) {
	t.Parallel()
	b, addr, stop := openDurable(t, t.TempDir())
	t.Cleanup(stop)
	peers := &relayingPeers{}
	b.SetCluster(Cluster{Peers: peers})
	mover := mqtttest.Dial(t, addr, 5)
	mover.Connect("mover", false, persistentProps)
	mover.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: 1,
		Properties: packets.Properties{SubscriptionIdentifier: []int{7}}, Filters: packets.Subscriptions{{Filter: "a/#", Qos: 1, RetainAsPublished: true}}})
	mover.Expect(packets.Suback)
	mover.Subscribe(2, "a/only-qos0", 0)
	stayer := mqtttest.Dial(t, addr, 5)
	stayer.Connect("stayer", true, packets.Properties{})
	stayer.Subscribe(1, "a/#", 1)

	epoch := waitBound(t, b, b.mustScope(t, "default").ClientID("mover"))
	before := time.Now().Add(-time.Second)
	owned, _, _, err := b.TakeOver(t.Context(), "default", "mover", "edge-new", epoch+1, false)
	require.NoError(t, err)
	require.True(t, owned)
	require.Equal(t, packets.ErrSessionTakenOver.Code, mover.Expect(packets.Disconnect).ReasonCode)
	_, err = b.TakeoverEnd(t.Context(), "default", "mover", epoch+1)
	require.NoError(t, err)
	require.Nil(t, b.session(b.mustScope(t, "default").ClientID("mover")), "the session left this edge")

	old := forwardedMsg(1, "a/b", 1, before)
	old.Retain = true
	require.NoError(t, b.DeliverForwarded(t.Context(), old, SharedChoice{}))
	require.Equal(t, "a/b", stayer.Expect(packets.Publish).TopicName, "local subscribers get it as usual")
	require.Equal(t, []relayCall{{edge: "edge-new", topic: "default/a/b", targets: []RelayTarget{
		{Tenant: "default", ClientID: "mover", Epoch: epoch + 1, QoS: 1, Retain: true, SubIDs: []int{7}}}}}, peers.calls())
	require.Equal(t, 1.0, promtestutil.ToFloat64(b.m.handoverRelays.WithLabelValues("ok")))

	// QoS 0, a newer message and another topic: not relayed.
	require.NoError(t, b.DeliverForwarded(t.Context(), forwardedMsg(2, "a/c", 0, before), SharedChoice{}))
	require.NoError(t, b.DeliverForwarded(t.Context(), forwardedMsg(3, "a/d", 1, time.Now().Add(time.Second)), SharedChoice{}))
	require.NoError(t, b.DeliverForwarded(t.Context(), forwardedMsg(4, "z", 1, before), SharedChoice{}))
	require.Len(t, peers.calls(), 1)

	// A relay the new owner did not take leaves the message not taken here.
	peers.mu.Lock()
	peers.err = errors.New("new owner unreachable")
	peers.mu.Unlock()
	require.Error(t, b.DeliverForwarded(t.Context(), forwardedMsg(5, "a/e", 2, before), SharedChoice{}))
	require.Equal(t, 1.0, promtestutil.ToFloat64(b.m.handoverRelays.WithLabelValues("error")))
}

// takenOverTarget connects the persistent client "target", subscribed to
// a/#, and makes its session look taken over from another edge at now:
// what was published before is remembered for a minute.
func takenOverTarget(t *testing.T, now time.Time) (*Broker, string, *mqtttest.Client, *session, uint64) {
	t.Helper()
	b, addr, stop := openDurable(t, t.TempDir())
	t.Cleanup(stop)
	target := mqtttest.Dial(t, addr, 5)
	target.Connect("target", false, persistentProps)
	target.Subscribe(1, "a/#", 1)
	id := b.mustScope(t, "default").ClientID("target")
	epoch := waitBound(t, b, id)
	s := b.session(id)
	s.mu.Lock()
	s.recent = &recentIDs{ids: map[MsgID]struct{}{}}
	s.recent.narrow(now, time.Minute)
	s.mu.Unlock()
	return b, addr, target, s, epoch
}

// A relayed message goes to its target sessions alone, once even when it
// reached the session directly as well; one for a session that is not here
// is taken with nothing to do, unless the session is owned here and held
// elsewhere.
func TestBroker_DeliverRelayed(t *testing.T) {
	t.Parallel()
	b, addr, target, _, epoch := takenOverTarget(t, time.Now())
	other := mqtttest.Dial(t, addr, 5)
	other.Connect("other", true, packets.Properties{})
	other.Subscribe(1, "a/#", 1)

	early := forwardedMsg(1, "a/b", 1, time.Now().Add(-time.Second))
	to := []RelayTarget{{Tenant: "default", ClientID: "target", Epoch: epoch, QoS: 1}}
	require.NoError(t, b.DeliverForwarded(t.Context(), early, SharedChoice{}))
	target.Expect(packets.Publish)
	other.Expect(packets.Publish)
	require.NoError(t, b.DeliverRelayed(t.Context(), early, to))
	_, err := target.Read(200 * time.Millisecond)
	require.Error(t, err, "the relayed copy of a message the session has is dropped")

	relayed := forwardedMsg(2, "a/c", 1, time.Now().Add(-time.Second))
	require.NoError(t, b.DeliverRelayed(t.Context(), relayed, to))
	require.Equal(t, "a/c", target.Expect(packets.Publish).TopicName)
	_, err = other.Read(200 * time.Millisecond)
	require.Error(t, err, "a relayed message is for its target sessions alone")

	require.NoError(t, b.DeliverRelayed(t.Context(), forwardedMsg(3, "a/d", 1, time.Now()),
		[]RelayTarget{{Tenant: "default", ClientID: "gone", Epoch: 1, QoS: 1}}))
	require.Error(t, b.DeliverRelayed(t.Context(), forwardedMsg(4, "a/e", 1, time.Now()),
		[]RelayTarget{{Tenant: "default", ClientID: "target", Epoch: epoch + 1, QoS: 1}}), "a copy under an older epoch is not the session meant")

	// Owned here but still held elsewhere (a failed takeover): not taken.
	sc := b.mustScope(t, "default")
	b.setUnfinished(sc.ClientID("stuck"), unfinishedTakeover{previous: "edge-7", epoch: 3, scope: sc, clientID: "stuck"})
	require.Error(t, b.DeliverRelayed(t.Context(), forwardedMsg(5, "a/f", 1, time.Now()),
		[]RelayTarget{{Tenant: "default", ClientID: "stuck", Epoch: 3, QoS: 1}}), "no copy here to take it")
}

// A message relayed here for a session that this edge has since handed
// over to a third edge (it moved on within the handover memory) is
// relayed on to that edge: taken here, where the session is gone, it would
// be acknowledged to its publisher and reach nobody.
func TestBroker_RelayForASessionThatMovedOnGoesOn(t *testing.T) {
	t.Parallel()
	b, addr, stop := openDurable(t, t.TempDir())
	t.Cleanup(stop)
	peers := &relayingPeers{}
	b.SetCluster(Cluster{Peers: peers})
	mover := mqtttest.Dial(t, addr, 5)
	mover.Connect("mover", false, persistentProps)
	mover.Subscribe(1, "a/#", 1)
	epoch := waitBound(t, b, b.mustScope(t, "default").ClientID("mover"))
	before := time.Now().Add(-time.Second)
	owned, _, _, err := b.TakeOver(t.Context(), "default", "mover", "edge-d", epoch+1, false)
	require.NoError(t, err)
	require.True(t, owned)
	_, err = b.TakeoverEnd(t.Context(), "default", "mover", epoch+1)
	require.NoError(t, err)
	require.Nil(t, b.session(b.mustScope(t, "default").ClientID("mover")))

	// The edge that handed the session here relays a message published
	// before that first handover.
	require.NoError(t, b.DeliverRelayed(t.Context(), forwardedMsg(1, "a/b", 1, before),
		[]RelayTarget{{Tenant: "default", ClientID: "mover", Epoch: epoch, QoS: 1}}))
	require.Equal(t, []relayCall{{edge: "edge-d", topic: "default/a/b", targets: []RelayTarget{
		{Tenant: "default", ClientID: "mover", Epoch: epoch + 1, QoS: 1}}}}, peers.calls(), "relayed on to the session's owner now")
}

// The memory of a handed-over session lasts as long as a publish routed
// before the handover can still arrive, and honours No Local.
func TestHandedOver_ExpiresAndHonoursNoLocal(t *testing.T) {
	t.Parallel()
	h := newHandedOver(time.Minute)
	at := time.Now()
	sc, err := tenancy.NewScope("t")
	require.NoError(t, err)
	share, _ := sc.Filter("$share/g/g")
	s := &session{id: sc.ClientID("c"), scope: sc, subs: map[string]*subscription{
		"a": {filter: sc.Topic("a/#"), qos: 2},
		"n": {filter: sc.Topic("n"), qos: 1, noLocal: true},
		"g": {filter: sc.Topic("g"), full: share, qos: 1, group: &shareGroup{name: "g", filter: sc.Topic("g")}},
	}}
	h.add(s, at, "edge-2", 9)
	old := at.Add(-time.Millisecond).UnixNano()
	msg := func(topic string, created int64, origin string) *Message {
		return &Message{Topic: sc.Topic(topic), QoS: 1, Created: created, Origin: origin}
	}
	want := []relay{{to: "edge-2", targets: []RelayTarget{{Tenant: "t", ClientID: "c", Epoch: 9, QoS: 1}}}}
	require.Equal(t, want, h.relays(msg("a/b", old, ""), at, nil))
	require.Equal(t, want, h.relays(msg("a/b", at.Add(handoverSkew/2).UnixNano(), ""), at, nil), "within the clock margin")
	require.Empty(t, h.relays(msg("a/b", at.Add(handoverSkew).UnixNano(), ""), at, nil))
	require.Equal(t, want, h.relays(msg("n", old, sc.ClientID("other")), at, nil))
	require.Empty(t, h.relays(msg("n", old, sc.ClientID("c")), at, nil), "the session's own message is not for it (No Local)")
	require.Empty(t, h.relays(msg("g", old, ""), at, nil), "a shared subscription is not relayed with the plain ones")
	rs, groups := h.groupRelays(msg("g", old, ""), at, func(group, filter string) bool { return group == "g" && filter == sc.Topic("g") })
	require.Equal(t, want, rs, "but for its group, when this edge has no member of it")
	require.Equal(t, []*shareGroup{{name: "g", filter: sc.Topic("g")}}, groups)
	rs, _ = h.groupRelays(msg("g", old, ""), at, func(string, string) bool { return false })
	require.Empty(t, rs)
	require.Empty(t, h.relays(&Message{Topic: "other/a/b", QoS: 1, Created: old}, at, nil), "another tenant's topic")
	require.Empty(t, h.relays(msg("a/b", old, ""), at, func(string) bool { return false }))
	// Limited to the session (a relay it moved on from here), its plain
	// subscriptions count, and so do its shared ones.
	mine := func(id string) bool { return id == sc.ClientID("c") }
	require.Equal(t, want, h.relays(msg("a/b", old, ""), at, mine))
	require.Equal(t, want, h.relays(msg("g", old, ""), at, mine))

	require.Empty(t, h.relays(msg("a/b", old, ""), at.Add(time.Minute), nil), "forgotten once no publish from before can arrive")
	require.Zero(t, h.latest.Load())
	require.Empty(t, h.entries)
	require.Zero(t, h.subs.Len())
}

// A session remembered with no known owner is relayed nowhere until its
// owner is named: then to that owner alone, or, named by nobody, its
// entries go; named as the owner it is remembered for already, once.
func TestHandedOver_ResolvesAnUnknownOwner(t *testing.T) {
	t.Parallel()
	sc, err := tenancy.NewScope("t")
	require.NoError(t, err)
	at := time.Now()
	old := &Message{Topic: sc.Topic("a/b"), QoS: 1, Created: at.Add(-time.Millisecond).UnixNano()}
	for _, tc := range []struct {
		name    string
		owner   string
		already bool // remembered for owner before
		want    []relay
	}{
		{"named", "edge-2", false, []relay{{to: "edge-2", targets: []RelayTarget{{Tenant: "t", ClientID: "c", Epoch: 9, QoS: 1}}}}},
		{"named_again", "edge-2", true, []relay{{to: "edge-2", targets: []RelayTarget{{Tenant: "t", ClientID: "c", Epoch: 9, QoS: 1}}}}},
		{"nobody", "", false, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := newHandedOver(time.Minute)
			s := &session{id: sc.ClientID("c"), scope: sc, subs: map[string]*subscription{"a": {filter: sc.Topic("a/#"), qos: 1}}}
			if tc.already {
				h.add(s, at, "edge-2", 9)
			}
			h.add(s, at, "", 0)
			rs := h.relays(old, at, nil)
			require.True(t, slices.ContainsFunc(rs, func(r relay) bool { return r.to == "" }), "refused until the owner is known")
			h.resolve(s.id, tc.owner, 9)
			require.Equal(t, tc.want, h.relays(old, at, nil))
			require.Len(t, h.entries, len(tc.want))
		})
	}
}

// After a takeover, a session remembers only messages published before it,
// and only for as long as they can be relayed.
func TestRecentIDs(t *testing.T) {
	t.Parallel()
	r := &recentIDs{ids: map[MsgID]struct{}{}}
	now := time.Now()
	m := func(seq uint64, created time.Time) *Message {
		return &Message{ID: MsgID{Edge: "e", Seq: seq}, Created: created.UnixNano()}
	}
	require.False(t, r.seen(m(1, now.Add(time.Hour))), "during the hold every message counts")
	require.True(t, r.seen(m(1, now.Add(time.Hour))))
	r.narrow(now, time.Minute)
	require.False(t, r.seen(m(2, now.Add(time.Second))))
	require.False(t, r.seen(m(2, now.Add(time.Second))), "a message published after the takeover is not remembered")
	require.False(t, r.seen(m(3, now)))
	require.True(t, r.seen(m(3, now)))
	require.False(t, r.over(now.Add(time.Minute-time.Nanosecond)))
	require.True(t, r.over(now.Add(time.Minute)), "nothing to remember once the previous owner relays no more")
}

// storedSession opens a durable broker and the state of a persistent
// session of clientID, as a takeover or the shared store hands it over.
func storedSession(t *testing.T, clientID string) (*Broker, *tenancy.Scope, string, durable.SessionState) {
	t.Helper()
	b, _, stop := openDurable(t, t.TempDir())
	t.Cleanup(stop)
	sc := b.mustScope(t, "default")
	id := sc.ClientID(clientID)
	return b, sc, id, durable.SessionState{Session: durable.Session{ID: id, ExpiryInterval: 300}}
}

// Of two imports of one session (a client's CONNECT resuming it and the
// adoption of its failed takeover, at once), the one under the older claim
// does not replace the newer copy: that copy's store epoch would go with it
// and leave it unable to store anything.
func TestBroker_ImportKeepsNewerCopy(t *testing.T) {
	t.Parallel()
	b, sc, id, st := storedSession(t, "twice")
	older, err := b.importSession(t.Context(), sc, id, 7, st)
	require.NoError(t, err)
	older.releaseHold()
	_, err = b.importSession(t.Context(), sc, id, 5, st)
	require.ErrorIs(t, err, errNewerCopy)
	require.Equal(t, uint64(7), sessionEpoch(b, id), "the newer copy stays")
	newer, err := b.importSession(t.Context(), sc, id, 9, st)
	require.NoError(t, err, "a newer claim replaces it")
	newer.releaseHold()
	require.Equal(t, uint64(9), sessionEpoch(b, id))
	// A failure after the older import forgets that copy only.
	b.forgetCopy(older, 7)
	require.Equal(t, uint64(9), sessionEpoch(b, id), "the newer copy stays")
	// Nor the copy a newer claim took on: a client that connected here
	// bound it under its own epoch.
	newer.mu.Lock()
	newer.epoch = 11
	newer.mu.Unlock()
	b.forgetCopy(newer, 9)
	require.Same(t, newer, b.session(id), "bound under a newer claim, it stays")
	b.forgetCopy(newer, 11)
	require.Nil(t, b.session(id))
}

// scriptedTakeover is the other edges of a takeover, as a test scripts them.
type scriptedTakeover struct {
	begin   func(newEpoch uint64) ([]byte, error)
	late    []byte // what End hands over
	landing bool   // End says frames were landing
	ended   []uint64
	from    []string // the previous owners Begin was called on
}

func (f *scriptedTakeover) Begin(_ context.Context, previous, _, _ string, newEpoch uint64, _ bool) ([]byte, error) {
	f.from = append(f.from, previous)
	return f.begin(newEpoch)
}

func (f *scriptedTakeover) End(_ context.Context, _, _, _ string, newEpoch uint64) (TakeoverEnded, error) {
	f.ended = append(f.ended, newEpoch)
	return TakeoverEnded{Late: f.late, FramesLanding: f.landing}, nil
}

// releaseCounter records the epochs released; claims go to the embedded
// ownership (none is made when it is left nil).
type releaseCounter struct {
	Ownership
	released []uint64
	mu       sync.Mutex
}

func (o *releaseCounter) Release(_ context.Context, _, _ string, epoch uint64) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.released = append(o.released, epoch)
	return nil
}

// A takeover whose session was meanwhile brought here under a newer claim
// (its client connected here and read it from the shared store) leaves that
// copy alone: ending it would release the newer claim at the coordinator
// and leave the connected client with no session. The previous owner is
// still told the takeover ended, so that it lets its copy go.
func TestBroker_SupersededTakeoverKeepsTheNewerCopy(t *testing.T) {
	t.Parallel()
	b, sc, id, st := storedSession(t, "roaming")
	state, err := durable.EncodeTransfer(st)
	require.NoError(t, err)
	own := &releaseCounter{}
	var newer *session
	tk := &scriptedTakeover{begin: func(uint64) ([]byte, error) {
		// While the previous owner answers, the client connects here
		// under a newer claim and its session is read from the store.
		var err error
		newer, err = b.importSession(t.Context(), sc, id, 9, st)
		newer.releaseHold()
		return state, err
	}}
	b.SetCluster(Cluster{Ownership: own, Takeover: tk})

	moved, _, err := b.takeOverFrom(t.Context(), "previous", sc, "roaming", 7, false, false)
	require.ErrorIs(t, err, errNewerCopy)
	require.False(t, moved)
	require.Same(t, newer, b.session(id), "the newer copy stays")
	require.Equal(t, []uint64{7}, tk.ended, "the previous owner hears the takeover ended")
	b.releases.Wait()
	require.Empty(t, own.released, "no claim is given back")
}

func sessionEpoch(b *Broker, id string) uint64 {
	s := b.session(id)
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.epoch
}

// countingCustody counts handovers and answers each with err (nil: taken).
type countingCustody struct {
	n   atomic.Int32
	err error
}

func (c *countingCustody) Handover(context.Context, string, string) error { c.n.Add(1); return c.err }

// A session whose handover fails stays in the edge's store, and the drain
// does not wait for it as for one whose client took it elsewhere.
func TestBroker_DrainDoesNotWaitForASessionThatStays(t *testing.T) {
	t.Parallel()
	b, addr, stop := openDurable(t, t.TempDir())
	t.Cleanup(stop)
	custody := &countingCustody{err: errors.New("no custodian")}
	b.SetCluster(Cluster{Custody: custody})
	c := mqtttest.Dial(t, addr, 5)
	c.Connect("stays", false, persistentProps)
	waitBound(t, b, b.mustScope(t, "default").ClientID("stays"))
	start := time.Now()
	moved, stayed := b.DrainWith(t.Context(), DrainOptions{})
	require.Equal(t, 0, moved)
	require.Equal(t, 1, stayed)
	require.Equal(t, int32(1), custody.n.Load())
	require.Less(t, time.Since(start), drainHeldWait, "the drain waited for the session that stays")
}

// drainInBackground starts a drain of b and returns a channel closed when
// it ends.
func drainInBackground(b *Broker) <-chan struct{} {
	drained := make(chan struct{})
	go func() {
		defer close(drained)
		b.DrainWith(context.Background(), DrainOptions{})
	}()
	return drained
}

// A drain waits for a session another edge began to take over (its client
// came back there during the drain) until the takeover ends: that edge
// admits the client only once TakeoverEnd answered.
func TestBroker_DrainWaitsForTakeovers(t *testing.T) {
	t.Parallel()
	b, addr, stop := openDurable(t, t.TempDir())
	t.Cleanup(stop)
	custody := &countingCustody{}
	b.SetCluster(Cluster{Custody: custody})
	c := mqtttest.Dial(t, addr, 5)
	c.Connect("mover", false, persistentProps)
	c.Subscribe(1, "a/#", 1)
	id := b.mustScope(t, "default").ClientID("mover")
	epoch := waitBound(t, b, id)
	owned, _, _, err := b.TakeOver(t.Context(), "default", "mover", "edge-new", epoch+1, false)
	require.NoError(t, err)
	require.True(t, owned)

	drained := drainInBackground(b)
	select {
	case <-drained:
		t.Fatal("the drain ended while a takeover was under way")
	case <-time.After(300 * time.Millisecond):
	}
	_, err = b.TakeoverEnd(t.Context(), "default", "mover", epoch+1)
	require.NoError(t, err)
	select {
	case <-drained:
	case <-time.After(5 * time.Second):
		t.Fatal("the drain did not end after the takeover did")
	}
	require.Equal(t, int32(1), custody.n.Load())
}

// grantOwnership grants every claim as grant says.
type grantOwnership func() Grant

func (g grantOwnership) Claim(context.Context, string, string) (Grant, error) { return g(), nil }
func (grantOwnership) Release(context.Context, string, string, uint64) error  { return nil }

// grantsInOrder grants the claims made one after another as grants says,
// the first claim the first grant.
func grantsInOrder(grants []Grant) grantOwnership {
	var mu sync.Mutex
	return func() Grant {
		mu.Lock()
		defer mu.Unlock()
		g := grants[0]
		grants = grants[1:]
		return g
	}
}

// A claim that finds this edge the owner already, of a session it holds no
// copy of, takes the session over from the edge it was taken from: the
// answer to this edge's earlier claim was lost (a leader change), that
// CONNECT was refused, and the session and its connection stayed there
// (invariant 3).
func TestBroker_ClaimAfterLostAnswerTakesOverFromTakenFrom(t *testing.T) {
	t.Parallel()
	b, addr, stop := openDurable(t, t.TempDir())
	t.Cleanup(stop)
	tk := &scriptedTakeover{begin: func(uint64) ([]byte, error) { return nil, nil }}
	b.SetCluster(Cluster{Takeover: tk, Ownership: grantOwnership(func() Grant {
		return Grant{Epoch: 9, Previous: "test", TakenFrom: "other"}
	})})
	c := mqtttest.Dial(t, addr, 5)
	require.Equal(t, packets.CodeSuccess.Code, c.Connect("lost", false, packets.Properties{SessionExpiryInterval: 60, SessionExpiryIntervalFlag: true}).ReasonCode)
	require.Equal(t, []string{"other"}, tk.from)
	waitBound(t, b, b.mustScope(t, "default").ClientID("lost"))

	// Held here, the session is this edge's: no takeover.
	again := mqtttest.Dial(t, addr, 5)
	require.Equal(t, packets.CodeSuccess.Code, again.Connect("lost", false, packets.Properties{SessionExpiryInterval: 60, SessionExpiryIntervalFlag: true}).ReasonCode)
	require.Equal(t, []string{"other"}, tk.from)
}

// A copy this edge holds under a claim older than its latest one, whose
// answer was lost, does not make the session this edge's: another edge
// claimed it between the two, and its takeover found no copy here yet (the
// copy came after, from a CONNECT that the newer claim superseded, and
// stayed). The claim after the lost one takes the session over from the
// edge it was taken from, where its client is still connected (invariant
// 3; CI: storm-031 connected on two edges across a Raft leader change).
func TestBroker_ClaimAfterLostAnswerTakesOverDespiteOlderCopy(t *testing.T) {
	t.Parallel()
	b, addr, stop := openDurable(t, t.TempDir())
	t.Cleanup(stop)
	tk := &scriptedTakeover{begin: func(uint64) ([]byte, error) { return nil, nil }}
	b.SetCluster(Cluster{Takeover: tk, Ownership: grantsInOrder([]Grant{
		{Epoch: 5}, // the copy's claim
		// 7: "other" claims the session (the copy here stays, fenced);
		// 8: this edge's claim, granted by the new leader, its answer lost.
		{Epoch: 9, Previous: "test", PreviousEpoch: 8, TakenFrom: "other"},
		{Epoch: 11, Previous: "test", PreviousEpoch: 9, TakenFrom: "other"},
	})})
	props := packets.Properties{SessionExpiryInterval: 60, SessionExpiryIntervalFlag: true}
	id := b.mustScope(t, "default").ClientID("lost")
	old := mqtttest.Dial(t, addr, 5)
	require.Equal(t, packets.CodeSuccess.Code, old.Connect("lost", false, props).ReasonCode)
	require.Equal(t, uint64(5), waitBound(t, b, id))
	_ = old.Conn.Close()
	waitUnbound(t, b.session(id), "the older copy stays here, offline")
	require.Empty(t, tk.from)

	c := mqtttest.Dial(t, addr, 5)
	require.Equal(t, packets.CodeSuccess.Code, c.Connect("lost", false, props).ReasonCode)
	require.Equal(t, []string{"other"}, tk.from, "the session is taken over from the edge it was taken from")
	require.Equal(t, uint64(9), waitBound(t, b, id))

	// Held here under the latest claim, the session is this edge's: no
	// takeover.
	again := mqtttest.Dial(t, addr, 5)
	require.Equal(t, packets.CodeSuccess.Code, again.Connect("lost", false, props).ReasonCode)
	require.Equal(t, []string{"other"}, tk.from)
}

// A message relayed by the previous owner of a session taken over goes to
// the client before the newer ones that reached the session directly while
// it settled: the client gets them in the order they were published.
func TestBroker_RelayedMessageKeepsItsPlace(t *testing.T) {
	t.Parallel()
	b, target, to, now := relayAfterNewer(t, false, func(*mqtttest.Client) {})
	first := target.Expect(packets.Publish)
	require.Equal(t, "a/old", first.TopicName, "the relayed, older message first")
	require.Equal(t, "a/new", target.Expect(packets.Publish).TopicName)
	require.GreaterOrEqual(t, time.Since(now), handoverSettle-50*time.Millisecond, "the newer one waited for the settle")
	require.Equal(t, 1.0, promtestutil.ToFloat64(b.m.relaysReceived.WithLabelValues("kept")))

	// After the settle, a relay goes when it comes.
	require.NoError(t, b.DeliverRelayed(t.Context(), forwardedMsg(3, "a/late", 1, now.Add(-time.Second)), to))
	require.Equal(t, "a/late", target.Expect(packets.Publish).TopicName)
	require.Equal(t, 1.0, promtestutil.ToFloat64(b.m.relaysReceived.WithLabelValues("late")))
}

// sharedLocal is an edge-local store standing in for the shared one: every
// edge of a test reads what the test stored in it.
type sharedLocal struct{ *durable.Store }

// brokerOnStore is a broker (not serving yet) whose durable state is a
// new store on disk, as wrap presents it; both close when the test ends.
func brokerOnStore(t *testing.T, wrap func(*durable.Store) DurableState) (*Broker, *durable.Store) {
	t.Helper()
	cfg := DefaultConfig()
	cfg.EdgeID = "test"
	b, err := New(cfg, anonymous(), testutil.Logger(t), prometheus.NewRegistry())
	require.NoError(t, err)
	st, err := durable.Open(t.TempDir(), testutil.Logger(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Close(); _ = st.Close() })
	require.NoError(t, b.Restore(wrap(st)))
	return b, st
}

func (sharedLocal) Shared() bool { return true }

// fencedTakeover returns a broker whose store fences every takeover, and the
// transfer state of client's session, subscribed to filter at qos, that
// a takeover here gets from the previous owner.
func fencedTakeover(t *testing.T, client, filter string, qos byte) (*Broker, *tenancy.Scope, string, []byte) {
	t.Helper()
	b, _ := brokerOnStore(t, func(st *durable.Store) DurableState { return fencedShared{sharedLocal{st}} })
	sc := b.mustScope(t, "default")
	id := sc.ClientID(client)
	inner, _ := sc.Filter(filter)
	state, err := durable.EncodeTransfer(durable.SessionState{Session: durable.Session{ID: id, ProtocolVersion: 5, ExpiryInterval: 300},
		Subs: []durable.Subscription{{Filter: inner, QoS: qos}}})
	require.NoError(t, err)
	return b, sc, id, state
}

// serveTCP serves MQTT from b on a free loopback port and returns its address.
func serveTCP(t testing.TB, b *Broker) string {
	t.Helper()
	l := newTCP("127.0.0.1:0")
	require.NoError(t, b.AddListener(l))
	require.NoError(t, b.Serve())
	return l.Address()
}

// servingOnSharedStore is brokerOnStore on a sharedLocal store, serving
// MQTT on addr.
func servingOnSharedStore(t *testing.T) (*Broker, *durable.Store, string) {
	t.Helper()
	b, st := brokerOnStore(t, func(st *durable.Store) DurableState { return sharedLocal{st} })
	addr := serveTCP(t, b)
	return b, st, addr
}

// A takeover that fails after the previous owner gave the session up (here
// End fails) refuses the CONNECT, but the session stays with this edge, its
// owner at the coordinator: resumed from the shared store, offline, with
// its routes, it queues for its client instead of leaving a gap in which
// what is published for it reaches no edge.
func TestBroker_IncompleteTakeoverResumesFromTheStore(t *testing.T) {
	t.Parallel()
	b, st, addr := servingOnSharedStore(t)

	id := b.mustScope(t, "default").ClientID("mover")
	rec := durable.Session{ID: id, ProtocolVersion: 5, ExpiryInterval: 300}
	require.NoError(t, st.PutSession(t.Context(), rec))
	require.NoError(t, st.PutSubscription(t.Context(), id, durable.Subscription{Filter: b.mustScope(t, "default").Topic("s/#"), QoS: 1}))
	state, err := durable.EncodeTransfer(durable.SessionState{Session: rec})
	require.NoError(t, err)
	var added atomic.Int32
	routes := &fakeRoutes{add: func(_, filter, _ string) error {
		if filter == "s/#" {
			added.Add(1)
		}
		return nil
	}}
	tk := &failingEnd{scriptedTakeover{begin: func(uint64) ([]byte, error) { return state, nil }}}
	b.SetCluster(Cluster{Routes: routes, Takeover: tk, Ownership: grantOwnership(func() Grant {
		return Grant{Epoch: 9, Previous: "other"}
	})})

	c := mqtttest.Dial(t, addr, 5)
	require.Equal(t, packets.ErrServerUnavailable.Code, c.Connect("mover", false, persistentProps).ReasonCode)
	s := b.session(id)
	require.NotNil(t, s, "the session stays here")
	require.Equal(t, uint64(9), sessionEpoch(b, id))
	require.False(t, s.online.Load(), "offline until its client comes back")
	require.Positive(t, added.Load(), "its routes are registered here")
}

// fencedShared is a shared store in which a newer claim holds every
// session: activating one is refused as fenced.
type fencedShared struct{ sharedLocal }

func (fencedShared) Activate(context.Context, string, uint64) error {
	return fmt.Errorf("activate: %w", durable.ErrFenced)
}

// A failed takeover whose session a newer claim took elsewhere (its client
// connected to another edge) is not left unfinished here: listed, it
// would hold a dead previous owner's routes for the whole adoption wait,
// and every publish would find the dead edge's route meanwhile.
func TestBroker_SupersededUnfinishedTakeoverIsSettled(t *testing.T) {
	t.Parallel()
	b, st := brokerOnStore(t, func(st *durable.Store) DurableState { return fencedShared{sharedLocal{st}} })
	sc := b.mustScope(t, "default")
	id := sc.ClientID("moved-on")
	require.NoError(t, st.PutSession(t.Context(), durable.Session{ID: id, ProtocolVersion: 5, ExpiryInterval: 300}))
	b.SetCluster(Cluster{Routes: &fakeRoutes{add: func(string, string, string) error { return nil }}})
	b.setUnfinished(id, unfinishedTakeover{previous: "edge-dead", epoch: 30, scope: sc, clientID: "moved-on"})
	_, from := b.ClaimsSettled()
	require.Equal(t, []string{"edge-dead"}, from)
	here, settled := b.resumeOwned(sc, "moved-on", 30, "edge-dead")
	require.False(t, here)
	require.True(t, settled, "the caller does not list it unfinished again")
	_, from = b.ClaimsSettled()
	require.Empty(t, from, "the newer claim settled it")
}

// failingEnd is a scripted takeover whose End fails.
type failingEnd struct{ scriptedTakeover }

func (f *failingEnd) End(context.Context, string, string, string, uint64) (TakeoverEnded, error) {
	return TakeoverEnded{}, errors.New("previous owner stopped")
}

// A message the previous owner queued after Begin, but before its store
// read for Begin, comes both in the stored state and in the late list. It
// is queued once: a second copy would be sent twice, the second time as a
// store entry whose message may be freed by then (refused as invalid,
// and the client dropped).
func TestBroker_TakeoverLateCopyOfStoredMessageQueuedOnce(t *testing.T) {
	t.Parallel()
	b, sc, id, st := storedSession(t, "overlap")
	m := &durable.Message{ID: "edge-2/1/1635", Topic: sc.Topic("t/p"), Payload: []byte("x"), QoS: 1, Created: 1}
	st.Subs = []durable.Subscription{{Filter: sc.Topic("t/#"), QoS: 1}}
	st.Queue = []durable.Entry{{Seq: 41, MsgID: m.ID, QoS: 1, Msg: m}}
	state, err := durable.EncodeTransfer(st)
	require.NoError(t, err)
	late, err := durable.EncodeTransfer(durable.SessionState{Session: durable.Session{ID: id},
		Queue: []durable.Entry{{Seq: 7, MsgID: m.ID, QoS: 1, Msg: m}}})
	require.NoError(t, err)
	b.SetCluster(Cluster{Takeover: &scriptedTakeover{begin: func(uint64) ([]byte, error) { return state, nil }, late: late}})
	moved, _, err := b.takeOverFrom(t.Context(), "edge-3", sc, "overlap", 5, false, false)
	require.NoError(t, err)
	require.True(t, moved)
	s := b.session(id)
	s.mu.Lock()
	defer s.mu.Unlock()
	require.Equal(t, 1, s.queue.len(), "the message in both is queued once")
}

// A session imported while messages are published to its subscriptions
// (a takeover under load): none is lost or left half-queued, because the
// session takes messages only once it is whole. Run with -race, the
// import's own queue and a publisher's would otherwise be written at once.
func TestBroker_ImportWhilePublishing(t *testing.T) {
	t.Parallel()
	b, sc, id, st := storedSession(t, "busy")
	filter, _ := sc.Filter("busy/#")
	st.Subs = []durable.Subscription{{Filter: filter, QoS: 1}}
	const stored = 5000
	for i := range stored {
		m := &durable.Message{ID: fmt.Sprintf("prev/1/%d", i+1), Topic: sc.Topic("busy/old"), Payload: []byte("old"), QoS: 1}
		st.Queue = append(st.Queue, durable.Entry{Seq: uint64(i + 1), MsgID: m.ID, QoS: 1, Msg: m})
	}
	stop := make(chan struct{})
	var published atomic.Int64
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := b.Publish(sc.Tenant(), "busy/new", []byte("new"), 1, false); err == nil {
				published.Add(1)
			}
		}
	})
	time.Sleep(20 * time.Millisecond) // the publisher is running
	s, err := b.importSession(t.Context(), sc, id, 7, st)
	require.NoError(t, err)
	s.releaseHold()
	close(stop)
	wg.Wait()
	s.mu.Lock()
	defer s.mu.Unlock()
	old, fresh := 0, 0
	for i := range s.queue.len() {
		d := s.queue.at(i)
		require.NotNil(t, d.msg, "queue entry %d of %d has no message", i, s.queue.len())
		switch string(d.msg.Payload) {
		case "old":
			old++
		case "new":
			fresh++
		}
	}
	t.Logf("queued: %d stored entries, %d of %d messages published meanwhile", old, fresh, published.Load())
	require.Equal(t, stored, old, "every stored entry is queued")
	require.LessOrEqual(t, fresh, int(published.Load()), "no published message is queued twice")
}

// A session that moves takes its memory of the QoS 2 messages it took
// along: a resend of one under its msgID (the publisher was not
// acknowledged because another recipient failed) is not delivered again
// on the edge the session moved to, while a new message is.
func TestBroker_ImportKeepsQoS2Memory(t *testing.T) {
	t.Parallel()
	b, sc, id, st := storedSession(t, "once")
	filter, _ := sc.Filter("q/#")
	st.Subs = []durable.Subscription{{Filter: filter, QoS: 2}}
	st.TookQoS2 = []string{"other/1/7"}
	s, err := b.importSession(t.Context(), sc, id, 7, st)
	require.NoError(t, err)
	s.releaseHold()
	require.NoError(t, b.DeliverForwarded(t.Context(), forwardedMsg(7, "q/x", 2, time.Now()), SharedChoice{}))
	require.NoError(t, b.DeliverForwarded(t.Context(), forwardedMsg(8, "q/x", 2, time.Now()), SharedChoice{}))
	s.mu.Lock()
	var queued []uint64
	for i := range s.queue.len() {
		queued = append(queued, s.queue.at(i).msg.ID.Seq)
	}
	took := s.tookIDsLocked(nil)
	s.mu.Unlock()
	require.Equal(t, []uint64{8}, queued, "the resend of 7 is not delivered again")
	require.Equal(t, []string{"other/1/7", "other/1/8"}, took)

	// Taken over from here, the session hands the memory on, at Begin and
	// with the late messages at End.
	require.NoError(t, b.store.PutSession(t.Context(), st.Session))
	owned, _, state, err := b.TakeOver(t.Context(), "default", "once", "edge-new", 9, false)
	require.NoError(t, err)
	require.True(t, owned)
	begun, err := durable.DecodeTransfer(state)
	require.NoError(t, err)
	require.Equal(t, took, begun.TookQoS2)
	require.NoError(t, b.DeliverForwarded(t.Context(), forwardedMsg(9, "q/x", 2, time.Now()), SharedChoice{}))
	late, err := b.TakeoverEnd(t.Context(), "default", "once", 9)
	require.NoError(t, err)
	ended, err := durable.DecodeTransfer(late)
	require.NoError(t, err)
	require.Equal(t, []string{"other/1/7", "other/1/8", "other/1/9"}, ended.TookQoS2)

	// The new owner queues the late message, which its memory names too,
	// and then remembers it.
	nb, nsc, nid, _ := storedSession(t, "once")
	begun.Session.ID = nid
	ns, err := nb.importSession(t.Context(), nsc, nid, 9, begun)
	require.NoError(t, err)
	require.NoError(t, nb.mergeLate(nid, late))
	ns.releaseHold()
	ns.mu.Lock()
	defer ns.mu.Unlock()
	var last uint64
	for i := range ns.queue.len() {
		last = ns.queue.at(i).msg.ID.Seq
	}
	require.Equal(t, uint64(9), last, "the late message is queued")
	require.True(t, ns.took.has(MsgID{Edge: "other", Incarnation: 1, Seq: 9}))
}

// ownerAt is an ownership that says edge owns every session under epoch.
type ownerAt struct {
	fakeOwnership
	edge  string
	epoch uint64
}

func (o ownerAt) Owner(context.Context, string, string) (string, uint64, error) {
	return o.edge, o.epoch, nil
}

// A copy fenced by a newer owner that resumed the session beside it (its
// takeover went elsewhere) hands that owner the messages published before
// and routed here: they are relayed to it, as for a handover, not taken
// here by no session once the copy is gone.
func TestBroker_FencedCopyRelaysToTheOwner(t *testing.T) {
	t.Parallel()
	b, sc, id, st := storedSession(t, "orphan")
	filter, _ := sc.Filter("orphan/#")
	st.Subs = []durable.Subscription{{Filter: filter, QoS: 1}}
	s, err := b.importSession(t.Context(), sc, id, 7, st)
	require.NoError(t, err)
	s.releaseHold()
	b.SetCluster(Cluster{Ownership: ownerAt{edge: "edge-9", epoch: 12}})
	before := time.Now().UnixNano()

	require.True(t, b.yieldIfFenced(s, fmt.Errorf("enqueue: %w", durable.ErrFenced)))
	b.releases.Wait()
	require.Nil(t, b.session(id), "the fenced copy is given up")
	m := &Message{Topic: sc.Topic("orphan/x"), QoS: 1, Created: before}
	rs := b.handed.relays(m, time.Now(), nil)
	require.Len(t, rs, 1, "a message published before is relayed")
	require.Equal(t, "edge-9", rs[0].to)
	require.Equal(t, uint64(12), rs[0].targets[0].Epoch)
	later := &Message{Topic: sc.Topic("orphan/x"), QoS: 1, Created: time.Now().Add(time.Second).UnixNano()}
	require.Empty(t, b.handed.relays(later, time.Now(), nil), "one published after is routed to the owner directly")
}

// When the previous owner was still storing forwarded frames at the
// handover, newer messages wait past handoverSettle: a relay that comes
// two seconds late still goes first.
func TestBroker_RelayBehindLandingFramesKeepsItsPlace(t *testing.T) {
	t.Parallel()
	_, target, _, now := relayAfterNewer(t, true, func(target *mqtttest.Client) {
		_, err := target.Read(2 * handoverSettle)
		require.Error(t, err, "the newer message waits past handoverSettle")
	})
	require.Equal(t, "a/old", target.Expect(packets.Publish).TopicName, "the relayed, older message first")
	require.Equal(t, "a/new", target.Expect(packets.Publish).TopicName)
	require.Less(t, time.Since(now), handoverSettleLanding+time.Second)
}

// relayAfterNewer takes a session over (from an edge whose frames were
// landing, or not), delivers a message published after the handover, runs
// between, and then relays an older one; it returns the target's client and
// the relay's targets.
func relayAfterNewer(t *testing.T, landing bool, between func(*mqtttest.Client)) (*Broker, *mqtttest.Client, []RelayTarget, time.Time) {
	t.Helper()
	now := time.Now()
	b, _, target, s, epoch := takenOverTarget(t, now)
	s.settleAfterTakeover(now, landing)
	newer := forwardedMsg(1, "a/new", 1, time.Now().Add(handoverSkew+time.Millisecond))
	require.NoError(t, b.DeliverForwarded(t.Context(), newer, SharedChoice{}))
	between(target)
	older := forwardedMsg(2, "a/old", 1, now.Add(-time.Second))
	to := []RelayTarget{{Tenant: "default", ClientID: "target", Epoch: epoch, QoS: 1}}
	require.NoError(t, b.DeliverRelayed(t.Context(), older, to))
	return b, target, to, now
}

// A session resumed from the store after its edge died, with no handover,
// still drops a resend of a QoS 2 message it took: the store remembers the
// msgIDs, and keeps them after the delivery's entry is gone.
func TestBroker_StoredQoS2MemoryOutlivesItsEdge(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	b, _, stop := openDurable(t, dir)
	t.Cleanup(stop)
	sc := b.mustScope(t, "default")
	id := sc.ClientID("once")
	filter, _ := sc.Filter("q/#")
	st := durable.SessionState{Session: durable.Session{ID: id, ExpiryInterval: 300}, Subs: []durable.Subscription{{Filter: filter, QoS: 2}}}
	require.NoError(t, b.store.PutSession(t.Context(), st.Session))
	require.NoError(t, b.store.PutSubscription(t.Context(), id, st.Subs[0]))
	s, err := b.importSession(t.Context(), sc, id, 7, st)
	require.NoError(t, err)
	s.releaseHold()
	require.NoError(t, b.DeliverForwarded(t.Context(), forwardedMsg(7, "q/x", 2, time.Now()), SharedChoice{}))
	// Delivered and completed: its entry leaves the store.
	s.mu.Lock()
	seq := s.queue.at(0).seq
	s.mu.Unlock()
	require.NoError(t, b.store.Dequeue(t.Context(), id, []durable.Entry{{Seq: seq, MsgID: "other/1/7"}}))
	stored, ok, err := b.store.LoadSession(t.Context(), id)
	require.NoError(t, err)
	require.True(t, ok)
	require.Empty(t, stored.Queue)
	require.Equal(t, []string{"other/1/7"}, stored.TookQoS2)
	stop()

	// The next edge resumes the session from the store alone.
	nb, _, nstop := openDurable(t, dir)
	t.Cleanup(nstop)
	ns := nb.session(id)
	require.NotNil(t, ns)
	require.NoError(t, nb.DeliverForwarded(t.Context(), forwardedMsg(7, "q/x", 2, time.Now()), SharedChoice{}))
	require.NoError(t, nb.DeliverForwarded(t.Context(), forwardedMsg(8, "q/x", 2, time.Now()), SharedChoice{}))
	ns.mu.Lock()
	defer ns.mu.Unlock()
	var queued []uint64
	for i := range ns.queue.len() {
		queued = append(queued, ns.queue.at(i).msg.ID.Seq)
	}
	require.Equal(t, []uint64{8}, queued, "the resend of 7 is not delivered again")
}

// recordingRoutes fails the Add of number failAt (1-based) with err and
// records which filters were added and removed.
type recordingRoutes struct {
	failAt int
	err    error

	mu             sync.Mutex
	added, removed []string
}

func (r *recordingRoutes) Add(_ context.Context, _, filter, _ string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.added = append(r.added, filter)
	if len(r.added) == r.failAt {
		return r.err
	}
	return nil
}

func (r *recordingRoutes) Remove(_ context.Context, _, filter, _ string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.removed = append(r.removed, filter)
	return nil
}

// An import whose routes fail part way removes the routes it counted and
// no others: a route it never added may be counted by another session of
// this edge on the same filter, which a Remove would take from it. One not
// confirmed in time is counted (it may still land); one refused is not.
func TestBroker_FailedImportRemovesOnlyItsRoutes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name        string
		err         error
		failedGoes  bool
		wantRemoved int
	}{
		{"unconfirmed", context.DeadlineExceeded, true, 2},
		{"refused", fmt.Errorf("%w: wildcard cap", ErrRouteRefused), false, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b, sc, id, st := storedSession(t, "partial")
			for _, f := range []string{"a/#", "b/#", "c/#"} {
				filter, _ := sc.Filter(f)
				st.Subs = append(st.Subs, durable.Subscription{Filter: filter, QoS: 1})
			}
			routes := &recordingRoutes{failAt: 2, err: tc.err}
			b.SetCluster(Cluster{Routes: routes})
			_, err := b.importSession(t.Context(), sc, id, 7, st)
			require.ErrorIs(t, err, tc.err)
			routes.mu.Lock()
			defer routes.mu.Unlock()
			require.Len(t, routes.added, 2)
			want := routes.added[:1]
			if tc.failedGoes {
				want = routes.added
			}
			require.ElementsMatch(t, want, routes.removed)
			require.Len(t, routes.removed, tc.wantRemoved)
			require.Nil(t, b.session(id), "nothing half-imported stays")
		})
	}
}

// A takeover whose session a newer claim took while the copy was being
// made (Activate is fenced after the previous owner ended its side) leaves
// the copy's messages to the newer owner: the copy's routes drew messages
// published before that owner was routed to, the copy refused them, and
// sent again they must not find no session here.
func TestBroker_FencedTakeoverRelaysToTheOwner(t *testing.T) {
	t.Parallel()
	b, sc, id, state := fencedTakeover(t, "contested", "c/#", 1)
	b.SetCluster(Cluster{Routes: &fakeRoutes{add: func(string, string, string) error { return nil }},
		Takeover:  &scriptedTakeover{begin: func(uint64) ([]byte, error) { return state, nil }},
		Ownership: ownerAt{edge: "edge-new", epoch: 21}})
	before := time.Now().UnixNano()
	_, _, err := b.takeOverFrom(t.Context(), "edge-prev", sc, "contested", 20, false, false)
	require.ErrorIs(t, err, durable.ErrFenced)
	require.Nil(t, b.session(id), "no copy stays")
	rs := b.handed.relays(&Message{Topic: sc.Topic("c/x"), QoS: 1, Created: before}, time.Now(), nil)
	require.Len(t, rs, 1, "what was published meanwhile goes to the newer owner")
	require.Equal(t, "edge-new", rs[0].to)
	require.Equal(t, uint64(21), rs[0].targets[0].Epoch)
}

// slowRemoval is a route table whose removals take a while.
type slowRemoval struct{ fakeRoutes }

func (r *slowRemoval) Remove(ctx context.Context, tenant, filter, group string) error {
	time.Sleep(300 * time.Millisecond)
	return r.fakeRoutes.Remove(ctx, tenant, filter, group)
}

// The fenced copy's routes draw messages until they are gone, which can be
// well after the fence was seen: what entered the cluster until then is
// relayed too.
func TestBroker_FencedTakeoverRelaysUntilItsRoutesAreGone(t *testing.T) {
	t.Parallel()
	b, sc, _, state := fencedTakeover(t, "slow-gone", "s/#", 1)
	b.SetCluster(Cluster{Routes: &slowRemoval{fakeRoutes{add: func(string, string, string) error { return nil }}},
		Takeover:  &scriptedTakeover{begin: func(uint64) ([]byte, error) { return state, nil }},
		Ownership: ownerAt{edge: "edge-new", epoch: 21}})
	_, _, err := b.takeOverFrom(t.Context(), "edge-prev", sc, "slow-gone", 20, false, false)
	require.ErrorIs(t, err, durable.ErrFenced)
	late := time.Now().Add(-time.Millisecond).UnixNano() // after the fence, before the routes went
	rs := b.handed.relays(&Message{Topic: sc.Topic("s/x"), QoS: 1, Created: late}, time.Now(), nil)
	require.Len(t, rs, 1, "published while the copy's routes were still up")
	require.Len(t, rs[0].targets, 1)
	require.Empty(t, b.handed.relays(&Message{Topic: sc.Topic("s/x"), QoS: 1, Created: time.Now().Add(time.Second).UnixNano()}, time.Now(), nil))
}

// A relay for a session whose connection here holds its claim but has not
// made its copy yet is refused, for the sender to send again: taken as
// for a session that moved on, it would reach no copy.
func TestBroker_RelayWaitsForAConnectingSession(t *testing.T) {
	t.Parallel()
	b, _ := brokerOnStore(t, func(st *durable.Store) DurableState { return sharedLocal{st} })
	sc := b.mustScope(t, "default")
	id := sc.ClientID("arriving")
	to := []RelayTarget{{Tenant: "default", ClientID: "arriving", Epoch: 21, QoS: 1}}
	m := forwardedMsg(1, "a/x", 1, time.Now())
	require.NoError(t, b.DeliverRelayed(t.Context(), m, to), "no connection: the session moved on")
	g := b.guardClaim(id)
	require.Error(t, b.DeliverRelayed(t.Context(), m, to), "its claim may be the one meant")
	require.False(t, g.granted(21))
	require.Error(t, b.DeliverRelayed(t.Context(), m, to))
	b.dropGuard(id, g)
	older := b.guardClaim(id)
	defer b.dropGuard(id, older)
	require.False(t, older.granted(20))
	require.NoError(t, b.DeliverRelayed(t.Context(), m, to), "a connection under an older claim is not the one meant")
}

// unreachableOwner grants every claim as grant says; its owner lookup
// waits, as for a coordinator that does not answer, until reachable is
// set, and then names edge the owner of every session under epoch.
type unreachableOwner struct {
	grant     Grant
	edge      string
	epoch     uint64
	reachable atomic.Bool
	lookups   atomic.Int32
}

func (o *unreachableOwner) Claim(context.Context, string, string) (Grant, error) { return o.grant, nil }
func (*unreachableOwner) Release(context.Context, string, string, uint64) error  { return nil }

func (o *unreachableOwner) Owner(ctx context.Context, _, _ string) (string, uint64, error) {
	o.lookups.Add(1)
	for !o.reachable.Load() {
		select {
		case <-ctx.Done():
			return "", 0, ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
	return o.edge, o.epoch, nil
}

// A fenced takeover copy whose newer owner the coordinator cannot name yet
// does not let the messages routed to it go to nobody: they are refused,
// for their senders to send again, until the owner is known, and then
// relayed to it. The lookup made inside the CONNECT ends with the
// CONNECT's deadline, not the edge's stop.
func TestBroker_FencedTakeoverRefusesUntilItsOwnerIsKnown(t *testing.T) {
	t.Parallel()
	b, _, id, state := fencedTakeover(t, "unowned", "u/#", 1)
	b.cfg.ConnectTimeout = 500 * time.Millisecond
	own := &unreachableOwner{grant: Grant{Epoch: 20, Previous: "edge-prev"}, edge: "edge-new", epoch: 21}
	peers := &relayingPeers{}
	b.SetCluster(Cluster{Routes: &fakeRoutes{add: func(string, string, string) error { return nil }},
		Takeover: &scriptedTakeover{begin: func(uint64) ([]byte, error) { return state, nil }}, Ownership: own, Peers: peers})
	addr := serveTCP(t, b)

	before := time.Now()
	c := mqtttest.Dial(t, addr, 5)
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, Properties: persistentProps,
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Keepalive: 30, ClientIdentifier: "unowned"}})
	ack, err := c.Read(10 * time.Second)
	require.NoError(t, err)
	require.Equal(t, packets.Connack, ack.FixedHeader.Type)
	require.Equal(t, packets.ErrServerUnavailable.Code, ack.ReasonCode)
	require.Less(t, time.Since(before), 3*time.Second, "the owner lookup ends with the CONNECT's deadline")
	require.Positive(t, own.lookups.Load())
	require.Nil(t, b.session(id), "the fenced copy is gone")

	m := forwardedMsg(1, "u/x", 1, before)
	require.Error(t, b.DeliverForwarded(t.Context(), m, SharedChoice{}), "not taken while nobody is known to relay it to")
	require.Empty(t, peers.calls())

	own.reachable.Store(true)
	require.Eventually(t, func() bool { return b.DeliverForwarded(t.Context(), m, SharedChoice{}) == nil },
		5*time.Second, 10*time.Millisecond, "relayed once the owner is known")
	calls := peers.calls()
	require.Len(t, calls, 1)
	require.Equal(t, "edge-new", calls[0].edge)
	require.Equal(t, uint64(21), calls[0].targets[0].Epoch)
}

// sharedReportLog records the outcomes of group messages reported to
// their origins.
type sharedReportLog struct {
	mu       sync.Mutex
	outcomes []ShareOutcome
}

func (r *sharedReportLog) ReportShared(_ ShareOrigin, _ *Message, _ GroupKey, o ShareOutcome) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.outcomes = append(r.outcomes, o)
	return true
}

func (r *sharedReportLog) reported() []ShareOutcome {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.outcomes)
}

// A shared-group message chosen for this edge because of a fenced copy's
// membership, refused by the copy and sent again once it is gone, finds
// no member of the group here: it is relayed to the session's newer
// owner, as a plain subscription's is, and not taken by nobody (QoS 2, or
// a QoS 1 one its origin does not keep). One its origin keeps is reported
// acknowledged once the owner took it, not re-dispatched as well.
func TestBroker_FencedTakeoverRelaysItsGroupMessages(t *testing.T) {
	for _, tc := range []struct {
		name   string
		qos    uint32
		origin *ShareOrigin
		want   []ShareOutcome
	}{
		{"qos2", 2, nil, nil},
		{"qos1_unkept", 1, nil, nil},
		{"qos1_kept", 1, &ShareOrigin{Edge: "edge-pub", Incarnation: 1}, []ShareOutcome{ShareAcked}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b, sc, id, state := fencedTakeover(t, "member", "$share/g/s/#", 2)
			peers, reports := &relayingPeers{}, &sharedReportLog{}
			b.SetCluster(Cluster{Routes: &fakeRoutes{add: func(string, string, string) error { return nil }},
				Takeover:  &scriptedTakeover{begin: func(uint64) ([]byte, error) { return state, nil }},
				Ownership: ownerAt{edge: "edge-new", epoch: 21}, Peers: peers, Reports: reports})
			before := time.Now()
			_, _, err := b.takeOverFrom(t.Context(), "edge-prev", sc, "member", 20, false, false)
			require.ErrorIs(t, err, durable.ErrFenced)
			require.Nil(t, b.session(id))

			choice := SharedChoice{Chosen: true, Groups: []GroupKey{{Name: "g", Filter: "s/#"}}, Origin: tc.origin}
			require.NoError(t, b.DeliverForwarded(t.Context(), forwardedMsg(1, "s/x", tc.qos, before), choice))
			calls := peers.calls()
			require.Len(t, calls, 1, "relayed to the member's newer owner")
			require.Equal(t, "edge-new", calls[0].edge)
			require.Equal(t, []RelayTarget{{Tenant: "default", ClientID: "member", Epoch: 21, QoS: byte(tc.qos)}}, calls[0].targets)
			require.Equal(t, tc.want, reports.reported())

			// A group this edge was not chosen for is not relayed; nor is
			// a message published after the copy's routes were gone.
			require.NoError(t, b.DeliverForwarded(t.Context(), forwardedMsg(2, "s/x", tc.qos, before), SharedChoice{Chosen: true}))
			require.NoError(t, b.DeliverForwarded(t.Context(), forwardedMsg(3, "s/x", tc.qos, time.Now().Add(time.Second)), choice))
			require.Len(t, peers.calls(), 1)
		})
	}
}

// A forwarded message that must be relayed to a session whose owner is not
// known yet is refused before any recipient here gets it: sent again (and
// again, until the owner is known), it reaches each of them once, not once
// per attempt (a QoS 2 group message to two members, a QoS 1 one twice).
func TestBroker_OwnerUnknownRefusalDeliversNothingHere(t *testing.T) {
	for _, tc := range []struct {
		name   string
		qos    uint32
		filter string // the local recipient's
		choice SharedChoice
	}{
		{"plain_qos1", 1, "u/#", SharedChoice{}},
		{"group_qos2", 2, "$share/here/u/#", SharedChoice{Chosen: true, Groups: []GroupKey{{Name: "here", Filter: "u/#"}, {Name: "gone", Filter: "u/#"}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b, addr := startBroker(t, nil)
			peers := &relayingPeers{}
			b.SetCluster(Cluster{Peers: peers})
			local := mqtttest.Dial(t, addr, 5)
			local.Connect("local", true, packets.Properties{})
			local.Subscribe(1, tc.filter, 2)

			// A fenced copy, gone, whose owner the coordinator has not named.
			sc := b.mustScope(t, "default")
			gone := &session{id: sc.ClientID("gone"), scope: sc, subs: map[string]*subscription{
				"p": {filter: sc.Topic("u/#"), full: sc.Topic("u/#"), qos: 2},
				"g": {filter: sc.Topic("u/#"), full: "$share/gone/" + sc.Topic("u/#"), qos: 2, group: &shareGroup{name: "gone", filter: sc.Topic("u/#")}},
			}}
			at := time.Now()
			b.handed.add(gone, at, "", 0)

			m := forwardedMsg(1, "u/x", tc.qos, at.Add(-time.Second))
			for range 3 {
				require.ErrorIs(t, b.DeliverForwarded(t.Context(), m, tc.choice), errOwnerUnknown)
			}
			expectNothing(t, local, 200*time.Millisecond)
			require.Empty(t, peers.calls())

			b.handed.resolve(gone.id, "edge-new", 21)
			require.NoError(t, b.DeliverForwarded(t.Context(), m, tc.choice))
			require.Equal(t, "u/x", local.Expect(packets.Publish).TopicName)
			expectNothing(t, local, 200*time.Millisecond)
			calls := peers.calls()
			require.NotEmpty(t, calls)
			for _, c := range calls {
				require.Equal(t, "edge-new", c.edge, "relayed to the owner alone, once it is known")
			}
		})
	}
}

// A relay for sessions here and for one that moved on to an edge not
// known yet is refused before the sessions here get it: sent again, it
// reaches them once.
func TestBroker_OwnerUnknownRefusalOfARelayDeliversNothingHere(t *testing.T) {
	t.Parallel()
	b, _, target, _, epoch := takenOverTarget(t, time.Now())
	peers := &relayingPeers{}
	b.SetCluster(Cluster{Peers: peers})
	sc := b.mustScope(t, "default")
	gone := &session{id: sc.ClientID("gone"), scope: sc, subs: map[string]*subscription{"a": {filter: sc.Topic("a/#"), full: sc.Topic("a/#"), qos: 1}}}
	at := time.Now()
	b.handed.add(gone, at, "", 0)

	m := forwardedMsg(1, "a/x", 1, at.Add(-time.Second))
	to := []RelayTarget{{Tenant: "default", ClientID: "target", Epoch: epoch, QoS: 1}, {Tenant: "default", ClientID: "gone", Epoch: 3, QoS: 1}}
	for range 3 {
		require.ErrorIs(t, b.DeliverRelayed(t.Context(), m, to), errOwnerUnknown)
	}
	expectNothing(t, target, 200*time.Millisecond)
	b.handed.resolve(gone.id, "edge-new", 21)
	require.NoError(t, b.DeliverRelayed(t.Context(), m, to))
	require.Equal(t, "a/x", target.Expect(packets.Publish).TopicName)
	expectNothing(t, target, 200*time.Millisecond)
	require.Len(t, peers.calls(), 1)
}

// ctxOwner names edge the owner of every session under epoch, unless the
// lookup's context has ended (a coordinator call made on it fails at once).
type ctxOwner struct {
	fakeOwnership
	edge  string
	epoch uint64
}

func (o ctxOwner) Owner(ctx context.Context, _, _ string) (string, uint64, error) {
	if err := ctx.Err(); err != nil {
		return "", 0, err
	}
	return o.edge, o.epoch, nil
}

// deadlineEnd is a scripted takeover whose End waits for the CONNECT's
// deadline and fails with it.
type deadlineEnd struct{ scriptedTakeover }

func (f *deadlineEnd) End(ctx context.Context, _, _, _ string, _ uint64) (TakeoverEnded, error) {
	<-ctx.Done()
	return TakeoverEnded{}, ctx.Err()
}

// A takeover that failed because its CONNECT's deadline passed still
// names the fenced copy's owner when the coordinator answers: the lookup
// does not run on the expired deadline (failing at once and refusing what
// the copy's routes drew until a background lookup succeeds).
func TestBroker_FencedTakeoverPastItsDeadlineStillFindsTheOwner(t *testing.T) {
	t.Parallel()
	b, _ := brokerOnStore(t, func(st *durable.Store) DurableState { return sharedLocal{st} })
	b.cfg.ConnectTimeout = 300 * time.Millisecond
	sc := b.mustScope(t, "default")
	id := sc.ClientID("late")
	filter, _ := sc.Filter("l/#")
	state, err := durable.EncodeTransfer(durable.SessionState{Session: durable.Session{ID: id, ProtocolVersion: 5, ExpiryInterval: 300},
		Subs: []durable.Subscription{{Filter: filter, QoS: 1}}})
	require.NoError(t, err)
	b.SetCluster(Cluster{Routes: &fakeRoutes{add: func(string, string, string) error { return nil }},
		Takeover:  &deadlineEnd{scriptedTakeover{begin: func(uint64) ([]byte, error) { return state, nil }}},
		Ownership: ctxOwner{edge: "edge-new", epoch: 21}})
	before := time.Now().UnixNano()
	ctx, cancel := context.WithTimeout(t.Context(), b.cfg.ConnectTimeout)
	defer cancel()
	_, _, err = b.takeOverFrom(ctx, "edge-prev", sc, "late", 20, false, false)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Nil(t, b.session(id), "no copy stays")
	rs := b.handed.relays(&Message{Topic: sc.Topic("l/x"), QoS: 1, Created: before}, time.Now(), nil)
	require.Len(t, rs, 1)
	require.Equal(t, "edge-new", rs[0].to, "the owner is named, nothing is refused")
}

// enqueueGate is a real durable store whose Enqueue for session id waits
// until release is closed (entered says one started).
type enqueueGate struct {
	*durable.Store
	id      string
	entered chan struct{}
	release chan struct{}
	open    func() // closes release, once
}

// gatedBroker serves MQTT from a broker whose store holds the writes of
// gate.id's queue until gate.open.
func gatedBroker(t *testing.T) (*Broker, *enqueueGate, string) {
	t.Helper()
	gate := &enqueueGate{entered: make(chan struct{}, 1), release: make(chan struct{})}
	gate.open = sync.OnceFunc(func() { close(gate.release) })
	b, _ := brokerOnStore(t, func(st *durable.Store) DurableState { gate.Store = st; return gate })
	t.Cleanup(gate.open) // before the broker closes: a failed test does not hang
	return b, gate, serveTCP(t, b)
}

func (s *enqueueGate) Enqueue(id string, e durable.Entry) *durable.Pending {
	if id == s.id {
		select {
		case s.entered <- struct{}{}:
		default:
		}
		<-s.release
	}
	return s.Store.Enqueue(id, e)
}

// A group member handed over from here while a forwarded message of its
// group is being delivered here (a recipient's store write holds the
// delivery up) does not get it relayed when the group got a member here:
// the group's message goes to one member (a QoS 2 one to two would break
// invariant 2).
func TestBroker_HandoverDuringDeliveryDoesNotRelayAServedGroup(t *testing.T) {
	t.Parallel()
	b, gate, addr := gatedBroker(t)
	peers := &relayingPeers{}
	b.SetCluster(Cluster{Peers: peers})
	sc := b.mustScope(t, "default")
	gate.id = sc.ClientID("slow")
	persistentSubscriber(t, addr, "slow", "g/#")
	member := mqtttest.Dial(t, addr, 5)
	member.Connect("member", true, packets.Properties{})
	member.Subscribe(1, "$share/G/g/#", 2)

	m := forwardedMsg(1, "g/x", 2, time.Now().Add(-time.Second))
	done := make(chan error, 1)
	go func() {
		done <- b.DeliverForwarded(context.Background(), m, SharedChoice{Chosen: true, Groups: []GroupKey{{Name: "G", Filter: "g/#"}}})
	}()
	select {
	case <-gate.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the delivery did not reach the slow session's store")
	}
	// Another member of the group leaves this edge meanwhile.
	inner := sc.Topic("g/#")
	b.handed.add(&session{id: sc.ClientID("h"), scope: sc, subs: map[string]*subscription{
		"g": {filter: inner, full: "$share/G/" + inner, qos: 2, group: &shareGroup{name: "G", filter: inner}},
	}}, time.Now(), "edge-new", 21)
	gate.open()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("the delivery did not end")
	}
	require.Equal(t, "g/x", member.Expect(packets.Publish).TopicName)
	require.Empty(t, peers.calls(), "the group had its member here")
}

// A session picked for two shared groups at once gets the message once,
// for both: neither group has to be relayed to a member handed over from
// here.
func TestBroker_MemberOfTwoGroupsServesBoth(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	peers := &relayingPeers{}
	b.SetCluster(Cluster{Peers: peers})
	both := mqtttest.Dial(t, addr, 5)
	both.Connect("both", true, packets.Properties{})
	both.Subscribe(1, "$share/G1/g/#", 2)
	both.Subscribe(2, "$share/G2/g/#", 2)
	sc := b.mustScope(t, "default")
	inner := sc.Topic("g/#")
	at := time.Now()
	b.handed.add(&session{id: sc.ClientID("h"), scope: sc, subs: map[string]*subscription{
		"g": {filter: inner, full: "$share/G2/" + inner, qos: 2, group: &shareGroup{name: "G2", filter: inner}},
	}}, at, "edge-new", 21)

	require.NoError(t, b.DeliverForwarded(t.Context(), forwardedMsg(1, "g/x", 2, at.Add(-time.Second)),
		SharedChoice{Chosen: true, Groups: []GroupKey{{Name: "G1", Filter: "g/#"}, {Name: "G2", Filter: "g/#"}}}))
	require.Equal(t, "g/x", both.Expect(packets.Publish).TopicName)
	expectNothing(t, both, 200*time.Millisecond)
	require.Empty(t, peers.calls(), "G2 had its member here")
}

// A session remembered for an owner under one epoch, whose later fenced
// copy's owner turns out to be the same edge under another, keeps both
// sets of entries linked: a later extension of the first still finds them.
// And a second fenced copy of a session whose first copy's owner is not
// known yet adds the subscriptions the first did not have.
func TestHandedOver_ResolveKeepsEveryEntryOfTheOwner(t *testing.T) {
	t.Parallel()
	sc, err := tenancy.NewScope("t")
	require.NoError(t, err)
	at := time.Now()
	id := sc.ClientID("c")
	copyOf := func(filters ...string) *session {
		s := &session{id: id, scope: sc, subs: map[string]*subscription{}}
		for _, f := range filters {
			s.subs[f] = &subscription{filter: sc.Topic(f), full: sc.Topic(f), qos: 1}
		}
		return s
	}
	msg := func(topic string, created time.Time) *Message {
		return &Message{Topic: sc.Topic(topic), QoS: 1, Created: created.UnixNano()}
	}
	h := newHandedOver(time.Minute)
	h.add(copyOf("a/#"), at, "edge-2", 8)
	h.add(copyOf("b/#"), at, "", 0)
	h.add(copyOf("b/#", "c/#"), at, "", 0) // a second fenced copy, with more
	h.resolve(id, "edge-2", 9)
	require.Equal(t, []relay{{to: "edge-2", targets: []RelayTarget{{Tenant: "t", ClientID: "c", Epoch: 9, QoS: 1}}}},
		h.relays(msg("c/x", at.Add(-time.Millisecond)), at, nil), "the second copy's subscription is remembered")

	later := at.Add(time.Second)
	h.extend(id, "edge-2", 8, later)
	require.Equal(t, []relay{{to: "edge-2", targets: []RelayTarget{{Tenant: "t", ClientID: "c", Epoch: 8, QoS: 1}}}},
		h.relays(msg("a/x", later.Add(-time.Millisecond)), at, nil), "the entries under epoch 8 are extended")
	h.pruneLocked(at.Add(time.Minute))
	require.NotEmpty(t, h.bySession, "the extended entries are kept for the memory past their new cutoff")
	h.pruneLocked(later.Add(handoverSkew + time.Minute))
	require.Empty(t, h.bySession)
	require.Empty(t, h.entries)
}

// subscribingOwner is a coordinator that does not answer the first owner
// lookup, during which the fenced copy s gets a subscription (a SUBSCRIBE
// landing meanwhile), and names edge under epoch afterwards.
type subscribingOwner struct {
	fakeOwnership
	s       *session
	sub     *subscription
	edge    string
	epoch   uint64
	lookups atomic.Int32
}

func (o *subscribingOwner) Owner(context.Context, string, string) (string, uint64, error) {
	if o.lookups.Add(1) == 1 {
		o.s.mu.Lock()
		o.s.subs["a/#"] = o.sub
		o.s.mu.Unlock()
		return "", 0, errors.New("coordinator unavailable")
	}
	return o.edge, o.epoch, nil
}

// A fenced copy that had no subscription when its owner lookup began, and
// one when the lookup failed, is remembered with no owner for that one: its
// owner is then looked up in the background too, or what the subscription
// matches would be refused for the whole handover memory.
func TestBroker_FencedCopySubscribedDuringItsLookupIsLookedUpAgain(t *testing.T) {
	t.Parallel()
	b, _ := brokerOnStore(t, func(st *durable.Store) DurableState { return sharedLocal{st} })
	sc := b.mustScope(t, "default")
	s := &session{id: sc.ClientID("late-sub"), scope: sc, epoch: 20, subs: map[string]*subscription{}}
	own := &subscribingOwner{s: s, sub: &subscription{filter: sc.Topic("a/#"), full: sc.Topic("a/#"), qos: 1}, edge: "edge-new", epoch: 21}
	b.SetCluster(Cluster{Ownership: own})
	before := time.Now().UnixNano()
	b.relayFenced(t.Context(), s, noForget)
	m := &Message{Topic: sc.Topic("a/x"), QoS: 1, Created: before}
	require.Eventually(t, func() bool {
		rs := b.handed.relays(m, time.Now(), nil)
		return len(rs) == 1 && rs[0].to == "edge-new"
	}, 5*time.Second, 10*time.Millisecond, "the owner is found in the background")
}

// flakyOwner is a coordinator whose owner lookups take a while and fail
// until reachable is set, and then name edge the owner of every session
// under epoch. It records how many lookups ran at once at most.
type flakyOwner struct {
	fakeOwnership
	edge      string
	epoch     uint64
	reachable atomic.Bool
	running   atomic.Int32
	most      atomic.Int32
	lookups   atomic.Int32
}

func (o *flakyOwner) Owner(ctx context.Context, _, _ string) (string, uint64, error) {
	o.lookups.Add(1)
	n := o.running.Add(1)
	defer o.running.Add(-1)
	for m := o.most.Load(); n > m && !o.most.CompareAndSwap(m, n); m = o.most.Load() {
	}
	select {
	case <-ctx.Done():
		return "", 0, ctx.Err()
	case <-time.After(10 * time.Millisecond):
	}
	if !o.reachable.Load() {
		return "", 0, errors.New("coordinator unavailable")
	}
	return o.edge, o.epoch, nil
}

// fencedCopy is a copy of client id under epoch 20, subscribed to a/#.
func fencedCopy(sc *tenancy.Scope, id string) *session {
	return &session{id: sc.ClientID(id), scope: sc, epoch: 20, subs: map[string]*subscription{
		"a/#": {filter: sc.Topic("a/#"), full: sc.Topic("a/#"), qos: 1}}}
}

// released reports whether every goroutine the broker waits on at release
// ended within d.
func released(b *Broker, d time.Duration) bool {
	done := make(chan struct{})
	go func() {
		b.releases.Wait()
		close(done)
	}()
	select {
	case <-done:
		return true
	case <-time.After(d):
		return false
	}
}

// The background lookup of a fenced copy's owner ends once the owner is
// named, and once nothing published before the copy went can arrive any
// more (its subscriptions are forgotten), whatever the coordinator says.
func TestBroker_FencedOwnerLookupEnds(t *testing.T) {
	for _, found := range []bool{true, false} {
		t.Run(fmt.Sprintf("found=%v", found), func(t *testing.T) {
			t.Parallel()
			b, _ := brokerOnStore(t, func(st *durable.Store) DurableState { return sharedLocal{st} })
			b.handed.memory = time.Second
			sc := b.mustScope(t, "default")
			own := &flakyOwner{edge: "edge-new", epoch: 21}
			b.SetCluster(Cluster{Ownership: own})
			s := fencedCopy(sc, "lost")
			before := time.Now().UnixNano()
			b.relayFenced(t.Context(), s, noForget)
			require.Eventually(t, func() bool { return own.lookups.Load() >= 3 }, 5*time.Second, time.Millisecond, "looked up in the background")
			require.False(t, released(b, 0), "the lookup goes on while the owner is not known")
			if found {
				own.reachable.Store(true)
				require.Eventually(t, func() bool {
					rs := b.handed.relays(&Message{Topic: sc.Topic("a/x"), QoS: 1, Created: before}, time.Now(), nil)
					return len(rs) == 1 && rs[0].to == "edge-new"
				}, 5*time.Second, time.Millisecond)
			}
			require.True(t, released(b, 5*time.Second), "the background lookup ended")
			n := own.lookups.Load()
			time.Sleep(300 * time.Millisecond)
			require.Equal(t, n, own.lookups.Load(), "no lookup after it ended")
		})
	}
}

// A fenced copy whose routes are slow to go keeps its subscriptions
// remembered for the handover memory past their removal, and its owner is
// looked up for as long: while they refuse what they match, something
// must still be looking for where it goes.
func TestBroker_FencedOwnerLookedUpWhileItsExtendedEntriesLast(t *testing.T) {
	t.Parallel()
	b, _ := brokerOnStore(t, func(st *durable.Store) DurableState { return sharedLocal{st} })
	b.handed.memory = 3 * time.Second
	sc := b.mustScope(t, "default")
	own := &flakyOwner{edge: "edge-new", epoch: 21}
	b.SetCluster(Cluster{Ownership: own})
	gone := make(chan struct{})
	before := time.Now().UnixNano()
	b.relayFenced(t.Context(), fencedCopy(sc, "slow"), func() <-chan struct{} { return gone })
	// The lookups back off: rounds at about 0.1, 0.3, 0.7, 1.5 and 3.1 s.
	time.Sleep(900 * time.Millisecond)
	close(gone) // the routes went: the entries last until about 3.9 s
	time.Sleep(300 * time.Millisecond)
	// Past the routes' end, before the 1.5 s round; the entries outlast
	// the 3.1 s one too, so that a round late on a busy machine still
	// comes while they last.
	own.reachable.Store(true)
	require.Eventually(t, func() bool {
		rs := b.handed.relays(&Message{Topic: sc.Topic("a/x"), QoS: 1, Created: before}, time.Now(), nil)
		return len(rs) == 1 && rs[0].to == "edge-new"
	}, 4*time.Second, time.Millisecond, "the owner is named while the entries last")
}

// The owners of many fenced copies (an edge cut off from the coordinator
// for a while) are looked up a few at a time, by one background loop, not
// by a goroutine each.
func TestBroker_FencedOwnerLookupsShareOneLoop(t *testing.T) {
	t.Parallel()
	b, _ := brokerOnStore(t, func(st *durable.Store) DurableState { return sharedLocal{st} })
	sc := b.mustScope(t, "default")
	own := &flakyOwner{edge: "edge-new", epoch: 21}
	b.SetCluster(Cluster{Ownership: own})
	const copies = 20
	for i := range copies {
		b.relayFenced(t.Context(), fencedCopy(sc, fmt.Sprintf("c%d", i)), noForget)
	}
	own.most.Store(0) // the lookups made before each copy went ran one at a time
	require.Eventually(t, func() bool { return own.lookups.Load() >= copies+3 }, 10*time.Second, time.Millisecond)
	require.LessOrEqual(t, own.most.Load(), int32(fencedLookupsAtOnce), "a few lookups at a time")
	own.reachable.Store(true)
	require.True(t, released(b, 10*time.Second), "the loop ends once every owner is known")
	rs := b.handed.relays(&Message{Topic: sc.Topic("a/x"), QoS: 1, Created: time.Now().Add(-time.Second).UnixNano()}, time.Now(), nil)
	require.Len(t, rs, 1)
	require.Equal(t, "edge-new", rs[0].to)
	require.Len(t, rs[0].targets, copies, "every owner is named")
}

// A forwarded QoS 2 message for a shared group with two members here and
// for a persistent session whose store write is slow: while the write
// waits, the session's fenced copy is remembered with no known owner (its
// lookup failed). The message is not refused after a member of the group
// got it: sent again, the group would pick its other member, and a QoS 2
// message would reach two members (invariant 2). The session matched
// here, so it took the message or failed it; nothing waits on its owner.
func TestBroker_OwnerUnknownAfterDeliveryIsNotRefused(t *testing.T) {
	t.Parallel()
	b, gate, addr := gatedBroker(t)
	peers := &relayingPeers{}
	b.SetCluster(Cluster{Peers: peers})
	sc := b.mustScope(t, "default")
	gate.id = sc.ClientID("slow")
	slow := persistentSubscriber(t, addr, "slow", "g/#")
	members := connectMembers(t, addr, "$share/G/g/#", "m1", "m2")

	m := forwardedMsg(1, "g/x", 2, time.Now().Add(-time.Second))
	choice := SharedChoice{Chosen: true, Groups: []GroupKey{{Name: "G", Filter: "g/#"}}}
	done := make(chan error, 1)
	go func() { done <- b.DeliverForwarded(context.Background(), m, choice) }()
	select {
	case <-gate.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the delivery did not reach the slow session's store")
	}
	// The slow session is fenced meanwhile, and its owner not found (a
	// stand-in for its copy: the copy's lock is held by the write).
	inner := sc.Topic("g/#")
	b.handed.add(&session{id: gate.id, scope: sc, subs: map[string]*subscription{
		"g/#": {filter: inner, full: inner, qos: 2}}}, time.Now(), "", 0)
	gate.open()
	var err error
	select {
	case err = <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the delivery did not end")
	}
	if err != nil {
		// As its sender would: sent again until taken, the owner named.
		b.handed.resolve(gate.id, "edge-new", 21)
		require.NoError(t, b.DeliverForwarded(context.Background(), m, choice))
	}
	got := 0
	for _, c := range members {
		if pk, err := c.Read(300 * time.Millisecond); err == nil {
			require.Equal(t, packets.Publish, pk.FixedHeader.Type)
			got++
		}
	}
	require.Equal(t, 1, got, "one member of the group gets the QoS 2 message")
	require.NoError(t, err, "not refused once a member got it")
	require.Equal(t, "g/x", slow.Expect(packets.Publish).TopicName)
}

// failingOwner is a coordinator whose owner lookups fail at once (no
// leader, connection refused) until reachable is set, and then take a
// while and name edge under epoch. It records how many lookups ran at
// once at most.
type failingOwner struct {
	flakyOwner
}

func (o *failingOwner) Owner(ctx context.Context, tenant, clientID string) (string, uint64, error) {
	if !o.reachable.Load() {
		o.lookups.Add(1)
		return "", 0, errors.New("no leader")
	}
	return o.flakyOwner.Owner(ctx, tenant, clientID)
}

// The background lookup of many fenced copies' owners backs off while the
// coordinator fails them at once, as when it does not answer: it does not
// look each copy up every 100 ms. Once the coordinator answers, the owners
// are named a few lookups at a time, not one by one.
func TestBroker_FencedOwnerLookupsBackOffOnErrors(t *testing.T) {
	t.Parallel()
	b, _ := brokerOnStore(t, func(st *durable.Store) DurableState { return sharedLocal{st} })
	sc := b.mustScope(t, "default")
	own := &failingOwner{flakyOwner{edge: "edge-new", epoch: 21}}
	b.SetCluster(Cluster{Ownership: own})
	const copies = 50
	published := time.Now().UnixNano()
	for i := range copies {
		b.relayFenced(t.Context(), fencedCopy(sc, fmt.Sprintf("c%d", i)), noForget)
	}
	before := own.lookups.Load()
	time.Sleep(3 * time.Second)
	require.LessOrEqual(t, own.lookups.Load()-before, int32(8), "backed off: one lookup a round, rounds 0.1, 0.2, 0.4 ... 2 s apart")

	own.reachable.Store(true)
	start := time.Now()
	require.True(t, released(b, 10*time.Second), "the loop ends once every owner is known")
	require.Less(t, time.Since(start), fencedRetryLast+copies*10*time.Millisecond/2, "named a few at a time")
	require.Greater(t, own.most.Load(), int32(1), "a few lookups at a time")
	require.LessOrEqual(t, own.most.Load(), int32(fencedLookupsAtOnce))
	rs := b.handed.relays(&Message{Topic: sc.Topic("a/x"), QoS: 1, Created: published}, time.Now(), nil)
	require.Len(t, rs, 1)
	require.Len(t, rs[0].targets, copies, "every owner is named")
}

// errOwner is a coordinator whose owner lookups fail at once.
type errOwner struct{ fakeOwnership }

func (errOwner) Owner(context.Context, string, string) (string, uint64, error) {
	return "", 0, errors.New("no leader")
}

// A fenced copy remembered with no owner is remembered until its routes
// are gone (its forget), also when its entries were given their owner
// meanwhile: the background lookup of an earlier fenced copy of the same
// session named it. A message that entered the cluster while the copy was
// forgotten, refused by the copy and sent again, is relayed to the owner.
func TestBroker_FencedCopyNamedDuringItsForgetIsRememberedUntilItEnds(t *testing.T) {
	t.Parallel()
	b, _ := brokerOnStore(t, func(st *durable.Store) DurableState { return sharedLocal{st} })
	sc := b.mustScope(t, "default")
	b.SetCluster(Cluster{Ownership: errOwner{}})
	s := fencedCopy(sc, "twice")
	start := time.Now()
	b.relayFenced(t.Context(), s, func() <-chan struct{} {
		// An earlier copy's lookup names the owner while this one goes.
		b.handed.resolve(s.id, "edge-new", 21)
		time.Sleep(400 * time.Millisecond)
		return nil
	})
	m := &Message{Topic: sc.Topic("a/x"), QoS: 1, Created: start.Add(250 * time.Millisecond).UnixNano()}
	rs := b.handed.relays(m, time.Now(), nil)
	require.Len(t, rs, 1, "entered while the copy went: relayed")
	require.Equal(t, "edge-new", rs[0].to)
}

// stuckRemoval is a route table whose removals wait, as the route client's
// do for the router's answer, until release is closed or their context
// ends.
type stuckRemoval struct {
	fakeRoutes
	release chan struct{}
}

func (r *stuckRemoval) Remove(ctx context.Context, tenant, filter, group string) error {
	select {
	case <-r.release:
	case <-ctx.Done():
		return ctx.Err()
	}
	return r.fakeRoutes.Remove(ctx, tenant, filter, group)
}

// A fenced takeover copy whose route removals the router does not answer
// does not hold its CONNECT (and the session's claim lock) until it does:
// the copy goes within a second (fencedForgetRoutes), with its removals
// still unanswered, they go on in the background, and what its routes
// draw until they are gone is still relayed to the owner.
func TestBroker_FencedTakeoverDoesNotWaitForAStuckRouter(t *testing.T) {
	t.Parallel()
	b, sc, id, state := fencedTakeover(t, "stuck", "s/#", 1)
	routes := &stuckRemoval{fakeRoutes: fakeRoutes{add: func(string, string, string) error { return nil }}, release: make(chan struct{})}
	open := sync.OnceFunc(func() { close(routes.release) })
	t.Cleanup(open)
	b.SetCluster(Cluster{Routes: routes,
		Takeover:  &scriptedTakeover{begin: func(uint64) ([]byte, error) { return state, nil }},
		Ownership: ownerAt{edge: "edge-new", epoch: 21}})
	done := make(chan error, 1)
	go func() {
		_, _, err := b.takeOverFrom(context.Background(), "edge-prev", sc, "stuck", 20, false, false)
		done <- err
	}()
	// Not fencedForgetRoutes plus a margin: a longer bound, up to waiting
	// for the router, would pass with it.
	select {
	case err := <-done:
		require.ErrorIs(t, err, durable.ErrFenced)
	case <-time.After(2500 * time.Millisecond):
		t.Fatal("the takeover waited for the router")
	}
	require.Zero(t, routes.removed.Load(), "the takeover returned with the removal unanswered")
	require.Nil(t, b.session(id), "no copy stays")
	// Past the cutoff the copy's entries got when it went: only their
	// extension once the routes are gone covers what enters now.
	time.Sleep(2 * handoverSkew)
	late := time.Now().UnixNano() // the copy gone, its route still up
	m := &Message{Topic: sc.Topic("s/x"), QoS: 1, Created: late}
	require.Empty(t, b.handed.relays(m, time.Now(), nil), "not covered yet: its routes are not gone")
	open()
	require.Eventually(t, func() bool { return len(b.handed.relays(m, time.Now(), nil)) == 1 }, 5*time.Second, 5*time.Millisecond,
		"published while the copy's route was still up: relayed")
}

// noForget is a relayFenced forget for a copy that was never here.
func noForget() <-chan struct{} { return nil }

// A forwarded message routed here by a fenced copy's routes while the copy
// went, whose owner is not known, is matched here after the copy left the
// index and before its remembered subscriptions were extended to cover it
// (it entered after their first cutoff): the copy's session is no
// recipient here and gets nothing. Once the entries are extended it is
// theirs, and it is refused for its sender to send again, not taken with
// the session missing it; sent again once the owner is named, it is
// relayed there.
func TestBroker_ExtendedOwnerUnknownAfterDeliveryIsRefused(t *testing.T) {
	t.Parallel()
	b, gate, addr := gatedBroker(t)
	peers := &relayingPeers{}
	b.SetCluster(Cluster{Peers: peers})
	sc := b.mustScope(t, "default")
	gate.id = sc.ClientID("slow")
	slow := mqtttest.Dial(t, addr, 5)
	slow.Connect("slow", false, persistentProps)
	slow.Subscribe(1, "a/#", 1)
	b.SetCluster(Cluster{Ownership: errOwner{}}) // owner lookups fail

	// A fenced copy whose owner is not found goes, and its routes are
	// slow to go.
	fenced := fencedCopy(sc, "fenced")
	going, gone := make(chan struct{}), make(chan struct{})
	proceed := make(chan struct{})
	go func() {
		defer close(gone)
		b.relayFenced(t.Context(), fenced, func() <-chan struct{} {
			close(going)
			<-proceed
			return nil
		})
	}()
	<-going
	time.Sleep(2 * handoverSkew) // past the entries' first cutoff
	m := forwardedMsg(1, "a/x", 1, time.Now())
	done := make(chan error, 1)
	go func() { done <- b.DeliverForwarded(context.Background(), m, SharedChoice{}) }()
	select {
	case <-gate.entered: // its recipients decided: the slow session alone
	case <-time.After(5 * time.Second):
		t.Fatal("the delivery did not reach the slow session's store")
	}
	close(proceed)
	<-gone // the copy's entries extended to its routes' end
	gate.open()
	select {
	case err := <-done:
		require.ErrorIs(t, err, errOwnerUnknown, "the fenced session missed it: not taken")
	case <-time.After(5 * time.Second):
		t.Fatal("the delivery did not end")
	}

	b.handed.resolve(fenced.id, "edge-new", 21)
	require.NoError(t, b.DeliverForwarded(context.Background(), m, SharedChoice{}))
	calls := peers.calls()
	require.Len(t, calls, 1)
	require.Equal(t, "edge-new", calls[0].edge)
	require.Equal(t, "fenced", calls[0].targets[0].ClientID)
}

// A fenced copy's routes that take longer than the handover memory to go
// extend its remembered subscriptions' cutoff past their first expiry: they
// are kept for the memory past the new cutoff, so a message that entered
// while the routes were still up, arriving after the first expiry, is
// relayed to the owner instead of taken by nobody.
func TestBroker_ExtendedFencedCopyOutlivesItsFirstExpiry(t *testing.T) {
	t.Parallel()
	const memory = time.Second
	b, _ := startBroker(t, func(c *Config) { c.HandoverMemory = memory })
	peers := &relayingPeers{}
	b.SetCluster(Cluster{Peers: peers, Ownership: ownerAt{edge: "edge-new", epoch: 21}})
	sc := b.mustScope(t, "default")
	start := time.Now()
	b.relayFenced(t.Context(), fencedCopy(sc, "slow"), func() <-chan struct{} {
		time.Sleep(memory + memory/2) // the router is slow to remove its routes
		return nil
	})
	require.True(t, time.Now().After(start.Add(memory)), "past the entries' first expiry")
	m := forwardedMsg(1, "a/x", 1, start.Add(memory+memory/4)) // entered while the routes were up
	require.NoError(t, b.DeliverForwarded(t.Context(), m, SharedChoice{}))
	calls := peers.calls()
	require.Len(t, calls, 1, "relayed to the owner")
	require.Equal(t, "edge-new", calls[0].edge)
}
