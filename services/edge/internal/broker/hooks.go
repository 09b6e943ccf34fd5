package broker

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/keelmq/keel/libs/topic"
	"github.com/keelmq/keel/libs/tracing"
	"github.com/keelmq/keel/services/edge/internal/auth"
	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

// hook connects mochi to the broker. Every method runs on the goroutine of
// the client concerned, so per-connection state needs no lock.
type hook struct {
	mqtt.HookBase
	b *Broker
}

func (h *hook) ID() string { return "keel-edge" }

func (h *hook) Provides(b byte) bool {
	return bytes.Contains([]byte{
		mqtt.OnConnect, mqtt.OnConnectAuthenticate, mqtt.OnACLCheck, mqtt.OnSessionEstablish,
		mqtt.OnSessionEstablished, mqtt.OnDisconnect, mqtt.OnPacketRead, mqtt.OnPacketEncode,
		mqtt.OnSubscribe, mqtt.OnSubscribed, mqtt.OnUnsubscribed, mqtt.OnPublish,
		mqtt.OnQosComplete, mqtt.OnQosDropped, mqtt.OnClientExpired,
		mqtt.StoredClients, mqtt.StoredSubscriptions, mqtt.StoredInflightMessages,
	}, []byte{b})
}

// OnConnect authenticates the client, moves it into its tenant's namespace
// and takes custody of its will. A refusal sends a CONNACK with the precise
// reason and closes.
func (h *hook) OnConnect(cl *mqtt.Client, pk packets.Packet) error {
	b := h.b
	// The CONNECT's span starts once the tenant is known (tracing on).
	spanCtx := context.Background()
	span := trace.SpanFromContext(spanCtx) // does nothing
	defer func() { span.End() }()
	refuse := func(code packets.Code, result string) error {
		if span.IsRecording() {
			span.SetStatus(codes.Error, result)
		}
		b.m.connects.WithLabelValues(result).Inc()
		_ = b.server.SendConnack(cl, connackCode(cl, code), false, nil)
		return code
	}
	if b.fenced.Load() {
		return refuse(packets.ErrServerUnavailable, "fenced")
	}
	if b.draining.Load() {
		return refuse(packets.ErrServerUnavailable, "draining")
	}
	if b.stopping.Load() {
		// Its session would be closed at once, and what it wrote could
		// cross what the stop writes of the connection it replaces. (0x8B
		// is a DISCONNECT's code, not a CONNACK's [MQTT-3.2.2-8].)
		return refuse(packets.ErrServerUnavailable, "stopping")
	}
	now := time.Now()
	if !b.guard.admit(cl.Net.Listener, now) {
		b.m.packetErrors.WithLabelValues("connect_rate").Inc()
		return refuse(packets.ErrConnectionRateExceeded, "connect_rate")
	}
	if b.guard.banned(cl.Net.Remote, now) {
		b.m.authFailures.WithLabelValues("banned").Inc()
		return refuse(packets.ErrBanned, "banned")
	}
	if len(pk.Connect.ClientIdentifier) > b.cfg.MaxClientIDLength {
		b.logger.Info("connect refused", "reason", "client id too long", "remote", cl.Net.Remote)
		return refuse(packets.ErrClientIdentifierNotValid, "invalid_client_id")
	}
	if pk.Properties.AuthenticationMethod != "" {
		// The edge supports no enhanced authentication ([MQTT-4.12.0-1]).
		b.m.authFailures.WithLabelValues("bad_authentication_method").Inc()
		b.logger.Info("connect refused", "reason", "unsupported authentication method", "method", pk.Properties.AuthenticationMethod, "remote", cl.Net.Remote)
		return refuse(packets.ErrBadAuthenticationMethod, "auth_failed")
	}
	req := &auth.Request{
		Listener:        cl.Net.Listener,
		Remote:          cl.Net.Remote,
		ClientID:        pk.Connect.ClientIdentifier,
		Username:        string(pk.Connect.Username),
		ProtocolVersion: pk.ProtocolVersion,
		TLS:             tlsState(cl.Net.Conn),
	}
	if pk.Connect.PasswordFlag {
		req.Password = pk.Connect.Password
	}
	// An ACL refresh running from here until the connection is registered
	// may not see it: aclSeen tells (aclwatch.go).
	aclGen := b.aclw.gen.Load()
	ctx, cancel := context.WithTimeout(context.Background(), b.cfg.ConnectTimeout)
	id, err := b.auth.Authenticate(ctx, req)
	cancel()
	if tracing.Enabled() {
		tenant := ""
		if err == nil {
			tenant = id.Tenant
		}
		spanCtx, span = startConnect(cl, tenant, now, time.Now(), err)
	}
	if err != nil {
		code := authCode(err)
		b.m.authFailures.WithLabelValues(authReason(code)).Inc()
		if code != packets.ErrServerUnavailable && b.guard.failed(cl.Net.Remote, now) {
			b.m.bans.Inc()
			b.logger.Warn("banning after repeated authentication failures", "remote", ipOf(cl.Net.Remote), "username_set", req.Username != "")
		}
		b.logger.Info("authentication refused", "remote", cl.Net.Remote, "username_set", req.Username != "", "reason", code.Reason, "error", err)
		return refuse(code, "auth_failed")
	}
	sc, err := b.scope(id.Tenant)
	if err != nil {
		b.logger.Error("authenticator returned an invalid tenant", "tenant", id.Tenant)
		return refuse(packets.ErrNotAuthorized, "auth_failed")
	}
	external := cl.ID // assigned by mochi when the client sent none
	internal := sc.ClientID(external)
	c := &conn{scope: sc, identity: id, clientID: external, listener: cl.Net.Listener}
	c.rules.Store(id.ACL.Bind(id.Tenant, id.Username, external))
	if b.cfg.PublishRate > 0 {
		c.limiter = newRateLimiter(b.cfg.PublishRate, b.cfg.PublishBurst)
	}
	if atomic.LoadUint32(&cl.Properties.Will.Flag) == 1 {
		w := &cl.Properties.Will // its topic is valid (vetConnect)
		if strings.HasPrefix(w.TopicName, "$SYS") || !c.rules.Load().CanPublish(w.TopicName) {
			return refuse(packets.ErrNotAuthorized, "will_not_authorized")
		}
		c.will.Store(b.newWill(sc.Topic(w.TopicName), w.Payload, w.Qos, w.Retain, forwardProps(&pk.Connect.WillProperties)))
		c.willDelay = w.WillDelayInterval
		// The edge publishes the will itself, exactly once, through routing.
		atomic.StoreUint32(&w.Flag, 0)
	}
	if max := b.cfg.MaxKeepAlive; max > 0 && (cl.State.Keepalive == 0 || cl.State.Keepalive > max) {
		cl.State.Keepalive = max
		cl.State.ServerKeepalive = cl.Properties.ProtocolVersion == 5
	}
	if kc, ok := cl.Net.Conn.(*keepaliveConn); ok && cl.State.Keepalive > 0 {
		kc.setKeepalive(cl.State.Keepalive)
	}
	// Claim the session before the CONNACK: in a cluster this is where a
	// session on another edge is taken over, and its epoch fences every write.
	ctx, cancel = context.WithTimeout(spanCtx, b.cfg.ConnectTimeout)
	claimCtx, claimSpan := tracer.Start(ctx, "cluster.claim")
	c.guard = b.guardClaim(internal)
	defer func() {
		if b.conn(cl) != c {
			b.refusedClaim(internal, c.guard) // refused
		}
	}()
	// Behind this edge's other claims of the session (sessionLocks).
	unlock, err := b.claiming.lock(ctx, internal)
	if err != nil {
		cancel()
		finishSpan(claimSpan, err)
		b.logger.Warn("session busy with another claim here until the connect timeout; refused", "client_id", internal)
		return refuse(packets.ErrServerUnavailable, "claim_busy")
	}
	defer unlock()
	// Settled when this hook returns: the session is held here, or the
	// connection refused (a failed takeover listed as unfinished).
	defer b.claimMarks.end(b.claimMarks.begin())
	grant, err := b.cluster.Ownership.Claim(claimCtx, id.Tenant, external)
	epoch, previous := grant.Epoch, grant.Previous
	finishSpan(claimSpan, err)
	if err == nil {
		b.claimMarks.observe(epoch)
	}
	if errors.Is(err, ErrClaimSuperseded) {
		cancel()
		b.logger.Info("session claimed again elsewhere while connecting; refused", "tenant", id.Tenant, "error", err)
		return refuse(packets.ErrServerUnavailable, "claim_superseded")
	}
	if err != nil {
		cancel()
		b.logger.Error("session claim failed", "tenant", id.Tenant, "error", err)
		return refuse(packets.ErrServerUnavailable, "claim_failed")
	}
	if b.logger.Enabled(ctx, slog.LevelDebug) {
		b.logger.Debug("session claimed for a connection", "client_id", internal, "epoch", epoch, "previous", previous)
	}
	if c.guard.granted(epoch) {
		// Another edge claimed the session since, for a newer connection.
		cancel()
		b.logger.Info("session claimed again elsewhere while connecting; refused", "tenant", id.Tenant)
		return refuse(packets.ErrServerUnavailable, "claim_superseded")
	}
	moved := false
	if previous == b.cfg.EdgeID {
		previous = b.unfinishedTakeover(internal, previous)
		if previous == b.cfg.EdgeID && grant.TakenFrom != "" && !b.holdsSince(internal, grant.PreviousEpoch) {
			// This edge owns the session but holds no copy under its
			// latest claim: the answer to that claim was lost (a leader
			// change), so that CONNECT was refused and the takeover never
			// ran. The session, and maybe a connection, are still where it
			// was taken from. A copy here under an older claim does not
			// say otherwise: another edge may have claimed the session
			// between the two, its takeover finding no copy here yet (the
			// copy came after, from a CONNECT of this edge that the newer
			// claim superseded, and stayed, fenced).
			previous = grant.TakenFrom
		}
	}
	if previous != "" && previous != b.cfg.EdgeID && grant.SourceGone && (previous == grant.Previous || previous == grant.TakenFrom) {
		// Its lease expired or it left: it fenced itself and closed its
		// connections, and what it stored is read from the store below.
		b.logger.Info("previous owner is gone; nothing to take over", "previous", previous)
		b.setUnfinished(internal, unfinishedTakeover{})
	} else if previous != "" && previous != b.cfg.EdgeID && b.cluster.Takeover != nil {
		if moved, previous, err = b.takeOverFrom(ctx, previous, sc, external, epoch, pk.Connect.Clean, false); err != nil {
			cancel()
			// While a dead edge's lease runs, every client that was on it
			// is refused here, each retrying: one line a second, with how
			// many it stands for (keel_edge_connects_total counts them all).
			if n := b.takeoverFails.Add(1); b.takeoverFailLog.Allow(time.Second) {
				b.logger.Error("session takeover failed; connection refused", "tenant", id.Tenant, "previous", previous, "error", err,
					"refused_since_last_line", n-b.takeoverFailsLogged.Swap(n))
			}
			settled := false
			if errors.Is(err, errTakeoverIncomplete) && !pk.Connect.Clean {
				_, settled = b.resumeOwned(sc, external, epoch, previous)
			}
			if !settled {
				b.setUnfinished(internal, unfinishedTakeover{previous: previous, epoch: epoch, scope: sc, clientID: external})
			}
			return refuse(packets.ErrServerUnavailable, "takeover_failed")
		}
		b.setUnfinished(internal, unfinishedTakeover{})
	}
	if b.store != nil && b.store.Shared() {
		if err := b.claimShared(ctx, sc, external, epoch, previous, pk.Connect.Clean, persistent(cl) || c.will.Load() != nil, moved, false); err != nil {
			cancel()
			b.logger.Error("session not resumed from the store", "tenant", id.Tenant, "previous", previous, "error", err)
			return refuse(packets.ErrServerUnavailable, "store_failed")
		}
	}
	cancel()
	c.epoch = epoch
	cl.ID = internal
	if w := c.will.Load(); w != nil {
		w.Origin = cl.ID
	}
	if !id.ExpiresAt.IsZero() {
		// A client whose token expires is disconnected then (0x87).
		c.expiry = time.AfterFunc(time.Until(id.ExpiresAt), func() {
			b.logger.Info("credentials expired; disconnecting", "client_id", cl.ID)
			b.m.disconnects.WithLabelValues("credentials_expired").Inc()
			_ = b.disconnect(cl, packets.ErrNotAuthorized)
		})
	}
	b.claimTaken(internal, epoch)
	// In claim order (the claim lock is held): established after the
	// client's CONNECTs claimed before this one.
	c.establishAfter, c.establishDone = b.establishing.enter(internal)
	b.conns.Store(cl, c)
	b.aclSeen(c, aclGen)
	return nil
}

