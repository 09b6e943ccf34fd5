package app

import (
	"context"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
)

// TestAPI_BumpAclVersion bumps ACL versions through a follower (which
// forwards to the leader) of a real three-node cluster: the version is a Raft
// index, so it grows; a watcher on the other follower gets every bump as an
// acl_version event, and a watcher that starts later finds the versions in
// force in its first snapshot.
func TestAPI_BumpAclVersion(t *testing.T) {
	t.Parallel()
	c := startCluster(t, 3, clusterOpts{fast: true, watchHeartbeat: 50 * time.Millisecond})
	l := c.waitLeader(5 * time.Second)
	fs := c.followers()
	require.Len(t, fs, 2)
	waitSameState(t, c, l)

	recv := watch(t, t.Context(), fs[1].client(), "e1", 0)
	first := recv(5 * time.Second)
	require.NotNil(t, first.GetSnapshot())
	require.Empty(t, first.GetSnapshot().GetAclVersions())

	bump := func(tenant string) uint64 {
		t.Helper()
		resp, err := retry(t.Context(), 10*time.Second, func(ctx context.Context) (*connect.Response[coordinatorv1.BumpAclVersionResponse], error) {
			return fs[0].client().BumpAclVersion(ctx, connect.NewRequest(&coordinatorv1.BumpAclVersionRequest{Tenant: tenant}))
		})
		require.NoError(t, err)
		return resp.Msg.GetVersion()
	}
	v1 := bump("acme")
	v2 := bump("acme")
	vAll := bump("")
	require.Greater(t, v2, v1)
	require.Greater(t, vAll, v2)
	for _, want := range []*coordinatorv1.AclVersionChange{{Tenant: "acme", Version: v1}, {Tenant: "acme", Version: v2}, {Tenant: "", Version: vAll}} {
		m := recv(5 * time.Second)
		require.NotNil(t, m, "no event for %v", want)
		require.Equal(t, want.GetTenant(), m.GetAclVersion().GetTenant(), "got %v", m)
		require.Equal(t, want.GetVersion(), m.GetAclVersion().GetVersion())
		require.Equal(t, want.GetVersion(), m.GetIndex(), "the event's index is the bump's")
	}

	waitSameState(t, c, l)
	later := watch(t, t.Context(), fs[1].client(), "e2", 0)(5 * time.Second)
	require.NotNil(t, later.GetSnapshot())
	got := map[string]uint64{}
	for _, a := range later.GetSnapshot().GetAclVersions() {
		got[a.GetTenant()] = a.GetVersion()
	}
	require.Equal(t, map[string]uint64{"acme": v2, "": vAll}, got)
}
