// Package storetest is the contract every [store.Store] implementation
// passes: run it from each implementation's tests with Run.
package storetest

import (
	"context"
	"fmt"
	"sort"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/persistence/internal/store"
)

// Run runs the contract suite; newStore returns a fresh, empty store.
func Run(t *testing.T, newStore func(t *testing.T) store.Store) {
	t.Run("fencing", func(t *testing.T) { testFencing(t, newStore(t)) })
	t.Run("queue", func(t *testing.T) { testQueue(t, newStore(t)) })
	t.Run("bounds", func(t *testing.T) { testBounds(t, newStore(t)) })
	t.Run("inflight", func(t *testing.T) { testInflight(t, newStore(t)) })
	t.Run("references", func(t *testing.T) { testReferences(t, newStore(t)) })
	t.Run("session_lifecycle", func(t *testing.T) { testSessionLifecycle(t, newStore(t)) })
	t.Run("retained", func(t *testing.T) { testRetained(t, newStore(t)) })
	t.Run("bad_input", func(t *testing.T) { testBadInput(t, newStore(t)) })
	t.Run("batch", func(t *testing.T) { testBatch(t, newStore(t)) })
	t.Run("took_qos2", func(t *testing.T) { testTookQoS2(t, newStore(t)) })
	t.Run("tenant_quota", func(t *testing.T) { testTenantQuota(t, newStore(t)) })
	t.Run("queue_order", func(t *testing.T) { testQueueOrder(t, newStore(t)) })
}

// testQueueOrder: entries leave the queue from anywhere (sent, dequeued,
// dropped as the oldest) and a msgID that left may be queued again: the
// queue keeps the order entries were queued in, the oldest is the one
// dropped, and a message queued again goes to the back.
func testQueueOrder(t *testing.T, s store.Store) {
	f := store.Fence{Epoch: 1}
	require.NoError(t, s.Activate(ctx, key, f))
	appendN(t, s, f, store.QueueLimits{}, 1, 6)
	sent := func(i int, pk uint16) store.Entry {
		e := entry(i)
		e.PacketID = pk
		return e
	}
	require.NoError(t, s.Send(ctx, key, f, []store.Entry{sent(2, 1), sent(4, 2)}))
	require.NoError(t, s.Dequeue(ctx, key, f, []string{msg(5).ID}))
	require.Equal(t, []string{msg(1).ID, msg(3).ID, msg(6).ID}, queueIDs(t, s))
	// 2 and 5 queued again (a relay, say): at the back.
	res, err := s.Append(ctx, key, f, store.QueueLimits{}, []store.Entry{entry(5), entry(2)}, []*store.Message{msg(5), msg(2)})
	require.NoError(t, err)
	require.Equal(t, store.AppendResult{Added: 2}, res)
	require.Equal(t, []string{msg(1).ID, msg(3).ID, msg(6).ID, msg(5).ID, msg(2).ID}, queueIDs(t, s))
	// The oldest go first, past the places of those that left (one for
	// each entry added: the queue was over the bound already).
	res = appendN(t, s, f, store.QueueLimits{MaxLen: 4, DropOldest: true}, 7, 8)
	require.Equal(t, store.AppendResult{Added: 2, DroppedOldest: 2}, res)
	require.Equal(t, []string{msg(6).ID, msg(5).ID, msg(2).ID, msg(7).ID, msg(8).ID}, queueIDs(t, s))
	st, err := s.Load(ctx, key)
	require.NoError(t, err)
	require.Len(t, st.Inflight, 2)
	require.Len(t, st.Messages, 6, "2 queued and in flight, 4, 5, 6, 7, 8")
	// Everything leaves; the queue starts again empty, and in order.
	var all []string
	for _, e := range st.Queue {
		all = append(all, e.MsgID)
	}
	require.NoError(t, s.Dequeue(ctx, key, f, all))
	require.Empty(t, queueIDs(t, s))
	appendN(t, s, f, store.QueueLimits{}, 9, 10)
	require.Equal(t, []string{msg(9).ID, msg(10).ID}, queueIDs(t, s))
}

