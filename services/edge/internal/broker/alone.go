package broker

import (
	"net"
	"syscall"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
)

// A delivery that finds its session's writer idle, and idle for a while,
// is written by the goroutine that queued it (a publisher's read loop, a
// forward stream's handler) with one write that does not wait, instead of
// by a writer goroutine started for it. At a few thousand messages a
// second each message travels alone, and starting a goroutine on another
// CPU for each cost more than the write: waking an idle thread, its
// scheduler's spinning, a second context switch. Under load the writer
// is still busy or was a moment ago, and its batches (one write for many
// deliveries) are worth more than the wake-up they cost, so nothing
// changes there.
//
// Only a delivery with nothing to store first goes alone (a durable
// session's packet IDs are stored before they are sent), only on plain
// TCP (a TLS record or a WebSocket frame cannot be written in part), and
// never one that would wait: a socket that takes less than the whole
// packet keeps the client's lock, and a writer goroutine writes the rest,
// as it writes to a client that reads slowly, before anything else goes
// to that client.

// writeAloneAfter is how long a session's writer must have been idle for
// a delivery to be written alone: longer than the gap between a busy
// session's messages, and short against a quiet one's.
const writeAloneAfter = time.Millisecond

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
	if cl == nil || s.queue.len() != 1 || d.onSubscribe || s.slow || !s.settleUntil.IsZero() ||
		d.qos > 0 && s.inflight >= s.window {
		// A retained message for a new subscription goes after the
		// SUBACK mochi writes once the subscribing hook returns.
		return false
	}
	kc, ok := cl.Net.Conn.(*keepaliveConn)
	if !ok {
		return false
	}
	if _, tcp := kc.Conn.(*net.TCPConn); !tcp {
		return false
	}
	return time.Now().UnixNano()-s.idleSince >= int64(s.b.aloneAfter)
}

// takeAloneLocked takes the one queued delivery for writeAlone, as the
// writer takes a batch. s.mu is held.
func (s *session) takeAloneLocked() aloneWrite {
	d := s.queue.pop()
	s.queueBytes -= d.msg.size()
	if d.qos > 0 {
		s.inflight++
	}
	if s.spilling && s.queue.len() < s.b.cfg.QueueLen/2 {
		s.spilling = false
	}
	s.wakeLocked()
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
	rest := buf[:0]
	if sent {
		var locked bool
		rest, locked = b.writeNow(s, w.cl, buf)
		if locked {
			// The client's lock is held until the rest is written: nothing
			// else may go to the client in between.
			b.mAlone[alonePartial].Inc()
			own := append([]byte(nil), rest...)
			b.writers.Add(1)
			go func() {
				defer b.writers.Done()
				err := b.writeRawLocked(s, w.cl, own)
				w.cl.Unlock()
				if err != nil {
					s.mu.Lock()
					s.writing = false
					s.mu.Unlock()
					return
				}
				growStackForWrite()
				s.writeLoop()
			}()
			*bufp = buf[:0]
			writeBufs.Put(bufp)
			return
		}
		if len(rest) == 0 {
			b.mAlone[aloneWhole].Inc()
		} else {
			b.mAlone[aloneRefused].Inc()
		}
	}
	if len(rest) > 0 {
		// Nothing written: the writer writes it, first.
		own := append([]byte(nil), rest...)
		*bufp = buf[:0]
		writeBufs.Put(bufp)
		b.writers.Add(1)
		go func() {
			defer b.writers.Done()
			growStackForWrite()
			if b.writeRaw(s, w.cl, own) != nil {
				s.mu.Lock()
				s.writing = false
				s.mu.Unlock()
				return
			}
			s.writeLoop()
		}()
		return
	}
	*bufp = buf[:0]
	writeBufs.Put(bufp)
	s.mu.Lock()
	more := s.queue.len() > 0
	if !more {
		s.writing = false
		s.idleSince = now.UnixNano()
	}
	s.mu.Unlock()
	if more {
		b.startWriter(s)
	}
}

// writeNow writes buf to cl's socket with one system call that does not
// wait, and returns what it did not write. When it wrote part of buf, it
// returns with cl's lock held (locked): the caller writes the rest and
// unlocks. Nothing written (the socket is full, the deadline of an
// earlier blocking write passed, the connection failed) returns all of
// buf, unlocked: the writer's blocking write, under a deadline of its
// own, then meets the same condition and acts on it.
func (b *Broker) writeNow(s *session, cl *mqtt.Client, buf []byte) (rest []byte, locked bool) {
	cl.Lock()
	kc, ok := cl.Net.Conn.(*keepaliveConn)
	if !ok || cl.Closed() || kc.held.n.Load() != 0 {
		// Held acknowledgements go first, with a write of their own.
		cl.Unlock()
		return buf, false
	}
	tc, ok := kc.Conn.(*net.TCPConn)
	if !ok {
		cl.Unlock()
		return buf, false
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		cl.Unlock()
		return buf, false
	}
	n := 0
	var werr error
	err = rc.Write(func(fd uintptr) bool {
		n, werr = syscall.Write(int(fd), buf)
		return true // one attempt: never wait for the socket
	})
	if err == nil {
		err = werr
	}
	if err != nil || n <= 0 {
		cl.Unlock()
		return buf, false
	}
	if n == len(buf) {
		cl.Unlock()
		return nil, false
	}
	return buf[n:], true
}
