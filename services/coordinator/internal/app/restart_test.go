package app

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/coordinator/internal/fsm"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
)

// encodedState is st in the snapshot format: the byte-for-byte identity of a
// replica's state.
func encodedState(t testing.TB, st *fsm.State) []byte {
	t.Helper()
	var buf bytes.Buffer
	require.NoError(t, fsm.WriteSnapshot(&buf, st))
	return buf.Bytes()
}

func lastSnapshotIndex(t testing.TB, tn *testNode) uint64 {
	t.Helper()
	v, err := strconv.ParseUint(tn.a().Node().Raft().Stats()["last_snapshot_index"], 10, 64)
	require.NoError(t, err)
	return v
}

// waitSameState waits until every running node has applied up to the leader's
// index and then requires its encoded state to equal the leader's.
func waitSameState(t testing.TB, c *cluster, l *testNode) {
	t.Helper()
	testutil.Eventually(t, 10*time.Second, func() error {
		want := l.a().FSM().State()
		for _, tn := range c.nodes {
			if st := tn.a().FSM().State(); st.Index() != want.Index() {
				return fmt.Errorf("%s at %d, leader at %d", tn.id, st.Index(), want.Index())
			}
		}
		return nil
	})
	want := encodedState(t, l.a().FSM().State())
	for _, tn := range c.nodes {
		require.True(t, bytes.Equal(want, encodedState(t, tn.a().FSM().State())), "%s's state differs from the leader's", tn.id)
	}
}

// claimBatch claims n sessions prefix0..n-1 for edge in one ClaimSessions call.
func claimBatch(t testing.TB, cl client, edge string, inc uint64, prefix string, n int) {
	t.Helper()
	req := &coordinatorv1.ClaimSessionsRequest{EdgeId: edge, Incarnation: inc}
	for i := range n {
		req.Claims = append(req.Claims, &coordinatorv1.SessionClaim{RequestId: fmt.Sprintf("%s-%s-%d", edge, prefix, i), Session: sk("acme", fmt.Sprintf("%s%d", prefix, i))})
	}
	resp, err := retry(t.Context(), 10*time.Second, func(ctx context.Context) (*connect.Response[coordinatorv1.ClaimSessionsResponse], error) {
		return cl.ClaimSessions(ctx, connect.NewRequest(req))
	})
	require.NoError(t, err)
	require.Len(t, resp.Msg.GetResults(), n)
}

// TestCluster_RestartFromSnapshotAndLog forces a snapshot on a follower,
// applies more entries (some while it is down), restarts it on its data and
// requires its state, encoded, to equal the leader's byte for byte; it also
// checks that the node really restored its own snapshot and replayed the log
// after it, not just received everything again.
func TestCluster_RestartFromSnapshotAndLog(t *testing.T) {
	t.Parallel()
	c := startCluster(t, 3, clusterOpts{fast: true})
	l := c.waitLeader(5 * time.Second)
	join(t, l.client(), "e1", 1, 2*time.Second)
	join(t, l.client(), "e2", 1, 2*time.Second)
	claimBatch(t, l.client(), "e1", 1, "a", 50)
	for i := range 5 {
		_, err := claimOne(t.Context(), c.nodes[i%3].client(), "e2", 1, "acme", fmt.Sprintf("a%d", i), fmt.Sprintf("take-%d", i))
		require.NoError(t, err)
	}
	rec := getSession(t, l.client(), "acme", "a10")
	_, err := retry(t.Context(), 10*time.Second, func(ctx context.Context) (*connect.Response[coordinatorv1.ReleaseSessionResponse], error) {
		return l.client().ReleaseSession(ctx, connect.NewRequest(&coordinatorv1.ReleaseSessionRequest{RequestId: "rel-a10",
			Session: sk("acme", "a10"), Epoch: rec.GetEpoch(), EdgeId: "e1", Incarnation: 1}))
	})
	require.NoError(t, err)

	f := c.followers()[0]
	waitSameState(t, c, l)
	require.NoError(t, f.a().Node().Raft().Snapshot().Error())
	snapIdx := lastSnapshotIndex(t, f)
	require.NotZero(t, snapIdx)

	// Entries after the snapshot, in the follower's log.
	claimBatch(t, l.client(), "e1", 1, "b", 50)
	for i := range 5 {
		_, err := claimOne(t.Context(), f.client(), "e2", 1, "acme", fmt.Sprintf("b%d", i), fmt.Sprintf("takeb-%d", i))
		require.NoError(t, err)
	}
	waitSameState(t, c, l)
	before := f.a().FSM().State().Index()
	require.Greater(t, before, snapIdx)

	f.kill()
	// Entries it misses while down.
	claimBatch(t, l.client(), "e2", 1, "c", 20)

	f.start()
	// Right after Raft starts, the node holds its own snapshot: Raft restores
	// it in NewRaft, before it hears from the leader.
	testutil.Eventually(t, 5*time.Second, func() error {
		if f.a().Node().Raft() == nil {
			return errors.New("raft not started")
		}
		return nil
	})
	require.GreaterOrEqual(t, f.a().FSM().State().Index(), snapIdx)
	waitSameState(t, c, l)
	st := f.a().FSM().State()
	require.Equal(t, 50+50+20-1, st.SessionCount())
	require.Equal(t, "e2", st.Session("acme", "b3").GetOwnerEdgeId())
	require.Nil(t, st.Session("acme", "a10"))

	// And a node restarted with nothing new to learn comes back identical too.
	f.kill()
	f.start()
	waitSameState(t, c, l)
}

