package broker

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"maps"
	"slices"
	"time"

	"github.com/mochi-mqtt/server/v2/hooks/storage"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

// Takeover reaches the edge that owned a session before this one claimed
// it (DESIGN: takeover, two phases). Begin asks it to let the session go:
// it closes the client's connection there (0x8E), so that a client ID has
// at most one live connection in the cluster, and returns the persistent
// session's state when the session moves (no clean start). End, once this
// edge has taken the state and registered the session's routes, returns
// what the previous owner queued for the session meanwhile, and the
// previous owner lets the session go. An error from Begin leaves the claim
// standing: a previous owner that is cut off fences itself when its lease
// runs out.
type Takeover interface {
	Begin(ctx context.Context, previousOwner, tenant, clientID string, newEpoch uint64, cleanStart bool) (state []byte, err error)
	End(ctx context.Context, previousOwner, tenant, clientID string, newEpoch uint64) (TakeoverEnded, error)
}

// ErrPreviousOwnerGone is what a Takeover returns when the previous owner
// is not a live member any more (its lease expired).
var ErrPreviousOwnerGone = errors.New("previous owner is not a live member")

// HeldElsewhereError is what Begin returns when the edge asked owns the
// session at the coordinator but holds no copy of it: its own takeover
// from Edge failed, and the session is still there. Taken over from the
// edge asked, the session would be resumed from the store while Edge's
// copy lived on, drawing the messages routed to it before the new owner's
// routes were in place, and losing them once fenced.
type HeldElsewhereError struct{ Edge string }

func (e *HeldElsewhereError) Error() string {
	return fmt.Sprintf("session held by edge %s, whose takeover did not finish", e.Edge)
}

// maxTakeoverHops bounds how many times a takeover follows
// HeldElsewhereError: each hop is a failed takeover that was not retried
// before the next claim, and each edge names the one it claimed from, so a
// longer chain means edges naming each other in a loop.
const maxTakeoverHops = 4

// takeoverGrace is how long the previous owner keeps queueing for a moved
// session after the new owner's routes are in place: messages routed to it
// just before then are still in flight on the forward links.
const takeoverGrace = 250 * time.Millisecond

// moving marks a session that another edge has claimed and is taking over.
type moving struct {
	epoch   uint64 // the new owner's
	to      string // the new owner's edge ID ("" when the caller did not say)
	fromSeq uint64 // queue entries after this one arrived after TakeoverBegin
	done    bool   // the late messages were handed over: take no more
	// What the move took from the copy, put back if it fails here
	// (moveFailed): the stored record the copy wrote, and the wills of
	// its connections, none of them armed: the one waiting for its delay
	// when the move began, and those of connections that ended during it
	// (willAtEnd). Void once the session goes on elsewhere.
	record *durable.Session
	wills  []*pendingWill
}

