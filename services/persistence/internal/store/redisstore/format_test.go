package redisstore

import (
	"context"
	"fmt"
	"testing"

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