func (h *hook) OnConnectAuthenticate(cl *mqtt.Client, _ packets.Packet) bool {
	return h.b.conn(cl) != nil
}

// OnSessionEstablish runs before mochi takes over an existing session of the
// same client ID. A clean start ends the old session here.
func (h *hook) OnSessionEstablish(cl *mqtt.Client, pk packets.Packet) {
	b := h.b
	if at := b.atSessionEstablish.Load(); at != nil {
		(*at)()
	}
	c := b.conn(cl)
	if c != nil && c.establishAfter != nil {
		// The CONNECT of the client claimed before this one is bound or
		// gone first (establishOrder).
		t := time.NewTimer(b.cfg.ConnectTimeout)
		select {
		case <-c.establishAfter:
		case <-t.C:
			b.logger.Warn("the client's previous connection still being established; going on", "client_id", cl.ID)
		case <-b.stopped.Done():
		}
		t.Stop()
	}
	if c != nil {
		// Before this claim ends or takes on the copy: an older CONNECT of
		// the client still to store its record (it waits for the record
		// lock) finds this one came, although the copy, ended by a Clean
		// Start, no longer says so (persistSession).
		defer b.establishedClaims.enter(cl.ID, c.epoch)()
	}
	// From an expiry or a Clean Start ending the session here to the will
	// that end sends, the stop waits (stopGate). Once the edge stops, the
	// will could not go out while the end removed the stored record that
	// keeps it: the CONNECT is refused instead, and ends nothing.
	b.stopGate.RLock()
	if b.willsHeldBack() {
		b.stopGate.RUnlock()
		b.logger.Info("edge stopping; connection refused", "client_id", cl.ID)
		if c != nil {
			// Its end leaves the session as it is (OnDisconnect).
			c.superseded.Store(true)
		}
		cl.Stop(errStopping)
		return
	}
	if old := b.expiredOffline(cl.ID, time.Now()); old != nil && old != cl {
		// The session expired before this CONNECT, whether or not mochi's
		// expiry tick has come since: it ends now, its will (if still
		// waiting) goes out, and the CONNECT starts a new session
		// (§3.1.2.11.2, [MQTT-3.2.2-3]).
		b.expireOffline(old)
	}
	// Without Clean Start the session goes on in this connection, unless
	// its live connection is one it does not outlive: the takeover closes
	// that, so the session ends, and this connection starts a new one
	// (Session Present 0 [MQTT-3.2.2-3], no subscriptions carried over;
	// 3.1.1 [MQTT-3.1.2-6]) while the old connection's will goes out at
	// once ([MQTT-3.1.2-8] "or the Session ends", §3.1.4). Decided once,
	// by the session (takeOver), and mochi is told the same (SessionFate).
	var endsWith *mqtt.Client
	var held *session
	ends := pk.Connect.Clean
	if !pk.Connect.Clean && c != nil {
		if held = b.session(cl.ID); held != nil {
			// Before the old connection is detached: one whose CONNACK is
			// out and whose bind is to come (it may come at any point from
			// here, detached or not) is refused under this claim's epoch.
			ends, endsWith = held.takeOver(cl, c.epoch)
		}
	}
	switch {
	case ends && held != nil:
		cl.State.SessionFate = mqtt.SessionEnded
		// The copy decided on; one put in its place since is not this
		// CONNECT's to end.
		b.endSessionRoutes(context.Background(), cl.ID, endWhich{only: held})
	case ends:
		cl.State.SessionFate = mqtt.SessionEnded
		b.endSession(cl.ID, nil)
	case held != nil:
		cl.State.SessionFate = mqtt.SessionResumed
	default:
		// No copy here goes on: mochi's own record decides, as released
		// (an ended 3.1.1 clean session it has not yet forgotten is not
		// resumed).
		cl.State.SessionFate = mqtt.SessionFateMochi
	}
	// Once the session's fate is recorded in its copy (takeOver raised its
	// epoch, or the copy ended): an earlier connection of the client whose
	// end decides its will from here on finds it there (willAtEnd), and a
	// will scheduled before is cancelled here, published at once if the
	// session ended. Cancelled first, a will scheduled in between by a
	// connection that ended meanwhile would stay, and go out after its
	// delay although the session went on [MQTT-3.1.3-9].
	b.cancelWill(cl.ID, ends)
	b.stopGate.RUnlock()
	if endsWith != nil {
		if oc := b.conn(endsWith); oc != nil {
			oc.sessionEnds.Store(true) // its will goes out at once
		}
	}
	if old, ok := b.server.Clients.Get(cl.ID); ok && old != cl {
		if oc := b.conn(old); oc != nil {
			if pk.Connect.Clean {
				oc.sessionEnds.Store(true) // its will goes out at once
			} else if !ends {
				// The session goes on in the new connection, so the old
				// connection's will is never sent ([MQTT-3.1.3-9]).
				oc.will.Store(nil)
			}
		}
		if !ends {
			if s := b.session(cl.ID); s != nil {
				s.detach(old)
			}
		}
	}
	if c != nil {
		if err := b.persistSession(cl, c); err != nil {
			// The client is told nothing yet; it reconnects and tries again.
			if errors.Is(err, errRecordSuperseded) {
				b.logger.Info("session taken on by a newer connection while connecting; closing", "client_id", cl.ID)
			} else {
				b.logger.Error("session not stored; closing", "client_id", cl.ID, "error", err)
			}
			cl.Stop(err)
		}
	}
}

