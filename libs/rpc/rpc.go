// Package rpc holds what every Keel service's Connect clients and handlers
// share: HTTP/2 without TLS inside the cluster network, and no compression
// of small messages.
package rpc

import (
	"context"
	"crypto/tls"
	"math"
	"net"
	"net/http"
	"time"

	"connectrpc.com/connect"

	"github.com/keelmq/keel/libs/tracing"
)

// H2CTransport speaks HTTP/2 to http URLs without TLS (prior knowledge),
// which Connect streams between services need, and HTTP/2 over TLS to
// https URLs. HTTP/2 pings find a dead peer under an idle stream within
// about 15 s. A peer's calls share a connection, up to the peer's stream
// limit ([MaxConcurrentStreams] for a Keel server).
func H2CTransport() *http.Transport {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	p.SetHTTP2(true)
	return &http.Transport{
		Protocols:           &p,
		ForceAttemptHTTP2:   true,
		MaxIdleConnsPerHost: 16,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		TLSClientConfig:     &tls.Config{MinVersion: tls.VersionTLS12},
		HTTP2: &http.HTTP2Config{SendPingTimeout: 10 * time.Second, PingTimeout: 5 * time.Second,
			MaxReadFrameSize: MaxFrameSize},
	}
}

// MaxFrameSize is the largest HTTP/2 frame Keel's clients and servers
// read. HTTP/2's default, 16 KiB, cut a forwarded frame of a few hundred
// messages into two or three DATA frames, and the receiver sent a window
// update (two frames, each its own write) for each: about six small writes
// and reads on both edges per forwarded frame. A forwarded frame now
// travels as one DATA frame, answered by one window update.
const MaxFrameSize = 1 << 20

// WarmUp makes one round trip to baseURL over hc, whatever its answer,
// before a long-lived stream opens: Go's HTTP/2 client sizes a request
// body's DATA frames, for the stream's whole life, by the peer's frame size
// as known when the stream starts, and on a new connection the peer's
// SETTINGS have not arrived yet (16 KiB then, whatever the peer allows).
// An answer comes after the peer's SETTINGS on the same connection.
func WarmUp(ctx context.Context, hc *http.Client, baseURL string) {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodHead, baseURL, nil)
	if err != nil {
		return
	}
	if resp, err := hc.Do(req); err == nil {
		_ = resp.Body.Close()
	}
}

// ServerHTTP2 is the HTTP/2 configuration of the services' API servers
// (coordinator, router, persistence, edge).
func ServerHTTP2() *http.HTTP2Config {
	return &http.HTTP2Config{MaxReadFrameSize: MaxFrameSize, MaxConcurrentStreams: MaxConcurrentStreams}
}

// MaxConcurrentStreams is how many calls a Keel server takes at once on
// one connection. A client's calls share a connection ([LeaseClient],
// [H2CClient]); past the limit Go's client dials another for each call
// that finds none free, racing, and Go's default (250) was too few for an
// edge's session releases after a connect storm: a few thousand at once
// opened hundreds of connections to the coordinator. Go's server also
// queues up to four times as many calls beyond it per connection.
const MaxConcurrentStreams = 4096

// H2CClient is an HTTP client on [H2CTransport] that sends each message
// of a client stream in one DATA frame (envelopeTransport).
func H2CClient() *http.Client {
	return &http.Client{Transport: envelopeTransport{H2CTransport()}}
}

// LeaseClient is [H2CClient] for a lease holder's calls to the
// coordinator. Its calls share one connection, up to the server's stream
// limit ([MaxConcurrentStreams]) at once; and it gives that connection up
// within LeaseSilence of its going silent (a ping sent after a second
// without a frame, and no answer to it within two), so that after a peer
// vanished without closing it, the next renewal goes on a new connection
// well within a lease (10 s by default; a lease shorter than about 7 s
// leaves a renewal less room). H2CClient's pings would take 15 s. A
// holder gives the connection up after a failed renewal too
// ([RedialAfter]): a coordinator may answer pings and not calls.
//
// HTTP/1.1 would find a new connection for a renewal after a timed-out
// one too, but takes a connection per concurrent call and keeps only two
// idle: a connect storm's claims and releases opened and closed a
// connection each, and left thousands in TIME_WAIT.
func LeaseClient() *http.Client {
	t := H2CTransport()
	t.HTTP2.SendPingTimeout = time.Second
	t.HTTP2.PingTimeout = LeaseSilence - time.Second
	t.IdleConnTimeout = time.Minute // a client made for a few calls does not ping on for good
	return &http.Client{Transport: envelopeTransport{t}}
}

// RedialAfter gives up hc's idle connections after a call that failed
// with err as one to a silent or stuck peer fails (it timed out, or the
// peer was unavailable), so that the next call dials again, perhaps to
// another instance behind the same address: a peer can answer HTTP/2
// pings and not calls. A connection with calls on it is left to them.
func RedialAfter(hc *http.Client, err error) {
	if code := connect.CodeOf(err); err != nil && (code == connect.CodeDeadlineExceeded || code == connect.CodeUnavailable) {
		hc.CloseIdleConnections()
	}
}

// LeaseSilence bounds how long a [LeaseClient] connection carries nothing
// from its peer before it is closed.
const LeaseSilence = 3 * time.Second

// ServerProtocols lets a server speak HTTP/1.1 and HTTP/2 without TLS.
func ServerProtocols() *http.Protocols {
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	return &p
}

// HandlerOptions are the options of every Keel Connect handler, followed
// by opts: trace context from callers ([tracing.Interceptor]), and no
// compression. Connect compresses every response a client accepts gzip for;
// Keel's messages are small and travel inside one cluster network, where a
// gzip writer per message costs more CPU than the bytes it saves (it was a
// fifth of a receiving edge's CPU under forwarding load).
func HandlerOptions(opts ...connect.HandlerOption) []connect.HandlerOption {
	return append([]connect.HandlerOption{connect.WithCompressMinBytes(math.MaxInt32),
		connect.WithInterceptors(tracing.Interceptor())}, opts...)
}

// ClientOptions are the options of every Keel Connect client, followed by
// opts: the caller's trace context goes with each call
// ([tracing.Interceptor]).
func ClientOptions(opts ...connect.ClientOption) []connect.ClientOption {
	return append([]connect.ClientOption{connect.WithInterceptors(tracing.Interceptor())}, opts...)
}
