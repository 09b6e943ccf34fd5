package logging

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestEvery_OncePerInterval: of many concurrent callers one line goes
// through, and another only once the interval has passed.
func TestEvery_OncePerInterval(t *testing.T) {
	var e Every
	var allowed atomic.Int32
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			if e.Allow(time.Hour) {
				allowed.Add(1)
			}
		})
	}
	wg.Wait()
	if n := allowed.Load(); n != 1 {
		t.Fatalf("%d lines let through, want 1", n)
	}
	if e.Allow(time.Hour) {
		t.Fatal("a second line within the interval")
	}
	time.Sleep(5 * time.Millisecond)
	if !e.Allow(time.Millisecond) {
		t.Fatal("no line once the interval passed")
	}
}
