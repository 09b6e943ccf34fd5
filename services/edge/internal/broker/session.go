package broker

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/keelmq/keel/services/edge/internal/auth"
	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

// delivery is one message queued for one session.
type delivery struct {
	msg    *Message
	qos    byte
	retain bool
	ids    []int
	seq    uint64 // position in a durable session's stored queue; 0 when not stored
	// group is the shared group that picked this session for the message;
	// if the session ends before its client acknowledges a QoS 1 one, the
	// group gets it again (shared.go).
	group *shareGroup
	// relayed marks a message the previous owner of a session taken over
	// relayed here: it goes in the queue at its place in ingress order.
	relayed bool
	// onSubscribe marks a retained message sent for a new subscription
	// ([MQTT-3.3.1-9]): it goes out even if the session took it before.
	onSubscribe bool
	// origin is the edge that forwarded this QoS 1 group message and keeps
	// it until told what became of it here (shared.go); nil for a message
	// this edge owns.
	origin *ShareOrigin
	// storeFirst marks a delivery taken for sending while its queueing
	// for the session offline was not yet answered: the tenant's queue
	// bound may refuse that, so its send stores the message first.
	storeFirst bool
	// sendDecides marks a delivery taken for sending while its queueing
	// was not yet answered: if the queueing fails, the send's answer says
	// whether the session has it (settleQueued).
	sendDecides bool
}

// session is the edge's view of one MQTT session: its subscriptions, its
// bounded outbound queue and, while connected, its client. It outlives the
// connection for persistent sessions.
//
// Goroutines: publishers call enqueue; one writer goroutine per session runs
// only while the queue has something it may send, so an idle client costs no
// goroutine of ours.
type session struct {
	id     string // internal client ID
	scope  *tenancy.Scope
	b      *Broker
	online atomic.Bool
	// ending counts the ends of its connections in progress (OnDisconnect),
	// raised before the session goes offline in one: until the end decided
	// the will, a drain does not hand the session over.
	ending atomic.Int32
	nsubs  atomic.Int32 // len(subs), readable without the lock
	// routable is when the session's routes pointed here (unix nano): a
	// message routed again after an edge left without taking it skips the
	// sessions routable here before its first routing, which had it
	// ([Again]). A session made from stored state is routable once its
	// routes are registered; until then it is not skipped.
	routable atomic.Int64

	mu         sync.Mutex
	client     *mqtt.Client // nil while offline
	version    byte
	rules      *auth.Rules
	maxPacket  uint32
	window     int // receive maximum of the client: QoS>0 messages in flight
	inflight   int
	persistent bool
	// endsWithClient: the session does not outlive its bound connection
	// (MQTT 5 Session Expiry 0, a 3.1.1 clean session), as of the bind or
	// of that connection's DISCONNECT since. A takeover of that connection
	// ends the session (takeOver).
	endsWithClient bool
	epoch          uint64 // of the ownership claim that bound the session here
	// moving is set while another edge takes the session over.
	moving *moving
	// recent holds msgIDs queued since the session was taken over from
	// another edge: a message may arrive by two ways (directly, and with the
	// previous owner's late ones or relayed by it), and is queued once.
	recent *recentIDs
	// hold, while open, keeps new messages back until the previous owner's
	// late ones are queued, so the session's order holds.
	hold chan struct{}
	// settleUntil, after a takeover from a live previous owner, holds back
	// the sending of messages that entered the cluster after settleCutoff
	// (unix nano), so that older ones it relays still go first.
	settleUntil  time.Time
	settleCutoff int64
	settleWake   bool // a writer start is armed for settleUntil
	queue        ring
	queueBytes   int
	writing      bool
	// resendingTo is the connection bind writes resends to while a writer
	// it does not own (an older connection's, still running) may take from
	// the queue: no writer takes meanwhile, so nothing new goes ahead of
	// the resends. An idle writer bind owns instead. A connection's bind
	// ends only its own guard: a newer one's may have replaced it.
	resendingTo *mqtt.Client
	idleSince   int64         // unix nano the writer last stopped with nothing to send (writeAlone)
	space       chan struct{} // closed when the queue frees room; publishers wait on it
	nudge       chan struct{} // wakes a writer waiting on the store: more to send
	subs        map[string]*subscription
	aliases     *mqtt.OutboundTopicAliases
	closed      bool   // the session ended; nothing more is queued
	nextID      uint16 // outbound packet ID cursor; writer only
	spilling    bool   // a persistent session's queue went past the live bound; stays so until it drains
	slow        bool   // a non-persistent client being disconnected for staying full; drop what comes
	durable     bool   // persistent with a store: QoS 1/2 deliveries are stored before they count as taken
	seq         uint64 // last stored queue position
	// unsettled holds the queue positions whose stored copies are being
	// written, until settleQueued decides them.
	unsettled map[uint64]unsettledWrite
	// yielding is set once a fenced write made the edge give the session
	// up (claims.go).
	yielding bool
	// sharedOut holds the QoS 1 shared-group deliveries sent to the client
	// and not yet acknowledged, by packet ID; nShared is its size, read
	// without the lock on every acknowledgement.
	sharedOut map[uint16]delivery
	nShared   atomic.Int32
	// unconfirmed holds the QoS 2 publishes of the client that were not
	// acknowledged, by packet ID; took, the QoS 2 deliveries the session
	// took lately (unconfirmed.go).
	unconfirmed map[uint16]unconfirmedPub
	took        *tookQoS2
	// record is the stored session record while it holds a will (shared
	// store only): the will leaves it once published or discarded.
	record *durable.Session
	sent   int64            // send order of in-flight messages; writer only (and bind, before the writer runs)
	resend []packets.Packet // in-flight messages to send again, in order, when a client binds
}

func newSession(b *Broker, id string, scope *tenancy.Scope) *session {
	s := &session{id: id, scope: scope, b: b, subs: map[string]*subscription{}, space: make(chan struct{}),
		nudge: make(chan struct{}, 1)}
	s.routable.Store(time.Now().UnixNano())
	return s
}

type enqueueResult int

const (
	enqueued enqueueResult = iota
	droppedQoS0
	droppedExpired
	droppedOffline  // non-persistent session gone
	droppedOverflow // offline queue full, policy drop
	slowConsumer    // non-persistent consumer stayed full past the grace
	storeFailed     // the durable store refused or timed out
	revoked         // stored, but taken back behind a failed write (settleQueued)
	droppedQuota    // offline, and the tenant's queue bound refused it (policy drop)
)

func notTaken(err error) enqueueResult {
	switch {
	case errors.Is(err, errRevoked):
		return revoked
	case errors.Is(err, durable.ErrQueueQuota):
		return droppedQuota
	}
	return storeFailed
}

// enqueue queues d for the session. For QoS 1/2 to a connected client whose
// queue is full it waits up to the slow-consumer grace (the publisher is
// pushed back); a persistent session past that keeps the message in its
// session queue, a non-persistent one is disconnected with 0x97. For a
// durable session the message counts as taken only once it is stored.
func (s *session) enqueue(d delivery) enqueueResult {
	s.mu.Lock()
	hold := s.hold
	s.mu.Unlock()
	if hold != nil {
		// Taken over just now: what the previous owner held back goes
		// first. The wait is bounded by the CONNECT timeout of the client
		// taking the session over.
		<-hold
	}
	r := s.enqueueNow(d)
	if r == enqueued && tracksQoS2(&d) {
		s.rememberQoS2(d.msg.ID)
	}
	return r
}

