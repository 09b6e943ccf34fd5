package broker

import (
	"errors"
	"sync"
	"sync/atomic"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
	"go.opentelemetry.io/otel/trace"
)

// errFailedEarlier ends the span of a publish left unacknowledged because
// an earlier one of its client failed.
var errFailedEarlier = errors.New("an earlier publish of the client was not taken")

// ackQueue acknowledges a client's QoS 1/2 publishes that wait for other
// edges. The reading goroutine routes each PUBLISH and moves on to the next
// one; the queue sends the PUBACK or PUBREC once every edge took the
// message, in the order the PUBLISH packets arrived, so one slow round trip
// to a peer costs a client its latency, not its throughput. A publish that
// waits for nobody is acknowledged by mochi on the reading goroutine, but
// only while the queue is empty: an acknowledgement never overtakes an
// earlier one.
type ackQueue struct {
	mu      sync.Mutex
	pending []pendingAck
	running bool
	// failed: an earlier publish was not taken and the client is being
	// disconnected; nothing after it may be acknowledged.
	failed bool
	// room is signalled when an entry leaves the queue (see reserve).
	room *sync.Cond
}

type pendingAck struct {
	packetID uint16
	qos      byte
	wait     func() error
	span     trace.Span // the publish's, when traced: ends with the acknowledgement
	msg      *Message   // the message, whose msgID a QoS 2 publish keeps if it is not acknowledged
}

// check tells how a QoS 1/2 PUBLISH with packetID stands against the
// queue: the client is being disconnected (failed), or the packet ID still
// awaits its acknowledgement (held): a QoS 2 PUBLISH sent again before its
// PUBREC must not be routed twice [MQTT-4.3.3-10], and a packet ID in use
// is not a new message.
func (q *ackQueue) check(packetID uint16) (failed, held bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.failed {
		return true, false
	}
	for i := range q.pending {
		if q.pending[i].packetID == packetID {
			return false, true
		}
	}
	return false, false
}

// idle reports whether an acknowledgement may be sent right away.
func (q *ackQueue) idle() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.pending) == 0 && !q.failed
}

// reserve holds an MQTT 3 client's reader while limit publishes await
// their acknowledgement: MQTT 3 has no Receive Maximum to enforce, so the
// edge pushes back as it does for a full subscriber queue. It reports
// false when the client is being disconnected.
func (q *ackQueue) reserve(limit int) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.init()
	for len(q.pending) >= limit && !q.failed {
		q.room.Wait()
	}
	return !q.failed
}

// fail stops acknowledgements and wakes a held reader.
func (q *ackQueue) fail() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.init()
	q.failed = true
	q.room.Broadcast()
}

func (q *ackQueue) init() {
	if q.room == nil {
		q.room = sync.NewCond(&q.mu)
	}
}

// queueAck defers the acknowledgement of pk until wait returns (wait may be
// nil: the publish only waits for earlier ones). span, when not nil, ends
// with the acknowledgement.
func (b *Broker) queueAck(cl *mqtt.Client, c *conn, pk *packets.Packet, wait func() error, span trace.Span, m *Message) {
	q := &c.acks
	v5 := cl.Properties.ProtocolVersion == 5
	q.mu.Lock()
	q.init()
	q.pending = append(q.pending, pendingAck{packetID: pk.PacketID, qos: pk.FixedHeader.Qos, wait: wait, span: span, msg: m})
	start := !q.running
	q.running = true
	q.mu.Unlock()
	if v5 {
		// mochi counts the window on its own acknowledgement path, which
		// this one replaces; it disconnects with 0x93 a client that sends
		// more than Receive Maximum unacknowledged [MQTT-3.3.4-8].
		cl.State.Inflight.DecreaseReceiveQuota()
	}
	b.m.acksDeferred.Inc()
	if start {
		b.ackers.Add(1)
		go func() {
			defer b.ackers.Done()
			b.sendAcks(cl, q, v5)
		}()
	}
}

// sendAcks runs while the queue has entries.
func (b *Broker) sendAcks(cl *mqtt.Client, q *ackQueue, v5 bool) {
	for {
		q.mu.Lock()
		if len(q.pending) == 0 || q.failed {
			unacked := q.pending
			for _, p := range q.pending {
				finishSpan(p.span, errFailedEarlier)
			}
			q.pending = nil
			q.running = false
			q.room.Broadcast()
			q.mu.Unlock()
			for _, p := range unacked {
				b.unconfirm(cl, p.qos, p.packetID, p.msg)
			}
			return
		}
		p := q.pending[0]
		q.mu.Unlock()

		var err error
		if p.wait != nil {
			err = p.wait()
		}
		if err == nil && b.fenced.Load() {
			err = errFenced
		}
		if err != nil {
			finishSpan(p.span, err)
			q.mu.Lock()
			q.failed = true
			q.pending[0].span = nil
			q.mu.Unlock()
			b.m.dropped.WithLabelValues("forward_failed").Inc()
			b.logger.Warn("publish not acknowledged", "client_id", cl.ID, "packet_id", p.packetID, "error", err)
			_ = b.disconnect(cl, packets.ErrServerBusy)
			continue
		}
		b.writeAck(cl, p, v5)
		finishSpan(p.span, nil)

		q.mu.Lock()
		q.pending = q.pending[1:]
		q.room.Broadcast()
		q.mu.Unlock()
	}
}

// writeAck does what mochi does after OnPublish for a publish it
// acknowledges itself.
func (b *Broker) writeAck(cl *mqtt.Client, p pendingAck, v5 bool) {
	ack := packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Puback},
		PacketID:    p.packetID,
		ReasonCode:  packets.QosCodes[p.qos].Code,
		Created:     time.Now().Unix(),
	}
	if p.qos == 2 {
		ack.FixedHeader.Type = packets.Pubrec
		ack.ReasonCode = packets.CodeSuccess.Code
		// In flight before it is written: the PUBREL may come back at once,
		// and mochi answers it from the inflight store.
		if cl.State.Inflight.Set(ack) {
			atomic.AddInt64(&b.server.Info.Inflight, 1)
		}
	}
	if err := cl.WritePacket(ack); err != nil {
		return // the connection is gone; the client sends it again
	}
	if p.qos == 1 && v5 {
		cl.State.Inflight.IncreaseReceiveQuota()
	}
}
