package wire

import (
	"errors"
	"fmt"
	"io"
	"sync"
)

// Reader splits a byte stream into packets with one buffer and no allocation
// per packet. It is not safe for concurrent use.
type Reader struct {
	r          io.Reader
	buf        []byte
	start, end int
	max        int

	// BeforeRead, if set, runs each time the Reader has no complete packet
	// buffered and is about to block in Read. Clients use it to flush the
	// acknowledgements they queued for the packets just handled, so that
	// acks go out in one write per read.
	BeforeRead func() error
}

// NewReader returns a Reader with an initial buffer of size bytes that grows
// up to max bytes to hold one packet (max <= 0 means [MaxRemainingLength]+5).
func NewReader(r io.Reader, size, max int) *Reader {
	if max <= 0 {
		max = MaxRemainingLength + 5
	}
	if size < 16 {
		size = 16
	}
	return &Reader{r: r, buf: make([]byte, size), max: max}
}

// Next returns the next packet's fixed-header byte and body. body aliases the
// Reader's buffer and is valid only until the next call.
func (r *Reader) Next() (header byte, body []byte, err error) {
	for {
		if r.end > r.start {
			h, rem, hs, err := ParseHeader(r.buf[r.start:r.end])
			switch {
			case err == nil:
				total := hs + rem
				if total > r.max {
					return 0, nil, fmt.Errorf("%w: %d bytes", ErrTooLarge, total)
				}
				if r.end-r.start >= total {
					body = r.buf[r.start+hs : r.start+total]
					r.start += total
					return h, body, nil
				}
				if total > len(r.buf) {
					nb := make([]byte, max(total, 2*len(r.buf)))
					r.end = copy(nb, r.buf[r.start:r.end])
					r.start, r.buf = 0, nb
				}
			case !errors.Is(err, ErrShortBuffer):
				return 0, nil, err
			}
		}
		if r.start == r.end {
			r.start, r.end = 0, 0
		} else if r.start > 0 && len(r.buf)-r.end < len(r.buf)/4 {
			// Move the partial packet to the front so the next Read is large.
			r.end = copy(r.buf, r.buf[r.start:r.end])
			r.start = 0
		}
		if r.BeforeRead != nil {
			if err := r.BeforeRead(); err != nil {
				return 0, nil, err
			}
		}
		n, err := r.r.Read(r.buf[r.end:])
		r.end += n
		if n == 0 && err != nil {
			return 0, nil, err
		}
	}
}

// Writer buffers encoded packets for one connection and writes them in
// batches. Two goroutines may share it, for example a publisher loop and the
// goroutine reading that connection's acknowledgements: appends are guarded
// by one mutex and writes to the connection by another, so a Flush never
// blocks appends while it is in the kernel and packets keep their order.
type Writer struct {
	mu    sync.Mutex // guards buf
	buf   []byte
	spare []byte

	wmu sync.Mutex // serialises w.Write; taken before mu
	w   io.Writer
}

// NewWriter returns a Writer with an initial buffer of size bytes.
func NewWriter(w io.Writer, size int) *Writer {
	return &Writer{w: w, buf: make([]byte, 0, size), spare: make([]byte, 0, size)}
}

// Publish queues a PUBLISH and returns the number of bytes now pending.
func (w *Writer) Publish(topic, payload []byte, qos byte, packetID uint16) int {
	w.mu.Lock()
	w.buf = AppendPublish(w.buf, topic, payload, qos, packetID, false, false)
	n := len(w.buf)
	w.mu.Unlock()
	return n
}

// Ack queues an acknowledgement (see [AppendAck]) and returns the bytes pending.
func (w *Writer) Ack(t byte, packetID uint16) int {
	w.mu.Lock()
	w.buf = AppendAck(w.buf, t, packetID)
	n := len(w.buf)
	w.mu.Unlock()
	return n
}

// Raw queues already-encoded bytes and returns the bytes pending.
func (w *Writer) Raw(b []byte) int {
	w.mu.Lock()
	w.buf = append(w.buf, b...)
	n := len(w.buf)
	w.mu.Unlock()
	return n
}

// Pending returns the number of bytes queued and not yet written.
func (w *Writer) Pending() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.buf)
}

// Flush writes everything queued so far.
func (w *Writer) Flush() error {
	w.wmu.Lock()
	defer w.wmu.Unlock()
	w.mu.Lock()
	out := w.buf
	w.buf = w.spare[:0]
	w.mu.Unlock()
	var err error
	if len(out) > 0 {
		_, err = w.w.Write(out)
	}
	// Only this function, under wmu, touches spare.
	w.spare = out[:0]
	return err
}