// OnSessionEstablished binds the connection to its session.
func (h *hook) OnSessionEstablished(cl *mqtt.Client, pk packets.Packet) {
	b := h.b
	c := b.conn(cl)
	if c == nil {
		return
	}
	c.established.Store(true)
	if !b.bindEstablished(cl, c) {
		return
	}
	if cl.State.SessionFate == mqtt.SessionResumed {
		b.mirrorSession(cl)
	}
	// A resumed session keeps only what its client may still subscribe to.
	// Not under the guard: the route removals wait on the router, and a
	// takeover from another edge that waits for the guard holds the
	// guards' lock meanwhile, which every CONNECT here takes (supersede).
	b.recheckSubscriptions(cl, c)
	b.m.connects.WithLabelValues("ok").Inc()
	if b.draining.Load() {
		// Admitted as a drain began (past its check in OnConnect): the
		// drain's disconnects may have missed it, mochi listing its client
		// only now, and it would hold the drain's wait for every session
		// to go offline. It goes as the others did, and its session with
		// theirs.
		ref := ""
		if p := b.drainReference.Load(); p != nil {
			ref = *p
		}
		go b.disconnectDraining(cl, ref)
	}
}

// bindEstablished binds the connection to its session under its CONNECT
// guard, and reports whether it did: a takeover from another edge either
// marked the guard before (the connection goes now) or finds the session
// bound after.
func (b *Broker) bindEstablished(cl *mqtt.Client, c *conn) bool {
	g := c.guard
	g.mu.Lock()
	defer func() {
		g.mu.Unlock()
		// After the unlock: supersede takes the guards' lock, then g's.
		b.claimDone(cl.ID, g, c.epoch)
		c.releaseEstablishing()
	}()
	if g.supersededBy > c.epoch {
		b.dropSuperseded(cl, c, "session taken over by another edge while connecting; disconnecting")
		return false
	}
	b.sessMu.Lock()
	s := b.sessions[cl.ID]
	if s == nil {
		s = newSession(b, cl.ID, c.scope)
		// Under the connection's claim from the start: until the bind
		// stamps it, an older claim's custody, import or end would find
		// the copy at epoch 0 and take it as its own.
		s.epoch = c.epoch
		b.sessions[cl.ID] = s
	}
	b.sessMu.Unlock()
	if at := b.atBind.Load(); at != nil {
		(*at)(cl.ID)
	}
	c.sess.Store(s)
	window := int(b.cfg.MaxInflight)
	if cl.Properties.ProtocolVersion == 5 && cl.Properties.Props.ReceiveMaximum > 0 {
		window = min(window, int(cl.Properties.Props.ReceiveMaximum))
	}
	// mochi's send quota only gates its own queued sends, which the edge
	// never uses. Held at zero it also keeps mochi from calling
	// Inflight.NextImmediate after every packet, which takes the in-flight
	// read lock twice and deadlocks against the edge's writer adding a
	// message between the two (mochi v2.7.9, inflight.go NextImmediate).
	cl.State.Inflight.ResetSendQuota(0)
	// An older connection of the client bound after this one's CONNECT
	// took the session (its bind came late) gives its in-flight messages
	// back first, as a takeover's detach does: replaced, its writer would
	// keep draining the session's queue into a closed connection.
	s.mu.Lock()
	prev := s.client
	older := prev != nil && prev != cl && s.epoch <= c.epoch
	s.mu.Unlock()
	if older {
		s.detach(prev)
	}
	if !s.bind(cl, c.rules.Load(), persistent(cl), window, c.epoch) {
		if cl.Closed() && !cl.IsTakenOver() {
			// Gone by itself before its bind: its OnDisconnect ends it
			// as any connection's end, will included.
			return false
		}
		// Its CONNACK went out before this hook ran, and meanwhile a newer
		// CONNECT of the client, bound already, took the session over, or
		// the copy ended here for a newer holder (fenced, or its edge's
		// lease lapsed): bound now, the session would stay on a closed
		// connection, or the connection on a copy the edge no longer holds.
		why := "session taken over while connecting; disconnecting"
		s.mu.Lock()
		if s.closed {
			why = "session given up here for a newer holder while connecting; disconnecting"
		}
		s.mu.Unlock()
		b.dropSuperseded(cl, c, why)
		return false
	}
	s.mu.Lock()
	s.record = c.record
	s.mu.Unlock()
	return true
}

// dropSuperseded ends a connection whose session a newer claim took before
// the connection was bound to it.
func (b *Broker) dropSuperseded(cl *mqtt.Client, c *conn, why string) {
	b.logger.Info(why, "client_id", cl.ID)
	b.m.connects.WithLabelValues("claim_superseded").Inc()
	c.will.Store(nil) // the session goes on in the newer connection ([MQTT-3.1.3-9])
	c.superseded.Store(true)
	go func() { _ = b.disconnect(cl, packets.ErrSessionTakenOver) }()
}

func persistent(cl *mqtt.Client) bool {
	if cl.Properties.ProtocolVersion == 5 {
		return cl.Properties.Props.SessionExpiryInterval > 0
	}
	return !cl.Properties.Clean
}

