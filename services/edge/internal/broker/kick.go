package broker

import (
	"context"
	"errors"
	"fmt"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// ErrNoSession is returned by [Broker.Kick] when this edge holds no session
// of the client ID (it never had one, the session ended, or it moved to
// another edge).
var ErrNoSession = errors.New("no such session on this edge")

// ErrKickRaced is returned by [Broker.Kick] with discard when the client
// connected again, to this edge, before its session could be ended: the
// new connection holds the session now.
var ErrKickRaced = errors.New("the client connected again before its session was discarded")

// ErrStopping is returned by [Broker.Kick] with discard once the edge stops:
// the session's will could no longer go out from here, while the discard
// would remove the stored record that keeps it for the session's next
// holder.
var ErrStopping = errors.New("edge stopping; discard the session where it goes next")

// KickResult is what [Broker.Kick] did.
type KickResult struct {
	// WasConnected is true when a client connection was closed.
	WasConnected bool
	// ProtocolVersion of the closed connection (3, 4 or 5); 0 if none.
	ProtocolVersion byte
	// Discarded is true when the session ended: discard was asked, or it
	// did not outlive its connection (clean session, expiry 0).
	Discarded bool
}

const (
	// kickWriteWait bounds the write of the DISCONNECT to a client that may
	// not be reading; the connection is closed regardless after it.
	kickWriteWait = time.Second
	// kickWait bounds how long Kick waits for the closed connection's
	// disconnect to be handled.
	kickWait = 5 * time.Second
)

// Kick disconnects, on an operator's request, the client of the session
// (tenant, clientID) this edge holds: an MQTT 5 client is sent DISCONNECT
// with reason 0x98 (administrative action), an MQTT 3 client's connection
// is just closed (MQTT 3 has no DISCONNECT from the server). The
// disconnect is handled as any the server causes: the will is published,
// after its delay if the session goes on. Without discard a persistent
// session stays, offline and queueing, for its client to resume; with
// discard the session ends now, as one whose expiry passed ends: its will
// goes out at once, its subscriptions, queue and stored state are removed
// and its ownership is released at the coordinator. An offline session
// (persistent, or in custody here) is only ended, with discard.
func (b *Broker) Kick(ctx context.Context, tenant, clientID string, discard bool) (KickResult, error) {
	var res KickResult
	sc, err := b.scope(tenant)
	if err != nil {
		return res, err
	}
	id := sc.ClientID(clientID)
	s := b.session(id)
	if s == nil {
		// mochi binds a connection to its session just after its CONNACK
		// went out: a client that may already act as connected is waited
		// for, not reported absent.
		if cl, ok := b.server.Clients.Get(id); ok && !cl.Closed() && b.conn(cl) != nil {
			_ = pollUntil(ctx, func() bool { return b.session(id) != nil || cl.Closed() })
			s = b.session(id)
		}
		if s == nil {
			return res, ErrNoSession
		}
	}
	s.mu.Lock()
	cl, moving, persistent := s.client, s.moving != nil, s.persistent
	s.mu.Unlock()
	if moving {
		return res, fmt.Errorf("%w: it is moving to the edge that claimed it", ErrNoSession)
	}
	if cl != nil && !cl.Closed() {
		// A connection closed already (its disconnect not handled yet) is
		// not kicked, but waited for below.
		res.WasConnected, res.ProtocolVersion = true, cl.Properties.ProtocolVersion
		b.logger.Info("client kicked by an operator; disconnecting", "client_id", id, "tenant", tenant,
			"protocol_version", res.ProtocolVersion, "discard", discard)
	}
	if discard {
		// The stop waits for the end and the will (stopGate). Once the
		// edge stops, a will could no longer go out from here while the
		// end removes the stored record that keeps it: no discard then.
		b.stopGate.RLock()
		if b.willsHeldBack() {
			b.stopGate.RUnlock()
			return res, ErrStopping
		}
		// The session ends first, as a clean start ends a connected one:
		// the connection's disconnect then finds no session, so nothing of
		// it is written back to the store.
		if cl != nil {
			if c := b.conn(cl); c != nil {
				c.sessionEnds.Store(true) // the session ends: its will goes out at once ([MQTT-3.1.3-9])
			}
		}
		b.endSession(id, cl) // with cl: a connection bound since keeps the session
		if b.session(id) == s {
			b.stopGate.RUnlock()
			return res, ErrKickRaced
		}
		// After the end: a will waiting for its delay goes now, for the
		// same reason, and so does one a connection ending meanwhile
		// scheduled before the end (its end, from here on, finds the
		// session ended and publishes at once).
		b.cancelWill(id, true)
		b.stopGate.RUnlock()
		b.logger.Info("session discarded by an operator", "client_id", id, "tenant", tenant)
	}
	if cl != nil {
		if res.WasConnected {
			b.disconnectAdmin(cl)
		}
		// Wait until the disconnect was handled; a session that does not
		// outlive its connection ends then.
		if err := pollUntil(ctx, func() bool {
			s.mu.Lock()
			bound := s.client == cl
			s.mu.Unlock()
			return !bound && b.conn(cl) == nil && (persistent || b.session(id) != s)
		}); err != nil {
			return res, fmt.Errorf("client disconnected, but its disconnect was not handled in time: %w", err)
		}
	}
	if discard {
		b.forgetOfflineClient(id)
	}
	res.Discarded = b.session(id) != s
	return res, nil
}

// disconnectAdmin closes cl's connection for an administrative action:
// DISCONNECT 0x98 first for MQTT 5, given kickWriteWait to go out through a
// socket the client may not be reading.
//
// It closes the socket itself rather than stopping the client: the close
// fails the connection's read at once, and its disconnect is then handled
// as any the server causes (the will goes out).
func (b *Broker) disconnectAdmin(cl *mqtt.Client) {
	if cl.Net.Conn == nil {
		return
	}
	if cl.Properties.ProtocolVersion == 5 {
		_ = cl.Net.Conn.SetWriteDeadline(time.Now().Add(kickWriteWait))
		sent := make(chan struct{})
		go func() {
			defer close(sent)
			code := packets.ErrAdministrativeAction
			_ = cl.WritePacket(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect},
				ReasonCode: code.Code, Properties: packets.Properties{ReasonString: code.Reason}})
		}()
		select {
		case <-sent:
		case <-time.After(2 * kickWriteWait):
		}
	}
	_ = cl.Net.Conn.Close()
}

// pollUntil polls done until it reports true, for at most kickWait.
func pollUntil(ctx context.Context, done func() bool) error {
	ctx, cancel := context.WithTimeout(ctx, kickWait)
	defer cancel()
	for !done() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
	return nil
}

// forgetOfflineClient removes mochi's record of a client whose session
// ended while it was offline, as mochi does itself when a session expires:
// a later connection with the same client ID starts afresh (no session
// present, nothing inherited).
func (b *Broker) forgetOfflineClient(id string) {
	cur, ok := b.server.Clients.Get(id)
	if !ok || !cur.Closed() {
		return // none, or a live connection has it
	}
	cur.ClearInflights()
	b.server.UnsubscribeClient(cur)
	b.server.Clients.Delete(id)
}
