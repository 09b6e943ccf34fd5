package server

import (
	"context"
	"slices"
	"sort"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/services/coordinator/internal/fsm"
	"github.com/keelmq/keel/services/coordinator/internal/lease"
	"github.com/keelmq/keel/services/coordinator/internal/raftpb"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
)

// DefaultRouteGrace is the default of Config.RouteGrace. Edges report when
// their custody and claims have settled (routes registered), and the
// removal waits for those reports; the grace is the floor beside them. At
// 5 s it was most of what a 10,000-client edge failover took after its
// clients were back: with a 3 s lease, a 1,000-client failover recovered in
// 8.8 s with 5 s and in 6.0 s with 1 s (make bench-failover). The e2e
// suite's edge kills have run at 1 s throughout.
const DefaultRouteGrace = time.Second

// DefaultAdoptionWait is the default of Config.AdoptionWait: well past the
// forward bound, so that a custodian slower than that costs publishers a
// reconnect, not a message.
const DefaultAdoptionWait = 2 * time.Minute

const (
	// removeEdgeTimeout bounds one RemoveEdge call. The router answers only
	// after every router node passed the dead edge on to its edges (each of
	// them acknowledging or letting its cache lease run out) and it scanned
	// the table, which takes seconds, not minutes.
	removeEdgeTimeout = 30 * time.Second
	removeBackoffMin  = 500 * time.Millisecond
	removeBackoffMax  = 30 * time.Second
)

// deadState reports whether an incarnation in state st is dead for good: the
// FSM never brings a left or expired incarnation back.
func deadState(st raftpb.MemberState) bool {
	return st == raftpb.MemberState_MEMBER_STATE_EXPIRED || st == raftpb.MemberState_MEMBER_STATE_LEFT
}

// deadEdge is one edge whose routes of incarnation inc and older must leave
// the router.
type deadEdge struct {
	inc       uint64
	adopted   bool      // custody found no session of inc or older left to reassign
	adoptedAt time.Time // when adopted was set
	// index is the Raft index of the state custody found the edge dead
	// and without sessions in: a claim with a later epoch sees the edge
	// gone, and one at or before it is settled once its claimant reports
	// claims settled through index ([claimReport]).
	index    uint64
	due      time.Time // earliest next RemoveEdge; set once adopted
	attempts int       // failed RemoveEdge calls
	// custodians holds, per custodian this term gave sessions of the edge
	// to, the highest epoch it gave: the routes wait until each reported
	// those sessions adopted ([deadRoutes.settled]).
	custodians map[memberInc]uint64
}

// memberInc is one incarnation of a member.
type memberInc struct {
	id  string
	inc uint64
}

// deadRoute is a removal handed to the caller by [deadRoutes.takeDue].
type deadRoute struct {
	edge     string
	inc      uint64
	attempts int
	// unsettled lists the custodians that had not reported their sessions
	// adopted when the wait for them ran out.
	unsettled []string
}

// deadRoutes is one leader term's list of dead edges whose routes are still to
// be removed from the router. It is kept in memory only: a new leader rebuilds
// it from the FSM, which is enough because RemoveEdge is idempotent. It is
// safe for concurrent use (the FSM observer adds, the leader loop marks
// custody done, the removal loop takes and completes).
//
// One entry per edge suffices: RemoveEdge(edge, inc) removes the routes of inc
// and every older incarnation and never those of a newer one, so the highest
// dead incarnation stands for all of them.
type deadRoutes struct {
	grace time.Duration
	// adoptionWait bounds how long after adoption the removal waits for
	// custodians that do not report their sessions adopted; 0 does not wait
	// for them.
	adoptionWait time.Duration
	// reportWithin is how long after adoption a custodian that has not
	// reported its progress at all is waited for (a lease TTL: it renews
	// three times in it). Past it, it is taken for an edge that does not
	// report, as one of an earlier version does.
	reportWithin time.Duration
	wake         chan struct{} // one-slot: something became due sooner

	mu      sync.Mutex
	pending map[string]*deadEdge // by edge ID; guarded by mu
	removed map[string]uint64    // highest incarnation removed this term, by edge ID; guarded by mu
	// progress is each edge incarnation's last reported custody progress
	// (CustodyProgress.adopted_through); guarded by mu.
	progress map[memberInc]uint64
	// claims is each edge incarnation's last report of its own claims, from
	// the edges that report them; guarded by mu.
	claims map[memberInc]claimReport
}