// TakeOver gives up, on this edge, the session that another edge claimed
// under newEpoch: its connection is closed with 0x8E (MQTT 5), and its will
// goes out at once if the session ends (the new connection starts clean,
// or the session does not outlive its connection), never if the session
// goes on elsewhere ([MQTT-3.1.3-9]). A
// persistent session that moves (no clean start) is returned in the
// session transfer encoding and stays here, offline and still queueing,
// until [Broker.TakeoverEnd]; any other session ends. owned is false when
// this edge holds no session under an older epoch (a stale request never
// closes a newer connection).
func (b *Broker) TakeOver(ctx context.Context, tenant, clientID, newOwner string, newEpoch uint64, cleanStart bool) (owned, wasConnected bool, state []byte, err error) {
	sc, err := b.scope(tenant)
	if err != nil {
		return false, false, nil, err
	}
	id := sc.ClientID(clientID)
	// A CONNECT of the client in flight here loses to the newer claim; it
	// is marked before the session is looked at (claims.go).
	b.supersede(id, newEpoch)
	s, err := b.settledSession(ctx, id)
	if err != nil {
		return false, false, nil, err
	}
	if s == nil {
		if held := b.passUnfinished(id, newEpoch); held != "" {
			return false, false, nil, &HeldElsewhereError{Edge: held}
		}
		return false, false, nil, nil
	}
	s.mu.Lock()
	epoch, cl, persistent := s.epoch, s.client, s.persistent && s.durable
	if epoch >= newEpoch {
		s.mu.Unlock()
		return false, false, nil, nil
	}
	if cl == nil {
		if old := b.expiredOffline(id, time.Now()); old != nil {
			// The session expired here before the claim came, whether or
			// not mochi's expiry tick has come since: it ends now (its will
			// goes out, if still waiting) and nothing moves; the new
			// connection starts a new session ([MQTT-3.2.2-3]).
			s.mu.Unlock()
			b.m.takeovers.Inc()
			b.stopGate.RLock() // as in expireOffline
			heldBack := b.willsHeldBack()
			if !b.expireOffline(old) && heldBack && b.store != nil && b.store.Shared() {
				// mochi's tick took the expiry first, and may not have
				// rewritten the record yet: before the end below
				// deactivates it.
				heldBack = b.storeEndedWill(id, epoch)
			}
			// This copy, if mochi's tick took the record first and is
			// still ending it.
			b.endSessionRoutes(context.Background(), id, endWhich{only: s, forCustody: heldBack})
			b.stopGate.RUnlock()
			return true, false, nil, nil
		}
	}
	// A session that does not outlive its connection, or one with no
	// durable state to move, ends here as a clean start ends it: the new
	// connection starts a new session.
	moves := persistent && !cleanStart
	var mv *moving
	if moves {
		// From here on the session keeps what it queues apart for End.
		mv = &moving{epoch: newEpoch, to: newOwner, fromSeq: s.seq, record: s.record}
		if old := s.moving; old != nil && !old.done {
			// An earlier claim's move that never ended: what it holds is
			// this one's to put back.
			mv.record, mv.wills = old.record, old.wills
		}
		s.moving = mv
		// The session goes on elsewhere, and the new owner stores its
		// record again: without the will when a connection takes it on
		// (the will is void), with it when the owner adopts the session
		// with no connection (a drain), and it waits there for its delay.
		s.record = nil
	}
	s.mu.Unlock()
	b.m.takeovers.Inc()
	willWaiting := false
	if moves {
		// A will waiting for its delay does not go from here: it goes with
		// the move. After s.moving is set: a connection ending from here on
		// finds the session moving and leaves its will with the move too
		// (willAtEnd).
		b.willMu.Lock()
		s.mu.Lock()
		if s.moving == mv && !mv.done {
			if pw := b.takeWillLocked(id); pw != nil {
				willWaiting = true
				mv.wills = append(mv.wills, pw)
			}
		}
		s.mu.Unlock()
		b.willMu.Unlock()
	}
	if cl != nil {
		wasConnected = true
		if c := b.conn(cl); c != nil && !moves {
			c.sessionEnds.Store(true) // its will goes out at once
		}
		b.logger.Info("session taken over by another edge; disconnecting", "client_id", cl.ID)
		_ = b.disconnect(cl, packets.ErrSessionTakenOver)
		// The connection's in-flight messages go back to the session (as on
		// a local takeover) so that they move with it.
		s.detach(cl)
	}
	if !moves {
		// Once the edge stops, no will goes out from here (willsHeldBack):
		// the stored record that holds one stays, as an edge that died
		// leaves it, and the new owner, starting the session clean,
		// publishes the will from there (claimShared). The decision holds
		// until the will is sent: the stop waits for it (stopGate).
		b.stopGate.RLock()
		forCustody := b.store != nil && b.store.Shared() && b.willsHeldBack()
		b.endSessionRoutes(context.Background(), id, endWhich{forCustody: forCustody})
		if at := b.atTakeOverWill.Load(); at != nil {
			(*at)()
		}
		// After the end: a will waiting for its delay goes now, and so does
		// one that a connection ending before the end scheduled
		// ([MQTT-3.1.3-9]: published when the delay passes or the session
		// ends, whichever is first).
		b.cancelWill(id, true)
		b.stopGate.RUnlock()
		if b.store != nil && b.store.Shared() && !forCustody {
			// The will goes out from here. The stored record that holds
			// it leaves the store before the new owner, told of the end,
			// reads it (the end's own delete is queued, and the new
			// owner's activation would fence it off): left there, the
			// record's will would be published again by the new owner.
			if err := b.store.DeleteSession(ctx, id, true); err != nil {
				return true, wasConnected, nil, fmt.Errorf("ended session not removed from the store: %w", err)
			}
		}
		return true, wasConnected, nil, nil
	}
	st, ok, err := b.store.LoadSession(ctx, id)
	if err != nil || !ok {
		// The session stays here: no End follows a failed Begin.
		b.moveFailed(id, s, mv, epoch)
		return true, wasConnected, nil, errors.Join(errors.New("session not stored"), err)
	}
	if cl == nil {
		// Offline here: the session's expiry and its will's delay go on
		// counting, where it goes, from when its connection ended: the
		// earlier of mochi's end of it here and the stored one (a session
		// adopted here carries its end in the record, and mochi's may not
		// be dated back to it yet).
		if old, ok := b.server.Clients.Get(id); ok && old.Closed() {
			if at := old.StoppedAt(); !at.IsZero() && (st.Session.Disconnected == 0 || at.UnixNano() < st.Session.Disconnected) {
				st.Session.Disconnected = at.UnixNano()
			}
		}
	}
	if !willWaiting {
		// The stored record holds the will of a connection that was live
		// (this takeover closed it: the client came back elsewhere, which
		// voids it), or of none: only a will that was waiting for its
		// delay, its connection gone without a DISCONNECT (or closed by a
		// drain), goes on with the session. A new owner with a connection
		// voids even that one ([MQTT-3.1.3-9]); one that adopts the session
		// with none (a drain) sends it after its delay unless the client
		// comes back.
		st.Session.Will = nil
	}
	// detach put the connection's in-flight messages back in memory; the
	// stored in-flight set already holds them, with their packet IDs.
	//
	// The QoS 2 messages queued since Begin are left out: the store read
	// above may not hold them, and End hands them over late. Named here,
	// they would be remembered as taken on import, and the new owner would
	// skip their late copies as taken before: acknowledged, and nowhere.
	// End names them, after the late messages are merged (mergeLate).
	s.mu.Lock()
	st.TookQoS2 = s.tookIDsLocked(lateIDsLocked(s, mv.fromSeq))
	s.mu.Unlock()
	if state, err = durable.EncodeTransfer(st); err != nil {
		// Begin fails with it, and no End follows.
		b.moveFailed(id, s, mv, epoch)
	}
	return true, wasConnected, state, err
}