// testTenantQuota: the entries queued for all of a tenant's sessions are
// bounded (QueueLimits.TenantMax), apart from other tenants'; every way an
// entry leaves a queue (sent, dequeued, dropped as the oldest, its session
// deleted) makes room again.
func testTenantQuota(t *testing.T, s store.Store) {
	f := store.Fence{Epoch: 1}
	a, b, c := store.SessionKey{Tenant: "acme", ClientID: "a"}, store.SessionKey{Tenant: "acme", ClientID: "b"}, store.SessionKey{Tenant: "acme", ClientID: "c"}
	other := store.SessionKey{Tenant: "other", ClientID: "a"}
	for _, k := range []store.SessionKey{a, b, c, other} {
		require.NoError(t, s.Activate(ctx, k, f))
	}
	refuse, drop := store.QueueLimits{TenantMax: 3}, store.QueueLimits{TenantMax: 3, DropOldest: true}
	app := func(k store.SessionKey, lim store.QueueLimits, ids ...int) store.AppendResult {
		t.Helper()
		var es []store.Entry
		var ms []*store.Message
		for _, i := range ids {
			es = append(es, entry(i))
			ms = append(ms, msg(i))
		}
		res, err := s.Append(ctx, k, f, lim, es, ms)
		require.NoError(t, err)
		return res
	}
	require.Equal(t, store.AppendResult{Added: 2}, app(a, refuse, 1, 2))
	require.Equal(t, store.AppendResult{Added: 1, Refused: 1}, app(b, refuse, 3, 4), "the tenant's third entry fits, its fourth not")
	require.Equal(t, store.AppendResult{Added: 2}, app(other, refuse, 1, 2), "another tenant counts apart")
	// Appends of one session in one batch (merged into one call by a
	// store that merges), the last past the bound, and a send joined to
	// them: the count follows each.
	lim4 := store.QueueLimits{TenantMax: 4}
	one := func(i int) store.Op {
		return store.Op{Kind: store.OpAppend, Key: other, Fence: f, Limits: lim4, Entries: []store.Entry{entry(i)}, Messages: []*store.Message{msg(i)}}
	}
	sent := entry(1) // queued before: a send joined to the appends (not one of theirs, which it would take direct)
	sent.PacketID = 1
	res := store.Submit(ctx, s, []store.Op{one(20), one(21), one(22), {Kind: store.OpSend, Key: other, Fence: f, Entries: []store.Entry{sent}}})()
	require.Len(t, res, 4)
	for i, want := range []store.AppendResult{{Added: 1}, {Added: 1}, {Refused: 1}, {}} {
		require.NoError(t, res[i].Err, "op %d", i)
		require.Equal(t, want, res[i].Append, "op %d", i)
	}
	u, err := s.TenantUsage(ctx, "other")
	require.NoError(t, err)
	require.Equal(t, 3, u.Queued, "2, 20 and 21 queued; 1 in flight")
	require.NoError(t, s.Dequeue(ctx, other, f, []string{msg(20).ID, msg(21).ID}))
	require.Equal(t, store.AppendResult{Refused: 1}, app(b, drop, 5), "the tenant's bound refuses, whatever the session's policy")
	require.Equal(t, store.AppendResult{Refused: 1}, app(c, drop, 6))
	require.Equal(t, store.AppendResult{Added: 1}, app(c, store.QueueLimits{}, 7), "without a bound the tenant's entries are still counted")
	require.Equal(t, store.AppendResult{Refused: 1}, app(c, refuse, 8), "counted: now 4 queued")

	// Sent (queue → in flight), dequeued, the session deleted: each frees.
	require.NoError(t, s.Send(ctx, a, f, []store.Entry{{MsgID: msg(1).ID, QoS: 1, PacketID: 1}}))
	require.NoError(t, s.Dequeue(ctx, c, f, []string{msg(7).ID}))
	require.Equal(t, store.AppendResult{Added: 1}, app(c, refuse, 9), "2 left the queues: 3 queued now")
	require.Equal(t, store.AppendResult{Refused: 1}, app(a, refuse, 10))
	require.NoError(t, s.DeleteSession(ctx, b, f))
	require.Equal(t, store.AppendResult{Added: 1}, app(a, refuse, 11), "b's one queued entry went with it")
	require.Equal(t, store.AppendResult{Duplicates: 1}, app(a, refuse, 11), "a duplicate takes no room")
	st, err := s.Load(ctx, a)
	require.NoError(t, err)
	require.Len(t, st.Queue, 2)
	require.Len(t, st.Inflight, 1)
	own := store.QueueLimits{MaxLen: 2, DropOldest: true, TenantMax: 3}
	require.Equal(t, store.AppendResult{Added: 1, DroppedOldest: 1}, app(a, own, 12), "at both bounds the session's own drop makes the room")
	u, err = s.TenantUsage(ctx, "acme")
	require.NoError(t, err)
	require.Equal(t, store.TenantUsage{Queued: 3}, u, "a's 11 and 12, c's 9")
	require.Equal(t, store.AppendResult{Added: 1}, app(c, store.QueueLimits{}, 13), "unbounded: the tenant now over its bound")
	require.Equal(t, store.AppendResult{Added: 1, DroppedOldest: 1}, app(a, own, 14), "over the tenant's bound, the session's own drop still makes room")
	u, err = s.TenantUsage(ctx, "acme")
	require.NoError(t, err)
	require.Equal(t, store.TenantUsage{Queued: 4}, u)
	_, err = s.PutRetained(ctx, "acme", &store.Message{ID: "r/1/1", Topic: "r/1", Payload: []byte("x"), Created: 1})
	require.NoError(t, err)
	u, err = s.TenantUsage(ctx, "acme")
	require.NoError(t, err)
	require.Equal(t, 1, u.Retained)
	u, err = s.TenantUsage(ctx, "other")
	require.NoError(t, err)
	require.Equal(t, store.TenantUsage{Queued: 1}, u)
	st, err = s.Load(ctx, a)
	require.NoError(t, err)
	require.Equal(t, []string{msg(12).ID, msg(14).ID}, []string{st.Queue[0].MsgID, st.Queue[1].MsgID})
}