// tracksQoS2 reports whether d is a QoS 2 delivery a session takes only
// once: a resend of a QoS 2 publish goes under the msgID of the first copy
// (unconfirmed.go). A retained message sent for a new subscription goes
// out whatever was delivered before.
func tracksQoS2(d *delivery) bool { return d.qos == 2 && !d.onSubscribe }

// offlineFullLocked reports whether a message of size bytes would take the
// session's queue past its offline bounds (count and bytes).
func (s *session) offlineFullLocked(size int) bool {
	cfg := &s.b.cfg
	return s.queue.len() >= cfg.OfflineQueueLen || cfg.OfflineQueueBytes > 0 && s.queueBytes+size > cfg.OfflineQueueBytes
}

// enqueueNow is enqueue without waiting for a takeover to complete. A
// publisher held back by the session's full queue has its wait observed
// (keel_edge_publish_backpressure_seconds): the clock is read only then,
// not for every delivery.
func (s *session) enqueueNow(d delivery) enqueueResult {
	var blocked time.Time
	r := s.enqueueOrWait(d, &blocked)
	if !blocked.IsZero() {
		s.b.m.publishWait.Observe(time.Since(blocked).Seconds())
	}
	return r
}

// enqueueOrWait is enqueueNow; blocked is set to when it first waited for
// queue space.
func (s *session) enqueueOrWait(d delivery, blocked *time.Time) enqueueResult {
	s.mu.Lock()
	if s.moving != nil && s.moving.done {
		// Moved to another edge, whose copy no longer takes what arrives
		// here: the publisher is not acknowledged and sends again.
		s.mu.Unlock()
		return storeFailed
	}
	if r := s.recent; r != nil {
		if now := time.Now(); r.over(now) {
			s.recent = nil
		} else if r.seen(d.msg) {
			s.mu.Unlock()
			return enqueued
		}
	}
	if tracksQoS2(&d) && s.took.has(d.msg.ID) {
		s.mu.Unlock()
		return enqueued // taken before
	}
	s.mu.Unlock()
	cfg := &s.b.cfg
	size := d.msg.size()
	var deadline time.Time
	for {
		s.mu.Lock()
		if s.closed {
			// Ended while this waited: gone, or moved (handed over, or
			// forgotten for another copy). A moved session goes on
			// elsewhere, so the message is not taken here: the sender
			// sends it again and finds the session's new edge.
			moved := s.moving != nil
			s.mu.Unlock()
			if moved {
				return storeFailed
			}
			return droppedOffline
		}
		if s.client == nil {
			// Offline persistent session: bounded by the offline limits.
			if d.qos == 0 && !cfg.QueueQoS0Offline {
				s.mu.Unlock()
				return droppedQoS0
			}
			result := enqueued
			// Held to the tenant's queue bound, unless the session's own
			// drop makes room for it (the tenant's count stays) or it is a
			// group's message, owed to the group.
			bounded := d.group == nil
			if s.offlineFullLocked(size) {
				if !cfg.OfflineDropOldest || size > cfg.OfflineQueueBytes && cfg.OfflineQueueBytes > 0 {
					s.mu.Unlock()
					return droppedOverflow
				}
				var gone []durable.Entry
				popped, freed := 0, false
				for s.queue.len() > 0 && s.offlineFullLocked(size) {
					old := s.queue.pop()
					s.queueBytes -= old.msg.size()
					popped++
					if old.seq > 0 {
						gone = append(gone, durable.Entry{Seq: old.seq, MsgID: msgIDString(old.msg.ID)})
						if w, ok := s.unsettled[old.seq]; ok {
							// Its queueing may yet be refused by the
							// tenant's bound: then it frees nothing there,
							// and its refusal is not a second drop.
							w.dropped = true
							s.unsettled[old.seq] = w
							freed = freed || !w.offline
						} else {
							freed = true
						}
					}
				}
				if len(gone) > 0 && s.b.store != nil {
					_ = s.b.store.Dequeue(context.Background(), s.id, gone)
					bounded = bounded && !freed
				}
				if popped > 1 {
					// The result counts one; a larger message may take more.
					s.b.m.dropped.WithLabelValues("offline_queue_full").Add(float64(popped - 1))
				}
				result = droppedOverflow
			}
			p, seq := s.pushLocked(d, size, bounded)
			s.mu.Unlock()
			if err := s.waitQueued(p, d.msg, seq); err != nil {
				if result == droppedOverflow {
					// What the session's drop made room for was not taken
					// after all: the drop is counted here, not by the result.
					s.b.m.dropped.WithLabelValues("offline_queue_full").Inc()
				}
				return notTaken(err)
			}
			return result
		}
		if s.slow {
			s.mu.Unlock()
			return slowConsumer
		}
		full := s.queue.len() >= cfg.QueueLen || s.queueBytes+size > cfg.QueueBytes
		if full && s.persistent && !deadline.IsZero() && time.Now().After(deadline) {
			s.spilling = true
		}
		if !full || (s.persistent && s.spilling) {
			// A persistent session past the grace keeps the message beyond the
			// live bound, up to the offline bound, rather than lose it.
			if full && s.offlineFullLocked(size) {
				s.mu.Unlock()
				return droppedOverflow
			}
			p, seq := s.pushLocked(d, size, false)
			start := !s.writing
			s.writing = true
			var alone aloneWrite
			if start && seq == 0 && s.aloneLocked(&d) {
				alone = s.takeAloneLocked()
			}
			s.mu.Unlock()
			switch {
			case alone.cl != nil:
				s.writeAlone(alone)
			case start:
				s.b.startWriter(s)
			}
			if err := s.waitQueued(p, d.msg, seq); err != nil {
				return notTaken(err)
			}
			return enqueued
		}
		if d.qos == 0 {
			s.mu.Unlock()
			return droppedQoS0
		}
		space := s.space
		cl := s.client
		s.mu.Unlock()
		if deadline.IsZero() {
			*blocked = time.Now()
			deadline = blocked.Add(cfg.SlowConsumerGrace)
		}
		wait := time.Until(deadline)
		if wait <= 0 {
			if s.persistent {
				continue
			}
			s.b.disconnectSlow(s, cl)
			return slowConsumer
		}
		t := time.NewTimer(wait)
		select {
		case <-space:
		case <-t.C:
		case <-s.b.done:
			t.Stop()
			if s.persistent {
				return storeFailed // the session outlives this edge
			}
			return droppedOffline
		}
		t.Stop()
	}
}

// pushLocked queues d and, for a durable session, submits its stored copy
// in queue order, at position seq; offline marks queueing for a session
// with no client, which the tenant's queue bound may refuse. s.mu must be
// held.
func (s *session) pushLocked(d delivery, size int, offline bool) (p *durable.Pending, seq uint64) {
	if s.durable && s.b.store != nil {
		s.seq++
		d.seq = s.seq
		e := entryOf(&d, 0, 0)
		e.Offline = offline
		p = s.b.store.Enqueue(s.id, e)
		if s.unsettled == nil {
			s.unsettled = map[uint64]unsettledWrite{}
		}
		s.unsettled[d.seq] = unsettledWrite{id: d.msg.ID, origin: d.msg.Origin, offline: offline}
	}
	if d.relayed {
		s.queueRelayedLocked(d)
	} else {
		s.queue.push(d)
	}
	s.queueBytes += size
	s.nudgeWriterLocked()
	return p, d.seq
}

