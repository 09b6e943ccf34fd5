package broker

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/keelmq/keel/services/edge/internal/durable"
)

// Custody hands a persistent session of a draining edge to another edge,
// which adopts it (DESIGN: custody of offline sessions).
type Custody interface {
	Handover(ctx context.Context, tenant, clientID string) error
}

// drainParallel bounds the handovers in flight while draining.
const drainParallel = 16

const (
	// drainWriteWait bounds the write of the DISCONNECT to a client that
	// may not be reading; its connection is closed regardless after it.
	drainWriteWait = time.Second
	// drainDisconnectParallel bounds the clients being disconnected at once.
	drainDisconnectParallel = 64
	// drainOfflineWait bounds the wait for the disconnected clients'
	// sessions to go offline before they are handed over.
	drainOfflineWait = 5 * time.Second
	// drainHeldWait bounds the wait for the sessions handed over to their
	// clients' new edges to be taken over from this one.
	drainHeldWait = 5 * time.Second
	// drainLeftWait is drainHeldWait for the sessions that stay in the
	// store: a client back elsewhere at once has claimed its session there
	// within it.
	drainLeftWait = time.Second
)

// DrainOptions shape a drain.
type DrainOptions struct {
	// ServerReference, when set, tells MQTT 5 clients where to reconnect:
	// they get DISCONNECT 0x9C (use another server) with it as the Server
	// Reference property instead of 0x8B (server shutting down).
	ServerReference string
}

// Drain is DrainWith without options.
func (b *Broker) Drain(ctx context.Context) (moved, stayed int) {
	return b.DrainWith(ctx, DrainOptions{})
}

// DrainWith prepares the edge to stop without losing a session: new
// connections are refused, every client is disconnected with 0x8B, or 0x9C
// and a server reference, and each persistent session is handed to a
// custodian edge, which takes it over with its queue and keeps queueing for
// it until the client comes back. A closed connection's will is the
// server's close's [MQTT-3.1.2-8]: it waits for its delay and goes with its
// session, for the custodian to send unless the client comes back first;
// one with no delay goes out from here (OnDisconnect). A session that
// could not be handed over, by ctx's end at the latest, stays in this
// edge's store. It returns how many sessions moved and how many stayed.
func (b *Broker) DrainWith(ctx context.Context, opts DrainOptions) (moved, stayed int) {
	b.drainReference.Store(&opts.ServerReference) // before draining: who sees that sees this
	b.draining.Store(true)
	b.stopping.Store(true)
	b.disconnectAll(opts.ServerReference)
	// Sessions go offline as their connections close, and each end decides
	// its connection's will (OnDisconnect) before the session is handed
	// over: a will waiting for its delay goes with it (TakeOver). A session
	// goes offline within its connection's end, so once none is online,
	// every end to wait for has begun.
	wait, cancel := context.WithTimeout(ctx, b.offlineWait)
	waitUntil(wait, func() bool { return b.countSessions(online) == 0 && b.disconnecting.Load() == 0 })
	cancel()
	if b.cluster.Custody == nil {
		return 0, b.sessionCount()
	}
	var persistent []*session
	b.sessMu.Lock()
	for _, s := range b.sessions {
		if s.persistent && s.durable {
			persistent = append(persistent, s)
		}
	}
	b.sessMu.Unlock()

	var mu sync.Mutex
	left := map[*session]bool{} // stayed: not handed over; guarded by mu
	sem := make(chan struct{}, drainParallel)
	var wg sync.WaitGroup
	for _, s := range persistent {
		external, ok := s.scope.ExternalClientID(s.id)
		if !ok {
			continue
		}
		// Online first: a connection's end counts itself ending before
		// the session goes offline.
		if s.online.Load() || s.ending.Load() > 0 {
			// Its connection has not ended past the wait, or its end has
			// not decided the will: handed over now, the session would
			// leave without the will, void where it goes. It stays, with
			// the will in its stored record, which the stop leaves there
			// (OnDisconnect, forCustody) for the custodian that adopts
			// the session once this edge is gone.
			mu.Lock()
			stayed++
			left[s] = true
			mu.Unlock()
			b.logger.Warn("session not handed over: its connection has not ended; it stays in the store for custody",
				"client_id", s.id)
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			err := b.cluster.Custody.Handover(ctx, s.scope.Tenant(), external)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				stayed++
				left[s] = true
				b.logger.Warn("session not handed over; it stays in this edge's store", "client_id", s.id, "error", err)
				return
			}
			moved++
		}()
	}
	wg.Wait()
	// A session whose client took it to another edge during the drain (the
	// custodian found it moved on) leaves only when that edge's takeover
	// reaches this one: until then this edge holds its routes and queues
	// for it, and leaving sooner would leave it with no edge that does. The
	// wait is short (a client reconnecting at once) and bounded. A session
	// that stays (left) is waited for a shorter while: its client, sent
	// away by the drain, is likely back elsewhere at once, and the claim
	// there takes it over from here; past that, its store keeps it for
	// custody.
	held, cancelHeld := context.WithTimeout(ctx, drainHeldWait)
	leftUntil := time.Now().Add(drainLeftWait)
	waitUntil(held, func() bool {
		leftToo := time.Now().Before(leftUntil)
		return b.countSessions(func(s *session) bool { return heldPersistent(s) && (leftToo || !left[s]) }) == 0
	})
	cancelHeld()
	// A session may still be between TakeoverBegin and TakeoverEnd here:
	// the other edge admits its client only once End answered, so the edge
	// stays for it.
	waitUntil(ctx, func() bool { return b.countSessions(beingTakenOver) == 0 })
	b.m.drainedSessions.WithLabelValues("moved").Add(float64(moved))
	b.m.drainedSessions.WithLabelValues("stayed").Add(float64(stayed))
	b.logger.Info("drained", "sessions_moved", moved, "sessions_stayed", stayed)
	return moved, stayed
}

