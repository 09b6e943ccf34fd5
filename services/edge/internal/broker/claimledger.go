package broker

import (
	"slices"
	"sync"
)

// claimLedger follows this edge's session claims for the coordinator, which
// removes a dead edge's routes only once every session claimed from it is
// held by its claimant (CustodyProgress.claims_settled_through): a claim
// whose takeover failed leaves a session that the coordinator says is here
// and that nobody holds, and the dead edge's routes are the only ones that
// reach it until this edge adopts it from the store.
//
// A claim settles when the connection (or adoption) that made it is
// admitted or refused: the session is held here then, or the claim was
// superseded, or the failed takeover is listed as unfinished. Its epoch
// is not known while it is in flight, but it is greater than any index
// this edge saw applied before sending it; so everything up to the lowest
// such index among the claims still in flight is settled.
type claimLedger struct {
	mu   sync.Mutex
	seen uint64         // highest Raft index seen applied
	open map[uint64]int // claims in flight, by the index seen when each began
}

// begin records a claim about to be sent and returns its mark for end.
func (l *claimLedger) begin() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.open == nil {
		l.open = map[uint64]int{}
	}
	l.open[l.seen]++
	return l.seen
}

// end records that the claim begun with mark settled.
func (l *claimLedger) end(mark uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.open[mark]--; l.open[mark] <= 0 {
		delete(l.open, mark)
	}
}

// observe records that index is applied at the coordinator (a grant's
// epoch, or the index a lease renewal reported).
func (l *claimLedger) observe(index uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.seen = max(l.seen, index)
}

// through returns the highest index such that every claim with an epoch
// at or below it has settled.
func (l *claimLedger) through() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	t := l.seen
	for mark := range l.open {
		t = min(t, mark)
	}
	return t
}

// ClaimsSettled reports the edge's claims to the coordinator: every claim
// with an epoch at or below through has settled, and unfinishedFrom lists
// the edges whose sessions this edge claimed, failed to take over, and
// does not hold yet.
func (b *Broker) ClaimsSettled() (through uint64, unfinishedFrom []string) {
	// through first: a claim that settles between the two reads is listed
	// as unfinished or counted settled, never neither.
	through = b.claimMarks.through()
	b.sessMu.Lock()
	for id, u := range b.unfinished {
		if b.sessions[id] == nil && !slices.Contains(unfinishedFrom, u.previous) {
			unfinishedFrom = append(unfinishedFrom, u.previous)
		}
	}
	b.sessMu.Unlock()
	slices.Sort(unfinishedFrom)
	return through, unfinishedFrom
}

// ObserveIndex tells the edge a Raft index the coordinator has applied.
func (b *Broker) ObserveIndex(index uint64) { b.claimMarks.observe(index) }