// moveFailed puts back on copy s of session id, held under epoch, what the
// move mv took, if mv is still the copy's: the move failed here, and the
// session stays. So do the wills of its connections, the live one the
// takeover closed included: no new connection took the session on
// ([MQTT-3.1.3-9]), unless one here did meanwhile, which voids them. A
// will whose delay passed, or of a session that ended meanwhile, goes out
// now. Decided under b.willMu, as a connection's end decides its will
// (willAtEnd), so that a CONNECT here cancels what this arms.
func (b *Broker) moveFailed(id string, s *session, mv *moving, epoch uint64) {
	var now []*pendingWill
	b.willMu.Lock()
	s.mu.Lock()
	if s.moving != mv {
		s.mu.Unlock()
		b.willMu.Unlock()
		return // another claim's move replaced it: that one decides
	}
	s.moving = nil
	if s.record == nil && !s.closed {
		s.record = mv.record
	}
	resumed, ended := s.epoch > epoch, s.closed
	s.mu.Unlock()
	for _, pw := range mv.wills {
		switch delay := time.Until(pw.at); {
		case resumed:
		case !ended && !pw.due && delay > 0:
			b.armLocked(id, pw, delay)
		case b.stopping.Load():
			b.keepDueLocked(id, pw)
		default:
			now = append(now, pw)
		}
	}
	b.willMu.Unlock()
	for _, pw := range now {
		pw.fire()
	}
}

// settledSession returns this edge's copy of session id once no import of
// it is in progress: a copy being taken in (from its previous owner, the
// shared store, or custody) is not whole until its stored state is written
// under its epoch and the late messages are merged, and handed on before
// that, what the import adds afterwards would stay behind with a copy that
// is no longer the session's. The import ends within its own deadlines;
// if it failed, its copy is gone and nil is returned.
func (b *Broker) settledSession(ctx context.Context, id string) (*session, error) {
	for {
		s := b.session(id)
		if s == nil {
			return nil, nil
		}
		s.mu.Lock()
		hold := s.hold
		s.mu.Unlock()
		if hold == nil {
			return s, nil
		}
		select {
		case <-hold:
		case <-ctx.Done():
			return nil, fmt.Errorf("session %s still being taken in here: %w", id, ctx.Err())
		}
	}
}