var (
	ctx = context.Background()
	key = store.SessionKey{Tenant: "acme", ClientID: "dev-1"}
)

func msg(i int) *store.Message {
	return &store.Message{ID: fmt.Sprintf("edge-a/1/%d", i), Topic: "t", Payload: []byte{byte(i)}, QoS: 1, Created: int64(i)}
}

func entry(i int) store.Entry { return store.Entry{MsgID: msg(i).ID, QoS: 1} }

func appendN(t *testing.T, s store.Store, f store.Fence, lim store.QueueLimits, from, to int) store.AppendResult {
	t.Helper()
	var es []store.Entry
	var ms []*store.Message
	for i := from; i <= to; i++ {
		es = append(es, entry(i))
		ms = append(ms, msg(i))
	}
	res, err := s.Append(ctx, key, f, lim, es, ms)
	require.NoError(t, err)
	return res
}

func queueIDs(t *testing.T, s store.Store) []string {
	t.Helper()
	st, err := s.Load(ctx, key)
	require.NoError(t, err)
	var ids []string
	for _, e := range st.Queue {
		ids = append(ids, e.MsgID)
	}
	return ids
}

func testFencing(t *testing.T, s store.Store) {
	require.NoError(t, s.Activate(ctx, key, store.Fence{Epoch: 5}))
	require.ErrorIs(t, s.PutSubscription(ctx, key, store.Fence{Epoch: 4}, store.Subscription{Filter: "a"}), store.ErrFenced)
	_, err := s.Append(ctx, key, store.Fence{Epoch: 4}, store.QueueLimits{}, []store.Entry{entry(1)}, []*store.Message{msg(1)})
	require.ErrorIs(t, err, store.ErrFenced)
	require.ErrorIs(t, s.Activate(ctx, key, store.Fence{Epoch: 3}), store.ErrFenced, "epochs never go back")
	require.NoError(t, s.PutSubscription(ctx, key, store.Fence{Epoch: 5}, store.Subscription{Filter: "a"}))
	require.NoError(t, s.Activate(ctx, key, store.Fence{Epoch: 9}))
	require.NoError(t, s.PutSession(ctx, key, store.Fence{Epoch: 9}, store.Session{ProtocolVersion: 5, ExpiryInterval: 60}))
	require.ErrorIs(t, s.DeleteSession(ctx, key, store.Fence{Epoch: 5}), store.ErrFenced)
	// A fenced-off owner's session record (its will, its expiry) must not
	// overwrite the new owner's.
	require.ErrorIs(t, s.PutSession(ctx, key, store.Fence{Epoch: 8}, store.Session{ProtocolVersion: 4, ExpiryInterval: 1}), store.ErrFenced)
	st, err := s.Load(ctx, key)
	require.NoError(t, err)
	require.Equal(t, uint64(9), st.Epoch)
	require.Equal(t, uint32(60), st.Session.ExpiryInterval, "the fenced put changed nothing")
	require.Equal(t, byte(5), st.Session.ProtocolVersion)
	require.Len(t, st.Subs, 1, "the fenced delete changed nothing")
	require.Empty(t, st.Queue, "the fenced append stored nothing")
}