// watch opens a WatchCluster stream and returns a receive function yielding
// the next message that is not a heartbeat, or nil on timeout.
func watch(t testing.TB, ctx context.Context, cl client, member string, from uint64) func(time.Duration) *coordinatorv1.WatchClusterResponse {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	stream, err := cl.WatchCluster(ctx, connect.NewRequest(&coordinatorv1.WatchClusterRequest{MemberId: member,
		Role: coordinatorv1.MemberRole_MEMBER_ROLE_EDGE, Incarnation: 1, FromIndex: from}))
	require.NoError(t, err)
	msgs := make(chan *coordinatorv1.WatchClusterResponse, 1024)
	go func() {
		defer close(msgs)
		for stream.Receive() {
			if stream.Msg().GetHeartbeat() == nil {
				msgs <- stream.Msg()
			}
		}
	}()
	t.Cleanup(func() { cancel(); _ = stream.Close() })
	return func(d time.Duration) *coordinatorv1.WatchClusterResponse {
		select {
		case m := <-msgs:
			return m
		case <-time.After(d):
			return nil
		}
	}
}

// TestCluster_WatchResume checks WatchCluster's from_index: a watcher that
// reconnects with the last index it processed gets exactly the events it
// missed and no snapshot; one with a current index gets nothing; one whose
// index is older than what the node can replay (here: before the snapshot the
// node restarted from) or ahead of its state gets a full snapshot first.
func TestCluster_WatchResume(t *testing.T) {
	t.Parallel()
	c := startCluster(t, 3, clusterOpts{fast: true, watchHeartbeat: 50 * time.Millisecond})
	l := c.waitLeader(5 * time.Second)
	f := c.followers()[0]
	join(t, l.client(), "e1", 1, 2*time.Second)
	waitSameState(t, c, l)

	recv := watch(t, t.Context(), f.client(), "e1", 0)
	first := recv(5 * time.Second)
	require.NotNil(t, first)
	require.NotNil(t, first.GetSnapshot(), "a new watcher starts with a snapshot")
	require.Len(t, first.GetSnapshot().GetMembers(), 1)
	last := first.GetIndex()
	require.Nil(t, recv(200*time.Millisecond), "nothing happened since")

	// e2 and e3 join while a second watcher is away; it resumes from last.
	join(t, l.client(), "e2", 1, 2*time.Second)
	join(t, l.client(), "e3", 1, 2*time.Second)
	waitSameState(t, c, l)
	recv2 := watch(t, t.Context(), f.client(), "e1", last)
	var joined []string
	for range 2 {
		m := recv2(5 * time.Second)
		require.NotNil(t, m)
		require.Nil(t, m.GetSnapshot(), "a resumed watcher gets no snapshot")
		require.NotNil(t, m.GetMembership(), "got %v", m)
		require.Greater(t, m.GetIndex(), last)
		joined = append(joined, m.GetMembership().GetMember().GetMemberId())
		last = m.GetIndex()
	}
	require.Equal(t, []string{"e2", "e3"}, joined)
	require.Nil(t, recv2(200*time.Millisecond))
	// The watcher that stayed connected saw the same two events.
	for _, id := range []string{"e2", "e3"} {
		m := recv(5 * time.Second)
		require.NotNil(t, m)
		require.Equal(t, id, m.GetMembership().GetMember().GetMemberId())
	}

	// Up to date: nothing is sent but heartbeats.
	recv3 := watch(t, t.Context(), f.client(), "e1", f.a().FSM().State().Index())
	require.Nil(t, recv3(300*time.Millisecond))

	// Ahead of the node's state (it cannot know what the watcher saw): snapshot.
	recv4 := watch(t, t.Context(), f.client(), "e1", f.a().FSM().State().Index()+1000)
	m := recv4(5 * time.Second)
	require.NotNil(t, m)
	require.NotNil(t, m.GetSnapshot())

	// Too old: the node restarted from a snapshot cannot replay what came
	// before it, so a watcher resuming from there gets a full snapshot.
	require.NoError(t, f.a().Node().Raft().Snapshot().Error())
	f.kill()
	f.start()
	waitSameState(t, c, l)
	testutil.Eventually(t, 5*time.Second, func() error {
		if f.a().srv.Ready() != nil {
			return errors.New("restarted node not ready")
		}
		return nil
	})
	recv5 := watch(t, t.Context(), f.client(), "e1", 1)
	m = recv5(5 * time.Second)
	require.NotNil(t, m)
	require.NotNil(t, m.GetSnapshot(), "a watcher older than the node's history gets a snapshot")
	var members []string
	for _, mm := range m.GetSnapshot().GetMembers() {
		members = append(members, mm.GetMemberId())
	}
	require.ElementsMatch(t, []string{"e1", "e2", "e3"}, members)
	require.GreaterOrEqual(t, m.GetIndex(), lastSnapshotIndex(t, f))
}
