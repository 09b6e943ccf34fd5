package failover

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/persistence/internal/redistest"
	"github.com/keelmq/keel/services/persistence/internal/store"
	"github.com/keelmq/keel/services/persistence/internal/store/redisstore"
)

// memRecords stands in for the coordinator's record of the group, with the
// same compare-and-set rule.
type memRecords struct {
	mu  sync.Mutex
	rec Record
}

func (m *memRecords) Get(context.Context) (Record, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.rec, nil
}

func (m *memRecords) CompareAndSet(_ context.Context, oldEpoch uint64, next Record) (Record, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.rec.Epoch != oldEpoch {
		return m.rec, ErrRecordChanged
	}
	next.Epoch = oldEpoch + 1
	m.rec = next
	return next, nil
}

// TestFailover_KillPrimaryLosesNoAcknowledgedWrite streams acknowledged
// (WAIT 1) appends, kills the primary with SIGKILL, promotes the replica
// with the highest offset, and checks that every append acknowledged before
// the kill is on the new primary; writes go on there, a writer following
// the old record is fenced, and the old primary comes back as a replica.
func TestFailover_KillPrimaryLosesNoAcknowledgedWrite(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	g := redistest.StartGroup(t, 2, 1)
	nodes := []string{g.Primary.Addr, g.Replicas[0].Addr, g.Replicas[1].Addr}
	records := &memRecords{rec: Record{Primary: g.Primary.Addr, Epoch: 1}}
	ctx := context.Background()
	k := store.SessionKey{Tenant: "acme", ClientID: "dev"}
	f := store.Fence{Epoch: 1, GroupEpoch: 1}

	w, err := redisstore.New(redisstore.Config{Addr: g.Primary.Addr, MinReplicas: 1, WaitTimeout: 500 * time.Millisecond}, testutil.Logger(t))
	require.NoError(t, err)
	require.NoError(t, w.Activate(ctx, k, f))
	var (
		mu    sync.Mutex
		acked []string
	)
	ackedN := func() int { mu.Lock(); defer mu.Unlock(); return len(acked) }
	var stop sync.WaitGroup
	stopCh := make(chan struct{})
	stop.Add(1)
	go func() {
		defer stop.Done()
		for i := 0; ; i++ {
			select {
			case <-stopCh:
				return
			default:
			}
			id := fmt.Sprintf("e/1/%d", i)
			cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			_, err := w.Append(cctx, k, f, store.QueueLimits{}, []store.Entry{{MsgID: id, QoS: 1}}, []*store.Message{{ID: id, Topic: "t", Payload: []byte("x"), QoS: 1}})
			cancel()
			if err == nil {
				mu.Lock()
				acked = append(acked, id)
				mu.Unlock()
			}
		}
	}()
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := ackedN(); n < 200 {
			return fmt.Errorf("%d acknowledged so far", n)
		}
		return nil
	})
	g.Primary.Kill()
	time.Sleep(300 * time.Millisecond) // the writer now fails: nothing more is acknowledged
	close(stopCh)
	stop.Wait()
	_ = w.Close()
	require.NotEmpty(t, acked)

	p := &Promoter{Nodes: nodes, Records: records, Logger: testutil.Logger(t),
		WaitWriters: func(context.Context) error { return nil }} // the only writer has stopped
	start := time.Now()
	rec, err := p.Failover(ctx)
	require.NoError(t, err)
	t.Logf("promoted %s in %v", rec.Primary, time.Since(start))
	require.NotEqual(t, g.Primary.Addr, rec.Primary)
	require.Equal(t, uint64(2), rec.Epoch)

	w2, err := redisstore.New(redisstore.Config{Addr: rec.Primary, MinReplicas: 1}, testutil.Logger(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = w2.Close() })
	st, err := w2.Load(ctx, k)
	require.NoError(t, err)
	have := map[string]bool{}
	for _, e := range st.Queue {
		have[e.MsgID] = true
	}
	for _, id := range acked {
		require.True(t, have[id], "acknowledged %s lost in failover", id)
	}
	t.Logf("%d acknowledged appends, all on the new primary", len(acked))

	// A writer still following the old record is refused by the new primary.
	_, err = w2.Append(ctx, k, f, store.QueueLimits{}, []store.Entry{{MsgID: "late", QoS: 1}}, []*store.Message{{ID: "late", Topic: "t", QoS: 1}})
	require.ErrorIs(t, err, store.ErrGroupFenced)
	// Writers of the new record go on, replicated.
	_, err = w2.Append(ctx, k, store.Fence{Epoch: 1, GroupEpoch: 2}, store.QueueLimits{}, []store.Entry{{MsgID: "after", QoS: 1}}, []*store.Message{{ID: "after", Topic: "t", QoS: 1}})
	require.NoError(t, err)

	// The old primary returns as a primary of its own; reconcile demotes it
	// and it follows the new one.
	g.Primary.Restart()
	require.NoError(t, p.Reconcile(ctx))
	testutil.Eventually(t, 10*time.Second, func() error {
		v, err := g.Primary.Client().Get(ctx, GroupEpochKey).Result()
		if err != nil || v != "2" {
			return fmt.Errorf("old primary not yet following: %q %v", v, err)
		}
		return nil
	})
}