func testQueue(t *testing.T, s store.Store) {
	f := store.Fence{Epoch: 1}
	require.NoError(t, s.Activate(ctx, key, f))
	res := appendN(t, s, f, store.QueueLimits{}, 1, 3)
	require.Equal(t, 3, res.Added)
	// A retry of the same messages is a no-op: idempotent on msgID.
	res = appendN(t, s, f, store.QueueLimits{}, 2, 4)
	require.Equal(t, 1, res.Added)
	require.Equal(t, 2, res.Duplicates)
	require.Equal(t, []string{msg(1).ID, msg(2).ID, msg(3).ID, msg(4).ID}, queueIDs(t, s), "in order")
	st, err := s.Load(ctx, key)
	require.NoError(t, err)
	require.Len(t, st.Messages, 4)
	require.Equal(t, []byte{2}, st.Messages[msg(2).ID].Payload)
	require.NoError(t, s.Dequeue(ctx, key, f, []string{msg(1).ID}))
	require.Equal(t, []string{msg(2).ID, msg(3).ID, msg(4).ID}, queueIDs(t, s))

	// The store numbers queue positions itself, one per entry added, going
	// on across calls; a caller's Seq is ignored and the entry's other
	// fields are kept.
	e := store.Entry{MsgID: msg(5).ID, QoS: 2, Retain: true, SubIDs: []int{7, 9}, Seq: 999}
	res, err = s.Append(ctx, key, f, store.QueueLimits{}, []store.Entry{e, entry(6)}, []*store.Message{msg(5), msg(6)})
	require.NoError(t, err)
	require.Equal(t, 2, res.Added)
	st, err = s.Load(ctx, key)
	require.NoError(t, err)
	var seqs []uint64
	for _, q := range st.Queue {
		seqs = append(seqs, q.Seq)
	}
	require.Equal(t, []uint64{2, 3, 4, 5, 6}, seqs)
	e.Seq = 5
	require.Equal(t, e, st.Queue[3])
}

func testBounds(t *testing.T, s store.Store) {
	f := store.Fence{Epoch: 1}
	require.NoError(t, s.Activate(ctx, key, f))
	res := appendN(t, s, f, store.QueueLimits{MaxLen: 3}, 1, 5)
	require.Equal(t, store.AppendResult{Added: 3, Refused: 2}, res, "refuse newest")
	require.Equal(t, []string{msg(1).ID, msg(2).ID, msg(3).ID}, queueIDs(t, s))
	res = appendN(t, s, f, store.QueueLimits{MaxLen: 3, DropOldest: true}, 6, 7)
	require.Equal(t, store.AppendResult{Added: 2, DroppedOldest: 2}, res, "drop oldest")
	require.Equal(t, []string{msg(3).ID, msg(6).ID, msg(7).ID}, queueIDs(t, s))
	st, err := s.Load(ctx, key)
	require.NoError(t, err)
	require.Len(t, st.Messages, 3, "dropped messages are not kept")
}

// testReferences: a stored message lives while any queue or in-flight
// entry refers to it, however the references come and go within one call.
func testReferences(t *testing.T, s store.Store) {
	f := store.Fence{Epoch: 1}
	require.NoError(t, s.Activate(ctx, key, f))
	sent := func(i int, pk uint16) store.Entry {
		e := entry(i)
		e.PacketID = pk
		return e
	}
	stored := func() []string {
		t.Helper()
		st, err := s.Load(ctx, key)
		require.NoError(t, err)
		var ids []string
		for id := range st.Messages {
			ids = append(ids, id)
		}
		sort.Strings(ids)
		return ids
	}
	appendN(t, s, f, store.QueueLimits{}, 1, 2)
	// Message 1 goes out twice (two subscriptions), message 2 once.
	require.NoError(t, s.Send(ctx, key, f, []store.Entry{sent(1, 1), sent(1, 2), sent(2, 3)}))
	st, err := s.Load(ctx, key)
	require.NoError(t, err)
	require.Empty(t, st.Queue)
	require.Len(t, st.Inflight, 3)
	require.NoError(t, s.Complete(ctx, key, f, []uint16{1}))
	require.Equal(t, []string{msg(1).ID, msg(2).ID}, stored(), "message 1 is still in flight at packet 2")
	// Sent again at the same packet IDs (a resend), then packet 2 completed
	// twice in one call: message 1's last reference goes once.
	require.NoError(t, s.Send(ctx, key, f, []store.Entry{sent(1, 2), sent(2, 3)}))
	require.NoError(t, s.Complete(ctx, key, f, []uint16{2, 2}))
	require.Equal(t, []string{msg(2).ID}, stored())
	// A packet ID taken by another message releases the one it held, even
	// twice within one call.
	appendN(t, s, f, store.QueueLimits{}, 3, 4)
	require.NoError(t, s.Send(ctx, key, f, []store.Entry{sent(3, 3), sent(4, 3)}))
	st, err = s.Load(ctx, key)
	require.NoError(t, err)
	require.Equal(t, []store.Entry{sent(4, 3)}, st.Inflight)
	require.Equal(t, []string{msg(4).ID}, stored())
	require.NoError(t, s.Complete(ctx, key, f, []uint16{3}))
	require.Empty(t, stored())
	// One call sends a queued message at QoS 0 and at QoS 1 (two
	// subscriptions): the QoS 0 copy needs no reference, the other keeps
	// the message.
	appendN(t, s, f, store.QueueLimits{}, 5, 5)
	atMostOnce := entry(5)
	atMostOnce.QoS = 0
	require.NoError(t, s.Send(ctx, key, f, []store.Entry{atMostOnce, sent(5, 4)}))
	require.Equal(t, []string{msg(5).ID}, stored())
	require.NoError(t, s.Complete(ctx, key, f, []uint16{4}))
	require.Empty(t, stored())
}

