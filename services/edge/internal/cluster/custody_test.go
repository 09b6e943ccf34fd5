package cluster

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
)

// flakyCustodian fails each session's first failures tries.
type flakyCustodian struct {
	failures int
	mu       sync.Mutex
	tries    map[string]int
	seen     map[string]uint64 // client ID → epoch of the last try
	adopted  map[string]uint64 // client ID → epoch
}

func (c *flakyCustodian) TakeCustody(_ context.Context, tenant, clientID string, epoch uint64) (bool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.tries[clientID]++
	if c.seen != nil {
		c.seen[clientID] = epoch
	}
	if c.tries[clientID] <= c.failures {
		return false, errors.New("store unavailable")
	}
	c.adopted[clientID] = epoch
	return true, nil
}

// TestWatch_CustodyTriedUntilAdopted: sessions of an edge whose lease
// expired are assigned to the watching edge by a real coordinator, a
// custody that fails is tried again, off the workers, until it succeeds,
// and a watch that starts over finds them in its snapshot.
func TestWatch_CustodyTriedUntilAdopted(t *testing.T) {
	t.Parallel()
	url, _ := startCoordinator(t, time.Second)
	logger := testutil.Logger(t)
	client := NewClient(url)

	dead := &Member{Client: client, ID: "edge-dead", Logger: logger, Margin: 100 * time.Millisecond}
	require.NoError(t, dead.Join(t.Context()))
	deadCtx, stopDead := context.WithCancel(t.Context())
	go func() { _ = dead.Run(deadCtx) }()
	owner := &Ownership{Client: client, Member: dead, MaxBatch: 8}
	var epochs []uint64
	for i := range 3 {
		g, err := owner.Claim(t.Context(), "acme", fmt.Sprintf("dev-%d", i))
		require.NoError(t, err)
		epochs = append(epochs, g.Epoch)
	}

	live := &Member{Client: client, ID: "edge-live", Logger: logger, Margin: 100 * time.Millisecond}
	require.NoError(t, live.Join(t.Context()))
	go func() { _ = live.Run(t.Context()) }()
	custodian := &flakyCustodian{failures: 2, tries: map[string]int{}, seen: map[string]uint64{}, adopted: map[string]uint64{}}
	w := &Watch{Client: client, Self: "edge-live", Incarnation: live.Incarnation, Custodian: custodian, Logger: logger, Workers: 1}
	go func() { _ = w.Run(t.Context()) }()

	stopDead() // its lease runs out
	testutil.Eventually(t, 20*time.Second, func() error {
		custodian.mu.Lock()
		defer custodian.mu.Unlock()
		if len(custodian.adopted) < 3 {
			for id, epoch := range custodian.seen {
				if _, ok := custodian.adopted[id]; !ok && w.AdoptedThrough() >= epoch {
					t.Errorf("custody reported done through %d, %s of epoch %d not adopted", w.AdoptedThrough(), id, epoch)
				}
			}
			return fmt.Errorf("adopted %v after tries %v", custodian.adopted, custodian.tries)
		}
		// The watch counts a job done once TakeCustody has returned.
		for id, epoch := range custodian.adopted {
			if through := w.AdoptedThrough(); through < epoch {
				return fmt.Errorf("%s adopted under %d, reported through %d", id, epoch, through)
			}
		}
		return nil
	})
	custodian.mu.Lock()
	for i := range 3 {
		id := fmt.Sprintf("dev-%d", i)
		require.Equal(t, 3, custodian.tries[id], "%s: two failures, then adopted", id)
		require.Greater(t, custodian.adopted[id], epochs[i], "%s: custody comes with a newer epoch", id)
		require.GreaterOrEqual(t, w.AdoptedThrough(), custodian.adopted[id], "%s: reported adopted once it is", id)
	}
	adopted := maps.Clone(custodian.adopted)
	custodian.mu.Unlock()

	// A watch that starts over (from a snapshot, as after reconnecting to
	// a coordinator that cannot replay what it missed) is handed the
	// sessions in custody again, with their epochs.
	again := &flakyCustodian{tries: map[string]int{}, adopted: map[string]uint64{}}
	w2 := &Watch{Client: client, Self: "edge-live", Incarnation: live.Incarnation, Custodian: again, Logger: logger}
	go func() { _ = w2.Run(t.Context()) }()
	testutil.Eventually(t, 10*time.Second, func() error {
		again.mu.Lock()
		defer again.mu.Unlock()
		if !maps.Equal(again.adopted, adopted) {
			return fmt.Errorf("from the snapshot: %v, want %v", again.adopted, adopted)
		}
		return nil
	})
}

// Custody jobs end out of order; what is reported done is everything below
// the lowest epoch still open, and everything received once none is.
func TestCustodyProgress_DoneBelowTheLowestOpen(t *testing.T) {
	var p custodyProgress
	require.Zero(t, p.through())
	p.start(10)
	p.start(10)
	p.start(12)
	require.Equal(t, uint64(9), p.through())
	p.done(12)
	p.done(10)
	require.Equal(t, uint64(9), p.through(), "one job of epoch 10 is open still")
	p.done(10)
	require.Equal(t, uint64(12), p.through())
	p.start(15)
	require.Equal(t, uint64(14), p.through())
	p.done(15)
	// An edge that does not adopt (no shared store) is done on arrival.
	p.skip([]*coordinatorv1.SessionEpoch{{Epoch: 20}, {Epoch: 18}})
	require.Equal(t, uint64(20), p.through())
}
