package testutil

import (
	"io"
	"net"
	"sync"
	"testing"
)

// Proxy carries TCP connections to a target address, and fails them the
// two ways a network partition does. Cut closes them and refuses new ones:
// a partition both ends see. Stall makes the connections it carries at
// that moment stop carrying anything, in either direction, while they stay
// open: what a network that silently drops every packet does, or a peer
// that hangs while its kernel still answers; connections made afterwards
// are carried as before.
type Proxy struct {
	ln     net.Listener
	target string
	done   chan struct{}

	mu       sync.Mutex
	cut      bool
	conns    []net.Conn
	stalls   []chan struct{} // one per connection pair, closed to stall it
	accepted int
}

// NewProxy starts a proxy to target on a free loopback port; it stops with
// the test.
func NewProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("proxy: %v", err)
	}
	p := &Proxy{ln: ln, target: target, done: make(chan struct{})}
	var wg sync.WaitGroup
	wg.Go(p.accept)
	t.Cleanup(func() {
		close(p.done)
		_ = ln.Close()
		p.Cut()
		wg.Wait()
	})
	return p
}

// Cut closes every connection carried, and every one made from now on.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = true
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.conns = nil
}

// Addr is the proxy's address (host:port).
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Accepted is how many connections the proxy has taken.
func (p *Proxy) Accepted() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.accepted
}

// Stall stops every connection carried now.
func (p *Proxy) Stall() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, s := range p.stalls {
		select {
		case <-s:
		default:
			close(s)
		}
	}
}

func (p *Proxy) accept() {
	for {
		in, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		p.accepted++
		p.mu.Unlock()
		out, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = in.Close()
			continue
		}
		stall := make(chan struct{})
		p.mu.Lock()
		if p.cut {
			p.mu.Unlock()
			_, _ = in.Close(), out.Close()
			continue
		}
		p.conns = append(p.conns, in, out)
		p.stalls = append(p.stalls, stall)
		p.mu.Unlock()
		go p.carry(out, in, stall)
		go p.carry(in, out, stall)
	}
}

// carry copies from src to dst until either fails or the pair is stalled:
// then what src brings is dropped, and dst hears nothing more.
func (p *Proxy) carry(dst, src net.Conn, stall chan struct{}) {
	defer func() { _ = dst.Close() }()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		select {
		case <-stall:
			// Hold both ends open until the test ends, carrying nothing.
			<-p.done
			return
		default:
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if err != io.EOF {
				_ = src.Close()
			}
			return
		}
	}
}