func testInflight(t *testing.T, s store.Store) {
	f := store.Fence{Epoch: 1}
	require.NoError(t, s.Activate(ctx, key, f))
	appendN(t, s, f, store.QueueLimits{}, 1, 3)
	sent := []store.Entry{entry(1), entry(2)}
	sent[0].PacketID, sent[1].PacketID = 65535, 65534
	sent[1].QoS = 2
	require.NoError(t, s.Send(ctx, key, f, sent))
	require.NoError(t, s.Pubrel(ctx, key, f, 65534))
	st, err := s.Load(ctx, key)
	require.NoError(t, err)
	require.Len(t, st.Queue, 1)
	require.Len(t, st.Inflight, 2)
	sort.Slice(st.Inflight, func(i, j int) bool { return st.Inflight[i].PacketID > st.Inflight[j].PacketID })
	require.Equal(t, uint16(65535), st.Inflight[0].PacketID)
	require.False(t, st.Inflight[0].Pubrel)
	require.True(t, st.Inflight[1].Pubrel)
	require.Len(t, st.Messages, 3)
	require.NoError(t, s.Complete(ctx, key, f, []uint16{65535, 65534}))
	st, err = s.Load(ctx, key)
	require.NoError(t, err)
	require.Empty(t, st.Inflight)
	require.Len(t, st.Messages, 1, "completed messages are released")
	// Sending a message that was never stored is refused, and the rest of
	// the send changes nothing: the queued entry stays queued.
	queued := entry(3)
	queued.PacketID = 8
	require.ErrorIs(t, s.Send(ctx, key, f, []store.Entry{queued, {MsgID: "nope", QoS: 1, PacketID: 9}}), store.ErrInvalid)
	st, err = s.Load(ctx, key)
	require.NoError(t, err)
	require.Len(t, st.Queue, 1, "a refused send moves nothing")
	require.Empty(t, st.Inflight)
	// Inbound QoS 2 state.
	require.NoError(t, s.PutIncoming(ctx, key, f, store.Incoming{PacketID: 42, MsgID: "m42"}))
	st, _ = s.Load(ctx, key)
	require.Equal(t, []store.Incoming{{PacketID: 42, MsgID: "m42"}}, st.Incoming)
	require.NoError(t, s.DeleteIncoming(ctx, key, f, 42))
	st, _ = s.Load(ctx, key)
	require.Empty(t, st.Incoming)
}

func testSessionLifecycle(t *testing.T, s store.Store) {
	f := store.Fence{Epoch: 3}
	require.NoError(t, s.Activate(ctx, key, f))
	require.NoError(t, s.PutSession(ctx, key, f, store.Session{ProtocolVersion: 5, ExpiryInterval: 60}))
	require.NoError(t, s.PutSubscription(ctx, key, f, store.Subscription{Filter: "a/#", QoS: 1}))
	require.NoError(t, s.PutSubscription(ctx, key, f, store.Subscription{Filter: "a/#", QoS: 2}))
	appendN(t, s, f, store.QueueLimits{}, 1, 2)
	st, err := s.Load(ctx, key)
	require.NoError(t, err)
	require.Equal(t, uint32(60), st.Session.ExpiryInterval)
	require.Equal(t, []store.Subscription{{Filter: "a/#", QoS: 2}}, st.Subs, "a repeated filter replaces")
	require.NoError(t, s.DeleteSubscription(ctx, key, f, "a/#"))
	require.NoError(t, s.DeleteSession(ctx, key, f))
	st, err = s.Load(ctx, key)
	require.NoError(t, err)
	require.Nil(t, st.Session)
	require.Empty(t, st.Queue)
	require.Empty(t, st.Messages)
	require.Equal(t, uint64(3), st.Epoch, "the epoch survives the session")
	require.ErrorIs(t, s.Activate(ctx, key, store.Fence{Epoch: 2}), store.ErrFenced)
}

