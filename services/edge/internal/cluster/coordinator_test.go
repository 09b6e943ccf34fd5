package cluster

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/libs/testutil"
	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	"github.com/keelmq/keel/proto/gen/keel/coordinator/v1/coordinatorv1connect"
	"github.com/keelmq/keel/services/edge/internal/broker"
)

// startCoordinator builds and runs a single-node keel-coordinator with the
// given lease TTL (and extra flags) and returns its API URL and process.
func startCoordinator(t *testing.T, ttl time.Duration, extra ...string) (string, *os.Process) {
	t.Helper()
	if testing.Short() {
		t.Skip("starts a coordinator process; skipped under -short")
	}
	bin := testutil.Build(t, t.TempDir(), "./services/coordinator/cmd/keel-coordinator")
	api, ops := testutil.FreeAddr(t), testutil.FreeAddr(t)
	cmd := exec.Command(bin, "--api.addr", api, "--ops.addr", ops, "--raft.bind-addr", testutil.FreeAddr(t),
		"--gossip.bind-addr", testutil.FreeAddr(t), "--raft.bootstrap-expect", "1", "--raft.node-id", "c1",
		"--raft.data-dir", t.TempDir(), "--lease-ttl", ttl.String(), "--log.level", "warn")
	cmd.Args = withTestLogLevel(append(cmd.Args, extra...))
	var logs strings.Builder
	cmd.Stdout, cmd.Stderr = &logs, &logs
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("coordinator logs:\n%s", logs.String())
		}
	})
	testutil.Eventually(t, 30*time.Second, func() error {
		resp, err := http.Get("http://" + ops + "/readyz")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("readyz %d", resp.StatusCode)
		}
		return nil
	})
	return "http://" + api, cmd.Process
}

// joinedEdgeA starts a coordinator (lease TTL 10 s) and joins edge-a to it.
func joinedEdgeA(t *testing.T) *Member {
	t.Helper()
	url, _ := startCoordinator(t, 10*time.Second)
	m := &Member{Client: NewClient(url), ID: "edge-a", Address: "127.0.0.1:1883", Logger: testutil.Logger(t)}
	require.NoError(t, m.Join(t.Context()))
	return m
}

// Claims against a real coordinator: epochs grow per session, the previous
// owner is reported, and a burst of concurrent claims goes out in batches.
func TestOwnership_Claims(t *testing.T) {
	t.Parallel()
	m := joinedEdgeA(t)
	c := m.Client
	o := &Ownership{Client: c, Member: m, MaxBatch: 64, Linger: time.Millisecond}

	g1, err := o.Claim(t.Context(), "acme", "dev-1")
	require.NoError(t, err)
	require.Empty(t, g1.Previous)
	g2, err := o.Claim(t.Context(), "acme", "dev-1")
	require.NoError(t, err)
	require.Greater(t, g2.Epoch, g1.Epoch, "the epoch of a session only grows")
	require.Equal(t, "edge-a", g2.Previous)

	// Another edge takes the session; claiming it again (as after a lost
	// answer), it is told whom it took the session from, and the epoch of
	// its own claim before (a copy it holds under an older one is not that
	// claim's).
	mb := &Member{Client: c, ID: "edge-b", Address: "127.0.0.1:1884", Logger: testutil.Logger(t)}
	require.NoError(t, mb.Join(t.Context()))
	ob := &Ownership{Client: c, Member: mb, MaxBatch: 64, Linger: time.Millisecond}
	g3, err := ob.Claim(t.Context(), "acme", "dev-1")
	require.NoError(t, err)
	require.Equal(t, "edge-a", g3.Previous)
	g4, err := ob.Claim(t.Context(), "acme", "dev-1")
	require.NoError(t, err)
	require.Equal(t, broker.Grant{Epoch: g4.Epoch, Previous: "edge-b", PreviousEpoch: g3.Epoch, TakenFrom: "edge-a"}, g4)

	var wg sync.WaitGroup
	epochs := make([]uint64, 300)
	for i := range epochs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			g, err := o.Claim(t.Context(), "acme", fmt.Sprintf("storm-%d", i))
			if err != nil {
				t.Errorf("claim %d: %v", i, err)
			}
			epochs[i] = g.Epoch
		}()
	}
	wg.Wait()
	for i, e := range epochs {
		require.Positive(t, e, "claim %d", i)
	}
}

