package remotestore

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"

	"github.com/keelmq/keel/services/edge/internal/broker"
	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

var (
	_ broker.DurableState  = (*Store)(nil)
	_ broker.RetainedIndex = (*Store)(nil)
)

func newStore(t testing.TB, url string, tune ...func(*Config)) *Store {
	t.Helper()
	cfg := Config{URL: url}
	for _, f := range tune {
		f(&cfg)
	}
	s, err := New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func scope(t testing.TB, tenant string) *tenancy.Scope {
	sc, err := tenancy.NewScope(tenant)
	require.NoError(t, err)
	return sc
}

// base is recent: messages expire an hour after it, and the service skips
// expired retained messages.
var base = time.Now().Add(-time.Minute).Truncate(time.Second).UnixNano()

// message builds a stored message the way the broker does: internal
// topic and origin, MQTT 5 properties as JSON, expiry from the interval.
func message(sc *tenancy.Scope, seq uint64, topicName string, qos byte) *durable.Message {
	f := byte(1)
	p := durable.Props{PayloadFormat: &f, ContentType: "text/plain", ResponseTopic: "reply/" + topicName,
		CorrelationData: []byte{1, 2, byte(seq)}, User: []packets.UserProperty{{Key: "k", Val: "v1"}, {Key: "k", Val: "v2"}}, Expiry: 3600}
	props, _ := json.Marshal(&p)
	created := base + int64(seq)*int64(time.Millisecond)
	return &durable.Message{ID: fmt.Sprintf("edge-a/7/%d", seq), Topic: sc.Topic(topicName), Payload: []byte(fmt.Sprintf("payload %d", seq)),
		QoS: qos, Retain: false, Props: props, Origin: sc.ClientID("publisher"), Created: created,
		Expiry: created/int64(time.Second) + 3600}
}

func queued(m *durable.Message, seq uint64, qos byte) durable.Entry {
	return durable.Entry{Seq: seq, MsgID: m.ID, QoS: qos, SubIDs: []int{3}, Msg: m}
}

func requireSameMessage(t *testing.T, want, got *durable.Message) {
	t.Helper()
	require.NotNil(t, got, "message %s", want.ID)
	require.Equal(t, want.ID, got.ID)
	require.Equal(t, want.Topic, got.Topic)
	require.Equal(t, want.Payload, got.Payload)
	require.Equal(t, want.QoS, got.QoS)
	require.Equal(t, want.Retain, got.Retain)
	require.Equal(t, want.Origin, got.Origin)
	require.Equal(t, want.Created, got.Created)
	require.Equal(t, want.Expiry, got.Expiry)
	var wp, gp durable.Props
	require.NoError(t, json.Unmarshal(want.Props, &wp))
	require.NoError(t, json.Unmarshal(got.Props, &gp))
	require.Equal(t, wp, gp)
}

func waitOK(t *testing.T, p *durable.Pending) {
	t.Helper()
	require.NoError(t, p.Wait(ctxT(t)))
}

// TestRoundTrip makes every write of a session, then reads it back from
// another store (another edge): the same session, subscriptions, queue in
// order with bodies and properties, in-flight deliveries with their packet
// IDs and PUBREL state, and inbound QoS 2 records.
func TestRoundTrip(t *testing.T) {
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) {
			t.Parallel()
			p := be.start(t)
			s := newStore(t, p.URL)
			ctx := ctxT(t)
			sc := scope(t, "acme")
			id := sc.ClientID("device-1")

			require.NoError(t, s.Activate(ctx, id, 7))
			rec := durable.Session{ID: id, Listener: "tcp", Username: []byte("dev"), ProtocolVersion: 5, ExpiryInterval: 3600,
				Props: json.RawMessage(`{"ReceiveMaximum":10}`), Disconnected: 1_700_000_000_123_456_789}
			require.NoError(t, s.PutSession(ctx, rec))

			subs := []durable.Subscription{
				{Filter: sc.Topic("sensors/+/temp"), QoS: 1, Identifier: 3},
				{Filter: "$share/workers/" + sc.Topic("jobs/#"), QoS: 2, NoLocal: true, RetainAsPublished: true, RetainHandling: 2},
				{Filter: "$share/$queue/" + sc.Topic("orders"), QoS: 1},
				{Filter: sc.Topic("$SYS/broker/#"), QoS: 0},
				{Filter: sc.Topic("gone"), QoS: 0},
			}
			for _, sub := range subs {
				require.NoError(t, s.PutSubscription(ctx, id, sub))
			}
			require.NoError(t, s.DeleteSubscription(ctx, id, sc.Topic("gone")))
			subs = subs[:4]

			var msgs []*durable.Message
			for i := range 7 {
				msgs = append(msgs, message(sc, uint64(i+1), "sensors/x/temp", 2))
			}
			// m1..m5 queued; m2 dropped; m1 and m3 sent from the queue, m6
			// and m7 sent live (never queued); m3 got its PUBREC, m7 its
			// PUBACK.
			for i := range 5 {
				waitOK(t, s.Enqueue(id, queued(msgs[i], uint64(i+1), 2)))
			}
			require.NoError(t, s.Dequeue(ctx, id, []durable.Entry{{Seq: 2, MsgID: msgs[1].ID}}))
			sent := []durable.Entry{queued(msgs[0], 1, 1), queued(msgs[2], 3, 2), queued(msgs[5], 0, 1), queued(msgs[6], 0, 2)}
			for i, pk := range []uint16{65535, 65534, 65533, 65532} {
				sent[i].PacketID, sent[i].Order = pk, int64(i+1)
			}
			waitOK(t, s.Send(id, sent))
			require.NoError(t, s.Pubrel(ctx, id, 65534))
			require.NoError(t, s.Complete(ctx, id, 65532))
			require.NoError(t, s.PutIncoming(ctx, id, durable.Incoming{PacketID: 10, MsgID: "edge-b/3/99"}))
			require.NoError(t, s.PutIncoming(ctx, id, durable.Incoming{PacketID: 11, MsgID: "edge-b/3/100"}))
			require.NoError(t, s.DeleteIncoming(ctx, id, 11))
			// Not acknowledged: routed again under its msgID when resent.
			require.NoError(t, s.PutIncoming(ctx, id, durable.Incoming{PacketID: 12, MsgID: "edge-b/3/101", Unconfirmed: true, Fingerprint: 42}))

			// Another edge reads it, without activating anything.
			other := newStore(t, p.URL)
			require.NoError(t, s.barrier(ctx)) // the unwaited deletes are applied
			st, ok, err := other.LoadSession(ctx, id)
			require.NoError(t, err)
			require.True(t, ok)
			require.Equal(t, rec, st.Session)

			sortSubs := func(xs []durable.Subscription) {
				slices.SortFunc(xs, func(a, b durable.Subscription) int { return strings.Compare(a.Filter, b.Filter) })
			}
			sortSubs(subs)
			sortSubs(st.Subs)
			require.Equal(t, subs, st.Subs)

			require.Len(t, st.Queue, 2)
			for i, want := range []*durable.Message{msgs[3], msgs[4]} {
				e := st.Queue[i]
				require.Equal(t, want.ID, e.MsgID)
				require.Equal(t, byte(2), e.QoS)
				require.Equal(t, []int{3}, e.SubIDs)
				requireSameMessage(t, want, e.Msg)
			}
			require.Less(t, st.Queue[0].Seq, st.Queue[1].Seq, "queue entries are numbered in queue order")

			require.Len(t, st.Inflight, 3)
			for i, want := range []struct {
				m      *durable.Message
				pk     uint16
				qos    byte
				pubrel bool
			}{{msgs[0], 65535, 1, false}, {msgs[2], 65534, 2, true}, {msgs[5], 65533, 1, false}} {
				e := st.Inflight[i]
				require.Equal(t, want.m.ID, e.MsgID)
				require.Equal(t, want.pk, e.PacketID)
				require.Equal(t, want.qos, e.QoS)
				require.Equal(t, want.pubrel, e.Pubrel)
				require.Equal(t, int64(i+1), e.Order)
				requireSameMessage(t, want.m, e.Msg)
			}
			slices.SortFunc(st.Incoming, func(a, b durable.Incoming) int { return cmp.Compare(a.PacketID, b.PacketID) })
			require.Equal(t, []durable.Incoming{{PacketID: 10, MsgID: "edge-b/3/99"},
				{PacketID: 12, MsgID: "edge-b/3/101", Unconfirmed: true, Fingerprint: 42}}, st.Incoming)

			// What a takeover moves lands as it was on a third store, and a
			// second import changes nothing.
			third := newStore(t, p.URL)
			moved := scope(t, "acme").ClientID("device-2")
			st.Session.ID = moved
			require.NoError(t, third.Activate(ctx, moved, 9))
			require.NoError(t, third.ImportSession(ctx, st))
			require.NoError(t, third.ImportSession(ctx, st))
			got, ok, err := s.LoadSession(ctx, moved)
			require.NoError(t, err)
			require.True(t, ok)
			sortSubs(got.Subs)
			// Queue positions are the service's own, per session: compare
			// the order alone.
			for _, x := range []*durable.SessionState{&st, &got} {
				for i := range x.Queue {
					x.Queue[i].Seq = 0
				}
			}
			require.Equal(t, st, got)

			require.NoError(t, s.DeleteSession(ctx, id, true))
			_, ok, err = other.LoadSession(ctx, id)
			require.NoError(t, err)
			require.False(t, ok)
		})
	}
}

