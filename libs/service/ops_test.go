package service

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
)

// startOps starts an Ops on a free loopback port and stops it at cleanup.
func startOps(t *testing.T, reg *prometheus.Registry, configure func(*Ops)) *Ops {
	t.Helper()
	o := NewOps("127.0.0.1:0", reg, testutil.Logger(t))
	if configure != nil {
		configure(o)
	}
	require.NoError(t, o.Start())
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		require.NoError(t, o.Stop(ctx))
	})
	return o
}

// testClient does not keep connections alive. With keep-alives, parallel
// requests to one server can make the transport dial a spare connection that
// never sends a request, and http.Server.Shutdown waits up to 5s for such a
// connection, failing the cleanup's Stop.
var testClient = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, url, nil)
	require.NoError(t, err)
	resp, err := testClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

func TestNewRegistry(t *testing.T) {
	t.Parallel()
	mfs, err := NewRegistry().Gather()
	require.NoError(t, err)
	names := map[string]bool{}
	for _, mf := range mfs {
		names[mf.GetName()] = true
	}
	require.True(t, names["go_goroutines"], "go collector")
	if runtime.GOOS == "linux" {
		require.True(t, names["process_cpu_seconds_total"], "process collector")
	}
}

func TestOps_Endpoints(t *testing.T) {
	t.Parallel()
	reg := NewRegistry()
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "keel_test_things_total", Help: "Things."})
	reg.MustRegister(c)
	c.Add(3)

	o := startOps(t, reg, func(o *Ops) {
		o.Handle("/extra", http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			_, _ = io.WriteString(w, "extra")
		}))
	})
	base := "http://" + o.Addr()
	require.NotEqual(t, "127.0.0.1:0", o.Addr())

	for _, tc := range []struct {
		name     string
		path     string
		code     int
		contains string
	}{
		{"metrics_custom", "/metrics", 200, "keel_test_things_total 3"},
		{"metrics_go", "/metrics", 200, "go_goroutines"},
		{"healthz", "/healthz", 200, "ok"},
		{"readyz_not_ready", "/readyz", 503, "ready: service not marked ready"},
		{"extra_handler", "/extra", 200, "extra"},
		{"pprof_off", "/debug/pprof/", 404, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			code, body := get(t, base+tc.path)
			require.Equal(t, tc.code, code, body)
			require.Contains(t, body, tc.contains)
		})
	}
}

func TestOps_Readyz(t *testing.T) {
	t.Parallel()
	errDown := errors.New("redis down")
	for _, tc := range []struct {
		name     string
		ready    bool
		checks   map[string]error
		code     int
		contains []string
		excludes []string
	}{
		{name: "not_marked", ready: false, code: 503, contains: []string{"ready:"}},
		{name: "marked_no_checks", ready: true, code: 200, contains: []string{"ok"}},
		{name: "marked_checks_pass", ready: true, checks: map[string]error{"redis": nil, "raft": nil}, code: 200},
		{
			name: "one_check_fails", ready: true,
			checks:   map[string]error{"redis": errDown, "raft": nil},
			code:     503,
			contains: []string{"redis: redis down"},
			excludes: []string{"raft", "ready:"},
		},
		{
			name: "not_marked_and_failing", ready: false,
			checks:   map[string]error{"redis": errDown, "raft": errors.New("no leader")},
			code:     503,
			contains: []string{"ready:", "redis: redis down", "raft: no leader"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			o := NewOps("", nil, testutil.Logger(t))
			for name, err := range tc.checks {
				o.AddReadyCheck(name, func() error { return err })
			}
			o.SetReady(tc.ready)
			require.Equal(t, tc.ready, o.Ready())

			rec := httptest.NewRecorder()
			o.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
			require.Equal(t, tc.code, rec.Code, rec.Body.String())
			for _, s := range tc.contains {
				require.Contains(t, rec.Body.String(), s)
			}
			for _, s := range tc.excludes {
				require.NotContains(t, rec.Body.String(), s)
			}
		})
	}
}

