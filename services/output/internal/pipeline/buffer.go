package pipeline

import (
	"context"
	"sync"

	"github.com/keelmq/keel/services/output/internal/wire"
)

// entry is one buffered record.
type entry struct {
	rec  wire.Record
	size int64
}

// buffer is a bounded FIFO of records. Producers never block: a push that
// does not fit is refused. The consumer peeks a batch, works on it and
// commits it only once the sink took it, so a plugin crash or a reload in
// between loses nothing: the batch is still at the head.
type buffer struct {
	mu sync.Mutex
	// q is a ring: the records are the n from q[head], oldest first. It
	// grows by doubling when full and never shrinks, so a buffer that
	// stays busy stops allocating.
	q        []entry
	head     int
	n        int
	bytes    int64
	maxRecs  int
	maxBytes int64
	closed   bool
	notify   chan struct{} // cap 1: signalled on push and close
}

func newBuffer(maxRecs int, maxBytes int64) *buffer {
	return &buffer{maxRecs: maxRecs, maxBytes: maxBytes, notify: make(chan struct{}, 1)}
}

// setLimits changes the bounds; records already buffered stay.
func (b *buffer) setLimits(maxRecs int, maxBytes int64) {
	b.mu.Lock()
	b.maxRecs, b.maxBytes = maxRecs, maxBytes
	b.mu.Unlock()
}

// push appends rec unless the buffer is full or closed.
func (b *buffer) push(rec wire.Record) bool {
	size := int64(rec.Payload) + 64
	b.mu.Lock()
	if b.closed || b.n >= b.maxRecs || b.bytes+size > b.maxBytes {
		b.mu.Unlock()
		return false
	}
	if b.n == len(b.q) {
		b.grow()
	}
	b.q[(b.head+b.n)&(len(b.q)-1)] = entry{rec: rec, size: size}
	b.n++
	b.bytes += size
	b.mu.Unlock()
	select {
	case b.notify <- struct{}{}:
	default:
	}
	return true
}

// grow doubles the ring (its length stays a power of two), keeping the
// records in order from index 0.
func (b *buffer) grow() {
	q := make([]entry, max(64, 2*len(b.q)))
	for i := range b.n {
		q[i] = b.q[(b.head+i)&(len(b.q)-1)]
	}
	b.q, b.head = q, 0
}

// at returns the i-th record from the head.
func (b *buffer) at(i int) *entry { return &b.q[(b.head+i)&(len(b.q)-1)] }

// close refuses further pushes and wakes the consumer.
func (b *buffer) close() {
	b.mu.Lock()
	b.closed = true
	b.mu.Unlock()
	select {
	case b.notify <- struct{}{}:
	default:
	}
}

// peek waits until at least one record is buffered (or the buffer is closed
// and empty, or ctx ends) and returns up to max records and maxBytes from
// the head (at least one record), without removing them. It returns nil when
// there is nothing left to do.
func (b *buffer) peek(ctx context.Context, wake <-chan struct{}, max int, maxBytes int64) wire.Records {
	for {
		b.mu.Lock()
		if out := b.peekLocked(0, max, maxBytes); out != nil {
			b.mu.Unlock()
			return out
		}
		closed := b.closed
		b.mu.Unlock()
		if closed {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
			return nil
		case <-b.notify:
		}
	}
}

// peekFrom is peek of the records after the skip oldest, without waiting:
// nil when there are none.
func (b *buffer) peekFrom(skip, max int, maxBytes int64) wire.Records {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.peekLocked(skip, max, maxBytes)
}

func (b *buffer) peekLocked(skip, max int, maxBytes int64) wire.Records {
	n, size := 0, int64(0)
	for n < max && skip+n < b.n {
		s := b.at(skip + n).size
		if n > 0 && size+s > maxBytes {
			break
		}
		size += s
		n++
	}
	if n == 0 {
		return nil
	}
	out := make(wire.Records, n)
	for i := range n {
		out[i] = b.at(skip + i).rec
	}
	return out
}

// commit removes the n oldest records.
func (b *buffer) commit(n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	n = min(n, b.n)
	for i := range n {
		e := b.at(i)
		b.bytes -= e.size
		*e = entry{}
	}
	if b.n -= n; b.n == 0 {
		b.head = 0
	} else {
		b.head = (b.head + n) & (len(b.q) - 1)
	}
}

// len returns the number of buffered records.
func (b *buffer) len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.n
}

// capacity returns the record bound.
func (b *buffer) capacity() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.maxRecs
}

// closedEmpty reports whether the buffer is closed and drained.
func (b *buffer) closedEmpty() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.closed && b.n == 0
}