// TestWillRoundTrip: a session record keeps its will (msgID, body,
// properties, delay) for the edge that takes custody of it, and loses it
// when the record is written again without one.
func TestWillRoundTrip(t *testing.T) {
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) {
			t.Parallel()
			p := be.start(t)
			s := newStore(t, p.URL)
			ctx := ctxT(t)
			sc := scope(t, "acme")
			id := sc.ClientID("device-1")
			require.NoError(t, s.Activate(ctx, id, 7))

			will := message(sc, 9, "status/device-1", 1)
			will.Retain, will.Origin, will.Expiry = true, id, 0 // a will's expiry counts from its publication
			rec := durable.Session{ID: id, Listener: "tcp", ProtocolVersion: 4, Clean: true,
				Will: &durable.Will{Msg: will, Delay: 30}}
			require.False(t, rec.Persistent())
			require.NoError(t, s.PutSession(ctx, rec))

			other := newStore(t, p.URL)
			require.NoError(t, other.Activate(ctx, id, 8))
			st, ok, err := other.LoadSession(ctx, id)
			require.NoError(t, err)
			require.True(t, ok, "a record with only a will is a stored session")
			require.NotNil(t, st.Session.Will)
			require.Equal(t, uint32(30), st.Session.Will.Delay)
			requireSameMessage(t, will, st.Session.Will.Msg)
			require.True(t, st.Session.Will.Msg.Retain)
			require.Equal(t, id, st.Session.Will.Msg.Origin)
			require.Zero(t, st.Session.Will.Msg.Expiry)
			require.JSONEq(t, string(will.Props), string(st.Session.Will.Msg.Props), "the expiry interval travels as received")
			require.False(t, st.Session.Persistent())

			rec.Will = nil
			require.NoError(t, other.PutSession(ctx, rec))
			st, ok, err = s.LoadSession(ctx, id)
			require.NoError(t, err)
			require.True(t, ok)
			require.Nil(t, st.Session.Will)
		})
	}
}