// An edge that cannot renew fences itself once its lease runs out, and
// rejoins with a higher incarnation when the coordinator answers again.
func TestMember_FencesAndRejoins(t *testing.T) {
	t.Parallel()
	url, proc := startCoordinator(t, time.Second)
	var fenced, joined atomic.Int32
	var lastInc atomic.Uint64
	m := &Member{Client: NewClient(url), ID: "edge-b", Logger: testutil.Logger(t), Margin: 100 * time.Millisecond,
		OnFence: func() { fenced.Add(1) },
		OnJoin:  func(inc uint64) { joined.Add(1); lastInc.Store(inc) }}
	require.NoError(t, m.Join(t.Context()))
	first := m.Incarnation()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	go func() { _ = m.Run(ctx) }()

	time.Sleep(1500 * time.Millisecond)
	require.Zero(t, fenced.Load(), "renewals keep the lease")
	require.True(t, m.Valid())

	require.NoError(t, proc.Signal(syscall.SIGSTOP)) // the coordinator hangs
	testutil.Eventually(t, 5*time.Second, func() error {
		if fenced.Load() == 0 {
			return fmt.Errorf("not fenced yet")
		}
		return nil
	})
	require.False(t, m.Valid())
	o := &Ownership{Client: m.Client, Member: m, MaxBatch: 1}
	_, err := o.Claim(t.Context(), "acme", "x")
	require.ErrorIs(t, err, ErrFenced, "a fenced edge claims nothing")

	require.NoError(t, proc.Signal(syscall.SIGCONT))
	testutil.Eventually(t, 15*time.Second, func() error {
		if joined.Load() < 2 {
			return fmt.Errorf("not rejoined yet")
		}
		return nil
	})
	require.Greater(t, lastInc.Load(), first, "rejoins with a new incarnation")
	require.True(t, m.Valid())
}

// An edge's calls to the coordinator share one connection however many
// run at once (a connect storm's claims, and the releases when its clients
// go), and its lease outlives that connection going silent: the next
// renewals go on a new one before the lease runs out. Over HTTP/1.1 the
// storm opened a connection per call; with the HTTP/2 client's usual
// pings the silent connection held every renewal for 15 s, past the lease.
func TestClient_OneConnectionAndALeaseThatOutlivesItsSilence(t *testing.T) {
	t.Parallel()
	coordURL, _ := startCoordinator(t, 10*time.Second)
	proxy := testutil.NewProxy(t, strings.TrimPrefix(coordURL, "http://"))
	var fenced atomic.Int32
	m := &Member{Client: NewClient("http://" + proxy.Addr()), ID: "edge-storm", Address: "127.0.0.1:1883",
		Logger: testutil.Logger(t), Margin: time.Second, OnFence: func() { fenced.Add(1) }}
	require.NoError(t, m.Join(t.Context()))
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	go func() { _ = m.Run(ctx) }()

	counted := &countingReleases{CoordinatorServiceClient: m.Client}
	o := &Ownership{Client: counted, Member: m, MaxBatch: 256, Linger: time.Millisecond}
	const clients = 1000
	grants := make([]broker.Grant, clients)
	var wg sync.WaitGroup
	for i := range clients {
		wg.Go(func() {
			g, err := o.Claim(t.Context(), "acme", fmt.Sprintf("storm-%d", i))
			if err != nil {
				t.Errorf("claim %d: %v", i, err)
			}
			grants[i] = g
		})
	}
	wg.Wait()
	for i := range clients {
		wg.Go(func() {
			if err := o.Release(t.Context(), "acme", fmt.Sprintf("storm-%d", i), grants[i].Epoch); err != nil {
				t.Errorf("release %d: %v", i, err)
			}
		})
	}
	wg.Wait()
	require.Equal(t, 1, proxy.Accepted(), "the lease, the claims and the releases on one connection")
	require.Zero(t, counted.alone.Load(), "no release in a call of its own")
	require.LessOrEqual(t, counted.batches.Load(), int32(clients/8), "releases in few calls")
	t.Logf("%d releases in %d calls", clients, counted.batches.Load())
	for _, i := range []int{0, clients / 2, clients - 1} {
		owner, _, err := o.Owner(t.Context(), "acme", fmt.Sprintf("storm-%d", i))
		require.NoError(t, err)
		require.Empty(t, owner, "storm-%d released", i)
	}

	proxy.Stall()
	// Longer than a lease (10 s, less the margin): renewals kept it.
	for end := time.Now().Add(12 * time.Second); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		require.Zero(t, fenced.Load(), "the lease lapsed")
		require.True(t, m.Valid())
	}
	require.Greater(t, proxy.Accepted(), 1, "renewed on a new connection")
}

