package app

import (
	"context"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
)

// TestAPI_RemovePeer removes a stopped follower from the Raft configuration
// of a real three-node cluster through the other follower (which forwards
// to the leader): the answer lists the two servers left, the cluster still
// commits, and an unknown node is NotFound.
func TestAPI_RemovePeer(t *testing.T) {
	t.Parallel()
	c := startCluster(t, 3, clusterOpts{fast: true})
	l := c.waitLeader(5 * time.Second)
	fs := c.followers()
	require.Len(t, fs, 2)
	gone, via := fs[1], fs[0]
	gone.stop()

	resp, err := retry(t.Context(), 10*time.Second, func(ctx context.Context) (*connect.Response[coordinatorv1.RemovePeerResponse], error) {
		return via.client().RemovePeer(ctx, connect.NewRequest(&coordinatorv1.RemovePeerRequest{NodeId: gone.id}))
	})
	require.NoError(t, err)
	var left []string
	for _, p := range resp.Msg.GetPeers() {
		left = append(left, p.GetNodeId())
		require.True(t, p.GetVoter())
	}
	require.ElementsMatch(t, []string{l.id, via.id}, left)

	// Two of two voters: writes still commit.
	_, err = retry(t.Context(), 10*time.Second, func(ctx context.Context) (*connect.Response[coordinatorv1.BumpAclVersionResponse], error) {
		return via.client().BumpAclVersion(ctx, connect.NewRequest(&coordinatorv1.BumpAclVersionRequest{Tenant: "acme"}))
	})
	require.NoError(t, err)

	_, err = l.client().RemovePeer(t.Context(), connect.NewRequest(&coordinatorv1.RemovePeerRequest{NodeId: "nobody"}))
	require.Equal(t, connect.CodeNotFound, connect.CodeOf(err))
}