// unsettledWrite is a queued delivery whose stored copy is being written.
type unsettledWrite struct {
	id      MsgID  // its message's
	origin  string // the publisher of its message
	revoked bool   // taken back from the queue: an earlier write of its publisher failed
	// offline marks queueing the tenant's bound may refuse; dropped, that
	// the session's own bound dropped the delivery meanwhile (counted).
	offline, dropped bool
	// sent is set when the writer took the delivery meanwhile: its send
	// stores the message first (storeFirst), and what the session has
	// is then decided by that send, not by the queueing alone.
	sent *sendOutcome
}

// sendOutcome is the store's answer to the Send of a writer's batch.
type sendOutcome struct {
	done chan struct{} // closed once err is set
	err  error
	// cl and ids (queue position → packet ID of each delivery the batch
	// sent) are set before the Send: where a delivery the send failed to
	// store is held in flight. One taken and not in ids was not sent.
	cl  *mqtt.Client
	ids map[uint64]uint16
}

// unsendLocked forgets the PUBLISH with packet ID id that a failed send
// did not store: it leaves the in-flight messages of cl, the client it was
// sent to, or the session's resend list if cl has gone since (detach). One
// the session's next client got already (a resend raced this) stays with
// it. s.mu must be held.
func (s *session) unsendLocked(cl *mqtt.Client, id uint16) {
	if typ, ok := cl.State.Inflight.Type(id); ok && typ == packets.Publish {
		cl.State.Inflight.Delete(id)
		return
	}
	s.resend = slices.DeleteFunc(s.resend, func(pk packets.Packet) bool {
		return pk.PacketID == id && pk.FixedHeader.Type == packets.Publish
	})
}

// settleQueued waits until the store has p, the stored copy of m queued at
// seq, and decides whether the session took m. It did not if the write
// failed: the queuing is undone and the sender sends m again. Then the
// later deliveries of m's publisher still in the queue and not yet decided
// are taken back too (revoked), stored or not, and their senders send them
// again behind m: kept, they would reach the client before m's resend, out
// of their publisher's order. One already taken by the writer stays: the
// client has it.
func (s *session) settleQueued(p *durable.Pending, m *Message, seq uint64) error {
	err := s.settle(p, m)
	s.mu.Lock()
	w := s.unsettled[seq]
	delete(s.unsettled, seq)
	if len(s.unsettled) == 0 {
		s.unsettled = nil // an idle session keeps no map
	}
	if w.sent != nil && err != nil {
		// The writer took m meanwhile (for a client that came back, its
		// send stores m first, not held to the tenant's bound). Once the
		// send is stored the session has m, whatever became of the
		// queueing: counted as not taken, m would be forgotten (took)
		// while its client has it, and its resend delivered again.
		// Failed, the queueing's own answer decides. Taken from the
		// queue, m can no longer be revoked or unqueued meanwhile.
		s.mu.Unlock()
		<-w.sent.done // bounded by the send's own store timeout
		id, sent := w.sent.ids[seq]
		if !sent || w.sent.err == nil {
			// Not sent: expired or too large for the client, dropped by
			// the writer (counted there).
			return nil
		}
		s.mu.Lock()
		// The client got nothing (its writer stops on a failed send), but
		// the edge keeps what it sent in flight and sends it again when
		// the client is back: m must not go with it, stored nowhere.
		s.unsendLocked(w.sent.cl, id)
	}
	if err == nil && !w.revoked {
		s.mu.Unlock()
		return nil
	}
	if err != nil && w.dropped {
		// Dropped already by the session's own rules (counted there):
		// whatever the store did, the session does not have m, and its
		// publisher has nothing to send again.
		s.mu.Unlock()
		return nil
	}
	if errors.Is(err, durable.ErrQueueQuota) && !w.revoked {
		// Dropped for this session by the tenant's bound, as its own full
		// queue would drop it: nothing was stored, the publisher's later
		// messages keep their place, and m is not sent again.
		s.forgetLocked(m.ID)
		s.unqueueLocked(seq, m.ID)
		s.mu.Unlock()
		return err
	}
	s.forgetLocked(m.ID)
	if !w.revoked {
		s.unqueueLocked(seq, m.ID)
	}
	s.revokeAfterLocked(seq, m.Origin)
	s.mu.Unlock()
	if err != nil {
		return err
	}
	// Stored, but revoked: the copy leaves the store as well, or the session
	// would find it ahead of the resend of the message that failed when it
	// moves to another edge. A failure here costs that order only.
	if err := s.b.store.Dequeue(context.Background(), s.id, []durable.Entry{{Seq: seq, MsgID: msgIDString(m.ID)}}); err != nil {
		s.b.logger.Warn("revoked queue entry not removed from the store", "client_id", s.id, "error", err)
	}
	return errRevoked
}

// forgetLocked forgets that the session took message id, which it did not:
// a taken-over session's memory of queued msgIDs, and its memory of QoS 2
// deliveries, or the resend would be taken for a copy queued already and
// acknowledged with nothing stored.
func (s *session) forgetLocked(id MsgID) {
	if r := s.recent; r != nil {
		delete(r.ids, id)
	}
	if s.took != nil {
		// Its ring slot stays until evicted; a resend remembered meanwhile
		// is then forgotten that many deliveries early.
		delete(s.took.ids, id)
	}
}

// unqueueLocked removes the entry of message id at seq if the writer has
// not taken it yet: sent, it would have no stored copy, which the store
// refuses, and the client would be dropped for it.
func (s *session) unqueueLocked(seq uint64, id MsgID) {
	for i := range s.queue.len() {
		if d := s.queue.at(i); d.seq == seq && d.msg != nil && d.msg.ID == id {
			s.queueBytes -= d.msg.size()
			s.queue.remove(i)
			return
		}
	}
}

// revokeAfterLocked takes back the queued deliveries of origin's messages
// after seq whose writes are not decided.
func (s *session) revokeAfterLocked(seq uint64, origin string) {
	pending := false
	for q, w := range s.unsettled {
		if q > seq && !w.revoked && w.origin == origin {
			pending = true
			break
		}
	}
	if !pending {
		return // spares a walk of the queue on every failure of an outage
	}
	s.queue.removeIf(func(d *delivery) bool {
		w, ok := s.unsettled[d.seq]
		if !ok || d.seq <= seq || w.revoked || w.origin != origin || d.msg == nil {
			return false
		}
		w.revoked = true
		s.unsettled[d.seq] = w
		s.queueBytes -= d.msg.size()
		return true
	})
}