// failoverCase is a group of a primary and two replicas (WAIT 1), its
// record at epoch 1, a session activated on the primary through w, and a
// promoter for the group that takes writers as paused.
type failoverCase struct {
	g       *redistest.Group
	nodes   []string
	records *memRecords
	w       *redisstore.Store
	p       *Promoter
}

var (
	caseKey   = store.SessionKey{Tenant: "acme", ClientID: "dev"}
	caseFence = store.Fence{Epoch: 1, GroupEpoch: 1}
)

func newFailoverCase(t *testing.T) *failoverCase {
	t.Helper()
	g := redistest.StartGroup(t, 2, 1)
	c := &failoverCase{g: g, nodes: []string{g.Primary.Addr, g.Replicas[0].Addr, g.Replicas[1].Addr}}
	c.records = &memRecords{rec: Record{Primary: g.Primary.Addr, Replicas: c.nodes[1:], Epoch: 1}}
	w, err := redisstore.New(redisstore.Config{Addr: g.Primary.Addr, MinReplicas: 1}, testutil.Logger(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = w.Close() })
	require.NoError(t, w.Activate(context.Background(), caseKey, caseFence))
	c.w = w
	c.p = &Promoter{Nodes: c.nodes, Records: c.records, Logger: testutil.Logger(t), DialTimeout: 300 * time.Millisecond,
		WaitWriters: func(context.Context) error { return nil }}
	return c
}

// appendMsg queues message e/1/n for the session through w, acknowledged.
func appendMsg(t *testing.T, w *redisstore.Store, n int) {
	t.Helper()
	id := fmt.Sprintf("e/1/%d", n)
	_, err := w.Append(context.Background(), caseKey, caseFence, store.QueueLimits{}, []store.Entry{{MsgID: id, QoS: 1}}, []*store.Message{{ID: id, Topic: "t", QoS: 1}})
	require.NoError(t, err)
}

// queued returns how many entries the session has queued on the node at addr.
func queued(t *testing.T, addr string) int {
	t.Helper()
	r, err := redisstore.New(redisstore.Config{Addr: addr, MinReplicas: 1}, testutil.Logger(t))
	require.NoError(t, err)
	defer r.Close()
	st, err := r.Load(context.Background(), caseKey)
	require.NoError(t, err)
	return len(st.Queue)
}

