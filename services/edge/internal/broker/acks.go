package broker

import (
	"bytes"
	"errors"
	"net"
	"slices"
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
	handed  int // pending entries taken and gathered for the next write, at the front
	// failed: an earlier publish was not taken and the client is being
	// disconnected; nothing after it may be acknowledged.
	failed bool
	// recorded is how many entries at the head of pending the failure
	// recorded as unconfirmed already (waitAcks).
	recorded int
	// room is signalled when an entry leaves the queue (see reserve).
	room *sync.Cond
}

type pendingAck struct {
	packetID uint16
	qos      byte
	wait     func() error
	// forwarded: wait is the wait of the message's forwarding (Forward),
	// which the message reports on without waiting (ready).
	forwarded bool
	span      trace.Span // the publish's, when traced: ends with the acknowledgement
	msg       *Message   // the message, whose msgID a QoS 2 publish keeps if it is not acknowledged
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
// nil: the publish only waits for earlier ones). forwarded tells that wait
// is the wait of m's forwarding (pendingAck.forwarded). span, when not nil,
// ends with the acknowledgement.
func (b *Broker) queueAck(cl *mqtt.Client, c *conn, pk *packets.Packet, wait func() error, forwarded bool, span trace.Span, m *Message) {
	q := &c.acks
	v5 := cl.Properties.ProtocolVersion == 5
	q.mu.Lock()
	q.init()
	q.pending = append(q.pending, pendingAck{packetID: pk.PacketID, qos: pk.FixedHeader.Qos, wait: wait, forwarded: forwarded, span: span, msg: m})
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

// ready reports whether p's wait returns at once: under load a forwarded
// message was most often taken by the time its turn comes.
func (p *pendingAck) ready() bool {
	if p.wait == nil {
		return true
	}
	return p.forwarded && p.msg.ForwardsTaken()
}

// sendAcks runs while the queue has entries. It waits for each entry in
// turn and gathers the acknowledgements of those taken, and writes them
// with one write before a wait that would block, after ackBurst of them,
// and once it caught up: under load a client's acknowledgements leave
// together rather than one syscall each, in the order of the PUBLISHes.
// One goroutine does both: a writer of its own cost every burst a hand-off
// between goroutines, and every run two goroutines started.
func (b *Broker) sendAcks(cl *mqtt.Client, q *ackQueue, v5 bool) {
	batch := make([]pendingAck, 0, 16)
	var buf bytes.Buffer
	flush := func() {
		b.flushAcks(cl, q, batch, &buf, v5)
		clear(batch) // the array keeps no message
		batch = batch[:0]
	}
	for {
		q.mu.Lock()
		if q.handed == len(q.pending) || q.failed {
			if len(batch) > 0 {
				q.mu.Unlock()
				flush()
				continue // more may have come while they were written
			}
			unacked := q.pending[min(q.recorded, len(q.pending)):]
			for _, p := range q.pending {
				finishSpan(p.span, errFailedEarlier)
			}
			q.pending = nil
			q.handed = 0
			q.recorded = 0
			q.running = false
			q.room.Broadcast()
			q.mu.Unlock()
			for _, p := range unacked {
				b.unconfirm(cl, p.qos, p.packetID, p.msg)
			}
			return
		}
		p := q.pending[q.handed]
		q.mu.Unlock()

		if len(batch) > 0 && (len(batch) >= ackBurst || !p.ready()) {
			flush()
			continue // the queue may have failed
		}
		var err error
		if p.wait != nil {
			err = p.wait()
		}
		if err == nil && b.fenced.Load() {
			err = errFenced
		}
		if err != nil {
			if len(batch) > 0 {
				flush() // taken before it: acknowledged before the client is closed
			}
			q.mu.Lock()
			failed := q.failed // fenced meanwhile: failed from the first gathered
			q.mu.Unlock()
			if !failed {
				b.failAcks(cl, q, p, err)
			}
			continue // to end the run
		}
		q.mu.Lock()
		q.handed++
		q.mu.Unlock()
		batch = append(batch, p)
	}
}

// ackBurst bounds the acknowledgements written at once.
const ackBurst = 256

// failAcks stops the queue at p, whose wait failed with err: the client is
// disconnected, and nothing from p on is acknowledged.
func (b *Broker) failAcks(cl *mqtt.Client, q *ackQueue, p pendingAck, err error) {
	finishSpan(p.span, err)
	q.mu.Lock()
	q.failed = true
	q.room.Broadcast()
	q.pending[q.handed].span = nil
	rest := slices.Clone(q.pending[q.handed:])
	q.recorded = len(rest)
	q.mu.Unlock()
	b.m.dropped.WithLabelValues("forward_failed").Inc()
	b.logger.Warn("publish not acknowledged", "client_id", cl.ID, "packet_id", p.packetID, "error", err)
	// Recorded before the client can come back: a QoS 2 resend that finds
	// no record is routed under a new msgID, and the edges that took the
	// first copy deliver it again. (sendAcks records those queued since.)
	for _, r := range rest {
		b.unconfirm(cl, r.qos, r.packetID, r.msg)
	}
	_ = b.disconnect(cl, packets.ErrServerBusy)
}

// flushAcks writes the acknowledgements of batch, the entries at the head
// of the queue, with one write, and then takes them off the queue. Once
// the edge is fenced it writes none: the queue fails from the first.
func (b *Broker) flushAcks(cl *mqtt.Client, q *ackQueue, batch []pendingAck, buf *bytes.Buffer, v5 bool) {
	if !b.fenced.Load() {
		b.writeAcks(cl, q, batch, buf, v5)
		return
	}
	q.mu.Lock()
	q.handed = 0
	first := q.pending[0]
	q.mu.Unlock()
	b.failAcks(cl, q, first, errFenced)
}

// writeAcks writes the acknowledgements of batch, the entries at the head
// of the queue, with one write, and then takes them off the queue.
func (b *Broker) writeAcks(cl *mqtt.Client, q *ackQueue, batch []pendingAck, buf *bytes.Buffer, v5 bool) {
	buf.Reset()
	for _, p := range batch {
		b.encodeAck(cl, buf, p)
	}
	err := writeAcksTo(cl, buf.Bytes())
	b.acksWritten(cl, batch, err, v5)
	q.mu.Lock()
	clear(q.pending[:len(batch)]) // written: the queue's array does not keep them
	q.pending = q.pending[len(batch):]
	q.handed -= len(batch)
	q.room.Broadcast()
	q.mu.Unlock()
}

// acksWritten completes the acknowledgements of batch once their write
// returned err.
func (b *Broker) acksWritten(cl *mqtt.Client, batch []pendingAck, err error, v5 bool) {
	for _, p := range batch {
		if err == nil && p.qos == 1 && v5 {
			cl.State.Inflight.IncreaseReceiveQuota()
		}
		if err == nil {
			b.confirmed(p.msg)
		}
		finishSpan(p.span, nil)
	}
}

// heldAcks are the acknowledgements of PUBLISHes that waited for nobody,
// taken on the client's reading goroutine and not written yet. Under load
// a client's PUBLISHes arrive many to a read, and mochi wrote each one's
// acknowledgement with a syscall of its own as it handled it: at QoS 1
// across 50 pairs on one edge, a thousand writes per thousand messages and
// half the edge's CPU. Held, they leave together, before the reader next
// waits for the network (keepaliveConn.Read), with anything else written
// to the client (keepaliveConn.Write, under the client's lock, which every
// writer holds: an acknowledgement mochi or the ack queue writes never
// overtakes a held one), before a DISCONNECT from the client is handled,
// or once ackBurst wait. The fields are the client's lock's.
type heldAcks struct {
	n    atomic.Int32 // len(acks), readable without the lock
	b    *Broker
	cl   *mqtt.Client
	buf  bytes.Buffer
	acks []pendingAck
}

// holdAck holds the acknowledgement p of a PUBLISH of cl read from c.
func (c *keepaliveConn) holdAck(b *Broker, cl *mqtt.Client, p pendingAck) {
	cl.Lock()
	defer cl.Unlock()
	h := &c.held
	h.b, h.cl = b, cl
	b.encodeAck(cl, &h.buf, p)
	h.acks = append(h.acks, p)
	h.n.Store(int32(len(h.acks)))
	if len(h.acks) >= ackBurst {
		c.writeHeldLocked(nil)
	}
}

// flushHeld writes the held acknowledgements, if any. Only the reading
// goroutine calls it, the one that holds them (it reads held.cl unlocked).
func (c *keepaliveConn) flushHeld() {
	if c.held.n.Load() != 0 {
		c.writeHeld(c.held.cl)
	}
}

// flushHeldOf writes the held acknowledgements of cl, if any: before the
// edge closes the connection without writing to it, the acknowledgements
// of PUBLISHes it took leave first.
func flushHeldOf(cl *mqtt.Client) {
	if kc, ok := cl.Net.Conn.(*keepaliveConn); ok && kc.held.n.Load() != 0 {
		kc.writeHeld(cl)
	}
}

// writeHeld writes the held acknowledgements of cl, whose connection c is,
// under cl's lock.
func (c *keepaliveConn) writeHeld(cl *mqtt.Client) {
	cl.Lock()
	defer cl.Unlock()
	if c.held.n.Load() > 0 {
		c.writeHeldLocked(nil)
	}
}

// writeHeldLocked writes the held acknowledgements and then extra, in one
// write (one writev on TCP; one record or frame on TLS and WebSocket), and
// reports what of extra it wrote. The client's lock is held.
func (c *keepaliveConn) writeHeldLocked(extra []byte) (int, error) {
	h := &c.held
	held := int64(h.buf.Len())
	var err error
	var n int64
	switch _, tcp := c.Conn.(*net.TCPConn); {
	case h.cl.Closed():
		err = mqtt.ErrConnectionClosed
	case len(extra) > 0 && tcp:
		bufs := net.Buffers{h.buf.Bytes(), extra}
		n, err = bufs.WriteTo(c.Conn)
	default:
		h.buf.Write(extra)
		var w int
		w, err = c.Conn.Write(h.buf.Bytes())
		n = int64(w)
	}
	h.b.acksWritten(h.cl, h.acks, err, h.cl.Properties.ProtocolVersion == 5)
	if err != nil {
		h.cl.Stop(err)
	}
	h.buf.Reset()
	clear(h.acks)
	h.acks = h.acks[:0]
	h.n.Store(0)
	return int(max(n-held, 0)), err
}

// writeAcksTo writes encoded acknowledgements to cl. A failed write leaves
// them unsent: the connection is gone, and the client sends the PUBLISHes
// again.
func writeAcksTo(cl *mqtt.Client, buf []byte) error {
	cl.Lock()
	defer cl.Unlock()
	if cl.Closed() {
		return mqtt.ErrConnectionClosed
	}
	if cl.Net.Conn == nil {
		return nil // an inline client: nothing to write to
	}
	_, err := cl.Net.Conn.Write(buf)
	if err != nil {
		cl.Stop(err)
	}
	return err
}

// encodeAck does what mochi does after OnPublish for a publish it
// acknowledges itself, writing the PUBACK or PUBREC into buf.
func (b *Broker) encodeAck(cl *mqtt.Client, buf *bytes.Buffer, p pendingAck) {
	if p.qos != 2 {
		// A PUBACK of success with no property is the same 4 bytes in every
		// version: in MQTT 5 a Remaining Length of 2 leaves out the reason
		// code, which is then Success (3.4.2.1), as mochi's encoder does.
		buf.Write([]byte{packets.Puback << 4, 2, byte(p.packetID >> 8), byte(p.packetID)})
		return
	}
	ack := packets.Packet{
		FixedHeader:     packets.FixedHeader{Type: packets.Pubrec},
		PacketID:        p.packetID,
		ReasonCode:      packets.CodeSuccess.Code,
		ProtocolVersion: cl.Properties.ProtocolVersion,
		Created:         time.Now().Unix(), // for the inflight store's expiry
	}
	// In flight before it is written: the PUBREL may come back at once, and
	// mochi answers it from the inflight store.
	if cl.State.Inflight.Set(ack) {
		atomic.AddInt64(&b.server.Info.Inflight, 1)
	}
	_ = ack.PubrecEncode(buf)
}
