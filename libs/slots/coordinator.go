package slots

import (
	"context"
	"fmt"

	"connectrpc.com/connect"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	"github.com/keelmq/keel/proto/gen/keel/coordinator/v1/coordinatorv1connect"
)

// Fetch reads the cluster's slot table and K, the number of Redis groups,
// from the coordinator: the config of the snapshot that opens a
// WatchCluster stream, or of a later config event while the first leader
// has not installed the table yet (it installs one for every K, one group
// included), until ctx ends. The table is nil when K is 1. K is fixed at
// install, so what Fetch returns holds for the life of the cluster.
func Fetch(ctx context.Context, c coordinatorv1connect.CoordinatorServiceClient, memberID string, role coordinatorv1.MemberRole) (Table, int, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := c.WatchCluster(ctx, connect.NewRequest(&coordinatorv1.WatchClusterRequest{MemberId: memberID, Role: role}))
	if err != nil {
		return nil, 0, err
	}
	defer st.Close()
	for st.Receive() {
		cfg := st.Msg().GetConfig()
		if snap := st.Msg().GetSnapshot(); snap != nil {
			cfg = snap.GetConfig()
		}
		if len(cfg.GetSlotGroups()) == 0 {
			continue // not installed yet
		}
		k := max(int(cfg.GetRedisGroupCount()), 1)
		t := Table(cfg.GetSlotGroups())
		if err := t.Validate(k); err != nil {
			return nil, 0, err
		}
		if k == 1 {
			return nil, 1, nil
		}
		return t, k, nil
	}
	if err := st.Err(); err != nil {
		return nil, 0, err
	}
	return nil, 0, fmt.Errorf("watch cluster: stream ended before a slot table")
}
