package rpc

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// recordingListener records what its connections read, and how many reads
// that took.
type recordingListener struct {
	net.Listener
	mu    sync.Mutex
	read  bytes.Buffer
	reads int
}

func (l *recordingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &recordingConn{Conn: c, l: l}, nil
}

func (l *recordingListener) counts() (int, []byte) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.reads, bytes.Clone(l.read.Bytes())
}

type recordingConn struct {
	net.Conn
	l *recordingListener
}

func (c *recordingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.l.mu.Lock()
	c.l.reads++
	c.l.read.Write(p[:n])
	c.l.mu.Unlock()
	return n, err
}

const echoProcedure = "/keel.test.Echo/Echo"

// echoServer serves a Connect bidi stream that answers each message with
// itself, on h2c as every Keel service does, and records what it reads
// from the network below buffered (rpc.Buffered, or not).
func echoServer(t *testing.T, buffered bool) (baseURL string, rec *recordingListener) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	rec = &recordingListener{Listener: ln}
	var serveOn net.Listener = rec
	if buffered {
		serveOn = Buffered(rec)
	}
	mux := http.NewServeMux()
	mux.Handle(echoProcedure, connect.NewBidiStreamHandler(echoProcedure,
		func(_ context.Context, s *connect.BidiStream[wrapperspb.BytesValue, wrapperspb.BytesValue]) error {
			for {
				m, err := s.Receive()
				if errors.Is(err, io.EOF) {
					return nil
				}
				if err != nil {
					return err
				}
				if err := s.Send(m); err != nil {
					return err
				}
			}
		}, HandlerOptions()...))
	serve(t, serveOn, mux)
	return "http://" + ln.Addr().String(), rec
}

// serve serves h on ln, configured as the services' API servers are,
// until the test ends.
func serve(t *testing.T, ln net.Listener, h http.Handler) {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second, Protocols: ServerProtocols(), HTTP2: ServerHTTP2()}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
}

// echo sends each of msgs on one stream of hc, waiting for its answer
// before the next, so that each crosses alone, and returns the server's
// reads while they did and every byte it read.
func echo(t *testing.T, hc *http.Client, baseURL string, rec *recordingListener, msgs [][]byte) (reads int, wire []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	WarmUp(ctx, hc, baseURL)
	client := connect.NewClient[wrapperspb.BytesValue, wrapperspb.BytesValue](hc, baseURL+echoProcedure,
		ClientOptions(connect.WithGRPC())...)
	stream := client.CallBidiStream(ctx)
	require.NoError(t, stream.Send(wrapperspb.Bytes([]byte("first"))))
	_, err := stream.Receive()
	require.NoError(t, err)
	before, _ := rec.counts()
	for _, m := range msgs {
		require.NoError(t, stream.Send(wrapperspb.Bytes(m)))
		got, err := stream.Receive()
		require.NoError(t, err)
		require.True(t, bytes.Equal(m, got.GetValue()), "the answer is the message")
	}
	after, wire := rec.counts()
	require.NoError(t, stream.CloseRequest())
	require.NoError(t, stream.CloseResponse())
	return after - before, wire
}

// dataFrames returns the lengths of the non-empty DATA frames in wire,
// what a client wrote to an HTTP/2 connection.
func dataFrames(t *testing.T, wire []byte) []int {
	t.Helper()
	const preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
	require.True(t, bytes.HasPrefix(wire, []byte(preface)))
	wire = wire[len(preface):]
	var lens []int
	for len(wire) >= 9 {
		n := int(wire[0])<<16 | int(wire[1])<<8 | int(wire[2])
		require.GreaterOrEqual(t, len(wire), 9+n, "a frame cut short")
		if wire[3] == 0 && n > 0 { // DATA
			lens = append(lens, n)
		}
		wire = wire[9+n:]
	}
	require.Empty(t, wire)
	return lens
}

func echoMessages() [][]byte {
	var msgs [][]byte
	for i := range 24 {
		msgs = append(msgs, bytes.Repeat([]byte{byte(i)}, []int{0, 1, 60, 700, 3000}[i%5]))
	}
	return msgs
}

func TestH2CClient_SendsEachStreamMessageInOneDataFrame(t *testing.T) {
	t.Parallel()
	baseURL, rec := echoServer(t, true)
	msgs := echoMessages()
	_, wire := echo(t, H2CClient(), baseURL, rec, msgs)

	want := []int{5 + proto.Size(wrapperspb.Bytes([]byte("first")))}
	for _, m := range msgs {
		want = append(want, 5+proto.Size(wrapperspb.Bytes(m)))
	}
	require.Equal(t, want, dataFrames(t, wire), "one DATA frame per message, its envelope prefix with it")
}

func TestBuffered_ReadsAFrameThatArrivedWholeAtOnce(t *testing.T) {
	t.Parallel()
	msgs := echoMessages()
	for _, buffered := range []bool{false, true} {
		baseURL, rec := echoServer(t, buffered)
		reads, _ := echo(t, H2CClient(), baseURL, rec, msgs)
		if !buffered {
			// The frame's header, then its payload.
			require.GreaterOrEqual(t, reads, 2*len(msgs), "unbuffered, the reference")
			continue
		}
		// A window update now and then comes on its own.
		require.LessOrEqual(t, reads, len(msgs)+len(msgs)/4, "one read per frame")
	}
}