// queueRelayedLocked queues a relayed message ahead of the queued ones that
// entered the cluster after it: it was published before them, and reached
// this edge later only because it went by way of the previous owner. One
// already sent cannot be overtaken: while the session settles after its
// takeover, newer messages wait (writeLoop), so a relay arriving by then
// keeps its order.
func (s *session) queueRelayedLocked(d delivery) {
	at := s.queue.len()
	for i := range s.queue.len() {
		if s.queue.at(i).msg.Created > d.msg.Created {
			at = i
			break
		}
	}
	s.queue.insert(at, d)
	order := "kept"
	if s.settleUntil.IsZero() || time.Now().After(s.settleUntil) {
		order = "late"
	}
	s.b.m.relaysReceived.WithLabelValues(order).Inc()
}

// settleAfterTakeover holds back, for handoverSettle, the sending of the
// messages that enter the cluster from now on: the previous owner may still
// relay older ones. framesLanding (the previous owner was still storing
// forwarded frames, and the messages queued behind them on their links may
// come to it and be relayed for a while yet) holds them for
// handoverSettleLanding.
func (s *session) settleAfterTakeover(now time.Time, framesLanding bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	settle := handoverSettle
	if framesLanding {
		settle = handoverSettleLanding
		s.b.logger.Debug("previous owner's store was slow at the handover; newer messages wait for its relays",
			"client_id", s.id, "for", settle)
	}
	s.settleUntil = now.Add(settle)
	s.settleCutoff = now.Add(handoverSkew).UnixNano()
}

// settlingLocked reports whether d must wait for the session to settle
// after its takeover, and until when.
func (s *session) settlingLocked(d *delivery, now time.Time) (bool, time.Time) {
	if s.settleUntil.IsZero() {
		return false, time.Time{}
	}
	if !now.Before(s.settleUntil) {
		s.settleUntil = time.Time{}
		return false, time.Time{}
	}
	return d.msg.Created >= s.settleCutoff, s.settleUntil
}

// wakeWriterAt starts the writer at t, if it is not running then and there
// is something to send.
func (s *session) wakeWriterAt(t time.Time) {
	time.AfterFunc(time.Until(t), func() {
		s.mu.Lock()
		s.settleWake = false
		start := !s.writing && s.queue.len() > 0 && s.client != nil && !s.closed
		if start {
			s.writing = true
		}
		s.mu.Unlock()
		if start {
			s.b.startWriter(s)
		}
	})
}

// wait waits until the store has p; m, when traced, gets a persist span
// for the wait.
func (s *session) wait(p *durable.Pending, m *Message) error {
	if p == nil {
		return nil
	}
	return s.settle(p, m)
}

// waitQueued waits until the store has p, the stored copy of m queued at
// seq (or hands the wait to the caller collecting deferred writes); if it
// was not written, the queuing is undone (settleQueued).
func (s *session) waitQueued(p *durable.Pending, m *Message, seq uint64) error {
	if p == nil {
		return nil
	}
	if m.deferred != nil && m.deferred.add(s, p, m, seq) {
		return nil
	}
	return s.settleQueued(p, m, seq)
}

// settle waits for a durable write of m's delivery, in a persist span.
func (s *session) settle(p *durable.Pending, m *Message) error {
	ctx, cancel := context.WithTimeout(context.Background(), storeTimeout)
	defer cancel()
	span := childSpan(m, "persist", attrStore.String("queue"))
	err := p.Wait(ctx)
	finishSpan(span, err)
	switch {
	case errors.Is(err, durable.ErrQueueQuota):
		// Counted (keel_edge_dropped_total): a tenant at its bound would
		// log once per message.
		s.b.logger.Debug("message dropped for an offline session: tenant's queue quota reached", "client_id", s.id)
	case err != nil:
		s.b.logger.Error("message not stored for a persistent session", "client_id", s.id, "error", err)
		s.b.yieldIfFenced(s, err)
	}
	return err
}

// bind attaches a connected client to the session, and reports whether
// it did: a connection whose claim is older than the session's is one a
// newer CONNECT took the session from while it was being established, and
// a copy that ended (closed) is no longer the edge's: no message routed
// here reaches it, and opened again it would hold the client apart from
// the copy that serves the session.
func (s *session) bind(cl *mqtt.Client, rules *auth.Rules, persistent bool, window int, epoch uint64) bool {
	s.mu.Lock()
	// A closed connection (taken over by a newer CONNECT of the client
	// whose own bind is still to come) would take the session's resends
	// and queue with it.
	if s.epoch > epoch || cl.Closed() || s.closed {
		s.mu.Unlock()
		return false
	}
	s.epoch = epoch
	s.durable = persistent && s.b.store != nil
	s.client = cl
	s.version = cl.Properties.ProtocolVersion
	s.rules = rules
	s.maxPacket = cl.Properties.Props.MaximumPacketSize
	s.window = window
	s.persistent = persistent
	s.endsWithClient = !persistent
	s.slow = false
	s.aliases = mqtt.NewOutboundTopicAliases(cl.Properties.Props.TopicAliasMaximum)
	// In-flight messages of the session go out again first, in their
	// original order with their packet IDs and DUP set ([MQTT-4.4.0-1]);
	// they count against the client's window.
	resend := s.resend
	s.resend = nil
	s.inflight = len(resend)
	for _, pk := range resend {
		s.sent = max(s.sent, pk.Created)
		cl.State.Inflight.Set(pk)
	}
	// The resends go first: until they are written, this is the session's
	// writer, and what is published meanwhile waits in the queue (a
	// writer started for it, or a write alone, would go ahead of them).
	start := (s.queue.len() > 0 || len(resend) > 0) && !s.writing
	if start {
		s.writing = true
	}
	guarded := len(resend) > 0 && !start
	if guarded {
		s.resendingTo = cl
	}
	s.mu.Unlock()
	if len(resend) > 0 {
		if at := s.b.atResend.Load(); at != nil {
			(*at)()
		}
	}
	for _, pk := range resend {
		if pk.FixedHeader.Type == packets.Publish {
			pk.FixedHeader.Dup = true
		}
		if err := cl.WritePacket(pk); err != nil {
			break // the connection is gone; the messages stay in flight
		}
	}
	s.online.Store(true)
	if guarded {
		// The writer running meanwhile took nothing; it may have stopped.
		s.mu.Lock()
		if s.resendingTo == cl {
			s.resendingTo = nil
			if !s.writing && s.queue.len() > 0 {
				s.writing, start = true, true
			}
			s.nudgeWriterLocked()
		}
		s.mu.Unlock()
	}
	if start {
		s.b.startWriter(s) // it stops at once if nothing is queued
	}
	return true
}

func (s *session) wasDurable() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.durable
}

// stored reports whether the store holds a record of the session: it is
// durable, or its record carries a will.
func (s *session) stored() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.durable || s.record != nil
}

