package app

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	"github.com/keelmq/keel/proto/gen/keel/coordinator/v1/coordinatorv1connect"
)

// clusterOpts tunes a test cluster.
type clusterOpts struct {
	leaseTTL time.Duration
	// fast selects short Raft timeouts; false keeps the production defaults.
	fast bool
	// deadServerTimeout is --dead-server-timeout (0: off).
	deadServerTimeout time.Duration
	// watchHeartbeat overrides the WatchCluster heartbeat (default 200ms).
	watchHeartbeat time.Duration
	// strictFormation fails the test when the first leader is slow, instead
	// of starting over (see startCluster).
	strictFormation bool
	// routerURL is --router.url (empty: dead edges' routes are not removed).
	routerURL string
	// routeGrace is --custody.route-grace (0: the default).
	routeGrace time.Duration
	// adoptionWait is --custody.adoption-wait (0: custodians' reports are
	// not waited for).
	adoptionWait time.Duration
}

// testNode is one coordinator of a test cluster. Its addresses survive a
// restart, as a StatefulSet pod's do.
type testNode struct {
	t          testing.TB
	id         string
	dir        string
	raftAddr   string
	apiAddr    string
	gossipAddr string
	join       []string
	expect     int
	opts       clusterOpts

	mu     sync.Mutex
	app    *App
	cancel context.CancelFunc
	done   chan error
}

type cluster struct {
	t     testing.TB
	nodes []*testNode
}

func freeListener(t testing.TB, addr string) net.Listener {
	t.Helper()
	var ln net.Listener
	var err error
	// A restarted node rebinds its old port, which may linger briefly.
	for range 50 {
		if ln, err = net.Listen("tcp", addr); err == nil {
			return ln
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("listen %s: %v", addr, err)
	return nil
}

// startCluster starts n coordinators that find each other through gossip and
// bootstrap with bootstrap-expect=n, and waits until a leader is ready.
//
// NOTE(coordinator): under heavy CI load a cluster has once failed to elect a
// first leader within 30 s (not reproduced since). Tests about other things
// start over on fresh ports when formation takes over 20 s, and say so in
// the log; TestCluster_BootstrapExpect (opts.strictFormation) never does, so
// the formation path itself stays under test.
func startCluster(t testing.TB, n int, opts clusterOpts) *cluster {
	t.Helper()
	if !opts.strictFormation {
		if c := formCluster(t, n, opts, 20*time.Second); c != nil {
			return c
		}
		t.Logf("cluster of %d did not elect a leader within 20s; starting over on fresh ports", n)
	}
	c := formCluster(t, n, opts, 0)
	c.waitLeader(30 * time.Second) // generous: CI runs many clusters at once on 2 cores
	return c
}

// formCluster starts the nodes; with a positive wait it returns nil (after
// stopping them) when no leader is ready within it.
func formCluster(t testing.TB, n int, opts clusterOpts, wait time.Duration) *cluster {
	c := &cluster{t: t}
	var gossip []string
	for range n {
		gossip = append(gossip, testutil.FreeAddr(t))
	}
	for i := range n {
		tn := &testNode{t: t, id: "c" + strconv.Itoa(i+1), dir: t.TempDir(), gossipAddr: gossip[i], join: gossip, expect: n, opts: opts}
		c.nodes = append(c.nodes, tn)
	}
	for _, tn := range c.nodes {
		tn.start()
	}
	t.Cleanup(c.stopAll)
	if wait <= 0 {
		return c
	}
	for deadline := time.Now().Add(wait); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if c.leader() != nil {
			return c
		}
	}
	c.stopAll()
	return nil
}

func (tn *testNode) config() Config {
	var cfg Config
	fs := newFlagSet()
	cfg.RegisterFlags(fs)
	cfg.OpsAddr = ""
	cfg.LogLevel = "debug"
	cfg.StopTimeout = 5 * time.Second
	cfg.Raft.NodeID = tn.id
	cfg.Raft.DataDir = tn.dir
	cfg.Raft.BootstrapExpect = tn.expect
	if tn.opts.fast {
		// Short enough that failover tests take seconds, long enough that
		// a leader keeps its lease while a 2-core CI runner with the race
		// detector runs several clusters at once (at 100 ms leases they
		// were seen losing and re-electing leaders for tens of seconds).
		cfg.Raft.HeartbeatTimeout = 400 * time.Millisecond
		cfg.Raft.ElectionTimeout = 400 * time.Millisecond
		cfg.Raft.LeaderLeaseTimeout = 200 * time.Millisecond
		cfg.Raft.CommitTimeout = 5 * time.Millisecond
		// Snapshot often so that restarts and catch-up go through snapshots.
		cfg.Raft.SnapshotInterval = 200 * time.Millisecond
		cfg.Raft.SnapshotThreshold = 256
		cfg.Raft.TrailingLogs = 64
	}
	cfg.Gossip.BindAddr = tn.gossipAddr
	cfg.Gossip.Join = tn.join
	cfg.Gossip.JoinInterval = 100 * time.Millisecond
	cfg.Gossip.Local = true
	cfg.Server.LeaseTTL = tn.opts.leaseTTL
	if cfg.Server.LeaseTTL == 0 {
		cfg.Server.LeaseTTL = 2 * time.Second
	}
	cfg.Server.ReconcileInterval = 100 * time.Millisecond
	cfg.Server.WatchHeartbeat = 200 * time.Millisecond
	if tn.opts.watchHeartbeat > 0 {
		cfg.Server.WatchHeartbeat = tn.opts.watchHeartbeat
	}
	cfg.Server.DeadServerTimeout = tn.opts.deadServerTimeout
	cfg.Server.RouterURL = tn.opts.routerURL
	if tn.opts.routeGrace > 0 {
		cfg.Server.RouteGrace = tn.opts.routeGrace
	}
	cfg.Server.AdoptionWait = tn.opts.adoptionWait
	cfg.Registry = prometheus.NewRegistry()
	return cfg
}

func (tn *testNode) start() {
	t := tn.t
	t.Helper()
	cfg := tn.config()
	raftAddr, apiAddr := tn.raftAddr, tn.apiAddr
	if raftAddr == "" {
		raftAddr, apiAddr = "127.0.0.1:0", "127.0.0.1:0"
	}
	cfg.Raft.Listener = freeListener(t, raftAddr)
	cfg.APIListener = freeListener(t, apiAddr)
	tn.raftAddr, tn.apiAddr = cfg.Raft.Listener.Addr().String(), cfg.APIListener.Addr().String()
	a, err := New(cfg, testutil.Logger(t).With("node", tn.id))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	tn.mu.Lock()
	tn.app, tn.cancel, tn.done = a, cancel, done
	tn.mu.Unlock()
}

// stop stops the node gracefully (leadership transfer included).
func (tn *testNode) stop() {
	tn.mu.Lock()
	cancel, done := tn.cancel, tn.done
	tn.cancel = nil
	tn.mu.Unlock()
	if cancel == nil {
		return
	}
	cancel()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		tn.t.Errorf("node %s did not stop", tn.id)
	}
}