// A failover waits for every replica: an acknowledged write (WAIT 1) is on
// one replica at least, not on each, so the replica that does not answer
// may hold writes the others lack. With the primary and a replica down it
// promotes nothing and leaves the record as it is; once that replica is
// back it promotes the one with the highest offset.
func TestFailover_WaitsForEveryReplica(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	t.Parallel()
	c := newFailoverCase(t)
	g, ctx := c.g, context.Background()
	appendMsg(t, c.w, 1)
	_ = c.w.Close()

	g.Primary.Kill()
	g.Replicas[0].Kill()
	_, err := c.p.Failover(ctx)
	require.ErrorIs(t, err, ErrReplicaUnreachable)
	require.ErrorContains(t, err, g.Replicas[0].Addr)
	rec, _ := c.records.Get(ctx)
	require.Equal(t, uint64(1), rec.Epoch, "no record published")
	require.Equal(t, g.Primary.Addr, rec.Primary)
	role, err := g.Replicas[1].Client().Do(ctx, "ROLE").Slice()
	require.NoError(t, err)
	require.Equal(t, "slave", role[0], "nothing promoted")

	g.Replicas[0].Restart()
	rec, err = c.p.Failover(ctx)
	require.NoError(t, err)
	require.Contains(t, c.nodes[1:], rec.Primary)
	require.Equal(t, 1, queued(t, rec.Primary))
}

// TestFailover_RestartedReplicaKeepsItsClaim covers a replica that holds
// the only acknowledged copy of a write and restarts while the primary is
// down. Redis then reports it at replication offset 1 under a fresh
// replication ID (its position is not kept across a restart with AOF),
// however much data it loaded; the other replica, cut off from the primary
// before the write, reports its old, higher offset. The promotion must go
// by what each node holds, not by those offsets.
func TestFailover_RestartedReplicaKeepsItsClaim(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	t.Parallel()
	c := newFailoverCase(t)
	g, ctx := c.g, context.Background()
	appendMsg(t, c.w, 1)

	// Replica 1 stops following (pointed at a port nobody serves): the
	// next write reaches replica 0 alone, which confirms it (WAIT 1).
	// Replica 0 writes its AOF before it confirms (with everysec, Redis
	// may put the write off while an fsync runs), as its restart must
	// find it.
	require.NoError(t, g.Replicas[0].Client().ConfigSet(ctx, "appendfsync", "always").Err())
	require.NoError(t, g.Replicas[1].Client().Do(ctx, "REPLICAOF", "127.0.0.1", "1").Err())
	appendMsg(t, c.w, 2)
	_ = c.w.Close()

	g.Primary.Kill()
	g.Replicas[0].Restart()
	rec, err := c.p.Failover(ctx)
	require.NoError(t, err)
	require.Equal(t, g.Replicas[0].Addr, rec.Primary, "the replica holding every acknowledged write")
	require.Equal(t, 2, queued(t, rec.Primary))
}

// TestFailover_UnpublishedPromotionHoldsNoClaim covers a replica promoted
// and stamped with the next group epoch by a promotion that was never
// published (its compare-and-set lost, or a switchover rolled back before
// the replica's resync), then cut off. The record's writers go on under
// the old record through the other replica; when the primary dies, the
// stamp must not win over the writes that were acknowledged since.
func TestFailover_UnpublishedPromotionHoldsNoClaim(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	t.Parallel()
	c := newFailoverCase(t)
	g, ctx := c.g, context.Background()
	appendMsg(t, c.w, 1)

	stale := g.Replicas[1].Client()
	require.NoError(t, stale.Do(ctx, "REPLICAOF", "NO", "ONE").Err())
	require.NoError(t, stale.ConfigSet(ctx, "min-replicas-to-write", "0").Err()) // as if a replica had attached
	require.NoError(t, stale.Set(ctx, GroupEpochKey, 2, 0).Err())
	require.NoError(t, stale.Do(ctx, "REPLICAOF", "127.0.0.1", "1").Err())
	for n := 2; n <= 4; n++ {
		appendMsg(t, c.w, n) // confirmed by replica 0 alone
	}
	_ = c.w.Close()

	g.Primary.Kill()
	rec, err := c.p.Failover(ctx)
	require.NoError(t, err)
	require.Equal(t, g.Replicas[0].Addr, rec.Primary, "the replica holding every acknowledged write")
	require.Equal(t, 4, queued(t, rec.Primary))
}