// TestFencing: once one edge activated epoch 5, another still writing
// under epoch 3 is refused with ErrFenced and changes nothing.
func TestFencing(t *testing.T) {
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) {
			t.Parallel()
			p := be.start(t)
			ctx := ctxT(t)
			sc := scope(t, "acme")
			id := sc.ClientID("c")
			old, cur := newStore(t, p.URL), newStore(t, p.URL)

			require.NoError(t, old.Activate(ctx, id, 3))
			require.NoError(t, cur.Activate(ctx, id, 5))
			rec := durable.Session{ID: id, Listener: "tcp", ProtocolVersion: 4}
			require.NoError(t, cur.PutSession(ctx, rec))
			m := message(sc, 1, "a", 1)
			waitOK(t, cur.Enqueue(id, queued(m, 1, 1)))
			require.NoError(t, cur.PutSubscription(ctx, id, durable.Subscription{Filter: sc.Topic("a"), QoS: 1}))
			before, ok, err := cur.LoadSession(ctx, id)
			require.NoError(t, err)
			require.True(t, ok)

			fenced := func(err error) { t.Helper(); require.ErrorIs(t, err, ErrFenced) }
			fenced(old.PutSession(ctx, durable.Session{ID: id, Listener: "ws", ProtocolVersion: 5}))
			fenced(old.PutSubscription(ctx, id, durable.Subscription{Filter: sc.Topic("b"), QoS: 2}))
			fenced(old.DeleteSubscription(ctx, id, sc.Topic("a")))
			fenced(old.Enqueue(id, queued(message(sc, 2, "a", 1), 2, 1)).Wait(ctx))
			sendOld := queued(m, 1, 1)
			sendOld.PacketID = 1
			fenced(old.Send(id, []durable.Entry{sendOld}).Wait(ctx))
			fenced(old.PutIncoming(ctx, id, durable.Incoming{PacketID: 4, MsgID: "edge-a/7/9"}))
			fenced(old.Pubrel(ctx, id, 1))
			fenced(old.DeleteSession(ctx, id, true))
			fenced(old.Activate(ctx, id, 4))
			// Unwaited writes report nothing, and change nothing either.
			require.NoError(t, old.Dequeue(ctx, id, []durable.Entry{{Seq: 1, MsgID: m.ID}}))
			require.NoError(t, old.Complete(ctx, id, 1))
			require.NoError(t, old.barrier(ctx))

			after, ok, err := cur.LoadSession(ctx, id)
			require.NoError(t, err)
			require.True(t, ok)
			require.Equal(t, before, after)

			// A store that never activated the session sends nothing.
			require.ErrorIs(t, newStore(t, p.URL).PutSession(ctx, rec), ErrNotActive)
			// Deactivated under an older epoch than its own, a session stays
			// active: the copy that goes is not the one that activated it.
			oldEpoch, _ := old.epoch(id)
			old.Deactivate(id, oldEpoch-1)
			_, active := old.epoch(id)
			require.True(t, active)
			old.Deactivate(id, oldEpoch)
			require.ErrorIs(t, old.Enqueue(id, queued(m, 1, 1)).Wait(ctx), ErrNotActive)
		})
	}
}