func TestOps_ReadyzToggles(t *testing.T) {
	t.Parallel()
	o := startOps(t, nil, nil)
	url := "http://" + o.Addr() + "/readyz"

	code, _ := get(t, url)
	require.Equal(t, 503, code)
	o.SetReady(true)
	code, _ = get(t, url)
	require.Equal(t, 200, code)
	o.SetReady(false)
	code, _ = get(t, url)
	require.Equal(t, 503, code)

	// No registry: no /metrics.
	code, _ = get(t, "http://"+o.Addr()+"/metrics")
	require.Equal(t, 404, code)
}

func TestOps_Pprof(t *testing.T) {
	t.Parallel()
	o := startOps(t, nil, func(o *Ops) { o.EnablePprof = true })
	for _, path := range []string{"/debug/pprof/", "/debug/pprof/cmdline", "/debug/pprof/goroutine?debug=1"} {
		code, body := get(t, "http://"+o.Addr()+path)
		require.Equal(t, 200, code, path)
		require.NotEmpty(t, body, path)
	}
}

func TestOps_Disabled(t *testing.T) {
	t.Parallel()
	o := NewOps("", NewRegistry(), nil)
	require.NoError(t, o.Start())
	require.Empty(t, o.Addr())
	require.NoError(t, o.Stop(t.Context()))
	require.NoError(t, o.Stop(t.Context()))
}

func TestOps_StartStop(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		run  func(t *testing.T, o *Ops)
	}{
		{"stop_before_start", func(t *testing.T, o *Ops) {
			require.NoError(t, o.Stop(t.Context()))
		}},
		{"start_twice", func(t *testing.T, o *Ops) {
			require.NoError(t, o.Start())
			require.ErrorIs(t, o.Start(), ErrAlreadyStarted)
			require.NoError(t, o.Stop(t.Context()))
		}},
		{"stop_twice", func(t *testing.T, o *Ops) {
			require.NoError(t, o.Start())
			addr := o.Addr()
			require.NoError(t, o.Stop(t.Context()))
			require.NoError(t, o.Stop(t.Context()))
			_, err := testClient.Get("http://" + addr + "/healthz") //nolint:noctx // closed port
			require.Error(t, err)
		}},
		{"concurrent_stop", func(t *testing.T, o *Ops) {
			require.NoError(t, o.Start())
			errs := make(chan error, 3)
			for range 3 {
				go func() { errs <- o.Stop(t.Context()) }()
			}
			for range 3 {
				require.NoError(t, <-errs)
			}
		}},
		{"stop_deadline_closes_hard", func(t *testing.T, o *Ops) {
			hold := make(chan struct{})
			entered := make(chan struct{})
			o.Handle("/slow", http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
				close(entered)
				<-hold
			}))
			require.NoError(t, o.Start())
			go func() {
				resp, err := testClient.Get("http://" + o.Addr() + "/slow") //nolint:noctx // torn down by Stop
				if err == nil {
					resp.Body.Close()
				}
			}()
			<-entered
			ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
			defer cancel()
			err := o.Stop(ctx)
			close(hold)
			require.ErrorIs(t, err, context.DeadlineExceeded)
			require.ErrorIs(t, o.Stop(t.Context()), context.DeadlineExceeded, "later calls return the first result")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.run(t, NewOps("127.0.0.1:0", nil, testutil.Logger(t)))
		})
	}
}

func TestOps_StartBindError(t *testing.T) {
	t.Parallel()
	o1 := startOps(t, nil, nil)
	o2 := NewOps(o1.Addr(), nil, testutil.Logger(t))
	err := o2.Start()
	require.Error(t, err)
	require.True(t, strings.Contains(err.Error(), "listen ops"), err.Error())
	require.NoError(t, o2.Stop(t.Context()))
}
