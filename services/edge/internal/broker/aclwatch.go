package broker

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/keelmq/keel/services/edge/internal/auth"
)

// ACL changes while clients are connected.
//
// A connection's ACL is bound once, at CONNECT; subscriptions are checked
// once, at SUBSCRIBE; publish decisions are cached per connection and topic.
// When the users or ACLs of a tenant change, the coordinator's ACL version
// of that tenant goes up (keelctl bumps it after every change) and every
// edge is told through its cluster watch. For each tenant whose version
// increased (the empty tenant, the cluster-wide rules, stands for all of
// them), the edge then:
//
//  1. makes the authenticators answer from current data: PostgreSQL drops
//     its cached users of the tenant, the password file is read again; a
//     CONNECT from then on sees the change;
//  2. re-reads, in one call per tenant and backend, the ACL of every user
//     with a connection here whose ACL came from a backend that can read it
//     again (file, PostgreSQL; a JWT's ACL is in the token and stays), and
//     binds it to the connection: its cached publish decisions go with the
//     old rules, so the next PUBLISH is checked against the new ones (MQTT 5
//     QoS 1/2: PUBACK/PUBREC 0x87; MQTT 3.1.1 QoS 1/2: disconnected; QoS 0:
//     dropped). A user the backend no longer knows (removed or disabled) is
//     disconnected with 0x87;
//  3. checks the session's subscriptions against the new rules and removes
//     those no longer allowed, from the session, the subscription index and
//     the cluster's routes. MQTT has no server-initiated unsubscribe, so
//     the client is not told; the removal is logged and counted
//     (keel_edge_acl_revoked_subscriptions_total).
//
// In-flight messages: the change applies from the moment the rules are
// swapped. A PUBLISH checked before is routed as before; a message already
// queued for a removed subscription, or sent and awaiting its PUBACK, is
// still delivered (and resent after a reconnect); messages routed after the
// removal are not. A persistent session whose client is offline keeps its
// subscriptions until the client returns: at that CONNECT its
// subscriptions are checked against the rules it is bound to then.
//
// A refresh that fails (the database is down, the password file does not
// load) keeps the connections' current rules and is retried with backoff.

// aclWatch is the broker's record of the ACL versions it has seen.
type aclWatch struct {
	mu       sync.Mutex
	versions map[string]uint64 // tenant -> highest version seen; guarded by mu
	pending  map[string]bool   // tenants to refresh; guarded by mu
	once     sync.Once
	kick     chan struct{} // one slot; made by once
	// gen counts refreshes that started, so that a CONNECT racing with one
	// can tell (aclSeen).
	gen atomic.Uint64
}

const (
	aclRefreshTimeout = 10 * time.Second
	aclRetryMin       = time.Second
	aclRetryMax       = 30 * time.Second
)

// ACLVersion implements cluster.ACLWatcher: a version higher than the one
// last seen for tenant schedules a refresh of the tenant's ACLs. The first
// version seen of a tenant counts as a change too, since the edge cannot
// know what happened before it watched. It does not block.
func (b *Broker) ACLVersion(tenant string, version uint64) {
	w := &b.aclw
	w.mu.Lock()
	if w.versions == nil {
		w.versions, w.pending = map[string]uint64{}, map[string]bool{}
	}
	if version <= w.versions[tenant] {
		w.mu.Unlock()
		return
	}
	w.versions[tenant] = version
	w.mu.Unlock()
	b.refreshACLsLater(tenant)
}

