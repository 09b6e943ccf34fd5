package redisstore

import (
	"fmt"
	"testing"

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
	batch := make([]*op, len(ops))
	for i := range ops {
		o, err := s.prepare(&ops[i])
		require.NoError(t, err)
		o.result = make(chan opResult, 1)
		batch[i] = o
	}
	calls := merge(batch)
	var shape [][]int
	for _, c := range calls {
		shape = append(shape, c.ops)
	}
	// A's appends join; B's second append comes after B's send; A's second
	// complete comes after B's send, so it does not join A's first.
	require.Equal(t, [][]int{{0, 3, 7, 8, 9}, {1}, {2}, {4}, {5}, {6}, {10}}, shape)

	conn := s.rdb.Conn()
	defer conn.Close()
	require.NoError(t, loadScripts(ctx, conn))
	require.NoError(t, s.commit(ctx, conn, batch))
	want := []store.AppendResult{{Added: 1}, {Added: 1}, {}, {Added: 1}, {}, {}, {}, {Added: 1}, {Refused: 1}, {Duplicates: 1}, {Added: 1}}
	for i, o := range batch {
		r := <-o.result
		res := parse(ops[i].Kind, r.val, r.err)
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