// detach takes the session away from its previous client ahead of a
// takeover: the writer stops, and the client's outbound in-flight messages
// move to the session to be resent to the new connection in order.
func (s *session) detach(old *mqtt.Client) {
	s.mu.Lock()
	if s.client == old {
		s.client = nil
		s.online.Store(false)
		s.wakeLocked()
		s.nudgeWriterLocked() // it stops
	}
	// A writer running now is old's (or an earlier connection's, still
	// stopping), unless a newer connection is bound: that one's goes on.
	wait := s.client == nil
	s.mu.Unlock()
	// Bound a write stuck on the old socket, then wait for the writer.
	if old.Net.Conn != nil {
		_ = old.Net.Conn.SetWriteDeadline(time.Now().Add(time.Second))
	}
	deadline := time.Now().Add(2 * time.Second)
	for wait {
		s.mu.Lock()
		writing := s.writing
		s.mu.Unlock()
		if !writing || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Millisecond)
	}
	var out []packets.Packet
	for _, pk := range old.State.Inflight.GetAll(false) {
		// Outbound flows are PUBLISH (awaiting PUBACK/PUBREC) and PUBREL
		// (awaiting PUBCOMP); PUBREC entries are the client's inbound QoS 2
		// state, which mochi carries over itself.
		if pk.FixedHeader.Type == packets.Publish || pk.FixedHeader.Type == packets.Pubrel {
			out = append(out, pk)
			old.State.Inflight.Delete(pk.PacketID)
		}
	}
	slices.SortFunc(out, func(a, b packets.Packet) int { return cmp.Compare(a.Created, b.Created) })
	s.mu.Lock()
	s.resend = append(s.resend, out...)
	s.mu.Unlock()
}

// takeOver decides, for a CONNECT without Clean Start claimed under epoch
// whose connection is cl, whether the session goes on in cl or ends: it
// ends when its current connection is live (bound, not yet unbound) and the
// session does not outlive it (endsWithClient), since the takeover closes
// that connection (§3.1.2.11.2, §3.1.4; 3.1.1 [MQTT-3.1.2-6]). It returns
// that connection, or nil when the session goes on: then a connection of
// an older claim binds it no more, and a DISCONNECT of the old connection
// read from now changes the session no more (disconnecting).
// An older connection not bound to the session (its CONNECT abandoned
// before its bind, the copy left to a CONNECT in flight) is not the
// session's connection: the session goes on. A session that does not
// outlive its connection and whose connection was unbound (it closed: its
// OnDisconnect is on its way to ending the session) ends too: resumed, it
// would carry an ended session's subscriptions (3.1.1 [MQTT-3.1.2-6]), or
// that OnDisconnect would end it under the new claim's epoch, releasing
// the new connection's claim. ends reports the end; live is the old
// connection when it is still bound.
//
// The decision is made once, here, under the session's lock, from the
// session's own record; mochi is told it (SessionFate) rather than reading
// the old client's properties, which its goroutine may be writing.
func (s *session) takeOver(cl *mqtt.Client, epoch uint64) (ends bool, live *mqtt.Client) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.client != cl && s.epoch < epoch && s.endsWithClient {
		// The claim the session is ended under stays its old connection's:
		// ending gives that one back, not the new connection's.
		return true, s.client
	}
	s.epoch = max(s.epoch, epoch)
	return false, nil
}

// sessionAfter is what became of a session, as the will of one of its
// connections that ended is decided.
type sessionAfter uint8

const (
	// sessionHeld: nothing newer happened to it; the connection's end
	// decides.
	sessionHeld sessionAfter = iota
	// sessionResumed: a newer connection here took it on.
	sessionResumed
	// sessionMoved: it goes on elsewhere, handed to another edge or to a
	// copy that replaces this one.
	sessionMoved
	// sessionEnded: it ended, while its connection was ending or before.
	sessionEnded
)

// after reports what became of the session for a connection that held it
// under the claim of epoch. A copy given up for another edge or for a copy
// replacing it moved; one ended otherwise (a Clean Start, a takeover of a
// session that does not outlive its connection, an operator's discard)
// ended; one whose epoch a newer claim raised (takeOver, a newer bind)
// was resumed by that claim's connection. A nil session (a connection
// never bound) was held by nothing newer.
func (s *session) after(epoch uint64) sessionAfter {
	a, _ := s.afterOrPark(epoch, nil)
	return a
}

// afterOrPark is after that, for a session another edge is taking over
// (the move not done yet), leaves w with the move, when given: if the move
// fails, the session stays here and the will is decided again.
func (s *session) afterOrPark(epoch uint64, w *pendingWill) (_ sessionAfter, parked bool) {
	if s == nil {
		return sessionHeld, false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.moving != nil:
		// Not the will of a connection a newer one here replaced: void.
		if w != nil && !s.moving.done && s.epoch <= epoch {
			s.moving.wills = append(s.moving.wills, w)
			return sessionMoved, true
		}
		return sessionMoved, false
	case s.closed:
		return sessionEnded, false
	case s.epoch > epoch:
		return sessionResumed, false
	}
	return sessionHeld, false
}

// claimedAfter reports whether a claim newer than epoch took the session
// on here: a newer CONNECT's takeOver or bind, or an import under a newer
// claim.
func (s *session) claimedAfter(epoch uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.epoch > epoch
}

// disconnecting records the Session Expiry Interval of 0 of an MQTT 5
// DISCONNECT of cl, the session's connection under the claim of epoch: the
// session no longer outlives cl [MQTT-3.14.2-2]. A DISCONNECT read after
// a newer claim took the session over (takeOver) changes nothing. A
// non-zero interval changes nothing here: the session outlives the
// connection already, or the DISCONNECT is a protocol error.
func (s *session) disconnecting(cl *mqtt.Client, epoch uint64) {
	s.mu.Lock()
	if s.client == cl && s.epoch == epoch {
		s.endsWithClient = true
	}
	s.mu.Unlock()
}

// unbind detaches cl if it is still the session's client.
func (s *session) unbind(cl *mqtt.Client) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.client != cl {
		return false
	}
	s.client = nil
	s.online.Store(false)
	s.wakeLocked()
	s.nudgeWriterLocked() // it stops
	return true
}

// wakeLocked releases publishers waiting for room. s.mu must be held.
func (s *session) wakeLocked() {
	close(s.space)
	s.space = make(chan struct{})
}

// acked is called when a QoS 1/2 delivery completed or was dropped.
func (s *session) acked() {
	s.mu.Lock()
	if s.inflight > 0 {
		s.inflight--
	}
	start := s.client != nil && !s.writing && s.queue.len() > 0
	if start {
		s.writing = true
	}
	s.nudgeWriterLocked()
	s.mu.Unlock()
	if start {
		s.b.startWriter(s)
	}
}