// countingReleases counts the release calls made through it.
type countingReleases struct {
	coordinatorv1connect.CoordinatorServiceClient
	alone, batches atomic.Int32
}

func (c *countingReleases) ReleaseSession(ctx context.Context, req *connect.Request[coordinatorv1.ReleaseSessionRequest]) (*connect.Response[coordinatorv1.ReleaseSessionResponse], error) {
	c.alone.Add(1)
	return c.CoordinatorServiceClient.ReleaseSession(ctx, req)
}

func (c *countingReleases) ReleaseSessions(ctx context.Context, req *connect.Request[coordinatorv1.ReleaseSessionsRequest]) (*connect.Response[coordinatorv1.ReleaseSessionsResponse], error) {
	c.batches.Add(1)
	return c.CoordinatorServiceClient.ReleaseSessions(ctx, req)
}

// failingRenewal fails the renewal numbered fail (counting from the join's,
// 1) without sending it, and notes when each was made.
type failingRenewal struct {
	coordinatorv1connect.CoordinatorServiceClient
	fail int
	mu   sync.Mutex
	at   []time.Time
}

func (f *failingRenewal) RenewLease(ctx context.Context, req *connect.Request[coordinatorv1.RenewLeaseRequest]) (*connect.Response[coordinatorv1.RenewLeaseResponse], error) {
	f.mu.Lock()
	f.at = append(f.at, time.Now())
	n := len(f.at)
	f.mu.Unlock()
	if n == f.fail {
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("renewal lost"))
	}
	return f.CoordinatorServiceClient.RenewLease(ctx, req)
}

func (f *failingRenewal) times() []time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.at)
}

// A failed renewal is made again within retryRenewal, not a third of a
// lease later: one lost to a dead connection, with the next due only
// after a whole interval, left the lease less than a second.
func TestMember_RetriesAFailedRenewalSoon(t *testing.T) {
	t.Parallel()
	url, _ := startCoordinator(t, 6*time.Second) // renewals every 2 s
	client := &failingRenewal{CoordinatorServiceClient: NewClient(url), fail: 2}
	m := &Member{Client: client, ID: "edge-retry", Logger: testutil.Logger(t), Margin: time.Second}
	require.NoError(t, m.Join(t.Context()))
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	go func() { _ = m.Run(ctx) }()
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := len(client.times()); n < 3 {
			return fmt.Errorf("%d renewals", n)
		}
		return nil
	})
	at := client.times()
	require.Less(t, at[2].Sub(at[1]), retryRenewal+500*time.Millisecond, "the failed renewal made again soon")
	require.True(t, m.Valid())
}

// serveCoordinator serves h over h2c, as a coordinator serves, and returns
// its URL.
func serveCoordinator(t *testing.T, h coordinatorv1connect.CoordinatorServiceHandler) string {
	t.Helper()
	mux := http.NewServeMux()
	mux.Handle(coordinatorv1connect.NewCoordinatorServiceHandler(h))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = rpc.ServerProtocols()
	srv.Start()
	t.Cleanup(srv.Close)
	return srv.URL
}

// hungRenewals is a coordinator whose second renewal hangs until its
// caller gives up, while its connection answers as a live one does: a
// follower cut off from its leader.
type hungRenewals struct {
	coordinatorv1connect.UnimplementedCoordinatorServiceHandler
	calls atomic.Int32
}

