package failover

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/persistence/internal/redistest"
	"github.com/keelmq/keel/services/persistence/internal/store"
	"github.com/keelmq/keel/services/persistence/internal/store/redisstore"
)

// memLeases adds the promotion lease to memRecords: held by this member
// unless other is set.
type memLeases struct {
	memRecords
	lmu   sync.Mutex
	other string
}

func (m *memLeases) AcquirePromotionLease(context.Context, time.Duration) (bool, error) {
	m.lmu.Lock()
	defer m.lmu.Unlock()
	return m.other == "", nil
}

func (m *memLeases) FailoverLease(_ context.Context, _ time.Duration, renew uint64) (FailoverLease, error) {
	m.lmu.Lock()
	defer m.lmu.Unlock()
	return FailoverLease{Acquired: m.other == "", Epoch: max(renew, 1)}, nil
}

// writers append to sessions through a follower, as persistence instances
// do for edges: each message is retried until it is acknowledged (WAIT 1
// confirmed), and the acknowledged ones are remembered.
type writers struct {
	f    *Follower
	stop chan struct{}
	wg   sync.WaitGroup

	mu     sync.Mutex
	acked  map[store.SessionKey][]string
	errs   map[string]int
	maxLat time.Duration
}

func startWriters(t *testing.T, f *Follower, name string, n int) *writers {
	w := &writers{f: f, stop: make(chan struct{}), acked: map[store.SessionKey][]string{}, errs: map[string]int{}}
	ctx := context.Background()
	for i := range n {
		k := store.SessionKey{Tenant: "acme", ClientID: fmt.Sprintf("%s-%d", name, i)}
		fe := store.Fence{Epoch: 1} // the group epoch is the followed record's
		testutil.Eventually(t, 10*time.Second, func() error { return f.Activate(ctx, k, fe) })
		w.wg.Go(func() {
			for seq := 0; ; seq++ {
				id := fmt.Sprintf("e/%d/%d", i, seq)
				for {
					select {
					case <-w.stop:
						return
					default:
					}
					start := time.Now()
					cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
					_, err := f.Append(cctx, k, fe, store.QueueLimits{}, []store.Entry{{MsgID: id, QoS: 1}},
						[]*store.Message{{ID: id, Topic: "t", Payload: []byte("x"), QoS: 1}})
					cancel()
					lat := time.Since(start)
					w.mu.Lock()
					if err == nil {
						w.acked[k] = append(w.acked[k], id)
						w.maxLat = max(w.maxLat, lat)
						w.mu.Unlock()
						break
					}
					w.errs[errKind(err)]++
					w.mu.Unlock()
					time.Sleep(10 * time.Millisecond)
				}
			}
		})
	}
	return w
}

func errKind(err error) string {
	switch {
	case errors.Is(err, store.ErrNotReplicated):
		return "not_replicated"
	case errors.Is(err, store.ErrGroupFenced):
		return "group_fenced"
	case errors.Is(err, redisstore.ErrClosed):
		return "closed" // the follower re-pointed: in flight on the old primary, retried
	case errors.Is(err, redisstore.ErrUnavailable):
		if strings.Contains(err.Error(), "READONLY") {
			return "unavailable_readonly"
		}
		return "unavailable"
	}
	return "other: " + err.Error()
}

func (w *writers) count() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for _, ids := range w.acked {
		n += len(ids)
	}
	return n
}

func (w *writers) halt() {
	close(w.stop)
	w.wg.Wait()
}

// checkAll requires every acknowledged message on the node at addr.
func (w *writers) checkAll(t *testing.T, addr string) {
	t.Helper()
	s, err := redisstore.New(redisstore.Config{Addr: addr, MinReplicas: 1}, testutil.Logger(t))
	require.NoError(t, err)
	defer s.Close()
	w.mu.Lock()
	defer w.mu.Unlock()
	for k, ids := range w.acked {
		st, err := s.Load(context.Background(), k)
		require.NoError(t, err)
		have := map[string]bool{}
		for _, e := range st.Queue {
			have[e.MsgID] = true
		}
		for _, id := range ids {
			require.True(t, have[id], "acknowledged %s of %s missing on %s", id, k.ClientID, addr)
		}
	}
}

