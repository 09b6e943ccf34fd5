package server

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/keelmq/keel/services/persistence/internal/failover"
	"github.com/keelmq/keel/services/persistence/internal/metrics"

	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
	"github.com/keelmq/keel/proto/gen/keel/persistence/v1/persistencev1connect"
)

// lockedBuffer is a log destination the test reads while the server writes.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// startCountingServer serves a bolt store with metrics and a log the test
// reads; cfg.Switchover is set, so Switchover requests reach validation.
func startCountingServer(t *testing.T) (*testServer, *metrics.Metrics, *lockedBuffer) {
	t.Helper()
	m := metrics.New(prometheus.NewRegistry())
	logs := &lockedBuffer{}
	cfg := Config{Switchover: func(context.Context, failover.SwitchoverOptions) (failover.SwitchoverResult, error) {
		return failover.SwitchoverResult{}, nil
	}}
	srv := New(cfg, boltStore(t), m, nil, slog.New(slog.NewTextHandler(logs, nil)))
	return serveTest(t, srv), m, logs
}

func refusedCount(m *metrics.Metrics, kind string) float64 {
	return testutil.ToFloat64(m.Ops.WithLabelValues(kind, invalidStatus))
}

// An undecodable Write frame ends the stream with InvalidArgument, and is
// counted (kind "frame") and logged with the client's address.
func TestServer_Write_GarbageFrameCounted(t *testing.T) {
	t.Parallel()
	ts, m, logs := startCountingServer(t)
	require.Zero(t, refusedCount(m, refusedFrame))
	var body bytes.Buffer
	garbage := []byte{0xff, 0xff, 0xff, 0xff, 0x0f}
	body.WriteByte(0)
	_ = binary.Write(&body, binary.BigEndian, uint32(len(garbage)))
	body.Write(garbage)
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, ts.url+persistencev1connect.PersistenceServiceWriteProcedure, &body)
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/connect+proto")
	resp, err := h2cClient().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	require.Contains(t, string(out), "invalid_argument")

	require.Equal(t, 1.0, refusedCount(m, refusedFrame))
	require.Zero(t, refusedCount(m, refusedBatch))
	line := logs.String()
	require.Contains(t, line, "request refused")
	require.Contains(t, line, "reason=frame")
	require.Contains(t, line, "remote=127.0.0.1:")
	require.Contains(t, line, "unmarshal message")
}

// A batch refused whole is counted (kind "batch") and logged; the stream
// goes on.
func TestServer_Write_InvalidBatchCounted(t *testing.T) {
	t.Parallel()
	ts, m, logs := startCountingServer(t)
	w := newWriter(t, ts.client)
	resp := w.write()
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_INVALID_ARGUMENT, resp.GetStatus())
	require.Equal(t, 1.0, refusedCount(m, refusedBatch))
	require.Contains(t, logs.String(), "reason=batch")
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, w.write(activate(1)).GetStatus())
	require.Equal(t, 1.0, refusedCount(m, refusedBatch))
}

// The unary RPCs count each request refused for its content under their
// kind, and a refused Switchover request as switchovers{bad_request}.
func TestServer_UnaryRefusalsCounted(t *testing.T) {
	t.Parallel()
	ts, m, logs := startCountingServer(t)
	ctx := t.Context()

	_, err := ts.client.LoadSession(ctx, connect.NewRequest(&persistencev1.LoadSessionRequest{}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	require.Equal(t, 1.0, refusedCount(m, refusedLoadSession))

	for i, filter := range []string{"a/#/b", "$share/g/#"} {
		_, err = ts.client.LookupRetained(ctx, connect.NewRequest(&persistencev1.LookupRetainedRequest{Tenant: "acme", Filter: filter}))
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), filter)
		require.Equal(t, float64(i+1), refusedCount(m, refusedLookupRetained), filter)
	}
	_, err = ts.client.LookupRetained(ctx, connect.NewRequest(&persistencev1.LookupRetainedRequest{Tenant: "Bad", Filter: "#"}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	require.Equal(t, 3.0, refusedCount(m, refusedLookupRetained))

	_, err = ts.client.TenantUsage(ctx, connect.NewRequest(&persistencev1.TenantUsageRequest{Tenant: "Bad Tenant"}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	require.Contains(t, err.Error(), `tenant "Bad Tenant"`)
	require.Equal(t, 1.0, refusedCount(m, refusedTenantUsage))

	bad := testutil.ToFloat64(m.Switchovers.WithLabelValues("bad_request"))
	for _, r := range []*persistencev1.SwitchoverRequest{{To: "nohost"}, {Timeout: durationpb.New(-time.Second)}} {
		_, err = ts.client.Switchover(ctx, connect.NewRequest(r))
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), r.String())
	}
	require.Equal(t, bad+2, testutil.ToFloat64(m.Switchovers.WithLabelValues("bad_request")))

	// Requests that are fine are not counted.
	_, err = ts.client.LoadSession(ctx, connect.NewRequest(&persistencev1.LoadSessionRequest{Session: sess}))
	require.NoError(t, err)
	_, err = ts.client.TenantUsage(ctx, connect.NewRequest(&persistencev1.TenantUsageRequest{Tenant: "acme"}))
	require.NoError(t, err)
	require.Equal(t, 1.0, refusedCount(m, refusedLoadSession))
	require.Equal(t, 1.0, refusedCount(m, refusedTenantUsage))

	// One line for the burst: the rest are counted, not logged.
	require.Equal(t, 1, strings.Count(logs.String(), "request refused"), logs.String())
	require.Contains(t, logs.String(), "reason=load_session")
}
