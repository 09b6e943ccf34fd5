package app

import (
	"context"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	promtestutil "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/persistence/internal/redistest"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	"github.com/keelmq/keel/proto/gen/keel/coordinator/v1/coordinatorv1connect"
	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
	"github.com/keelmq/keel/proto/gen/keel/persistence/v1/persistencev1connect"
)

// coordBin is a keel-coordinator binary built by TestMain (the coordinator's
// packages are internal to its module, so it runs as processes).
var coordBin, coordBuildErr = "", error(nil)

func TestMain(m *testing.M) {
	flag.Parse()
	code := func() int {
		if !testing.Short() {
			dir, err := os.MkdirTemp("", "keel-coordinator-bin")
			if err != nil {
				panic(err)
			}
			defer os.RemoveAll(dir)
			coordBin = filepath.Join(dir, "keel-coordinator")
			out, err := exec.Command("go", "build", "-o", coordBin, "github.com/keelmq/keel/services/coordinator/cmd/keel-coordinator").CombinedOutput()
			if err != nil {
				coordBuildErr = fmt.Errorf("go build keel-coordinator: %w\n%s", err, out)
			}
		}
		return m.Run()
	}()
	os.Exit(code)
}

func h2c() *http.Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: &http.Transport{Protocols: &p}}
}

// startCoordinators runs a 3-node keel-coordinator cluster as processes on
// loopback (short Raft timeouts, 3 s member leases) and returns the API URLs
// once a leader answers. A cluster that does not come up (a port taken by
// another process between choosing and binding it, or no leader under heavy
// load) is torn down and started again on fresh ports, at most three times.
// extra flags go to every coordinator (the last of a flag wins).
func startCoordinators(t *testing.T, extra ...string) []string {
	t.Helper()
	if coordBuildErr != nil {
		t.Fatal(coordBuildErr)
	}
	for attempt := 1; ; attempt++ {
		apis, err := tryStartCoordinators(t, extra)
		if err == nil {
			return apis
		}
		if attempt == 3 {
			t.Fatalf("coordinators did not start: %v", err)
		}
		t.Logf("coordinator start attempt %d: %v", attempt, err)
	}
}

