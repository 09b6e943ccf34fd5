package broker

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"

	"github.com/keelmq/keel/services/edge/internal/durable"
)

// pendingWill is a will waiting for its delay.
type pendingWill struct {
	timer *time.Timer
	fire  func()
	at    time.Time // when its delay passes
	due   bool      // its delay passed while the edge was stopping; not sent
	// copy is the session copy whose connection left the will (nil: not
	// known); forgetting that copy cancels it (cancelWillOf), and no other.
	copy *session
	// keep stores the will for the edge's restart, if the edge stops
	// while it waits (a single-node edge; nil on an edge of a cluster,
	// whose custodian takes it over from the shared store).
	keep func()
}

// stop stops pw's timer, if it has one: a will a move holds is not armed.
func (pw *pendingWill) stop() {
	if pw.timer != nil {
		pw.timer.Stop()
	}
}

// newWill builds the will a connection carries. Its msgID is fixed now, so
// that if a custodian has to publish it again from the shared store (its
// first publisher died before clearing it there), every stored copy is the
// same message and is kept once.
func (b *Broker) newWill(topic string, payload []byte, qos byte, retain bool, props Props) *Message {
	return &Message{ID: b.ids.next(), Topic: topic, Payload: payload, QoS: qos, Retain: retain, Props: props,
		Created: time.Now().UnixNano()}
}

// errStopping refuses to publish a will while the edge stops: the will
// goes out from where the session goes next, a custodian edge (a cluster's
// shared store holds it), or this edge when it starts again
// (keepWillForRestart, a single-node edge).
var errStopping = errors.New("edge stopping")

// willsHeldBack reports whether a will due now cannot go out from this
// edge: it stops. A draining edge of a cluster is a member still, and
// routes, until it closes: a will its timer makes due waits for the
// session's handover all the same (armLocked), but one due because its
// session ended here (its expiry passed, or its client started clean on
// another edge), or due at once as the drain closed its connection, goes
// out from here: a session that ended has no handover to carry its will,
// and the end removes the stored record that holds it.
func (b *Broker) willsHeldBack() bool {
	if !b.stopping.Load() {
		return false
	}
	if !b.draining.Load() || b.singleNode() {
		return true
	}
	select {
	case <-b.done:
		return true
	default:
		return false
	}
}

// sendWill publishes a will now, and fails unless every recipient took it.
func (b *Broker) sendWill(will *Message) error {
	if b.willsHeldBack() {
		return errStopping
	}
	now := time.Now()
	m := &Message{ID: will.ID, Topic: will.Topic, Payload: will.Payload, QoS: will.QoS, Retain: will.Retain,
		Props: will.Props, Origin: will.Origin, Created: now.UnixNano()}
	if m.ID == (MsgID{}) {
		m.ID = b.ids.next()
	}
	if e := m.Props.MessageExpiryInterval; e > 0 {
		m.Expiry = now.Unix() + min(int64(e), b.cfg.MaxMessageExpiry)
	}
	if m.Retain {
		_ = b.retain(m) // counted and logged; the will's delivery goes on
	}
	if err := b.route(m); err != nil {
		return err
	}
	b.m.willsPublished.Inc()
	return nil
}

// publishWill publishes a will now. rec, when set, is the stored session
// record that holds it: the will leaves the record once it is out. It
// returns errStopping, having done nothing, when the edge stops; and when
// the stop began while the will went out and its writes failed (their
// waits end with the stop): then the will stays where it was kept, for
// the caller to keep it for the restart (a single-node edge) or for a
// custodian to read from the stored record. Sent again, with the same
// msgID, it is stored once by each recipient that took it already.
func (b *Broker) publishWill(id string, will *Message, rec *durable.Session) error {
	if err := b.sendWill(will); err != nil {
		if errors.Is(err, errStopping) {
			return errStopping
		}
		if b.willsHeldBack() {
			b.logger.Warn("will not stored for every recipient as the edge stops; kept to go out again", "client_id", id, "error", err)
			return errStopping
		}
		b.logger.Error("will not stored for every recipient", "client_id", id, "error", err)
	}
	if rec != nil {
		b.dropStoredWill(id, rec)
	}
	return nil
}

// scheduleWill publishes will after delay unless the session reconnects
// first ([MQTT-3.1.3-9]).
func (b *Broker) scheduleWill(id string, will *Message, delay time.Duration, rec *durable.Session, copy *session) {
	if delay <= 0 {
		b.publishWill(id, will, rec)
		return
	}
	b.willMu.Lock()
	defer b.willMu.Unlock()
	b.scheduleWillLocked(id, will, delay, rec, copy)
}