// TakeoverEnd completes a takeover on the previous owner: after a grace for
// messages still in flight to it, it returns what it queued for the session
// since TakeoverBegin and ends the session here (its routes and stored
// state go).
func (b *Broker) TakeoverEnd(ctx context.Context, tenant, clientID string, newEpoch uint64) ([]byte, error) {
	sc, err := b.scope(tenant)
	if err != nil {
		return nil, err
	}
	id := sc.ClientID(clientID)
	s := b.session(id)
	if s == nil {
		return nil, nil
	}
	s.mu.Lock()
	mv := s.moving
	s.mu.Unlock()
	if mv == nil || mv.epoch != newEpoch {
		return nil, fmt.Errorf("session %s is not moving under epoch %d", clientID, newEpoch)
	}
	// The new owner's routes are in place now (it registered them before
	// calling End): what is published from here on reaches it directly.
	handover := time.Now()
	select {
	case <-time.After(takeoverGrace):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	// What arrived since Begin is in memory, in order: an offline session's
	// queue holds everything the store does (and a shared store's sequence
	// numbers are not this edge's).
	s.mu.Lock()
	mv.done = true
	late := durable.SessionState{Session: durable.Session{ID: id}, TookQoS2: s.tookIDsLocked(nil)}
	for i := 0; i < s.queue.len(); i++ {
		if d := s.queue.at(i); d.seq > mv.fromSeq {
			late.Queue = append(late.Queue, entryOf(d, 0, 0))
		}
	}
	s.mu.Unlock()
	out, err := durable.EncodeTransfer(late)
	if err != nil {
		return nil, err
	}
	// Before the session leaves the index: from then on, a message
	// published before the handover that still arrives here is relayed.
	if mv.to != "" {
		b.handed.add(s, handover, mv.to, newEpoch)
	}
	// This copy only: one imported since in its place (an adoption
	// completed here meanwhile) is the session's now.
	b.endSessionRoutes(context.Background(), id, endWhich{only: s})
	return out, nil
}

// importSession makes a persistent session live on this edge from its
// stored state (taken over from the previous owner, or read from a shared
// store): mochi is told of an offline client so that the CONNACK reports the
// session present and the connection inherits its subscriptions, and the
// session's routes are registered. It writes nothing to the store.
func (b *Broker) importSession(ctx context.Context, sc *tenancy.Scope, id string, epoch uint64, st durable.SessionState) (*session, error) {
	if st.Session.ID != id {
		return nil, fmt.Errorf("session state of %q given for %q", st.Session.ID, id)
	}
	if b.store == nil {
		return nil, errors.New("no durable store to take a persistent session into")
	}
	// Two imports of one session can run at once (a client's CONNECT and
	// the adoption of its failed takeover): the one under the older claim
	// must not replace the other's copy, whose store epoch would go with it.
	mu := &b.importLocks[importStripe(id)]
	mu.Lock()
	defer mu.Unlock()
	if cur := b.session(id); cur != nil {
		cur.mu.Lock()
		newer := cur.epoch > epoch
		cur.mu.Unlock()
		if newer {
			return nil, fmt.Errorf("%w: %s is held here under a newer claim", errNewerCopy, id)
		}
	}
	b.forgetSessionRoutes(context.Background(), id, endWhich{replaced: true})
	s, client, subs, incoming := b.adopt(st, sc, fromRecord)
	s.epoch = epoch
	// The stored state's messages count as queued already: the previous
	// owner hands over late, or relays, what it queued after Begin, and
	// that can include messages its store read at Begin saw too (it waits
	// for its own writes first). Queued again, such a message is sent
	// twice, the second time as a store entry whose message the first
	// one's acknowledgement may have freed.
	s.recent = &recentIDs{ids: make(map[MsgID]struct{}, len(st.Queue)+len(st.Inflight))}
	for _, e := range st.Queue {
		s.recent.ids[parseMsgID(e.MsgID)] = struct{}{}
	}
	for _, e := range st.Inflight {
		s.recent.ids[parseMsgID(e.MsgID)] = struct{}{}
	}
	s.hold = make(chan struct{})
	b.indexSubs(s)
	b.sessMu.Lock()
	b.sessions[id] = s
	b.sessMu.Unlock()

	cl := b.server.NewClient(nil, client.Listener, id, false)
	cl.Properties.Username = client.Username
	cl.Properties.Clean = client.Clean
	cl.Properties.ProtocolVersion = client.ProtocolVersion
	cl.Properties.Props = packets.Properties{
		SessionExpiryInterval: client.Properties.SessionExpiryInterval, SessionExpiryIntervalFlag: client.Properties.SessionExpiryIntervalFlag,
		ReceiveMaximum: client.Properties.ReceiveMaximum, TopicAliasMaximum: client.Properties.TopicAliasMaximum,
		MaximumPacketSize: client.Properties.MaximumPacketSize,
	}
	cl.Stop(packets.ErrSessionTakenOver)
	for _, sub := range subs {
		pk := mochiSub(sub)
		if b.server.Topics.Subscribe(id, pk) {
			cl.State.Subscriptions.Add(sub.Filter, pk)
		}
	}
	for _, in := range incoming {
		cl.State.Inflight.Set(in.ToPacket())
	}
	b.server.Clients.Add(cl)

	// The session's routes, before the client hears it is back.
	s.mu.Lock()
	toRoute := slices.Collect(maps.Values(s.subs))
	s.mu.Unlock()
	for _, x := range toRoute {
		err := b.cluster.Routes.Add(ctx, sc.Tenant(), s.outsideFilter(x), groupName(x))
		if err == nil || !errors.Is(err, ErrRouteRefused) {
			s.routeCounted(x)
		}
		if err != nil {
			// Nothing half-imported stays (the import lock is held). The
			// session's end removes the routes it counted: only those, or
			// another session's count of the same filter would go.
			s.releaseHold()
			// The removals are not waited for, under the import lock, from
			// a router that did not answer the additions in time.
			b.forgetSessionRoutes(cancelled, id, endWhich{})
			return nil, fmt.Errorf("route of the taken-over session: %w", err)
		}
	}
	s.routable.Store(time.Now().UnixNano())
	b.logger.Debug("session copy imported", "client_id", id, "epoch", epoch, "queued", len(st.Queue), "inflight", len(st.Inflight))
	return s, nil
}

// forgetCopy ends s, the copy of a session an import under epoch made
// here, if it is still that copy: a failure after the import must not end
// a newer copy that replaced it meanwhile (a client that connected here
// and read the session from the shared store), nor this one once a newer
// claim took it on (a client that connected here bound it under its own
// epoch), whose claim the release would undo.
//
// A copy that goes refuses, from before its hold is released, what waited
// on the hold: taken in the moment before it goes, a message would be
// dropped with it, or relayed to an owner named later by nobody
// (lateRelays). Refused, it is sent again and finds the copy gone.
//
// The wait for the router to remove the copy's routes is bounded
// (fencedForgetRoutes): the caller holds the session's claim lock. The
// returned channel is closed once they are gone.
func (b *Broker) forgetCopy(s *session, epoch uint64) (routesGone <-chan struct{}) {
	mu := &b.importLocks[importStripe(s.id)]
	mu.Lock()
	defer mu.Unlock()
	here := b.session(s.id) == s
	s.mu.Lock()
	goes := here && s.epoch == epoch
	if goes {
		s.moving = &moving{done: true}
	}
	s.mu.Unlock()
	s.releaseHold()
	if !goes {
		return nil
	}
	gone := make(chan struct{})
	ctx, cancel := context.WithTimeout(b.stopped, fencedForgetRoutes)
	defer cancel()
	b.forgetSessionRoutes(ctx, s.id, endWhich{routesGone: gone})
	return gone
}

// errNewerCopy is returned by importSession when the edge holds the session
// under a newer claim than the import's.
var errNewerCopy = errors.New("a newer copy of the session is here")

// importStripes is the number of import locks: imports of different
// sessions rarely wait for each other.
const importStripes = 64

// importStripe picks the import lock of a session.
func importStripe(id string) int {
	h := fnv.New32a()
	_, _ = h.Write([]byte(id))
	return int(h.Sum32() % importStripes)
}

// forgetSession ends this edge's copy of a session that is being replaced
// by a newer one. A shared store keeps what it holds (the newer copy reads
// it); an edge-local store drops it before the newer copy is written.
func (b *Broker) forgetSession(id string) {
	b.forgetSessionRoutes(context.Background(), id, endWhich{})
}

// forgetSessionRoutes is forgetSession waiting for the removal of the
// session's routes only until routes ends (see endSessionRoutes).
func (b *Broker) forgetSessionRoutes(routes context.Context, id string, which endWhich) {
	s := b.session(id)
	if s == nil || (which.only != nil && s != which.only) {
		which.goneNow()
		return
	}
	s.mu.Lock()
	s.moving = &moving{done: true}
	s.mu.Unlock()
	which.only = s
	b.endSessionRoutes(routes, id, which)
	// The session goes on with its newer holder, which decides its will:
	// a will of this copy still waiting for its delay would go out from
	// here besides, or after the client came back there [MQTT-3.1.3-9].
	// After the copy is gone: a connection of it ending from here on
	// finds the session moved and leaves its will (willAtEnd).
	if b.session(id) != s {
		b.cancelWillOf(id, s)
	}
}

func mochiSub(sub storage.Subscription) packets.Subscription {
	return packets.Subscription{Filter: sub.Filter, RetainHandling: sub.RetainHandling, Qos: sub.Qos,
		RetainAsPublished: sub.RetainAsPublished, NoLocal: sub.NoLocal, Identifier: sub.Identifier}
}

// mergeLate queues what the previous owner held back for the session,
// skipping messages that reached it here directly, and stops remembering
// which did.
func (b *Broker) mergeLate(id string, late []byte) error {
	s := b.session(id)
	if s == nil {
		return nil
	}
	var st durable.SessionState
	if len(late) > 0 {
		var err error
		if st, err = durable.DecodeTransfer(late); err != nil {
			return err
		}
	}
	var failed error
	for _, e := range st.Queue {
		m := fromRecord(e.Msg)
		if r := s.enqueueNow(delivery{msg: m, qos: e.QoS, retain: e.Retain, ids: e.SubIDs}); r == storeFailed || r == revoked {
			failed = errStoreFailed
		}
	}
	// After the late messages: the previous owner took those too, and
	// remembered first they would be taken for copies queued already.
	for _, id := range st.TookQoS2 {
		s.rememberQoS2(parseMsgID(id))
	}
	return failed
}

// recentIDs remembers the msgIDs queued for a session taken over from
// another edge. Until the previous owner's late messages are merged it
// remembers every one. After that, only a message published before the
// handover can still come twice (directly, and relayed by the previous
// owner: handedOver), so only those are remembered, for as long as the
// previous owner relays.
type recentIDs struct {
	ids    map[MsgID]struct{}
	cutoff int64     // unix nano; 0: every message counts
	until  time.Time // zero while every message counts
}

// over reports whether nothing needs remembering from now on.
func (r *recentIDs) over(now time.Time) bool {
	return !r.until.IsZero() && !now.Before(r.until)
}

// seen reports whether m was queued before, and remembers it if it may come
// again.
func (r *recentIDs) seen(m *Message) bool {
	if r.cutoff != 0 && m.Created >= r.cutoff {
		return false
	}
	if _, ok := r.ids[m.ID]; ok {
		return true
	}
	r.ids[m.ID] = struct{}{}
	return false
}

// narrow keeps remembering, for memory from now, the messages published
// before now (plus the clock margin of handedOver).
func (r *recentIDs) narrow(now time.Time, memory time.Duration) {
	if r.cutoff != 0 {
		return
	}
	r.cutoff = now.Add(handoverSkew).UnixNano()
	r.until = now.Add(memory)
}

// releaseHold lets messages held back during a takeover in.
func (s *session) releaseHold() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.recent != nil {
		s.recent.narrow(time.Now(), s.b.handed.memory)
	}
	if s.hold != nil {
		close(s.hold)
		s.hold = nil
	}
}

