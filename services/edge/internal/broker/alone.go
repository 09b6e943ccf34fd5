package broker

import (
	"net"
	"syscall"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
)

// A delivery that finds its session's writer idle, and idle for a while,
// of a message with nothing behind it (its publisher had nothing more to
// read, or its forward frame carried it alone) is written by the goroutine
// that queued it (the publisher's read loop, the forward stream's handler)
// with one write that does not wait, instead of by a writer goroutine
// started for it. At a few thousand messages a second each message
// travels alone, and starting a goroutine on another CPU for each cost
// more than the write: waking an idle thread, its scheduler's spinning, a
// second context switch. Under load the writer is still busy or was a
// moment ago, and more messages follow in the same read: its batches (one
// write for many deliveries) are worth more than the wake-up they cost.
//
// Only a delivery with nothing to store first goes alone (a durable
// session's packet IDs are stored before they are sent), only on plain
// TCP (a TLS record or a WebSocket frame cannot be written in part), and
// never one that would wait: not for the socket, which takes what it has
// room for (the rest goes to a writer goroutine, with the client's lock
// kept until it is written, as for a client that reads slowly), nor for
// the client's lock (another write to the client holds it). A message
// goes alone to a few sessions at most; a writer goroutine each writes it
// to the rest, in parallel, as before.

// writeAloneAfter is how long a session's writer must have been idle for
// a delivery to be written alone: longer than the gap between a busy
// session's messages, and short against a quiet one's.
const writeAloneAfter = time.Millisecond

// maxAlonePerMessage bounds the sessions a message is written to alone.
const maxAlonePerMessage = 8

// Outcomes of a write alone (keel_edge_deliveries_written_alone_total).
const (
	aloneWhole = iota
	alonePartial
	aloneRefused
)

var aloneOutcomes = [...]string{aloneWhole: "whole", alonePartial: "partial", aloneRefused: "refused"}

// aloneWrite is a delivery taken from its session's queue to be written
// alone, with what its encoding needs.
type aloneWrite struct {
	d         delivery
	cl        *mqtt.Client
	version   byte
	maxPacket uint32
	aliases   *mqtt.OutboundTopicAliases
}

// aloneLocked reports whether d, which starts the idle writer of s (it is
// the only delivery queued, with nothing to store), may be written alone.
// s.mu is held.
func (s *session) aloneLocked(d *delivery) bool {
	cl := s.client
	if !d.msg.quiet || cl == nil || cl.Closed() || s.queue.len() != 1 || d.onSubscribe || s.slow || s.resendingTo != nil ||
		!s.settleUntil.IsZero() || d.qos > 0 && s.inflight >= s.window {
		// A retained message for a new subscription goes after the
		// SUBACK mochi writes once the subscribing hook returns.
		return false
	}
	if _, tc := plainTCP(cl); tc == nil {
		return false
	}
	return time.Now().UnixNano()-s.idleSince >= int64(s.b.aloneAfter) &&
		d.msg.alones.Add(1) <= maxAlonePerMessage
}

// takeAloneLocked takes the one queued delivery for writeAlone, as the
// writer takes a batch. s.mu is held.
func (s *session) takeAloneLocked() aloneWrite {
	d := s.takeForSendLocked()
	s.tookForSendLocked()
	return aloneWrite{d: d, cl: s.client, version: s.version, maxPacket: s.maxPacket, aliases: s.aliases}
}

// writeAlone writes w's delivery to its client as the session's writer,
// which the caller made it (s.writing). The writer's part ends here unless
// more was queued meanwhile or the socket did not take the whole packet:
// then a writer goroutine goes on.
func (s *session) writeAlone(w aloneWrite) {
	b := s.b
	now := time.Now()
	bufp := writeBufs.Get().(*[]byte)
	buf, _, sent := b.encodeDelivery((*bufp)[:0], w.cl, s, &w.d, w.version, w.maxPacket, w.aliases, now.Unix())
	*bufp = buf
	if !sent {
		putWriteBuf(bufp)
		s.aloneDone(now)
		return
	}
	written, locked := b.writeNow(w.cl, buf)
	switch {
	case written == len(buf):
		b.mAlone[aloneWhole].Inc()
		putWriteBuf(bufp)
		s.aloneDone(now)
		return
	case locked:
		// The client's lock is held until the rest is written: nothing
		// else may go to the client in between.
		b.mAlone[alonePartial].Inc()
	default:
		b.mAlone[aloneRefused].Inc()
	}
	b.writers.Add(1)
	go func() {
		defer b.writers.Done()
		growStackForWrite()
		// A failed write stops the connection (writeRaw). The writer then
		// reads the session's client again: a newer connection bound
		// meanwhile found the writer running and started none, so it goes
		// on for that one; with none, it stops.
		if locked {
			_ = b.writeRawLocked(s, w.cl, buf[written:])
			w.cl.Unlock()
		} else {
			_ = b.writeRaw(s, w.cl, buf)
		}
		putWriteBuf(bufp)
		s.writeLoop()
	}()
}

// aloneDone ends a write alone that needs no writer goroutine after it,
// unless more was queued meanwhile.
func (s *session) aloneDone(now time.Time) {
	s.mu.Lock()
	more := s.queue.len() > 0
	if !more {
		s.writing = false
		s.idleSince = now.UnixNano()
	}
	s.mu.Unlock()
	if more {
		s.b.startWriter(s)
	}
}

// putWriteBuf returns a write buffer to writeBufs, unless it grew past
// what the pool keeps.
func putWriteBuf(bufp *[]byte) {
	if cap(*bufp) <= maxKeptBuf {
		*bufp = (*bufp)[:0]
		writeBufs.Put(bufp)
	}
}

// writeNow writes buf to cl's socket with one system call that waits
// neither for the socket nor for cl's lock, and reports how much of buf it
// wrote. When that is a part, it returns with cl's lock held (locked): the
// caller writes the rest and unlocks. Nothing written (the lock is busy,
// acknowledgements are held for the client, the socket is full, the
// deadline of an earlier blocking write passed, the connection failed)
// leaves all of buf to the writer's blocking write, which acts on each of
// those as it always does.
func (b *Broker) writeNow(cl *mqtt.Client, buf []byte) (written int, locked bool) {
	if !cl.TryLock() {
		return 0, false
	}
	n := writeOnce(cl, buf)
	if n > 0 && n < len(buf) {
		return n, true
	}
	cl.Unlock()
	return max(n, 0), false
}

// writeOnce makes one write of buf to cl's socket that does not wait, and
// returns what it wrote (≤ 0: nothing). cl's lock is held. Held
// acknowledgements go first, in the writer's write: with any, nothing is
// written here.
func writeOnce(cl *mqtt.Client, buf []byte) int {
	kc, tc := plainTCP(cl)
	if tc == nil || cl.Closed() || kc.held.n.Load() != 0 {
		return 0
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return 0
	}
	n := 0
	var werr error
	if err := rc.Write(func(fd uintptr) bool {
		n, werr = syscall.Write(int(fd), buf)
		return true // one attempt: never wait for the socket
	}); err != nil || werr != nil {
		return 0
	}
	return n
}

// plainTCP returns cl's connection and the TCP connection under it, or a
// nil TCP connection when cl is not on plain TCP (TLS, WebSocket).
func plainTCP(cl *mqtt.Client) (*keepaliveConn, *net.TCPConn) {
	kc, ok := cl.Net.Conn.(*keepaliveConn)
	if !ok {
		return nil, nil
	}
	tc, _ := kc.Conn.(*net.TCPConn)
	return kc, tc
}
