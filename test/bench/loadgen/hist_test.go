package loadgen

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestHistogram_IndexMonotonic(t *testing.T) {
	t.Parallel()
	prev := -1
	for v := uint64(0); v < 1<<40; v += 1 + v/1024 {
		i := histIndex(v)
		if i < prev || histLow(i) > v || histLow(i+1) <= v {
			t.Fatalf("v=%d index %d (prev %d) bounds [%d,%d)", v, i, prev, histLow(i), histLow(i+1))
		}
		prev = i
	}
	require.Less(t, histIndex(1<<63), histBuckets)
}

func TestHistogram_QuantileAgainstSorted(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(1, 2))
	var h, a, b Histogram
	vals := make([]time.Duration, 100_000)
	for i := range vals {
		vals[i] = time.Duration(rng.ExpFloat64() * float64(200*time.Microsecond))
		h.Record(vals[i])
		if i%2 == 0 {
			a.Record(vals[i])
		} else {
			b.Record(vals[i])
		}
	}
	a.Merge(&b)
	slices.Sort(vals)
	for _, q := range []float64{0.5, 0.9, 0.99, 0.999} {
		want := float64(vals[int(q*float64(len(vals)))-1])
		got := float64(h.Quantile(q))
		require.InEpsilon(t, want, got, 0.04, "q=%v", q)
		require.Equal(t, h.Quantile(q), a.Quantile(q))
	}
	require.Equal(t, vals[len(vals)-1], h.Max())
	require.Equal(t, uint64(len(vals)), h.Count())
}

func TestBitset_Set(t *testing.T) {
	t.Parallel()
	var b bitset
	require.False(t, b.has(1000))
	require.False(t, b.set(1000))
	require.True(t, b.set(1000))
	require.True(t, b.has(1000))
	require.False(t, b.has(999))
	require.False(t, b.set(0))
	require.True(t, b.has(0))
}