// disconnectAll disconnects every client for a drain, several at a time,
// each write bounded by drainWriteWait.
func (b *Broker) disconnectAll(serverReference string) {
	sem := make(chan struct{}, drainDisconnectParallel)
	var wg sync.WaitGroup
	for _, cl := range b.server.Clients.GetAll() {
		if cl.Net.Conn == nil || cl.Closed() {
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			b.disconnectDraining(cl, serverReference)
		}()
	}
	wg.Wait()
}

// disconnectDraining disconnects cl for a drain: DISCONNECT 0x8B, or for an
// MQTT 5 client and a server reference 0x9C (use another server) with the
// Server Reference property. Either way the connection's stop cause is the
// server shutting down, and the disconnect counts as a shutdown.
func (b *Broker) disconnectDraining(cl *mqtt.Client, serverReference string) {
	_ = cl.Net.Conn.SetWriteDeadline(time.Now().Add(drainWriteWait))
	if serverReference == "" || cl.Properties.ProtocolVersion != 5 {
		_ = b.server.DisconnectClient(cl, packets.ErrServerShuttingDown)
		return
	}
	code := packets.ErrUseAnotherServer
	_ = cl.WritePacket(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}, ReasonCode: code.Code,
		Properties: packets.Properties{ReasonString: code.Reason, ServerReference: serverReference}})
	cl.Stop(packets.ErrServerShuttingDown)
}

// countSessions counts the sessions held here for which is reports true
// (called with the session's lock held).
func (b *Broker) countSessions(is func(s *session) bool) int {
	b.sessMu.Lock()
	defer b.sessMu.Unlock()
	n := 0
	for _, s := range b.sessions {
		s.mu.Lock()
		if is(s) {
			n++
		}
		s.mu.Unlock()
	}
	return n
}

// online is a session with a connected client.
func online(s *session) bool { return s.online.Load() }

// heldPersistent is a persistent session held here.
func heldPersistent(s *session) bool { return s.persistent && s.durable }

// beingTakenOver is a session another edge began to take over and has not
// finished taking.
func beingTakenOver(s *session) bool { return s.moving != nil && !s.moving.done }

// waitUntil polls done until it reports true or ctx ends.
func waitUntil(ctx context.Context, done func() bool) {
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for ctx.Err() == nil && !done() {
		select {
		case <-ctx.Done():
		case <-tick.C:
		}
	}
}