// writeLoop sends queued messages until the queue is empty, the client's
// receive window is full, or the client is gone.
//
// A durable session's batch goes to the client only once its packet IDs
// are stored (Send). The writer does not idle through that write: it takes
// the next batch meanwhile (woken by a new message or an acknowledgement),
// so up to maxStoring batches are being stored at once, each written to
// the client in order as soon as it and every batch before it are stored.
// A message that arrives while one is stored joins the next commit instead
// of waiting for that one to end first, and its Send often reaches the
// store together with its append (which then never queues it there).
func (s *session) writeLoop() {
	bp := deliveryBatches.Get().(*[]delivery)
	batch := (*bp)[:0]
	var storing []*storingBatch // in send order
	defer func() {
		for _, w := range storing {
			w.release()
		}
		clear(batch) // each is cleared once encoded; this is in case
		*bp = batch[:0]
		deliveryBatches.Put(bp)
	}()
	for {
		// Write what is stored, in order.
		for len(storing) > 0 && storing[0].isStored() {
			if !s.flush(storing[0]) {
				return
			}
			storing[0].release()
			storing = storing[1:]
		}
		s.mu.Lock()
		cl := s.client
		if cl == nil || cl.Closed() {
			s.writing = false
			s.mu.Unlock()
			return
		}
		batch = batch[:0]
		var firstSend *sendOutcome // the batch's send, for the deliveries it stores first
		now := time.Now()
		for s.queue.len() > 0 && len(batch) < writeBatch && len(storing) < maxStoring && s.resendingTo == nil {
			d := s.queue.peek()
			if d.msg == nil {
				// An entry with no message: none should be. One was
				// left by a publisher queuing into a session still being
				// imported (fixed: indexSubs); should another cause
				// appear, sending it would take the whole edge down.
				s.queue.pop()
				s.b.m.dropped.WithLabelValues("empty_queue_entry").Inc()
				s.b.logger.Error("entry without a message in a session's queue; dropped", "client_id", s.id,
					"queued", s.queue.len(), "seq", d.seq)
				continue
			}
			if d.qos > 0 && s.inflight >= s.window {
				break
			}
			if wait, until := s.settlingLocked(&d, now); wait {
				if len(batch) == 0 && !s.settleWake {
					s.settleWake = true
					s.wakeWriterAt(until)
				}
				break
			}
			s.takeForSendLocked()
			if w, ok := s.unsettled[d.seq]; ok && d.seq > 0 {
				// Its queueing may yet fail (a store failing over refuses
				// one write and takes the next): what the session has is
				// then what the send stored. Queued offline, it may be
				// refused by the tenant's bound besides, so the send
				// carries the message.
				if firstSend == nil {
					firstSend = &sendOutcome{done: make(chan struct{})}
				}
				w.sent = firstSend
				s.unsettled[d.seq] = w
				d.sendDecides, d.storeFirst = true, w.offline
			}
			batch = append(batch, d)
		}
		if len(batch) == 0 {
			if len(storing) == 0 {
				s.writing = false
				s.idleSince = now.UnixNano()
				s.mu.Unlock()
				return
			}
			s.mu.Unlock()
			// Wait for the oldest batch to be stored, or for something new
			// to send meanwhile.
			select {
			case <-storing[0].stored:
			case <-s.nudge:
			}
			continue
		}
		s.tookForSendLocked()
		version, maxPacket, aliases := s.version, s.maxPacket, s.aliases
		s.mu.Unlock()

		w := newStoringBatch(cl)
		// Fresh slices: a store may keep them until the write commits,
		// and the next batch is taken before that.
		var entries, dropped []durable.Entry
		for i := range batch {
			d := &batch[i]
			var id uint16
			var sent bool
			w.buf, id, sent = s.b.encodeDelivery(w.buf, cl, s, d, version, maxPacket, aliases, now.Unix())
			switch {
			case d.seq == 0 && (d.qos == 0 || !s.durable):
			case sent:
				e := entryOf(d, id, s.sent)
				e.StoreFirst = d.storeFirst
				entries = append(entries, e)
			case d.seq > 0:
				dropped = append(dropped, durable.Entry{Seq: d.seq, MsgID: msgIDString(d.msg.ID)})
			}
			if sent && d.sendDecides {
				if firstSend.ids == nil {
					firstSend.cl, firstSend.ids = cl, map[uint64]uint16{}
				}
				firstSend.ids[d.seq] = id
			}
			batch[i] = delivery{}
		}
		if len(dropped) > 0 {
			_ = s.b.store.Dequeue(context.Background(), s.id, dropped)
		}
		if len(entries) > 0 {
			// The packet IDs must be durable before the first send.
			w.store(s, s.b.store.Send(s.id, entries), firstSend)
		} else if firstSend != nil {
			close(firstSend.done) // none of them was sent
		}
		storing = append(storing, w)
	}
}

// takeForSendLocked takes the delivery at the head of the queue for
// sending: it leaves the queue's bounds and, at QoS 1/2, enters the
// client's receive window. s.mu is held.
func (s *session) takeForSendLocked() delivery {
	d := s.queue.pop()
	s.queueBytes -= d.msg.size()
	if d.qos > 0 {
		s.inflight++
	}
	return d
}

// tookForSendLocked follows the taking of deliveries for sending: the
// queue may be below its bounds again, for a spilling persistent session
// and for publishers waiting for room. s.mu is held.
func (s *session) tookForSendLocked() {
	if s.spilling && s.queue.len() < s.b.cfg.QueueLen/2 {
		s.spilling = false
	}
	s.wakeLocked()
}

// storingBatch is a batch of encoded deliveries, written to the client
// once its packet IDs are stored.
type storingBatch struct {
	cl     *mqtt.Client
	bufp   *[]byte
	buf    []byte
	stored chan struct{} // closed once the store answered; nil: nothing to store
	err    error         // the store's answer, set before stored closes
}

func newStoringBatch(cl *mqtt.Client) *storingBatch {
	bufp := writeBufs.Get().(*[]byte)
	return &storingBatch{cl: cl, bufp: bufp, buf: (*bufp)[:0]}
}

// store waits for p in the background, and tells sent (if any) its answer.
func (w *storingBatch) store(s *session, p *durable.Pending, sent *sendOutcome) {
	w.stored = make(chan struct{})
	go func() {
		w.err = s.wait(p, nil)
		if sent != nil {
			sent.err = w.err
			close(sent.done)
		}
		close(w.stored)
	}()
}

func (w *storingBatch) isStored() bool {
	if w.stored == nil {
		return true
	}
	select {
	case <-w.stored:
		return true
	default:
		return false
	}
}

func (w *storingBatch) release() {
	if w.stored != nil && !w.isStored() {
		return // its store goroutine still holds it; the buffer goes to the GC
	}
	if cap(w.buf) <= maxKeptBuf {
		*w.bufp = w.buf[:0]
		writeBufs.Put(w.bufp)
	}
	w.buf = nil
}

// flush writes a stored batch to its client; false means the writer stops
// (the store refused the batch, or the connection is gone, and no newer
// connection took the session: goesOnAfter).
func (s *session) flush(w *storingBatch) bool {
	if w.err != nil {
		if s.b.yieldIfFenced(s, w.err) {
			s.stopWriting()
			return false
		}
		w.cl.Stop(w.err) // resent from the store when the session resumes
		return s.goesOnAfter(w.cl)
	}
	if len(w.buf) > 0 {
		if err := s.b.writeRaw(s, w.cl, w.buf); err != nil {
			// The connection is gone; in-flight messages stay in the client's
			// store and are resent when the session resumes.
			return s.goesOnAfter(w.cl)
		}
	}
	return true
}

// goesOnAfter decides, once the writer failed to give old a batch, whether
// it goes on. It does when a newer connection was bound meanwhile: a
// takeover waits only so long for the old connection's writer, and the
// newer connection's bind, and every message queued since, left the queue
// to this writer. The batches it took for the newer connection are written
// next, in order; stopping would leave them, and the queue, until the
// newer connection's next message or reconnect. Else the writer stops.
func (s *session) goesOnAfter(old *mqtt.Client) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if cl := s.client; cl != nil && cl != old && !cl.Closed() {
		return true
	}
	s.writing = false
	return false
}

