package redisstore

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/persistence/internal/redistest"
	"github.com/keelmq/keel/services/persistence/internal/store"
)

// A fresh group is stamped with the store's format on the first write;
// a group written by another format (format 1 never stamped one, but
// counted its writes) refuses every write, with nothing written, until an
// operator resolves it.
func TestRedisStore_Format(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	t.Parallel()
	ctx := context.Background()
	k := store.SessionKey{Tenant: "acme", ClientID: "a"}
	for _, tc := range []struct {
		name  string
		setup map[string]string
		err   error
	}{
		{"fresh", nil, nil},
		{"stamped", map[string]string{FormatKey: Format, WriteSeqKey: "7"}, nil},
		{"format_1", map[string]string{WriteSeqKey: "7"}, ErrFormat},
		{"newer", map[string]string{FormatKey: "3"}, ErrFormat},
	} {
		t.Run(tc.name, func(t *testing.T) {
			node := redistest.StartNode(t)
			c := node.Client()
			for key, v := range tc.setup {
				require.NoError(t, c.Set(ctx, key, v, 0).Err())
			}
			s, err := New(Config{Addr: node.Addr}, testutil.Logger(t))
			require.NoError(t, err)
			t.Cleanup(func() { _ = s.Close() })
			err = s.Activate(ctx, k, store.Fence{Epoch: 1})
			if tc.err == nil {
				require.NoError(t, err)
				require.Equal(t, Format, c.Get(ctx, FormatKey).Val())
				return
			}
			require.ErrorIs(t, err, tc.err)
			require.ErrorIs(t, err, ErrUnavailable, "not the request's fault")
			require.Zero(t, c.Exists(ctx, keysOf(k).s).Val(), "nothing written")
			_, err = s.Load(ctx, k)
			require.ErrorIs(t, err, tc.err, "nor read")
		})
	}
}