func rmsg(topic string, created int64, payload string) *store.Message {
	return &store.Message{ID: fmt.Sprintf("r/%s/%d", topic, created), Topic: topic, Payload: []byte(payload), QoS: 1, Retain: true, Created: created}
}

func topics(ms []*store.Message) []string {
	var out []string
	for _, m := range ms {
		out = append(out, m.Topic)
	}
	sort.Strings(out)
	return out
}

func testRetained(t *testing.T, s store.Store) {
	for i, topic := range []string{"a", "a/b", "a/b/c", "a/x/c", "b", "$SYS/x", "/lead", "a//c"} {
		changed, err := s.PutRetained(ctx, "acme", rmsg(topic, int64(10+i), "v"))
		require.NoError(t, err)
		require.True(t, changed)
	}
	_, err := s.PutRetained(ctx, "other", rmsg("a", 1, "other tenant"))
	require.NoError(t, err)
	// Replaced only by newer messages.
	changed, err := s.PutRetained(ctx, "acme", rmsg("a", 5, "old"))
	require.NoError(t, err)
	require.False(t, changed)
	changed, err = s.PutRetained(ctx, "acme", rmsg("a", 100, "new"))
	require.NoError(t, err)
	require.True(t, changed)

	for _, tc := range []struct {
		filter string
		want   []string
	}{
		{"a", []string{"a"}},
		{"a/#", []string{"a", "a/b", "a/b/c", "a/x/c", "a//c"}},
		{"a/+/c", []string{"a//c", "a/b/c", "a/x/c"}},
		{"+", []string{"a", "b"}},
		{"#", []string{"/lead", "a", "a//c", "a/b", "a/b/c", "a/x/c", "b"}}, // not $SYS ([MQTT-4.7.2-1])
		{"$SYS/#", []string{"$SYS/x"}},
		{"+/lead", []string{"/lead"}},
		{"nothing/#", nil},
	} {
		got, err := s.LookupRetained(ctx, "acme", tc.filter, 100)
		require.NoError(t, err, tc.filter)
		want := append([]string(nil), tc.want...)
		sort.Strings(want)
		require.Equal(t, want, topics(got), tc.filter)
	}
	got, _ := s.LookupRetained(ctx, "acme", "a", 10)
	require.Equal(t, []byte("new"), got[0].Payload)
	got, _ = s.LookupRetained(ctx, "acme", "#", 3)
	require.Len(t, got, 3, "limit")

	// An empty payload deletes, and only newer deletes count.
	changed, err = s.PutRetained(ctx, "acme", &store.Message{ID: "del", Topic: "a/b/c", Created: 1000})
	require.NoError(t, err)
	require.True(t, changed)
	got, _ = s.LookupRetained(ctx, "acme", "a/#", 100)
	require.Equal(t, []string{"a", "a//c", "a/b", "a/x/c"}, topics(got))
	got, _ = s.LookupRetained(ctx, "other", "#", 100)
	require.Equal(t, []string{"a"}, topics(got), "tenants are apart")

	// A wildcard level with many children (the index is read a page at a
	// time): every match up to the limit, and the limit.
	var wantWide []string
	for i := range 1500 {
		tp := fmt.Sprintf("wide/%d/t", i)
		_, err := s.PutRetained(ctx, "wide", rmsg(tp, 1, "v"))
		require.NoError(t, err)
		_, err = s.PutRetained(ctx, "wide", rmsg(fmt.Sprintf("wide/%d/u", i), 1, "v"))
		require.NoError(t, err)
		wantWide = append(wantWide, tp)
	}
	sort.Strings(wantWide)
	got, err = s.LookupRetained(ctx, "wide", "wide/+/t", 2000)
	require.NoError(t, err)
	require.Equal(t, wantWide, topics(got), "wide/+/t")
	got, _ = s.LookupRetained(ctx, "wide", "wide/+/t", 10)
	require.Len(t, got, 10, "limit on a wide level")
	got, _ = s.LookupRetained(ctx, "wide", "#", 5000)
	require.Len(t, got, 3000, "# on a wide level")
}