func tryStartCoordinators(t *testing.T, extra []string) ([]string, error) {
	const n = 3
	var gossip, apis []string
	for range n {
		gossip = append(gossip, testutil.FreeAddr(t))
	}
	type proc struct {
		cmd    *exec.Cmd
		log    string
		exited chan error
	}
	var procs []*proc
	stop := func() {
		for _, p := range procs {
			_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
			<-p.exited
		}
		procs = nil
	}
	logs := func() string {
		var b strings.Builder
		for i, p := range procs {
			out, _ := os.ReadFile(p.log)
			fmt.Fprintf(&b, "\ncoordinator c%d log:\n%s", i+1, out)
		}
		return b.String()
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Log(logs())
		}
		stop()
	})
	for i := range n {
		api := testutil.FreeAddr(t)
		apis = append(apis, "http://"+api)
		dir := t.TempDir()
		// Raft timeouts short enough for failover tests to be quick, long
		// enough that a leader on a loaded 2-core runner keeps its lease.
		cmd := exec.Command(coordBin, "--raft.node-id", fmt.Sprintf("c%d", i+1), "--raft.data-dir", dir,
			"--raft.bind-addr", testutil.FreeAddr(t), "--raft.bootstrap-expect", "3",
			"--raft.heartbeat-timeout", "500ms", "--raft.election-timeout", "500ms", "--raft.leader-lease-timeout", "250ms", "--raft.commit-timeout", "5ms",
			"--gossip.bind-addr", gossip[i], "--gossip.join", strings.Join(gossip, ","), "--gossip.join-interval", "100ms",
			"--api.addr", api, "--ops.addr", "", "--lease-ttl", "3s", "--log.level", "warn")
		cmd.Args = append(cmd.Args, extra...)
		log, err := os.Create(filepath.Join(dir, "coordinator.log"))
		require.NoError(t, err)
		cmd.Stdout, cmd.Stderr = log, log
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		require.NoError(t, cmd.Start())
		p := &proc{cmd: cmd, log: log.Name(), exited: make(chan error, 1)}
		go func() { p.exited <- cmd.Wait(); _ = log.Close() }()
		procs = append(procs, p)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		for i, p := range procs {
			select {
			case err := <-p.exited:
				p.exited <- err // for stop
				err = fmt.Errorf("coordinator c%d exited: %v%s", i+1, err, logs())
				stop()
				return nil, err
			default:
			}
		}
		for _, api := range apis {
			c := coordinatorv1connect.NewCoordinatorServiceClient(h2c(), api)
			ctx, cancel := context.WithTimeout(t.Context(), time.Second)
			_, err := c.AcquirePromotionLease(ctx, connect.NewRequest(&coordinatorv1.AcquirePromotionLeaseRequest{MemberId: "probe", Incarnation: 1, GroupId: 99}))
			cancel()
			if err == nil {
				return apis, nil
			}
		}
		if time.Now().After(deadline) {
			err := fmt.Errorf("no leader answered within 30s%s", logs())
			stop()
			return nil, err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

type instance struct {
	app    *App
	cancel context.CancelFunc
	done   chan error
	client persistencev1connect.PersistenceServiceClient
}

func startInstance(t *testing.T, id, coord, redisAddr string, replicas []string) *instance {
	t.Helper()
	return startInstanceWith(t, id, coord, redisAddr, replicas, nil)
}

// startInstanceWith is startInstance with edit applied to the config.
func startInstanceWith(t *testing.T, id, coord, redisAddr string, replicas []string, edit func(*Config)) *instance {
	t.Helper()
	var cfg Config
	cfg.RegisterFlags(flag.NewFlagSet(id, flag.ContinueOnError))
	cfg.MemberID, cfg.Incarnation = id, 1
	cfg.OpsAddr = "127.0.0.1:0"
	cfg.Coordinator, cfg.RedisAddr, cfg.RedisReplicas = coord, redisAddr, replicas
	cfg.WaitTimeout = 500 * time.Millisecond
	cfg.LeaseMargin = 500 * time.Millisecond
	cfg.Failover.CheckInterval = 100 * time.Millisecond
	cfg.Failover.DownAfter = time.Second
	cfg.Failover.PromotionLeaseTTL = 5 * time.Second
	cfg.Failover.ReconcileInterval = time.Second
	cfg.Failover.FenceWriters = true
	cfg.StopTimeout = 5 * time.Second
	cfg.Registry = prometheus.NewRegistry()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	cfg.APIListener = ln
	if edit != nil {
		edit(&cfg)
	}
	a, err := New(cfg, testutil.Logger(t).With("member", id))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	in := &instance{app: a, cancel: cancel, done: make(chan error, 1),
		client: persistencev1connect.NewPersistenceServiceClient(h2c(), "http://"+ln.Addr().String())}
	go func() { in.done <- a.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-in.done:
		case <-time.After(15 * time.Second):
			t.Errorf("instance %s did not stop", id)
		}
	})
	testutil.Eventually(t, 30*time.Second, func() error {
		if !a.ops.Ready() {
			return fmt.Errorf("%s not ready", id)
		}
		return nil
	})
	return in
}

func (in *instance) status(t *testing.T) *persistencev1.StatusResponse {
	resp, err := in.client.Status(t.Context(), connect.NewRequest(&persistencev1.StatusRequest{}))
	require.NoError(t, err)
	return resp.Msg
}

var csess = &commonv1.SessionKey{Tenant: "acme", ClientId: "sub-1"}

func batchOf(id uint64, from uint64, n int) *persistencev1.WriteRequest {
	a := &persistencev1.AppendOp{}
	for i := range n {
		mid := &commonv1.MsgID{EdgeId: "edge-1", Incarnation: 1, Seq: from + uint64(i)}
		a.Entries = append(a.Entries, &persistencev1.Entry{MsgId: mid, Qos: 1})
		a.Messages = append(a.Messages, &commonv1.Message{Id: mid, Tenant: "acme", Topic: "t/1", Payload: []byte("payload"), Qos: 1})
	}
	return &persistencev1.WriteRequest{BatchId: id, Ops: []*persistencev1.WriteOp{{Session: csess, Fence: &persistencev1.Fence{Epoch: 1},
		Op: &persistencev1.WriteOp_Append{Append: a}}}}
}

