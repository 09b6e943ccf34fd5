package loadgen

import (
	"math/bits"
	"time"
)

// histSub is the number of linear sub-buckets per power of two; values are
// kept with a relative error below 1/histSub (about 3 %).
const (
	histSubBits = 5
	histSub     = 1 << histSubBits
	histBuckets = (64 - histSubBits + 1) * histSub
)

// Histogram is a log-linear latency histogram in the spirit of HDR
// Histogram: constant memory, O(1) Record, quantiles within ~3 %. The zero
// value is ready to use. It is not safe for concurrent use; keep one per
// goroutine and [Histogram.Merge] them.
type Histogram struct {
	counts [histBuckets]uint64
	n      uint64
	max    uint64
}

func histIndex(v uint64) int {
	if v < 2*histSub {
		return int(v)
	}
	shift := bits.Len64(v) - histSubBits - 1
	return (shift+1)*histSub + int(v>>shift) - histSub
}

// histLow is the smallest value that maps to bucket i.
func histLow(i int) uint64 {
	if i < 2*histSub {
		return uint64(i)
	}
	shift := i/histSub - 1
	return uint64(i%histSub+histSub) << shift
}

// Record adds one value in nanoseconds. Negative values count as zero.
func (h *Histogram) Record(d time.Duration) {
	v := uint64(max(d, 0))
	h.counts[histIndex(v)]++
	h.n++
	h.max = max(h.max, v)
}

// Merge adds all of o's values to h.
func (h *Histogram) Merge(o *Histogram) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.n += o.n
	h.max = max(h.max, o.max)
}

// Count returns the number of recorded values.
func (h *Histogram) Count() uint64 { return h.n }

// Max returns the largest recorded value.
func (h *Histogram) Max() time.Duration { return time.Duration(h.max) }

// Quantile returns the value at quantile q (0 < q <= 1), as the middle of
// the bucket that holds it, or 0 if the histogram is empty.
func (h *Histogram) Quantile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	rank := uint64(q*float64(h.n) + 0.5)
	rank = min(max(rank, 1), h.n)
	var seen uint64
	for i, c := range h.counts {
		seen += c
		if seen >= rank {
			lo, hi := histLow(i), histLow(i+1)
			return time.Duration(min(lo+(hi-lo)/2, h.max))
		}
	}
	return time.Duration(h.max)
}
