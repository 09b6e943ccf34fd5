package app

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	client "github.com/keelmq/keel/libs/outputclient"
	"github.com/keelmq/keel/libs/testutil"
	outputv1 "github.com/keelmq/keel/proto/gen/keel/output/v1"
	"github.com/keelmq/keel/services/output/internal/outputtest"
	"github.com/keelmq/keel/services/output/internal/sink/httpsink"
)

// httpCollector is an HTTP endpoint for the http sink in batch mode that
// keeps the records it received and counts them by "tenant/topic". Once
// stalled, it holds every request until released.
type httpCollector struct {
	url      string
	mu       sync.Mutex
	got      map[string]int
	records  []httpsink.BatchRecord
	stalled  atomic.Bool
	released chan struct{}
}

func newHTTPCollector(t *testing.T) *httpCollector {
	t.Helper()
	hc := &httpCollector{got: map[string]int{}, released: make(chan struct{})}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if hc.stalled.Load() {
			select {
			case <-hc.released:
			case <-r.Context().Done():
				return
			}
		}
		var b httpsink.BatchBody
		if err := json.Unmarshal(body, &b); err != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		hc.mu.Lock()
		for _, rec := range b.Records {
			hc.got[rec.Tenant+"/"+rec.Topic]++
		}
		hc.records = append(hc.records, b.Records...)
		hc.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(srv.Close)
	hc.url = srv.URL
	return hc
}

// stall holds the requests from now on, until release.
func (hc *httpCollector) stall() { hc.stalled.Store(true) }

// release answers the held requests and holds no more.
func (hc *httpCollector) release() {
	hc.stalled.Store(false)
	close(hc.released)
}

func (hc *httpCollector) count(key string) int {
	hc.mu.Lock()
	defer hc.mu.Unlock()
	return hc.got[key]
}

// received returns the records received so far.
func (hc *httpCollector) received() []httpsink.BatchRecord {
	hc.mu.Lock()
	defer hc.mu.Unlock()
	return slices.Clone(hc.records)
}

func (hc *httpCollector) total() int {
	hc.mu.Lock()
	defer hc.mu.Unlock()
	n := 0
	for _, c := range hc.got {
		n += c
	}
	return n
}

// waitDelivered waits until the collector has n records of tenant/topic.
func (hc *httpCollector) waitDelivered(t *testing.T, key string, n int) {
	t.Helper()
	testutil.Eventually(t, 15*time.Second, func() error {
		if got := hc.count(key); got < n {
			return fmt.Errorf("%s: received %d of %d", key, got, n)
		}
		return nil
	})
}

// filterRules sends acme's messages on the given filters to url; with
// betaToo, a rule of tenant beta sends all of beta's.
func filterRules(url string, betaToo bool, filters ...string) string {
	fs, _ := json.Marshal(filters)
	y := fmt.Sprintf(`
tenants:
  acme:
    rules:
      - name: to-http
        filters: %s
        sink:
          plugin: http
          config: {url: %q, batch: true, max_batch_records: 50, timeout: 5s, backoff_min: 10ms, backoff_max: 50ms}
`, fs, url)
	if betaToo {
		y += fmt.Sprintf(`  beta:
    rules:
      - name: everything
        filters: ["#"]
        sink:
          plugin: http
          config: {url: %q, batch: true, timeout: 5s}
`, url)
	}
	return y
}

// flatFilters lists each entry of f as its tenant followed by its filters.
func flatFilters(f *outputv1.RuleFilters) [][]string {
	var out [][]string
	for _, tf := range f.GetTenants() {
		out = append(out, append([]string{tf.GetTenant()}, tf.GetFilters()...))
	}
	return out
}

