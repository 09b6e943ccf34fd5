package app

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	client "github.com/keelmq/keel/libs/outputclient"
	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/output/internal/outputtest"
)

func TestMain(m *testing.M) {
	outputtest.MaybeServePlugin()
	code := m.Run()
	if edgeBuild.dir != "" {
		_ = os.RemoveAll(edgeBuild.dir)
	}
	os.Exit(code)
}

// harness is a running output service.
type harness struct {
	out       *Output
	url       string
	rulesPath string
	pluginDir string
}

// startOutput runs an output service with the given rules (plugins from
// outputtest.PluginDir) and returns it ready; it is stopped at cleanup.
func startOutput(t testing.TB, rulesYAML string) *harness {
	t.Helper()
	return startOutputWith(t, rulesYAML, nil)
}

// startOutputWith is startOutput with the configuration changed by mod.
func startOutputWith(t testing.TB, rulesYAML string, mod func(*Config)) *harness {
	t.Helper()
	dir := t.TempDir()
	h := &harness{rulesPath: filepath.Join(dir, "rules.yaml"), pluginDir: outputtest.PluginDir(t)}
	require.NoError(t, os.WriteFile(h.rulesPath, []byte(rulesYAML), 0o600))
	cfg := Config{
		ListenAddr: "127.0.0.1:0", OpsAddr: "127.0.0.1:0", MemberID: "out-1",
		RulesFile: h.rulesPath, PluginDir: h.pluginDir, PollInterval: 0, CreditBytes: 8 << 20,
		LogLevel: "debug", StopTimeout: 10 * time.Second, DrainTimeout: 3 * time.Second,
	}
	cfg.Pipeline.BackoffMin = 20 * time.Millisecond
	cfg.Pipeline.BackoffMax = 300 * time.Millisecond
	cfg.Pipeline.CallTimeout = 5 * time.Second
	cfg.Pipeline.DrainTimeout = 2 * time.Second
	if mod != nil {
		mod(&cfg)
	}
	out, err := New(cfg, testutil.Logger(t))
	require.NoError(t, err)
	h.out = out
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- out.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("output run: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Errorf("output did not stop")
		}
	})
	testutil.Eventually(t, 20*time.Second, func() error {
		select {
		case err := <-done:
			return errors.Join(errors.New("output exited"), err)
		default:
		}
		if out.Addr() == "" || !out.ops.Ready() {
			return errors.New("not ready")
		}
		return nil
	})
	h.url = "http://" + out.Addr()
	return h
}

// writeRules replaces the rules file in one step, so that a watcher never
// reads it half written.
func (h *harness) writeRules(t testing.TB, y string) {
	t.Helper()
	tmp := h.rulesPath + ".tmp"
	require.NoError(t, os.WriteFile(tmp, []byte(y), 0o600))
	require.NoError(t, os.Rename(tmp, h.rulesPath))
}

// newClient runs an edge-side client against h.
func newClient(t testing.TB, h *harness, mod func(*client.Config)) (*client.Client, *prometheus.Registry) {
	t.Helper()
	cfg := client.Config{URL: h.url, EdgeID: "edge-1", Incarnation: 7, BackoffMin: 20 * time.Millisecond, BackoffMax: 200 * time.Millisecond}
	if mod != nil {
		mod(&cfg)
	}
	reg := prometheus.NewRegistry()
	c, err := client.New(cfg, testutil.Logger(t), reg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return c, reg
}

// waitFilters waits until c uses the filter set h's rules publish.
func waitFilters(t testing.TB, c *client.Client, h *harness) {
	t.Helper()
	want := h.out.Host().Filters().Proto.GetVersion()
	testutil.Eventually(t, 10*time.Second, func() error {
		if v, ok := c.Filters(); !ok || v != want {
			return fmt.Errorf("client filters version %d (ok %v), want %d", v, ok, want)
		}
		return nil
	})
}

// metric sums the samples of a counter or gauge family whose labels include
// every pair in labels.
func metric(t testing.TB, g prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	fams, err := g.Gather()
	require.NoError(t, err)
	var sum float64
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
	next:
		for _, m := range f.GetMetric() {
			have := map[string]string{}
			for _, lp := range m.GetLabel() {
				have[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue next
				}
			}
			switch {
			case m.Counter != nil:
				sum += m.GetCounter().GetValue()
			case m.Gauge != nil:
				sum += m.GetGauge().GetValue()
			case m.Histogram != nil:
				sum += float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return sum
}

// h2cClient is an HTTP client speaking HTTP/2 without TLS, as Connect
// streams to the output service need.
func h2cClient() *http.Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: &http.Transport{Protocols: &p}}
}
