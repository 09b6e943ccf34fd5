package broker

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// A message keeps its Deferred after its run was waited for; a write it
// makes when delivered again (a group message re-dispatched, a retry) is
// not collected there, where nobody would wait for it, so that its caller
// waits for it (waitQueued).
func TestDeferred_WritesAfterTheWaitAreNotCollected(t *testing.T) {
	var d Deferred
	d.Message(0)
	require.True(t, d.add(nil, nil, nil, 0), "collected before the wait")
	d.mu.Lock()
	d.waits = nil // nothing to settle here: only the collection is tested
	d.mu.Unlock()
	require.Len(t, d.Wait(1), 1)
	require.False(t, d.add(nil, nil, nil, 0), "not collected after the wait")
	require.False(t, d.Pending())
}