// TestEnqueueIdempotent: the queue holds a msgID once, however often (and
// under whichever edge sequence) it is enqueued.
func TestEnqueueIdempotent(t *testing.T) {
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) {
			t.Parallel()
			p := be.start(t)
			s := newStore(t, p.URL)
			ctx := ctxT(t)
			sc := scope(t, "acme")
			id := sc.ClientID("c")
			require.NoError(t, s.Activate(ctx, id, 1))
			require.NoError(t, s.PutSession(ctx, durable.Session{ID: id, ProtocolVersion: 5}))
			m1, m2 := message(sc, 1, "a", 1), message(sc, 2, "a", 1)
			waitOK(t, s.Enqueue(id, queued(m1, 1, 1)))
			waitOK(t, s.Enqueue(id, queued(m2, 2, 1)))
			waitOK(t, s.Enqueue(id, queued(m1, 1, 1)))
			waitOK(t, s.Enqueue(id, queued(m1, 3, 1)))
			st, ok, err := s.LoadSession(ctx, id)
			require.NoError(t, err)
			require.True(t, ok)
			require.Len(t, st.Queue, 2)
			require.Equal(t, m1.ID, st.Queue[0].MsgID)
			require.Equal(t, m2.ID, st.Queue[1].MsgID)
		})
	}
}

// TestSendNeverQueued: a live delivery (never queued durably) is stored
// with its message when it goes in flight; a QoS 0 one costs nothing.
func TestSendNeverQueued(t *testing.T) {
	p := startPersistence(t, "")
	s := newStore(t, p.URL)
	ctx := ctxT(t)
	sc := scope(t, "acme")
	id := sc.ClientID("c")
	require.NoError(t, s.Activate(ctx, id, 1))
	require.NoError(t, s.PutSession(ctx, durable.Session{ID: id, ProtocolVersion: 4}))

	m := message(sc, 1, "live", 1)
	e := queued(m, 0, 1)
	e.PacketID = 65535
	waitOK(t, s.Send(id, []durable.Entry{e}))
	waitOK(t, s.Send(id, []durable.Entry{queued(message(sc, 2, "live", 0), 0, 0)}))
	// Sent again (a retry after an error): the same in-flight record.
	waitOK(t, s.Send(id, []durable.Entry{e}))

	st, ok, err := s.LoadSession(ctx, id)
	require.NoError(t, err)
	require.True(t, ok)
	require.Empty(t, st.Queue)
	require.Len(t, st.Inflight, 1)
	require.Equal(t, uint16(65535), st.Inflight[0].PacketID)
	requireSameMessage(t, m, st.Inflight[0].Msg)
}