// OnDisconnect publishes the will when the connection ended without a normal
// DISCONNECT and ends a session that does not outlive its connection.
func (h *hook) OnDisconnect(cl *mqtt.Client, err error, expire bool) {
	b := h.b
	b.disconnecting.Add(1)
	defer b.disconnecting.Add(-1)
	v, ok := b.conns.LoadAndDelete(cl)
	if !ok {
		// Refused before the session was established, or a client mochi
		// restores from the store as it starts (loadClients).
		if at, ok := b.restoredEnds[cl.ID]; ok {
			cl.SetStoppedAt(at)
		}
		return
	}
	c := v.(*conn)
	// A connection that ended before it was bound (its CONNACK could not be
	// written) leaves no claim in flight: relays would wait on it, nor a
	// CONNECT of the client waiting to be established.
	b.claimDone(cl.ID, c.guard, c.epoch)
	c.releaseEstablishing()
	if c.expiry != nil {
		c.expiry.Stop()
	}
	reason := "client"
	switch {
	case cl.IsTakenOver():
		reason = "taken_over"
	case errors.Is(err, packets.ErrServerShuttingDown) || errors.Is(cl.StopCause(), packets.ErrServerShuttingDown):
		reason = "shutdown"
	case errors.Is(err, packets.CodeDisconnectWillMessage) || errors.As(err, new(mqtt.ClientDisconnectError)):
		// The client's DISCONNECT with a Reason Code other than 0x00: it
		// ended the connection, and its will goes out ([MQTT-3.1.2-8]).
	case err != nil:
		reason = "error"
		if why, ok := unreadable(err); ok {
			// mochi could not read the packet (the edge's own refusals are
			// counted where they are made); an MQTT 5 client was told why.
			reason = "protocol_error"
			b.m.packetErrors.WithLabelValues(why).Inc()
			b.logger.Info("unreadable packet; connection closed", "client_id", cl.ID, "remote", cl.Net.Remote, "reason", err)
		}
	}
	b.m.disconnects.WithLabelValues(reason).Inc()
	if c.superseded.Load() {
		// It never held the session: another edge does, or the stop
		// refused it and the session stays for its next holder.
		return
	}
	if !c.established.Load() {
		// Its CONNACK was never written (the client gave up, or the
		// session was not stored). Its will stays with the stored record,
		// which the session's next claim reads; published here as well,
		// it would go out twice.
		if expire && !cl.IsTakenOver() {
			b.endAbandoned(cl, c)
		}
		return
	}
	s := b.session(cl.ID)
	if s != nil {
		s.ending.Add(1)
		defer s.ending.Add(-1)
		s.unbind(cl)
	}
	// A normal DISCONNECT (0x00) discards the will ([MQTT-3.1.2-10]); any other
	// end publishes it (a DISCONNECT with another Reason Code included,
	// [MQTT-3.1.2-8]), unless the edge holds wills back (willsHeldBack:
	// it stops, and does not drain). mochi reports
	// no error both for a normal DISCONNECT and for a connection the server
	// stopped between two packets (DisconnectClient, Stop): the stop cause
	// tells them apart.
	normal := err == nil && errors.Is(cl.StopCause(), packets.CodeDisconnect)
	if normal {
		b.storeDisconnectExpiry(cl, c, s)
	}
	if at := b.atWill.Load(); at != nil {
		(*at)(cl)
	}
	will, stopping := c.will.Load(), b.stopping.Load()
	// On a single-node edge a will that has not gone out when the edge
	// stops is kept in the store, for the edge to publish when it starts
	// again: its stop closed the connection (or the will's delay ran on
	// past it), and that is no normal DISCONNECT [MQTT-3.1.2-8]. An edge
	// of a cluster leaves its sessions to custodian edges.
	// The record is made only if the edge stops first: most wills go out,
	// or are cancelled, long before.
	var keep func()
	heldBack := false // published at once, and held back by a stop that began meanwhile
	if will != nil && !normal && b.store != nil && b.singleNode() {
		ended := time.Now()
		keep = func() { b.keepWillForRestart(cl.ID, c.epoch, keptWill(cl, c, will, ended)) }
	}
	// A drain closes connections as any server does that closes one
	// without the client's normal DISCONNECT, and their wills follow
	// [MQTT-3.1.2-8] (willsHeldBack): each waits for its delay, and goes
	// with its session to the custodian, which sends it when the delay has
	// passed unless the client came back first (TakeOver carries it); one
	// with no delay, or whose session ends with the connection, goes out
	// from here at once. A client that reconnects within its will's delay
	// (what MQTT 5's delay is for) sends no will through a rolling restart.
	// An edge of a cluster that stops can send no will: one its stop held
	// back stays in the session's stored record, with the record (see
	// forCustody), for the custodian that adopts the session to send, as
	// when an edge dies. Taken out, nobody would send it.
	heldBackNow := b.willsHeldBack()
	custody := will != nil && !normal && c.record != nil && b.store.Shared() // a custodian could send it
	forCustody := custody && heldBackNow
	if will != nil && !normal && !heldBackNow {
		delay := c.willDelay
		if expire || c.sessionEnds.Load() {
			delay = 0 // the session ends now, and the will with it ([MQTT-3.1.3-9])
		} else if cl.Properties.ProtocolVersion == 5 {
			// Published when the delay has passed or the session ends,
			// whichever comes first ([MQTT-3.1.3-9]): the session ends
			// when its expiry interval (as the DISCONNECT left it) has.
			delay = min(delay, cl.Properties.Props.SessionExpiryInterval)
		}
		heldBack = b.willAtEnd(cl.ID, c, will, delay, keep)
		// A stop that began meanwhile kept it from going out: it stays
		// in the stored record too.
		forCustody = custody && heldBack
	} else if c.record != nil && !forCustody {
		// A normal DISCONNECT: the will never goes out, so no custodian
		// may publish it either. (A single-node edge keeps one its stop
		// held back for its restart: keep.)
		b.dropStoredWill(cl.ID, c.record)
	}
	if c.sess.Load().after(c.epoch) == sessionResumed {
		// A newer CONNECT here took the session on, and mochi's
		// inheritClientSession for it is still to come or done: mochi's
		// records of this connection (its Clients entry, subscriptions,
		// in-flight state) are that connection's to inherit, not this
		// end's to clean up (expire: a DISCONNECT that set Session Expiry
		// 0 after the takeover), or the CONNACK would say Session Present
		// 0 for the session resumed [MQTT-3.2.2-2].
		cl.MarkTakenOver()
	}
	if expire && !cl.IsTakenOver() {
		// Not a session a newer CONNECT took over before this connection's
		// end (a DISCONNECT setting Session Expiry 0 read after its
		// takeOver): that CONNECT resumes it under its own claim, which
		// ending it here would release.
		b.endSessionRoutes(context.Background(), cl.ID, endWhich{cl: cl, upTo: c.epoch, forCustody: forCustody})
	}
	if keep != nil && (stopping || heldBack) {
		// After the session's end, which removes its record.
		keep()
	}
}

// endAbandoned ends the copy of a session that expires with the
// connection, claimed for it but never bound to it: nothing else would
// (mochi forgets the client). A copy is bound with its claim's epoch, so
// one under a later epoch is a newer claim's; a newer claim still on its
// way to binding (behind the claim lock, or past it with its guard up) is
// left its copy too, and if it is refused the copy ends then
// (deferAbandoned).
func (b *Broker) endAbandoned(cl *mqtt.Client, c *conn) {
	ctx, cancel := context.WithTimeout(b.stopped, b.cfg.ConnectTimeout)
	defer cancel()
	unlock, err := b.claiming.lock(ctx, cl.ID)
	if err != nil {
		return
	}
	defer unlock()
	s := b.session(cl.ID)
	if s == nil {
		return
	}
	if b.deferAbandoned(cl, c) {
		return
	}
	s.mu.Lock()
	// A copy being handed to another edge goes on there.
	mine := s.client == nil && s.epoch <= c.epoch && s.moving == nil
	if mine {
		// Ended under this connection's claim, the one the coordinator
		// holds, which the end gives back.
		s.epoch = c.epoch
	}
	s.mu.Unlock()
	if mine {
		// Not waiting on the router under the claim lock: the client that
		// gave up is likely connecting again.
		b.endSessionRoutes(cancelled, cl.ID, endWhich{cl: cl, only: s})
	}
}

