package app

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
)

// TestCluster_BootstrapExpect starts three coordinators that know only each
// other's gossip addresses and --bootstrap-expect=3: they must form one
// cluster with three voters and agree on the leader.
func TestCluster_BootstrapExpect(t *testing.T) {
	t.Parallel()
	c := startCluster(t, 3, clusterOpts{fast: true, strictFormation: true})
	l := c.waitLeader(5 * time.Second)
	testutil.Eventually(t, 5*time.Second, func() error {
		for _, tn := range c.nodes {
			servers, err := tn.a().Node().Servers()
			if err != nil {
				return err
			}
			if len(servers) != 3 {
				return fmt.Errorf("%s sees %d servers", tn.id, len(servers))
			}
			resp, err := tn.client().Status(t.Context(), connect.NewRequest(&coordinatorv1.StatusRequest{}))
			if err != nil {
				return err
			}
			if resp.Msg.GetLeaderId() != l.id || resp.Msg.GetLeaderAddress() != "http://"+l.apiAddr {
				return fmt.Errorf("%s sees leader %q at %q", tn.id, resp.Msg.GetLeaderId(), resp.Msg.GetLeaderAddress())
			}
		}
		return nil
	})
}

// TestCluster_KillLeader claims sessions, kills the leader hard, and checks
// that a new leader is elected, every acknowledged claim is still there, and
// the old leader, restarted on its data, catches up while claims go on.
func TestCluster_KillLeader(t *testing.T) {
	t.Parallel()
	c := startCluster(t, 3, clusterOpts{fast: true})
	l := c.waitLeader(5 * time.Second)
	f := c.followers()[0]
	join(t, f.client(), "e1", 1, 2*time.Second)

	want := map[string]uint64{}
	for i := range 40 {
		id := fmt.Sprintf("c%d", i)
		g, err := claimOne(t.Context(), c.nodes[i%3].client(), "e1", 1, "acme", id, "req-"+id)
		require.NoError(t, err)
		want[id] = g.GetEpoch()
	}

	killed := time.Now()
	require.NoError(t, l.a().Node().Kill())
	nl := c.waitLeader(10 * time.Second)
	require.NotEqual(t, l.id, nl.id)
	t.Logf("failover took %v", time.Since(killed))
	l.stop()
	for id, ep := range want {
		rec := getSession(t, f.client(), "acme", id)
		require.Equal(t, ep, rec.GetEpoch(), id)
		require.Equal(t, "e1", rec.GetOwnerEdgeId())
	}
	// A retried claim with a request ID from before the kill is not applied twice.
	g, err := claimOne(t.Context(), nl.client(), "e1", 1, "acme", "c0", "req-c0")
	require.NoError(t, err)
	require.Equal(t, want["c0"], g.GetEpoch())

	l.start()
	for i := 40; i < 240; i++ {
		_, err := claimOne(t.Context(), nl.client(), "e1", 1, "acme", fmt.Sprintf("c%d", i), "")
		require.NoError(t, err)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		a, b := l.a().FSM().State(), nl.a().FSM().State()
		if a.SessionCount() != 240 || a.Index() != b.Index() {
			return fmt.Errorf("restarted node has %d sessions at %d, leader %d at %d", a.SessionCount(), a.Index(), b.SessionCount(), b.Index())
		}
		return nil
	})
}