// willAtEnd publishes, schedules or voids the will of c, a connection of
// session id that ended without a normal DISCONNECT, by what became of its
// session. A takeover decides the session's fate (takeOver, the copy's
// end, a move) before it cancels the will waiting for its delay, and both
// the cancel and this decision are made under willMu: a will scheduled
// before the cancel is cancelled, and one decided after it sees the fate.
// Through the connection alone the takeover cannot reach a connection
// that left b.conns already, its will on the way here. heldBack reports a
// will published here and now that the edge's stop held back (kept, if
// keep): the caller keeps it again once the session's end, which removes
// the stored record, is done.
func (b *Broker) willAtEnd(id string, c *conn, will *Message, delay uint32, keep func()) (heldBack bool) {
	b.willMu.Lock()
	sess := c.sess.Load()
	var stopped atomic.Bool
	pw := &pendingWill{fire: func() {
		if b.publishWill(id, will, c.record) == errStopping {
			stopped.Store(true)
			if keep != nil {
				keep() // due as the edge stops: it goes out when the edge is back
			}
		}
	},
		at: time.Now().Add(time.Duration(delay) * time.Second), copy: sess, keep: keep}
	after, parked := sess.afterOrPark(c.epoch, pw)
	if parked {
		// Another edge is taking the session over: the will is void if it
		// does, and decided again here if the takeover fails (TakeOver).
		b.willMu.Unlock()
		return
	}
	switch after {
	case sessionResumed, sessionMoved:
		// A new connection to the session came before the delay passed
		// ([MQTT-3.1.3-9]), or another edge holds the session on. The will
		// leaves the stored record too, although the newer connection's
		// record replaces it: that connection's CONNECT may fail to store
		// its own, and left there, the will would be published by a
		// custodian (this edge dying) for a session this edge resumed.
		// Once the newer record is stored the drop finds its record
		// replaced and writes nothing (dropStoredWill).
		b.willMu.Unlock()
		if c.record != nil {
			b.dropStoredWill(id, c.record)
		}
		return
	case sessionEnded:
		delay = 0 // published when the delay passes or the session ends, whichever is first
	}
	if delay > 0 {
		b.armLocked(id, pw, time.Duration(delay)*time.Second)
		b.willMu.Unlock()
		return false
	}
	b.willMu.Unlock()
	pw.fire()
	return stopped.Load()
}

// scheduleWillLocked is scheduleWill for a delay above 0; b.willMu is held.
func (b *Broker) scheduleWillLocked(id string, will *Message, delay time.Duration, rec *durable.Session, copy *session) {
	b.armLocked(id, &pendingWill{fire: func() { b.publishWill(id, will, rec) }, at: time.Now().Add(delay), copy: copy}, delay)
}

// armLocked makes pw the will waiting for id, due after delay (above 0),
// in place of any other; b.willMu is held.
func (b *Broker) armLocked(id string, pw *pendingWill, delay time.Duration) {
	publish := pw.fire
	if old := b.wills[id]; old != nil {
		old.stop()
	}
	pw.timer = time.AfterFunc(delay, func() {
		b.willMu.Lock()
		if b.wills[id] != pw {
			b.willMu.Unlock()
			return // cancelled as it fired
		}
		if b.stopping.Load() {
			b.keepDueLocked(id, pw)
			b.willMu.Unlock()
			return
		}
		delete(b.wills, id)
		// Counted under willMu, before the stop's own pass over the
		// wills, among the releases Close waits for before the store
		// closes: a will the stop cuts short is kept (publishWill).
		b.releases.Add(1)
		b.willMu.Unlock()
		defer b.releases.Done()
		publish()
	})
	b.wills[id] = pw
}

// keepDueLocked keeps pw as the will of id, due: due while the edge
// stops, a will cannot be sent from here. It stays for the session's
// handover to carry (a drain's adopter sends it), or in the stored record
// for a custodian. b.willMu is held.
func (b *Broker) keepDueLocked(id string, pw *pendingWill) {
	if old := b.wills[id]; old != nil && old != pw {
		old.stop()
	}
	pw.due = true
	b.wills[id] = pw
}

// cancelWillOf drops the delayed will that a connection of session copy s
// left, if it is the one waiting: s was given up for a newer holder, which
// decides the will. A will a newer copy's connection left since is that
// copy's, and waits on.
func (b *Broker) cancelWillOf(id string, s *session) {
	b.willMu.Lock()
	pw := b.wills[id]
	if pw == nil || pw.copy != s {
		b.willMu.Unlock()
		return
	}
	delete(b.wills, id)
	b.willMu.Unlock()
	pw.stop()
}

