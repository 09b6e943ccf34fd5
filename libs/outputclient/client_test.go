package outputclient

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/logging"
	ktestutil "github.com/keelmq/keel/libs/testutil"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
)

// TestClient_Offer_NeverBlocks offers to a client whose output service is
// unreachable: every Offer returns at once, the queue holds its bound, and
// the rest is counted as dropped.
func TestClient_Offer_NeverBlocks(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	c, err := New(Config{URL: "http://" + ktestutil.FreeAddr(t), QueueRecords: 100, DropLogInterval: time.Hour}, ktestutil.Logger(t), reg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })

	var slowest time.Duration
	for i := range 10000 {
		s := time.Now()
		c.OfferMessage(&commonv1.Message{Tenant: "a", Topic: "t", Payload: []byte{byte(i)}})
		slowest = max(slowest, time.Since(s))
	}
	st := c.Stats()
	require.Equal(t, uint64(10000), st.Offered)
	require.LessOrEqual(t, c.QueueLen(), 100)
	require.GreaterOrEqual(t, st.Dropped, uint64(10000-100-DefaultMaxBatch))
	require.Equal(t, float64(st.Dropped), dropped(t, reg, ReasonQueueFull))
	require.Less(t, slowest, 50*time.Millisecond)
}

func dropped(t *testing.T, reg *prometheus.Registry, reason string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			if f.GetName() == "keel_edge_output_dropped_total" && m.GetLabel()[0].GetValue() == reason {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

// TestClient_DropLog_RateLimited checks that drops log at most once per
// interval while every drop is counted.
func TestClient_DropLog_RateLimited(t *testing.T) {
	t.Parallel()
	c, err := New(Config{URL: "http://127.0.0.1:1", QueueRecords: 1, DropLogInterval: time.Hour}, logging.Discard(), nil)
	require.NoError(t, err)
	for range 1000 {
		c.OfferMessage(&commonv1.Message{Tenant: "a", Topic: "t"})
	}
	require.Equal(t, uint64(999), c.Stats().Dropped)
	// One log line was allowed (the first drop), then none for an hour.
	require.False(t, c.dropLog.Allow(time.Hour), "the first drop's line took the hour")
	require.Equal(t, uint64(998), c.dropsSinceLog.Load())
}