// TestCluster_KillPrimaryUnderWrites runs the real thing: a 3-node
// coordinator cluster (processes), a Redis group of a primary and two
// replicas (processes), and three persistence instances in this process,
// each following the group record through a different coordinator. A
// writer streams batches of 32 QoS 1 appends through one instance,
// retrying each batch until it is answered OK, as an edge would. The
// primary is killed with SIGKILL: an instance takes the promotion lease and
// promotes the replica with the highest offset within the configured time,
// every instance follows the new record, writes go on (WAIT 1 still
// satisfied: the new primary has a replica), every batch answered OK before,
// during or after the failover is readable through another instance, and
// the old primary, restarted, is demoted to a replica.
func TestCluster_KillPrimaryUnderWrites(t *testing.T) {
	if testing.Short() {
		t.Skip("cluster: skipped under -short")
	}
	redistest.Binary(t)
	apis := startCoordinators(t)
	g := redistest.StartGroup(t, 2, 1)
	nodes := []string{g.Primary.Addr, g.Replicas[0].Addr, g.Replicas[1].Addr}
	var ins []*instance
	for i := range 3 {
		ins = append(ins, startInstance(t, fmt.Sprintf("p%d", i+1), apis[i], g.Primary.Addr, nodes[1:]))
	}
	st := ins[0].status(t)
	require.Equal(t, g.Primary.Addr, st.GetRedisPrimary())
	oldEpoch := st.GetGroupRecordEpoch()
	require.NotZero(t, oldEpoch)

	// Activate the session once.
	w := ins[0].client.Write(t.Context())
	require.NoError(t, w.Send(&persistencev1.WriteRequest{BatchId: 1, Ops: []*persistencev1.WriteOp{{Session: csess,
		Fence: &persistencev1.Fence{Epoch: 1}, Op: &persistencev1.WriteOp_Activate{Activate: &persistencev1.ActivateOp{}}}}}))
	r, err := w.Receive()
	require.NoError(t, err)
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, r.GetStatus(), r.GetError())

	var (
		mu       sync.Mutex
		acked    []uint64 // first seq of each acknowledged batch
		lastOK   time.Time
		statuses = map[string]int{}
	)
	ackedN := func() int { mu.Lock(); defer mu.Unlock(); return len(acked) }
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		id := uint64(1)
		for seq := uint64(1); ; seq += 32 {
			for { // retry the batch until it is acknowledged
				select {
				case <-stop:
					return
				default:
				}
				id++
				if err := w.Send(batchOf(id, seq, 32)); err != nil {
					t.Errorf("send: %v", err)
					return
				}
				resp, err := w.Receive()
				if err != nil {
					t.Errorf("receive: %v", err)
					return
				}
				mu.Lock()
				statuses[resp.GetStatus().String()]++
				if resp.GetStatus() == persistencev1.WriteStatus_WRITE_STATUS_OK {
					acked = append(acked, seq)
					lastOK = time.Now()
					mu.Unlock()
					break
				}
				mu.Unlock()
				time.Sleep(20 * time.Millisecond)
			}
		}
	}()
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := ackedN(); n < 100 {
			return fmt.Errorf("%d batches acknowledged", n)
		}
		return nil
	})
	killed := time.Now()
	beforeKill := ackedN()
	g.Primary.Kill()

	// Promotion: every instance follows a new record within DownAfter plus
	// the promotion itself.
	var promoted time.Duration
	testutil.Eventually(t, 15*time.Second, func() error {
		for _, in := range ins {
			if s := in.status(t); s.GetRedisPrimary() == g.Primary.Addr || s.GetGroupRecordEpoch() <= oldEpoch {
				return fmt.Errorf("%s still follows %s@%d", s.GetMemberId(), s.GetRedisPrimary(), s.GetGroupRecordEpoch())
			}
		}
		promoted = time.Since(killed)
		return nil
	})
	newPrimary := ins[0].status(t).GetRedisPrimary()
	// Writes continue on the new primary.
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := ackedN(); n < beforeKill+100 {
			return fmt.Errorf("%d batches acknowledged since the kill", n-beforeKill)
		}
		return nil
	})
	mu.Lock()
	resumed := lastOK.Sub(killed)
	mu.Unlock()
	close(stop)
	wg.Wait()
	_ = w.CloseRequest()
	t.Logf("promoted %s in %v (down-after 1s); %d batches acknowledged before the kill, %d in all; statuses %v; last ack %v after the kill",
		newPrimary, promoted, beforeKill, ackedN(), statuses, resumed)
	require.Less(t, promoted, 8*time.Second)

	// Every acknowledged record is readable, through another instance.
	requireStored(t, ins[2], acked)

	// The old primary returns and is demoted by reconciliation.
	g.Primary.Restart()
	testutil.Eventually(t, 15*time.Second, func() error {
		info, err := g.Primary.Client().Info(t.Context(), "replication").Result()
		if err != nil || !strings.Contains(info, "role:slave") || !strings.Contains(info, "master_port:"+newPrimary[strings.LastIndex(newPrimary, ":")+1:]) {
			return fmt.Errorf("old primary not yet a replica of %s", newPrimary)
		}
		return nil
	})
}