// takeOverFrom runs the new owner's side of a takeover before the CONNACK.
// A previous owner that does not answer Begin keeps nothing this edge
// needs to wait for (it fences itself when its lease runs out); one that
// handed a session over and then fails End still holds the late messages,
// so the connection is refused and the client comes back. moved is true
// when the session came over from the previous owner.
//
// The session is taken from the edge that holds it: previous, or the one
// previous names (HeldElsewhereError). from is that edge, the one a failed
// takeover is unfinished from; it is this edge when the session is here.
// offline is set when no connection comes with the takeover (an adoption
// from a draining edge): the will of the session's last connection is
// then kept, and waits here for its delay (completeTakeover).
func (b *Broker) takeOverFrom(ctx context.Context, previous string, sc *tenancy.Scope, clientID string, epoch uint64, cleanStart, offline bool) (moved bool, from string, err error) {
	state, from, err := b.beginTakeover(ctx, previous, sc.Tenant(), clientID, epoch, cleanStart)
	if errors.Is(err, ErrPreviousOwnerGone) {
		// Its lease expired: it fenced itself and closed its connections.
		b.logger.Info("previous owner is gone; nothing to take over", "previous", from)
		return false, from, nil
	}
	if err != nil {
		// It may still hold the client's connection: admitting this one
		// would make two. The client comes back; by then the previous owner
		// answers, or its lease has expired.
		return false, from, fmt.Errorf("previous owner %s did not give the session up: %w", from, err)
	}
	moved, err = b.completeTakeover(ctx, from, sc, clientID, epoch, state, offline)
	return moved, from, err
}