func (s *session) stopWriting() {
	s.mu.Lock()
	s.writing = false
	s.mu.Unlock()
}

// nudgeWriterLocked wakes a writer waiting for a batch to be stored: there
// is more to send. s.mu must be held.
func (s *session) nudgeWriterLocked() {
	if s.writing {
		select {
		case s.nudge <- struct{}{}:
		default:
		}
	}
}

const (
	writeBatch = 256
	maxStoring = 8 // batches of a session being stored at once
	maxKeptBuf = 256 << 10
)

var writeBufs = sync.Pool{New: func() any { b := make([]byte, 0, 16<<10); return &b }}

// deliveryBatches holds the writers' batches. A writer runs for each burst
// of messages to its session, and growing a fresh batch for each burst was
// a few allocations a burst, in every writer.
var deliveryBatches = sync.Pool{New: func() any { b := make([]delivery, 0, 16); return &b }}

// ring is a growable FIFO of deliveries.
type ring struct {
	buf        []delivery
	head, size int
}

func (r *ring) len() int { return r.size }

func (r *ring) push(d delivery) {
	if r.size == len(r.buf) {
		n := max(8, 2*len(r.buf))
		nb := make([]delivery, n)
		for i := 0; i < r.size; i++ {
			nb[i] = r.buf[(r.head+i)%len(r.buf)]
		}
		r.buf, r.head = nb, 0
	}
	r.buf[(r.head+r.size)%len(r.buf)] = d
	r.size++
}

func (r *ring) peek() delivery { return r.buf[r.head] }

// insert puts d at position i from the head (i == len: at the tail).
func (r *ring) insert(i int, d delivery) {
	r.push(d)
	for j := r.size - 1; j > i; j-- {
		*r.at(j) = *r.at(j - 1)
	}
	*r.at(i) = d
}

// at returns the i-th delivery from the head.
func (r *ring) at(i int) *delivery { return &r.buf[(r.head+i)%len(r.buf)] }

// remove takes out the i-th delivery, keeping the order of the others.
func (r *ring) remove(i int) {
	for j := i; j < r.size-1; j++ {
		*r.at(j) = *r.at(j + 1)
	}
	*r.at(r.size - 1) = delivery{}
	r.size--
}

// removeIf takes out the deliveries drop reports, keeping the order of the
// others, in one pass.
func (r *ring) removeIf(drop func(*delivery) bool) {
	kept := 0
	for i := range r.size {
		d := r.at(i)
		if drop(d) {
			continue
		}
		if kept != i {
			*r.at(kept) = *d
		}
		kept++
	}
	for i := kept; i < r.size; i++ {
		*r.at(i) = delivery{}
	}
	r.size = kept
}

func (r *ring) pop() delivery {
	d := r.buf[r.head]
	r.buf[r.head] = delivery{}
	r.head = (r.head + 1) % len(r.buf)
	r.size--
	if r.size == 0 && len(r.buf) > 64 {
		r.buf, r.head = nil, 0 // give back the memory of a burst
	}
	return d
}

// inflightPacket builds the packet kept in the client's in-flight store, from
// which the broker core matches PUBACK/PUBREC/PUBCOMP and resends on resume.
func inflightPacket(d *delivery, packetID uint16, retain bool, order int64) packets.Packet {
	pk := packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: d.qos, Retain: retain},
		TopicName:   d.msg.Topic,
		Payload:     d.msg.Payload,
		PacketID:    packetID,
		Properties:  d.msg.Props.packet(),
		Origin:      d.msg.Origin,
		Created:     order, // send order, for resends; mochi's own use of it is off
		Expiry:      d.msg.Expiry,
	}
	pk.Properties.MessageExpiryInterval = 0 // recomputed from Expiry when resent
	if len(d.ids) > 0 {
		pk.Properties.SubscriptionIdentifier = d.ids
	}
	return pk
}

// Why addSub refused a subscription.
var (
	errSubQuota        = errors.New("subscription quota reached")
	errSubNotRouted    = errors.New("route not registered")
	errSubNotStored    = errors.New("subscription not stored")
	errSubSessionEnded = errors.New("session ended")
	// errSubSuperseded: granted, but replaced or ended meanwhile (by a
	// newer connection's SUBSCRIBE or UNSUBSCRIBE, or the session's end),
	// or asked by a connection the session is no longer bound to: the
	// session holds something else now, which is not this SUBACK's to
	// touch.
	errSubSuperseded = errors.New("subscription superseded")
)