// pipeEnvelopes writes envs into w as Connect writes a stream's messages:
// each envelope's prefix, then its message, with a write each.
func pipeEnvelopes(w *io.PipeWriter, envs [][]byte, cutLast int) {
	for i, e := range envs {
		var prefix [5]byte
		binary.BigEndian.PutUint32(prefix[1:], uint32(len(e)))
		if _, err := w.Write(prefix[:]); err != nil {
			return
		}
		if i == len(envs)-1 && cutLast > 0 {
			_, _ = w.Write(e[:len(e)-cutLast])
			_ = w.CloseWithError(io.ErrUnexpectedEOF)
			return
		}
		if len(e) > 0 {
			if _, err := w.Write(e); err != nil {
				return
			}
		}
	}
	_ = w.Close()
}

func TestEnvelopeBody(t *testing.T) {
	t.Parallel()
	envs := [][]byte{[]byte("a"), {}, bytes.Repeat([]byte("b"), 100), bytes.Repeat([]byte("c"), 5000), []byte("dddd")}
	var stream []byte
	for _, e := range envs {
		stream = binary.BigEndian.AppendUint32(append(stream, 0), uint32(len(e)))
		stream = append(stream, e...)
	}

	t.Run("a read returns whole envelopes", func(t *testing.T) {
		t.Parallel()
		r, w := io.Pipe()
		go pipeEnvelopes(w, envs, 0)
		b := &envelopeBody{r: r}
		buf := make([]byte, 64<<10)
		var got []byte
		for _, e := range envs {
			n, err := b.Read(buf)
			require.NoError(t, err)
			require.Equal(t, 5+len(e), n, "envelope of %d bytes", len(e))
			got = append(got, buf[:n]...)
		}
		n, err := b.Read(buf)
		require.Equal(t, 0, n)
		require.ErrorIs(t, err, io.EOF)
		require.Equal(t, stream, got)
	})

	for _, size := range []int{1, 3, 5, 7, 64, 4096} {
		t.Run("reads smaller than an envelope", func(t *testing.T) {
			t.Parallel()
			r, w := io.Pipe()
			go pipeEnvelopes(w, envs, 0)
			b := &envelopeBody{r: r}
			buf := make([]byte, size)
			var got []byte
			for {
				n, err := b.Read(buf)
				got = append(got, buf[:n]...)
				if errors.Is(err, io.EOF) {
					break
				}
				require.NoError(t, err)
			}
			require.Equal(t, stream, got, "read %d bytes at a time", size)
		})
	}

	t.Run("a writer that fails inside an envelope", func(t *testing.T) {
		t.Parallel()
		r, w := io.Pipe()
		go pipeEnvelopes(w, envs, 2)
		got, err := io.ReadAll(&envelopeBody{r: r})
		require.ErrorIs(t, err, io.ErrUnexpectedEOF)
		require.Equal(t, stream[:len(stream)-2], got)
	})

	t.Run("close reaches the pipe", func(t *testing.T) {
		t.Parallel()
		r, w := io.Pipe()
		b := &envelopeBody{r: r}
		require.NoError(t, b.Close())
		_, err := w.Write([]byte{0})
		require.ErrorIs(t, err, io.ErrClosedPipe)
	})
}

// A request that is not a Connect or gRPC stream goes as it is.
func TestEnvelopeTransport_OnlyStreams(t *testing.T) {
	t.Parallel()
	var seen io.ReadCloser
	rt := envelopeTransport{roundTripFunc(func(req *http.Request) (*http.Response, error) {
		seen = req.Body
		return &http.Response{StatusCode: http.StatusNoContent, Body: http.NoBody}, nil
	})}
	for _, tc := range []struct {
		ct     string
		length int64
		pipe   bool
		wraps  bool
	}{
		{"application/grpc", -1, true, true},
		{"application/grpc+proto", -1, true, true},
		{"application/connect+proto", -1, true, true},
		{"application/json", -1, true, false},
		{"application/grpc", 10, true, false},
		{"application/grpc", -1, false, false},
	} {
		var body io.ReadCloser = io.NopCloser(bytes.NewReader(nil))
		if tc.pipe {
			body, _ = io.Pipe()
		}
		req, err := http.NewRequest(http.MethodPost, "http://x/", body)
		require.NoError(t, err)
		req.ContentLength = tc.length
		req.Header.Set("Content-Type", tc.ct)
		_, err = rt.RoundTrip(req)
		require.NoError(t, err)
		_, wrapped := seen.(*envelopeBody)
		require.Equal(t, tc.wraps, wrapped, "%+v", tc)
		require.True(t, body == req.Body, "the caller's request is left as it was")
	}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(req *http.Request) (*http.Response, error) { return f(req) }

// oneConn is a listener that accepts c once.
type oneConn struct {
	net.Listener
	c net.Conn
}

func (l *oneConn) Accept() (net.Conn, error) { return l.c, nil }

func TestBuffered_LeavesTLSConnectionsAsTheyAre(t *testing.T) {
	t.Parallel()
	a, b := net.Pipe()
	t.Cleanup(func() { _, _ = a.Close(), b.Close() })
	tc := tls.Server(a, &tls.Config{MinVersion: tls.VersionTLS12})
	got, err := Buffered(&oneConn{c: tc}).Accept()
	require.NoError(t, err)
	require.Same(t, tc, got, "the server must see a TLS connection")

	got, err = Buffered(&oneConn{c: b}).Accept()
	require.NoError(t, err)
	require.IsType(t, &bufferedConn{}, got)
}

type idleCloser struct {
	http.RoundTripper
	closed bool
}

func (c *idleCloser) CloseIdleConnections() { c.closed = true }

func TestEnvelopeTransport_ClosesIdleConnections(t *testing.T) {
	t.Parallel()
	inner := &idleCloser{}
	(&http.Client{Transport: envelopeTransport{inner}}).CloseIdleConnections()
	require.True(t, inner.closed)
}
