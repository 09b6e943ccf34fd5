package broker

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
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
	// abandoned holds, by internal client ID, the end of a session copy
	// that a connection which gave up before its CONNACK left to a newer
	// CONNECT in flight (deferAbandoned); guarded by mu.
	abandoned map[string]abandonedEnd
}

// abandonedEnd is the connection whose copy endAbandoned is to end.
type abandonedEnd struct {
	cl *mqtt.Client
	c  *conn
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
	b.dropGuardLocked(id, g)
}

// dropGuardLocked is dropGuard with b.claims.mu held.
func (b *Broker) dropGuardLocked(id string, g *claimGuard) {
	gs := slices.DeleteFunc(b.claims.byID[id], func(x *claimGuard) bool { return x == g })
	if len(gs) == 0 {
		delete(b.claims.byID, id)
		return
	}
	b.claims.byID[id] = gs
}

// refusedClaim drops the guard g of a CONNECT of id that was refused, and
// ends the copy an abandoned connection left to the CONNECTs in flight
// (deferAbandoned): endAbandoned ends it now unless another is still in
// flight, which it is left to in turn. Without this, a copy that expires
// with its connection would stay with nobody to end it.
func (b *Broker) refusedClaim(id string, g *claimGuard) {
	b.claims.mu.Lock()
	b.dropGuardLocked(id, g)
	end, ok := b.claims.abandoned[id]
	delete(b.claims.abandoned, id)
	b.claims.mu.Unlock()
	if ok {
		b.releases.Add(1)
		go func() {
			defer b.releases.Done()
			b.endAbandoned(end.cl, end.c)
		}()
	}
}

// deferAbandoned leaves the end of the copy of abandoned connection cl to
// the CONNECTs of its client in flight here whose claim may be newer than
// its own (connecting), and reports whether there are any. One that binds
// the session takes the copy on (claimTaken); the last refused ends it
// (refusedClaim). Under the guards' lock, so that a refusal sees what was
// left to it.
func (b *Broker) deferAbandoned(cl *mqtt.Client, c *conn) bool {
	b.claims.mu.Lock()
	defer b.claims.mu.Unlock()
	if !b.connectingLocked(cl.ID, c.epoch) {
		return false
	}
	if b.claims.abandoned == nil {
		b.claims.abandoned = make(map[string]abandonedEnd)
	}
	if cur, ok := b.claims.abandoned[cl.ID]; !ok || cur.c.epoch < c.epoch {
		b.claims.abandoned[cl.ID] = abandonedEnd{cl: cl, c: c}
	}
	return true
}

// claimTaken records that a CONNECT of id holds the session's claim under
// epoch: the copy an abandoned connection under an older claim left to it
// is its own now.
func (b *Broker) claimTaken(id string, epoch uint64) {
	b.claims.mu.Lock()
	defer b.claims.mu.Unlock()
	b.claimTakenLocked(id, epoch)
}

// claimTakenLocked is claimTaken with b.claims.mu held.
func (b *Broker) claimTakenLocked(id string, epoch uint64) {
	if end, ok := b.claims.abandoned[id]; ok && end.c.epoch < epoch {
		delete(b.claims.abandoned, id)
	}
}

// claimDone drops the guard g of a CONNECT of id that took the session's
// claim under epoch, once it bound the session, gave up to a newer claim,
// or ended before it bound: with it, it takes on the copy an abandoned
// connection under an older claim left to it (claimTaken). The CONNECT
// took on such a copy when its claim returned, but an abandoned
// connection's end that comes after that, while the CONNECT stores its
// session and writes its CONNACK, still finds its guard and leaves the
// copy to it: without this, that record (holding the abandoned client and
// its connection) would stay with nothing to clear it.
func (b *Broker) claimDone(id string, g *claimGuard, epoch uint64) {
	if g == nil {
		return
	}
	b.claims.mu.Lock()
	defer b.claims.mu.Unlock()
	b.dropGuardLocked(id, g)
	b.claimTakenLocked(id, epoch)
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
	return b.connectingLocked(id, epoch)
}

// connectingLocked is connecting with b.claims.mu held.
func (b *Broker) connectingLocked(id string, epoch uint64) bool {
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
			b.relayFenced(b.stopped, s, func() <-chan struct{} {
				b.forgetSessionRoutes(context.Background(), s.id, endWhich{only: s})
				return nil
			})
		}
	}()
	return true
}

// fencedLookup bounds one lookup of a fenced copy's owner.
const fencedLookup = 5 * time.Second

// fencedLookupPast bounds the lookup of a fenced copy's owner made again
// on a context of its own when the caller's ended first (relayFenced). It
// is short: the caller may hold the session's claim lock.
const fencedLookupPast = time.Second

// fencedForgetRoutes bounds the wait for the router to remove a fenced
// takeover copy's routes: its CONNECT holds the session's claim lock.
const fencedForgetRoutes = time.Second

