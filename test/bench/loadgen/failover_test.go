package loadgen

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/hooks/auth"
	"github.com/mochi-mqtt/server/v2/listeners"
	"github.com/stretchr/testify/require"
)

func TestNextAddr(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name            string
		n, killed, from int
		want            int
	}{
		{"first_survivor", 3, 2, -1, 0},
		{"first_survivor_first_killed", 3, 0, -1, 1},
		{"next", 3, 2, 0, 1},
		{"skips_killed", 3, 2, 1, 0},
		{"from_killed", 3, 2, 2, 0},
		{"wraps", 3, -1, 2, 0},
		{"nothing_killed", 3, -1, 0, 1},
		{"two_edges", 2, 1, 0, 0},
		{"two_edges_from_killed", 2, 1, 1, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, tc.want, nextAddr(tc.n, tc.killed, tc.from))
		})
	}
}

func TestRefusalReason(t *testing.T) {
	t.Parallel()
	opErr := func(err error) error { return &net.OpError{Op: "read", Net: "tcp", Err: err} }
	for _, tc := range []struct {
		err  error
		want string
	}{
		{&RefusedError{Code: 3}, "rc3_server_unavailable"},
		{fmt.Errorf("subscriber: %w", &RefusedError{Code: 5}), "rc5_not_authorized"},
		{&RefusedError{Code: 9}, "rc9"},
		{fmt.Errorf("subscribe: %w", fmt.Errorf("%w: subscription", ErrRefused)), "subscribe_refused"},
		{fmt.Errorf("dial x: %w", opErr(syscall.ECONNREFUSED)), "connection_refused"},
		{fmt.Errorf("read connack: %w", io.EOF), "closed_by_broker"},
		{fmt.Errorf("read connack: %w", opErr(syscall.ECONNRESET)), "connection_reset"},
		{fmt.Errorf("read connack: %w", opErr(os.ErrDeadlineExceeded)), "timeout"},
		{fmt.Errorf("read: %w", errBrokerDisconnect), "broker_disconnect"},
		{errors.New("weird"), "other"},
	} {
		require.Equal(t, tc.want, refusalReason(tc.err), tc.err.Error())
	}
	require.ErrorIs(t, &RefusedError{Code: 3}, ErrRefused)
}

func TestSplitAddrs(t *testing.T) {
	t.Parallel()
	require.Equal(t, []string{"a:1", "b:2", "c:3"}, splitAddrs("a:1,b:2 c:3"))
	require.Equal(t, []string{"a:1"}, splitAddrs(",a:1,"))
	require.Empty(t, splitAddrs(""))
}

func TestConfig_ValidateFailover(t *testing.T) {
	t.Parallel()
	base := func() Config {
		c := testConfig("127.0.0.1:1", ScenarioFailover, 0)
		c.Addrs = []string{"a:1", "b:2", "c:3"}
		c.KillPID, c.KilledAddr = 1234, "c:3"
		return c
	}
	for _, tc := range []struct {
		name string
		edit func(*Config)
		ok   bool
	}{
		{"ok", func(*Config) {}, true},
		{"no_kill", func(c *Config) { c.KillPID, c.KilledAddr = 0, "" }, true},
		{"one_addr", func(c *Config) { c.Addrs = []string{"c:3"} }, false},
		{"killed_not_listed", func(c *Config) { c.KilledAddr = "d:4" }, false},
		{"pid_without_addr", func(c *Config) { c.KilledAddr = "" }, false},
		{"addr_without_pid", func(c *Config) { c.KillPID = 0 }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := base()
			tc.edit(&c)
			err := c.Validate()
			if !tc.ok {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, 1, c.QoS)
			require.True(t, c.Persistent)
			require.Equal(t, DefaultAckTimeout, c.AckTimeout)
		})
	}
}