func waitAcked(t *testing.T, w *writers, n int) {
	t.Helper()
	testutil.Eventually(t, 20*time.Second, func() error {
		if got := w.count(); got < n {
			return fmt.Errorf("%d acknowledged, want %d", got, n)
		}
		return nil
	})
}

// replicaOfNode requires addr to become a replica of primary with its link up.
func replicaOfNode(t *testing.T, n *redistest.Node, primary string) {
	t.Helper()
	_, port, _ := net.SplitHostPort(primary)
	testutil.Eventually(t, 15*time.Second, func() error {
		info, err := n.Client().Info(context.Background(), "replication").Result()
		if err != nil {
			return err
		}
		if !strings.Contains(info, "role:slave") || !strings.Contains(info, "master_port:"+port+"\r") || !strings.Contains(info, "master_link_status:up") {
			return fmt.Errorf("%s not yet a replica of %s", n.Addr, primary)
		}
		return nil
	})
}

// TestSwitchover_LiveWritersLoseNothing runs a switchover of a live group
// while writers keep appending and acknowledging (WAIT 1) through a
// follower of the record, with the failover loop (following, reconciling)
// running: every acknowledged append is on the new primary, the record
// moved, the old primary is a replica of the new one, and writes resume.
// A second switchover with --to moves the primary back. Then the refusals:
// bad targets, the promotion lease held elsewhere, and a target that never
// catches up (undone: the primary unpaused and still recorded).
func TestSwitchover_LiveWritersLoseNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	g := redistest.StartGroup(t, 2, 1)
	byAddr := map[string]*redistest.Node{g.Primary.Addr: g.Primary, g.Replicas[0].Addr: g.Replicas[0], g.Replicas[1].Addr: g.Replicas[1]}
	records := &memLeases{memRecords: memRecords{rec: Record{Primary: g.Primary.Addr,
		Replicas: []string{g.Replicas[0].Addr, g.Replicas[1].Addr}, Epoch: 1}}}
	ctx := context.Background()
	logger := testutil.Logger(t)
	f, err := NewFollower(records.rec, func(addr string) (*redisstore.Store, error) {
		return redisstore.New(redisstore.Config{Addr: addr, MinReplicas: 1, WaitTimeout: 500 * time.Millisecond}, logger)
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	p := &Promoter{Records: records, Logger: logger}
	loop := NewLoop(LoopConfig{CheckInterval: 50 * time.Millisecond, DownAfter: 2 * time.Second,
		PromotionLeaseTTL: 2 * time.Second, ReconcileInterval: 200 * time.Millisecond}, records, f, p, nil, logger)
	lctx, stopLoop := context.WithCancel(ctx)
	loopDone := make(chan struct{})
	go func() { defer close(loopDone); _ = loop.Run(lctx) }()
	t.Cleanup(func() { stopLoop(); <-loopDone })

	w := startWriters(t, f, "a", 3)
	// A second instance follows the record only by polling it, as every
	// instance but the one running the switchover does: the writes the old
	// primary held fail there with READONLY and are retried.
	f2, err := NewFollower(records.rec, func(addr string) (*redisstore.Store, error) {
		return redisstore.New(redisstore.Config{Addr: addr, MinReplicas: 1, WaitTimeout: 500 * time.Millisecond}, logger)
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = f2.Close() })
	go func() {
		for lctx.Err() == nil {
			if rec, err := records.Get(lctx); err == nil {
				_, _ = f2.Follow(rec)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}()
	w2 := startWriters(t, f2, "b", 3)
	waitAcked(t, w, 300)
	waitAcked(t, w2, 300)

	// Switchover to the replica with the highest offset.
	before := w.count()
	start := time.Now()
	res, err := loop.Switchover(ctx, SwitchoverOptions{SyncTimeout: 5 * time.Second})
	require.NoError(t, err)
	took := time.Since(start)
	require.Equal(t, g.Primary.Addr, res.Old.Primary)
	require.NotEqual(t, g.Primary.Addr, res.New.Primary)
	require.Equal(t, uint64(2), res.New.Epoch)
	require.True(t, res.Demoted)
	require.ElementsMatch(t, []string{g.Primary.Addr, otherReplica(g, res.New.Primary)}, res.New.Replicas)
	rec, _ := records.Get(ctx)
	require.Equal(t, res.New, rec)
	require.Equal(t, rec, f.Record(), "the instance that ran it follows the new record")
	replicaOfNode(t, g.Primary, res.New.Primary)
	replicaOfNode(t, byAddr[otherReplica(g, res.New.Primary)], res.New.Primary)
	waitAcked(t, w, w.count()+300) // writes resume on the new primary
	waitAcked(t, w2, w2.count()+300)
	t.Logf("switchover %s -> %s: paused %v, took %v, offset %d; %d acknowledged before it",
		res.Old.Primary, res.New.Primary, res.PausedFor, took, res.Offset, before)

	// And back, naming the target.
	res2, err := loop.Switchover(ctx, SwitchoverOptions{To: g.Primary.Addr, SyncTimeout: 5 * time.Second})
	require.NoError(t, err)
	require.Equal(t, g.Primary.Addr, res2.New.Primary)
	require.Equal(t, res.New.Primary, res2.Old.Primary)
	require.Equal(t, uint64(3), res2.New.Epoch)
	replicaOfNode(t, byAddr[res.New.Primary], g.Primary.Addr)
	waitAcked(t, w, w.count()+300)
	waitAcked(t, w2, w2.count()+300)
	t.Logf("switchover back: paused %v", res2.PausedFor)

	for i, w := range []*writers{w, w2} {
		w.halt()
		t.Logf("writers %d: %d acknowledged in all; retried errors %v; slowest acknowledged append %v", i+1, w.count(), w.errs, w.maxLat)
		w.checkAll(t, g.Primary.Addr)
		for k := range w.errs {
			require.False(t, strings.HasPrefix(k, "other"), "unexpected write error %s", k)
		}
	}

	// Refusals leave everything as it was.
	for _, to := range []string{"nonsense", "127.0.0.1:0", "127.0.0.1:1", g.Primary.Addr} {
		_, err := loop.Switchover(ctx, SwitchoverOptions{To: to})
		require.ErrorIs(t, err, ErrBadTarget, to)
	}
	records.lmu.Lock()
	records.other = "p2"
	records.lmu.Unlock()
	_, err = loop.Switchover(ctx, SwitchoverOptions{})
	require.ErrorIs(t, err, ErrLeaseHeld)
	records.lmu.Lock()
	records.other = ""
	records.lmu.Unlock()

	// The target dies once the primary is paused: it never catches up, so
	// the switchover is undone and the primary unpaused.
	victim := byAddr[g.Replicas[0].Addr]
	p.afterPause = victim.Kill
	start = time.Now()
	_, err = loop.Switchover(ctx, SwitchoverOptions{To: victim.Addr, SyncTimeout: 500 * time.Millisecond})
	p.afterPause = nil
	require.ErrorIs(t, err, ErrNotInSync)
	t.Logf("not in sync after %v: %v", time.Since(start), err)
	rec, _ = records.Get(ctx)
	require.Equal(t, res2.New, rec, "record unchanged")
	k := store.SessionKey{Tenant: "acme", ClientID: "after"}
	wctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	require.NoError(t, f.Activate(wctx, k, store.Fence{Epoch: 1}), "the primary takes writes again (unpaused, the other replica confirms)")
	info, err := g.Primary.Client().Info(ctx, "replication").Result()
	require.NoError(t, err)
	require.Contains(t, info, "role:master")
}

func otherReplica(g *redistest.Group, primary string) string {
	for _, n := range append([]*redistest.Node{g.Primary}, g.Replicas...) {
		if n.Addr != primary && n != g.Primary {
			return n.Addr
		}
	}
	return ""
}
