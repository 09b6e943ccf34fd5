// Package listener provides the edge's MQTT network listeners.
//
// TCP replaces mochi's TCP listener, which logs every closed connection at
// warn level with an empty message, shares one error variable between the
// goroutines of all connections (a data race), and leaves Go's TCP
// keep-alive probes on although MQTT has its own keep-alive.
package listener

import (
	"context"
	"crypto/tls"
	"errors"
	"log/slog"
	"net"
	"sync"

	"github.com/mochi-mqtt/server/v2/listeners"
)

// TCP serves MQTT over TCP, or TLS when a TLS config is given.
type TCP struct {
	id      string
	address string
	tls     *tls.Config
	logger  *slog.Logger

	mu     sync.Mutex
	ln     net.Listener
	closed bool
	wg     sync.WaitGroup
}

// NewTCP returns a listener for address; tlsConfig may be nil.
func NewTCP(id, address string, tlsConfig *tls.Config) *TCP {
	return &TCP{id: id, address: address, tls: tlsConfig}
}

// ID implements listeners.Listener.
func (l *TCP) ID() string { return l.id }

// Protocol implements listeners.Listener.
func (l *TCP) Protocol() string {
	if l.tls != nil {
		return "tls"
	}
	return "tcp"
}

// Address returns the bound address once Init has run.
func (l *TCP) Address() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ln != nil {
		return l.ln.Addr().String()
	}
	return l.address
}

// Init binds the address.
func (l *TCP) Init(logger *slog.Logger) error {
	l.logger = logger
	// MQTT keep-alive finds dead peers; kernel probes only add syscalls.
	lc := net.ListenConfig{KeepAlive: -1}
	ln, err := lc.Listen(context.Background(), "tcp", l.address)
	if err != nil {
		return err
	}
	if l.tls != nil {
		ln = tls.NewListener(ln, l.tls)
	}
	l.mu.Lock()
	l.ln = ln
	l.mu.Unlock()
	return nil
}

// Serve accepts connections until Close.
func (l *TCP) Serve(establish listeners.EstablishFn) {
	l.mu.Lock()
	ln := l.ln
	l.mu.Unlock()
	for {
		conn, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			l.logger.Error("accept failed", "listener", l.id, "error", err)
			return
		}
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			if err := establish(l.id, conn); err != nil && l.logger.Enabled(context.Background(), slog.LevelDebug) {
				l.logger.Debug("connection ended", "listener", l.id, "remote", conn.RemoteAddr().String(), "error", err)
			}
		}()
	}
}

// Close stops accepting and closes the clients of this listener.
func (l *TCP) Close(closeClients listeners.CloseFn) {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return
	}
	l.closed = true
	ln := l.ln
	l.mu.Unlock()
	closeClients(l.id)
	if ln != nil {
		_ = ln.Close()
	}
}