// The queue's order list keeps only a bounded share of items for entries
// that left: those sent from the front go at once, holes further in once
// they outnumber the entries, and the list of an empty queue goes.
func TestRedisStore_QueueListStaysShort(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	t.Parallel()
	node := redistest.StartNode(t)
	s, err := New(Config{Addr: node.Addr}, testutil.Logger(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	ctx := context.Background()
	f := store.Fence{Epoch: 1}
	require.NoError(t, s.Activate(ctx, k, f))
	c := node.Client()
	ql := keysOf(k).ql
	id := func(i int) string { return fmt.Sprintf("e/1/%d", i) }
	add := func(from, to int) {
		t.Helper()
		var es []store.Entry
		var ms []*store.Message
		for i := from; i <= to; i++ {
			es = append(es, store.Entry{MsgID: id(i), QoS: 1})
			ms = append(ms, &store.Message{ID: id(i), Topic: "t", QoS: 1})
		}
		_, err := s.Append(ctx, k, f, store.QueueLimits{}, es, ms)
		require.NoError(t, err)
	}
	order := func() []string {
		t.Helper()
		st, err := s.Load(ctx, k)
		require.NoError(t, err)
		var ids []string
		for _, e := range st.Queue {
			ids = append(ids, e.MsgID)
		}
		return ids
	}
	add(1, 300)
	// Sent from the front, 50 at a time (and completed).
	for from := 1; from <= 250; from += 50 {
		var es []store.Entry
		var pks []uint16
		for i := from; i < from+50; i++ {
			es = append(es, store.Entry{MsgID: id(i), QoS: 1, PacketID: uint16(i)})
			pks = append(pks, uint16(i))
		}
		require.NoError(t, s.Send(ctx, k, f, es))
		require.NoError(t, s.Complete(ctx, k, f, pks))
	}
	require.Equal(t, int64(50), c.LLen(ctx, ql).Val(), "items of entries sent from the front go")
	// Holes behind a live front: 251 stays, three in four of the rest go.
	add(301, 600)
	var gone, want []string
	want = append(want, id(251))
	for i := 252; i <= 600; i++ {
		if i%4 != 0 {
			gone = append(gone, id(i))
		} else {
			want = append(want, id(i))
		}
	}
	require.NoError(t, s.Dequeue(ctx, k, f, gone))
	live := int64(len(want))
	require.Equal(t, live, c.LLen(ctx, ql).Val(), "holes are rewritten once they outnumber the entries")
	require.Equal(t, want, order())
	require.NoError(t, s.Dequeue(ctx, k, f, want))
	require.Zero(t, c.Exists(ctx, ql).Val(), "an empty queue has no list")
	require.Empty(t, order())
}

// A send whose second copy of a queued message needs a reference of its
// own, when the message's body is gone (its bucket expired), is refused
// with nothing written: the queued entry stays queued and nothing is in
// flight without the reference its completion gives back.
func TestRedisStore_SendOfAGoneBodyWritesNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	t.Parallel()
	ctx := context.Background()
	f := store.Fence{Epoch: 1}
	m := &store.Message{ID: "e/1/5", Topic: "t", QoS: 1}
	s, _ := storeWithGoneBody(t, f, m)
	err := s.Send(ctx, k, f, []store.Entry{{MsgID: m.ID, QoS: 1, PacketID: 1}, {MsgID: m.ID, QoS: 1, PacketID: 2}})
	require.ErrorIs(t, err, store.ErrInvalid)
	st, err := s.Load(ctx, k)
	require.NoError(t, err)
	require.Len(t, st.Queue, 1)
	require.Empty(t, st.Inflight)
}

// A send joined to the append that stores its messages, refused because
// another message it sends is stored nowhere, leaves the messages the
// append took for it in the queue: the append answered them taken, and the
// edge's next send of them finds them there, each with its reference.
func TestRedisStore_RefusedJoinedSendQueuesItsMessages(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	t.Parallel()
	ctx := t.Context()
	f := store.Fence{Epoch: 1}
	x := &store.Message{ID: "e/1/5", Topic: "t", QoS: 1}
	y := &store.Message{ID: "e/1/6", Topic: "t", QoS: 1, Expiry: time.Now().Add(time.Hour).Unix()}
	s, node := storeWithGoneBody(t, f, x)
	shape, res := committed(t, s, []store.Op{
		{Kind: store.OpAppend, Key: k, Fence: f, Entries: []store.Entry{{MsgID: x.ID, QoS: 1}, {MsgID: y.ID, QoS: 1}}, Messages: []*store.Message{x, y}},
		{Kind: store.OpSend, Key: k, Fence: f, Entries: []store.Entry{{MsgID: y.ID, QoS: 1, PacketID: 1}, {MsgID: x.ID, QoS: 1, PacketID: 2}, {MsgID: x.ID, QoS: 1, PacketID: 3}}},
	}, true)
	require.Equal(t, [][]int{{0, 1}}, shape, "the send joins the append")
	require.NoError(t, res[0].Err)
	require.Equal(t, store.AppendResult{Added: 1, Duplicates: 1}, res[0].Append)
	require.ErrorIs(t, res[1].Err, store.ErrInvalid)
	st, err := s.Load(ctx, k)
	require.NoError(t, err)
	require.Equal(t, []string{x.ID, y.ID}, []string{st.Queue[0].MsgID, st.Queue[1].MsgID})
	require.Empty(t, st.Inflight)
	require.Equal(t, y, st.Messages[y.ID])
	require.NoError(t, s.Send(ctx, k, f, []store.Entry{{MsgID: y.ID, QoS: 1, PacketID: 1}}))
	require.NoError(t, s.Complete(ctx, k, f, []uint16{1}))
	yBucket, _ := BodyKey(y.ID, true)
	require.Zero(t, node.Client().Exists(ctx, yBucket).Val(), "its one reference given back")
}

// storeWithGoneBody returns a store on a node of its own whose session k
// queued m under f, and m's body deleted (as if its bucket expired).
func storeWithGoneBody(t *testing.T, f store.Fence, m *store.Message) (*Store, *redistest.Node) {
	t.Helper()
	ctx := t.Context()
	node := redistest.StartNode(t)
	s, err := New(Config{Addr: node.Addr}, testutil.Logger(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	require.NoError(t, s.Activate(ctx, k, f))
	_, err = s.Append(ctx, k, f, store.QueueLimits{}, []store.Entry{{MsgID: m.ID, QoS: 1}}, []*store.Message{m})
	require.NoError(t, err)
	bucket, _ := BodyKey(m.ID, m.Expiry > 0)
	require.NoError(t, node.Client().Del(ctx, bucket).Err())
	return s, node
}
