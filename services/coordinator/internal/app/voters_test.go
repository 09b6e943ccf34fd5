package app

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
)

func voterIDs(t testing.TB, tn *testNode) []string {
	t.Helper()
	servers, err := tn.a().Node().Servers()
	require.NoError(t, err)
	var ids []string
	for _, s := range servers {
		ids = append(ids, string(s.ID))
	}
	slices.Sort(ids)
	return ids
}

// TestCluster_DeadServerRemoval stops a follower for good: with
// --dead-server-timeout the leader removes it from the Raft configuration, not
// before the timeout, and the remaining two keep committing. When the node
// comes back on its data it is added as a voter again and catches up.
func TestCluster_DeadServerRemoval(t *testing.T) {
	t.Parallel()
	const timeout = 1500 * time.Millisecond
	c := startCluster(t, 3, clusterOpts{fast: true, deadServerTimeout: timeout})
	l := c.waitLeader(5 * time.Second)
	testutil.Eventually(t, 5*time.Second, func() error {
		if ids := voterIDs(t, l); len(ids) != 3 {
			return fmt.Errorf("voters %v", ids)
		}
		return nil
	})
	f := c.followers()[0]
	stopped := time.Now()
	f.stop() // leaves gossip, as a deleted pod would

	var removedAfter time.Duration
	testutil.Eventually(t, 10*time.Second, func() error {
		l := c.waitLeader(5 * time.Second)
		if ids := voterIDs(t, l); slices.Contains(ids, f.id) {
			return fmt.Errorf("voters still %v", ids)
		}
		removedAfter = time.Since(stopped)
		return nil
	})
	t.Logf("dead voter removed after %v (timeout %v)", removedAfter, timeout)
	require.GreaterOrEqual(t, removedAfter, timeout, "removed before --dead-server-timeout")

	l = c.waitLeader(5 * time.Second)
	join(t, l.client(), "e1", 1, 2*time.Second)
	_, err := claimOne(t.Context(), l.client(), "e1", 1, "acme", "after-removal", "r1")
	require.NoError(t, err, "the two remaining voters commit")

	f.start()
	testutil.Eventually(t, 10*time.Second, func() error {
		l := c.leader()
		if l == nil {
			return errors.New("no leader")
		}
		if ids := voterIDs(t, l); !slices.Contains(ids, f.id) {
			return fmt.Errorf("voters %v", ids)
		}
		if f.a().FSM().State().Session("acme", "after-removal") == nil {
			return errors.New("returned node has not caught up")
		}
		return nil
	})
}

// TestCluster_DeadServerRemoval_KeepsQuorum stops two of three voters at
// once: the leader never removes voters when the alive ones would not be a
// majority without them (and soon cannot commit anything anyway), so the
// configuration keeps all three and the cluster recovers when they return.
// (Stopped one after the other, more than the timeout apart, the first one
// would rightly be removed while a majority remained.)
func TestCluster_DeadServerRemoval_KeepsQuorum(t *testing.T) {
	t.Parallel()
	const timeout = time.Second
	c := startCluster(t, 3, clusterOpts{fast: true, deadServerTimeout: timeout})
	c.waitLeader(5 * time.Second)
	fs := c.followers()
	var wg sync.WaitGroup
	for _, f := range fs {
		wg.Add(1)
		// Kill Raft first: a graceful stop leaves gossip before Raft, and in
		// that window the leader still has a majority and may rightly remove
		// the node that already left.
		go func() { defer wg.Done(); f.kill() }()
	}
	wg.Wait()
	time.Sleep(2 * timeout)
	var alive *testNode
	for _, tn := range c.nodes {
		if tn.running() {
			alive = tn
		}
	}
	require.Len(t, voterIDs(t, alive), 3, "a node without quorum removed voters")
	fs[0].start()
	fs[1].start()
	l := c.waitLeader(15 * time.Second)
	testutil.Eventually(t, 5*time.Second, func() error {
		if ids := voterIDs(t, l); len(ids) != 3 {
			return fmt.Errorf("voters %v", ids)
		}
		return nil
	})
}

// BenchmarkCluster_Failover measures leader failover with the production
// (default) Raft timeouts: from a hard kill of the leader to the first claim
// acknowledged by the new leader, through a surviving node's API, as an edge
// retrying every 10 ms would see it. Each iteration restarts the old leader
// and waits for it to catch up before the next kill.
//
//	go test -run '^$' -bench BenchmarkCluster_Failover -benchtime 5x ./internal/app/
func BenchmarkCluster_Failover(b *testing.B) {
	c := startCluster(b, 3, clusterOpts{leaseTTL: 10 * time.Second})
	b.StopTimer()
	var total, worst, electTotal time.Duration
	for i := 0; i < b.N; i++ {
		l := c.waitLeader(15 * time.Second)
		var survivor *testNode
		for _, tn := range c.nodes {
			if tn != l {
				survivor = tn
				break
			}
		}
		cl := survivor.client()
		// Renew the edge's lease (the new leader grants it a full TTL anyway).
		_, err := retry(b.Context(), 10*time.Second, func(ctx context.Context) (*connect.Response[coordinatorv1.RenewLeaseResponse], error) {
			return cl.RenewLease(ctx, connect.NewRequest(&coordinatorv1.RenewLeaseRequest{MemberId: "e1", Role: coordinatorv1.MemberRole_MEMBER_ROLE_EDGE,
				Incarnation: 1, Address: "http://e1", State: coordinatorv1.MemberState_MEMBER_STATE_ALIVE}))
		})
		if err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		killed := time.Now()
		if err := l.a().Node().Kill(); err != nil {
			b.Fatal(err)
		}
		var elected time.Duration
		for n := 0; ; n++ {
			if elected == 0 && c.leader() != nil {
				elected = time.Since(killed)
			}
			ctx, cancel := context.WithTimeout(b.Context(), 500*time.Millisecond)
			_, err := cl.ClaimSession(ctx, connect.NewRequest(&coordinatorv1.ClaimSessionRequest{RequestId: fmt.Sprintf("f%d", i),
				Session: sk("acme", fmt.Sprintf("f%d", i)), EdgeId: "e1", Incarnation: 1}))
			cancel()
			if err == nil {
				break
			}
			if time.Since(killed) > 30*time.Second {
				b.Fatalf("no leader serving 30s after the kill: %v", err)
			}
			time.Sleep(10 * time.Millisecond)
		}
		d := time.Since(killed)
		b.StopTimer()
		if elected == 0 {
			elected = d
		}
		b.Logf("kill %d: leader %s → serving after %v (ready leader seen after %v)", i, l.id, d, elected)
		total += d
		electTotal += elected
		worst = max(worst, d)
		l.stop()
		l.start()
		testutil.Eventually(b, 20*time.Second, func() error {
			nl := c.leader()
			if nl == nil || l.a().FSM().State().Index() != nl.a().FSM().State().Index() {
				return errors.New("restarted node not caught up")
			}
			return nil
		})
	}
	b.ReportMetric(float64(total.Milliseconds())/float64(b.N), "failover-ms")
	b.ReportMetric(float64(electTotal.Milliseconds())/float64(b.N), "elected-ms")
	b.ReportMetric(float64(worst.Milliseconds()), "max-failover-ms")
}