// unreadable reports whether err ended a connection because mochi could not
// read a packet (malformed, too large, a protocol error in its encoding),
// and names the cause for the packet error metric. The edge's own refusals
// (rejection) are not: they are counted where they are made.
func unreadable(err error) (string, bool) {
	var r rejection
	var code packets.Code
	if errors.As(err, &r) || !errors.As(err, &code) || code.Code < packets.ErrUnspecifiedError.Code {
		return "", false
	}
	switch code.Code {
	case packets.ErrPacketTooLarge.Code:
		return "packet_too_large", true
	case packets.ErrMalformedPacket.Code:
		return "malformed_packet", true
	case packets.ErrProtocolViolation.Code:
		return "protocol_error", true
	}
	return "unreadable_packet", true
}

// storeDisconnectExpiry writes the session expiry interval an MQTT 5
// DISCONNECT changed [MQTT-3.14.2-2] into the stored session record, so
// that a custodian or a restart expires the session when the client last
// asked, not when it said at CONNECT. A record that holds a will is
// changed in place, and written when the will is dropped, right after.
func (b *Broker) storeDisconnectExpiry(cl *mqtt.Client, c *conn, s *session) {
	e := cl.Properties.Props.SessionExpiryInterval
	if c.stored == nil || c.stored.ExpiryInterval == e || e == 0 || s == nil {
		return // unchanged, or the session ends with the connection
	}
	if c.record != nil {
		s.mu.Lock()
		if s.record == c.record {
			c.record.ExpiryInterval = e
		}
		s.mu.Unlock()
		return
	}
	rec := *c.stored
	rec.ExpiryInterval = e
	ctx, cancel := context.WithTimeout(context.Background(), storeTimeout)
	defer cancel()
	unlock, err := b.recordWrites.lock(ctx, cl.ID)
	if err != nil {
		b.logger.Warn("session expiry of the DISCONNECT not stored; the CONNECT's stays", "client_id", cl.ID, "error", err)
		return
	}
	defer unlock()
	if b.session(cl.ID) != s || s.claimedAfter(c.epoch) {
		// A newer connection took the session on (the DISCONNECT was read
		// after its takeOver): the record stored, or on its way, is that
		// connection's, with its own expiry.
		return
	}
	if err := b.store.PutSession(ctx, rec); err != nil {
		b.logger.Warn("session expiry of the DISCONNECT not stored; the CONNECT's stays", "client_id", cl.ID, "error", err)
	}
}

// OnClientExpired ends a session mochi found expired on its tick, unless
// a CONNECT of its client or a takeover ended it first.
//
// A CONNECT of the client between its claim and its bind decides itself
// (OnSessionEstablish checks the expiry): one that found the session not
// expired has raised the session's epoch to its claim's and stored its
// record, and ended here the session would take them along (the record
// deleted, the live connection's claim released).
//
// A single-node edge that stops (not one drained through its API, which
// goes on serving) ends no session on its tick. Ended here, the session
// would take its stored record along, and with it the will its end
// publishes, which the stop keeps for the restart (errStopping). Started
// again, the edge finds the session expired, its end dated from its
// connection's, and ends it then, will included.
func (h *hook) OnClientExpired(cl *mqtt.Client) {
	if h.b.stopping.Load() && !h.b.draining.Load() && h.b.singleNode() {
		return
	}
	done, ok := h.b.establishing.enterIdle(cl.ID)
	if !ok {
		return // a CONNECT is being established: its check decides
	}
	defer done()
	h.b.expireOffline(cl)
}

// OnPacketRead vets and rewrites a packet, in place, before mochi
// processes it. A packet it refuses ends the connection, unprocessed:
// mochi ignores any error from this hook but ErrRejectPacket, so every
// refusal is returned as a rejection.
func (h *hook) OnPacketRead(cl *mqtt.Client, pk *packets.Packet) error {
	if pk.FixedHeader.Type == packets.Disconnect {
		flushHeldOf(cl) // the connection closes with the DISCONNECT
	}
	var err error
	if pk.FixedHeader.Type == packets.Connect && h.b.conn(cl) == nil {
		if kc, ok := cl.Net.Conn.(*keepaliveConn); ok {
			kc.connectRead.Store(true)
		}
		err = h.b.vetConnect(cl, pk)
	} else {
		err = h.vetPacket(cl, pk)
	}
	if err != nil {
		// mochi may close the connection for it without a write.
		flushHeldOf(cl)
		return rejection{err}
	}
	return nil
}

// rejection is a refusal from OnPacketRead in the form mochi acts on: it is
// packets.ErrRejectPacket to errors.Is, and wraps why.
type rejection struct{ err error }

func (r rejection) Error() string        { return r.err.Error() }
func (r rejection) Unwrap() error        { return r.err }
func (r rejection) Is(target error) bool { return target == packets.ErrRejectPacket }

// vetPacket validates and rewrites every topic and filter a client sends
// into the internal, tenant-scoped form, before mochi looks at it.
func (h *hook) vetPacket(cl *mqtt.Client, pk *packets.Packet) error {
	b := h.b
	c := b.conn(cl)
	if c == nil {
		return nil // CONNECT; handled in OnConnect
	}
	switch pk.FixedHeader.Type {
	case packets.Publish:
		if pk.FixedHeader.Retain && b.cfg.RetainDisabled && cl.Properties.ProtocolVersion == 5 {
			// Told Retain Available 0 in its CONNACK ([MQTT-3.2.2-14]): 0x9A
			// (§3.3.1.3). A 3.1.1 client was told nothing: its message goes,
			// not retained.
			b.m.packetErrors.WithLabelValues("retain_not_supported").Inc()
			return b.refuse(cl, packets.ErrRetainNotSupported)
		}
		if pk.TopicName == "" && pk.Properties.TopicAliasFlag && pk.Properties.TopicAlias > 0 &&
			pk.Properties.TopicAlias <= b.cfg.TopicAliasMaximum {
			// Resolve the alias here: mochi checks the ACL on the topic name
			// before it resolves aliases itself. The stored name is internal.
			resolved := cl.State.TopicAliases.Inbound.Set(pk.Properties.TopicAlias, "")
			if resolved == "" {
				b.m.packetErrors.WithLabelValues("unknown_topic_alias").Inc()
				return b.refuse(cl, packets.ErrTopicAliasInvalid) // §3.3.2.3.4: an unmapped alias is a protocol error
			}
			pk.TopicName = resolved
			pk.Properties.TopicAliasFlag, pk.Properties.TopicAlias = false, 0
		} else if pk.TopicName != "" {
			if err := topic.ValidateName(pk.TopicName, b.limits); err != nil {
				b.m.packetErrors.WithLabelValues("invalid_topic").Inc()
				b.logger.Info("invalid topic name", "client_id", cl.ID, "error", err)
				return b.refuse(cl, packets.ErrTopicNameInvalid)
			}
			pk.TopicName = c.scope.Topic(pk.TopicName)
		}
		if c.limiter != nil {
			if wait := c.limiter.take(time.Now()); wait > 0 {
				b.m.throttledPubs.Inc()
				flushHeldOf(cl)  // the acknowledgements already due do not wait too
				time.Sleep(wait) // hold this client's reading: TCP pushes back
			}
		}
	case packets.Subscribe:
		filters := make([]packets.Subscription, len(pk.Filters))
		copy(filters, pk.Filters)
		c.refused = c.refused[:0]
		for i := range filters {
			f := &filters[i]
			code := byte(0)
			if err := b.checkFilter(f.Filter); err != nil {
				code = packets.ErrTopicFilterInvalid.Code
				if errors.Is(err, errSharedDisabled) {
					code = packets.ErrSharedSubscriptionsNotSupported.Code
				}
				b.m.packetErrors.WithLabelValues("invalid_filter").Inc()
				b.logger.Debug("topic filter refused", "client_id", cl.ID, "error", err)
				f.Filter = "" // mochi refuses an empty filter; OnSubscribed sets the precise code
			} else {
				var shared bool
				f.Filter, shared = c.scope.Filter(f.Filter)
				if shared && f.NoLocal {
					b.m.packetErrors.WithLabelValues("shared_no_local").Inc()
					return b.refuse(cl, packets.ErrProtocolViolationInvalidSharedNoLocal) // [MQTT-3.8.3-4]
				}
			}
			c.refused = append(c.refused, code)
		}
		pk.Filters = filters
	case packets.Pubrec:
		// [MQTT-4.3.3]: the PUBREC->PUBREL transition is durable before the
		// PUBREL leaves (mochi sends it right after this hook).
		if s := b.session(cl.ID); s != nil && s.durable && b.store != nil && pk.ReasonCode < 0x80 {
			ctx, cancel := context.WithTimeout(context.Background(), storeTimeout)
			err := b.store.Pubrel(ctx, cl.ID, pk.PacketID)
			cancel()
			if err != nil {
				b.logger.Error("pubrel state not stored; closing", "client_id", cl.ID, "error", err)
				return err
			}
		}
	case packets.Pubrel:
		if s := b.session(cl.ID); s != nil {
			s.pubrelMoved(cl, pk.PacketID)
		}
		// An inbound QoS 2 flow completes: its PUBREC state goes durably
		// before the PUBCOMP that mochi sends right after this hook. The
		// client may then reuse the packet ID at once; a record that
		// survived a crash or a store failover would make that new PUBLISH
		// look like a resend of this one, answered and never delivered.
		if s := b.session(cl.ID); s != nil && s.wasDurable() && b.store != nil {
			ctx, cancel := context.WithTimeout(context.Background(), storeTimeout)
			err := b.store.DeleteIncoming(ctx, cl.ID, pk.PacketID)
			cancel()
			if err != nil {
				b.logger.Error("PUBREC state not removed; closing without PUBCOMP", "client_id", cl.ID, "packet_id", pk.PacketID, "error", err)
				return err
			}
		}
	case packets.Disconnect:
		if pk.Properties.SessionExpiryIntervalFlag && pk.Properties.SessionExpiryInterval == 0 {
			// The session ends with this connection now [MQTT-3.14.2-2]:
			// a takeover before its end ends the session too.
			if s := b.session(cl.ID); s != nil {
				s.disconnecting(cl, c.epoch)
			}
		}
	case packets.Unsubscribe:
		filters := make([]packets.Subscription, len(pk.Filters))
		copy(filters, pk.Filters)
		for i := range filters {
			filters[i].Filter, _ = c.scope.Filter(filters[i].Filter)
		}
		pk.Filters = filters
	}
	return nil
}