// beginTakeover calls Begin on previous, and on the edges it names as
// holding the session (HeldElsewhereError), until one answers. from is the
// edge that answered, or this one when the session is named as being here.
func (b *Broker) beginTakeover(ctx context.Context, previous, tenant, clientID string, epoch uint64, cleanStart bool) (state []byte, from string, err error) {
	from = previous
	for hop := 0; ; hop++ {
		state, err = b.cluster.Takeover.Begin(ctx, from, tenant, clientID, epoch, cleanStart)
		var held *HeldElsewhereError
		if !errors.As(err, &held) {
			return state, from, err
		}
		if hop == maxTakeoverHops {
			return nil, from, fmt.Errorf("session not found after %d edges named another as holding it: %w", hop+1, err)
		}
		b.m.takeoverRedirects.Inc()
		b.logger.Info("session held by another edge than its previous owner; taking it over from there",
			"client_id", clientID, "asked", from, "held_by", held.Edge)
		if held.Edge == b.cfg.EdgeID {
			return nil, held.Edge, nil
		}
		from = held.Edge
	}
}

// completeTakeover takes in the state the previous owner gave up at Begin
// and ends the takeover there; see takeOverFrom.
func (b *Broker) completeTakeover(ctx context.Context, previous string, sc *tenancy.Scope, clientID string, epoch uint64, state []byte, offline bool) (moved bool, err error) {
	if len(state) == 0 {
		return false, nil
	}
	st, err := durable.DecodeTransfer(state)
	if err != nil {
		return false, err
	}
	id := sc.ClientID(clientID)
	s, err := b.importSession(ctx, sc, id, epoch, st)
	if errors.Is(err, errNewerCopy) {
		// A newer claim of this edge holds the session: its client
		// connected here meanwhile and read it from the shared store, after
		// that claim fenced the previous owner's writes, so it holds all
		// the previous owner stored. The previous owner is told the
		// takeover is over, so that it lets its copy go.
		if _, endErr := b.cluster.Takeover.End(ctx, previous, sc.Tenant(), clientID, epoch); endErr != nil {
			b.logger.Debug("superseded takeover not ended", "client_id", id, "previous", previous, "error", endErr)
		}
		return false, err
	}
	if err != nil {
		return false, fmt.Errorf("%w: %w", errTakeoverIncomplete, err)
	}
	// A will due at once of a session adopted with no connection goes out
	// after the hold (scheduleAdoptedWill), if the session came over.
	var willNow func()
	defer func() {
		if offline && err == nil {
			b.countFromEnd(s, &st.Session)
		}
		if willNow != nil && err == nil {
			willNow()
		}
	}()
	defer s.releaseHold() // whatever happened, nothing waits on it any longer
	// Whatever fails from here leaves no copy of the session here: its
	// routes would draw messages it cannot store (a newer claim may have
	// fenced it already).
	moved = true
	defer func() {
		if err != nil {
			// A newer claim may have taken the session while this copy was
			// made (a fenced write, here or in mergeLate's queueing). Its
			// routes drew messages meanwhile, and the copy's refusal of
			// them is all the senders hear: sent again, they find no
			// session here, and the newer owner, not yet routed to when
			// they were published, may not have them. So they go to it, as
			// if the copy had been handed over. The coordinator says
			// whether there is such an owner.
			b.relayFenced(ctx, s, func() <-chan struct{} { return b.forgetCopy(s, epoch) })
			moved = false
			err = fmt.Errorf("%w: %w", errTakeoverIncomplete, err)
		}
	}()
	ended, err := b.cluster.Takeover.End(ctx, previous, sc.Tenant(), clientID, epoch)
	if err != nil {
		return false, fmt.Errorf("end takeover: %w", err)
	}
	if !offline {
		// The session goes on with the new connection, whose record
		// replaces this one: the previous connection's will is void.
		st.Session.Will = nil
	}
	// Adopted with no connection (a draining edge handing it over), the
	// session keeps the will of its last connection, which ended without
	// a DISCONNECT: the previous owner voided it as the session left, and
	// it waits here for its delay, stored with the record, as a
	// custodian's would.
	// Only now, with the previous owner done writing, is the new epoch made
	// current: a shared store refuses the previous owner's writes from here
	// on, and anything it stored before is in st or late.
	if err := b.store.Activate(ctx, id, epoch); err != nil {
		return false, fmt.Errorf("activate the taken-over session: %w", err)
	}
	if err := b.store.ImportSession(ctx, st); err != nil {
		return false, fmt.Errorf("store the taken-over session: %w", err)
	}
	if err := b.mergeLate(id, ended.Late); err != nil {
		return false, err
	}
	s.settleAfterTakeover(time.Now(), ended.FramesLanding)
	if offline {
		willNow = b.scheduleAdoptedWill(id, &st.Session)
	}
	return true, nil
}

