package broker

import (
	"context"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
)

// expiredOffline returns mochi's record of the client id if its connection
// closed and its session has expired at now: its Session Expiry Interval
// passed since the close, to the nanosecond (§3.1.2.11.2). mochi's clock
// for it (clearExpiredClients) runs once a second; a CONNECT that comes
// between the expiry and that tick must find the session gone all the
// same (Session Present 0, [MQTT-3.2.2-3]).
func (b *Broker) expiredOffline(id string, now time.Time) *mqtt.Client {
	old, ok := b.server.Clients.Get(id)
	if !ok || !old.Closed() || old.IsTakenOver() || !b.server.SessionExpired(old, now) {
		return nil
	}
	return old
}

// expireOffline ends the session of old, mochi's record of a client whose
// connection closed, as its expiry ends it: the will still waiting for its
// delay goes out now ([MQTT-3.1.3-9]), the session's subscriptions, queue
// and stored state go, its ownership is released, and mochi forgets the
// client so that nothing is inherited from it. It reports whether it did:
// the first caller for old does (mochi's expiry tick, a CONNECT of the
// client, a takeover from another edge), the others find it done, so the
// will goes out once.
func (b *Broker) expireOffline(old *mqtt.Client) bool {
	// The claim the expired session was held under: a CONNECT that raised
	// the epoch since (one that stopped waiting for this expiry after its
	// timeout) took the copy on, and it is that claim's, not this end's.
	var upTo uint64
	if s := b.session(old.ID); s != nil {
		s.mu.Lock()
		upTo = s.epoch
		s.mu.Unlock()
	}
	if !b.server.Clients.DeleteIf(old.ID, old) {
		return false
	}
	// The will goes out from here and the stored record that holds it
	// ends: the stop waits for both (stopGate). Once the edge stops, the
	// will is held back, and the record stays with it for whoever holds
	// the session next: a single-node edge's restart, where the session
	// expires again (keepWillForRestart), or on a cluster the next
	// holder, which finds the session ended (storeEndedWill).
	b.stopGate.RLock()
	heldBack := b.willsHeldBack()
	b.cancelWill(old.ID, true)
	// Or the stop went on past its wait for the gate.
	heldBack = heldBack || b.willsHeldBack()
	if heldBack && b.store != nil && b.store.Shared() {
		heldBack = b.storeEndedWill(old.ID, upTo)
	}
	// With old: a connection bound since keeps its session.
	b.endSessionRoutes(context.Background(), old.ID, endWhich{cl: old, upTo: upTo, forCustody: heldBack})
	b.stopGate.RUnlock()
	// The session is gone: these reach no session of the edge. They clear
	// mochi's topic index, keyed by client ID, of the expired
	// subscriptions, which a new session's UNSUBSCRIBE would find.
	old.ClearInflights()
	b.server.UnsubscribeClient(old)
	return true
}
