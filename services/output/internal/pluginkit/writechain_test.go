package pluginkit

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A write waits for the one it follows, goes when that one left nothing to
// retry, and is refused (with every one after it) when it did. A write
// that follows none goes at once, and a late write of a run that failed
// stays refused whatever came since.
func TestWriteChain(t *testing.T) {
	var c WriteChain
	ok, err := c.Wait(t.Context(), 0)
	require.True(t, ok)
	require.NoError(t, err)

	went := make(chan bool, 1)
	go func() {
		ok, _ := c.Wait(context.Background(), 1)
		went <- ok
	}()
	select {
	case <-went:
		t.Fatal("write 2 went before write 1 finished")
	case <-time.After(50 * time.Millisecond):
	}
	c.Done(1, true)
	require.True(t, <-went)
	c.Done(2, false)

	ok, err = c.Wait(t.Context(), 2)
	require.NoError(t, err)
	require.False(t, ok, "behind a write that left records to retry")
	c.Done(3, false)
	ok, _ = c.Wait(t.Context(), 3)
	require.False(t, ok, "the refusal carries on down the run")

	// A new run, then a late write of the failed one.
	c.Done(5, true)
	ok, _ = c.Wait(t.Context(), 5)
	require.True(t, ok)
	ok, _ = c.Wait(t.Context(), 3)
	require.False(t, ok, "a late write behind the failed run is refused")

	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	_, err = c.Wait(ctx, 9)
	require.ErrorIs(t, err, context.DeadlineExceeded, "a write whose predecessor never comes waits only as long as its call")
	for s := uint64(10); s < 10+chainMemory; s++ {
		c.Done(s, true)
	}
	ok, err = c.Wait(t.Context(), 9)
	require.NoError(t, err)
	require.False(t, ok, "one that never came, long past, is taken for failed")

	require.Len(t, FailAll(3, "x").GetFailures(), 3)
	for i, f := range FailAll(3, "x").GetFailures() {
		require.Equal(t, uint32(i), f.GetIndex())
		require.True(t, f.GetRetryable())
	}
}
