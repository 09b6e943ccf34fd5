package durable

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	bolt "go.etcd.io/bbolt"
)

func open(t *testing.T, dir string) *Store {
	t.Helper()
	st, err := Open(dir, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = st.Close() })
	return st
}

func msg(i int) *Message {
	return &Message{ID: fmt.Sprintf("e/1/%d", i), Topic: "acme/t", Payload: []byte{byte(i)}, QoS: 1, Created: int64(i)}
}

func TestStore_QueueInflightLifecycle(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	st := open(t, dir)
	ctx := context.Background()
	require.NoError(t, st.PutSession(ctx, Session{ID: "s1", ProtocolVersion: 5, ExpiryInterval: 60}))
	require.NoError(t, st.PutSubscription(ctx, "s1", Subscription{Filter: "acme/#", QoS: 1}))
	for i := 1; i <= 3; i++ {
		require.NoError(t, st.Enqueue("s1", Entry{Seq: uint64(i), MsgID: msg(i).ID, QoS: 1, Msg: msg(i)}).Wait(ctx))
	}
	// A retried enqueue of the same position is a no-op.
	require.NoError(t, st.Enqueue("s1", Entry{Seq: 1, MsgID: msg(1).ID, QoS: 1, Msg: msg(1)}).Wait(ctx))
	require.NoError(t, st.Send("s1", []Entry{{Seq: 1, PacketID: 65535, MsgID: msg(1).ID, QoS: 1, Msg: msg(1)}}).Wait(ctx))
	require.NoError(t, st.Close())

	st = open(t, dir)
	sessions, _, err := st.Load()
	require.NoError(t, err)
	require.Len(t, sessions, 1)
	s := sessions[0]
	require.Len(t, s.Subs, 1)
	require.Len(t, s.Inflight, 1)
	require.Equal(t, uint16(65535), s.Inflight[0].PacketID)
	require.Len(t, s.Queue, 2)
	require.Equal(t, uint64(2), s.Queue[0].Seq)
	require.Equal(t, []byte{2}, s.Queue[0].Msg.Payload)

	require.NoError(t, st.Complete(ctx, "s1", 65535))
	require.NoError(t, st.DeleteSession(ctx, "s1", true))
	sessions, _, err = st.Load()
	require.NoError(t, err)
	require.Empty(t, sessions)
	// Every message reference is gone with the session.
	n := 0
	require.NoError(t, st.db.View(func(tx *bolt.Tx) error { n = tx.Bucket(bucketMsgs).Stats().KeyN; return nil }))
	require.Zero(t, n)
}

// The store remembers the msgIDs of the last TookQoS2Len QoS 2 deliveries
// enqueued with TookQoS2, oldest first, after their entries are gone, and
// forgets them with the session; an import carries them.
func TestStore_TookQoS2(t *testing.T) {
	t.Parallel()
	st := open(t, t.TempDir())
	ctx := context.Background()
	require.NoError(t, st.PutSession(ctx, Session{ID: "s1", ExpiryInterval: 60}))
	const n = TookQoS2Len + 6
	for i := 1; i <= n; i++ {
		m := msg(i)
		require.NoError(t, st.Enqueue("s1", Entry{Seq: uint64(i), MsgID: m.ID, QoS: 2, TookQoS2: i%2 == 0 || i > 10, Msg: m}).Wait(ctx))
		require.NoError(t, st.Dequeue(ctx, "s1", []Entry{{Seq: uint64(i), MsgID: m.ID}}))
	}
	var want []string
	for i := 1; i <= n; i++ {
		if i%2 == 0 || i > 10 {
			want = append(want, msg(i).ID)
		}
	}
	want = want[len(want)-TookQoS2Len:]
	got, ok, err := st.LoadSession(ctx, "s1")
	require.NoError(t, err)
	require.True(t, ok)
	require.Empty(t, got.Queue)
	require.Equal(t, want, got.TookQoS2)
	all, _, err := st.Load()
	require.NoError(t, err)
	require.Equal(t, want, all[0].TookQoS2)

	require.NoError(t, st.DeleteSession(ctx, "s1", true))
	require.NoError(t, st.ImportSession(ctx, SessionState{Session: Session{ID: "s1", ExpiryInterval: 60}, TookQoS2: []string{"a/1/1", "a/1/2"}}))
	got, _, err = st.LoadSession(ctx, "s1")
	require.NoError(t, err)
	require.Equal(t, []string{"a/1/1", "a/1/2"}, got.TookQoS2, "nothing left of the deleted session's memory")
}