// addSub adds or replaces a subscription of the session for a SUBSCRIBE
// of cl. It refuses one from a connection the session is no longer bound
// to (taken over while the SUBSCRIBE waited to be handled: the newer
// connection's subscriptions are the session's now), a new filter beyond
// max subscriptions, one whose route the cluster did not take, and for a
// durable session one the store did not keep. A refused
// replacement puts back the subscription it replaced when it had taken
// over that one's route; one whose own route was still being added is not
// put back (its adder gives the route up).
//
// The subscription matches this edge's publishes from the moment it is read,
// before its route and its durable record are in place: the server may send
// PUBLISH packets matching a subscription before its SUBACK (§3.8.4), and a
// client that subscribes and then has another client publish, without
// waiting for the SUBACK, gets what it expects from a single broker. Only
// the SUBACK waits (DESIGN: SUBSCRIBE); a refused subscription leaves the
// index again.
func (s *session) addSub(cl *mqtt.Client, sub *subscription, maxSubs int) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return errSubSessionEnded
	}
	if s.client != cl {
		s.mu.Unlock()
		return errSubSuperseded
	}
	old := s.subs[sub.full]
	if old == nil && maxSubs > 0 && len(s.subs) >= maxSubs {
		s.mu.Unlock()
		return errSubQuota
	}
	s.subs[sub.full] = sub
	s.nsubs.Store(int32(len(s.subs)))
	// A replacement takes over its route's count. One whose Add is still
	// out does its own: the count the earlier Add takes, its adder gives
	// back once it finds its subscription replaced.
	inherited := old != nil && old.counted.Swap(false)
	sub.counted.Store(inherited)
	isDurable := s.durable && s.b.store != nil
	s.mu.Unlock()
	if old != nil {
		s.b.index.remove(old) // [MQTT-3.8.4-3]: a repeated filter replaces the old one
	}
	// Into the index, then checked: whatever took sub out of the session
	// meanwhile (its end, an UNSUBSCRIBE or a SUBSCRIBE of a newer
	// connection) took it out of the index before sub was in it.
	if !s.indexHeld(sub) {
		return errSubSuperseded
	}
	// undo takes sub back. Only a subscription whose count sub took over is
	// put back in its place: one whose own Add was still out when sub
	// replaced it is given up by its adder, which may have done so already,
	// and one stored but not routed (the router refused it when the edge
	// registered its restored sessions) goes too. The store is then
	// brought in line with what the session holds of the filter
	// (storeRecord): the record of a dropped subscription, or of sub, would
	// bring it back when the session is next loaded, and the record of a
	// subscription made since (a newer connection's) must stay. Also when
	// sub never wrote its own: another write of the filter's record (an
	// older connection's failed SUBSCRIBE bringing the store in line) may
	// have written sub's while sub was held.
	undo := func(ctx context.Context) {
		restored := false
		s.mu.Lock()
		if s.subs[sub.full] == sub {
			if inherited {
				s.subs[sub.full] = old
				old.counted.Store(sub.counted.Swap(false))
				restored = true
			} else {
				delete(s.subs, sub.full)
			}
			s.nsubs.Store(int32(len(s.subs)))
		}
		s.mu.Unlock()
		s.b.index.remove(sub)
		if restored {
			s.indexHeld(old)
		}
		if err := s.dropRoute(ctx, sub); err != nil && ctx.Err() == nil {
			s.b.logger.Warn("route not removed", "client_id", s.id, "error", err)
		}
		if isDurable {
			sctx, cancel := context.WithTimeout(context.Background(), storeTimeout)
			defer cancel()
			if _, err := s.storeRecord(sctx, sub.full); err != nil {
				s.b.logger.Warn("record of a subscription the session let go not brought in line; it may come back when the session is loaded",
					"client_id", s.id, "error", err)
			}
		}
	}
	if !inherited {
		// The route is in place before the SUBACK leaves (DESIGN: SUBSCRIBE).
		ctx, cancel := context.WithTimeout(context.Background(), storeTimeout)
		err := s.b.cluster.Routes.Add(ctx, s.scope.Tenant(), s.outsideFilter(sub), groupName(sub))
		cancel()
		if err != nil {
			undo(cancelled)
			if !errors.Is(err, ErrRouteRefused) {
				// Counted though not confirmed, and held by no one else
				// (its flag was never set): it goes as it came, without
				// waiting for a router that did not answer in time.
				_ = s.removeRoute(cancelled, sub)
			}
			s.b.logger.Error("route not registered; subscription refused", "client_id", s.id, "error", err)
			return fmt.Errorf("%w: %w", errSubNotRouted, err)
		}
		if !s.routeCounted(sub) {
			// Granted, and meanwhile replaced or ended (by a newer
			// connection's SUBSCRIBE or UNSUBSCRIBE, or the session's end).
			s.b.index.remove(sub)
			return errSubSuperseded
		}
	}
	if isDurable {
		// Stored before the SUBACK leaves: a granted subscription of a
		// durable session outlives this edge.
		ctx, cancel := context.WithTimeout(context.Background(), storeTimeout)
		wrote, err := s.storeRecord(ctx, sub.full)
		cancel()
		if err != nil && (wrote == sub || wrote == nil && s.holds(sub)) {
			s.b.logger.Error("subscription not stored; refused", "client_id", s.id, "error", err)
			undo(context.Background())
			return fmt.Errorf("%w: %w", errSubNotStored, err)
		}
		if wrote != sub {
			// Replaced or ended meanwhile: the store has what the session
			// holds now, or will once its own write is done.
			if err != nil {
				s.b.logger.Warn("record of a subscription not brought in line; it may come back when the session is loaded",
					"client_id", s.id, "error", err)
			}
			s.b.index.remove(sub)
			return errSubSuperseded
		}
	}
	return nil
}

// storeRecord brings the stored record of the session's subscription of
// filter in line with what the session holds of it now: the record of the
// subscription it holds, or none. The writes of one session's records go
// one at a time (Broker.records), each reading what to write once it is
// its turn, so the last one written is what the session held last: a
// removal that waited (a failed SUBSCRIBE giving its route up first)
// never takes out, or a late write overwrites, the record of a
// subscription made since, by a newer connection of the session say. It
// returns the subscription whose record it wrote; nil when it removed the
// record, or wrote nothing because the session ended (its records went
// with it, or are the next owner's).
func (s *session) storeRecord(ctx context.Context, filter string) (*subscription, error) {
	unlock, err := s.b.records.lock(ctx, s.id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	s.mu.Lock()
	closed, held := s.closed, s.subs[filter]
	s.mu.Unlock()
	switch {
	case closed:
		return nil, nil
	case held == nil:
		return nil, s.b.store.DeleteSubscription(ctx, s.id, filter)
	default:
		return held, s.b.store.PutSubscription(ctx, s.id, subRecord(held))
	}
}

// indexHeld puts sub in the index if the session still holds it, and
// reports whether it did.
func (s *session) indexHeld(sub *subscription) bool {
	return s.b.index.addIfHeld(sub, func() bool { return s.holds(sub) })
}

// holds reports whether sub is the session's subscription of its filter.
func (s *session) holds(sub *subscription) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.subs[sub.full] == sub
}

// routeCounted records that an Add counted sub's route (it returned, or
// failed other than refused), and reports whether the session still holds
// sub. The flag is set only while it does, under the session's lock, so
// that a replacement inherits only a count its adder saw held; one the
// session let go meanwhile gives its count back at once, here.
func (s *session) routeCounted(sub *subscription) (held bool) {
	s.mu.Lock()
	if held = s.subs[sub.full] == sub; held {
		sub.counted.Store(true)
	}
	s.mu.Unlock()
	if !held {
		_ = s.removeRoute(cancelled, sub)
	}
	return held
}

// dropRoute removes sub's route count, if sub still holds it: every place
// a subscription leaves calls it, and only one removes the count.
func (s *session) dropRoute(ctx context.Context, sub *subscription) error {
	if !sub.counted.Swap(false) {
		return nil
	}
	return s.removeRoute(ctx, sub)
}

// removeRoute removes one count of sub's route; the caller holds it.
func (s *session) removeRoute(ctx context.Context, sub *subscription) error {
	return s.b.cluster.Routes.Remove(ctx, s.scope.Tenant(), s.outsideFilter(sub), groupName(sub))
}

// removeSub removes the session's subscription of filter, waiting for the
// router to remove its route until routes ends (the route client drops it
// from the set it registers at once either way). cl, when set, is the
// connection asking (an UNSUBSCRIBE, an ACL recheck): one the session is
// no longer bound to changes nothing, and then it reports false.
func (s *session) removeSub(routes context.Context, cl *mqtt.Client, filter string) bool {
	s.mu.Lock()
	if cl != nil && s.client != cl {
		s.mu.Unlock()
		return false
	}
	sub := s.subs[filter]
	delete(s.subs, filter)
	s.nsubs.Store(int32(len(s.subs)))
	s.mu.Unlock()
	if sub != nil {
		s.b.index.remove(sub)
		// A subscription whose Add is still out is removed by its adder.
		if err := s.dropRoute(routes, sub); err != nil && routes.Err() == nil {
			s.b.logger.Warn("route not removed", "client_id", s.id, "error", err)
		}
		if s.durable && s.b.store != nil {
			ctx, cancel := context.WithTimeout(context.Background(), storeTimeout)
			defer cancel()
			_, _ = s.storeRecord(ctx, filter)
		}
	}
	return true
}

// outsideFilter is the filter of sub as the tenant's clients write it
// (without any share prefix): the form the cluster's routing table keeps.
func (s *session) outsideFilter(sub *subscription) string {
	ext, _ := s.scope.ExternalTopic(sub.filter)
	return ext
}

// groupName is sub's share group name, "" for a plain subscription. It is
// read from the filter, not from sub.group, which the index sets.
func groupName(sub *subscription) string {
	group, _, _, _ := parseShare(sub.full)
	return group
}
