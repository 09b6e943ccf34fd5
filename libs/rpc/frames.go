package rpc

import (
	"bufio"
	"crypto/tls"
	"encoding/binary"
	"io"
	"net"
	"net/http"
	"strings"
)

// Connect writes each message of a client stream into the request body's
// pipe with two writes, its 5-byte envelope prefix and then the message,
// and Go's HTTP/2 client sends each read of a request body as a DATA frame
// of its own, flushed with a write to the socket. So every message sent on
// a stream (a forwarded frame, a batch of store writes) cost the sender
// two frames and two system calls, and the receiver four reads (each
// frame's header, then its payload). At a few thousand messages a second,
// when each crosses alone, those were a third of a stream's system calls.
// envelopeTransport hands the HTTP/2 client each envelope whole.

// envelopeTransport reads the body of a streaming Connect or gRPC request
// whole envelopes at a time (envelopeBody).
type envelopeTransport struct {
	http.RoundTripper
}

func (t envelopeTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if body, ok := req.Body.(*io.PipeReader); ok && req.ContentLength < 0 && enveloped(req.Header.Get("Content-Type")) {
		r := *req // RoundTrip must not change the caller's request
		r.Body = &envelopeBody{r: body}
		req = &r
	}
	return t.RoundTripper.RoundTrip(req)
}

// CloseIdleConnections closes the transport's idle connections, as
// [http.Client.CloseIdleConnections] expects of its transport.
func (t envelopeTransport) CloseIdleConnections() {
	if c, ok := t.RoundTripper.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// enveloped reports whether a request body of content type ct is a
// sequence of 5-byte-prefixed envelopes: gRPC, gRPC-Web and Connect
// streams.
func enveloped(ct string) bool {
	return strings.HasPrefix(ct, "application/grpc") || strings.HasPrefix(ct, "application/connect+")
}

// envelopeBody reads a stream of envelopes (a flags byte, a 4-byte
// big-endian length, then that many bytes) from a pipe whose writer writes
// each envelope's prefix and message separately, one right after the
// other. A read that ends inside an envelope reads on, while it has room,
// until the envelope is whole: the writer is writing its rest that moment.
// A read never waits for the next envelope.
type envelopeBody struct {
	r      *io.PipeReader
	prefix [5]byte
	have   int // bytes of the current envelope's prefix read, up to 5
	left   int // bytes of the current envelope's message still to read
}

func (b *envelopeBody) Read(p []byte) (int, error) {
	n := 0
	for n < len(p) {
		m, err := b.r.Read(p[n:])
		b.account(p[n : n+m])
		n += m
		if err != nil || b.have == 0 && b.left == 0 {
			return n, err
		}
	}
	return n, nil
}

// account follows the envelope boundaries through read, the next bytes of
// the stream.
func (b *envelopeBody) account(read []byte) {
	for len(read) > 0 {
		if b.left > 0 {
			k := min(b.left, len(read))
			b.left -= k
			read = read[k:]
			continue
		}
		k := copy(b.prefix[b.have:], read)
		b.have += k
		read = read[k:]
		if b.have == len(b.prefix) {
			b.have = 0
			b.left = int(binary.BigEndian.Uint32(b.prefix[1:]))
		}
	}
}

func (b *envelopeBody) Close() error { return b.r.Close() }

// serverReadBuffer is what a server connection reads ahead: a forwarded
// frame of a few hundred messages, with its frame header, in one read.
const serverReadBuffer = 32 << 10

// Listen listens on a TCP address for a Keel service's Connect server. Go's
// HTTP/2 server reads its connections unbuffered, each frame's 9-byte
// header and then its payload with a system call each; the connections of
// this listener read ahead (serverReadBuffer), so a frame that arrived
// whole is read with one.
func Listen(addr string) (net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	return Buffered(ln), nil
}

// Buffered makes the connections ln accepts read ahead, as [Listen]'s do.
func Buffered(ln net.Listener) net.Listener { return bufferedListener{ln} }

type bufferedListener struct {
	net.Listener
}

func (l bufferedListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	if _, ok := c.(*tls.Conn); ok {
		// Buffered already, and the server must see it is TLS.
		return c, nil
	}
	return &bufferedConn{Conn: c, r: bufio.NewReaderSize(c, serverReadBuffer)}, nil
}

// bufferedConn reads c through r.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufferedConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// CloseWrite lets an HTTP/1 server half-close the connection, as it does a
// TCP connection's.
func (c *bufferedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}