func (b *Broker) checkFilter(f string) error {
	if err := topic.ValidateFilter(f, b.limits); err != nil {
		return err
	}
	if _, _, shared, err := topic.ParseShare(f); err != nil {
		return err
	} else if shared && b.cfg.SharedDisabled {
		return errSharedDisabled
	}
	return nil
}

var errSharedDisabled = errors.New("shared subscriptions are disabled")

// refuse ends a connection for a protocol error, with a DISCONNECT carrying
// the reason for MQTT 5 clients.
func (b *Broker) refuse(cl *mqtt.Client, code packets.Code) error {
	if cl.Properties.ProtocolVersion == 5 {
		_ = b.disconnect(cl, code)
	}
	return code
}

// OnPacketEncode maps names back to the client's view on packets mochi
// writes itself (in-flight resends, CONNACK).
func (h *hook) OnPacketEncode(cl *mqtt.Client, pk *packets.Packet) {
	switch pk.FixedHeader.Type {
	case packets.Publish:
		if pk.TopicName != "" {
			if _, ext, ok := tenancy.TenantOfTopic(pk.TopicName); ok {
				pk.TopicName = ext
			}
		}
	case packets.Connack:
		if cl.Properties.ProtocolVersion == 3 {
			// MQTT 3.1 has no Session Present flag: the byte that holds it
			// since 3.1.1 is reserved there and not used (MQTT V3.1 §3.2).
			pk.SessionPresent = false
		}
		if cl.Properties.ProtocolVersion < 5 {
			pk.ReasonCode = connackCode(cl, packets.Code{Code: pk.ReasonCode}).Code
			break
		}
		if pk.ReasonCode == packets.CodeSuccess.Code {
			// Announce the limits the edge enforces ([MQTT-3.2.2-17],
			// §3.2.2.3.6): mochi's CONNACK leaves them out.
			pk.Properties.TopicAliasMaximum = h.b.cfg.TopicAliasMaximum
			pk.Properties.MaximumPacketSize = h.b.cfg.MaxPacketSize
			// An absent property says available (§3.2.2.3.5, §3.2.2.3.13).
			if h.b.cfg.RetainDisabled {
				pk.Properties.RetainAvailable, pk.Properties.RetainAvailableFlag = 0, true
			}
			if h.b.cfg.SharedDisabled {
				pk.Properties.SharedSubAvailable, pk.Properties.SharedSubAvailableFlag = 0, true
			}
		}
	case packets.Pubrec:
		// mochi answers a QoS 2 PUBLISH resent before its PUBREL with 0x91
		// (packet identifier in use). The spec wants the same PUBREC again,
		// successful, and no second delivery (§4.3.3, [MQTT-4.3.3-9]): a
		// client would take 0x91 as the message refused.
		if pk.ReasonCode == packets.ErrPacketIdentifierInUse.Code {
			pk.ReasonCode = packets.CodeSuccess.Code
			pk.Properties.ReasonString = ""
		}
	case packets.Suback:
		if pk.Properties.ReasonString == "" {
			for _, code := range pk.ReasonCodes {
				if code >= packets.ErrUnspecifiedError.Code {
					pk.Properties.ReasonString = "one or more topic filters refused; see the reason code of each"
					break
				}
			}
		}
	}
}

// connackCode maps a CONNACK reason to the client's protocol: MQTT 3.1.1
// has return codes 1 to 5 only ([MQTT-3.2.2-4]).
func connackCode(cl *mqtt.Client, code packets.Code) packets.Code {
	if cl.Properties.ProtocolVersion >= 5 || code.Code < 0x80 {
		return code
	}
	switch code.Code {
	case packets.ErrUnsupportedProtocolVersion.Code:
		return packets.Err3UnsupportedProtocolVersion
	case packets.ErrClientIdentifierNotValid.Code,
		// mochi refuses an empty client ID with clean session 0 as 0x80
		// (unspecified); 3.1.1 says identifier rejected ([MQTT-3.1.3-8]).
		packets.ErrUnspecifiedError.Code:
		return packets.Err3ClientIdentifierNotValid
	case packets.ErrBadUsernameOrPassword.Code, packets.ErrMalformedUsername.Code, packets.ErrMalformedPassword.Code:
		return packets.Code{Code: 0x04, Reason: "bad user name or password"}
	case packets.ErrNotAuthorized.Code, packets.ErrBanned.Code:
		return packets.Err3NotAuthorized
	}
	return packets.Err3ServerUnavailable
}

// OnACLCheck applies the connection's ACL to publishes and subscriptions.
func (h *hook) OnACLCheck(cl *mqtt.Client, internal string, write bool) bool {
	c := h.b.conn(cl)
	if c == nil {
		return false
	}
	if write {
		ext, ok := c.scope.ExternalTopic(internal)
		if !ok || strings.HasPrefix(ext, "$SYS") {
			return false // clients never publish into $SYS
		}
		rules := c.rules.Load()
		if rules == nil {
			return true
		}
		if c.pubACLFor != rules {
			c.pubACL, c.pubACLFor = nil, rules // an ACL change made the cache stale
		}
		if allowed, hit := c.pubACL[ext]; hit {
			return allowed
		}
		allowed := rules.CanPublish(ext)
		if c.pubACL == nil || len(c.pubACL) >= 256 {
			c.pubACL = make(map[string]bool, 16)
		}
		c.pubACL[ext] = allowed
		return allowed
	}
	ext, ok := c.scope.ExternalFilter(internal)
	if !ok {
		return false
	}
	if _, inner, shared, _ := topic.ParseShare(ext); shared {
		ext = inner
	}
	return c.rules.Load().CanSubscribe(ext)
}