// claimReport is what an edge last said of the sessions it claimed
// (CustodyProgress.claims_settled_through and unfinished_from). A session
// it claimed from an edge that then died, whose takeover failed, is held by
// nobody until the claimant adopts it from the store: the dead edge's routes
// are the only ones that reach it, so they stay until the claimant reported
// every such claim settled.
type claimReport struct {
	through    uint64
	unfinished []string
}

func newDeadRoutes(grace, adoptionWait, reportWithin time.Duration) *deadRoutes {
	return &deadRoutes{grace: grace, adoptionWait: adoptionWait, reportWithin: reportWithin, wake: make(chan struct{}, 1),
		pending: map[string]*deadEdge{}, removed: map[string]uint64{}, progress: map[memberInc]uint64{},
		claims: map[memberInc]claimReport{}}
}

// settleRecheck is how often a removal whose custodians have not all
// reported is looked at again; they report with their lease renewals.
const settleRecheck = 250 * time.Millisecond

// assigned records that sessions of the dead edge's incarnation edgeInc
// (or older) went to the custodian (to, toInc) under epoch, directly or
// passed on from a custodian that died before adopting them: the edge's
// routes, if still to be removed, wait for that custodian. A newer
// incarnation of the edge (it rejoined since) is not the one pending.
func (d *deadRoutes) assigned(edge string, edgeInc uint64, to string, toInc, epoch uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	p := d.pending[edge]
	if p == nil || edgeInc > p.inc {
		return
	}
	if p.custodians == nil {
		p.custodians = map[memberInc]uint64{}
	}
	k := memberInc{to, toInc}
	p.custodians[k] = max(p.custodians[k], epoch)
}

// recallCustody fills in, from the state st, the custodians of the
// pending edges' sessions that an earlier leader assigned, directly or by
// passing a session on from a custodian that died (its custody origin):
// their assignments are not in this term's memory, and without them the
// removal would wait for no custodian, and could take a dead edge's routes
// while its sessions' custodians had not registered theirs. A session counts
// while it is still in custody (not claimed by a connection since). It
// scans every session once; call it before any removal can be due.
func (d *deadRoutes) recallCustody(st *fsm.State) {
	d.mu.Lock()
	pending := make(map[string]bool, len(d.pending))
	for id := range d.pending {
		pending[id] = true
	}
	d.mu.Unlock()
	if len(pending) == 0 {
		return
	}
	st.ScanSessions(fsm.SessionScan{}, func(rec *raftpb.SessionRecord, _ bool) bool {
		if rec.GetOwnerKind() != raftpb.OwnerKind_OWNER_KIND_CUSTODY {
			return true
		}
		from := rec.GetTakenFromEdgeId()
		if pending[from] {
			d.assigned(from, rec.GetTakenFromIncarnation(), rec.GetOwnerEdgeId(), rec.GetOwnerIncarnation(), rec.GetEpoch())
		}
		// Passed on from a custodian that died: the edge whose death
		// started the custody may still hold the only routes to it.
		if origin, originInc := fsm.CustodyOrigin(rec); origin != from {
			if pending[origin] {
				d.assigned(origin, originInc, rec.GetOwnerEdgeId(), rec.GetOwnerIncarnation(), rec.GetEpoch())
			}
		}
		return true
	})
}

// reported records an edge incarnation's custody progress, and the state
// of its own claims, from its lease renewal.
func (d *deadRoutes) reported(id string, inc uint64, c *coordinatorv1.CustodyProgress) {
	d.mu.Lock()
	defer d.mu.Unlock()
	k := memberInc{id, inc}
	d.progress[k] = max(d.progress[k], c.GetAdoptedThrough())
	if c.GetClaimsSettledThrough() > 0 {
		d.claims[k] = claimReport{through: c.GetClaimsSettledThrough(), unfinished: c.GetUnfinishedFrom()}
	}
}

