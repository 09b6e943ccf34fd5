package cluster

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
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