// OnSubscribe records which filters already existed, for retain handling 1.
func (h *hook) OnSubscribe(cl *mqtt.Client, pk packets.Packet) packets.Packet {
	c := h.b.conn(cl)
	if c == nil {
		return pk
	}
	c.existed = c.existed[:0]
	for _, f := range pk.Filters {
		_, ok := cl.State.Subscriptions.Get(f.Filter)
		c.existed = append(c.existed, ok)
	}
	return pk
}

// OnSubscribed registers the granted subscriptions, then queues retained
// messages ([MQTT-3.8.4-4]; the server may send them before the SUBACK).
func (h *hook) OnSubscribed(cl *mqtt.Client, pk packets.Packet, codes []byte) {
	b := h.b
	c := b.conn(cl)
	s := b.session(cl.ID)
	if c == nil || s == nil {
		return
	}
	// codes is the slice mochi's SUBACK carries: writing to it sets the
	// reason code the client gets.
	refuse := func(i int, code byte) {
		if cl.Properties.ProtocolVersion < 5 {
			code = packets.ErrUnspecifiedError.Code // 3.1.1 has only 0x80 (failure)
		}
		codes[i] = code
	}
	for i, f := range pk.Filters {
		if i >= len(codes) {
			break
		}
		if i < len(c.refused) && c.refused[i] != 0 {
			refuse(i, c.refused[i])
			continue
		}
		if codes[i] >= packets.ErrUnspecifiedError.Code {
			continue
		}
		sub := &subscription{sess: s, full: f.Filter, filter: f.Filter, qos: codes[i], noLocal: f.NoLocal,
			rap: f.RetainAsPublished, rh: f.RetainHandling}
		if f.Identifier > 0 {
			sub.ids = []int{f.Identifier}
		}
		group, inner, shared, _ := topic.ParseShare(f.Filter)
		if shared {
			sub.filter = inner
			sub.group = &shareGroup{name: group, filter: inner}
		}
		if err := s.addSub(cl, sub, b.cfg.MaxSubscriptions); err != nil {
			// mochi's records of the filter say what the session holds:
			// the subscription it would have replaced, or what a newer
			// connection holds now (it took the session over, or
			// subscribed or unsubscribed since), and not this SUBSCRIBE's.
			b.mirrorSub(cl, f.Filter)
			if errors.Is(err, errSubSuperseded) {
				refuse(i, packets.ErrUnspecifiedError.Code)
				continue
			}
			if errors.Is(err, errSubQuota) {
				b.m.packetErrors.WithLabelValues("subscription_quota").Inc()
				refuse(i, packets.ErrQuotaExceeded.Code)
			} else {
				// Not a fault of the client's: it may subscribe again.
				refuse(i, packets.ErrUnspecifiedError.Code)
			}
			continue
		}
		if !c.rules.Load().CanSubscribe(s.outsideFilter(sub)) {
			// An ACL change came between the check and now, and its
			// re-check of the session's subscriptions may have missed
			// this one.
			s.removeSub(context.Background(), cl, f.Filter)
			b.mirrorSub(cl, f.Filter)
			refuse(i, packets.ErrNotAuthorized.Code)
			continue
		}
		// mochi recorded the filter before this hook, outside the
		// session's lock: an older connection's failed SUBSCRIBE of it
		// that mirrored the session in between (holding nothing of it
		// yet) took that record out.
		b.mirrorSub(cl, f.Filter)
		existed := i < len(c.existed) && c.existed[i]
		if shared || f.RetainHandling == 2 || (f.RetainHandling == 1 && existed) {
			continue // [MQTT-3.3.1-10] [MQTT-3.3.1-11]; no retained for shares (§4.8.2)
		}
		now := time.Now().Unix()
		b.matchRetained(sub.filter, now, func(m *Message) {
			s.enqueue(delivery{msg: m, qos: min(m.QoS, sub.qos), retain: true, ids: sub.ids, onSubscribe: true}) // [MQTT-3.3.1-9]
		})
	}
}

// mirrorSession gives mochi's records of cl, bound to the session it
// resumed, the session's subscriptions they lack. mochi inherits them from
// the client's previous connection, and has none to inherit when its
// record of that connection is gone, though the session goes on (its
// CONNACK says Session Present 1): an UNSUBSCRIBE would be answered "no
// subscription existed", and a SUBSCRIBE with Retain Handling 1 taken for
// a new subscription.
func (b *Broker) mirrorSession(cl *mqtt.Client) {
	s := b.session(cl.ID)
	if s == nil || s.nsubs.Load() == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.client != cl {
		return // taken over since: the newer connection's records are its own
	}
	for filter, sub := range s.subs {
		if _, ok := cl.State.Subscriptions.Get(filter); ok {
			continue
		}
		pk := sub.packet()
		cl.State.Subscriptions.Add(filter, pk)
		b.server.Topics.Subscribe(cl.ID, pk)
	}
}

