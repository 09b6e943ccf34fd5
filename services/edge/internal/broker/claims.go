package broker

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/keelmq/keel/services/edge/internal/durable"
)

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

// claimGuards holds the guards of the CONNECTs in flight, by internal
// client ID. One client ID may have several at once (a client that gave up
// waiting for its CONNACK and connected again): a takeover marks them all.
type claimGuards struct {
	mu   sync.Mutex
	byID map[string][]*claimGuard
}

// guardClaim registers a guard for a CONNECT of id (internal client ID).
func (b *Broker) guardClaim(id string) *claimGuard {
	g := &claimGuard{}
	b.claims.mu.Lock()
	defer b.claims.mu.Unlock()
	if b.claims.byID == nil {
		b.claims.byID = make(map[string][]*claimGuard)
	}
	b.claims.byID[id] = append(b.claims.byID[id], g)
	return g
}

// dropGuard forgets g if it still stands for id.
func (b *Broker) dropGuard(id string, g *claimGuard) {
	if g == nil {
		return
	}
	b.claims.mu.Lock()
	defer b.claims.mu.Unlock()
	gs := slices.DeleteFunc(b.claims.byID[id], func(x *claimGuard) bool { return x == g })
	if len(gs) == 0 {
		delete(b.claims.byID, id)
		return
	}
	b.claims.byID[id] = gs
}

// supersede tells the CONNECTs of id in flight here that another edge
// claimed the session under epoch.
func (b *Broker) supersede(id string, epoch uint64) {
	b.claims.mu.Lock()
	defer b.claims.mu.Unlock()
	for _, g := range b.claims.byID[id] {
		g.mu.Lock()
		if g.epoch == 0 || g.epoch < epoch {
			g.supersededBy = max(g.supersededBy, epoch)
		}
		g.mu.Unlock()
	}
}

// connecting reports whether a CONNECT of id is in flight here whose
// claim may be epoch: granted at epoch or later, or not answered yet (the
// coordinator may have granted it).
func (b *Broker) connecting(id string, epoch uint64) bool {
	b.claims.mu.Lock()
	defer b.claims.mu.Unlock()
	for _, g := range b.claims.byID[id] {
		g.mu.Lock()
		mine := g.epoch == 0 || g.epoch >= epoch
		g.mu.Unlock()
		if mine {
			return true
		}
	}
	return false
}

// granted records the connection's claim and reports whether a newer one
// already took the session.
func (g *claimGuard) granted(epoch uint64) (superseded bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.epoch = epoch
	return g.supersededBy > epoch
}

// yieldIfFenced gives up this edge's copy of s when the store refused one
// of its writes as fenced: a newer claim holds the session (its client
// connected elsewhere, or a custodian took it, and a takeover between the
// two failed). Kept, the copy would keep the session's routes here, and
// every message for it would fail to be stored, so its publishers would
// get no acknowledgement until the session moved on. The store keeps what
// it holds for the newer owner; a client still bound here is disconnected
// with 0x8E, its will void (the session goes on elsewhere). It reports
// whether err was a fence.
func (b *Broker) yieldIfFenced(s *session, err error) bool {
	if !errors.Is(err, durable.ErrFenced) {
		return false
	}
	s.mu.Lock()
	if s.yielding || s.closed {
		s.mu.Unlock()
		return true
	}
	s.yielding = true
	cl := s.client
	s.mu.Unlock()
	b.releases.Add(1)
	go func() {
		defer b.releases.Done()
		if b.session(s.id) != s {
			return
		}
		b.logger.Warn("session fenced by a newer owner; giving it up here", "client_id", s.id, "error", err)
		b.m.fencedSessions.Inc()
		if cl != nil {
			if c := b.conn(cl); c != nil {
				c.will.Store(nil)
				c.superseded.Store(true)
			}
			_ = b.disconnect(cl, packets.ErrSessionTakenOver)
		}
		if b.session(s.id) == s {
			b.relayFenced(s, func() { b.forgetSessionRoutes(context.Background(), s.id, endWhich{only: s}) })
		}
	}()
	return true
}

// relayFenced makes the session's owner at the coordinator the new owner
// of fenced copy s for the messages published before it took the session
// and routed here (handedOver), as if s had been handed over to it: the
// owner resumed the session from the store beside this copy (its takeover
// went to an edge that did not know the session was here), so it may not
// have been routed to when they were published, and this copy cannot
// store them. Without an owner to name, they find no session here once
// the copy is gone. forget ends the copy, taking its routes; what entered
// the cluster until then is relayed too, since those routes drew it here
// later than the newer owner's claim.
func (b *Broker) relayFenced(s *session, forget func()) {
	owner, epoch := b.fencedOwner(s)
	if owner != "" {
		b.handed.add(s, time.Now(), owner, epoch)
		b.logger.Info("fenced session's late messages go to its owner", "client_id", s.id, "owner", owner, "epoch", epoch)
	}
	forget()
	if owner != "" {
		b.handed.extend(s.id, owner, epoch, time.Now())
	}
}

// fencedOwner is the edge that owns fenced copy s's session at the
// coordinator under a newer claim, "" if none (or none found).
func (b *Broker) fencedOwner(s *session) (owner string, epoch uint64) {
	lookup, ok := b.cluster.Ownership.(OwnerLookup)
	if !ok {
		return "", 0
	}
	clientID, _ := s.scope.ExternalClientID(s.id)
	ctx, cancel := context.WithTimeout(b.stopped, 5*time.Second)
	defer cancel()
	owner, epoch, err := lookup.Owner(ctx, s.scope.Tenant(), clientID)
	s.mu.Lock()
	mine := s.epoch
	s.mu.Unlock()
	if err != nil {
		b.logger.Warn("fenced session's owner not found; messages routed to its copy here are not relayed", "client_id", s.id, "error", err)
		return "", 0
	}
	if owner == "" || owner == b.cfg.EdgeID || epoch <= mine {
		b.logger.Debug("session not claimed by another edge; nothing relayed", "client_id", s.id, "owner", owner, "epoch", epoch)
		return "", 0
	}
	return owner, epoch
}
