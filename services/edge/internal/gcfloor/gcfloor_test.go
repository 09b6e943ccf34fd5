package gcfloor

import (
	"math"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"testing"
	"time"
)

func gogc(t *testing.T) int {
	t.Helper()
	s := []metrics.Sample{{Name: "/gc/gogc:percent"}}
	metrics.Read(s)
	return int(s[0].Value.Uint64())
}

func cycles() uint64 {
	s := []metrics.Sample{{Name: "/gc/cycles/total:gc-cycles"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

func TestPercentFor(t *testing.T) {
	for _, c := range []struct{ live, roots, floor, base, want int }{
		{live: 1 << 20, roots: 1 << 20, floor: 64 << 20, base: 100, want: 1600},  // the minimum reaches the floor first
		{live: 8 << 20, roots: 16 << 20, floor: 64 << 20, base: 100, want: 350},  // stacks and globals count
		{live: 30 << 20, roots: 30 << 20, floor: 61 << 20, base: 100, want: 104}, // 30 + 30 × 1.04 ≥ 61
		{live: 32 << 20, roots: 32 << 20, floor: 64 << 20, base: 100, want: 100},
		{live: 40 << 20, roots: 40 << 20, floor: 64 << 20, base: 100, want: 100},
		{live: 128 << 20, roots: 128 << 20, floor: 64 << 20, base: 100, want: 100},
		{live: 128 << 20, roots: 128 << 20, floor: 64 << 20, base: 50, want: 50},
		{live: 0, roots: 0, floor: 64 << 20, base: 100, want: 1600},
		{live: 1, roots: 1, floor: 1 << 50, base: 100, want: maxPercent},
	} {
		got := percentFor(c.live, c.roots, c.floor, c.base)
		if got != c.want {
			t.Errorf("percentFor(%d, %d, %d, %d) = %d, want %d", c.live, c.roots, c.floor, c.base, got, c.want)
		}
		if goal := max(c.live+c.roots*got/100, runtimeHeapMinimum*got/100); got < maxPercent && goal < c.floor && got != c.base {
			t.Errorf("percentFor(%d, %d, %d, %d) = %d leaves the goal %d below the floor", c.live, c.roots, c.floor, c.base, got, goal)
		}
	}
}

var sink []byte

// churn allocates n bytes of garbage in 64 KiB pieces.
func churn(n int) {
	for i := 0; i < n>>16; i++ {
		sink = make([]byte, 1<<16)
	}
}

// A small heap is collected once per floor's worth of allocation, not once
// per its own size, and Stop gives the collector its base percent back.
func TestKeep_CollectsASmallHeapOncePerFloor(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(100))
	defer debug.SetMemoryLimit(debug.SetMemoryLimit(math.MaxInt64)) // a GOMEMLIMIT of the environment would win
	runtime.GC()
	before := cycles()
	churn(256 << 20)
	without := cycles() - before

	f := Keep(128<<20, 100)
	if p := gogc(t); p <= 100 {
		f.Stop()
		t.Fatalf("GOGC is %d with a 128 MiB floor over a small heap", p)
	}
	before = cycles()
	churn(256 << 20)
	with := cycles() - before
	f.Stop()
	if p := gogc(t); p != 100 {
		t.Errorf("GOGC is %d after Stop, want 100", p)
	}
	t.Logf("collections while allocating 256 MiB: %d at GOGC=100, %d with a 128 MiB floor", without, with)
	// About 2 with the floor (256 / 128 MiB, and a cycle of lag), and 60 to
	// 90 without on an idle machine; with the machine busy (CI runs test
	// binaries side by side) background marking lags the allocation, and
	// 27 without against 4 with has been seen. The floor's count is the
	// claim; the comparison only shows that the heap is small without it.
	if with > 4 || with*4 > without {
		t.Errorf("%d collections with the floor against %d without", with, without)
	}
}

// The runtime's own heap goal lands on the floor, not past it.
func TestKeep_GoalReachesTheFloor(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(100))
	defer debug.SetMemoryLimit(debug.SetMemoryLimit(math.MaxInt64))
	const floor = 96 << 20
	f := Keep(floor, 100)
	defer f.Stop()
	runtime.GC()
	runtime.GC()
	s := []metrics.Sample{{Name: "/gc/heap/goal:bytes"}}
	metrics.Read(s)
	if goal := s[0].Value.Uint64(); goal < floor || goal > floor*11/10 {
		t.Errorf("heap goal %d MiB with a %d MiB floor (GOGC %d)", goal>>20, floor>>20, gogc(t))
	}
}

// The percent follows the live heap from cycle to cycle: a heap that grows
// past the floor is collected at its base percent, and one that shrinks
// below it gets the floor back.
func TestKeep_FollowsTheLiveHeap(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(100))
	const floor = 16 << 20
	f := Keep(floor, 100)
	defer f.Stop()
	if p := gogc(t); p <= 100 {
		t.Fatalf("GOGC is %d over a small heap with a %d MiB floor", p, floor>>20)
	}
	// until collects until GOGC satisfies ok: the percent changes in a
	// cleanup that runs after a cycle, on a goroutine of the runtime's.
	until := func(ok func(int) bool, what string) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for !ok(gogc(t)) {
			if time.Now().After(deadline) {
				t.Fatalf("GOGC is %d, still not %s", gogc(t), what)
			}
			runtime.GC()
			time.Sleep(time.Millisecond)
		}
	}
	held := make([][]byte, 0, 512)
	for range 512 {
		held = append(held, make([]byte, 64<<10)) // 32 MiB live
	}
	until(func(p int) bool { return p == 100 }, "back at its base with 32 MiB live")
	runtime.KeepAlive(held)
	held = nil
	until(func(p int) bool { return p > 100 }, "raised again once the heap shrank")
}

// A heap holding more than the floor is collected as its base percent says.
func TestKeep_LeavesALargeHeapAtItsBase(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(100))
	held := make([][]byte, 0, 512)
	for range 512 {
		held = append(held, make([]byte, 64<<10)) // 32 MiB live
	}
	f := Keep(8<<20, 100)
	defer f.Stop()
	runtime.GC()
	runtime.GC()
	if p := gogc(t); p != 100 {
		t.Errorf("GOGC is %d with 32 MiB live over an 8 MiB floor, want 100", p)
	}
	runtime.KeepAlive(held)
}

func TestKeep_NoFloorChangesNothing(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(70))
	if f := Keep(0, 100); f != nil {
		t.Fatal("Keep(0) returned a floor")
	}
	runtime.GC()
	runtime.GC()
	if p := gogc(t); p != 70 {
		t.Errorf("GOGC is %d, want 70 untouched", p)
	}
	var f *Floor
	f.Stop() // a nil floor stops as nothing
}