// forget drops the progress of an incarnation whose lease is gone.
func (d *deadRoutes) forget(id string, inc uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.progress, memberInc{id, inc})
	delete(d.claims, memberInc{id, inc})
}

// unsettledLocked lists the edges the removal of edge's routes (p) waits
// for: live custodians that have not reported the sessions they were given
// adopted; dead custodians whose own sessions custody has not passed on
// yet (their unadopted sessions of edge among them: once passed on, the new
// custodians are waited for instead, [deadRoutes.assigned]); and live
// claimants that have not reported their claims settled through p's index,
// or still list edge as the source of a failed takeover.
func (d *deadRoutes) unsettledLocked(edge string, p *deadEdge, now time.Time, live func(id string, inc uint64) bool) []string {
	var out []string
	for c, epoch := range p.custodians {
		if !live(c.id, c.inc) {
			// Its death may not be recorded here yet (its lease goes
			// before the observer adds it): only custody having passed its
			// sessions on, or its own routes gone, settles it.
			q := d.pending[c.id]
			passed := q != nil && q.inc >= c.inc && q.adopted
			if !passed && d.removed[c.id] < c.inc {
				out = append(out, c.id)
			}
			continue
		}
		through, reports := d.progress[c]
		if !reports && !now.Before(p.adoptedAt.Add(d.reportWithin)) {
			continue
		}
		if through < epoch {
			out = append(out, c.id)
		}
	}
	for c, r := range d.claims {
		if c.id == edge || !live(c.id, c.inc) || slices.Contains(out, c.id) {
			continue
		}
		if r.through < p.index || slices.Contains(r.unfinished, edge) {
			out = append(out, c.id)
		}
	}
	sort.Strings(out)
	return out
}

// add records that the routes of edge's incarnation inc and older are dead.
func (d *deadRoutes) add(edge string, inc uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.removed[edge] >= inc {
		return
	}
	if p := d.pending[edge]; p != nil {
		if p.inc >= inc {
			return
		}
		// A later incarnation died as well: its sessions must be adopted
		// before any of its routes go, and its removal covers the older one.
		*p = deadEdge{inc: inc}
		return
	}
	d.pending[edge] = &deadEdge{inc: inc}
}

// adopted is told that custody found no session of any dead incarnation of
// rec's edge left to reassign, in the state rec was read from. The pending
// removal then becomes due after the grace, during which the custodians
// register the adopted sessions' routes: removing the dead edge's routes
// first could leave a publish with no route for an adopted session. A
// state older than the death the entry stands for says nothing about that
// incarnation's sessions, so it leaves the entry waiting for a later scan.
func (d *deadRoutes) adopted(rec *raftpb.MemberRecord, now time.Time, index uint64) {
	if rec == nil {
		return
	}
	d.mu.Lock()
	p := d.pending[rec.GetMemberId()]
	covered := p != nil && !p.adopted &&
		(p.inc < rec.GetIncarnation() || p.inc == rec.GetIncarnation() && deadState(rec.GetState()))
	if covered {
		p.adopted, p.adoptedAt, p.due, p.index = true, now, now.Add(d.grace), index
	}
	d.mu.Unlock()
	if covered {
		d.poke()
	}
}

func (d *deadRoutes) poke() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// takeDue returns the removals due at now, in edge ID order: adopted, past
// the grace, and either every live custodian reported its sessions adopted
// (their routes registered), or the adoption wait ran out. live tells
// whether an edge incarnation holds a lease.
func (d *deadRoutes) takeDue(now time.Time, live func(id string, inc uint64) bool) []deadRoute {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []deadRoute
	for id, p := range d.pending {
		if !p.adopted || now.Before(p.due) {
			continue
		}
		r := deadRoute{edge: id, inc: p.inc, attempts: p.attempts}
		if d.adoptionWait == 0 {
			out = append(out, r)
			continue
		}
		if r.unsettled = d.unsettledLocked(id, p, now, live); len(r.unsettled) > 0 {
			if bound := p.adoptedAt.Add(d.adoptionWait); now.Before(bound) {
				p.due = minTime(now.Add(settleRecheck), bound)
				continue
			}
		}
		out = append(out, r)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].edge < out[j].edge })
	return out
}

