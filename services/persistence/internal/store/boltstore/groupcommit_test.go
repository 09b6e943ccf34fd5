package boltstore

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	bolt "go.etcd.io/bbolt"

	"github.com/keelmq/keel/services/persistence/internal/store"
)

var ctx = context.Background()

func open(t *testing.T) *Store {
	t.Helper()
	s, err := Open(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// holdWriter takes bbolt's writer lock until the returned function is
// called, so that everything submitted meanwhile queues up behind it.
func holdWriter(t *testing.T, s *Store) (release func()) {
	t.Helper()
	held, hold, done := make(chan struct{}), make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		_ = s.db.Update(func(*bolt.Tx) error { close(held); <-hold; return nil })
	}()
	<-held
	var once sync.Once
	release = func() { once.Do(func() { close(hold); <-done }) }
	t.Cleanup(release)
	return release
}

func bmsg(i int) *store.Message {
	return &store.Message{ID: fmt.Sprintf("edge-a/1/%d", i), Topic: "t", Payload: []byte(fmt.Sprint(i)), QoS: 1, Created: int64(i)}
}

func appendOp(k store.SessionKey, epoch uint64, ids ...int) store.Op {
	o := store.Op{Kind: store.OpAppend, Key: k, Fence: store.Fence{Epoch: epoch}}
	for _, i := range ids {
		o.Entries = append(o.Entries, store.Entry{MsgID: bmsg(i).ID, QoS: 1})
		o.Messages = append(o.Messages, bmsg(i))
	}
	return o
}

func queueOf(t *testing.T, s *Store, k store.SessionKey) []string {
	t.Helper()
	st, err := s.Load(ctx, k)
	require.NoError(t, err)
	var ids []string
	for _, e := range st.Queue {
		ids = append(ids, e.MsgID)
	}
	return ids
}

type countObserver struct{ commits, ops atomic.Int64 }

func (o *countObserver) Committed(calls int, _ time.Duration, _, _ bool) {
	o.commits.Add(1)
	o.ops.Add(int64(calls))
}

// Ops submitted from many goroutines while a commit is in progress are
// applied together, each answered with its own result: the fenced ones
// refused, the others appended.
func TestGroupCommit_ConcurrentOpsShareCommits(t *testing.T) {
	s := open(t)
	obs := &countObserver{}
	s.Observer = obs
	keys := make([]store.SessionKey, 8)
	for i := range keys {
		keys[i] = store.SessionKey{Tenant: "acme", ClientID: fmt.Sprint("dev-", i)}
		require.NoError(t, s.Activate(ctx, keys[i], store.Fence{Epoch: 2}))
	}
	before := s.Stats()
	release := holdWriter(t, s)

	const n = 400
	fenced := func(i int) bool { return i%7 == 0 }
	results := make([]store.OpResult, n)
	var submitted, done sync.WaitGroup
	for i := range n {
		submitted.Add(1)
		done.Add(1)
		go func() {
			defer done.Done()
			epoch := uint64(2)
			if fenced(i) {
				epoch = 1
			}
			wait := s.Submit(ctx, []store.Op{appendOp(keys[i%len(keys)], epoch, i)})
			submitted.Done()
			results[i] = wait()[0]
		}()
	}
	submitted.Wait()
	release()
	done.Wait()

	after := s.Stats()
	commits := after.Commits - before.Commits
	require.Equal(t, uint64(n), after.Ops-before.Ops)
	// At most the first op was taken before the writer lock was held;
	// everything else went into the next transaction.
	require.LessOrEqual(t, commits, uint64(2), "%d ops took %d commits", n, commits)
	require.Equal(t, int64(after.Commits), obs.commits.Load())
	require.Equal(t, int64(after.Ops), obs.ops.Load())
	want := make([][]string, len(keys))
	for i, r := range results {
		if fenced(i) {
			require.ErrorIs(t, r.Err, store.ErrFenced, "op %d", i)
			require.Zero(t, r.Append, "op %d", i)
			continue
		}
		require.NoError(t, r.Err, "op %d", i)
		require.Equal(t, store.AppendResult{Added: 1}, r.Append, "op %d", i)
		want[i%len(keys)] = append(want[i%len(keys)], bmsg(i).ID)
	}
	for i, k := range keys {
		got := queueOf(t, s, k)
		sort.Strings(got)
		sort.Strings(want[i])
		require.Equal(t, want[i], got, "session %d: the fenced appends stored nothing", i)
	}
}

// Callers waiting on every op (the Store methods) get batched too, and each
// caller's ops stay in its order.
func TestGroupCommit_ParallelCallers(t *testing.T) {
	s := open(t)
	const callers, per = 32, 40
	keys := make([]store.SessionKey, callers)
	for i := range keys {
		keys[i] = store.SessionKey{Tenant: "acme", ClientID: fmt.Sprint("dev-", i)}
		require.NoError(t, s.Activate(ctx, keys[i], store.Fence{Epoch: 1}))
	}
	before := s.Stats()
	var wg sync.WaitGroup
	errs := make(chan error, callers)
	for c := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range per {
				i := c*per + j
				res, err := s.Append(ctx, keys[c], store.Fence{Epoch: 1}, store.QueueLimits{}, []store.Entry{{MsgID: bmsg(i).ID, QoS: 1}}, []*store.Message{bmsg(i)})
				if err == nil && res != (store.AppendResult{Added: 1}) {
					err = fmt.Errorf("append %d: %+v", i, res)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	after := s.Stats()
	commits, ops := after.Commits-before.Commits, after.Ops-before.Ops
	t.Logf("%d ops in %d commits (%.1f ops/commit)", ops, commits, float64(ops)/float64(commits))
	require.Equal(t, uint64(callers*per), ops)
	require.Less(t, commits, ops)
	for c, k := range keys {
		var want []string
		for j := range per {
			want = append(want, bmsg(c*per+j).ID)
		}
		require.Equal(t, want, queueOf(t, s, k), "caller %d, in order", c)
	}
}

// failSendsAt9 fails every send to packet ID 9 after it wrote.
func failSendsAt9(o *store.Op) error {
	if o.Kind == store.OpSend && o.Entries[0].PacketID == 9 {
		return fmt.Errorf("%w: failed after writing (test)", store.ErrInvalid)
	}
	return nil
}

// An op that fails, before or after writing part of itself, fails alone and
// leaves nothing; the ops around it in the same batch are stored.
func TestGroupCommit_FailedOpLeavesNothing(t *testing.T) {
	s := open(t)
	s.failAfterWrite = failSendsAt9
	k := store.SessionKey{Tenant: "acme", ClientID: "dev-1"}
	f := store.Fence{Epoch: 5}
	bad := appendOp(k, 5, 9)
	bad.Messages[0] = bmsg(10)
	huge := &store.Message{ID: strings.Repeat("x", bolt.MaxKeySize+1), Topic: "t", Payload: []byte("x")}
	ops := []store.Op{
		{Kind: store.OpActivate, Key: k, Fence: f},
		appendOp(k, 5, 1, 2),
		appendOp(k, 4, 3), // fenced
		{Kind: store.OpSend, Key: k, Fence: f, Entries: []store.Entry{ // 2 was never stored
			{MsgID: bmsg(1).ID, QoS: 1, PacketID: 1}, {MsgID: "nope", QoS: 1, PacketID: 2}}},
		appendOp(k, 5, 4),
		bad, // entry and message disagree
		{Kind: store.OpAppend, Key: k, Fence: f, // a key bbolt would refuse
			Entries:  []store.Entry{{MsgID: bmsg(5).ID, QoS: 1}, {MsgID: huge.ID, QoS: 1}},
			Messages: []*store.Message{bmsg(5), huge}},
		appendOp(k, 5, 8),
		// Moves 8 from the queue to packet 9, then fails: after writing,
		// so the transaction is rolled back.
		{Kind: store.OpSend, Key: k, Fence: f, Entries: []store.Entry{{MsgID: bmsg(8).ID, QoS: 1, PacketID: 9}}},
		{Kind: store.OpSend, Key: k, Fence: f, Entries: []store.Entry{{MsgID: bmsg(2).ID, QoS: 1, PacketID: 7}}},
		{Kind: store.OpPutRetained, Tenant: "acme", Retained: &store.Message{ID: "r", Topic: "a", Payload: []byte("v"), Created: 1}},
		{Kind: store.OpKind(99), Key: k},
	}
	before := s.Stats()
	res := s.Submit(ctx, ops)()
	after := s.Stats()
	require.Equal(t, uint64(1), after.Replays-before.Replays, "one op failed after writing")
	require.Equal(t, uint64(2), after.Commits-before.Commits, "the ops before it, then the ops after it")

	for i, want := range []error{nil, nil, store.ErrFenced, store.ErrInvalid, nil, store.ErrInvalid, store.ErrInvalid, nil,
		store.ErrInvalid, nil, nil, store.ErrInvalid} {
		if want == nil {
			require.NoError(t, res[i].Err, "op %d", i)
		} else {
			require.ErrorIs(t, res[i].Err, want, "op %d", i)
		}
	}
	require.Equal(t, store.AppendResult{Added: 2}, res[1].Append)
	require.Equal(t, store.AppendResult{Added: 1}, res[4].Append)
	require.Zero(t, res[6].Append)
	require.Equal(t, store.AppendResult{Added: 1}, res[7].Append)
	require.True(t, res[10].Changed)

	st, err := s.Load(ctx, k)
	require.NoError(t, err)
	require.Equal(t, uint64(5), st.Epoch)
	require.Equal(t, []string{bmsg(1).ID, bmsg(4).ID, bmsg(8).ID}, queueOf(t, s, k), "the failed ops moved nothing")
	require.Equal(t, []uint64{1, 3, 4}, []uint64{st.Queue[0].Seq, st.Queue[1].Seq, st.Queue[2].Seq})
	require.Len(t, st.Inflight, 1)
	require.Equal(t, store.Entry{MsgID: bmsg(2).ID, QoS: 1, PacketID: 7}, st.Inflight[0])
	require.Len(t, st.Messages, 4)
	require.NotContains(t, st.Messages, bmsg(3).ID)
	require.NotContains(t, st.Messages, bmsg(5).ID)
	require.NoError(t, s.Submit(ctx, []store.Op{appendOp(k, 5, 6)})()[0].Err)
	st, err = s.Load(ctx, k)
	require.NoError(t, err)
	require.Equal(t, uint64(5), st.Queue[3].Seq, "the failed append took no queue position")
	// The refcounts are right too: completing and dequeuing releases all.
	require.NoError(t, s.Complete(ctx, k, f, []uint16{7}))
	require.NoError(t, s.Dequeue(ctx, k, f, []string{bmsg(1).ID, bmsg(4).ID, bmsg(8).ID, bmsg(6).ID}))
	require.NoError(t, s.db.View(func(tx *bolt.Tx) error {
		require.Zero(t, tx.Bucket(bMsgs).Stats().KeyN, "no message left behind")
		return nil
	}))
}

// Each op failing after writing costs one rollback and one more commit (of
// the ops before it), however many there are: the ops before it are not
// applied again and again.
func TestGroupCommit_ManyFailures(t *testing.T) {
	s := open(t)
	s.failAfterWrite = failSendsAt9
	k := store.SessionKey{Tenant: "acme", ClientID: "dev-1"}
	f := store.Fence{Epoch: 1}
	require.NoError(t, s.Activate(ctx, k, f))
	var ops []store.Op
	for i := range 200 {
		ops = append(ops, appendOp(k, 1, i))
		if i%2 == 1 {
			ops = append(ops, store.Op{Kind: store.OpSend, Key: k, Fence: f, Entries: []store.Entry{
				{MsgID: bmsg(i).ID, QoS: 1, PacketID: 9}}})
		}
	}
	before := s.Stats()
	res := s.Submit(ctx, ops)()
	after := s.Stats()
	require.Equal(t, uint64(100), after.Replays-before.Replays)
	require.Equal(t, uint64(100), after.Commits-before.Commits, "the last op fails: nothing after it")
	var want []string
	for i, j := 0, 0; i < 200; i++ {
		require.NoError(t, res[j].Err)
		want = append(want, bmsg(i).ID)
		j++
		if i%2 == 1 {
			require.ErrorIs(t, res[j].Err, store.ErrInvalid)
			j++
		}
	}
	require.Equal(t, want, queueOf(t, s, k))
}

// Ops apply in the order submitted, across Submit calls and within one,
// whether or not their callers wait in between.
func TestGroupCommit_SubmissionOrder(t *testing.T) {
	s := open(t)
	k := store.SessionKey{Tenant: "acme", ClientID: "dev-1"}
	release := holdWriter(t, s)
	var waits []func() []store.OpResult
	sub := func(ops ...store.Op) { waits = append(waits, s.Submit(ctx, ops)) }
	sub(store.Op{Kind: store.OpActivate, Key: k, Fence: store.Fence{Epoch: 3}})
	sub(appendOp(k, 2, 1)) // after the activation: fenced
	for i := 1; i <= 50; i++ {
		sub(appendOp(k, 3, i))
	}
	sub(store.Op{Kind: store.OpDequeue, Key: k, Fence: store.Fence{Epoch: 3}, MsgIDs: []string{bmsg(1).ID}},
		appendOp(k, 3, 1)) // dequeued just before: appended again, at the end
	sub(store.Op{Kind: store.OpActivate, Key: k, Fence: store.Fence{Epoch: 4}}, appendOp(k, 3, 99))
	release()
	var res []store.OpResult
	for _, w := range waits {
		res = append(res, w()...)
	}
	require.NoError(t, res[0].Err)
	require.ErrorIs(t, res[1].Err, store.ErrFenced)
	for i := 2; i < 52; i++ {
		require.NoError(t, res[i].Err)
		require.Equal(t, store.AppendResult{Added: 1}, res[i].Append)
	}
	require.NoError(t, res[52].Err)
	require.Equal(t, store.AppendResult{Added: 1}, res[53].Append)
	require.NoError(t, res[54].Err)
	require.ErrorIs(t, res[55].Err, store.ErrFenced)
	var want []string
	for i := 2; i <= 50; i++ {
		want = append(want, bmsg(i).ID)
	}
	want = append(want, bmsg(1).ID)
	require.Equal(t, want, queueOf(t, s, k))
}

// Close answers what was submitted before it; later writes fail.
func TestGroupCommit_Close(t *testing.T) {
	s, err := Open(t.TempDir())
	require.NoError(t, err)
	k := store.SessionKey{Tenant: "acme", ClientID: "dev-1"}
	release := holdWriter(t, s)
	wait := s.Submit(ctx, []store.Op{{Kind: store.OpActivate, Key: k, Fence: store.Fence{Epoch: 1}}, appendOp(k, 1, 1)})
	closed := make(chan error, 1)
	go func() { closed <- s.Close() }()
	require.Eventually(t, func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.closed
	}, 5*time.Second, time.Millisecond)
	require.ErrorIs(t, s.Activate(ctx, k, store.Fence{Epoch: 1}), ErrClosed)
	release()
	require.NoError(t, <-closed)
	res := wait()
	require.NoError(t, res[0].Err)
	require.NoError(t, res[1].Err)
	require.Equal(t, store.AppendResult{Added: 1}, res[1].Append)
	require.ErrorIs(t, s.Submit(ctx, []store.Op{appendOp(k, 1, 2)})()[0].Err, ErrClosed)
	require.NoError(t, s.Close())
}

func TestGroupCommit_Context(t *testing.T) {
	s := open(t)
	k := store.SessionKey{Tenant: "acme", ClientID: "dev-1"}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	require.ErrorIs(t, s.Activate(cctx, k, store.Fence{Epoch: 1}), context.Canceled, "not submitted")
	require.Empty(t, s.Submit(ctx, nil)())

	// A caller that stops waiting learns nothing of the outcome; the op
	// is applied all the same, in its turn.
	release := holdWriter(t, s)
	cctx, cancel = context.WithCancel(ctx)
	wait := s.Submit(cctx, []store.Op{{Kind: store.OpActivate, Key: k, Fence: store.Fence{Epoch: 7}}})
	cancel()
	require.ErrorIs(t, wait()[0].Err, context.Canceled)
	release()
	require.Eventually(t, func() bool {
		st, err := s.Load(ctx, k)
		return err == nil && st.Epoch == 7
	}, 5*time.Second, time.Millisecond)
}

// Load reads without writing: a session never written is empty.
func TestLoad_Unknown(t *testing.T) {
	s := open(t)
	st, err := s.Load(ctx, store.SessionKey{Tenant: "acme", ClientID: "nobody"})
	require.NoError(t, err)
	require.Equal(t, &store.State{Messages: map[string]*store.Message{}}, st)
	_, err = s.Load(ctx, store.SessionKey{ClientID: "x"})
	require.ErrorIs(t, err, store.ErrInvalid)
	require.Zero(t, s.Stats().Commits)
}