// Adopt takes custody of a session whose owner, fromEdge, is draining: the
// session is claimed here, only while fromEdge still owns it, and taken over
// from fromEdge as a connecting client would, then stays offline here until
// its client comes back. adopted is true when fromEdge may let the session
// go: it is here now, or its client took it to another edge meanwhile (that
// edge keeps it, and the client its connection); false when the session
// ended.
func (b *Broker) Adopt(ctx context.Context, tenant, clientID, fromEdge string) (adopted bool, err error) {
	if b.draining.Load() {
		return false, errors.New("this edge is draining too")
	}
	if b.cluster.Takeover == nil {
		return false, errors.New("this edge takes no sessions over")
	}
	sc, err := b.scope(tenant)
	if err != nil {
		return false, err
	}
	// Behind this edge's other claims of the session (sessionLocks).
	unlock, err := b.claiming.lock(ctx, sc.ClientID(clientID))
	if err != nil {
		return false, err
	}
	defer unlock()
	// Only while the draining edge owns it: a client that came back
	// elsewhere meanwhile keeps its connection and its session there.
	defer b.claimMarks.end(b.claimMarks.begin())
	var g Grant
	if co, ok := b.cluster.Ownership.(ConditionalOwnership); ok {
		g, err = co.ClaimFrom(ctx, tenant, clientID, fromEdge)
	} else {
		g, err = b.cluster.Ownership.Claim(ctx, tenant, clientID)
	}
	epoch, previous := g.Epoch, g.Previous
	if errors.Is(err, ErrOwnerChanged) {
		b.logger.Debug("session moved on before its handover; left where it is", "client_id", clientID, "from", fromEdge, "error", err)
		return true, nil
	}
	if err != nil {
		return false, err
	}
	b.claimMarks.observe(epoch)
	if previous == "" || previous == b.cfg.EdgeID {
		// Nothing to take: the session ended, or it is here already. A
		// claim with no session behind it is given back.
		if b.session(sc.ClientID(clientID)) == nil {
			_ = b.cluster.Ownership.Release(ctx, tenant, clientID, epoch)
		}
		return false, nil
	}
	b.logger.Debug("session claimed for custody", "client_id", sc.ClientID(clientID), "from", fromEdge, "epoch", epoch, "previous", previous)
	moved := false
	if !g.SourceGone {
		moved, previous, err = b.takeOverFrom(ctx, previous, sc, clientID, epoch, false, true)
	}
	if errors.Is(err, errNewerCopy) {
		// Its client came back here meanwhile, under a newer claim.
		return true, nil
	}
	if errors.Is(err, errTakeoverIncomplete) {
		if here, settled := b.resumeOwned(sc, clientID, epoch, previous); here {
			return true, nil
		} else if settled {
			return false, err // claimed elsewhere meanwhile, or ended: nothing is left unfinished here
		}
	}
	if err != nil {
		// The session is owned here and still held there: it is adopted
		// from the store once that edge is gone (PreviousOwnerGone).
		b.setUnfinished(sc.ClientID(clientID), unfinishedTakeover{previous: previous, epoch: epoch, scope: sc, clientID: clientID})
		return false, err
	}
	if b.store != nil && b.store.Shared() {
		if err := b.claimShared(ctx, sc, clientID, epoch, previous, false, true, moved, true); err != nil {
			return false, err
		}
	}
	return b.session(sc.ClientID(clientID)) != nil, nil
}

