package remotestore

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
)

// TestExpiryTakesTheSessionsLaterWrites: a write that waited too long fails,
// and so does every later write of its session still queued, young or
// not; sent after the failed one, it would be applied out of its order.
// Other sessions' writes and barriers stay queued, in order.
func TestExpiryTakesTheSessionsLaterWrites(t *testing.T) {
	now := time.Now()
	s := &Store{cfg: Config{MaxQueueWait: time.Second}}
	write := func(id string, age time.Duration) *op {
		return &op{w: &persistencev1.WriteOp{}, call: &call{id: id}, at: now.Add(-age)}
	}
	a1, b1, barrier, a2, anon, b2 := write("a", 2*time.Second), write("b", 500*time.Millisecond), &op{at: now},
		write("a", 0), write("", 0), write("b", 0)
	s.queue = []*op{a1, b1, barrier, a2, anon, b2}

	require.Equal(t, []*op{a1, a2}, s.expiredLocked(now))
	require.Equal(t, []*op{b1, barrier, anon, b2}, s.queue)

	require.Empty(t, s.expiredLocked(now), "nothing else waited too long")
	require.Len(t, s.queue, 4)

	// Once b1 is too old, b2 goes with it; the barrier and the write of no
	// session stay.
	require.Equal(t, []*op{b1, b2}, s.expiredLocked(now.Add(600*time.Millisecond)))
	require.Equal(t, []*op{barrier, anon}, s.queue)
}