// TakeoverEnded is the previous owner's answer to TakeoverEnd.
type TakeoverEnded struct {
	// Late holds what it queued for the session since TakeoverBegin (the
	// session transfer encoding).
	Late []byte
	// FramesLanding: it was still storing forwarded frames, so messages
	// published before the handover may be relayed here for a while yet.
	FramesLanding bool
}

// errTakeoverIncomplete wraps the failure of a takeover after the previous
// owner gave the session up (TakeoverBegin answered with its state).
var errTakeoverIncomplete = errors.New("takeover incomplete")

// resumeOwned resumes from the shared store a session this edge owns at
// the coordinator but holds no copy of, because its takeover from previous
// failed: after the previous owner gave it up (its copy and routes go when
// it ends the takeover or stops), or because the previous owner left. No
// custodian takes a session its owner holds, so without a copy here nothing
// would queue for it until its client came back, and what is published
// meanwhile would be acknowledged to nobody. Resumed (its epoch made
// current, so the previous owner stores nothing more), the session waits
// here, offline, for its client. It reports whether the session is here now
// (or a newer copy of it, its client having come back first), and whether
// no takeover of it is left unfinished here: it is here, a newer claim took
// it elsewhere, or it ended. Unless settled, the caller lists it unfinished.
func (b *Broker) resumeOwned(sc *tenancy.Scope, clientID string, epoch uint64, previous string) (here, settled bool) {
	if b.store == nil || !b.store.Shared() {
		return false, false
	}
	ctx, cancel := context.WithTimeout(b.stopped, 30*time.Second)
	defer cancel()
	id := sc.ClientID(clientID)
	err := b.claimShared(ctx, sc, clientID, epoch, previous, false, true, false, true)
	switch {
	case errors.Is(err, errNewerCopy):
	case errors.Is(err, durable.ErrFenced):
		// A newer claim holds the session (its client connected to
		// another edge meanwhile): the takeover is that claim's now, not
		// unfinished here. Listed still, it would hold the previous
		// owner's routes, if it died, for the whole adoption wait.
		b.logger.Info("session of a failed takeover claimed again elsewhere; not resumed here", "client_id", id,
			"previous", previous, "error", err)
		b.setUnfinished(id, unfinishedTakeover{})
		return false, true
	case err != nil:
		b.logger.Warn("session of a failed takeover not resumed; it waits in the store for its client", "client_id", id,
			"previous", previous, "error", err)
		return false, false
	case b.session(id) == nil:
		b.setUnfinished(id, unfinishedTakeover{})
		return false, true // nothing stored: the session ended
	}
	b.setUnfinished(id, unfinishedTakeover{})
	return true, true
}

// unfinishedTakeover is a takeover that failed after this edge's claim
// went through: the coordinator says this edge owns the session, but the
// previous owner still holds it (or held it when it went away).
type unfinishedTakeover struct {
	previous string
	epoch    uint64 // of this edge's claim
	scope    *tenancy.Scope
	clientID string // external
}

// unfinishedTakeover returns the edge a failed takeover of id was from,
// or self if there is none. A copy here under an older claim than the
// failed one's is no sign the takeover was settled since (holdsSince).
func (b *Broker) unfinishedTakeover(id, self string) string {
	b.sessMu.Lock()
	u, ok := b.unfinished[id]
	b.sessMu.Unlock()
	if ok && !b.holdsSince(id, u.epoch) {
		return u.previous
	}
	return self
}

// passUnfinished answers a takeover of id under newEpoch that reached this
// edge, named as the previous owner while it holds no copy: it returns the
// edge its own failed takeover left the session on ("" if none), and
// forgets that takeover, which is the newer claim's now.
func (b *Broker) passUnfinished(id string, newEpoch uint64) string {
	b.sessMu.Lock()
	defer b.sessMu.Unlock()
	u, ok := b.unfinished[id]
	if !ok || u.epoch >= newEpoch || b.sessions[id] != nil {
		return ""
	}
	delete(b.unfinished, id)
	return u.previous
}

// setUnfinished records (or with a zero u forgets) a takeover of id that
// failed after the claim.
func (b *Broker) setUnfinished(id string, u unfinishedTakeover) {
	b.sessMu.Lock()
	defer b.sessMu.Unlock()
	if u.previous == "" {
		delete(b.unfinished, id)
		return
	}
	if b.unfinished == nil {
		b.unfinished = map[string]unfinishedTakeover{}
	}
	b.unfinished[id] = u
}