func (h *hungRenewals) RenewLease(ctx context.Context, _ *connect.Request[coordinatorv1.RenewLeaseRequest]) (*connect.Response[coordinatorv1.RenewLeaseResponse], error) {
	if h.calls.Add(1) == 2 {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return connect.NewResponse(&coordinatorv1.RenewLeaseResponse{}), nil
}

// A renewal that timed out leaves its connection: the next goes on a new
// one (behind a Service address, perhaps to another coordinator), even
// though the old one still answers pings.
func TestClient_RenewsOnANewConnectionAfterATimeout(t *testing.T) {
	t.Parallel()
	proxy := testutil.NewProxy(t, strings.TrimPrefix(serveCoordinator(t, &hungRenewals{}), "http://"))
	c := NewClient("http://" + proxy.Addr())

	renew := func(timeout time.Duration) error {
		ctx, cancel := context.WithTimeout(t.Context(), timeout)
		defer cancel()
		_, err := c.RenewLease(ctx, connect.NewRequest(&coordinatorv1.RenewLeaseRequest{}))
		return err
	}
	require.NoError(t, renew(5*time.Second))
	require.Equal(t, connect.CodeDeadlineExceeded, connect.CodeOf(renew(300*time.Millisecond)))
	require.NoError(t, renew(5*time.Second))
	require.Equal(t, 2, proxy.Accepted(), "the renewal after the failed one on a new connection")
}

// unavailableReleases answers the first release call as a coordinator
// without a leader does, and records the request IDs it saw, and the
// calls. Without batches, it is a coordinator older than ReleaseSessions.
type unavailableReleases struct {
	coordinatorv1connect.UnimplementedCoordinatorServiceHandler
	noBatches bool
	mu        sync.Mutex
	ids       []string
	calls     int
	refuse    string // a client whose release is refused as stale
}

func (u *unavailableReleases) ReleaseSession(_ context.Context, req *connect.Request[coordinatorv1.ReleaseSessionRequest]) (*connect.Response[coordinatorv1.ReleaseSessionResponse], error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.calls++
	u.ids = append(u.ids, req.Msg.GetRequestId())
	if u.calls == 1 {
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("no leader"))
	}
	if req.Msg.GetSession().GetClientId() == u.refuse {
		return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("claimed again"))
	}
	return connect.NewResponse(&coordinatorv1.ReleaseSessionResponse{Released: true}), nil
}

func (u *unavailableReleases) ReleaseSessions(_ context.Context, req *connect.Request[coordinatorv1.ReleaseSessionsRequest]) (*connect.Response[coordinatorv1.ReleaseSessionsResponse], error) {
	if u.noBatches {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("no ReleaseSessions"))
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	u.calls++
	resp := &coordinatorv1.ReleaseSessionsResponse{}
	for _, r := range req.Msg.GetReleases() {
		u.ids = append(u.ids, r.GetRequestId())
		res := &coordinatorv1.ReleaseResult{Released: true}
		if r.GetSession().GetClientId() == u.refuse {
			res = &coordinatorv1.ReleaseResult{Error: &coordinatorv1.ReleaseError{
				Code: coordinatorv1.ReleaseErrorCode_RELEASE_ERROR_CODE_STALE_EPOCH, Message: "claimed again"}}
		}
		resp.Results = append(resp.Results, res)
	}
	if u.calls == 1 {
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("no leader"))
	}
	return connect.NewResponse(resp), nil
}

// A release the coordinator could not take is sent again, under the same
// request ID (applied once): a lost one leaves the session's record naming
// this edge. A refused one is an error for its caller alone. A coordinator
// older than ReleaseSessions gets each release in a call of its own.
func TestOwnership_RetriesAReleaseWhileTheCoordinatorIsUnavailable(t *testing.T) {
	t.Parallel()
	for _, noBatches := range []bool{false, true} {
		t.Run(fmt.Sprintf("batches=%v", !noBatches), func(t *testing.T) {
			t.Parallel()
			coord := &unavailableReleases{noBatches: noBatches, refuse: "dev-stale"}
			o := &Ownership{Client: NewClient(serveCoordinator(t, coord)), Member: &Member{ID: "edge-a"},
				MaxBatch: 2, Linger: time.Second} // both in one call: it goes once full
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			var stale error
			var wg sync.WaitGroup
			wg.Go(func() { stale = o.Release(ctx, "acme", "dev-stale", 7) })
			require.NoError(t, o.Release(ctx, "acme", "dev-1", 7))
			wg.Wait()
			require.ErrorContains(t, stale, "claimed again")
			coord.mu.Lock()
			defer coord.mu.Unlock()
			if noBatches {
				require.Equal(t, 3, coord.calls, "the release refused unavailable again, the other once")
				seen := map[string]int{}
				for _, id := range coord.ids {
					seen[id]++
				}
				require.Len(t, seen, 2, "two releases, one sent again under the same request ID")
				require.Equal(t, 2, seen[coord.ids[0]], "the first release, refused unavailable, again")
				return
			}
			require.Equal(t, 2, coord.calls, "one call of both, sent again")
			require.Len(t, coord.ids, 4)
			require.Equal(t, coord.ids[:2], coord.ids[2:], "the same requests again")
		})
	}
}