// kill stops Raft at once, as a crash would, then tears the rest down.
func (tn *testNode) kill() {
	tn.mu.Lock()
	a := tn.app
	tn.mu.Unlock()
	_ = a.Node().Kill()
	tn.stop()
}

func (tn *testNode) running() bool {
	tn.mu.Lock()
	defer tn.mu.Unlock()
	return tn.cancel != nil
}

func (tn *testNode) a() *App {
	tn.mu.Lock()
	defer tn.mu.Unlock()
	return tn.app
}

func (c *cluster) stopAll() {
	for _, tn := range c.nodes {
		tn.stop()
	}
}

// leader returns the node that is leader and ready, or nil.
func (c *cluster) leader() *testNode {
	for _, tn := range c.nodes {
		if tn.running() && tn.a().Node().IsLeader() && tn.a().srv.Ready() == nil {
			return tn
		}
	}
	return nil
}

func (c *cluster) waitLeader(timeout time.Duration) *testNode {
	c.t.Helper()
	var l *testNode
	testutil.Eventually(c.t, timeout, func() error {
		if l = c.leader(); l == nil {
			return errors.New("no ready leader")
		}
		return nil
	})
	return l
}

func (c *cluster) followers() []*testNode {
	var out []*testNode
	for _, tn := range c.nodes {
		if tn.running() && !tn.a().Node().IsLeader() {
			out = append(out, tn)
		}
	}
	return out
}

