package server

import (
	"fmt"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/coordinator/internal/discovery"
	"github.com/keelmq/keel/services/coordinator/internal/fsm"
)

// TestServer_AnOlderCoordinatorIsNotAddedAsAVoter: a coordinator that
// applies fewer commands than the leader (a downgraded node) would stop at
// the first entry of the log it cannot decode, so the leader leaves it out
// of the voters until it advertises the leader's command set.
func TestServer_AnOlderCoordinatorIsNotAddedAsAVoter(t *testing.T) {
	ts := newTestServer(t, true, nil)
	n2 := newTestNode(t, "n2")
	require.NoError(t, n2.Start())
	t.Cleanup(func() { _ = n2.Kill() })

	member := func(commands fsm.CommandType) discovery.Member {
		return discovery.Member{Name: "n2", Meta: discovery.Meta{Role: discovery.RoleCoordinator, ID: "n2",
			RaftAddr: n2.Addr(), Commands: int(commands)}}
	}
	voters := func() []raft.ServerID {
		servers, err := ts.node.Servers()
		require.NoError(t, err)
		var ids []raft.ServerID
		for _, sv := range servers {
			if sv.Suffrage == raft.Voter {
				ids = append(ids, sv.ID)
			}
		}
		return ids
	}
	missing, refused := map[string]time.Time{}, map[string]int{}

	for _, older := range []fsm.CommandType{0, fsm.NewestCommand - 1} {
		ts.peers.set(self(fsm.NewestCommand), member(older))
		ts.s.reconcileVoters(missing, refused)
		require.Equal(t, []raft.ServerID{"n1"}, voters(), "a node applying commands up to %d", older)
		require.Equal(t, 1.0, promtest.ToFloat64(ts.s.metrics.votersRefused))
	}

	ts.peers.set(self(fsm.NewestCommand), member(fsm.NewestCommand))
	ts.s.reconcileVoters(missing, refused)
	require.ElementsMatch(t, []raft.ServerID{"n1", "n2"}, voters())
	require.Zero(t, promtest.ToFloat64(ts.s.metrics.votersRefused))
	testutil.Eventually(t, 10*time.Second, func() error {
		if got, want := n2.Raft().AppliedIndex(), ts.node.Raft().AppliedIndex(); got < want {
			return fmt.Errorf("n2 applied %d of %d", got, want)
		}
		return nil
	})
}