// cancelWill drops a delayed will when its client reconnects. When the new
// connection starts clean the old session ends now, and its will's delay with
// it: the will is published at once.
func (b *Broker) cancelWill(id string, clean bool) {
	if pw := b.takeWill(id); pw != nil && clean {
		pw.fire()
	}
}

// takeWill stops the will waiting for id and returns it, or nil if none
// was. One that is there has not gone out, whether its timer fired or not:
// a timer's publish removes it first, under b.willMu, and gives up if it
// is gone. One due while the edge stopped is returned as well.
func (b *Broker) takeWill(id string) *pendingWill {
	b.willMu.Lock()
	defer b.willMu.Unlock()
	return b.takeWillLocked(id)
}

func (b *Broker) takeWillLocked(id string) *pendingWill {
	pw := b.wills[id]
	if pw != nil {
		delete(b.wills, id)
		pw.stop()
	}
	return pw
}

// willRecord is the session record to store for a connection's session:
// with its will when a shared store holds it, so that a custodian can
// publish the will if this edge dies. nil when nothing needs storing: a
// session that does not outlive its connection and has no will there.
func (b *Broker) willRecord(rec durable.Session, c *conn) *durable.Session {
	if w := c.will.Load(); w != nil && b.store.Shared() {
		rec.Will = &durable.Will{Msg: w.record(), Delay: c.willDelay}
	}
	if rec.Will == nil && !rec.Persistent() {
		return nil
	}
	return &rec
}

// dropStoredWill takes the will out of the session's stored record once it
// was published, or can no longer be (a normal DISCONNECT). It
// does nothing if the record was replaced since: rec is the one that held
// the will. A session that does not outlive its connection loses its record.
//
// The check and the write are made under the session's record lock, which
// a newer connection's persistSession holds across its own write and its
// replacing of s.record: the newer record, stored before that connection
// is bound, is never overwritten (or deleted) by this one.
func (b *Broker) dropStoredWill(id string, rec *durable.Session) {
	ctx, cancel := context.WithTimeout(context.Background(), storeTimeout)
	defer cancel()
	unlock, err := b.recordWrites.lock(ctx, id)
	if err != nil {
		b.logger.Warn("will not cleared from the stored session", "client_id", id, "error", err)
		return
	}
	defer unlock()
	s := b.session(id)
	if s == nil {
		return
	}
	s.mu.Lock()
	if s.record != rec {
		s.mu.Unlock()
		return
	}
	s.record = nil
	s.mu.Unlock()
	if rec.Persistent() {
		without := *rec
		without.Will = nil
		err = b.store.PutSession(ctx, without)
	} else {
		err = b.store.DeleteSession(ctx, id, true)
	}
	if err != nil {
		// A custodian may publish it again if this edge dies now; with the
		// same msgID, stored recipients keep it once.
		b.logger.Warn("will not cleared from the stored session", "client_id", id, "error", err)
	}
}

// singleNode reports whether this edge is the whole broker: no other edge
// takes its sessions over, so a will its stop leaves is its own to publish
// when it starts again.
func (b *Broker) singleNode() bool {
	_, local := b.cluster.Ownership.(*localOwnership)
	return local && (b.store == nil || !b.store.Shared())
}

// keptWill is the record that keeps the will of connection c of cl, which
// ended at ended without a normal DISCONNECT, over the edge's restart: the
// session's record with the will, and with the end, from which the will's
// delay and the session's expiry count.
func keptWill(cl *mqtt.Client, c *conn, will *Message, ended time.Time) durable.Session {
	rec := sessionRecord(cl, c)
	rec.Props = recordProps(cl)
	rec.Will = &durable.Will{Msg: will.record(), Delay: c.willDelay}
	rec.Disconnected = ended.UnixNano()
	return rec
}

