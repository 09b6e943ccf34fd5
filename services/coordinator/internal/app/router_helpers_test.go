package app

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/routerclient"
	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/libs/testutil"

	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
	"github.com/keelmq/keel/proto/gen/keel/router/v1/routerv1connect"
)

// The router is another module whose internal packages this one cannot
// import, so tests run the real keel-router binary, built once per test
// binary into binDir.
var (
	binOnce sync.Once
	binDir  string
	binPath string
	binErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if binDir != "" {
		_ = os.RemoveAll(binDir)
	}
	os.Exit(code)
}

func routerBin(t testing.TB) string {
	t.Helper()
	binOnce.Do(func() {
		root, err := testutil.RepoRoot()
		if err != nil {
			binErr = err
			return
		}
		if binDir, binErr = os.MkdirTemp("", "keel-coordinator-test-bin"); binErr != nil {
			return
		}
		binPath = filepath.Join(binDir, "keel-router")
		cmd := exec.Command("go", "build", "-o", binPath, "./services/router/cmd/keel-router")
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			binErr = fmt.Errorf("build keel-router: %w: %s", err, out)
		}
	})
	require.NoError(t, binErr)
	return binPath
}

var (
	lowPortsMu sync.Mutex
	lowPorts   = map[int]bool{} // handed out by this process; guarded by lowPortsMu
)

// lowPort returns a port below Linux's ephemeral range (32768 and up) that
// was free for TCP and UDP on 127.0.0.1 (memberlist needs both). A child
// process binds it only later; a port from the ephemeral range could be
// taken meanwhile as the source port of any outgoing connection.
func lowPort(t testing.TB) int {
	t.Helper()
	lowPortsMu.Lock()
	defer lowPortsMu.Unlock()
	for range 500 {
		p := 20000 + rand.IntN(32768-20000)
		if lowPorts[p] {
			continue
		}
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(p))
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			continue
		}
		pc, err := net.ListenPacket("udp", addr)
		_ = ln.Close()
		if err != nil {
			continue
		}
		_ = pc.Close()
		lowPorts[p] = true
		return p
	}
	t.Fatal("no free port below 32768")
	return 0
}

func lowAddr(t testing.TB) string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(lowPort(t)))
}

// routerProc is a keel-router process in single-node mode.
type routerProc struct {
	url string // API base URL
	ops string // ops address (/metrics, /readyz)
}

// startRouter runs keel-router on loopback until the test ends and waits
// for its /readyz. A start that exits early (a port taken between choosing
// and binding it) is retried on fresh ports.
func startRouter(t *testing.T) *routerProc {
	t.Helper()
	bin := routerBin(t)
	for attempt := 1; ; attempt++ {
		p, err := tryStartRouter(t, bin)
		if err == nil {
			return p
		}
		if attempt == 3 {
			t.Fatalf("router did not start: %v", err)
		}
		t.Logf("router start attempt %d: %v", attempt, err)
	}
}

func tryStartRouter(t *testing.T, bin string) (*routerProc, error) {
	api, ops := lowAddr(t), lowAddr(t)
	// The edges register after the router starts, so its new table has
	// nobody to wait for (router.rebuild-wait).
	cmd := exec.Command(bin, "--api.addr", api, "--ops.addr", ops, "--olric.single-node", "--router.rebuild-wait", "200ms",
		"--olric.bind-addr", "127.0.0.1", "--olric.port", strconv.Itoa(lowPort(t)),
		"--olric.memberlist-port", strconv.Itoa(lowPort(t)), "--log.level", "info")
	var logs strings.Builder // read only after Wait: the copying goroutine writes it until then
	cmd.Stdout, cmd.Stderr = &logs, &logs
	dieWithParent(cmd)
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stop := func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(20 * time.Second):
			t.Logf("router did not stop within 20s of SIGTERM; killed")
			_ = cmd.Process.Kill()
			<-exited
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		select {
		case err := <-exited:
			return nil, fmt.Errorf("router exited before ready (%v): %s", err, logs.String())
		case <-time.After(50 * time.Millisecond):
		}
		resp, err := http.Get("http://" + ops + "/readyz")
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(deadline) {
			stop()
			return nil, fmt.Errorf("router not ready within 30s: %s", logs.String())
		}
	}
	t.Cleanup(func() {
		stop()
		if t.Failed() {
			t.Logf("router logs:\n%s", logs.String())
		}
	})
	return &routerProc{url: "http://" + api, ops: ops}, nil
}

func (r *routerProc) api() routerv1connect.RouterServiceClient {
	return routerv1connect.NewRouterServiceClient(rpc.H2CClient(), r.url, connect.WithGRPC())
}

// lookup returns the edges the router names for a publish on (tenant, topic).
func (r *routerProc) lookup(ctx context.Context, tenant, topic string) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	resp, err := r.api().Lookup(ctx, connect.NewRequest(&routerv1.LookupRequest{Tenant: tenant, Topic: topic}))
	if err != nil {
		return nil, err
	}
	return resp.Msg.GetEdgeIds(), nil
}

// mustLookup is lookup retried while the router refuses (e.g. its table is
// still waiting for edges after start).
func (r *routerProc) mustLookup(t *testing.T, tenant, topic string) []string {
	t.Helper()
	var edges []string
	testutil.Eventually(t, 10*time.Second, func() (err error) {
		edges, err = r.lookup(t.Context(), tenant, topic)
		return err
	})
	return edges
}

// metric returns the value of one sample of the router's /metrics, 0 if
// absent; sample is the name with its labels as exposed, e.g.
// `x_total{kind="a",op="b"}`.
func (r *routerProc) metric(t *testing.T, sample string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + r.ops + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), sample+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			require.NoError(t, err)
			return f
		}
	}
	require.NoError(t, sc.Err())
	return 0
}

// edgeRoutes runs the router client of an edge that exists only as far as
// the router and the coordinator are concerned: the routes it registers are
// what a real edge registers for its subscribers. stop ends its RouteSync
// stream as the death of the edge's process would; its routes stay behind.
func edgeRoutes(t *testing.T, r *routerProc, id string, inc uint64) (c *routerclient.Client, stop func()) {
	t.Helper()
	c, err := routerclient.New(routerclient.Config{URL: r.url, EdgeID: id, Incarnation: inc, HTTPClient: rpc.H2CClient(),
		Logger: testutil.Logger(t).With("edge", id, "incarnation", inc)})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	testutil.Eventually(t, 10*time.Second, func() error {
		if !c.Ready() {
			return errors.New("router client not ready")
		}
		return nil
	})
	return c, stop
}

func subscribe(t *testing.T, c *routerclient.Client, tenant string, filters ...string) {
	t.Helper()
	for _, f := range filters {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		require.NoError(t, c.Subscribe(ctx, tenant, f), "subscribe %s", f)
		cancel()
	}
}

// counter returns the value of a counter of reg whose only label has the
// given value (empty: an unlabelled counter), 0 if absent.
func counter(t *testing.T, reg *prometheus.Registry, name, label string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if label == "" && len(m.GetLabel()) == 0 || len(m.GetLabel()) == 1 && m.GetLabel()[0].GetValue() == label {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

// gauge returns the value of an unlabelled gauge of reg, 0 if absent.
func gauge(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) == 1 {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	return 0
}