// TakeCustody adopts a session that the coordinator assigned to this edge
// under epoch because its owner's lease expired: the session is read from
// the shared store, its routes are registered, and it stays offline here,
// queueing, until its client comes back. adopted is false when nothing was
// stored for it (its ownership is given back) or a newer owner exists.
func (b *Broker) TakeCustody(ctx context.Context, tenant, clientID string, epoch uint64) (adopted bool, err error) {
	if b.store == nil || !b.store.Shared() {
		b.m.adoptedSessions.WithLabelValues("no_shared_store").Inc()
		return false, errors.New("custody of another edge's sessions needs the shared store (cluster.persistence)")
	}
	sc, err := b.scope(tenant)
	if err != nil {
		return false, err
	}
	id := sc.ClientID(clientID)
	unlock, err := b.claiming.lock(ctx, id)
	if err != nil {
		return false, err
	}
	defer unlock()
	if s := b.session(id); s != nil {
		s.mu.Lock()
		newer := s.epoch >= epoch
		s.mu.Unlock()
		if newer {
			b.m.adoptedSessions.WithLabelValues("stale").Inc()
			return false, nil
		}
		b.forgetSession(id)
	}
	if err := b.store.Activate(ctx, id, epoch); err != nil {
		if errors.Is(err, durable.ErrFenced) {
			// Its client has connected somewhere since.
			b.m.adoptedSessions.WithLabelValues("stale").Inc()
			return false, nil
		}
		b.m.adoptedSessions.WithLabelValues("error").Inc()
		return false, err
	}
	st, ok, err := b.store.LoadSession(ctx, id)
	if err != nil {
		b.m.adoptedSessions.WithLabelValues("error").Inc()
		return false, err
	}
	if !ok {
		// A session that stored nothing ended with its connection.
		b.store.Deactivate(id, epoch)
		b.m.adoptedSessions.WithLabelValues("nothing_stored").Inc()
		if err := b.cluster.Ownership.Release(ctx, tenant, clientID, epoch); err != nil {
			b.logger.Debug("custody release refused", "client_id", id, "error", err)
		}
		return false, nil
	}
	if !st.Session.Persistent() {
		// The session ended with its connection when its edge died: only
		// its will is left, and it goes out now ([MQTT-3.1.3-9]).
		if w := st.Session.Will; w != nil {
			if err := b.publishStoredWill(id, w.Msg); err != nil {
				b.m.adoptedSessions.WithLabelValues("error").Inc()
				return false, err
			}
		}
		if err := b.store.DeleteSession(ctx, id, true); err != nil {
			b.logger.Warn("ended session not removed from the store", "client_id", id, "error", err)
		}
		b.store.Deactivate(id, epoch)
		b.m.adoptedSessions.WithLabelValues("ended").Inc()
		if err := b.cluster.Ownership.Release(ctx, tenant, clientID, epoch); err != nil {
			b.logger.Debug("custody release refused", "client_id", id, "error", err)
		}
		return false, nil
	}
	s, err := b.importSession(ctx, sc, id, epoch, st)
	if err != nil {
		// Nothing half-adopted stays: the watch tries again.
		b.m.adoptedSessions.WithLabelValues("error").Inc()
		return false, err
	}
	now := b.scheduleAdoptedWill(id, &st.Session)
	s.releaseHold()
	b.countFromEnd(s, &st.Session)
	if now != nil {
		now()
	}
	b.m.adoptedSessions.WithLabelValues("adopted").Inc()
	return true, nil
}

// scheduleAdoptedWill schedules the will kept in rec, the stored record of
// session id, which this edge took with no connection of its client: its
// connection ended without a DISCONNECT (or its edge died), so the will
// goes out after its delay unless the client comes back first. The delay
// counts from when that connection ended where the record says so (a
// session handed over by a draining edge, or adopted and stored since),
// else from now: when an edge died is not known to the second.
//
// It is called while the copy's hold is up, so that a takeover finds the
// will waiting; a will due at once is returned instead (now), for the
// caller to publish once the hold is released: it may match the session's
// own subscriptions, whose deliveries wait for the hold.
func (b *Broker) scheduleAdoptedWill(id string, rec *durable.Session) (now func()) {
	w := rec.Will
	if w == nil {
		return nil
	}
	s := b.session(id)
	if s != nil {
		s.mu.Lock()
		s.record = rec
		s.mu.Unlock()
	}
	delay := time.Duration(w.Delay) * time.Second
	if rec.ProtocolVersion == 5 {
		delay = min(delay, time.Duration(rec.ExpiryInterval)*time.Second)
	}
	if at := rec.DisconnectedAt(); !at.IsZero() {
		delay -= max(time.Since(at), 0) // an end in the future (a clock ahead) takes nothing off
	}
	will := fromRecord(w.Msg)
	if delay <= 0 {
		return func() { b.publishWill(id, will, rec) }
	}
	b.scheduleWill(id, will, delay, rec, s)
	return nil
}

// countFromEnd dates the end of adopted session s, offline here, back to
// when its last connection ended, where its record says (rec.Disconnected:
// handed over by a draining edge, or stored by an edge that adopted it
// so), so that its expiry counts from then and not from its adoption
// (§3.1.2.11.2). Only once the copy's hold is released: a session that has
// expired already then ends on mochi's next tick, as any offline session
// does, not in the middle of its import.
func (b *Broker) countFromEnd(s *session, rec *durable.Session) {
	at := rec.DisconnectedAt()
	if at.IsZero() {
		return
	}
	cl, ok := b.server.Clients.Get(s.id)
	if !ok || !cl.Closed() || cl.IsTakenOver() || b.session(s.id) != s {
		return // its client came back meanwhile, or the copy went
	}
	cl.SetStoppedAt(at)
}

// publishStoredWill publishes a will read from the shared store and fails
// unless every recipient took it: custody is tried again then, and the
// will, with the same msgID, is kept once by recipients that store it.
func (b *Broker) publishStoredWill(id string, w *durable.Message) error {
	if err := b.sendWill(fromRecord(w)); err != nil {
		return fmt.Errorf("will of %s: %w", id, err)
	}
	return nil
}