// TestRetained: retained messages by tenant, topic and filter, replaced
// only by newer ones and cleared by an empty payload; two tenants with the
// same topics never see each other's.
func TestRetained(t *testing.T) {
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) {
			t.Parallel()
			p := be.start(t)
			s := newStore(t, p.URL)
			ctx := ctxT(t)
			acme, globex := scope(t, "acme"), scope(t, "globex")
			retained := func(sc *tenancy.Scope, seq uint64, topicName, payload string) *durable.Message {
				m := message(sc, seq, topicName, 1)
				m.Retain, m.Payload = true, []byte(payload)
				return m
			}
			require.NoError(t, s.PutRetained(ctx, retained(acme, 1, "home/door", "acme open"), true))
			require.NoError(t, s.PutRetained(ctx, retained(globex, 2, "home/door", "globex shut"), true))
			require.NoError(t, s.PutRetained(ctx, retained(acme, 3, "home/light", "on"), true))
			require.NoError(t, s.PutRetained(ctx, retained(acme, 4, "$SYS/uptime", "42"), true))

			match := func(filter string) map[string]string {
				t.Helper()
				ms, err := s.MatchRetained(ctx, filter)
				require.NoError(t, err)
				out := map[string]string{}
				for _, m := range ms {
					require.True(t, m.Retain)
					out[m.Topic] = string(m.Payload)
				}
				return out
			}
			require.Equal(t, map[string]string{acme.Topic("home/door"): "acme open", acme.Topic("home/light"): "on"}, match(acme.Topic("home/#")))
			require.Equal(t, map[string]string{globex.Topic("home/door"): "globex shut"}, match(globex.Topic("home/+")))
			require.Equal(t, map[string]string{acme.Topic("home/door"): "acme open", acme.Topic("home/light"): "on"}, match(acme.Topic("#")),
				"# does not reach $-topics")
			require.Equal(t, map[string]string{acme.Topic("$SYS/uptime"): "42"}, match(acme.Topic("$SYS/#")))
			require.Empty(t, match(globex.Topic("$SYS/#")))

			// The full message comes back as stored.
			ms, err := s.MatchRetained(ctx, globex.Topic("home/door"))
			require.NoError(t, err)
			require.Len(t, ms, 1)
			requireSameMessage(t, retained(globex, 2, "home/door", "globex shut"), &ms[0])

			// An older message does not replace a newer one; a newer empty
			// one clears the topic, of its tenant only.
			stale := retained(acme, 10, "home/door", "stale")
			stale.Created = base - int64(time.Second)
			require.NoError(t, s.PutRetained(ctx, stale, true))
			require.Equal(t, "acme open", match(acme.Topic("home/door"))[acme.Topic("home/door")])
			require.NoError(t, s.PutRetained(ctx, retained(acme, 9, "home/door", ""), true))
			require.Empty(t, match(acme.Topic("home/door")))
			require.Equal(t, map[string]string{globex.Topic("home/door"): "globex shut"}, match(globex.Topic("home/door")))
		})
	}
}

// TestConcurrentEnqueue: many goroutines enqueue to many sessions at once;
// every call is answered, each session's queue holds its messages in the
// order its goroutine submitted them, and the batches were shared.
func TestConcurrentEnqueue(t *testing.T) {
	p := startPersistence(t, "")
	reg := prometheus.NewRegistry()
	s := newStore(t, p.URL, func(c *Config) { c.Registerer = reg })
	ctx := ctxT(t)
	sc := scope(t, "acme")
	const sessions, perSession = 16, 60
	for i := range sessions {
		require.NoError(t, s.Activate(ctx, sc.ClientID(fmt.Sprint(i)), 1))
		require.NoError(t, s.PutSession(ctx, durable.Session{ID: sc.ClientID(fmt.Sprint(i)), ProtocolVersion: 5}))
	}
	var wg sync.WaitGroup
	var failed atomic.Int32
	for i := range sessions {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := sc.ClientID(fmt.Sprint(i))
			// Submit a window at a time, waiting for all, as a session's
			// publishers would.
			for start := 0; start < perSession; start += 10 {
				var ps []*durable.Pending
				for j := start; j < start+10; j++ {
					m := message(sc, uint64(i*1000+j+1), "a", 1)
					ps = append(ps, s.Enqueue(id, queued(m, uint64(j+1), 1)))
				}
				for _, p := range ps {
					if p.Wait(ctx) != nil {
						failed.Add(1)
					}
				}
			}
		}()
	}
	wg.Wait()
	require.Zero(t, failed.Load())
	for i := range sessions {
		st, ok, err := s.LoadSession(ctx, sc.ClientID(fmt.Sprint(i)))
		require.NoError(t, err)
		require.True(t, ok)
		require.Len(t, st.Queue, perSession)
		for j, e := range st.Queue {
			require.Equal(t, fmt.Sprintf("edge-a/7/%d", i*1000+j+1), e.MsgID)
		}
	}
	require.Equal(t, float64(sessions*perSession+2*sessions), promtest.ToFloat64(s.m.byStatus[statusOK]))
	batches := promtest.ToFloat64(s.m.batches)
	require.Less(t, batches, float64(sessions*perSession+2*sessions), "ops shared batches")
	t.Logf("%d ops in %.0f batches", sessions*perSession+2*sessions, batches)
}