// refreshACLsLater schedules a refresh of tenant's ACLs on the refresh
// goroutine, which refreshes whatever is pending at once.
func (b *Broker) refreshACLsLater(tenant string) {
	w := &b.aclw
	w.mu.Lock()
	if w.pending == nil {
		w.versions, w.pending = map[string]uint64{}, map[string]bool{}
	}
	w.pending[tenant] = true
	w.mu.Unlock()
	w.once.Do(func() {
		w.kick = make(chan struct{}, 1)
		go b.aclLoop()
	})
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// aclSeen runs once a new connection is registered: if a refresh started
// since the connection began authenticating (generation gen), it may have
// authenticated from stale data and the refresh may have missed it, so its
// tenant is refreshed again.
func (b *Broker) aclSeen(c *conn, gen uint64) {
	if b.aclw.gen.Load() != gen {
		b.refreshACLsLater(c.scope.Tenant())
	}
}

func (b *Broker) aclLoop() {
	w := &b.aclw
	var retry <-chan time.Time
	backoff := time.Duration(0)
	for {
		select {
		case <-b.done:
			return
		case <-w.kick:
		case <-retry:
		}
		w.mu.Lock()
		tenants := make([]string, 0, len(w.pending))
		for t := range w.pending {
			tenants = append(tenants, t)
		}
		clear(w.pending)
		w.mu.Unlock()
		if len(tenants) == 0 {
			continue
		}
		failed := b.refreshACLs(tenants)
		if len(failed) == 0 {
			b.m.aclRefreshes.WithLabelValues("ok").Inc()
			backoff, retry = 0, nil
			continue
		}
		b.m.aclRefreshes.WithLabelValues("error").Inc()
		w.mu.Lock()
		for _, t := range failed {
			w.pending[t] = true
		}
		w.mu.Unlock()
		backoff = min(max(2*backoff, aclRetryMin), aclRetryMax)
		retry = time.After(backoff)
		b.logger.Warn("acl refresh incomplete; connected clients keep their rules until it is retried",
			"tenants", failed, "retry_in", backoff)
	}
}

// aclGroup is the connections of one tenant whose ACL comes from one source.
type aclGroup struct {
	src    auth.ACLSource
	tenant string
}

type aclTarget struct {
	cl *mqtt.Client
	c  *conn
}

// refreshACLs applies an ACL change of tenants ("" for all) to the
// authenticators and to the connected clients; it returns the tenants to
// try again.
func (b *Broker) refreshACLs(tenants []string) (failed []string) {
	all := slices.Contains(tenants, "")
	if inv, ok := b.auth.(auth.ACLInvalidator); ok {
		if err := inv.InvalidateACLs(tenants); err != nil {
			// The last good data stays in force; connections are re-bound
			// to it, which changes nothing, and the whole refresh is retried.
			b.logger.Error("authenticator did not reload its ACLs", "tenants", tenants, "error", err)
			failed = tenants
		}
	}
	b.aclw.gen.Add(1)
	groups := map[aclGroup][]aclTarget{}
	b.conns.Range(func(k, v any) bool {
		c := v.(*conn)
		t := c.scope.Tenant()
		if c.identity.ACLSource == nil || (!all && !slices.Contains(tenants, t)) {
			return true // no ACL, or it came with the credentials (a JWT's)
		}
		g := aclGroup{src: c.identity.ACLSource, tenant: t}
		groups[g] = append(groups[g], aclTarget{cl: k.(*mqtt.Client), c: c})
		return true
	})
	for g, targets := range groups {
		users := make([]string, 0, len(targets))
		for _, tg := range targets {
			users = append(users, tg.c.identity.ACLUser)
		}
		slices.Sort(users)
		users = slices.Compact(users)
		ctx, cancel := context.WithTimeout(b.stopped, aclRefreshTimeout)
		acls, err := g.src.ReadACLs(ctx, g.tenant, users)
		cancel()
		if err != nil {
			b.logger.Error("acls not read again; the tenant's clients keep their rules", "tenant", g.tenant, "error", err)
			if !slices.Contains(failed, g.tenant) {
				failed = append(failed, g.tenant)
			}
			continue
		}
		for _, tg := range targets {
			acl, ok := acls[tg.c.identity.ACLUser]
			if !ok {
				b.revokeUser(tg.cl, tg.c)
				continue
			}
			tg.c.rules.Store(acl.Bind(g.tenant, tg.c.identity.Username, tg.c.clientID))
			b.recheckSubscriptions(tg.cl, tg.c)
		}
	}
	return failed
}

// revokeUser disconnects a client whose user no longer exists or is
// disabled, with 0x87; until it is gone it may do nothing.
func (b *Broker) revokeUser(cl *mqtt.Client, c *conn) {
	c.rules.Store((&auth.ACL{}).Bind(c.scope.Tenant(), c.identity.Username, c.clientID))
	b.recheckSubscriptions(cl, c)
	b.logger.Info("user removed or disabled; disconnecting", "client_id", cl.ID, "tenant", c.scope.Tenant())
	b.m.disconnects.WithLabelValues("user_revoked").Inc()
	go func() { _ = b.disconnect(cl, packets.ErrNotAuthorized) }()
}

// recheckSubscriptions removes the subscriptions of cl's session that its
// rules in force no longer allow.
func (b *Broker) recheckSubscriptions(cl *mqtt.Client, c *conn) {
	rules := c.rules.Load()
	if rules == nil {
		return
	}
	s := b.session(cl.ID)
	if s == nil || s.nsubs.Load() == 0 {
		return
	}
	s.mu.Lock()
	if s.client != cl {
		// Not bound to this connection (yet, or any more): the connection
		// that binds it checks its subscriptions then.
		s.mu.Unlock()
		return
	}
	subs := make([]*subscription, 0, len(s.subs))
	for _, sub := range s.subs {
		subs = append(subs, sub)
	}
	s.mu.Unlock()
	for _, sub := range subs {
		ext := s.outsideFilter(sub)
		if rules.CanSubscribe(ext) {
			continue
		}
		// Not waiting on the router: the subscription left the index, so
		// what its route still draws here for a moment reaches nobody.
		// Only while the session is still cl's: the removals above may
		// have waited, and a newer connection that took the session over
		// meanwhile (checked against its own rules when it was bound)
		// holds what it subscribed to, under the same filter too.
		if !s.removeSub(cancelled, cl, sub.full) {
			continue
		}
		// Under the session's lock: a takeover inheriting cl's records in
		// between keeps the newer connection's record of the filter.
		b.mirrorSub(cl, sub.full)
		b.m.aclRevoked.Inc()
		b.logger.Info("subscription removed: the client's ACL no longer allows it", "client_id", cl.ID, "filter", ext,
			"shared_group", groupName(sub))
	}
}
