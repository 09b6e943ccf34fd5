package pipeline

import (
	"context"
	"sync"

	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
)

// entry is one buffered record.
type entry struct {
	rec  *pluginv1.Record
	size int64
}

// buffer is a bounded FIFO of records. Producers never block: a push that
// does not fit is refused. The consumer peeks a batch, works on it and
// commits it only once the sink took it, so a plugin crash or a reload in
// between loses nothing: the batch is still at the head.
type buffer struct {
	mu       sync.Mutex
	q        []entry // q[head:] are the records, oldest first
	head     int
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
func (b *buffer) push(rec *pluginv1.Record) bool {
	size := int64(len(rec.GetMessage().GetPayload())) + 64
	b.mu.Lock()
	if b.closed || len(b.q)-b.head >= b.maxRecs || b.bytes+size > b.maxBytes {
		b.mu.Unlock()
		return false
	}
	b.q = append(b.q, entry{rec: rec, size: size})
	b.bytes += size
	b.mu.Unlock()
	select {
	case b.notify <- struct{}{}:
	default:
	}
	return true
}

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
func (b *buffer) peek(ctx context.Context, wake <-chan struct{}, max int, maxBytes int64) []*pluginv1.Record {
	for {
		b.mu.Lock()
		n, size := 0, int64(0)
		for n < max && b.head+n < len(b.q) {
			s := b.q[b.head+n].size
			if n > 0 && size+s > maxBytes {
				break
			}
			size += s
			n++
		}
		if n > 0 {
			out := make([]*pluginv1.Record, n)
			for i := range n {
				out[i] = b.q[b.head+i].rec
			}
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

// commit removes the n oldest records.
func (b *buffer) commit(n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	n = min(n, len(b.q)-b.head)
	for i := b.head; i < b.head+n; i++ {
		b.bytes -= b.q[i].size
		b.q[i] = entry{}
	}
	b.head += n
	if b.head == len(b.q) {
		b.q, b.head = b.q[:0], 0
	} else if b.head > 1024 && b.head > len(b.q)/2 {
		b.q = append(b.q[:0], b.q[b.head:]...)
		b.head = 0
	}
}

// len returns the number of buffered records.
func (b *buffer) len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.q) - b.head
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
	return b.closed && len(b.q) == b.head
}
