package durable

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A session read from one edge's store, encoded, decoded and imported into
// another's holds the same subscriptions, queue (in order), in-flight
// entries with their packet IDs and inbound QoS 2 state; a session with a
// similar ID ("s1" and "s10") is not swept along.
func TestStore_SessionTransfer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	from, to := open(t, t.TempDir()), open(t, t.TempDir())
	for _, id := range []string{"s1", "s10"} {
		require.NoError(t, from.PutSession(ctx, Session{ID: id, ProtocolVersion: 5, ExpiryInterval: 60}))
		require.NoError(t, from.PutSubscription(ctx, id, Subscription{Filter: "acme/#", QoS: 1, Identifier: 7}))
	}
	for i := 1; i <= 3; i++ {
		require.NoError(t, from.Enqueue("s1", Entry{Seq: uint64(i), MsgID: msg(i).ID, QoS: 1, Msg: msg(i)}).Wait(ctx))
	}
	require.NoError(t, from.Enqueue("s10", Entry{Seq: 1, MsgID: msg(9).ID, QoS: 1, Msg: msg(9)}).Wait(ctx))
	require.NoError(t, from.Send("s1", []Entry{{Seq: 1, PacketID: 42, MsgID: msg(1).ID, QoS: 1, Msg: msg(1), Order: 5}}).Wait(ctx))
	require.NoError(t, from.PutIncoming(ctx, "s1", Incoming{PacketID: 9, MsgID: "e/1/99"}))

	st, ok, err := from.LoadSession(ctx, "s1")
	require.NoError(t, err)
	require.True(t, ok)
	b, err := EncodeTransfer(st)
	require.NoError(t, err)
	got, err := DecodeTransfer(b)
	require.NoError(t, err)
	require.NoError(t, to.ImportSession(ctx, got))

	back, ok, err := to.LoadSession(ctx, "s1")
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, st.Session, back.Session)
	require.Equal(t, []Subscription{{Filter: "acme/#", QoS: 1, Identifier: 7}}, back.Subs)
	require.Len(t, back.Queue, 2)
	require.Equal(t, []uint64{2, 3}, []uint64{back.Queue[0].Seq, back.Queue[1].Seq})
	require.Equal(t, []byte{2}, back.Queue[0].Msg.Payload)
	require.Len(t, back.Inflight, 1)
	require.Equal(t, uint16(42), back.Inflight[0].PacketID)
	require.Equal(t, []Incoming{{PacketID: 9, MsgID: "e/1/99"}}, back.Incoming)
	_, ok, err = to.LoadSession(ctx, "s10")
	require.NoError(t, err)
	require.False(t, ok)

	_, err = DecodeTransfer([]byte(`{"format":99}`))
	require.Error(t, err)
	_, err = DecodeTransfer([]byte(`{"format":1,"session":{"id":"x"},"queue":[{"m":"a/1/1","msg":{"id":"b/1/1"}}]}`))
	require.Error(t, err, "an entry must carry its own message")
}

// A session's end travels as how long it had been offline, and is dated
// again on the receiver's clock: an absolute time from a sender whose clock
// runs behind would expire the session early there.
func TestSessionTransfer_CarriesTheEndAsTimeOffline(t *testing.T) {
	t.Parallel()
	ended := time.Now().Add(-90 * time.Second)
	b, err := EncodeTransfer(SessionState{Session: Session{ID: "s", ProtocolVersion: 5, ExpiryInterval: 300, Disconnected: ended.UnixNano()}})
	require.NoError(t, err)
	var raw map[string]any
	require.NoError(t, json.Unmarshal(b, &raw))
	require.NotContains(t, raw["session"], "dis", "no absolute time on the wire")
	require.InDelta(t, float64(90*time.Second), raw["offline_ns"], float64(time.Second))
	got, err := DecodeTransfer(b)
	require.NoError(t, err)
	require.WithinDuration(t, ended, got.Session.DisconnectedAt(), time.Second)

	b, err = EncodeTransfer(SessionState{Session: Session{ID: "s", ProtocolVersion: 5, ExpiryInterval: 300}})
	require.NoError(t, err)
	got, err = DecodeTransfer(b)
	require.NoError(t, err)
	require.Zero(t, got.Session.Disconnected, "a session with no known end gets none")
}

// A peer's session transfer is outside input: no panic, and what decodes
// re-encodes.
func FuzzDecodeTransfer(f *testing.F) {
	f.Add([]byte(`{"format":1,"session":{"id":"5:acmex"},"queue":[{"s":1,"m":"a/1/1","q":1,"msg":{"id":"a/1/1","t":"acme/t","c":1}}]}`))
	f.Add([]byte(`{"format":1}`))
	f.Add([]byte(`{"format":1,"session":{"id":"5:acmex","v":5,"sei":60},"offline_ns":9223372036854775807}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, b []byte) {
		st, err := DecodeTransfer(b)
		if err != nil {
			return
		}
		if _, err := EncodeTransfer(st); err != nil {
			t.Fatalf("decoded state does not encode: %v", err)
		}
	})
}