// mirrorSub makes mochi's records of filter for cl say what the client's
// session holds of it, after a SUBSCRIBE of cl, whatever came of it: cl's
// own subscription list, and mochi's topic index, which is keyed by client
// ID and so shared by every connection of the client. A newer connection
// may have taken the session over (or started a new one) while the
// SUBSCRIBE waited, and subscribed the filter or inherited it from cl: its
// record must stay, or mochi answers its UNSUBSCRIBE "no subscription
// existed"; and one the session does not hold must go, or mochi answers
// "success". Under the session's lock, the record follows the session's
// latest change of the filter, and every SUBSCRIBE mirrors after its own:
// the last to mirror writes what the session holds last. An UNSUBSCRIBE
// is not mirrored: mochi takes its record out before the edge's hook, in
// the connection's own read loop, so a newer connection's record of the
// filter comes after it but for a takeover landing within that one step.
func (b *Broker) mirrorSub(cl *mqtt.Client, filter string) {
	s := b.session(cl.ID)
	if s == nil {
		cl.State.Subscriptions.Delete(filter)
		b.server.Topics.Unsubscribe(filter, cl.ID)
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	held := s.subs[filter]
	if held == nil {
		cl.State.Subscriptions.Delete(filter)
		b.server.Topics.Unsubscribe(filter, cl.ID)
		return
	}
	pk := held.packet()
	if s.client == cl {
		cl.State.Subscriptions.Add(filter, pk)
	} else {
		cl.State.Subscriptions.Delete(filter) // not cl's any more
	}
	b.server.Topics.Subscribe(cl.ID, pk)
}

func (h *hook) OnUnsubscribed(cl *mqtt.Client, pk packets.Packet) {
	s := h.b.session(cl.ID)
	if s == nil {
		return
	}
	for _, f := range pk.Filters {
		// An UNSUBSCRIBE handled after a newer connection took the session
		// over, or mochi's clean-up of a connection whose session ended,
		// leaves the session alone.
		s.removeSub(context.Background(), cl, f.Filter)
	}
}

// The answers OnPublish gives mochi, made errors once: a packets.Code is a
// struct, and returning one as an error allocates it, for every PUBLISH.
var (
	errRejectPacket error = packets.ErrRejectPacket // handled here: mochi does nothing more
	errIgnorePacket error = packets.CodeSuccessIgnore
)

// OnPublish routes a client's PUBLISH. Its PUBACK/PUBREC leaves only once
// every recipient has the message: held for the connection's next write
// (heldAcks) when nobody is waited for, else from the ack queue.
func (h *hook) OnPublish(cl *mqtt.Client, pk *packets.Packet) error {
	b := h.b
	c := b.conn(cl)
	if c == nil {
		return errRejectPacket
	}
	if b.fenced.Load() {
		// No acknowledgement from a fenced edge: the client sends it again
		// elsewhere.
		_ = b.disconnect(cl, packets.ErrServerShuttingDown)
		return errRejectPacket
	}
	if pk.FixedHeader.Qos > 0 {
		failed, held := c.acks.check(pk.PacketID)
		if failed {
			return errRejectPacket // being disconnected unacknowledged
		}
		if held {
			// Sent again while its acknowledgement is pending: that one
			// will be answered, and a QoS 2 message is routed once.
			b.m.duplicatePubs.Inc()
			return errRejectPacket
		}
		if cl.Properties.ProtocolVersion < 5 && !c.acks.reserve(int(b.cfg.ReceiveMaximum)) {
			return errRejectPacket
		}
	}
	// mochi stamps a publish it receives (a keel patch of third_party/mochi):
	// its clock reading is the message's, and a packet that did not come
	// that way reads the clock here.
	now := pk.Received
	if now == 0 {
		now = time.Now().UnixNano()
	}
	id, resent := MsgID{}, false
	if pk.FixedHeader.Qos == 2 {
		if s := b.session(cl.ID); s != nil {
			if id, resent = s.takeUnconfirmed(pk.PacketID, pk.FixedHeader.Dup, pk.TopicName, pk.Payload); resent {
				b.m.qos2Rerouted.Inc()
			}
		}
	}
	if !resent {
		id = b.ids.next()
	}
	m := &Message{
		ID:      id,
		Topic:   pk.TopicName,
		Payload: pk.Payload,
		QoS:     pk.FixedHeader.Qos,
		Retain:  pk.FixedHeader.Retain,
		Props:   forwardProps(&pk.Properties),
		Origin:  cl.ID,
		Created: now,
		quiet:   cl.ReadBuffered() == 0,
	}
	if e := pk.Properties.MessageExpiryInterval; e > 0 {
		m.Expiry = now/int64(time.Second) + min(int64(e), b.cfg.MaxMessageExpiry)
	}
	if resent {
		// To the edges the first copy's shared groups went to.
		m.edges = b.picks.edgesFor(id)
	}
	b.mIn[m.QoS].Inc()
	b.bIn[m.QoS].Add(float64(len(m.Payload)))
	if tracing.Enabled() {
		m.span = startPublish(c.scope, m)
	}
	if m.QoS == 2 && b.store != nil {
		// [MQTT-4.3.3]: the PUBREC state is durable before the message is
		// routed, so a resend after a crash goes under the same msgID and
		// no recipient takes it twice. It is stored unconfirmed, and stays
		// so after the PUBREC (no second write): an edge that dies while
		// routing leaves a record that a loaded copy of the session must
		// not answer as taken (the message would reach nobody), and a
		// PUBREL for it after a move completes all the same (pubrelMoved).
		if s := b.session(cl.ID); s != nil && s.wasDurable() {
			ctx, cancel := context.WithTimeout(context.Background(), storeTimeout)
			err := b.store.PutIncoming(ctx, cl.ID, durable.Incoming{PacketID: pk.PacketID, MsgID: msgIDString(m.ID),
				Unconfirmed: true, Fingerprint: fingerprint(m.Topic, m.Payload)})
			cancel()
			if err != nil {
				finishSpan(m.span, err)
				b.logger.Warn("publish not acknowledged", "client_id", cl.ID, "error", err)
				_ = b.disconnect(cl, packets.ErrServerBusy)
				return errRejectPacket
			}
		}
	}
	if m.Retain {
		// At QoS 1/2 the retained message is acknowledged with the rest:
		// one the store did not take would be gone for later subscribers
		// on other edges, the publisher told otherwise. The client sends it
		// again (a QoS 2 resend under the same msgID).
		if err := b.retain(m); err != nil && m.QoS > 0 {
			return b.notAcknowledged(cl, pk, m, err)
		}
	}
	if c.lookups.pending(m.Topic) {
		return b.routeBehind(cl, c, pk, m)
	}
	wait, err := b.routeAtOnce(m)
	if errors.Is(err, ErrNeedsLookup) {
		return b.routeBehind(cl, c, pk, m)
	}
	if err != nil {
		wait, err = b.routeAgainNow(cl, m, err)
	}
	wait = b.retrying(cl, m, wait)
	if err != nil {
		// Not every recipient took the message: no acknowledgement. The
		// client reconnects and sends it again.
		return b.notAcknowledged(cl, pk, m, err)
	}
	if m.QoS > 0 && (wait != nil || !c.acks.idle()) {
		// The held ones first: they would otherwise wait for the queue's
		// first write, a peer's round trip away.
		flushHeldOf(cl)
		b.queueAck(cl, c, pk, wait, wait != nil, m.span, m)
		return errRejectPacket // acknowledged by the queue
	}
	if kc, ok := cl.Net.Conn.(*keepaliveConn); ok && m.QoS > 0 {
		if cl.Properties.ProtocolVersion == 5 {
			cl.State.Inflight.DecreaseReceiveQuota() // as queueAck, in place of mochi's own path
		}
		kc.holdAck(b, cl, pendingAck{packetID: pk.PacketID, qos: pk.FixedHeader.Qos, span: m.span, msg: m})
		return errRejectPacket // acknowledged with the next write (heldAcks)
	}
	finishSpan(m.span, nil)
	b.confirmed(m)
	// Success, but mochi must not fan the message out itself.
	return errIgnorePacket
}

// notAcknowledged refuses m, published by cl in pk, for err: it is not
// acknowledged, a QoS 2 resend goes under m's msgID again (unconfirm), and
// the client is disconnected with 0x89 to send it again.
func (b *Broker) notAcknowledged(cl *mqtt.Client, pk *packets.Packet, m *Message, err error) error {
	finishSpan(m.span, err)
	b.unconfirm(cl, pk.FixedHeader.Qos, pk.PacketID, m)
	b.logger.Warn("publish not acknowledged", "client_id", cl.ID, "error", err)
	_ = b.disconnect(cl, packets.ErrServerBusy)
	return errRejectPacket
}

// OnQosComplete frees a slot of the client's receive window when one of the
// edge's QoS 1/2 deliveries completes.
func (h *hook) OnQosComplete(cl *mqtt.Client, pk packets.Packet) {
	switch pk.FixedHeader.Type {
	case packets.Pubrel:
		return // an inbound QoS 2 flow completed; its state went at the PUBREL (OnPacketRead)
	case packets.Puback:
		if pk.Created != 0 {
			// The edge's own PUBACK to an inbound QoS 1 publish: mochi stamps
			// packets it builds; packets read from the wire carry no stamp.
			return
		}
	}
	h.b.completed(cl, pk.PacketID, pk.FixedHeader.Type == packets.Puback && pk.ReasonCode >= packets.ErrUnspecifiedError.Code)
}

func (h *hook) OnQosDropped(cl *mqtt.Client, pk packets.Packet) {
	h.b.completed(cl, pk.PacketID, false)
}

// completed frees a window slot and forgets the stored in-flight entry. A
// group message the client refused goes to another member of its group.
func (b *Broker) completed(cl *mqtt.Client, packetID uint16, refused bool) {
	s := b.session(cl.ID)
	if s == nil {
		return
	}
	if d, ok := s.ackedShared(packetID); ok {
		if refused {
			b.redispatchAll(s, []delivery{d}, ShareRefused)
		} else {
			b.reportAcked(s, d)
		}
	}
	s.acked()
	if s.durable && b.store != nil {
		_ = b.store.Complete(context.Background(), cl.ID, packetID)
	}
}

func authReason(code packets.Code) string {
	switch code {
	case packets.ErrNotAuthorized:
		return "not_authorized"
	case packets.ErrServerUnavailable:
		return "unavailable"
	}
	return "bad_credentials"
}