func testBadInput(t *testing.T, s store.Store) {
	f := store.Fence{Epoch: 1}
	bad := store.SessionKey{Tenant: "", ClientID: "x"}
	require.ErrorIs(t, s.Activate(ctx, bad, f), store.ErrInvalid)
	_, err := s.Append(ctx, key, f, store.QueueLimits{}, []store.Entry{entry(1)}, []*store.Message{msg(2)})
	require.ErrorIs(t, err, store.ErrInvalid, "entry and message disagree")
	_, err = s.PutRetained(ctx, "acme", &store.Message{ID: "x"})
	require.ErrorIs(t, err, store.ErrInvalid, "no topic")
	st, err := s.Load(ctx, key)
	require.NoError(t, err)
	require.Empty(t, st.Queue)
}

// testBatch submits interleaved ops of several sessions in one batch, as
// the persistence service does with what its streams bring: every op gets
// its own result, whatever the store merges, and the batch's order holds
// where it matters.
func testBatch(t *testing.T, s store.Store) {
	a, b, c := key, store.SessionKey{Tenant: "acme", ClientID: "dev-2"}, store.SessionKey{Tenant: "acme", ClientID: "dev-3"}
	f := store.Fence{Epoch: 1}
	for _, k := range []store.SessionKey{a, b} {
		require.NoError(t, s.Activate(ctx, k, f))
	}
	require.NoError(t, s.Activate(ctx, c, store.Fence{Epoch: 5}))
	// A holds message 10 in flight, its only reference, and message 11.
	appendN(t, s, f, store.QueueLimits{}, 10, 11)
	inflight := []store.Entry{entry(10), entry(11)}
	inflight[0].PacketID, inflight[1].PacketID = 1, 2
	require.NoError(t, s.Send(ctx, a, f, inflight))

	lim := store.QueueLimits{MaxLen: 3}
	app := func(k store.SessionKey, fence store.Fence, i int) store.Op {
		return store.Op{Kind: store.OpAppend, Key: k, Fence: fence, Limits: lim, Entries: []store.Entry{entry(i)}, Messages: []*store.Message{msg(i)}}
	}
	neverQueued := entry(10)
	neverQueued.PacketID = 7
	ops := []store.Op{
		app(a, f, 1),
		app(b, f, 1),
		{Kind: store.OpComplete, Key: a, Fence: f, PacketIDs: []uint16{2}},
		app(a, f, 2),
		app(c, store.Fence{Epoch: 4}, 1), // fenced: C is at epoch 5
		// B takes message 10 while A still holds it; A lets it go after
		// (below: the ops of two sessions have no order between them).
		{Kind: store.OpSend, Key: b, Fence: f, Entries: []store.Entry{neverQueued}},
		app(a, f, 3),
		app(a, f, 4), // A's queue is full: refused
		app(a, f, 2), // a retry: duplicate
		app(b, f, 2),
	}
	res := store.Submit(ctx, s, ops)()
	require.Len(t, res, len(ops))
	want := []store.AppendResult{{Added: 1}, {Added: 1}, {}, {Added: 1}, {}, {}, {Added: 1}, {Refused: 1}, {Duplicates: 1}, {Added: 1}}
	for i, r := range res {
		if i == 4 {
			require.ErrorIs(t, r.Err, store.ErrFenced, "op %d", i)
			continue
		}
		require.NoError(t, r.Err, "op %d", i)
		require.Equal(t, want[i], r.Append, "op %d", i)
	}
	require.Equal(t, []string{msg(1).ID, msg(2).ID, msg(3).ID}, queueIDs(t, s), "A's queue in batch order")
	require.NoError(t, s.Complete(ctx, a, f, []uint16{1}))
	st, err := s.Load(ctx, b)
	require.NoError(t, err)
	require.Len(t, st.Inflight, 1)
	require.NotNil(t, st.Messages[msg(10).ID], "B's in-flight message outlived A's release")
	st, err = s.Load(ctx, c)
	require.NoError(t, err)
	require.Empty(t, st.Queue, "the fenced append stored nothing")
}

