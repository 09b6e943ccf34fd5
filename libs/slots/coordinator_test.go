package slots

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	"github.com/keelmq/keel/proto/gen/keel/coordinator/v1/coordinatorv1connect"
)

// watchScript answers WatchCluster with the given events, then holds the
// stream open until the client goes.
type watchScript struct {
	coordinatorv1connect.UnimplementedCoordinatorServiceHandler
	events []*coordinatorv1.WatchClusterResponse
}

func (w *watchScript) WatchCluster(ctx context.Context, _ *connect.Request[coordinatorv1.WatchClusterRequest], st *connect.ServerStream[coordinatorv1.WatchClusterResponse]) error {
	for _, e := range w.events {
		if err := st.Send(e); err != nil {
			return err
		}
	}
	<-ctx.Done()
	return nil
}

func fetchFrom(t *testing.T, events ...*coordinatorv1.WatchClusterResponse) (Table, int, error) {
	t.Helper()
	mux := http.NewServeMux()
	mux.Handle(coordinatorv1connect.NewCoordinatorServiceHandler(&watchScript{events: events}))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	defer cancel()
	return Fetch(ctx, coordinatorv1connect.NewCoordinatorServiceClient(srv.Client(), srv.URL), "m", coordinatorv1.MemberRole_MEMBER_ROLE_PERSISTENCE)
}

func snapshot(cfg *coordinatorv1.ClusterConfig) *coordinatorv1.WatchClusterResponse {
	return &coordinatorv1.WatchClusterResponse{Event: &coordinatorv1.WatchClusterResponse_Snapshot{Snapshot: &coordinatorv1.ClusterSnapshot{Config: cfg}}}
}

func config(cfg *coordinatorv1.ClusterConfig) *coordinatorv1.WatchClusterResponse {
	return &coordinatorv1.WatchClusterResponse{Event: &coordinatorv1.WatchClusterResponse_Config{Config: cfg}}
}

// A member that starts before the first leader installed the slot table
// waits for it (a later config event), instead of taking the empty config
// for one group: a group-0 persistence instance of a K=2 cluster would then
// take every session for its whole life.
func TestFetch_WaitsForTheTable(t *testing.T) {
	two := &coordinatorv1.ClusterConfig{RedisGroupCount: 2, SlotGroups: Even(2)}
	table, k, err := fetchFrom(t, snapshot(&coordinatorv1.ClusterConfig{}), config(two))
	require.NoError(t, err)
	require.Equal(t, 2, k)
	require.Equal(t, Table(Even(2)), table)

	// One group: a table of zeros, returned as nil.
	table, k, err = fetchFrom(t, snapshot(&coordinatorv1.ClusterConfig{RedisGroupCount: 1, SlotGroups: Even(1)}))
	require.NoError(t, err)
	require.Equal(t, 1, k)
	require.Nil(t, table)

	// No table ever: Fetch gives up with its context.
	_, _, err = fetchFrom(t, snapshot(&coordinatorv1.ClusterConfig{}))
	require.Error(t, err)

	// A table that does not match K is refused.
	_, _, err = fetchFrom(t, snapshot(&coordinatorv1.ClusterConfig{RedisGroupCount: 3, SlotGroups: Even(2)}))
	require.ErrorIs(t, err, ErrInvalid)
}
