package broker

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
)

// failingFirstEnqueue is a real durable store whose first Enqueue fails.
type failingFirstEnqueue struct {
	*durable.Store
	failed atomic.Bool
}

func (s *failingFirstEnqueue) Enqueue(id string, e durable.Entry) *durable.Pending {
	if s.failed.CompareAndSwap(false, true) {
		return durable.DonePending(errors.New("injected store failure"))
	}
	return s.Store.Enqueue(id, e)
}

// A message whose stored copy was not written is not taken: it leaves the
// session's queue, and neither a taken-over session's memory of queued
// msgIDs nor its memory of QoS 2 deliveries keeps it, so the sender's
// resend is queued and stored, not taken for a duplicate and acknowledged
// with nothing stored (as it was when a Redis primary failed over during a
// takeover: 836 acknowledged messages lost in the e2e suite).
func TestSession_MessageNotStoredIsNotTaken(t *testing.T) {
	t.Parallel()
	for _, qos := range []byte{1, 2} {
		b, st := brokerOnStore(t, func(st *durable.Store) DurableState { return &failingFirstEnqueue{Store: st} })

		sc := b.mustScope(t, "default")
		s := newSession(b, sc.ClientID("offline"), sc)
		require.NoError(t, st.PutSession(context.Background(), durable.Session{ID: s.id, ProtocolVersion: 5, ExpiryInterval: 300}))
		s.durable, s.persistent = true, true
		s.recent = &recentIDs{ids: map[MsgID]struct{}{}} // as after a takeover
		m := &Message{ID: MsgID{Edge: "edge-a", Incarnation: 1, Seq: 7}, Topic: sc.Topic("t"), Payload: []byte("x"),
			QoS: qos, Created: time.Now().UnixNano()}
		d := delivery{msg: m, qos: qos}

		require.Equal(t, storeFailed, s.enqueue(d), "qos %d", qos)
		require.Zero(t, s.queue.len(), "qos %d: not taken, not queued", qos)
		require.Equal(t, enqueued, s.enqueue(d), "qos %d: the resend", qos)
		require.Equal(t, 1, s.queue.len(), "qos %d", qos)
		stored, ok, err := st.LoadSession(context.Background(), s.id)
		require.NoError(t, err)
		if ok {
			require.Len(t, stored.Queue, 1, "qos %d: the resend is stored", qos)
		} else {
			t.Fatalf("qos %d: nothing stored for the session", qos)
		}
	}
}