// requireStored requires every record of the batches of 32 acknowledged
// from the given first sequence numbers to be readable through in.
func requireStored(t *testing.T, in *instance, acked []uint64) {
	t.Helper()
	resp, err := in.client.LoadSession(t.Context(), connect.NewRequest(&persistencev1.LoadSessionRequest{Session: csess}))
	require.NoError(t, err)
	have := map[uint64]bool{}
	for _, e := range resp.Msg.GetQueue() {
		have[e.GetMsgId().GetSeq()] = true
	}
	for _, seq := range acked {
		for i := range uint64(32) {
			require.True(t, have[seq+i], "acknowledged record %d lost", seq+i)
		}
	}
}

// batchWriter streams batches of 32 QoS 1 appends through one instance,
// retrying each until it is answered OK, as an edge would.
type batchWriter struct {
	mu       sync.Mutex
	acked    []uint64    // first seq of each acknowledged batch
	ackedAt  []time.Time // when each was acknowledged
	statuses map[string]int
	stop     chan struct{}
	wg       sync.WaitGroup
}

func startBatchWriter(t *testing.T, in *instance) *batchWriter {
	t.Helper()
	w := in.client.Write(t.Context())
	require.NoError(t, w.Send(&persistencev1.WriteRequest{BatchId: 1, Ops: []*persistencev1.WriteOp{{Session: csess,
		Fence: &persistencev1.Fence{Epoch: 1}, Op: &persistencev1.WriteOp_Activate{Activate: &persistencev1.ActivateOp{}}}}}))
	r, err := w.Receive()
	require.NoError(t, err)
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, r.GetStatus(), r.GetError())
	bw := &batchWriter{statuses: map[string]int{}, stop: make(chan struct{})}
	bw.wg.Go(func() {
		defer func() { _ = w.CloseRequest() }()
		id := uint64(1)
		for seq := uint64(1); ; seq += 32 {
			for {
				select {
				case <-bw.stop:
					return
				default:
				}
				id++
				if err := w.Send(batchOf(id, seq, 32)); err != nil {
					t.Errorf("send: %v", err)
					return
				}
				resp, err := w.Receive()
				if err != nil {
					t.Errorf("receive: %v", err)
					return
				}
				bw.mu.Lock()
				bw.statuses[resp.GetStatus().String()]++
				ok := resp.GetStatus() == persistencev1.WriteStatus_WRITE_STATUS_OK
				if ok {
					bw.acked = append(bw.acked, seq)
					bw.ackedAt = append(bw.ackedAt, time.Now())
				}
				bw.mu.Unlock()
				if ok {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
		}
	})
	return bw
}

func (bw *batchWriter) count() int {
	bw.mu.Lock()
	defer bw.mu.Unlock()
	return len(bw.acked)
}

func (bw *batchWriter) waitFor(t *testing.T, n int) {
	t.Helper()
	testutil.Eventually(t, 20*time.Second, func() error {
		if got := bw.count(); got < n {
			return fmt.Errorf("%d batches acknowledged, want %d", got, n)
		}
		return nil
	})
}

// TestCluster_SwitchoverUnderWrites runs the operator switchover (the
// Switchover RPC) on a live group: a 3-node coordinator cluster and a Redis
// primary with two replicas (processes), two persistence instances, and a
// writer streaming acknowledged batches through the instance that does NOT
// run the switchover, so it only learns of the new primary by following the
// record. Every batch answered OK is readable afterwards, the record moved,
// both instances follow it, the old primary is a replica of the new one, and
// writes resume. Refusals come with their codes: a bad target is
// InvalidArgument, a promotion lease held elsewhere Aborted.
func TestCluster_SwitchoverUnderWrites(t *testing.T) {
	if testing.Short() {
		t.Skip("cluster: skipped under -short")
	}
	redistest.Binary(t)
	apis := startCoordinators(t)
	g := redistest.StartGroup(t, 2, 1)
	nodes := []string{g.Primary.Addr, g.Replicas[0].Addr, g.Replicas[1].Addr}
	var ins []*instance
	for i := range 2 {
		ins = append(ins, startInstance(t, fmt.Sprintf("p%d", i+1), apis[i], g.Primary.Addr, nodes[1:]))
	}
	oldEpoch := ins[0].status(t).GetGroupRecordEpoch()

	bw := startBatchWriter(t, ins[0])
	bw.waitFor(t, 100)
	before := bw.count()
	start := time.Now()
	resp, err := ins[1].client.Switchover(t.Context(), connect.NewRequest(&persistencev1.SwitchoverRequest{Timeout: durationpb.New(5 * time.Second)}))
	require.NoError(t, err)
	took := time.Since(start)
	sw := resp.Msg
	require.Equal(t, g.Primary.Addr, sw.GetOldPrimary())
	require.Contains(t, nodes[1:], sw.GetNewPrimary())
	require.Greater(t, sw.GetRecordEpoch(), oldEpoch)
	require.Equal(t, oldEpoch, sw.GetOldRecordEpoch())
	require.True(t, sw.GetOldPrimaryDemoted())
	require.ElementsMatch(t, []string{g.Primary.Addr, otherOf(nodes[1:], sw.GetNewPrimary())}, sw.GetReplicaAddresses())
	testutil.Eventually(t, 10*time.Second, func() error {
		for _, in := range ins {
			if s := in.status(t); s.GetRedisPrimary() != sw.GetNewPrimary() || s.GetGroupRecordEpoch() != sw.GetRecordEpoch() {
				return fmt.Errorf("%s follows %s@%d", s.GetMemberId(), s.GetRedisPrimary(), s.GetGroupRecordEpoch())
			}
		}
		return nil
	})
	bw.waitFor(t, bw.count()+100) // writes resume on the new primary
	close(bw.stop)
	bw.wg.Wait()
	t.Logf("switchover %s -> %s (epoch %d -> %d): paused %v, RPC took %v; %d batches acknowledged before, %d in all; statuses %v",
		sw.GetOldPrimary(), sw.GetNewPrimary(), sw.GetOldRecordEpoch(), sw.GetRecordEpoch(), sw.GetPausedFor().AsDuration(), took,
		before, bw.count(), bw.statuses)
	require.Equal(t, 1.0, promtestutil.ToFloat64(ins[1].app.metrics.Switchovers.WithLabelValues("ok")))

	// Every acknowledged record is readable, through the other instance.
	load, err := ins[1].client.LoadSession(t.Context(), connect.NewRequest(&persistencev1.LoadSessionRequest{Session: csess}))
	require.NoError(t, err)
	have := map[uint64]bool{}
	for _, e := range load.Msg.GetQueue() {
		have[e.GetMsgId().GetSeq()] = true
	}
	for _, seq := range bw.acked {
		for i := range uint64(32) {
			require.True(t, have[seq+i], "acknowledged record %d lost", seq+i)
		}
	}
	info, err := g.Primary.Client().Info(t.Context(), "replication").Result()
	require.NoError(t, err)
	require.Contains(t, info, "role:slave")
	require.Contains(t, info, "master_port:"+sw.GetNewPrimary()[strings.LastIndex(sw.GetNewPrimary(), ":")+1:])

	// Refusals.
	for _, to := range []string{"nope", "127.0.0.1:1", sw.GetNewPrimary()} {
		_, err = ins[0].client.Switchover(t.Context(), connect.NewRequest(&persistencev1.SwitchoverRequest{To: to}))
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%s: %v", to, err)
	}
	_, err = ins[0].client.Switchover(t.Context(), connect.NewRequest(&persistencev1.SwitchoverRequest{Timeout: durationpb.New(2 * time.Minute)}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%v", err)
	coord := coordinatorv1connect.NewCoordinatorServiceClient(h2c(), apis[2])
	lease, err := coord.AcquirePromotionLease(t.Context(), connect.NewRequest(&coordinatorv1.AcquirePromotionLeaseRequest{MemberId: "operator-probe",
		Incarnation: 1, GroupId: 0, Ttl: durationpb.New(20 * time.Second)}))
	testutil.Eventually(t, 15*time.Second, func() error { // an instance's reconcile may hold it for a moment
		if err == nil && lease.Msg.GetAcquired() {
			return nil
		}
		lease, err = coord.AcquirePromotionLease(t.Context(), connect.NewRequest(&coordinatorv1.AcquirePromotionLeaseRequest{MemberId: "operator-probe",
			Incarnation: 1, GroupId: 0, Ttl: durationpb.New(20 * time.Second)}))
		return fmt.Errorf("lease not acquired: %v", err)
	})
	_, err = ins[0].client.Switchover(t.Context(), connect.NewRequest(&persistencev1.SwitchoverRequest{}))
	require.Equal(t, connect.CodeAborted, connect.CodeOf(err), "%v", err)
	t.Logf("refused while the lease is held elsewhere: %v", err)
}

func otherOf(addrs []string, not string) string {
	for _, a := range addrs {
		if a != not {
			return a
		}
	}
	return ""
}

// TestCluster_FailoverLeasePausesWriters: while another member holds the
// group's promotion lease for a failover (fence_writers), the coordinator
// grants a writer no writes: it answers UNAVAILABLE from its next lease
// renewal on, though its primary is fine, and acknowledges again once the
// lease is gone. A promoter that waits one lease TTL after taking the
// lease thus knows no other writer still acknowledges through the old
// primary.
func TestCluster_FailoverLeasePausesWriters(t *testing.T) {
	if testing.Short() {
		t.Skip("cluster: skipped under -short")
	}
	redistest.Binary(t)
	apis := startCoordinators(t)
	g := redistest.StartGroup(t, 1, 1)
	in := startInstance(t, "p1", apis[0], g.Primary.Addr, []string{g.Replicas[0].Addr})
	w := in.client.Write(t.Context())
	id := uint64(0)
	write := func(ops ...*persistencev1.WriteOp) persistencev1.WriteStatus {
		t.Helper()
		id++
		require.NoError(t, w.Send(&persistencev1.WriteRequest{BatchId: id, Ops: ops}))
		r, err := w.Receive()
		require.NoError(t, err)
		return r.GetStatus()
	}
	activate := &persistencev1.WriteOp{Session: csess, Fence: &persistencev1.Fence{Epoch: 1},
		Op: &persistencev1.WriteOp_Activate{Activate: &persistencev1.ActivateOp{}}}
	testutil.Eventually(t, 10*time.Second, func() error {
		if st := write(activate); st != persistencev1.WriteStatus_WRITE_STATUS_OK {
			return fmt.Errorf("activate: %s", st)
		}
		return nil
	})
	seq := uint64(1)
	batch := func() persistencev1.WriteStatus {
		t.Helper()
		id++
		require.NoError(t, w.Send(batchOf(id, seq, 4)))
		r, err := w.Receive()
		require.NoError(t, err)
		if r.GetStatus() == persistencev1.WriteStatus_WRITE_STATUS_OK {
			seq += 4
		}
		return r.GetStatus()
	}
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, batch())

	const leaseTTL = 6 * time.Second
	coord := coordinatorv1connect.NewCoordinatorServiceClient(h2c(), apis[1])
	var taken time.Time
	testutil.Eventually(t, 15*time.Second, func() error { // the bootstrap's lease may still be held
		lease, err := coord.AcquirePromotionLease(t.Context(), connect.NewRequest(&coordinatorv1.AcquirePromotionLeaseRequest{MemberId: "promoter-probe",
			Incarnation: 1, GroupId: 0, Ttl: durationpb.New(leaseTTL), FenceWriters: true}))
		if err != nil || !lease.Msg.GetAcquired() {
			return fmt.Errorf("lease not acquired: %v", err)
		}
		taken = time.Now()
		return nil
	})
	var paused time.Duration
	testutil.Eventually(t, 5*time.Second, func() error { // one renewal: every TTL/3 (3 s leases here)
		if st := batch(); st != persistencev1.WriteStatus_WRITE_STATUS_UNAVAILABLE {
			return fmt.Errorf("batch answered %s", st)
		}
		paused = time.Since(taken)
		return nil
	})
	t.Logf("writes refused %v after the failover's lease was taken", paused.Round(time.Millisecond))
	require.Less(t, paused, 3*time.Second, "within one lease TTL of the lease")
	testutil.Eventually(t, leaseTTL+5*time.Second, func() error {
		if st := batch(); st != persistencev1.WriteStatus_WRITE_STATUS_OK {
			return fmt.Errorf("batch answered %s", st)
		}
		return nil
	})
	t.Logf("writes acknowledged again %v after the lease was taken (it lasted %v)", time.Since(taken).Round(time.Millisecond), leaseTTL)
}
