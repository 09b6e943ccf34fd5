package broker

import "sync"

// A claimGuard covers one CONNECT from the moment it claims its session at
// the coordinator until the session is bound to the connection. Another
// edge that claims the same session in that window calls TakeOver here,
// but finds no session bound yet: without the guard, it would take over
// nothing and both connections would live. TakeOver marks the guard
// instead, and the CONNECT gives up: refused if it has not been
// acknowledged, disconnected with 0x8E if it has (at most one live
// connection per client ID, DESIGN invariant 3).
type claimGuard struct {
	mu sync.Mutex
	// epoch is the connection's claim, once granted; 0 before.
	epoch uint64
	// supersededBy is the newest claim another edge took the session with
	// while this one was in flight.
	supersededBy uint64
}

// guardClaim registers a guard for a CONNECT of id (internal client ID).
func (b *Broker) guardClaim(id string) *claimGuard {
	g := &claimGuard{}
	b.claims.Store(id, g)
	return g
}

// dropGuard forgets g if it still stands for id.
func (b *Broker) dropGuard(id string, g *claimGuard) {
	if g != nil {
		b.claims.CompareAndDelete(id, g)
	}
}

// supersede tells a CONNECT of id in flight here that another edge claimed
// the session under epoch.
func (b *Broker) supersede(id string, epoch uint64) {
	v, ok := b.claims.Load(id)
	if !ok {
		return
	}
	g := v.(*claimGuard)
	g.mu.Lock()
	if g.epoch == 0 || g.epoch < epoch {
		g.supersededBy = max(g.supersededBy, epoch)
	}
	g.mu.Unlock()
}

// granted records the connection's claim and reports whether a newer one
// already took the session.
func (g *claimGuard) granted(epoch uint64) (superseded bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.epoch = epoch
	return g.supersededBy > epoch
}
