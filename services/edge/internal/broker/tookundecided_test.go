package broker

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
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
		return s.tookIDsLocked(nil)
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

// staleLoad is a shared store whose session reads, once armed, answer
// with what the store held before the test was told the read began: a
// write landing meanwhile is not in the answer, as when a takeover's read
// of the store races the previous owner's last writes.
type staleLoad struct {
	sharedLocal
	armed   atomic.Bool
	started chan struct{}
	release chan struct{}
}

func (s *staleLoad) LoadSession(ctx context.Context, id string) (durable.SessionState, bool, error) {
	st, ok, err := s.sharedLocal.LoadSession(ctx, id)
	if s.armed.CompareAndSwap(true, false) {
		close(s.started)
		<-s.release
	}
	return st, ok, err
}

// A QoS 2 message queued for a moving session after TakeoverBegin's read of
// the store is handed over late (TakeoverEnd), and named as taken only
// there: named at Begin, the new owner would remember it on import and
// skip its late copy as taken before, and it would be acknowledged with
// no copy anywhere (seen when a Redis primary was killed during a
// takeover).
func TestBroker_TakeoverBeginNamesNoLateMessage(t *testing.T) {
	t.Parallel()
	st := &staleLoad{started: make(chan struct{}), release: make(chan struct{})}
	b, _ := brokerOnStore(t, func(s *durable.Store) DurableState { st.sharedLocal = sharedLocal{s}; return st })
	addr := serveTCP(t, b)
	id := b.mustScope(t, "default").ClientID("mover")
	c := mqtttest.Dial(t, addr, 5)
	c.Connect("mover", true, persistentProps)
	require.Equal(t, []byte{2}, c.Subscribe(1, "q/#", 2).ReasonCodes)
	epoch := waitBound(t, b, id)
	_ = c.Conn.Close()
	require.Eventually(t, func() bool {
		s := b.session(id)
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.client == nil
	}, 5*time.Second, 5*time.Millisecond)

	st.armed.Store(true)
	type begun struct {
		state []byte
		err   error
	}
	done := make(chan begun, 1)
	go func() {
		_, _, state, err := b.TakeOver(t.Context(), "default", "mover", "edge-new", epoch+1, false)
		done <- begun{state, err}
	}()
	<-st.started
	require.NoError(t, b.DeliverForwarded(t.Context(), forwardedMsg(9, "q/x", 2, time.Now()), SharedChoice{}))
	close(st.release)
	r := <-done
	require.NoError(t, r.err)
	state, err := durable.DecodeTransfer(r.state)
	require.NoError(t, err)
	require.NotContains(t, state.TookQoS2, "other/1/9", "named at Begin, not in its state")

	late, err := b.TakeoverEnd(t.Context(), "default", "mover", epoch+1)
	require.NoError(t, err)
	lateState, err := durable.DecodeTransfer(late)
	require.NoError(t, err)
	require.Len(t, lateState.Queue, 1, "handed over late")
	require.Equal(t, "other/1/9", lateState.Queue[0].MsgID)
	require.Contains(t, lateState.TookQoS2, "other/1/9", "and named with it")
}

// failingOnlineQueueing is a real durable store whose queueing for a
// connected session is answered when the test says (a store failing over
// refuses it, late), while the writer's send of the same message goes
// through: its answer is the one that counts.
type failingOnlineQueueing struct {
	sharedLocal
	mu   sync.Mutex
	held []chan error
}

func (s *failingOnlineQueueing) Enqueue(id string, e durable.Entry) *durable.Pending {
	if e.Offline {
		return s.sharedLocal.Enqueue(id, e)
	}
	done := make(chan error, 1)
	s.mu.Lock()
	s.held = append(s.held, done)
	s.mu.Unlock()
	return durable.NewPending(done)
}

func (s *failingOnlineQueueing) fail(t *testing.T) {
	t.Helper()
	require.Eventually(t, func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return len(s.held) > 0
	}, 5*time.Second, time.Millisecond)
	s.mu.Lock()
	held := s.held
	s.held = nil
	s.mu.Unlock()
	for _, c := range held {
		c <- errors.New("injected: not replicated")
	}
}

// A QoS 2 message whose queueing failed after the writer sent it, and
// stored the send, was taken: the client has it. Counted as not taken, it
// was forgotten, and its resend (the same msgID) went to the client again
// under a new packet ID: a QoS 2 message delivered twice (seen when a Redis
// primary was killed under a QoS 2 stream).
func TestSession_QueueingFailedAfterAStoredSendIsTaken(t *testing.T) {
	t.Parallel()
	st := &failingOnlineQueueing{}
	b, _ := brokerOnStore(t, func(s *durable.Store) DurableState { st.sharedLocal = sharedLocal{s}; return st })
	addr := serveTCP(t, b)
	c := mqtttest.Dial(t, addr, 5)
	c.Connect("sub", true, persistentProps)
	require.Equal(t, []byte{2}, c.Subscribe(1, "q/#", 2).ReasonCodes)
	id := b.mustScope(t, "default").ClientID("sub")
	waitBound(t, b, id)

	deliver := func() []error {
		d := &Deferred{}
		require.NoError(t, b.DeliverForwarded(DeferWrites(t.Context(), d), forwardedMsg(5, "q/x", 2, time.Now()), SharedChoice{}))
		return d.Wait(1)
	}
	errs := make(chan []error, 1)
	go func() { errs <- deliver() }()
	got := c.Expect(packets.Publish)
	require.Equal(t, "q/x", got.TopicName)
	st.fail(t)
	require.Equal(t, []error{nil}, <-errs, "taken: its send was stored")

	require.Equal(t, []error{nil}, deliver(), "the resend, taken before")
	pk, err := c.Read(300 * time.Millisecond)
	require.Error(t, err, "nothing delivered twice: got type %d id %d", pk.FixedHeader.Type, pk.PacketID)
}