// relayFenced makes the session's owner at the coordinator the new owner
// of fenced copy s for the messages published before it took the session
// and routed here (handedOver), as if s had been handed over to it: the
// owner resumed the session from the store beside this copy (its takeover
// went to an edge that did not know the session was here), so it may not
// have been routed to when they were published, and this copy cannot
// store them. Without an owner to name, they find no session here once
// the copy is gone. forget ends the copy, taking its routes; what entered
// the cluster until they are gone is relayed too, since those routes drew
// it here later than the newer owner's claim. forget returns a channel
// closed once the router removed them, if it returns before (nil: gone).
//
// ctx bounds the owner lookup made before forget (a CONNECT's deadline,
// for a copy its takeover made). One that ctx ended (that deadline may be
// what failed the takeover) is made again on a short context of its own:
// a coordinator that answers names the owner, and nothing is refused. A
// lookup that fails leaves the copy's subscriptions remembered with no
// owner: what they match is refused, for its senders to send again, rather
// than taken by nobody, while the lookup goes on in the background until
// the coordinator answers or nothing published before can arrive any more.
func (b *Broker) relayFenced(ctx context.Context, s *session, forget func() (routesGone <-chan struct{})) {
	s.mu.Lock()
	mine := s.epoch
	s.mu.Unlock()
	lookup, cancel := context.WithTimeout(ctx, fencedLookup)
	owner, epoch, err := b.fencedOwner(lookup, s, mine)
	cancel()
	if err != nil && ctx.Err() != nil && b.stopped.Err() == nil {
		lookup, cancel := context.WithTimeout(b.stopped, fencedLookupPast)
		owner, epoch, err = b.fencedOwner(lookup, s, mine)
		cancel()
	}
	if err != nil {
		b.logger.Warn("fenced session's owner not found yet; messages routed to its copy here are refused until it is",
			"client_id", s.id, "error", err)
		owner, epoch = "", 0
	}
	relays := err != nil || owner != ""
	at := time.Now()
	// What the copy holds once the lookup is over: a SUBSCRIBE may have
	// landed during it.
	var remembered []*handedSub
	if relays {
		remembered = b.handed.add(s, at, owner, epoch)
		if owner != "" {
			b.logger.Info("fenced session's late messages go to its owner", "client_id", s.id, "owner", owner, "epoch", epoch)
		}
	}
	gone := forget()
	// The entries added, wherever they stand now: the background lookup
	// of an earlier fenced copy of the session may have named their owner
	// meanwhile (resolve).
	b.handed.extendEntries(remembered, time.Now())
	waits := err != nil && len(remembered) > 0
	if waits {
		// Something waits on the owner: what the copy's subscriptions
		// match is refused until it is named, for as long as they are
		// remembered.
		b.findFencedOwner(s, mine, time.Now().Add(b.handed.memory))
	}
	if gone != nil && len(remembered) > 0 {
		// Extended again once the router removed the routes, and the
		// owner looked up for as long.
		b.releases.Add(1)
		go func() {
			defer b.releases.Done()
			select {
			case <-gone:
				b.handed.extendEntries(remembered, time.Now())
				if waits {
					b.fencedOwners.extend(s.id, time.Now().Add(b.handed.memory))
				}
			case <-b.stopped.Done():
			}
		}()
	}
}

// fencedOwners holds the fenced copies whose owner relayFenced could not
// name, for the one background loop that looks them up (findFencedOwner).
type fencedOwners struct {
	mu      sync.Mutex
	pending map[string]*pendingOwner // by internal client ID; guarded by mu
	running bool                     // the loop runs; guarded by mu
}

// pendingOwner is a fenced copy whose owner is looked up.
type pendingOwner struct {
	s *session
	// mine is the newest claim of the session's copies here: the owner's
	// is newer.
	mine uint64
	// until is when the copies' remembered subscriptions expire: nothing
	// waits on the owner after it.
	until time.Time
}

// Bounds of the wait between two rounds of the loop that looks up fenced
// copies' owners: from the first, doubling while the coordinator does not
// answer, up to the last.
const (
	fencedRetryFirst = 100 * time.Millisecond
	fencedRetryLast  = 2 * time.Second
)

// fencedLookupsAtOnce bounds the lookups of fenced copies' owners that the
// loop runs at once: the coordinator answers each in a few milliseconds,
// so thousands of copies (an edge cut off from it for a while) are named
// within a second or two, well inside the handover memory, without
// thousands of calls at once.
const fencedLookupsAtOnce = 8

// findFencedOwner has the owner of fenced copy s, which relayFenced could
// not name, looked up in the background until the coordinator answers or
// until (when the copy's remembered subscriptions expire), and named to the
// handed-over index. One loop looks every such copy up, a few at a time: an
// edge cut off from the coordinator may have thousands. A copy that comes
// while the loop waits is looked up in its next round: its own lookup
// failed just now.
func (b *Broker) findFencedOwner(s *session, mine uint64, until time.Time) {
	f := &b.fencedOwners
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.pending == nil {
		f.pending = map[string]*pendingOwner{}
	}
	if p := f.pending[s.id]; p != nil {
		// Another fenced copy of the session: its owner is newer than
		// either's claim, and they are remembered for the longer.
		mine, until = max(mine, p.mine), maxTime(until, p.until)
	}
	f.pending[s.id] = &pendingOwner{s: s, mine: mine, until: until}
	if f.running {
		return
	}
	f.running = true
	b.releases.Add(1)
	go func() {
		defer b.releases.Done()
		b.findFencedOwners()
	}()
}

