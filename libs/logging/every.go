package logging

import (
	"sync/atomic"
	"time"
)

// Every lets a repeated log line through at most once per interval, for
// events a misbehaving peer can cause thousands of times a second (the
// counters count them all). The zero value is ready; safe for concurrent
// use.
type Every struct {
	last atomic.Int64 // Unix nanos of the last line let through
}

// Allow reports whether a line may be logged now, at most once per
// interval; a true answer counts as that line.
func (e *Every) Allow(interval time.Duration) bool {
	now := time.Now().UnixNano()
	last := e.last.Load()
	return now-last >= int64(interval) && e.last.CompareAndSwap(last, now)
}
