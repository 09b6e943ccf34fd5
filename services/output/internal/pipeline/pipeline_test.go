package pipeline

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	outputv1 "github.com/keelmq/keel/proto/gen/keel/output/v1"
	"github.com/keelmq/keel/services/output/internal/outputtest"
	"github.com/keelmq/keel/services/output/internal/rules"
)

func TestMain(m *testing.M) {
	outputtest.MaybeServePlugin()
	os.Exit(m.Run())
}

func parseRules(t *testing.T, yaml string) *rules.Set {
	t.Helper()
	set, err := rules.Parse("r.yaml", []byte(yaml), rules.Options{PluginDir: outputtest.PluginDir(t)})
	require.NoError(t, err)
	return set
}

// TestHost_Apply_ConfigRefusedAtItsLine: a config the plugin refuses is
// reported like the problems rules.Parse finds, at its line and path, with
// the plugin's own message.
func TestHost_Apply_ConfigRefusedAtItsLine(t *testing.T) {
	t.Parallel()
	set := parseRules(t, `tenants:
  acme:
    rules:
      - name: orders
        filters: ["orders/#"]
        transforms:
          - plugin: filter
            config: {nope: 1}
        sink: {plugin: http, config: {url: "http://127.0.0.1:1/"}}
      - name: audit
        filters: ["audit/#"]
        sink:
          plugin: http
          config:
            timeout: 1s
`)
	h := NewHost(Config{}, testutil.Logger(t), nil)
	t.Cleanup(func() { _ = h.Stop(t.Context()) })
	err := h.Apply(t.Context(), set)
	require.Error(t, err)
	t.Logf("apply error: %v", err)
	require.ErrorIs(t, err, ErrPluginConfig)
	require.ErrorIs(t, err, rules.ErrInvalid)
	require.Contains(t, err.Error(), `r.yaml:14: tenants.acme.rules[1].sink.config: http sink config: url "": want an absolute http(s) URL`)
	require.Contains(t, err.Error(), `r.yaml:8: tenants.acme.rules[0].transforms[0].config: decode config: json: unknown field "nope"`)
	var located *rules.Error
	require.True(t, errors.As(err, &located))
	require.Positive(t, located.Line)
	require.Empty(t, h.Status(), "nothing runs after a refused config")
}

// TestPipeline_RestartCountedWhenItSucceeds kills a sink plugin and makes
// its relaunch fail twice before one succeeds: the fault counts one
// restart, when the plugin is back, and the failed attempts count as launch
// errors.
func TestPipeline_RestartCountedWhenItSucceeds(t *testing.T) {
	t.Parallel()
	set := parseRules(t, `tenants:
  acme:
    rules:
      - {name: orders, filters: ["#"], sink: {plugin: http, config: {url: "http://127.0.0.1:1/"}}}
`)
	spec := set.Pipeline("acme/orders")
	cfg := Config{StartTimeout: 5 * time.Second}.withDefaults()
	logger := testutil.Logger(t)
	m := NewMetrics(nil)
	rt := newRuntime(spec)
	require.NoError(t, rt.start(t.Context(), &cfg, logger))
	t.Cleanup(func() { rt.stop(&cfg) })
	p := newPipeline(spec, rt, cfg, logger, m)
	restarts := func() float64 { return promtest.ToFloat64(m.Restarts.WithLabelValues("acme/orders", "http")) }
	launchErrors := func() float64 { return promtest.ToFloat64(m.Errors.WithLabelValues("acme/orders", "http", "launch")) }

	pr := rt.sink
	oldPid := pr.p.Pid()
	require.NoError(t, syscall.Kill(oldPid, syscall.SIGKILL))
	testutil.Eventually(t, 5*time.Second, func() error {
		if !pr.p.Exited() {
			return fmt.Errorf("plugin %d still running", oldPid)
		}
		return nil
	})

	good := pr.stage.Path
	pr.stage.Path = filepath.Join(t.TempDir(), "keel-output-http")
	require.NoError(t, os.WriteFile(pr.stage.Path, []byte("#!/bin/sh\necho not a plugin\nexit 3\n"), 0o755))
	for range 2 {
		require.Error(t, p.ensure(t.Context()))
	}
	require.Zero(t, restarts())
	require.Equal(t, 2.0, launchErrors())
	require.Equal(t, outputv1.PipelineState_PIPELINE_STATE_RESTARTING, p.status().GetState())
	require.Zero(t, p.status().GetPluginRestarts())

	pr.stage.Path = good
	require.NoError(t, p.ensure(t.Context()))
	require.Equal(t, 1.0, restarts())
	require.Equal(t, uint64(1), p.status().GetPluginRestarts())
	require.Equal(t, outputv1.PipelineState_PIPELINE_STATE_RUNNING, p.status().GetState())
	require.NotEqual(t, oldPid, pr.p.Pid())

	require.NoError(t, p.ensure(t.Context()))
	require.Equal(t, 1.0, restarts(), "a running plugin is not restarted")
	require.Equal(t, 2.0, launchErrors())
}