// TestOutput_Filters_OnlyMatchingSent runs an edge-side client against an
// output service whose rule sends acme's sensors/# to an HTTP endpoint. The
// client gets the rules' filters on its stream: matching messages reach the
// endpoint, the others are never sent (the output service receives none,
// the client counts them as skipped). Rewriting the rules file adds a
// filter and a tenant: the watcher reloads it, the new filters reach the
// client on the open stream, and messages on them flow from then on. A
// reload that changes no filter sends no new set.
func TestOutput_Filters_OnlyMatchingSent(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	t.Parallel()
	hc := newHTTPCollector(t)
	h := startOutputWith(t, filterRules(hc.url, false, "sensors/#"), func(c *Config) { c.PollInterval = 50 * time.Millisecond })
	c, creg := newClient(t, h, nil)
	waitFilters(t, c, h)
	v1 := h.out.Host().Filters().Proto
	require.Equal(t, [][]string{{"acme", "sensors/#"}}, flatFilters(v1))

	const n = 30
	seq := uint64(0)
	offer := func(tenant, topic string) {
		t.Helper()
		seq++
		require.True(t, c.OfferMessage(outputtest.Message(tenant, topic, seq, []byte(`{}`))))
	}
	nonMatching := [][2]string{{"acme", "alerts/fire"}, {"acme", "other/x"}, {"beta", "sensors/1"}, {"acme", "$SYS/sensors"}}
	for i := range n {
		offer("acme", "sensors/1")
		offer(nonMatching[i%len(nonMatching)][0], nonMatching[i%len(nonMatching)][1])
	}
	hc.waitDelivered(t, "acme/sensors/1", n)
	reg := h.out.Registry()
	require.Zero(t, metric(t, reg, "keel_output_unmatched_total", nil), "a message no rule matches reached the output service")
	require.Equal(t, float64(n), metric(t, reg, "keel_output_records_in_total", nil))
	require.Equal(t, float64(n), metric(t, creg, "keel_edge_output_sent_total", nil))
	require.Equal(t, float64(n), metric(t, creg, "keel_edge_output_skipped_total", nil))
	require.Equal(t, n, hc.total())
	st := c.Stats()
	require.Equal(t, uint64(2*n), st.Offered)
	require.Equal(t, uint64(n), st.Skipped)

	// Add a filter for acme and a rule for beta by rewriting the file.
	h.writeRules(t, filterRules(hc.url, true, "sensors/#", "alerts/+"))
	testutil.Eventually(t, 10*time.Second, func() error {
		if v, _ := c.Filters(); v <= v1.GetVersion() {
			return fmt.Errorf("client still on filters version %d", v)
		}
		return nil
	})
	v2 := h.out.Host().Filters().Proto
	require.Equal(t, v1.GetVersion()+1, v2.GetVersion())
	require.Equal(t, [][]string{{"acme", "alerts/+", "sensors/#"}, {"beta", "#"}}, flatFilters(v2))
	skipped := c.Stats().Skipped
	offer("acme", "alerts/fire")
	offer("beta", "sensors/1")
	offer("acme", "other/x")
	hc.waitDelivered(t, "acme/alerts/fire", 1)
	hc.waitDelivered(t, "beta/sensors/1", 1)
	require.Equal(t, skipped+1, c.Stats().Skipped, "acme other/x is still matched by no rule")
	require.Zero(t, metric(t, reg, "keel_output_unmatched_total", nil))

	// A change that leaves the filters as they are sends no new set.
	reloads := metric(t, reg, "keel_output_rules_reloads_total", map[string]string{"result": "ok"})
	h.writeRules(t, filterRules(hc.url, true, "alerts/+", "sensors/#", "sensors/#"))
	require.NoError(t, h.out.Reload(t.Context(), false))
	require.Equal(t, reloads+1, metric(t, reg, "keel_output_rules_reloads_total", map[string]string{"result": "ok"}))
	require.Same(t, v2, h.out.Host().Filters().Proto)
	v, _ := c.Filters()
	require.Equal(t, v2.GetVersion(), v)
}

// TestOutput_Filters_EverythingBeforeFirstSet offers messages to a client
// that has not received the rules' filters yet: every one is queued and
// sent, and the output service drops those no rule matches, as it did
// before edges filtered. Once the set has arrived, such messages are left
// out on the edge.
func TestOutput_Filters_EverythingBeforeFirstSet(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	t.Parallel()
	hc := newHTTPCollector(t)
	h := startOutput(t, filterRules(hc.url, false, "sensors/#"))
	reg := prometheus.NewRegistry()
	c, err := client.New(client.Config{URL: h.url, EdgeID: "edge-1", Incarnation: 7, BackoffMin: 20 * time.Millisecond},
		testutil.Logger(t), reg)
	require.NoError(t, err)

	const n = 10
	for i := range n {
		require.True(t, c.OfferMessage(outputtest.Message("acme", "sensors/1", uint64(2*i+1), []byte(`{}`))))
		require.True(t, c.OfferMessage(outputtest.Message("acme", "other/1", uint64(2*i+2), []byte(`{}`))))
	}
	_, ok := c.Filters()
	require.False(t, ok)
	require.Equal(t, 2*n, c.QueueLen(), "without filters every message is queued")
	require.Zero(t, c.Stats().Skipped)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	hc.waitDelivered(t, "acme/sensors/1", n)
	testutil.Eventually(t, 10*time.Second, func() error {
		if u := metric(t, h.out.Registry(), "keel_output_unmatched_total", nil); u != n {
			return fmt.Errorf("output service received %v unmatched records, want %d", u, n)
		}
		return nil
	})
	require.Equal(t, float64(2*n), metric(t, reg, "keel_edge_output_sent_total", nil))

	waitFilters(t, c, h)
	for i := range n {
		require.True(t, c.OfferMessage(outputtest.Message("acme", "other/1", uint64(100+i), []byte(`{}`))))
	}
	require.True(t, c.OfferMessage(outputtest.Message("acme", "sensors/1", 200, []byte(`{}`))))
	hc.waitDelivered(t, "acme/sensors/1", n+1)
	require.Equal(t, uint64(n), c.Stats().Skipped)
	require.Equal(t, float64(n), metric(t, h.out.Registry(), "keel_output_unmatched_total", nil))
	require.Equal(t, float64(2*n+1), metric(t, reg, "keel_edge_output_sent_total", nil))
	require.Zero(t, hc.count("acme/other/1"), "unmatched records never reach the sink")
}
