package broker

import (
	"context"
	"sync"

	"github.com/keelmq/keel/services/edge/internal/durable"
)

// Deferred collects the durable writes that delivering one message
// submitted (queued copies for persistent sessions), so that a caller
// delivering many messages in a row (a forward frame) submits them all and
// then waits once: the store commits them together instead of one round
// trip per message. Submission order, and so each session's order, is
// unchanged.
type Deferred struct {
	mu    sync.Mutex
	waits []deferredWait
}

type deferredWait struct {
	s *session
	p *durable.Pending
	m *Message
}

func (d *Deferred) add(s *session, p *durable.Pending, m *Message) {
	d.mu.Lock()
	d.waits = append(d.waits, deferredWait{s, p, m})
	d.mu.Unlock()
}

// Wait returns once every collected write is stored, or with the first
// failure: the message was then not taken by every recipient.
func (d *Deferred) Wait() error {
	d.mu.Lock()
	waits := d.waits
	d.waits = nil
	d.mu.Unlock()
	var failed error
	for _, w := range waits {
		if err := w.s.settle(w.p, w.m); err != nil && failed == nil {
			w.s.b.m.dropped.WithLabelValues("store_failed").Inc()
			failed = errStoreFailed
		}
	}
	return failed
}

type deferredKey struct{}

// DeferWrites makes [Broker.DeliverForwarded] with the returned context
// collect its durable writes in d instead of waiting for them; the caller
// must call d.Wait before it counts the message as taken.
func DeferWrites(ctx context.Context, d *Deferred) context.Context {
	return context.WithValue(ctx, deferredKey{}, d)
}

func deferredFrom(ctx context.Context) *Deferred {
	d, _ := ctx.Value(deferredKey{}).(*Deferred)
	return d
}
