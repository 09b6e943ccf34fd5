package broker

import (
	"sync"
	"sync/atomic"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/keelmq/keel/services/edge/internal/auth"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

// delivery is one message queued for one session.
type delivery struct {
	msg    *Message
	qos    byte
	retain bool
	ids    []int
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

	mu         sync.Mutex
	client     *mqtt.Client // nil while offline
	version    byte
	rules      *auth.Rules
	maxPacket  uint32
	window     int // receive maximum of the client: QoS>0 messages in flight
	inflight   int
	persistent bool
	queue      ring
	queueBytes int
	writing    bool
	space      chan struct{} // closed when the queue frees room; publishers wait on it
	subs       map[string]*subscription
	aliases    *mqtt.OutboundTopicAliases
	closed     bool   // the session ended; nothing more is queued
	nextID     uint16 // outbound packet ID cursor; writer only
	spilling   bool   // a persistent session's queue went past the live bound; stays so until it drains
}

func newSession(b *Broker, id string, scope *tenancy.Scope) *session {
	return &session{id: id, scope: scope, b: b, subs: map[string]*subscription{}, space: make(chan struct{})}
}

type enqueueResult int

const (
	enqueued enqueueResult = iota
	droppedQoS0
	droppedExpired
	droppedOffline  // non-persistent session gone
	droppedOverflow // offline queue full, policy drop
	slowConsumer    // non-persistent consumer stayed full past the grace
)

// enqueue queues d for the session. For QoS 1/2 to a connected client whose
// queue is full it waits up to the slow-consumer grace (the publisher is
// pushed back); a persistent session past that keeps the message in its
// session queue, a non-persistent one is disconnected with 0x97.
func (s *session) enqueue(d delivery) enqueueResult {
	cfg := &s.b.cfg
	size := d.msg.size()
	var deadline time.Time
	for {
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			return droppedOffline
		}
		if s.client == nil {
			// Offline persistent session: bounded by the offline limits.
			if d.qos == 0 && !cfg.QueueQoS0Offline {
				s.mu.Unlock()
				return droppedQoS0
			}
			if s.queue.len() >= cfg.OfflineQueueLen {
				if cfg.OfflineDropOldest {
					old := s.queue.pop()
					s.queueBytes -= old.msg.size()
					s.queue.push(d)
					s.queueBytes += size
					s.mu.Unlock()
					return droppedOverflow
				}
				s.mu.Unlock()
				return droppedOverflow
			}
			s.queue.push(d)
			s.queueBytes += size
			s.mu.Unlock()
			return enqueued
		}
		full := s.queue.len() >= cfg.QueueLen || s.queueBytes+size > cfg.QueueBytes
		if full && s.persistent && !deadline.IsZero() && time.Now().After(deadline) {
			s.spilling = true
		}
		if !full || (s.persistent && s.spilling) {
			// A persistent session past the grace keeps the message beyond the
			// live bound, up to the offline bound, rather than lose it.
			if full && s.queue.len() >= cfg.OfflineQueueLen {
				s.mu.Unlock()
				return droppedOverflow
			}
			s.queue.push(d)
			s.queueBytes += size
			start := !s.writing
			s.writing = true
			s.mu.Unlock()
			if start {
				s.b.startWriter(s)
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
			deadline = time.Now().Add(cfg.SlowConsumerGrace)
		}
		wait := time.Until(deadline)
		if wait <= 0 {
			if s.persistent {
				continue
			}
			s.b.disconnectSlow(cl)
			return slowConsumer
		}
		t := time.NewTimer(wait)
		select {
		case <-space:
		case <-t.C:
		case <-s.b.done:
			t.Stop()
			return droppedOffline
		}
		t.Stop()
	}
}

// bind attaches a connected client to the session.
func (s *session) bind(cl *mqtt.Client, rules *auth.Rules, persistent bool, window int) {
	s.mu.Lock()
	s.client = cl
	s.version = cl.Properties.ProtocolVersion
	s.rules = rules
	s.maxPacket = cl.Properties.Props.MaximumPacketSize
	s.window = window
	s.persistent = persistent
	s.closed = false
	s.aliases = mqtt.NewOutboundTopicAliases(cl.Properties.Props.TopicAliasMaximum)
	// A resumed session's in-flight messages are resent by the broker core
	// and still count against the client's window.
	s.inflight = cl.State.Inflight.Len()
	start := s.queue.len() > 0 && !s.writing
	if start {
		s.writing = true
	}
	s.mu.Unlock()
	s.online.Store(true)
	if start {
		s.b.startWriter(s)
	}
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
	s.mu.Unlock()
	if start {
		s.b.startWriter(s)
	}
}

// writeLoop sends queued messages until the queue is empty, the client's
// receive window is full, or the client is gone.
func (s *session) writeLoop() {
	var batch []delivery
	bufp := writeBufs.Get().(*[]byte)
	defer writeBufs.Put(bufp)
	for {
		s.mu.Lock()
		cl := s.client
		if cl == nil || cl.Closed() {
			s.writing = false
			s.mu.Unlock()
			return
		}
		batch = batch[:0]
		for s.queue.len() > 0 && len(batch) < writeBatch {
			d := s.queue.peek()
			if d.qos > 0 && s.inflight >= s.window {
				break
			}
			s.queue.pop()
			s.queueBytes -= d.msg.size()
			if d.qos > 0 {
				s.inflight++
			}
			batch = append(batch, d)
		}
		if len(batch) == 0 {
			s.writing = false
			s.mu.Unlock()
			return
		}
		if s.spilling && s.queue.len() < s.b.cfg.QueueLen/2 {
			s.spilling = false
		}
		s.wakeLocked()
		version, maxPacket, aliases := s.version, s.maxPacket, s.aliases
		s.mu.Unlock()

		buf := (*bufp)[:0]
		now := time.Now().Unix()
		for i := range batch {
			buf = s.b.encodeDelivery(buf, cl, s, &batch[i], version, maxPacket, aliases, now)
			batch[i] = delivery{}
		}
		if len(buf) > 0 {
			if err := s.b.writeRaw(cl, buf); err != nil {
				// The connection is gone; in-flight messages stay in the client's
				// store and are resent when the session resumes.
				s.mu.Lock()
				s.writing = false
				s.mu.Unlock()
				return
			}
		}
		if cap(buf) <= maxKeptBuf {
			*bufp = buf
		}
	}
}

const (
	writeBatch = 256
	maxKeptBuf = 256 << 10
)

var writeBufs = sync.Pool{New: func() any { b := make([]byte, 0, 16<<10); return &b }}

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

func (r *ring) drain() []delivery {
	out := make([]delivery, 0, r.size)
	for r.size > 0 {
		out = append(out, r.pop())
	}
	return out
}

// inflightPacket builds the packet kept in the client's in-flight store, from
// which the broker core matches PUBACK/PUBREC/PUBCOMP and resends on resume.
func inflightPacket(d *delivery, packetID uint16, retain bool) packets.Packet {
	pk := packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: d.qos, Retain: retain},
		TopicName:   d.msg.Topic,
		Payload:     d.msg.Payload,
		PacketID:    packetID,
		Properties:  d.msg.Props,
		Origin:      d.msg.Origin,
		Created:     d.msg.Created / int64(time.Second),
		Expiry:      d.msg.Expiry,
	}
	pk.Properties.MessageExpiryInterval = 0 // recomputed from Expiry when resent
	if len(d.ids) > 0 {
		pk.Properties.SubscriptionIdentifier = d.ids
	}
	return pk
}

// addSub adds or replaces a subscription of the session. It refuses a new
// filter beyond max subscriptions.
func (s *session) addSub(sub *subscription, maxSubs int) bool {
	s.mu.Lock()
	old := s.subs[sub.full]
	if old == nil && maxSubs > 0 && len(s.subs) >= maxSubs {
		s.mu.Unlock()
		return false
	}
	s.subs[sub.full] = sub
	s.mu.Unlock()
	if old != nil {
		s.b.index.remove(old) // [MQTT-3.8.4-3]: a repeated filter replaces the old one
	}
	s.b.index.add(sub)
	return true
}

func (s *session) removeSub(filter string) {
	s.mu.Lock()
	sub := s.subs[filter]
	delete(s.subs, filter)
	s.mu.Unlock()
	if sub != nil {
		s.b.index.remove(sub)
	}
}
