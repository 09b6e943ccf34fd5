// Package gcfloor keeps the collector's heap goal from falling below a
// floor.
//
// At GOGC=100 the collector runs each time the heap has grown by as much
// as it holds live. An edge with a few hundred clients holds a few MiB, and
// every message it passes on allocates, so it collected every few
// milliseconds: a sixth of a subscribing edge's CPU across edges went to the
// collector. Raising GOGC alone would let a large heap grow five-fold too;
// a floor costs at most its size, and a heap well above it is collected as
// GOGC says. A memory limit (GOMEMLIMIT) still wins over the floor.
//
// The percent is set after each cycle, from the heap that cycle found live,
// and holds for the next: a live heap that jumps within one cycle from far
// below the floor to near it gets the next goal at the old, high percent
// until the cycle's sweep is done, and GOMEMLIMIT is what bounds that.
package gcfloor

import (
	"math"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync"
)

// maxPercent bounds the GOGC set for a nearly empty heap.
const maxPercent = 1 << 20

// runtimeHeapMinimum is the runtime's smallest heap goal at GOGC=100. It
// scales with GOGC, so a GOGC that lifts a small heap's goal to the floor
// would lift the minimum far past it; percentFor caps GOGC where the
// minimum reaches the floor. TestKeep_GoalReachesTheFloor reads the
// runtime's own goal, and fails if the runtime changes this.
const runtimeHeapMinimum = 4 << 20

// Floor holds the heap goal at or above its size until Stop.
type Floor struct {
	floor, base int

	mu      sync.Mutex
	stopped bool
	percent int
	live    []metrics.Sample
}

// Keep starts holding the heap goal at or above floor bytes, with base as
// the GOGC of a heap that reaches it. It returns nil, and changes nothing,
// for a floor of 0.
func Keep(floor uint64, base int) *Floor {
	if floor == 0 {
		return nil
	}
	f := &Floor{
		floor:   int(min(floor, math.MaxInt64/2)),
		base:    base,
		percent: base,
		live: []metrics.Sample{
			{Name: "/gc/heap/live:bytes"},
			{Name: "/gc/scan/stack:bytes"},
			{Name: "/gc/scan/globals:bytes"},
		},
	}
	f.adjust()
	return f
}

// Stop gives the collector back its base GOGC.
func (f *Floor) Stop() {
	if f == nil {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.stopped = true
	debug.SetGCPercent(f.base)
}

// percentFor is the GOGC whose heap goal reaches floor. The goal is live +
// roots × GOGC/100, where roots is the live heap plus the stacks and globals
// the collector scans.
func percentFor(live, roots, floor, base int) int {
	if live >= floor {
		return base
	}
	p := math.Floor(float64(floor) * 100 / runtimeHeapMinimum)
	if roots > 0 {
		p = min(p, math.Ceil(float64(floor-live)*100/float64(roots)))
	}
	return min(max(int(min(p, maxPercent)), base), maxPercent)
}

// sentinel is garbage from birth: its cleanup runs after the cycle that
// found it so, and sets the percent for the next one.
type sentinel struct{ f *Floor }

func (f *Floor) adjust() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.stopped {
		return
	}
	metrics.Read(f.live)
	var n [3]int
	for i, s := range f.live {
		if s.Value.Kind() == metrics.KindUint64 {
			n[i] = int(min(s.Value.Uint64(), math.MaxInt64/4))
		}
	}
	if p := percentFor(n[0], n[0]+n[1]+n[2], f.floor, f.base); p != f.percent {
		debug.SetGCPercent(p)
		f.percent = p
	}
	runtime.AddCleanup(&sentinel{f: f}, func(f *Floor) { f.adjust() }, f)
}