// storeEndedWill rewrites the stored record of session id, which ended
// here under the claim of epoch upTo while the edge stops, as a session
// that ended and left its will: no expiry, clean, the will kept. Wills are
// held back then, so the will goes out from the session's next holder,
// which must not resume the session (claimShared publishes such a will
// and removes the record, as a custodian does). It reports whether the
// record must stay: false only when it holds no will (the end then
// removes it). A record a newer claim of the client stored is that
// claim's, and stays as it is; one the rewrite could not read or write
// stays as it was, with its will.
func (b *Broker) storeEndedWill(id string, upTo uint64) (keep bool) {
	ctx, cancel := context.WithTimeout(context.Background(), storeTimeout)
	defer cancel()
	unlock, err := b.recordWrites.lock(ctx, id)
	if err != nil {
		b.logger.Warn("will of an ended session kept in its stored record as it was", "client_id", id, "error", err)
		return true
	}
	defer unlock()
	s := b.session(id)
	if s != nil && s.claimedAfter(upTo) || b.establishedClaims.newest(id) > upTo || b.connecting(id, upTo+1) {
		return true
	}
	st, ok, err := b.store.LoadSession(ctx, id)
	if err != nil {
		b.logger.Warn("will of an ended session kept in its stored record as it was", "client_id", id, "error", err)
		return true
	}
	if !ok || st.Session.Will == nil {
		return false
	}
	if s != nil {
		// A will drop still to come (the will's own timer) finds the
		// record replaced, and writes nothing (dropStoredWill).
		s.mu.Lock()
		s.record = nil
		s.mu.Unlock()
	}
	rec := st.Session
	rec.ExpiryInterval, rec.Clean = 0, true
	if err := b.store.PutSession(ctx, rec); err != nil {
		b.logger.Warn("will of an ended session kept in its stored record as it was", "client_id", id, "error", err)
	}
	return true
}

// keepWillForRestart stores rec (keptWill), the will of the connection of
// session id under the claim of epoch, when a single-node edge stops
// before the will went out: the client did not leave with a normal
// DISCONNECT, so its will goes out after its delay unless it comes back
// first [MQTT-3.1.2-8], and the edge publishes it when it starts again
// (restoredWills). A newer connection of the client (one the stop has
// not refused yet) decides the will and owns the record: it is left as
// it is, under the session's record lock, as persistSession leaves a
// newer connection's.
func (b *Broker) keepWillForRestart(id string, epoch uint64, rec durable.Session) {
	ctx, cancel := context.WithTimeout(context.Background(), storeTimeout)
	defer cancel()
	unlock, err := b.recordWrites.lock(ctx, id)
	if err != nil {
		b.logger.Warn("will not kept for the restart", "client_id", id, "error", err)
		return
	}
	defer unlock()
	s := b.session(id)
	if s != nil && s.claimedAfter(epoch) || b.establishedClaims.newest(id) > epoch || b.connecting(id, epoch+1) {
		return
	}
	if s == nil {
		// The session ended with the connection (a clean session, the
		// stop's end of it), or since (an operator's discard): only the
		// will is left, and it goes out as soon as the edge is back.
		rec.ExpiryInterval, rec.Clean = 0, true
	}
	if err := b.store.PutSession(ctx, rec); err != nil {
		b.logger.Warn("will not kept for the restart", "client_id", id, "error", err)
	}
}

// restoredWills publishes or schedules the wills a single-node edge's store
// kept over its restart (keepWillForRestart): of sessions that ended
// (published now; their records go) and of persistent sessions whose
// clients have not come back (after what is left of their delay, counted
// from when the connection ended, unless the client comes back first). It
// runs before the listeners open, so that a client connecting at once
// finds its will waiting and cancels it. An edge of a cluster publishes
// none: records of ended sessions go, and the rest wait for the shared
// store's custodians as before.
func (b *Broker) restoredWills(ended, waiting []durable.Session) {
	ctx, cancel := context.WithTimeout(context.Background(), storeTimeout)
	defer cancel()
	single := b.singleNode()
	for _, rec := range ended {
		if single && rec.Will != nil {
			b.publishWill(rec.ID, fromRecord(rec.Will.Msg), nil)
		}
		if err := b.store.DeleteSession(ctx, rec.ID, true); err != nil {
			b.logger.Warn("ended session not removed from the store", "client_id", rec.ID, "error", err)
		}
	}
	if !single {
		return
	}
	ends := make(map[string]time.Time, len(waiting))
	for i := range waiting {
		if now := b.scheduleAdoptedWill(waiting[i].ID, &waiting[i]); now != nil {
			now()
		}
		if at := waiting[i].DisconnectedAt(); !at.IsZero() {
			ends[waiting[i].ID] = at
		}
	}
	// The session's expiry counts from that end too (§3.1.2.11.2): mochi
	// dates a restored client's end from its load, and OnDisconnect, which
	// it calls for each as it loads them, moves it back; before the
	// listeners open, so that no client resumes a session that expired
	// while the edge was down, its will published.
	b.restoredEnds = ends
	if n := len(ended) + len(waiting); n > 0 {
		b.logger.Info("wills kept over the restart published or scheduled", "ended_sessions", len(ended), "waiting", len(waiting))
	}
}
