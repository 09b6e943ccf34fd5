package loadgen

import (
	"log/slog"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/hooks/auth"
	"github.com/mochi-mqtt/server/v2/listeners"
	"github.com/stretchr/testify/require"
)

// testWriter sends log output to t.Log, so it shows only when a test fails.
type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// startMochi runs an in-process mochi v2 broker with the allow-all hook on a
// free loopback port and returns its address once it accepts connections.
func startMochi(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	server := mqtt.New(&mqtt.Options{
		InlineClient: false,
		Logger:       slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelError})),
	})
	require.NoError(t, server.AddHook(new(auth.AllowHook), nil))
	require.NoError(t, server.AddListener(listeners.NewNet("bench", ln)))
	require.NoError(t, server.Serve())
	t.Cleanup(func() { closeMochi(t, server) })
	return ln.Addr().String()
}

// closeMochi closes a mochi server, giving up after a while: mochi v2.7.9's
// Close takes its clients' read lock twice (GetByListener calls Len), which
// deadlocks when a connecting client waits for the write lock in between,
// as the failover scenario's reconnecting clients do.
func closeMochi(t *testing.T, server *mqtt.Server) {
	done := make(chan struct{})
	go func() { _ = server.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Log("mochi did not close within 10s (its Close can deadlock on its clients' lock); left behind")
	}
}

func testConfig(addr, scenario string, qos int) Config {
	return Config{
		Scenario: scenario, QoS: qos, Size: DefaultSize, Clients: 10,
		Duration: time.Second, Warmup: 200 * time.Millisecond, Inflight: 200,
		PubAddr: addr, SubAddr: addr, Drain: DefaultDrain, KeepAlive: DefaultKeepAlive,
		TopicPrefix: DefaultTopicPrefix, ConnectConcurrency: 8, StallTimeout: 5 * time.Second,
		BrokerPID: os.Getpid(),
	}
}

// TestRun_Mochi drives each message scenario for one second against an
// in-process mochi broker and checks that messages flowed, and that with
// QoS 1 and 2 nothing the broker acknowledged went missing. The broker runs
// in the test process, so BrokerPID is the test's own pid: the broker
// figures are then only a smoke test of the /proc sampling.
func TestRun_Mochi(t *testing.T) {
	t.Parallel()
	addr := startMochi(t)
	for _, tc := range []struct {
		name     string
		scenario string
		qos      int
	}{
		{"pairs_qos1", ScenarioPairs, 1},
		{"fanin_qos1", ScenarioFanIn, 1},
		{"fanout_qos1", ScenarioFanOut, 1},
		{"pairs_qos2", ScenarioPairs, 2},
		{"fanin_qos0", ScenarioFanIn, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(addr, tc.scenario, tc.qos)
			cfg.TopicPrefix = "bench-" + tc.name
			r, err := Run(t.Context(), cfg)
			require.NoError(t, err)
			t.Log(r.String())
			require.Zero(t, r.Errors, r.FirstError)
			require.Positive(t, r.Rate)
			require.Positive(t, r.P50us)
			require.GreaterOrEqual(t, r.P99us, r.P50us)
			require.Positive(t, r.BrokerRSS)
			require.Zero(t, r.Foreign)
			if tc.qos > 0 {
				require.Zero(t, r.Lost, "acknowledged by the broker but never delivered")
				require.Zero(t, r.Dup)
				require.Zero(t, r.OOO)
				require.Zero(t, r.Unacked)
				require.Equal(t, r.Sent, r.Acked)
				perMessage := uint64(1)
				if tc.scenario == ScenarioFanOut {
					perMessage = uint64(cfg.Clients)
				}
				require.Equal(t, r.Sent*perMessage, r.Delivered)
			}
		})
	}
}

// TestRun_Paced paces pairs at a rate far below what the broker takes: the
// rate delivered is the one asked for, and QoS 1 loses nothing to the
// pacing.
func TestRun_Paced(t *testing.T) {
	t.Parallel()
	addr := startMochi(t)
	cfg := testConfig(addr, ScenarioPairs, 1)
	cfg.TopicPrefix = "bench-paced"
	cfg.Rate = 2000
	r, err := Run(t.Context(), cfg)
	require.NoError(t, err)
	t.Log(r.String())
	require.Zero(t, r.Errors, r.FirstError)
	require.Equal(t, 2000.0, r.PacedRate)
	// Never faster than asked (but for the window's edges); slower only
	// on a machine too busy to keep the pace.
	require.LessOrEqual(t, r.Rate, 2300.0, "delivered faster than paced")
	require.GreaterOrEqual(t, r.Rate, 400.0, "delivered far slower than paced")
	require.Zero(t, r.Lost)
	require.Zero(t, r.Dup)
	require.Zero(t, r.OOO)
	require.Equal(t, r.Sent, r.Acked)
	require.Equal(t, r.Sent, r.Delivered)
}

func TestRun_Storm(t *testing.T) {
	t.Parallel()
	addr := startMochi(t)
	for _, scenario := range []string{ScenarioStorm, ScenarioIdle} {
		t.Run(scenario, func(t *testing.T) {
			cfg := testConfig(addr, scenario, 0)
			cfg.Clients = 200
			cfg.Hold = 100 * time.Millisecond
			r, err := Run(t.Context(), cfg)
			require.NoError(t, err)
			t.Log(r.String())
			require.Zero(t, r.ConnectErrors, r.FirstError)
			require.Positive(t, r.P50us)
			if scenario == ScenarioStorm {
				require.Positive(t, r.Rate)
			}
		})
	}
}

func TestRun_RefusedConnect(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	cfg := testConfig(addr, ScenarioPairs, 0)
	_, err = Run(t.Context(), cfg)
	require.Error(t, err)
}

func TestConfig_Validate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		edit func(*Config)
		ok   bool
	}{
		{"defaults", func(*Config) {}, true},
		{"unknown_scenario", func(c *Config) { c.Scenario = "nope" }, false},
		{"qos3", func(c *Config) { c.QoS = 3 }, false},
		{"size_below_header", func(c *Config) { c.Size = MinSize - 1 }, false},
		{"no_clients", func(c *Config) { c.Clients = 0 }, false},
		{"no_window", func(c *Config) { c.Inflight = 0 }, false},
		{"hold_past_keepalive", func(c *Config) { c.Scenario = ScenarioIdle; c.Hold = time.Minute; c.KeepAlive = 30 }, false},
		{"password_without_user", func(c *Config) { c.Password = "x" }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := testConfig("127.0.0.1:1", ScenarioFanIn, 0)
			tc.edit(&cfg)
			err := cfg.Validate()
			if tc.ok {
				require.NoError(t, err)
			} else {
				require.Error(t, err)
			}
		})
	}
}