// TestPromoter_Describe reads a live group: roles, links, the write marks
// (equal on every node once replicated), memory; a killed replica is
// reported with its error.
func TestPromoter_Describe(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	t.Parallel()
	g := redistest.StartGroup(t, 2, 1)
	rec := Record{Primary: g.Primary.Addr, Replicas: []string{g.Replicas[0].Addr, g.Replicas[1].Addr}, Epoch: 7}
	ctx := context.Background()
	k := store.SessionKey{Tenant: "acme", ClientID: "dev"}
	w, err := redisstore.New(redisstore.Config{Addr: g.Primary.Addr, MinReplicas: 2}, testutil.Logger(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = w.Close() })
	require.NoError(t, w.Activate(ctx, k, store.Fence{Epoch: 1, GroupEpoch: 7}))

	p := &Promoter{Logger: testutil.Logger(t), DialTimeout: 300 * time.Millisecond}
	nodes := p.Describe(ctx, rec)
	require.Len(t, nodes, 3)
	require.Equal(t, "master", nodes[0].Role)
	for _, n := range nodes {
		require.NoError(t, n.Err)
		require.Equal(t, uint64(7), n.WriteEpoch, n.Addr)
		require.Equal(t, uint64(1), n.WriteSeq, n.Addr)
		require.Positive(t, n.UsedMemory)
	}
	for _, n := range nodes[1:] {
		require.Equal(t, "slave", n.Role)
		require.Equal(t, g.Primary.Addr, n.Following)
		require.True(t, n.LinkUp)
		require.GreaterOrEqual(t, n.Lag, int64(0))
	}
	g.Replicas[1].Kill()
	nodes = p.Describe(ctx, rec)
	require.Error(t, nodes[2].Err)
	require.NoError(t, nodes[1].Err)
}

// TestFailover_RetainedWritesCarryTheirEpoch: a new primary that takes only
// retained writes ranks above the old primary's own lineage, which holds
// more writing calls (unacknowledged: its replicas had gone) under the old
// record. When the new primary dies, its replica is promoted, not the old
// primary, and the acknowledged retained message is there.
func TestFailover_RetainedWritesCarryTheirEpoch(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	t.Parallel()
	c := newFailoverCase(t)
	g, p, ctx := c.g, c.p, context.Background()
	_ = c.w.Close()

	// The replicas go; the old primary takes three more calls nobody
	// confirms (as in its min-replicas-max-lag window).
	for _, r := range g.Replicas {
		require.NoError(t, r.Client().Do(ctx, "REPLICAOF", "127.0.0.1", "1").Err())
	}
	require.NoError(t, g.Primary.Client().ConfigSet(ctx, "min-replicas-to-write", "0").Err())
	lone, err := redisstore.New(redisstore.Config{Addr: g.Primary.Addr}, testutil.Logger(t))
	require.NoError(t, err)
	for n := 1; n <= 3; n++ {
		appendMsg(t, lone, n)
	}
	_ = lone.Close()

	rec, err := p.Failover(ctx)
	require.NoError(t, err)
	require.NotEqual(t, g.Primary.Addr, rec.Primary)
	w2, err := redisstore.New(redisstore.Config{Addr: rec.Primary, MinReplicas: 1}, testutil.Logger(t))
	require.NoError(t, err)
	w2.SetGroupEpoch(rec.Epoch)
	_, err = w2.PutRetained(ctx, "acme", &store.Message{ID: "e/2/1", Topic: "r", QoS: 1, Payload: []byte("kept"), Created: 1})
	require.NoError(t, err, "acknowledged: on the other replica too")
	_ = w2.Close()

	for _, r := range g.Replicas {
		if r.Addr == rec.Primary {
			r.Kill()
		}
	}
	rec2, err := p.Failover(ctx)
	require.NoError(t, err)
	require.NotEqual(t, g.Primary.Addr, rec2.Primary, "the old primary's longer lineage is of the older record")
	w3, err := redisstore.New(redisstore.Config{Addr: rec2.Primary, MinReplicas: 1}, testutil.Logger(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = w3.Close() })
	got, err := w3.LookupRetained(ctx, "acme", "r", 10)
	require.NoError(t, err)
	require.Len(t, got, 1)
}

