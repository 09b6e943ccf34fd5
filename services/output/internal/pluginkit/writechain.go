package pluginkit

import (
	"context"
	"sync"

	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
)

// WriteChain orders a sink plugin's writes, for a sink that declares
// max_writes_in_flight above 1: the host then sends the next write while
// the previous one is being written, so that the plugin decodes and
// converts it meanwhile, and the chain lets it reach the external system
// only after the write it follows (SinkServiceWriteRequest.follows)
// finished, and not at all when that one failed or left records to retry
// (the host retries those first).
type WriteChain struct {
	mu      sync.Mutex
	results map[uint64]bool // whether each recent write left nothing to retry, by sequence
	high    uint64          // highest sequence finished
	turn    chan struct{}   // closed and replaced whenever a write finishes
}

// chainMemory is how many finished writes the chain remembers: far more
// than a host keeps in flight.
const chainMemory = 64

// Wait blocks until the write with sequence follows finished (0: a write
// that follows none goes at once), and reports whether the write waiting
// may go out: false means the one it follows failed, and it must fail
// every record, retryable (and call Done). An error means ctx ended first.
func (c *WriteChain) Wait(ctx context.Context, follows uint64) (bool, error) {
	if follows == 0 {
		return true, nil
	}
	for {
		c.mu.Lock()
		if ok, done := c.results[follows]; done {
			c.mu.Unlock()
			return ok, nil
		}
		if follows+chainMemory <= c.high {
			// Never came, or long forgotten: the host sends again.
			c.mu.Unlock()
			return false, nil
		}
		if c.turn == nil {
			c.turn = make(chan struct{})
		}
		turn := c.turn
		c.mu.Unlock()
		select {
		case <-turn:
		case <-ctx.Done():
			return false, ctx.Err()
		}
	}
}

// Done records that the write with sequence seq finished, and whether it
// left nothing to retry (records refused for good do not count).
func (c *WriteChain) Done(seq uint64, ok bool) {
	if seq == 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.results == nil {
		c.results = map[uint64]bool{}
	}
	c.results[seq] = ok
	c.high = max(c.high, seq)
	for s := range c.results {
		if s+chainMemory <= c.high {
			delete(c.results, s)
		}
	}
	if c.turn != nil {
		close(c.turn)
		c.turn = nil
	}
}

// FailAll is the answer to a write whose predecessor failed: every one of
// its n records failed, retryable.
func FailAll(n int, message string) *pluginv1.SinkServiceWriteResponse {
	out := &pluginv1.SinkServiceWriteResponse{Failures: make([]*pluginv1.RecordFailure, n)}
	for i := range out.Failures {
		out.Failures[i] = &pluginv1.RecordFailure{Index: uint32(i), Retryable: true, Message: message}
	}
	return out
}