// testTookQoS2: the store remembers the msgIDs of the last TookQoS2Len
// entries appended marked TookQoS2, oldest first, whatever becomes of the
// entries, so that a session resumed from the store still drops a resend
// of a QoS 2 message it took.
func testTookQoS2(t *testing.T, s store.Store) {
	f := store.Fence{Epoch: 2}
	require.NoError(t, s.Activate(ctx, key, f))
	load := func() *store.State {
		t.Helper()
		st, err := s.Load(ctx, key)
		require.NoError(t, err)
		return st
	}
	ids := func(is ...int) []string {
		var out []string
		for _, i := range is {
			out = append(out, msg(i).ID)
		}
		return out
	}
	// appendQoS2 appends entries at QoS 2, marked unless i is negative.
	appendQoS2 := func(f store.Fence, lim store.QueueLimits, is ...int) (store.AppendResult, error) {
		var es []store.Entry
		var ms []*store.Message
		for _, i := range is {
			e := store.Entry{MsgID: msg(abs(i)).ID, QoS: 2, TookQoS2: i > 0}
			es, ms = append(es, e), append(ms, msg(abs(i)))
		}
		return s.Append(ctx, key, f, lim, es, ms)
	}

	require.Empty(t, load().TookQoS2)
	res, err := appendQoS2(f, store.QueueLimits{}, 1, -2, 3)
	require.NoError(t, err)
	require.Equal(t, store.AppendResult{Added: 3}, res)
	st := load()
	require.Equal(t, ids(1, 3), st.TookQoS2, "marked entries only, in order")
	for _, e := range st.Queue {
		require.False(t, e.TookQoS2, "the mark is not part of the stored entry")
	}
	// A retry of the append (its answer was lost) lists nothing twice; an
	// entry queued unmarked and appended again marked is listed then.
	res, err = appendQoS2(f, store.QueueLimits{}, 1, 2, 3)
	require.NoError(t, err)
	require.Equal(t, store.AppendResult{Duplicates: 3}, res)
	require.Equal(t, ids(1, 3, 2), load().TookQoS2)

	// Delivered and completed, the entries are gone; the memory stays.
	var sent []store.Entry
	for i, id := range ids(1, 2, 3) {
		sent = append(sent, store.Entry{MsgID: id, QoS: 2, PacketID: uint16(10 + i)})
	}
	require.NoError(t, s.Send(ctx, key, f, sent))
	require.NoError(t, s.Pubrel(ctx, key, f, 10))
	require.NoError(t, s.Complete(ctx, key, f, []uint16{10, 11, 12}))
	st = load()
	require.Empty(t, st.Queue)
	require.Empty(t, st.Inflight)
	require.Empty(t, st.Messages)
	require.Equal(t, ids(1, 3, 2), st.TookQoS2)

	// An entry the queue limit refuses was not taken; one sent at once
	// (its send in the append's batch) was.
	res, err = appendQoS2(f, store.QueueLimits{MaxLen: 1}, 4, 5)
	require.NoError(t, err)
	require.Equal(t, store.AppendResult{Added: 1, Refused: 1}, res)
	r := store.Submit(ctx, s, []store.Op{
		{Kind: store.OpAppend, Key: key, Fence: f, Entries: []store.Entry{{MsgID: msg(6).ID, QoS: 2, TookQoS2: true}}, Messages: []*store.Message{msg(6)}},
		{Kind: store.OpSend, Key: key, Fence: f, Entries: []store.Entry{{MsgID: msg(6).ID, QoS: 2, PacketID: 20}}},
	})()
	require.NoError(t, r[0].Err)
	require.NoError(t, r[1].Err)
	require.Equal(t, ids(1, 3, 2, 4, 6), load().TookQoS2)

	// A fenced append records nothing.
	require.NoError(t, s.Activate(ctx, key, store.Fence{Epoch: 3}))
	_, err = appendQoS2(f, store.QueueLimits{}, 7)
	require.ErrorIs(t, err, store.ErrFenced)
	f = store.Fence{Epoch: 3}
	require.Equal(t, ids(1, 3, 2, 4, 6), load().TookQoS2)

	// DeleteSession forgets, as it forgets the queue.
	require.NoError(t, s.DeleteSession(ctx, key, f))
	require.Empty(t, load().TookQoS2)

	// The newest TookQoS2Len are kept, within one append and across them.
	var many []int
	for i := 1001; i <= 1000+store.TookQoS2Len+6; i++ {
		many = append(many, i)
	}
	res, err = appendQoS2(f, store.QueueLimits{}, many...)
	require.NoError(t, err)
	require.Equal(t, len(many), res.Added)
	require.Equal(t, ids(many[6:]...), load().TookQoS2)
	_, err = appendQoS2(f, store.QueueLimits{}, 3001, -3002, 3003)
	require.NoError(t, err)
	require.Equal(t, append(ids(many[8:]...), ids(3001, 3003)...), load().TookQoS2)
}

func abs(i int) int { return max(i, -i) }