// TestReplState_FollowsWholeHostAndPort: whether a node follows the
// recorded primary is read from INFO replication's master_host and
// master_port whole; a host or port that only starts like the primary's
// is another node.
func TestReplState_FollowsWholeHostAndPort(t *testing.T) {
	info := func(role, host, port string) string {
		s := "# Replication\r\nrole:" + role + "\r\n"
		if host != "" {
			s += "master_host:" + host + "\r\nmaster_port:" + port + "\r\nmaster_link_status:up\r\nslave_repl_offset:42\r\n"
		}
		return s + "connected_slaves:0\r\nmaster_replid:0123456789abcdef\r\nmaster_repl_offset:42\r\n"
	}
	for _, tc := range []struct {
		name, info, primary string
		want                bool
	}{
		{"same host and port", info("slave", "10.0.0.1", "6379"), "10.0.0.1:6379", true},
		{"host with a longer last octet", info("slave", "10.0.0.12", "6379"), "10.0.0.1:6379", false},
		{"host name with a suffix", info("slave", "redis-1.keel", "6379"), "redis-1:6379", false},
		{"port with more digits", info("slave", "10.0.0.1", "63790"), "10.0.0.1:6379", false},
		{"shorter port", info("slave", "10.0.0.1", "637"), "10.0.0.1:6379", false},
		{"another host", info("slave", "10.0.0.2", "6379"), "10.0.0.1:6379", false},
		{"a primary", info("master", "", ""), "10.0.0.1:6379", false},
		{"IPv6", info("slave", "::1", "6379"), "[::1]:6379", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, parseReplication("n:1", tc.info).follows(tc.primary))
		})
	}
}

// TestReconcile_RepointsReplicaOfLookalikeHost: a replica of 127.0.0.10,
// whose INFO text contains "master_host:127.0.0.1", is not a replica of
// the recorded 127.0.0.1: a reconcile re-points it.
func TestReconcile_RepointsReplicaOfLookalikeHost(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	t.Parallel()
	g := redistest.StartGroup(t, 1, 1)
	ctx := context.Background()
	_, port, _ := net.SplitHostPort(g.Primary.Addr)
	r := g.Replicas[0]
	require.NoError(t, r.Client().Do(ctx, "REPLICAOF", "127.0.0.10", port).Err())
	records := &memRecords{rec: Record{Primary: g.Primary.Addr, Replicas: []string{r.Addr}, Epoch: 1}}
	p := &Promoter{Records: records, Logger: testutil.Logger(t), DialTimeout: 300 * time.Millisecond}
	need, err := p.NeedsReconcile(ctx)
	require.NoError(t, err)
	require.True(t, need)
	require.NoError(t, p.Reconcile(ctx))
	replicaOfNode(t, r, g.Primary.Addr)
	info, err := r.Client().Info(ctx, "replication").Result()
	require.NoError(t, err)
	require.Contains(t, info, "master_host:127.0.0.1\r\n")
}

// refusingDialer dials as net.Dialer does but refuses the address set.
type refusingDialer struct {
	mu     sync.Mutex
	refuse string
}

func (d *refusingDialer) set(addr string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.refuse = addr
}

func (d *refusingDialer) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	d.mu.Lock()
	refused := addr == d.refuse
	d.mu.Unlock()
	if refused {
		return nil, fmt.Errorf("dial %s: refused by the test", addr)
	}
	return (&net.Dialer{}).DialContext(ctx, network, addr)
}

