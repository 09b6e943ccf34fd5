package cluster

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
)

// aclVersions records the ACL versions a watch tells.
type aclVersions struct {
	mu   sync.Mutex
	seen map[string]uint64
}

func (a *aclVersions) ACLVersion(tenant string, version uint64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.seen[tenant] = max(a.seen[tenant], version)
}

func (a *aclVersions) atLeast(tenant string, version uint64) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.seen[tenant] < version {
		return fmt.Errorf("tenant %s: version %d told, want %d", tenant, a.seen[tenant], version)
	}
	return nil
}

// TestWatch_ReopensAStreamThatWentSilent runs a real coordinator behind a
// proxy, and an edge's cluster watch through the proxy. Once the proxy
// stalls the watch's connection (it stays open and carries nothing, as
// through a network that drops everything), an ACL bump still reaches the
// edge: the watch gives the silent stream up and opens another.
func TestWatch_ReopensAStreamThatWentSilent(t *testing.T) {
	t.Parallel()
	coordURL, _ := startCoordinator(t, 10*time.Second)
	proxy := testutil.NewProxy(t, strings.TrimPrefix(coordURL, "http://"))
	acl := &aclVersions{seen: map[string]uint64{}}
	w := &Watch{Client: NewClient("http://" + proxy.Addr()), Self: "edge-silent", Incarnation: func() uint64 { return 1 },
		ACL: acl, Logger: testutil.Logger(t), Silence: 3 * time.Second}
	go func() { _ = w.Run(t.Context()) }()

	admin := NewClient(coordURL)
	bump := func() uint64 {
		t.Helper()
		resp, err := admin.BumpAclVersion(t.Context(), connect.NewRequest(&coordinatorv1.BumpAclVersionRequest{Tenant: "acme"}))
		require.NoError(t, err)
		return resp.Msg.GetVersion()
	}
	first := bump()
	testutil.Eventually(t, 15*time.Second, func() error { return acl.atLeast("acme", first) })

	proxy.Stall()
	second := bump()
	require.Greater(t, second, first)
	testutil.Eventually(t, 15*time.Second, func() error { return acl.atLeast("acme", second) })
}
