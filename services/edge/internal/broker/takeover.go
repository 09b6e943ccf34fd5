package broker

import (
	"context"

	"github.com/mochi-mqtt/server/v2/packets"
)

// Takeover reaches the edge that owned a session before this one claimed
// it. Begin asks it to let the session go: close the client's connection
// there (0x8E), so that a client ID has at most one live connection in the
// cluster. An error leaves the claim standing: the previous owner, if it is
// cut off, fences itself when its lease runs out.
type Takeover interface {
	Begin(ctx context.Context, previousOwner, tenant, clientID string, newEpoch uint64) error
}

// TakeOver gives up, on this edge, the session that another edge claimed
// under newEpoch: its connection is closed with 0x8E (MQTT 5) and its will
// is not sent, because the session goes on elsewhere ([MQTT-3.1.3-9]). A
// session without expiry ends with its connection; a persistent one stays
// here offline, its stored state untouched, until it expires. owned is false
// when this edge holds no session under an older epoch (a stale request
// never closes a newer connection).
func (b *Broker) TakeOver(tenant, clientID string, newEpoch uint64) (owned, wasConnected bool) {
	sc, err := b.scope(tenant)
	if err != nil {
		return false, false
	}
	s := b.session(sc.ClientID(clientID))
	if s == nil {
		return false, false
	}
	s.mu.Lock()
	epoch, cl := s.epoch, s.client
	s.mu.Unlock()
	if epoch >= newEpoch {
		return false, false
	}
	b.m.takeovers.Inc()
	if cl == nil {
		return true, false
	}
	if c := b.conn(cl); c != nil {
		c.will.Store(nil)
	}
	b.logger.Info("session taken over by another edge; disconnecting", "client_id", cl.ID)
	_ = b.server.DisconnectClient(cl, packets.ErrSessionTakenOver)
	return true, true
}
