package server

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/keelmq/keel/services/persistence/internal/failover"

	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
)

// The Switchover RPC validates its request, refuses on an instance with no
// Redis group, answers the result, and maps every failure to its code.
func TestServer_Switchover(t *testing.T) {
	ctx := context.Background()
	req := func(to string, timeout time.Duration) *connect.Request[persistencev1.SwitchoverRequest] {
		r := &persistencev1.SwitchoverRequest{To: to}
		if timeout != 0 {
			r.Timeout = durationpb.New(timeout)
		}
		return connect.NewRequest(r)
	}
	_, err := New(Config{}, nil, nil, nil, nil).Switchover(ctx, req("", 0))
	require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err), "no Redis group: %v", err)

	var got failover.SwitchoverOptions
	var answer error
	srv := New(Config{Switchover: func(_ context.Context, o failover.SwitchoverOptions) (failover.SwitchoverResult, error) {
		got = o
		if answer != nil {
			return failover.SwitchoverResult{}, answer
		}
		return failover.SwitchoverResult{Old: failover.Record{Primary: "a:1", Replicas: []string{"b:2", "c:3"}, Epoch: 5},
			New: failover.Record{Primary: "b:2", Replicas: []string{"a:1", "c:3"}, Epoch: 9}, Offset: 42, PausedFor: 30 * time.Millisecond, Demoted: true}, nil
	}}, nil, nil, nil, nil)
	resp, err := srv.Switchover(ctx, req("", 0))
	require.NoError(t, err)
	require.Equal(t, failover.SwitchoverOptions{SyncTimeout: failover.DefaultSwitchoverSyncTimeout}, got)
	m := resp.Msg
	require.Equal(t, "a:1", m.GetOldPrimary())
	require.Equal(t, "b:2", m.GetNewPrimary())
	require.Equal(t, uint64(9), m.GetRecordEpoch())
	require.Equal(t, uint64(5), m.GetOldRecordEpoch())
	require.Equal(t, []string{"a:1", "c:3"}, m.GetReplicaAddresses())
	require.Equal(t, int64(42), m.GetOffset())
	require.Equal(t, 30*time.Millisecond, m.GetPausedFor().AsDuration())
	require.True(t, m.GetOldPrimaryDemoted())
	_, err = srv.Switchover(ctx, req("c:3", 3*time.Second))
	require.NoError(t, err)
	require.Equal(t, failover.SwitchoverOptions{To: "c:3", SyncTimeout: 3 * time.Second}, got)

	for _, r := range []*connect.Request[persistencev1.SwitchoverRequest]{req("nohost", 0), req("h:0", 0), req(":7", 0),
		req("", -time.Second), req("", 2*time.Minute)} {
		_, err := srv.Switchover(ctx, r)
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%v: %v", r.Msg, err)
	}
	for want, e := range map[connect.Code]error{
		connect.CodeInvalidArgument:    failover.ErrBadTarget,
		connect.CodeFailedPrecondition: failover.ErrNotInSync,
		connect.CodeAborted:            failover.ErrLeaseHeld,
		connect.CodeUnavailable:        failover.ErrCoordinator,
		connect.CodeUnknown:            failover.ErrOutcomeUnknown,
		connect.CodeInternal:           errors.New("promote: ERR boom"),
		connect.CodeDeadlineExceeded:   context.DeadlineExceeded,
	} {
		answer = fmt.Errorf("switchover: %w", e)
		_, err := srv.Switchover(ctx, req("", 0))
		require.Equal(t, want, connect.CodeOf(err), "%v", e)
		require.ErrorContains(t, err, e.Error())
	}
	for _, e := range []error{failover.ErrNoCandidate, failover.ErrPrimaryNotServing, failover.ErrUnsupported} {
		answer = e
		_, err := srv.Switchover(ctx, req("", 0))
		require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err), "%v", e)
	}
	for _, e := range []error{failover.ErrPromotionRunning, failover.ErrRecordChanged} {
		answer = e
		_, err := srv.Switchover(ctx, req("", 0))
		require.Equal(t, connect.CodeAborted, connect.CodeOf(err), "%v", e)
	}
}