// TestServiceKilled: when the persistence process dies mid-stream, every
// pending write is answered with an error (none hangs), and once it is back
// the store writes again on a new stream.
func TestServiceKilled(t *testing.T) {
	p := startPersistence(t, "")
	s := newStore(t, p.URL, func(c *Config) {
		c.MaxQueueWait = 2 * time.Second
		c.ReconnectMax = 200 * time.Millisecond
	})
	ctx := ctxT(t)
	sc := scope(t, "acme")
	id := sc.ClientID("c")
	require.NoError(t, s.Activate(ctx, id, 1))
	require.NoError(t, s.PutSession(ctx, durable.Session{ID: id, ProtocolVersion: 5}))

	var (
		seq      atomic.Uint64
		ok, errs atomic.Int64
		stop     = make(chan struct{})
		wg       sync.WaitGroup
	)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				n := seq.Add(1)
				// A bound far beyond MaxQueueWait: the store must answer
				// first.
				wctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				err := s.Enqueue(id, queued(message(sc, n, "a", 1), n, 1)).Wait(wctx)
				cancel()
				if errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("enqueue %d hung", n)
					return
				}
				if err != nil {
					if !errors.Is(err, ErrUnavailable) {
						t.Errorf("enqueue %d: %v, want ErrUnavailable", n, err)
					}
					errs.Add(1)
				} else {
					ok.Add(1)
				}
			}
		}()
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if ok.Load() < 50 {
			return fmt.Errorf("%d enqueued", ok.Load())
		}
		return nil
	})
	p.kill()
	testutil.Eventually(t, 10*time.Second, func() error {
		if errs.Load() < 8 {
			return fmt.Errorf("%d writes failed", errs.Load())
		}
		return nil
	})
	okWhileDown := ok.Load()
	p.start() // same ports and data
	testutil.Eventually(t, 15*time.Second, func() error {
		if ok.Load() < okWhileDown+50 {
			return fmt.Errorf("%d enqueued since the restart", ok.Load()-okWhileDown)
		}
		return nil
	})
	close(stop)
	wg.Wait()
	require.Positive(t, promtest.ToFloat64(s.m.reconnects))
	t.Logf("%d writes answered OK, %d failed", ok.Load(), errs.Load())

	// The epoch survived in the service: the store still writes under it,
	// and everything answered OK is there.
	st, found, err := s.LoadSession(ctx, id)
	require.NoError(t, err)
	require.True(t, found)
	require.GreaterOrEqual(t, int64(len(st.Queue)), ok.Load())
}

// TestClose: Close answers what is queued, and later writes fail at once.
func TestClose(t *testing.T) {
	p := startPersistence(t, "")
	s := newStore(t, p.URL)
	ctx := ctxT(t)
	sc := scope(t, "acme")
	id := sc.ClientID("c")
	require.NoError(t, s.Activate(ctx, id, 1))
	var ps []*durable.Pending
	for i := range 100 {
		ps = append(ps, s.Enqueue(id, queued(message(sc, uint64(i+1), "a", 1), uint64(i+1), 1)))
	}
	require.NoError(t, s.Close())
	for _, p := range ps {
		require.NoError(t, p.Wait(ctx))
	}
	require.ErrorIs(t, s.Enqueue(id, queued(message(sc, 200, "a", 1), 200, 1)).Wait(ctx), ErrClosed)
	require.ErrorIs(t, s.PutSession(ctx, durable.Session{ID: id, ProtocolVersion: 5}), ErrClosed)
}