var (
	h2cOnce sync.Once
	h2c     *http.Client
)

func httpClient() *http.Client {
	h2cOnce.Do(func() {
		var p http.Protocols
		p.SetUnencryptedHTTP2(true)
		h2c = &http.Client{Transport: &http.Transport{Protocols: &p}}
	})
	return h2c
}

func (tn *testNode) client(opts ...connect.ClientOption) coordinatorv1connect.CoordinatorServiceClient {
	return coordinatorv1connect.NewCoordinatorServiceClient(httpClient(), "http://"+tn.apiAddr, opts...)
}

func sk(tenant, client string) *commonv1.SessionKey {
	return &commonv1.SessionKey{Tenant: tenant, ClientId: client}
}

// retry calls fn until it succeeds or timeout passes, as a client retrying
// with backoff across leader changes would.
func retry[T any](ctx context.Context, timeout time.Duration, fn func(context.Context) (T, error)) (T, error) {
	deadline := time.Now().Add(timeout)
	backoff := 10 * time.Millisecond
	for {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		v, err := fn(cctx)
		cancel()
		if err == nil || connect.CodeOf(err) == connect.CodeInvalidArgument || connect.CodeOf(err) == connect.CodeFailedPrecondition || time.Now().After(deadline) {
			return v, err
		}
		time.Sleep(backoff)
		backoff = min(backoff*2, 200*time.Millisecond)
	}
}

// join registers an edge and returns a function that keeps renewing its lease
// every TTL/3 until called.
func join(t testing.TB, c coordinatorv1connect.CoordinatorServiceClient, id string, inc uint64, ttl time.Duration) (stop func()) {
	t.Helper()
	return joinReporting(t, c, id, inc, ttl, nil)
}

// joinReporting is join for an edge whose renewals report its custody
// progress (nil: none).
func joinReporting(t testing.TB, c coordinatorv1connect.CoordinatorServiceClient, id string, inc uint64, ttl time.Duration, custody func() uint64) (stop func()) {
	t.Helper()
	renew := func(ctx context.Context) (*connect.Response[coordinatorv1.RenewLeaseResponse], error) {
		req := &coordinatorv1.RenewLeaseRequest{MemberId: id, Role: coordinatorv1.MemberRole_MEMBER_ROLE_EDGE,
			Incarnation: inc, Address: "http://" + id, State: coordinatorv1.MemberState_MEMBER_STATE_ALIVE}
		if custody != nil {
			req.Custody = &coordinatorv1.CustodyProgress{AdoptedThrough: custody()}
		}
		return c.RenewLease(ctx, connect.NewRequest(req))
	}
	_, err := retry(t.Context(), 10*time.Second, renew)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		tk := time.NewTicker(ttl / 3)
		defer tk.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tk.C:
				_, _ = retry(ctx, ttl/3, renew)
			}
		}
	}()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); wg.Wait() }) }
	t.Cleanup(stop)
	return stop
}

func claimOne(ctx context.Context, c coordinatorv1connect.CoordinatorServiceClient, edge string, inc uint64, tenant, client, req string) (*coordinatorv1.SessionGrant, error) {
	resp, err := retry(ctx, 10*time.Second, func(ctx context.Context) (*connect.Response[coordinatorv1.ClaimSessionResponse], error) {
		return c.ClaimSession(ctx, connect.NewRequest(&coordinatorv1.ClaimSessionRequest{RequestId: req, Session: sk(tenant, client),
			EdgeId: edge, Incarnation: inc}))
	})
	if err != nil {
		return nil, fmt.Errorf("claim %s/%s: %w", tenant, client, err)
	}
	return resp.Msg.GetGrant(), nil
}

func getSession(t testing.TB, c coordinatorv1connect.CoordinatorServiceClient, tenant, client string) *coordinatorv1.SessionRecord {
	t.Helper()
	resp, err := retry(t.Context(), 10*time.Second, func(ctx context.Context) (*connect.Response[coordinatorv1.GetSessionResponse], error) {
		return c.GetSession(ctx, connect.NewRequest(&coordinatorv1.GetSessionRequest{Session: sk(tenant, client)}))
	})
	require.NoError(t, err)
	return resp.Msg.GetSession()
}

func newFlagSet() *flag.FlagSet { return flag.NewFlagSet("test", flag.ContinueOnError) }