// TestFigures checks the result computation on a hand-made run: 4
// subscribers on 2 edges, edge 1 (subscribers 1 and 3) killed at 10 s.
func TestFigures(t *testing.T) {
	t.Parallel()
	s := time.Second
	raw := &foRaw{
		addrs: []string{"a:1", "b:2"}, killed: 1, killAt: 10 * s, n: 4,
		first: []int{0, 1, 0, 1}, last: []int{0, 0, 0, 0},
		drops: []int{0, 1, 0, 2},
		// Subscriber 1 back at 12 s; 3 back at 15 s (after two drops).
		upAt:     []time.Duration{0, 12 * s, 0, 15 * s},
		up:       []bool{true, true, true, true},
		notFound: []bool{false, false, false, true},
		// Round 0 acked before the kill; round 1 acked after it, except
		// message 6 (round 1, subscriber 2), never acknowledged.
		ackedAt: []time.Duration{
			5 * s, 5 * s, 5 * s, 5 * s,
			11 * s, 13 * s, 0, 14 * s,
		},
		// Message 3 (round 0, subscriber 3) and 5 (round 1, subscriber 1)
		// never arrived; message 7 arrived last, at 16 s.
		deliveredAt: []time.Duration{
			6 * s, 6 * s, 6 * s, 0,
			11 * s, 0, 0, 16 * s,
		},
		deliveredAtKill: 3,
	}
	cfg := &Config{KilledAddr: "b:2", KillPID: 42}
	fr := raw.figures(cfg)
	require.Equal(t, 2, fr.OnKilled)
	require.Equal(t, 2, fr.Dropped)
	require.Equal(t, 2, fr.Back)
	require.Zero(t, fr.NotBack)
	require.Equal(t, 1, fr.SessionsNotFound)
	require.InDelta(t, 2.0, fr.FirstBackSec, 0.1)
	require.InDelta(t, 5.0, fr.ReconnectMaxSec, 0.001)
	require.InDelta(t, 5.0, fr.ReconnectP99Sec, 0.2)
	require.InDelta(t, 4.0, fr.Round1AckedSec, 0.001)
	require.InDelta(t, 6.0, fr.AllDeliveredSec, 0.001)
	require.InDelta(t, 6.0, fr.Round1KilledFirstSec, 0.001) // message 7 only
	require.InDelta(t, 6.0, fr.Round1KilledLastSec, 0.001)
	require.InDelta(t, 1.0, fr.Round1OthersLastSec, 0.001) // message 4
	require.Equal(t, uint64(1), fr.LostBefore)
	require.Equal(t, uint64(1), fr.LostAfter)
	require.Equal(t, map[string]uint64{"b:2": 2}, fr.LostByEdge)
	require.Equal(t, []LostMsg{
		{Client: 3, Round: 0, FirstAddr: "b:2", LastAddr: "a:1", Drops: 2, AckedSec: -5, BackSec: 5},
		{Client: 1, Round: 1, FirstAddr: "b:2", LastAddr: "a:1", Drops: 1, AckedSec: 3, BackSec: 2},
	}, fr.LostMsgs)
	require.False(t, fr.Recovered)
	require.Zero(t, fr.RecoveredSec)

	// The same run with every message delivered and acknowledged.
	raw.ackedAt[6] = 12 * s
	raw.deliveredAt[3], raw.deliveredAt[5], raw.deliveredAt[6] = 12*s, 13*s, 12*s
	fr = raw.figures(cfg)
	require.True(t, fr.Recovered)
	require.InDelta(t, 6.0, fr.RecoveredSec, 0.001)
	require.InDelta(t, 3.0, fr.Round1KilledFirstSec, 0.001) // message 5
	require.InDelta(t, 2.0, fr.Round1OthersLastSec, 0.001)  // message 6
	require.Zero(t, fr.LostBefore+fr.LostAfter)
	require.Empty(t, fr.LostMsgs)
	require.Contains(t, fr.String(), "RECOVERED")

	// A subscriber that never came back.
	raw.up[3] = false
	fr = raw.figures(cfg)
	require.Equal(t, 1, fr.NotBack)
	require.False(t, fr.Recovered)
}

// TestRun_FailoverMochi runs the failover scenario against one in-process
// mochi with three listeners, which share their sessions like edges of one
// cluster. The "kill" closes the third listener and its clients, which
// must come back on the others with their sessions and get every message.
//
// mochi itself can lose a message published to a client of the closed
// listener while that client's reconnect takes its session over: the
// publish finds the old client, the takeover copies its in-flight messages,
// and then the publish adds one to the old client (1 run in 10 to 30 under
// -race). That is the stand-in broker, not the generator: such a run is
// logged and run again on a fresh mochi, up to eight times (a loaded
// machine makes it likelier several runs in a row: once in 60, four).
func TestRun_FailoverMochi(t *testing.T) {
	t.Parallel()
	var r *Result
	for attempt := 1; ; attempt++ {
		r = runFailoverOnMochi(t)
		if r.Lost == 0 || attempt == 8 {
			break
		}
		t.Logf("attempt %d: mochi lost %d message(s) racing its own takeover; running again", attempt, r.Lost)
	}
	require.Zero(t, r.Errors, r.FirstError)
	fr := r.Failover
	require.NotNil(t, fr)
	require.Equal(t, 20, fr.OnKilled)
	require.Equal(t, 20, fr.Dropped)
	require.Equal(t, 20, fr.Back)
	require.Zero(t, fr.SessionsNotFound)
	require.Equal(t, uint64(120), r.Sent)
	require.Equal(t, uint64(120), r.Acked)
	require.Zero(t, r.Lost)
	require.Zero(t, r.Foreign)
	require.True(t, fr.Recovered, r.String())
	require.Positive(t, fr.Attempts)
	require.Equal(t, 2, fr.PubConns)
}

// runFailoverOnMochi runs the failover scenario once against a fresh
// in-process mochi (see TestRun_FailoverMochi).
func runFailoverOnMochi(t *testing.T) *Result {
	t.Helper()
	server := mqtt.New(&mqtt.Options{
		InlineClient: false,
		Logger:       slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelError})),
	})
	require.NoError(t, server.AddHook(new(auth.AllowHook), nil))
	addrs := make([]string, 3)
	for i := range addrs {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		require.NoError(t, server.AddListener(listeners.NewNet(fmt.Sprintf("l%d", i), ln)))
		addrs[i] = ln.Addr().String()
	}
	require.NoError(t, server.Serve())
	defer closeMochi(t, server)

	cfg := testConfig("", ScenarioFailover, 1)
	cfg.Clients = 60
	cfg.Addrs, cfg.KilledAddr = addrs, addrs[2]
	cfg.KillAfter = 50 * time.Millisecond
	cfg.AckTimeout, cfg.RecoverTimeout, cfg.Drain = 5*time.Second, 20*time.Second, 5*time.Second
	cfg.BrokerPID = 0
	cfg.kill = func() error {
		server.Listeners.Close("l2", func(id string) {
			for _, cl := range server.Clients.GetByListener(id) {
				cl.Stop(errors.New("killed"))
			}
		})
		// The publisher loses its connection too, and must go on from
		// another listener.
		for _, cl := range server.Clients.GetByListener("l0") {
			if strings.HasSuffix(cl.ID, "-fp0") {
				cl.Stop(errors.New("dropped"))
			}
		}
		return nil
	}
	r, err := Run(t.Context(), cfg)
	require.NoError(t, err)
	t.Log(r.String())
	return r
}