// TestCloseWhileDown: with the service gone, Close returns within its
// bound and fails what waited.
func TestCloseWhileDown(t *testing.T) {
	s := newStore(t, "http://"+freeAddr(t), func(c *Config) { c.CloseTimeout = 500 * time.Millisecond })
	s.epochs["4:acmec"] = 1 // as if activated before the service went away
	p := s.Enqueue("4:acmec", queued(message(scope(t, "acme"), 1, "a", 1), 1, 1))
	start := time.Now()
	require.NoError(t, s.Close())
	require.Less(t, time.Since(start), 3*time.Second)
	require.Error(t, p.Wait(ctxT(t)))
}

// TestInvalidRefusedAlone: a write the service would refuse fails on its
// own, before it can spoil the batch of others.
func TestInvalidRefusedAlone(t *testing.T) {
	p := startPersistence(t, "")
	s := newStore(t, p.URL, func(c *Config) { c.MaxPayload = 16 })
	ctx := ctxT(t)
	sc := scope(t, "acme")
	id := sc.ClientID("c")
	require.NoError(t, s.Activate(ctx, id, 1))
	big := message(sc, 1, "a", 1)
	big.Payload = make([]byte, 17)
	badTopic := message(sc, 2, "a", 1)
	badTopic.Topic = "globex/a"
	good := message(sc, 3, "a", 1)
	good.Payload = []byte("ok")
	pb := s.Enqueue(id, queued(big, 1, 1))
	pt := s.Enqueue(id, queued(badTopic, 2, 1))
	pg := s.Enqueue(id, queued(good, 3, 1))
	require.ErrorIs(t, pb.Wait(ctx), ErrInvalid)
	require.ErrorIs(t, pt.Wait(ctx), ErrInvalid)
	require.NoError(t, pg.Wait(ctx))
	_, err := s.MatchRetained(ctx, "not-internal")
	require.ErrorIs(t, err, ErrInvalid)
}

// TestOrderInflight: in-flight entries come back in ingress order, whatever
// their packet IDs.
func TestOrderInflight(t *testing.T) {
	sc := scope(t, "acme")
	mk := func(seq uint64, created int64, pk uint16) durable.Entry {
		m := message(sc, seq, "a", 1)
		m.Created = created
		return durable.Entry{MsgID: m.ID, PacketID: pk, QoS: 1, Msg: m}
	}
	entries := []durable.Entry{mk(5, 300, 65535), mk(2, 100, 7), mk(3, 100, 65534), mk(4, 200, 1)}
	orderInflight(entries)
	var got []uint16
	for i, e := range entries {
		got = append(got, e.PacketID)
		require.Equal(t, int64(i+1), e.Order)
	}
	require.Equal(t, []uint16{7, 65534, 1, 65535}, got)
}

// TestTookQoS2Remembered: the msgIDs of QoS 2 deliveries enqueued as taken
// once come back with the session, oldest first, after their entries left,
// so that an edge resuming it drops a resend; others are not listed.
func TestTookQoS2Remembered(t *testing.T) {
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) {
			t.Parallel()
			p := be.start(t)
			s := newStore(t, p.URL)
			ctx := ctxT(t)
			sc := scope(t, "acme")
			id := sc.ClientID("c")
			require.NoError(t, s.Activate(ctx, id, 1))
			require.NoError(t, s.PutSession(ctx, durable.Session{ID: id, ProtocolVersion: 5, ExpiryInterval: 60}))
			m1, m2, m3 := message(sc, 1, "a", 2), message(sc, 2, "a", 2), message(sc, 3, "a", 2)
			for i, m := range []*durable.Message{m1, m2, m3} {
				e := queued(m, uint64(i+1), 2)
				e.TookQoS2 = m != m2 // a retained message sent on subscribe, say
				waitOK(t, s.Enqueue(id, e))
			}
			waitOK(t, s.Send(id, []durable.Entry{{Seq: 1, PacketID: 1, MsgID: m1.ID, QoS: 2, Msg: m1}}))
			require.NoError(t, s.Complete(ctx, id, 1))
			st, ok, err := s.LoadSession(ctx, id)
			require.NoError(t, err)
			require.True(t, ok)
			require.Len(t, st.Queue, 2)
			require.Empty(t, st.Inflight)
			require.Equal(t, []string{m1.ID, m3.ID}, st.TookQoS2)
		})
	}
}
