package raftnode

import (
	"errors"
	"net"
	"sync"
	"time"

	"github.com/hashicorp/raft"
)

// errIsolated is returned by Dial while the stream layer is isolated.
var errIsolated = errors.New("raft transport isolated")

// streamLayer is the raft.StreamLayer of the TCP transport. It tracks every
// connection so that a test can cut the node off ([Node.Isolate]): while
// isolated it refuses dials and closes accepted connections, which to its
// peers looks like a network partition in both directions.
type streamLayer struct {
	ln        net.Listener
	advertise net.Addr

	mu       sync.Mutex
	isolated bool                  // guarded by mu
	conns    map[net.Conn]struct{} // guarded by mu
}

var _ raft.StreamLayer = (*streamLayer)(nil)

func newStreamLayer(ln net.Listener, advertise net.Addr) *streamLayer {
	if advertise == nil {
		advertise = ln.Addr()
	}
	return &streamLayer{ln: ln, advertise: advertise, conns: map[net.Conn]struct{}{}}
}

func (s *streamLayer) Accept() (net.Conn, error) {
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return nil, err
		}
		if tc := s.track(c); tc != nil {
			return tc, nil
		}
	}
}

func (s *streamLayer) Dial(addr raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	s.mu.Lock()
	iso := s.isolated
	s.mu.Unlock()
	if iso {
		return nil, errIsolated
	}
	c, err := net.DialTimeout("tcp", string(addr), timeout)
	if err != nil {
		return nil, err
	}
	if tc := s.track(c); tc != nil {
		return tc, nil
	}
	return nil, errIsolated
}

// track registers c, or closes it and returns nil while isolated.
func (s *streamLayer) track(c net.Conn) net.Conn {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.isolated {
		_ = c.Close()
		return nil
	}
	s.conns[c] = struct{}{}
	return &trackedConn{Conn: c, s: s}
}

func (s *streamLayer) Close() error   { return s.ln.Close() }
func (s *streamLayer) Addr() net.Addr { return s.advertise }

func (s *streamLayer) setIsolated(iso bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.isolated = iso
	if iso {
		for c := range s.conns {
			_ = c.Close()
		}
		clear(s.conns)
	}
}

type trackedConn struct {
	net.Conn
	s    *streamLayer
	once sync.Once
}

func (c *trackedConn) Close() error {
	c.once.Do(func() {
		c.s.mu.Lock()
		delete(c.s.conns, c.Conn)
		c.s.mu.Unlock()
	})
	return c.Conn.Close()
}
