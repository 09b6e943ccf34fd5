package loadgen

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/keelmq/keel/test/bench/wire"
)

// handshakeTimeout bounds CONNECT→CONNACK and SUBSCRIBE→SUBACK.
const handshakeTimeout = 10 * time.Second

// Buffer sizes. Idle and storm clients use the small ones so that 10,000 of
// them cost the generator little memory.
const (
	bigReadBuf    = 64 * 1024
	bigWriteBuf   = 64 * 1024
	smallReadBuf  = 64
	flushAtBytes  = 32 * 1024
	maxPacketSize = 1 << 20
)

// ErrRefused is returned when the broker refuses a CONNECT or a SUBSCRIBE.
var ErrRefused = errors.New("broker refused")

// RefusedError is a CONNACK with a nonzero return code. It matches
// [ErrRefused] under errors.Is.
type RefusedError struct{ Code byte }

func (e *RefusedError) Error() string {
	return fmt.Sprintf("%v: connack return code %d", ErrRefused, e.Code)
}

// Is reports whether target is [ErrRefused].
func (e *RefusedError) Is(target error) bool { return target == ErrRefused }

// client is one MQTT connection.
type client struct {
	conn net.Conn
	r    *wire.Reader
	w    *wire.Writer
}

// dial opens a TCP connection and completes the MQTT handshake.
func dial(ctx context.Context, cfg *Config, addr, clientID string, readBuf int) (*client, error) {
	return dialSession(ctx, cfg, addr, clientID, readBuf, true)
}

// dialSession is dial with the clean session flag given.
func dialSession(ctx context.Context, cfg *Config, addr, clientID string, readBuf int, clean bool) (*client, error) {
	c, _, err := dialResume(ctx, cfg, addr, clientID, readBuf, clean)
	return c, err
}

// dialResume is dialSession that also reports the CONNACK's session present
// flag. A refusal is a [*RefusedError].
func dialResume(ctx context.Context, cfg *Config, addr, clientID string, readBuf int, clean bool) (*client, bool, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, false, fmt.Errorf("dial %s: %w", addr, err)
	}
	c := &client{conn: conn, r: wire.NewReader(conn, readBuf, maxPacketSize)}
	opts := wire.ConnectOptions{ClientID: clientID, KeepAlive: uint16(cfg.KeepAlive), CleanSession: clean}
	if cfg.Username != "" {
		opts.Username = cfg.Username
		if cfg.Password != "" {
			opts.Password = []byte(cfg.Password)
		}
	}
	_ = conn.SetDeadline(time.Now().Add(handshakeTimeout))
	if _, err := conn.Write(wire.AppendConnect(nil, opts)); err != nil {
		conn.Close()
		return nil, false, fmt.Errorf("send connect: %w", err)
	}
	h, body, err := c.r.Next()
	if err != nil {
		conn.Close()
		return nil, false, fmt.Errorf("read connack: %w", err)
	}
	p, err := wire.DecodeBody(h, body)
	if err != nil || p.Type != wire.Connack {
		conn.Close()
		return nil, false, fmt.Errorf("read connack: got type %d: %w", h>>4, errors.Join(err, wire.ErrMalformed))
	}
	if p.ReturnCode != 0 {
		conn.Close()
		return nil, false, &RefusedError{Code: p.ReturnCode}
	}
	_ = conn.SetDeadline(time.Time{})
	return c, p.SessionPresent, nil
}

// subscribe sends one SUBSCRIBE and waits for its SUBACK. It must run before
// the client's reading goroutine starts.
func (c *client) subscribe(filter string, qos byte) error {
	_ = c.conn.SetDeadline(time.Now().Add(handshakeTimeout))
	defer func() { _ = c.conn.SetDeadline(time.Time{}) }()
	if _, err := c.conn.Write(wire.AppendSubscribe(nil, 1, filter, qos)); err != nil {
		return fmt.Errorf("send subscribe: %w", err)
	}
	for {
		h, body, err := c.r.Next()
		if err != nil {
			return fmt.Errorf("read suback: %w", err)
		}
		if h>>4 != wire.Suback {
			continue // e.g. a retained message; the run has not started
		}
		p, err := wire.DecodeBody(h, body)
		if err != nil {
			return fmt.Errorf("read suback: %w", err)
		}
		if p.ReturnCodes[0] == wire.SubackFailure {
			return fmt.Errorf("%w: subscription to %q", ErrRefused, filter)
		}
		return nil
	}
}

// disconnect sends DISCONNECT, best effort, and closes the connection.
func (c *client) disconnect() {
	_ = c.conn.SetWriteDeadline(time.Now().Add(time.Second))
	if c.w != nil {
		c.w.Raw(wire.AppendDisconnect(nil))
		_ = c.w.Flush()
	} else {
		_, _ = c.conn.Write(wire.AppendDisconnect(nil))
	}
	_ = c.conn.Close()
}

// forEach runs fn(i) for i in [0, n) on at most par goroutines and returns
// the first error, after all calls have returned.
func forEach(ctx context.Context, n, par int, fn func(ctx context.Context, i int) error) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(n, par) {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= n || ctx.Err() != nil {
					return
				}
				if err := fn(ctx, i); err != nil {
					cancel(err)
					return
				}
			}
		})
	}
	wg.Wait()
	return context.Cause(ctx)
}