// PreviousOwnerGone is told that an edge left the membership (its lease
// expired). The sessions this edge claimed from it without completing the
// takeover are owned here as far as the coordinator knows, so custody
// passes them by, and the dead edge's routes go after the grace: until
// their clients reconnect, nobody would hold them and what is published
// for them would find no route. They are adopted from the shared store
// now, as a custodian would, and wait here, queueing, for their clients.
func (b *Broker) PreviousOwnerGone(edge string) {
	if b.store == nil || !b.store.Shared() {
		return
	}
	b.sessMu.Lock()
	var adopt []unfinishedTakeover
	for id, u := range b.unfinished {
		if u.previous == edge && b.sessions[id] == nil {
			adopt = append(adopt, u)
		}
	}
	b.sessMu.Unlock()
	for _, u := range adopt {
		b.releases.Add(1)
		go func() {
			defer b.releases.Done()
			id := u.scope.ClientID(u.clientID)
			unlock, err := b.claiming.lock(b.stopped, id)
			if err != nil {
				return
			}
			defer unlock()
			// A claim that ran meanwhile settled the takeover.
			b.sessMu.Lock()
			still := b.unfinished[id] == u && b.sessions[id] == nil
			b.sessMu.Unlock()
			if still {
				b.resumeOwned(u.scope, u.clientID, u.epoch, edge)
			}
		}()
	}
}

// claimShared makes this edge the writer of a session in a store every
// edge shares, and resumes the session from it when no live edge handed it
// over: its previous owner died, or a custodian holds it only in the store
// (or, with no previous owner, the store holds it all the same). A stored
// session that did not outlive its connection is not resumed: it ended,
// and only its will is left to publish. A session that nobody owned
// before and that stores nothing (it does not outlive its connection and
// has no will) costs the store nothing.
//
// offline is set when no connection of the client resumes the session
// (the edge adopts it): the will its last connection left in the store then
// waits for its delay, as a custodian's would (scheduleAdoptedWill);
// resumed by a connection, the will is void ([MQTT-3.1.3-9]).
func (b *Broker) claimShared(ctx context.Context, sc *tenancy.Scope, clientID string, epoch uint64, previous string, cleanStart, stores, moved, offline bool) error {
	if moved || (previous == "" && !stores) {
		return nil
	}
	id := sc.ClientID(clientID)
	if err := b.store.Activate(ctx, id, epoch); err != nil {
		return fmt.Errorf("activate session: %w", err)
	}
	if previous == "" && cleanStart {
		return nil
	}
	if cleanStart {
		// Whatever a dead owner left must not come back; the session ends
		// here, so a will it left goes out now ([MQTT-3.1.3-9]).
		if st, ok, err := b.store.LoadSession(ctx, id); err == nil && ok && st.Session.Will != nil {
			if err := b.publishWill(id, fromRecord(st.Session.Will.Msg), nil); err != nil {
				// The edge stops: the will stays stored, and the client's
				// next CONNECT (elsewhere) sends it.
				return fmt.Errorf("will of the ended session not published: %w", err)
			}
		}
		return b.store.DeleteSession(ctx, id, true)
	}
	if s := b.session(id); s != nil {
		return nil // this edge holds it already
	}
	// With no previous owner this is most often a new session, and the
	// read finds nothing. A stored one is the client's all the same: an
	// owner that gave its claim back without ending the session must not
	// cost the client its session and what is queued for it.
	st, ok, err := b.store.LoadSession(ctx, id)
	if err != nil || !ok {
		return err
	}
	if !st.Session.Persistent() {
		// A session that does not outlive its connection (Session Expiry
		// 0, a 3.1.1 clean session) ended with it, on an owner that died
		// or gave its claim back before the end removed the record, kept
		// for the will alone. Nothing of it is resumed (Session Present 0
		// [MQTT-3.2.2-3]; 3.1.1 [MQTT-3.1.2-6]); the will, not published
		// yet, goes out now, the session having ended ([MQTT-3.1.3-9]),
		// and leaves the store with the record, as on a clean start.
		// Not sent, it stays stored, and the client's next CONNECT tries
		// again.
		if w := st.Session.Will; w != nil {
			if err := b.sendWill(fromRecord(w.Msg)); err != nil {
				return fmt.Errorf("will of the ended session not published: %w", err)
			}
		}
		return b.store.DeleteSession(ctx, id, true)
	}
	b.m.resumedFromStore.Inc()
	if previous == "" {
		b.logger.Warn("session stored while no edge owned it; resumed from the shared store", "client_id", id,
			"queued", len(st.Queue), "inflight", len(st.Inflight))
	} else {
		b.logger.Info("session resumed from the shared store", "client_id", id, "previous", previous,
			"queued", len(st.Queue), "inflight", len(st.Inflight))
	}
	s, err := b.importSession(ctx, sc, id, epoch, st)
	if err != nil {
		return err
	}
	var now func()
	if offline {
		// Scheduled before the hold goes: a takeover waits for the hold,
		// and must find the will waiting, to void it.
		now = b.scheduleAdoptedWill(id, &st.Session)
	}
	s.releaseHold()
	if offline {
		b.countFromEnd(s, &st.Session)
	}
	if now != nil {
		now()
	}
	return nil
}
