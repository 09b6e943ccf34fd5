package app

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/output/internal/meta"
	"github.com/keelmq/keel/services/output/internal/outputtest"
)

// TestOutput_Reload_BadRulesKeepLastGood applies broken rules files and a
// broken plugin binary: each reload fails with an error naming the problem
// (and its line where there is one) while the running rules keep delivering.
func TestOutput_Reload_BadRulesKeepLastGood(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	t.Parallel()
	addr := outputtest.StartKafka(t, 1, kafkaTopic)
	good := kafkaRules(addr, "")
	h := startOutput(t, good)
	c, _ := newClient(t, h, nil)
	seq := uint64(0)
	delivered := func() {
		t.Helper()
		seq++
		require.True(t, c.OfferMessage(outputtest.Message("acme", "sensors/r", seq, []byte("x"))))
		testutil.Eventually(t, 10*time.Second, func() error {
			if w := metric(t, h.out.Registry(), "keel_output_records_out_total", nil); w < float64(seq) {
				return fmt.Errorf("written %v of %d", w, seq)
			}
			return nil
		})
	}
	delivered()

	notPlugin := filepath.Join(t.TempDir(), "keel-output-fake")
	require.NoError(t, os.WriteFile(notPlugin, []byte("#!/bin/sh\necho not a plugin\nexit 3\n"), 0o755))
	for _, tc := range []struct {
		name, rules, want string
	}{
		{"yaml_syntax", good + "\n  oops: [\n", "rules.yaml:13: did not find expected node content"},
		{"unknown_field", "tenants:\n  acme:\n    rules:\n      - name: x\n        filter: [a]\n", "rules.yaml:5: field filter not found"},
		{"bad_filter", "tenants:\n  acme:\n    rules:\n      - name: x\n        filters: [\"a/#/b\"]\n        sink: {plugin: kafka}\n", "rules.yaml:5: tenants.acme.rules[0].filters[0]"},
		{"missing_binary", "tenants:\n  acme:\n    rules:\n      - name: x\n        filters: [a]\n        sink: {plugin: nope}\n", "rules.yaml:6: tenants.acme.rules[0].sink.plugin: plugin \"nope\""},
		{"not_a_plugin", fmt.Sprintf("plugins: {fake: %q}\ntenants:\n  acme:\n    rules:\n      - name: x\n        filters: [a]\n        sink: {plugin: fake}\n", notPlugin), "launch plugin"},
		{"config_refused", "tenants:\n  acme:\n    rules:\n      - name: x\n        filters: [a]\n        sink: {plugin: kafka, config: {topic: t}}\n", "rules.yaml:6: tenants.acme.rules[0].sink.config: kafka sink config: brokers: at least one address is required"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h.writeRules(t, tc.rules)
			err := h.out.Reload(t.Context(), true)
			require.Error(t, err)
			require.Contains(t, err.Error(), tc.want)
			t.Logf("reload error: %v", err)
			delivered()
		})
	}
	require.Equal(t, 6.0, metric(t, h.out.Registry(), "keel_output_rules_reloads_total", map[string]string{"result": "error"}))
}

// reloadTrigger makes the output service re-read its rules file.
type reloadTrigger func(t *testing.T, h *harness)

// TestOutput_Reload_KeepsBuffer points a rule at a Kafka address nobody
// listens on, so records pile up in its buffer while the sink retries, then
// fixes the address in the rules file. The reload switches the pipeline to
// new plugin processes and every buffered record is delivered, whichever
// way the reload comes: a call, a change of the file, or SIGHUP.
func TestOutput_Reload_KeepsBuffer(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	t.Parallel()
	testReloadKeepsBuffer(t, nil, func(t *testing.T, h *harness) {
		require.NoError(t, h.out.Reload(t.Context(), false))
	})
}

func TestOutput_Reload_KeepsBufferOnFileChange(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	t.Parallel()
	testReloadKeepsBuffer(t, func(c *Config) { c.PollInterval = 50 * time.Millisecond }, func(*testing.T, *harness) {})
}

// TestOutput_Reload_KeepsBufferOnSIGHUP is not parallel: the signal goes to
// the whole test process, and every output service running in it reloads.
func TestOutput_Reload_KeepsBufferOnSIGHUP(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	// The test's own registration keeps a SIGHUP from ending the process
	// should it come before the service's watcher registered its own.
	own := make(chan os.Signal, 16)
	signal.Notify(own, syscall.SIGHUP)
	defer signal.Stop(own)
	testReloadKeepsBuffer(t, nil, func(t *testing.T, h *harness) {
		reloads := func() float64 {
			return metric(t, h.out.Registry(), "keel_output_rules_reloads_total", map[string]string{"result": "ok"})
		}
		// With no polling the changed file alone reloads nothing.
		before := reloads()
		time.Sleep(300 * time.Millisecond)
		require.Equal(t, before, reloads())
		testutil.Eventually(t, 10*time.Second, func() error {
			require.NoError(t, syscall.Kill(os.Getpid(), syscall.SIGHUP))
			deadline := time.Now().Add(time.Second)
			for time.Now().Before(deadline) {
				if reloads() > before {
					return nil
				}
				time.Sleep(20 * time.Millisecond)
			}
			return errors.New("no reload after SIGHUP")
		})
	})
}

func testReloadKeepsBuffer(t *testing.T, mod func(*Config), reload reloadTrigger) {
	addr := outputtest.StartKafka(t, 2, kafkaTopic)
	dead := testutil.FreeAddr(t)
	h := startOutputWith(t, kafkaRules(dead, ""), mod)
	c, _ := newClient(t, h, nil)
	const n = 500
	for i := range n {
		require.True(t, c.OfferMessage(outputtest.Message("acme", "sensors/k", uint64(i+1), fmt.Appendf(nil, "%d", i))))
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if b := h.out.Host().Buffered(); b != n {
			return fmt.Errorf("buffered %d", b)
		}
		return nil
	})
	oldPid := h.out.Host().PluginPIDs("acme/to-kafka")[0]
	h.writeRules(t, kafkaRules(addr, ""))
	reload(t, h)
	testutil.Eventually(t, 20*time.Second, func() error {
		if w := metric(t, h.out.Registry(), "keel_output_records_out_total", nil); w < n {
			return fmt.Errorf("written %v", w)
		}
		return nil
	})
	require.NotEqual(t, oldPid, h.out.Host().PluginPIDs("acme/to-kafka")[0])
	msgs := outputtest.ReadKafka(t, addr, kafkaTopic, 2, n, 30*time.Second)
	ids := map[string]bool{}
	for _, m := range msgs {
		ids[header(m.Headers, meta.HeaderMsgID)] = true
	}
	require.Len(t, ids, n)
	require.Zero(t, metric(t, h.out.Registry(), "keel_output_dropped_total", nil))
}
