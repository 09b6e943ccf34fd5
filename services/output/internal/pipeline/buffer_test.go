package pipeline

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/output/internal/wire"
)

func rec(i int) wire.Record { return wire.Record{Ingress: int64(i), Payload: 36} } // 100 bytes with the 64 of overhead

// TestBuffer_FIFOAcrossWrapAndGrowth: records come out in the order they
// went in, whole batches at a time, while the ring wraps around and grows
// with records at both ends; the bounds hold throughout.
func TestBuffer_FIFOAcrossWrapAndGrowth(t *testing.T) {
	b := newBuffer(1000, 1000*100)
	ctx := context.Background()
	next, want := 0, 0
	push := func(n int) {
		for range n {
			require.True(t, b.push(rec(next)))
			next++
		}
	}
	take := func(max int) {
		recs := b.peek(ctx, nil, max, 1<<30)
		require.NotEmpty(t, recs)
		for _, r := range recs {
			require.Equal(t, int64(want), r.Ingress)
			want++
		}
		// Peeking again without a commit gives the same head.
		require.Equal(t, recs[0].Ingress, b.peek(ctx, nil, 1, 1<<30)[0].Ingress)
		b.commit(len(recs))
	}
	push(50) // ring of 64
	take(40)
	push(40) // wraps: 10 at the end, 40 from the start
	require.Len(t, b.q, 64)
	push(30) // full at 64 while wrapped: grows
	require.Equal(t, 80, b.len())
	for b.len() > 0 {
		take(7)
	}
	require.Zero(t, b.bytes)

	// Bounds: records, then bytes.
	push(1000)
	require.False(t, b.push(rec(-1)))
	take(1000)
	b.setLimits(1000, 250)
	push(2)
	require.False(t, b.push(rec(-1)), "a third record would pass the byte bound")

	// A batch stops before the byte bound (but holds at least one record).
	require.Len(t, b.peek(ctx, nil, 10, 150), 1)
	require.Len(t, b.peek(ctx, nil, 10, 200), 2)
}

// TestBuffer_CloseDrains: a closed buffer refuses pushes and hands out what
// it holds, then nothing.
func TestBuffer_CloseDrains(t *testing.T) {
	b := newBuffer(10, 1<<20)
	require.True(t, b.push(rec(1)))
	b.close()
	require.False(t, b.push(rec(2)))
	require.False(t, b.closedEmpty())
	recs := b.peek(context.Background(), nil, 10, 1<<20)
	require.Len(t, recs, 1)
	b.commit(1)
	require.True(t, b.closedEmpty())
	require.Nil(t, b.peek(context.Background(), nil, 10, 1<<20))
}