// next returns when the earliest adopted removal is due; false if none is.
func (d *deadRoutes) next() (time.Time, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var at time.Time
	found := false
	for _, p := range d.pending {
		if p.adopted && (!found || p.due.Before(at)) {
			at, found = p.due, true
		}
	}
	return at, found
}

// done records a successful removal of (edge, inc). An entry raised to a
// newer dead incarnation meanwhile stays pending.
func (d *deadRoutes) done(edge string, inc uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.removed[edge] = max(d.removed[edge], inc)
	if p := d.pending[edge]; p != nil && p.inc <= inc {
		delete(d.pending, edge)
	}
}

// failed records a failed removal of (edge, inc) at now and returns the
// backoff before the next attempt.
func (d *deadRoutes) failed(edge string, inc uint64, now time.Time) time.Duration {
	d.mu.Lock()
	defer d.mu.Unlock()
	p := d.pending[edge]
	if p == nil || p.inc != inc {
		return 0
	}
	p.attempts++
	wait := removeBackoffMin << min(p.attempts-1, 16)
	wait = min(wait, removeBackoffMax)
	p.due = now.Add(wait)
	return wait
}

// len returns the number of edges whose routes are still to be removed.
func (d *deadRoutes) len() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.pending)
}

// removeDeadRoutes calls RemoveEdge for every due entry of d, one at a time
// (each call scans the router's whole table), until ctx ends with the term.
// It runs beside the leader loop so that a slow router never delays lease
// expiry or custody.
func (s *Server) removeDeadRoutes(ctx context.Context, d *deadRoutes, leases *lease.Table) {
	timer := time.NewTimer(0)
	defer timer.Stop()
	live := func(id string, inc uint64) bool { return leases.Remaining(id, inc, s.now()) > 0 }
	for {
		for _, e := range d.takeDue(s.now(), live) {
			if ctx.Err() != nil {
				return
			}
			s.removeEdgeRoutes(ctx, d, e)
		}
		// The due times are on s.now, which tests may drive; waking at least
		// every second keeps such a clock from stalling removals.
		wait := time.Second
		if at, ok := d.next(); ok {
			wait = min(max(at.Sub(s.now()), time.Millisecond), wait)
		}
		timer.Reset(wait)
		select {
		case <-ctx.Done():
			return
		case <-d.wake:
		case <-timer.C:
		}
	}
}

func (s *Server) removeEdgeRoutes(ctx context.Context, d *deadRoutes, e deadRoute) {
	cctx, cancel := context.WithTimeout(ctx, removeEdgeTimeout)
	resp, err := s.router.RemoveEdge(cctx, connect.NewRequest(&routerv1.RemoveEdgeRequest{EdgeId: e.edge, Incarnation: e.inc}))
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return // the term ended; the next leader starts over
		}
		wait := d.failed(e.edge, e.inc, s.now())
		s.metrics.routeRemovals.WithLabelValues("error").Inc()
		s.logger.Warn("cannot remove a dead edge's routes from the router; retrying", logging.KeyEdgeID, e.edge,
			"incarnation", e.inc, "attempt", e.attempts+1, "retry_in", wait, logging.Err(err))
		return
	}
	d.done(e.edge, e.inc)
	if len(e.unsettled) > 0 {
		// Publishes matching a session those custodians have not routed yet
		// reach nobody until they do.
		s.metrics.routeRemovals.WithLabelValues("unconfirmed").Inc()
		s.logger.Warn("dead edge's routes removed from the router before every custodian and claimant reported its sessions held",
			logging.KeyEdgeID, e.edge, "incarnation", e.inc, "waited_for", e.unsettled, "adoption_wait", d.adoptionWait,
			"routes_removed", resp.Msg.GetRoutesRemoved())
		return
	}
	s.metrics.routeRemovals.WithLabelValues("ok").Inc()
	s.logger.Info("dead edge's routes removed from the router", logging.KeyEdgeID, e.edge, "incarnation", e.inc,
		"routes_removed", resp.Msg.GetRoutesRemoved(), "failed_attempts", e.attempts)
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}
