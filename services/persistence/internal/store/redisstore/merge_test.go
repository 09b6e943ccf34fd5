package redisstore

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/persistence/internal/redistest"
	"github.com/keelmq/keel/services/persistence/internal/store"
)

// TestCommit_MergesPerSession commits one batch of interleaved ops of
// several sessions, as the commit loop does: a session's appends (and its
// completes) become one script call, every op still gets its own result,
// and a release never moves past a send that needs its message.
func TestCommit_MergesPerSession(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	node := redistest.StartNode(t)
	s, err := New(Config{Addr: node.Addr}, testutil.Logger(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	ctx := t.Context()

	a, b, c := store.SessionKey{Tenant: "acme", ClientID: "a"}, store.SessionKey{Tenant: "acme", ClientID: "b"}, store.SessionKey{Tenant: "acme", ClientID: "c"}
	f := store.Fence{Epoch: 1}
	require.NoError(t, s.Activate(ctx, a, f))
	require.NoError(t, s.Activate(ctx, b, f))
	require.NoError(t, s.Activate(ctx, c, store.Fence{Epoch: 5}))
	msg := func(i int) *store.Message {
		return &store.Message{ID: fmt.Sprintf("e/1/%d", i), Topic: "t", Payload: []byte{byte(i)}, QoS: 1, Created: int64(i)}
	}
	entry := func(i int, pk uint16) store.Entry { return store.Entry{MsgID: msg(i).ID, QoS: 1, PacketID: pk} }
	// A holds messages 10 and 11 in flight: each its only reference.
	_, err = s.Append(ctx, a, f, store.QueueLimits{}, []store.Entry{entry(10, 0), entry(11, 0)}, []*store.Message{msg(10), msg(11)})
	require.NoError(t, err)
	require.NoError(t, s.Send(ctx, a, f, []store.Entry{entry(10, 1), entry(11, 2)}))

	lim := store.QueueLimits{MaxLen: 3}
	app := func(k store.SessionKey, fence store.Fence, i int) store.Op {
		return store.Op{Kind: store.OpAppend, Key: k, Fence: fence, Limits: lim, Entries: []store.Entry{entry(i, 0)}, Messages: []*store.Message{msg(i)}}
	}
	ops := []store.Op{
		app(a, f, 1),
		app(b, f, 1),
		{Kind: store.OpComplete, Key: a, Fence: f, PacketIDs: []uint16{2}},
		app(a, f, 2),
		app(c, store.Fence{Epoch: 4}, 1), // fenced
		// B takes message 10, never queued, while A still holds it...
		{Kind: store.OpSend, Key: b, Fence: f, Entries: []store.Entry{entry(10, 7)}},
		// ...and A releases it after: this complete must not join A's first.
		{Kind: store.OpComplete, Key: a, Fence: f, PacketIDs: []uint16{1}},
		app(a, f, 3),
		app(a, f, 4), // A's queue is full: refused
		app(a, f, 2), // duplicate
		app(b, f, 2),
	}
	shape, results := committed(t, s, ops, true)
	// A's appends join; B's second append comes after B's send; A's second
	// complete comes after B's send, so it does not join A's first.
	require.Equal(t, [][]int{{0, 3, 7, 8, 9}, {1}, {2}, {4}, {5}, {6}, {10}}, shape)
	want := []store.AppendResult{{Added: 1}, {Added: 1}, {}, {Added: 1}, {}, {}, {}, {Added: 1}, {Refused: 1}, {Duplicates: 1}, {Added: 1}}
	for i, res := range results {
		if i == 4 {
			require.ErrorIs(t, res.Err, store.ErrFenced)
			continue
		}
		require.NoError(t, res.Err, "op %d", i)
		require.Equal(t, want[i], res.Append, "op %d", i)
	}
	st, err := s.Load(ctx, b)
	require.NoError(t, err)
	require.NotNil(t, st.Messages[msg(10).ID], "B's in-flight message outlived A's release")
	require.Len(t, st.Queue, 2)
	st, err = s.Load(ctx, a)
	require.NoError(t, err)
	require.Len(t, st.Queue, 3)
	require.Empty(t, st.Inflight)
}

// commit writes a batch and answers it, as the commit loop does when no
// commit is before it.
func (s *Store) commit(ctx context.Context, conn *redis.Conn, batch []*op) error {
	done := make(chan struct{})
	close(done)
	return s.finish(ctx, conn, s.write(ctx, conn, batch), done)
}

// committed prepares ops and commits them as one batch; it returns the
// calls merge made (their op indexes) and each op's result.
func committed(t *testing.T, s *Store, ops []store.Op, merged bool) ([][]int, []store.OpResult) {
	t.Helper()
	ctx := t.Context()
	batch := make([]*op, len(ops))
	for i := range ops {
		o, err := s.prepare(&ops[i])
		require.NoError(t, err)
		o.result = make(chan opResult, 1)
		batch[i] = o
	}
	conn := s.rdb.Conn()
	defer conn.Close()
	require.NoError(t, loadScripts(ctx, conn))
	var shape [][]int
	if merged {
		for _, c := range merge(batch) {
			shape = append(shape, c.ops)
		}
		require.NoError(t, s.commit(ctx, conn, batch))
	} else {
		for _, o := range batch {
			require.NoError(t, s.commit(ctx, conn, []*op{o}))
		}
	}
	res := make([]store.OpResult, len(ops))
	for i, o := range batch {
		r := <-o.result
		res[i] = parse(ops[i].Kind, r.val, r.err)
	}
	return shape, res
}

// references returns every stored message's reference count, by msgID.
func references(t *testing.T, s *Store) map[string]string {
	t.Helper()
	ctx := t.Context()
	keys, err := s.rdb.Keys(ctx, "m[bx]:*").Result()
	require.NoError(t, err)
	out := map[string]string{}
	for _, k := range keys {
		fields, err := s.rdb.HGetAll(ctx, k).Result()
		require.NoError(t, err)
		for f := range fields {
			if len(f) == 2 {
				n := fields["#"+f]
				if n == "" {
					n = "1"
				}
				out[k[3:]+f] = n
			}
		}
	}
	return out
}

// TestCommit_SendJoinsItsAppend commits one batch in which sessions append
// messages and send them at once, and the same ops one call each on
// another server: a send joins the append call that stores its messages
// (unless a complete of the session came between, or it sends a message
// the call does not store), and the stored state is the same either way,
// reference counts included; only the joined entries never touched the
// queue. Odd messages are marked TookQoS2: the session's list of them is
// the same too.
func TestCommit_SendJoinsItsAppend(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	open := func() *Store {
		s, err := New(Config{Addr: redistest.StartNode(t).Addr}, testutil.Logger(t))
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		return s
	}
	a, b := store.SessionKey{Tenant: "acme", ClientID: "a"}, store.SessionKey{Tenant: "acme", ClientID: "b"}
	f := store.Fence{Epoch: 1}
	msg := func(i int) *store.Message {
		return &store.Message{ID: fmt.Sprintf("e/1/%d", i), Topic: "t", Payload: []byte{byte(i)}, QoS: 1, Created: int64(i)}
	}
	lim := store.QueueLimits{MaxLen: 4}
	app := func(k store.SessionKey, is ...int) store.Op {
		o := store.Op{Kind: store.OpAppend, Key: k, Fence: f, Limits: lim}
		for _, i := range is {
			o.Entries = append(o.Entries, store.Entry{MsgID: msg(i).ID, QoS: 1, TookQoS2: i%2 == 1})
			o.Messages = append(o.Messages, msg(i))
		}
		return o
	}
	// send takes (message, packet ID, QoS) triples.
	send := func(k store.SessionKey, xs ...int) store.Op {
		o := store.Op{Kind: store.OpSend, Key: k, Fence: f}
		for j := 0; j < len(xs); j += 3 {
			o.Entries = append(o.Entries, store.Entry{MsgID: msg(xs[j]).ID, PacketID: uint16(xs[j+1]), QoS: byte(xs[j+2])})
		}
		return o
	}
	complete := func(k store.SessionKey, pks ...uint16) store.Op {
		return store.Op{Kind: store.OpComplete, Key: k, Fence: f, PacketIDs: pks}
	}
	ops := []store.Op{
		app(a, 1, 2),
		app(b, 1),
		send(a, 1, 1, 1, 2, 2, 0), // 2 goes at QoS 0: its reference goes
		app(a, 3, 4),
		send(a, 3, 3, 1, 3, 4, 1), // 3 twice: the second copy is a reference of its own
		app(b, 6),
		send(b, 6, 9, 1, 1, 10, 2),
		app(a, 5),
		complete(a, 1),
		send(a, 5, 1, 1), // a complete came between (packet ID 1 again): not joined
		app(a, 7),
		send(a, 7, 5, 1, 4, 6, 1), // 4 is queued by an earlier call: not joined
		app(b, 8),
		send(b, 8, 11, 1),
	}
	merged, alone := open(), open()
	for _, s := range []*Store{merged, alone} {
		require.NoError(t, s.Activate(t.Context(), a, f))
		require.NoError(t, s.Activate(t.Context(), b, f))
	}
	shape, got := committed(t, merged, ops, true)
	require.Equal(t, [][]int{{0, 2}, {1, 5, 6}, {3, 4}, {7}, {8}, {9}, {10}, {11}, {12, 13}}, shape)
	_, want := committed(t, alone, ops, false)
	require.Equal(t, want, got)
	for _, k := range []store.SessionKey{a, b} {
		sm, err := merged.Load(t.Context(), k)
		require.NoError(t, err)
		sa, err := alone.Load(t.Context(), k)
		require.NoError(t, err)
		slices.SortFunc(sm.Inflight, byPacketID)
		slices.SortFunc(sa.Inflight, byPacketID)
		require.Equal(t, sa, sm, "session %s", k.ClientID)
	}
	st, err := merged.Load(t.Context(), a)
	require.NoError(t, err)
	require.Equal(t, []string{msg(1).ID, msg(3).ID, msg(5).ID, msg(7).ID}, st.TookQoS2)
	require.Equal(t, references(t, alone), references(t, merged))
	// A full queue does not bound a message sent at once: it never waits
	// in the queue.
	full := store.QueueLimits{MaxLen: 1}
	_, res := committed(t, merged, []store.Op{app(a, 10), complete(a, 1, 2, 3, 4, 5, 6)}, true)
	require.Equal(t, store.AppendResult{Added: 1}, res[0].Append)
	_, res = committed(t, merged, []store.Op{
		{Kind: store.OpAppend, Key: a, Fence: f, Limits: full, Entries: []store.Entry{{MsgID: msg(9).ID, QoS: 1}}, Messages: []*store.Message{msg(9)}},
		send(a, 9, 12, 1),
	}, true)
	require.NoError(t, res[0].Err)
	require.Equal(t, store.AppendResult{Added: 1}, res[0].Append)
	require.NoError(t, res[1].Err)
	st, err = merged.Load(t.Context(), a)
	require.NoError(t, err)
	require.Len(t, st.Queue, 1)
	require.Equal(t, msg(10).ID, st.Queue[0].MsgID)
	require.Len(t, st.Inflight, 1)
	require.Equal(t, msg(9).ID, st.Inflight[0].MsgID)
	require.Contains(t, st.Messages, msg(9).ID)
}

func byPacketID(x, y store.Entry) int { return int(x.PacketID) - int(y.PacketID) }

// TestAppend_UnmarkedCostsNoCommand: appends without TookQoS2, fresh or
// retried, run no command of the TookQoS2 list and leave its key unmade.
func TestAppend_UnmarkedCostsNoCommand(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	node := redistest.StartNode(t)
	s, err := New(Config{Addr: node.Addr}, testutil.Logger(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	ctx := t.Context()
	k := store.SessionKey{Tenant: "acme", ClientID: "a"}
	f := store.Fence{Epoch: 1}
	require.NoError(t, s.Activate(ctx, k, f))
	rdb := node.Client()
	require.NoError(t, rdb.ConfigResetStat(ctx).Err())
	es := []store.Entry{{MsgID: "e/1/1", QoS: 2}, {MsgID: "e/1/2", QoS: 2}}
	ms := []*store.Message{{ID: "e/1/1", Topic: "t"}, {ID: "e/1/2", Topic: "t"}}
	for range 2 {
		_, err := s.Append(ctx, k, f, store.QueueLimits{MaxLen: 1}, es, ms)
		require.NoError(t, err)
	}
	stats, err := rdb.Info(ctx, "commandstats").Result()
	require.NoError(t, err)
	require.Contains(t, stats, "cmdstat_evalsha:")
	// One RPUSH: the queue's order list, for the first append's queued
	// entry (the second append's entries are queued already, or refused).
	require.Contains(t, stats, "cmdstat_rpush:calls=1,")
	for _, cmd := range []string{"ltrim", "lrange", "lpos", "llen"} {
		require.NotContains(t, stats, "cmdstat_"+cmd+":")
	}
	require.Zero(t, rdb.Exists(ctx, keysOf(k).took).Val())
}

// TestCommit_CoalescesRetainedPerTopic commits one batch of retained
// writes, several to one topic: of a topic's sets with no clear between,
// only the one the script would leave (the newest; of equal ones the last)
// reaches Redis, the others ride on its call and are answered "not
// changed", and what is stored is what the same writes leave one call at a
// time. Creation times compare exactly, not as doubles.
func TestCommit_CoalescesRetainedPerTopic(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	put := func(topic string, created int64, payload string) store.Op {
		return store.Op{Kind: store.OpPutRetained, Tenant: "acme", Retained: &store.Message{ID: fmt.Sprintf("e/1/%s/%d/%s", topic, created, payload),
			Topic: topic, Payload: []byte(payload), QoS: 1, Created: created}}
	}
	ops := func() []store.Op {
		return []store.Op{
			put("s/t", 1, "a"),
			put("s/u", 1, "u"),
			put("s/t", 3, "c"),
			put("s/t", 2, "b"), // older than the one before: the script refuses it
			put("s/v", 1, ""),  // clears what is not there
			put("s/t", 3, "d"), // as new as c, and later: it stays
			put("s/w", 2, "w"),
			put("s/w", 1, ""),  // an older clear: refused
			put("s/x", 5, ""),  // clears what is not there...
			put("s/x", 1, "x"), // ...so this older set is stored
			put("s/x", 2, "y"), // and replaced
			put("s/y", 1_700_000_000_000_000_100, "y1"),
			put("s/y", 1_700_000_000_000_000_000, "y0"), // 100 ns older: refused, though equal as doubles
		}
	}
	stored := func(s *Store) map[string]string {
		t.Helper()
		ms, err := s.LookupRetained(t.Context(), "acme", "#", 100)
		require.NoError(t, err)
		out := map[string]string{}
		for _, m := range ms {
			out[m.Topic] = string(m.Payload)
		}
		return out
	}
	var states []map[string]string
	for _, merged := range []bool{true, false} {
		node := redistest.StartNode(t)
		s, err := New(Config{Addr: node.Addr}, testutil.Logger(t))
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		shape, results := committed(t, s, ops(), merged)
		if merged {
			require.Equal(t, [][]int{{1}, {4}, {5, 0, 3, 2}, {6}, {7}, {8}, {10, 9}, {11, 12}}, shape)
			var changed []bool
			for i, r := range results {
				require.NoError(t, r.Err, "op %d", i)
				changed = append(changed, r.Changed)
			}
			require.Equal(t, []bool{false, true, false, false, false, true, true, false, false, false, true, true, false}, changed)
		}
		states = append(states, stored(s))
	}
	require.Equal(t, map[string]string{"s/t": "d", "s/u": "u", "s/w": "w", "s/x": "y", "s/y": "y1"}, states[0])
	require.Equal(t, states[1], states[0], "coalesced and one call at a time differ")
}