// extend has the owner of session id, if it is still looked up, looked up
// until at least until: its copy's remembered subscriptions were extended.
func (f *fencedOwners) extend(id string, until time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if p := f.pending[id]; p != nil && until.After(p.until) {
		// Replaced, not changed: the loop reads a round's entries unlocked.
		f.pending[id] = &pendingOwner{s: p.s, mine: p.mine, until: until}
	}
}

// findFencedOwners is the loop of findFencedOwner. A round looks up every
// pending copy, the soonest to expire first, fencedLookupsAtOnce at a
// time; a lookup the coordinator does not answer (it failed, at once or
// in time) ends the round (the others would fail as well), and the next
// comes after a longer wait. The loop ends when no copy is pending.
func (b *Broker) findFencedOwners() {
	f := &b.fencedOwners
	for wait := fencedRetryFirst; ; {
		select {
		case <-b.stopped.Done():
			f.mu.Lock()
			f.running = false
			f.mu.Unlock()
			return
		case <-time.After(wait):
		}
		f.mu.Lock()
		round := make([]*pendingOwner, 0, len(f.pending))
		for _, p := range f.pending {
			round = append(round, p)
		}
		f.mu.Unlock()
		slices.SortFunc(round, func(x, y *pendingOwner) int { return x.until.Compare(y.until) })
		answered := b.findFencedOwnersRound(round)
		f.mu.Lock()
		if len(f.pending) == 0 {
			f.running = false
			f.mu.Unlock()
			return
		}
		f.mu.Unlock()
		if answered {
			wait = fencedRetryFirst
		} else {
			wait = min(2*wait, fencedRetryLast)
		}
	}
}

// findFencedOwnersRound looks up the owners of round in order until one is
// not answered, and reports whether every one was: the first alone (while
// the coordinator does not answer, a round costs it one call), the others
// fencedLookupsAtOnce at a time.
func (b *Broker) findFencedOwnersRound(round []*pendingOwner) bool {
	if len(round) == 0 {
		return true
	}
	if !b.findFencedOwnerOnce(round[0]) {
		return false
	}
	round = round[1:]
	var failed atomic.Bool
	var lookups sync.WaitGroup
	slots := make(chan struct{}, fencedLookupsAtOnce)
	for _, p := range round {
		slots <- struct{}{}
		if failed.Load() {
			break
		}
		lookups.Go(func() {
			defer func() { <-slots }()
			if !b.findFencedOwnerOnce(p) {
				failed.Store(true)
			}
		})
	}
	lookups.Wait()
	return !failed.Load()
}

// findFencedOwnerOnce looks up p's owner once, and forgets p once it is
// named or nothing waits on it any more. It reports whether the
// coordinator answered: a lookup that failed, whether at once (no leader,
// a connection refused) or when its time ran out, was not.
func (b *Broker) findFencedOwnerOnce(p *pendingOwner) (answered bool) {
	f := &b.fencedOwners
	done := func() {
		f.mu.Lock()
		if f.pending[p.s.id] == p {
			delete(f.pending, p.s.id)
		}
		f.mu.Unlock()
	}
	if !time.Now().Before(p.until) {
		done() // forgotten: nothing published before can arrive any more
		return true
	}
	ctx, cancel := context.WithTimeout(b.stopped, fencedLookup)
	owner, epoch, err := b.fencedOwner(ctx, p.s, p.mine)
	cancel()
	if err != nil {
		b.logger.Debug("fenced session's owner still not found", "client_id", p.s.id, "error", err)
		return false
	}
	b.handed.resolve(p.s.id, owner, epoch)
	b.logger.Info("fenced session's owner found; its late messages go there", "client_id", p.s.id, "owner", owner, "epoch", epoch)
	done()
	return true
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// fencedOwner is the edge that owns fenced copy s's session at the
// coordinator under a newer claim than mine, "" if none; err when the
// coordinator did not say.
func (b *Broker) fencedOwner(ctx context.Context, s *session, mine uint64) (owner string, epoch uint64, err error) {
	lookup, ok := b.cluster.Ownership.(OwnerLookup)
	if !ok {
		return "", 0, nil
	}
	clientID, _ := s.scope.ExternalClientID(s.id)
	owner, epoch, err = lookup.Owner(ctx, s.scope.Tenant(), clientID)
	if err != nil {
		return "", 0, err
	}
	if owner == "" || owner == b.cfg.EdgeID || epoch <= mine {
		b.logger.Debug("session not claimed by another edge; nothing relayed", "client_id", s.id, "owner", owner, "epoch", epoch)
		return "", 0, nil
	}
	return owner, epoch, nil
}
