package broker

import (
	"context"
	"sync"

	"github.com/keelmq/keel/services/edge/internal/durable"
)

// Deferred collects the durable writes that delivering a run of messages
// submitted (queued copies for persistent sessions), so that a caller
// delivering many messages in a row (a forward frame) submits them all and
// then waits once: the store commits them together instead of one round
// trip per message. Submission order, and so each session's order, is
// unchanged. One Deferred serves a whole run, so the run costs one context
// rather than one per message.
type Deferred struct {
	// Quiet says the run is one message with nothing behind it (a frame
	// that carries it alone): its deliveries to idle sessions may be
	// written at once by the caller's goroutine (writeAlone).
	Quiet bool

	mu     sync.Mutex
	msg    int // index of the message being delivered
	waits  []deferredWait
	waited bool // Wait ran: nobody waits for what comes later
}

type deferredWait struct {
	msg int
	s   *session
	p   *durable.Pending
	m   *Message
	seq uint64 // where the session queued m
}

// Message marks the writes collected from now on as the i-th message's.
func (d *Deferred) Message(i int) {
	d.mu.Lock()
	d.msg = i
	d.mu.Unlock()
}

// add collects a write, and reports whether it did. A message delivered
// again after its run was waited for (a group message re-dispatched when
// its member left, a retry) keeps its Deferred: its writes then are not
// collected, and their caller waits for them itself. Collected, nobody
// would wait: the message would count as taken before it was stored, and
// a failed write would go unnoticed.
func (d *Deferred) add(s *session, p *durable.Pending, m *Message, seq uint64) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.waited {
		return false
	}
	d.waits = append(d.waits, deferredWait{d.msg, s, p, m, seq})
	return true
}

// Pending reports whether writes were collected: Wait waits for the store.
func (d *Deferred) Pending() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.waits) > 0
}

// Wait returns once every collected write is stored or failed, with the
// first failure of each of the n messages (nil: every recipient took it).
func (d *Deferred) Wait(n int) []error {
	d.mu.Lock()
	waits := d.waits
	d.waits, d.waited = nil, true
	d.mu.Unlock()
	errs := make([]error, n)
	var failedBy map[*Message][]*session
	for _, w := range waits {
		err := w.s.settleQueued(w.p, w.m, w.seq)
		if err == nil {
			continue
		}
		if errs[w.msg] == nil {
			errs[w.msg] = w.s.b.counted(notTaken(err))
		}
		if len(w.m.picks) > 0 {
			if failedBy == nil {
				failedBy = map[*Message][]*session{}
			}
			failedBy[w.m] = append(failedBy[w.m], w.s)
		}
	}
	// Sent again, a failed message goes to the members of shared groups
	// that took it, not to others (sharedPicks).
	for m, except := range failedBy {
		except[0].b.rememberFailed(m, except)
	}
	return errs
}

type deferredKey struct{}

// DeferWrites makes [Broker.DeliverForwarded] with the returned context
// collect its durable writes in d instead of waiting for them; the caller
// marks each message with d.Message and must call d.Wait before it counts
// any of them as taken.
func DeferWrites(ctx context.Context, d *Deferred) context.Context {
	return context.WithValue(ctx, deferredKey{}, d)
}

func deferredFrom(ctx context.Context) *Deferred {
	d, _ := ctx.Value(deferredKey{}).(*Deferred)
	return d
}
