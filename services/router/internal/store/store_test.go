package store

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
)

// startCluster starts n members on loopback concurrently and waits until each
// one serves.
func startCluster(t *testing.T, n int, mut func(*Config)) []*Store {
	t.Helper()
	cfgs := make([]Config, n)
	var peers []string
	for i := range cfgs {
		cfgs[i] = Config{BindAddr: "127.0.0.1", Port: testutil.FreePort(t), MemberlistPort: testutil.FreePort(t),
			ReplicaCount: 2, WriteQuorum: 2, ReadQuorum: 1, MemberCountQuorum: 2, ReadRepair: true, Env: "local", StartTimeout: 20 * time.Second}
		if mut != nil {
			mut(&cfgs[i])
		}
		peers = append(peers, fmt.Sprintf("127.0.0.1:%d", cfgs[i].MemberlistPort))
	}
	stores := make([]*Store, n)
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range cfgs {
		for j, p := range peers {
			if j != i {
				cfgs[i].Peers = append(cfgs[i].Peers, p)
			}
		}
		s, err := New(cfgs[i], testutil.Logger(t))
		require.NoError(t, err)
		stores[i] = s
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = s.Stop(ctx)
		})
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = s.Start(t.Context()) }()
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	return stores
}

func TestStore_PutGetAcrossMembers(t *testing.T) {
	if testing.Short() {
		t.Skip("multi-node olric")
	}
	t.Parallel()
	s := startCluster(t, 3, nil)
	ctx := t.Context()
	testutil.Eventually(t, 10*time.Second, func() error {
		if got := len(s[2].Members(ctx)); got != 3 {
			return fmt.Errorf("members %d", got)
		}
		return nil
	})
	for i := range 50 {
		require.NoError(t, s[i%3].Put(ctx, fmt.Sprintf("k%d", i), []byte{byte(i)}))
	}
	// Right after members join, Olric v0.5.7 moves partitions around and a
	// read on another member can miss a write for a moment (it is AP during
	// rebalancing; the router covers this by edges re-sending their route
	// sets after a membership change). Every write must become visible.
	for i := range 50 {
		testutil.Eventually(t, 10*time.Second, func() error {
			v, err := s[(i+1)%3].Get(ctx, fmt.Sprintf("k%d", i))
			if err != nil {
				return err
			}
			if len(v) != 1 || v[0] != byte(i) {
				return fmt.Errorf("k%d = %v", i, v)
			}
			return nil
		})
	}
	_, err := s[0].Get(ctx, "missing")
	require.ErrorIs(t, err, ErrNotFound)
	var keys int
	require.NoError(t, s[1].Scan(ctx, "k1", func(string) bool { keys++; return true }))
	require.Equal(t, 11, keys) // k1, k10..k19
}
