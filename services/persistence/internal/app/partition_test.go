package app

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/persistence/internal/redistest"
)

// TestCluster_PartitionedWriterStopsBeforePromotion: a partition leaves the
// Redis primary with one replica and one persistence instance (p1) on one
// side, cut off from the coordinators; the other instances and two other
// replicas are on the coordinators' side, and cannot reach the primary. The
// old primary keeps a replica, so WAIT 1 still succeeds there: p1 would go
// on acknowledging writes that the promoted replica never gets. It does
// not: its lease lapses and it stops acknowledging, and the promotion on
// the other side waits until the coordinator has seen that lease expire.
// Every batch p1 acknowledged is on the new primary.
//
// Writes wait for two of the three replicas (WAIT 2): the promoter, which
// cannot reach the replica on p1's side, promotes only because every
// acknowledged write is on two replicas, one of which it reaches. With
// WAIT 1 it waits for that replica (TestFailover_WaitsForEveryReplica).
func TestCluster_PartitionedWriterStopsBeforePromotion(t *testing.T) {
	if testing.Short() {
		t.Skip("cluster: skipped under -short")
	}
	redistest.Binary(t)
	// Leases long enough that a promotion not waiting for p1 would come
	// well before p1's lease lapses (renewals every TTL/3, minus the margin).
	const leaseTTL = 6 * time.Second
	apis := startCoordinators(t, "--lease-ttl", leaseTTL.String())
	g := redistest.StartGroup(t, 3, 1)
	primary, cutReplica := g.Primary.Addr, g.Replicas[0].Addr
	replicas := []string{cutReplica, g.Replicas[1].Addr, g.Replicas[2].Addr}

	link := testutil.NewProxy(t, strings.TrimPrefix(apis[0], "http://"))
	wait2 := func(c *Config) { c.MinReplicas = 2 }
	p1 := startInstanceWith(t, "p1", "http://"+link.Addr(), primary, replicas, wait2)
	far := &cutDialer{}
	var others []*instance
	for i, id := range []string{"p2", "p3"} {
		others = append(others, startInstanceWith(t, id, apis[i+1], primary, replicas, func(c *Config) { wait2(c); c.RedisDialer = far.dial }))
	}
	p2 := others[0]
	oldEpoch := p2.status(t).GetGroupRecordEpoch()
	farReplicas := []*redis.Client{g.Replicas[1].Client(), g.Replicas[2].Client()}

	bw := startBatchWriter(t, p1)
	bw.waitFor(t, 50)
	// p1 bootstrapped the group under the promotion lease: the failover
	// on the other side would wait for that lease to run out.
	time.Sleep(5 * time.Second)
	cut := time.Now()
	link.Cut()
	far.cut(primary, cutReplica)

	// A replica on the coordinators' side becomes the primary.
	var promoted time.Time
	testutil.Eventually(t, 30*time.Second, func() error {
		for _, c := range farReplicas {
			if info, err := c.Info(t.Context(), "replication").Result(); err == nil && strings.Contains(info, "role:master") {
				promoted = time.Now()
				return nil
			}
		}
		return errors.New("no replica on the coordinators' side promoted yet")
	})
	testutil.Eventually(t, 10*time.Second, func() error {
		if st := p2.status(t); st.GetRedisPrimary() == primary || st.GetGroupRecordEpoch() <= oldEpoch {
			return fmt.Errorf("p2 follows %s@%d", st.GetRedisPrimary(), st.GetGroupRecordEpoch())
		}
		return nil
	})
	// The old primary, with its replica, still takes p1's writes: give p1
	// time to acknowledge some if it would.
	time.Sleep(time.Second)
	close(bw.stop)
	bw.wg.Wait()

	bw.mu.Lock()
	acked, ackedAt := bw.acked, bw.ackedAt
	statuses := bw.statuses
	bw.mu.Unlock()
	last := ackedAt[len(ackedAt)-1]
	t.Logf("cut at 0; p1's last acknowledgement at %v; promoted by %v; statuses %v",
		last.Sub(cut).Round(time.Millisecond), promoted.Sub(cut).Round(time.Millisecond), statuses)
	require.True(t, last.Before(promoted), "p1 stopped acknowledging before the promotion")

	requireStored(t, p2, acked) // on the new primary
}

// cutDialer dials Redis for instances on one side of a partition: once
// addresses are cut, their connections are closed and new ones refused.
type cutDialer struct {
	mu    sync.Mutex
	isCut map[string]bool
	conns map[string][]net.Conn
}

var errPartitioned = errors.New("partitioned")

func (d *cutDialer) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	d.mu.Lock()
	cut := d.isCut[addr]
	d.mu.Unlock()
	if cut {
		return nil, errPartitioned
	}
	c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.isCut[addr] {
		_ = c.Close()
		return nil, errPartitioned
	}
	if d.conns == nil {
		d.conns = map[string][]net.Conn{}
	}
	d.conns[addr] = append(d.conns[addr], c)
	return c, nil
}

func (d *cutDialer) cut(addrs ...string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.isCut == nil {
		d.isCut = map[string]bool{}
	}
	for _, a := range addrs {
		d.isCut[a] = true
		for _, c := range d.conns[a] {
			_ = c.Close()
		}
		delete(d.conns, a)
	}
}