// TestCluster_ClaimRace has many goroutines claim the same few sessions for
// two edges through all three nodes, then checks every answer against a
// sequential model: per session, epochs are strictly increasing and each grant
// names as previous exactly the grant before it.
func TestCluster_ClaimRace(t *testing.T) {
	t.Parallel()
	c := startCluster(t, 3, clusterOpts{fast: true})
	join(t, c.nodes[0].client(), "e1", 1, 2*time.Second)
	join(t, c.nodes[1].client(), "e2", 1, 2*time.Second)

	type grant struct {
		edge                  string
		epoch, prevEpoch      uint64
		prevOwner, sessionKey string
	}
	const workers, perWorker, sessions = 12, 25, 4
	results := make(chan grant, workers*perWorker)
	errs := make(chan error, workers)
	for w := range workers {
		go func() {
			edge := []string{"e1", "e2"}[w%2]
			cl := c.nodes[w%3].client()
			for i := range perWorker {
				id := fmt.Sprintf("s%d", (w+i)%sessions)
				// A request ID per claim: a retry after an unknown outcome
				// (a leader change mid-claim) gets the first answer instead
				// of a second grant the model would not know of.
				g, err := claimOne(t.Context(), cl, edge, 1, "acme", id, fmt.Sprintf("w%d-%d", w, i))
				if err != nil {
					errs <- err
					return
				}
				results <- grant{edge: edge, epoch: g.GetEpoch(), prevEpoch: g.GetPrevious().GetEpoch(),
					prevOwner: g.GetPrevious().GetOwnerEdgeId(), sessionKey: id}
			}
			errs <- nil
		}()
	}
	for range workers {
		require.NoError(t, <-errs)
	}
	close(results)
	bySession := map[string]map[uint64]grant{}
	for g := range results {
		if bySession[g.sessionKey] == nil {
			bySession[g.sessionKey] = map[uint64]grant{}
		}
		_, dup := bySession[g.sessionKey][g.epoch]
		require.False(t, dup, "epoch %d granted twice for %s", g.epoch, g.sessionKey)
		bySession[g.sessionKey][g.epoch] = g
	}
	total := 0
	for id, grants := range bySession {
		// Replay the grants in epoch order against the model.
		var epochs []uint64
		for e := range grants {
			epochs = append(epochs, e)
		}
		sortU64(epochs)
		var prev *grant
		for _, e := range epochs {
			g := grants[e]
			if prev == nil {
				require.Zero(t, g.prevEpoch, "%s: first grant has no previous", id)
			} else {
				require.Equal(t, prev.epoch, g.prevEpoch, "%s: previous epoch", id)
				require.Equal(t, prev.edge, g.prevOwner, "%s: previous owner", id)
			}
			prev = &g
			total++
		}
		rec := getSession(t, c.nodes[2].client(), "acme", id)
		require.Equal(t, prev.epoch, rec.GetEpoch())
		require.Equal(t, prev.edge, rec.GetOwnerEdgeId())
	}
	require.Equal(t, workers*perWorker, total)
}

func sortU64(s []uint64) {
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
}

// TestCluster_MinorityPartition cuts the leader's Raft transport off: the
// minority (the old leader alone) cannot commit a claim, the majority elects a
// new leader and can, and after healing every node converges on the
// majority's state, without the claim the minority could not commit.
func TestCluster_MinorityPartition(t *testing.T) {
	t.Parallel()
	c := startCluster(t, 3, clusterOpts{fast: true})
	l := c.waitLeader(5 * time.Second)
	stopRenew := join(t, l.client(), "e1", 1, 5*time.Second)
	_, err := claimOne(t.Context(), l.client(), "e1", 1, "acme", "before", "")
	require.NoError(t, err)
	stopRenew()

	l.a().Node().Isolate(true)
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	_, err = l.client().ClaimSession(ctx, connect.NewRequest(&coordinatorv1.ClaimSessionRequest{
		Session: sk("acme", "minority"), EdgeId: "e1", Incarnation: 1}))
	cancel()
	require.Error(t, err, "an isolated leader cannot commit")

	var nl *testNode
	testutil.Eventually(t, 10*time.Second, func() error {
		for _, tn := range c.nodes {
			if tn != l && tn.a().Node().IsLeader() && tn.a().srv.Ready() == nil {
				nl = tn
				return nil
			}
		}
		return errors.New("no new leader in the majority")
	})
	join(t, nl.client(), "e1", 1, 5*time.Second)
	_, err = claimOne(t.Context(), nl.client(), "e1", 1, "acme", "majority", "")
	require.NoError(t, err)

	l.a().Node().Isolate(false)
	testutil.Eventually(t, 10*time.Second, func() error {
		want := nl.a().FSM().State()
		for _, tn := range c.nodes {
			st := tn.a().FSM().State()
			if st.Index() != want.Index() || st.SessionCount() != 2 || st.Session("acme", "majority") == nil {
				return fmt.Errorf("%s at %d with %d sessions, leader at %d", tn.id, st.Index(), st.SessionCount(), want.Index())
			}
			if st.Session("acme", "minority") != nil {
				return fmt.Errorf("%s has the minority's claim", tn.id)
			}
		}
		return nil
	})
}