// TestLoop_FailoverPausesItsOwnWrites: the coordinator grants a failing-over
// group's other writers no writes, but not the failover's own instance.
// Its writes must stop too, from before it reads the replicas' positions
// until it follows the record it publishes: one written through the old
// primary meanwhile (a primary that stalled and came back), confirmed by
// the replica that is not promoted, would be lost. Here the old primary
// takes writes throughout. A write through the instance's gate during a
// failover is refused, and acknowledged only once the new record is
// published and followed, on the new primary; after a failover given up
// (a replica unreachable) the old primary stays and writes go through
// again.
func TestLoop_FailoverPausesItsOwnWrites(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	t.Parallel()
	g := redistest.StartGroup(t, 2, 1)
	records := &memLeases{memRecords: memRecords{rec: Record{Primary: g.Primary.Addr,
		Replicas: []string{g.Replicas[0].Addr, g.Replicas[1].Addr}, Epoch: 1}}}
	ctx := context.Background()
	logger := testutil.Logger(t)
	var openFails atomic.Bool
	f, err := NewFollower(records.rec, func(addr string) (*redisstore.Store, error) {
		if openFails.Swap(false) {
			return nil, fmt.Errorf("connect to %s: refused by the test", addr)
		}
		return redisstore.New(redisstore.Config{Addr: addr, MinReplicas: 1, WaitTimeout: 500 * time.Millisecond}, logger)
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	dialer := &refusingDialer{}
	p := &Promoter{Records: records, Logger: logger, DialTimeout: 300 * time.Millisecond, MinReplicas: 1, Dialer: dialer.dial}
	loop := NewLoop(LoopConfig{CheckInterval: 50 * time.Millisecond, DownAfter: time.Second, PromotionLeaseTTL: 2 * time.Second,
		ReconcileInterval: 200 * time.Millisecond, FenceWriters: true}, records, f, p, nil, logger)
	fe := store.Fence{Epoch: 1} // the group epoch is the followed record's
	require.NoError(t, f.Activate(ctx, caseKey, fe))

	// write appends message id as the server answers a batch: the gate is
	// asked before the write and again before the answer.
	write := func(id string) error {
		if err := loop.Gate(); err != nil {
			return err
		}
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		if _, err := f.Append(cctx, caseKey, fe, store.QueueLimits{}, []store.Entry{{MsgID: id, QoS: 1}},
			[]*store.Message{{ID: id, Topic: "t", Payload: []byte("x"), QoS: 1}}); err != nil {
			return err
		}
		return loop.Gate()
	}
	require.NoError(t, write("e/1/1"))

	// Given up: a replica does not answer.
	var inWindow error
	p.WaitWriters = func(context.Context) error {
		inWindow = write("e/1/2")
		dialer.set(g.Replicas[1].Addr)
		return nil
	}
	require.False(t, loop.failover(ctx, records.rec))
	require.ErrorIs(t, inWindow, ErrFailingOver, "not acknowledged through the old primary while failing over")
	rec, _ := records.Get(ctx)
	require.Equal(t, uint64(1), rec.Epoch, "nothing published")
	require.NoError(t, loop.Gate(), "the gate opens again with the old primary kept")
	require.NoError(t, write("e/1/3"), "the old primary takes writes again")
	dialer.set("")

	// Done: a write submitted while failing over, and retried as an edge
	// retries, is acknowledged only under the new record, on the new
	// primary. The instance fails to follow the record it published at
	// first: it does not write until it follows it.
	type ack struct {
		at    time.Time
		epoch uint64
		tries int
	}
	acked := make(chan ack, 1)
	p.WaitWriters = func(context.Context) error {
		go func() {
			for i := 1; ; i++ {
				if err := write("e/1/4"); err == nil {
					acked <- ack{time.Now(), f.Record().Epoch, i}
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
		}()
		// Long enough for many tries through the old primary.
		time.Sleep(500 * time.Millisecond)
		return nil
	}
	openFails.Store(true)
	require.True(t, loop.failover(ctx, records.rec))
	rec, _ = records.Get(ctx)
	require.Equal(t, uint64(2), rec.Epoch)
	require.NotEqual(t, g.Primary.Addr, rec.Primary)
	require.Equal(t, uint64(1), f.Record().Epoch, "following the new record failed")
	require.ErrorIs(t, loop.Gate(), ErrFailingOver, "not writing through the old record")
	loop.follow(rec) // the loop's next tick
	done := time.Now()
	var a ack
	select {
	case a = <-acked:
	case <-time.After(20 * time.Second):
		t.Fatal("the write was never acknowledged after the failover")
	}
	require.Equal(t, uint64(2), a.epoch, "acknowledged under the new record only")
	require.Greater(t, a.tries, 1, "refused while failing over")
	t.Logf("acknowledged %v after the new record was followed, at try %d", a.at.Sub(done).Round(time.Millisecond), a.tries)
	require.Equal(t, 3, queued(t, rec.Primary), "e/1/1, e/1/3 and e/1/4 on the new primary")
}
