package broker

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
)

// A session moving to another edge names the QoS 2 messages it took, so
// that the new owner does not take them again; not those whose stored
// copies are still being written (a forwarded frame settles its writes
// after queuing its messages). Such a write may fail after the move: named,
// the message's relay or resend would be answered at the new owner as
// taken before, and acknowledged with no copy anywhere (seen when a Redis
// primary was killed during a takeover).
func TestSession_MovingNamesOnlySettledQoS2Messages(t *testing.T) {
	t.Parallel()
	st := &heldOfflineQueueing{}
	b, _ := brokerOnStore(t, func(s *durable.Store) DurableState { st.Store = s; return st })
	sc := b.mustScope(t, "default")
	s := newSession(b, sc.ClientID("offline"), sc)
	require.NoError(t, st.PutSession(context.Background(), durable.Session{ID: s.id, ProtocolVersion: 5, ExpiryInterval: 300}))
	s.durable, s.persistent = true, true
	took := func() []string {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.tookIDsLocked()
	}
	deliver := func(seq uint64) (*Message, *Deferred) {
		d := &Deferred{}
		m := &Message{ID: MsgID{Edge: "edge-a", Incarnation: 1, Seq: seq}, Topic: sc.Topic("t"), Payload: []byte("x"),
			QoS: 2, Created: time.Now().UnixNano(), deferred: d}
		require.Equal(t, enqueued, s.enqueue(delivery{msg: m, qos: 2}))
		require.Equal(t, 1, st.heldCount(), "its write is held")
		return m, d
	}

	m1, d1 := deliver(1)
	require.Empty(t, took(), "its write undecided, m1 is not named")
	st.answer(nil)
	require.Equal(t, []error{nil}, d1.Wait(1))
	require.Equal(t, []string{msgIDString(m1.ID)}, took(), "stored, m1 is named")

	_, d2 := deliver(2)
	require.Equal(t, []string{msgIDString(m1.ID)}, took())
	st.answer(errors.New("injected store failure"))
	require.Error(t, d2.Wait(1)[0])
	require.Equal(t, []string{msgIDString(m1.ID)}, took(), "not stored, m2 is never named")
}
