package broker

import (
	"sync/atomic"
)

// Status is what the edge holds, for operators (the edge API's Status and
// Drain). Counts are read one after the other, not as one snapshot.
type Status struct {
	// Connections is the number of open client connections (those still
	// in CONNECT included), as keel_edge_connections.
	Connections int
	// SessionsConnected is the number of sessions with a connection.
	SessionsConnected int
	// SessionsOffline is the number of sessions held without one:
	// persistent sessions whose client is away, and sessions in custody.
	SessionsOffline int
	// Routes is the number of distinct routes (tenant, filter, share group)
	// the sessions here hold at the router: what the route client
	// aggregates their subscriptions into.
	Routes int
	// Fenced is true while the edge's cluster lease has lapsed.
	Fenced bool
	// Draining is true once a drain started: nobody is admitted any more.
	Draining bool
}

// routeKey is one aggregated route: the internal filter is tenant-scoped.
type routeKey struct{ filter, group string }

// Status counts what the edge holds. It only reads, taking each session's
// lock in turn, never all at once.
func (b *Broker) Status() Status {
	st := Status{
		Connections: int(atomic.LoadInt64(&b.server.Info.ClientsConnected)),
		Fenced:      b.fenced.Load(),
		Draining:    b.draining.Load(),
	}
	b.sessMu.Lock()
	all := make([]*session, 0, len(b.sessions))
	for _, s := range b.sessions {
		all = append(all, s)
	}
	b.sessMu.Unlock()
	routes := map[routeKey]struct{}{}
	for _, s := range all {
		if s.online.Load() {
			st.SessionsConnected++
		} else {
			st.SessionsOffline++
		}
		s.mu.Lock()
		for _, sub := range s.subs {
			routes[routeKey{sub.filter, groupName(sub)}] = struct{}{}
		}
		s.mu.Unlock()
	}
	st.Routes = len(routes)
	return st
}

// Fenced reports whether the edge's cluster lease has lapsed: it admits
// nobody and acknowledges nothing until it rejoins.
func (b *Broker) Fenced() bool { return b.fenced.Load() }

// Draining reports whether a drain started.
func (b *Broker) Draining() bool { return b.draining.Load() }
