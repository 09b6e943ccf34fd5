package server

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/libs/slots"
	"github.com/keelmq/keel/services/coordinator/internal/fsm"
	"github.com/keelmq/keel/services/coordinator/internal/lease"
	"github.com/keelmq/keel/services/coordinator/internal/raftpb"
)

// leaderTerm is the leader's state for one term.
type leaderTerm struct {
	leases   *lease.Table
	claims   *batcher[*raftpb.Claim, *raftpb.ClaimOutcome]
	releases *batcher[*raftpb.ReleaseSessionCommand, *raftpb.ReleaseOutcome]
	// releaseBatches is set while every voter applies ReleaseSessions
	// entries (batchReleasesIfAgreed); until then a release is an entry alone.
	releaseBatches atomic.Bool
	routes         *deadRoutes   // nil without a router URL
	kick           chan struct{} // one-slot: run the custody scan soon
	dirtyMu        sync.Mutex
	// dirty holds the edges whose sessions may need custody, each with the
	// Raft index of the latest change that marked it: a scan of an older
	// state must not clear a mark it has not seen. Guarded by dirtyMu.
	dirty map[string]uint64
	incs  map[string]uint64 // latest incarnation of every edge member; guarded by dirtyMu
	// writers follows the persistence members' pauses for failovers.
	writers *writerPauses
}

// observe marks edges whose membership changed for the custody scan, and
// records dead edge incarnations whose routes must leave the router. It runs
// on the FSM's apply goroutine, in log order.
func (t *leaderTerm) observe(index uint64, events []fsm.Event) {
	marked := false
	t.dirtyMu.Lock()
	for _, e := range events {
		m := e.Member
		if e.Kind != fsm.EventMember || m.GetRole() != raftpb.MemberRole_MEMBER_ROLE_EDGE {
			continue
		}
		id, inc := m.GetMemberId(), m.GetIncarnation()
		t.dirty[id] = index
		marked = true
		if t.routes != nil {
			switch prev := t.incs[id]; {
			case deadState(m.GetState()):
				t.routes.add(id, inc)
			case prev != 0 && prev < inc:
				// A rejoin that came before the old incarnation's lease ran
				// out leaves no EXPIRED record of it, yet its routes stay in
				// the router (hidden from lookups, still stored).
				t.routes.add(id, prev)
			}
		}
		t.incs[id] = inc
	}
	t.dirtyMu.Unlock()
	if marked {
		select {
		case t.kick <- struct{}{}:
		default:
		}
	}
}

func (s *Server) apply(ctx context.Context, ct fsm.CommandType, cmd proto.Message) (proto.Message, uint64, error) {
	start := time.Now()
	msg, idx, err := s.node.Apply(ctx, ct, cmd)
	s.metrics.applyDuration.WithLabelValues(commandName(ct)).Observe(time.Since(start).Seconds())
	return msg, idx, err
}

func commandName(ct fsm.CommandType) string {
	switch ct {
	case fsm.CmdClaimSessions:
		return "claim_sessions"
	case fsm.CmdReleaseSession:
		return "release_session"
	case fsm.CmdReleaseSessions:
		return "release_sessions"
	case fsm.CmdReassignSessions:
		return "reassign_sessions"
	case fsm.CmdUpsertMember:
		return "upsert_member"
	case fsm.CmdAcquirePromotionLease, fsm.CmdAcquirePromotionLeaseV2:
		return "acquire_promotion_lease"
	case fsm.CmdCompareAndSetRedis:
		return "cas_redis_primary"
	case fsm.CmdBumpAclVersion:
		return "bump_acl_version"
	default:
		return "other"
	}
}

// leaderLoop runs for one term. It first waits for a barrier, so the FSM holds
// every entry of earlier terms, then grants every known member a full TTL
// (a new leader never expires anyone early), and then serves: expiring leases
// on its own clock, reassigning orphaned sessions, removing the routes of dead
// edges from the router once their sessions are adopted, and adding voters.
func (s *Server) leaderLoop(ctx context.Context) {
	log := s.logger.With("term_leader", s.node.ID())
	for {
		err := s.node.Barrier(s.cfg.LeaseTTL)
		if err == nil {
			break
		}
		log.Warn("leader barrier failed", logging.Err(err))
		select {
		case <-ctx.Done():
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
	t := &leaderTerm{
		leases:  lease.NewTable(s.cfg.LeaseTTL),
		kick:    make(chan struct{}, 1),
		dirty:   map[string]uint64{},
		incs:    map[string]uint64{},
		writers: newWriterPauses(),
	}
	if s.router != nil {
		t.routes = newDeadRoutes(s.cfg.RouteGrace, s.cfg.AdoptionWait, s.cfg.LeaseTTL)
	}
	st := s.fsm.State()
	t.leases.Reset(st.Members(), s.now())
	for _, m := range st.Members() {
		if m.GetRole() != raftpb.MemberRole_MEMBER_ROLE_EDGE {
			continue
		}
		t.dirty[m.GetMemberId()] = st.Index()
		t.incs[m.GetMemberId()] = m.GetIncarnation()
		// Removals are not recorded in Raft, so whether an earlier leader
		// got to this one is unknown; RemoveEdge is idempotent, and the
		// custody scan below gates it as for a fresh death.
		if t.routes != nil && deadState(m.GetState()) {
			t.routes.add(m.GetMemberId(), m.GetIncarnation())
		}
	}
	s.installSlotTable(ctx, st)
	t.claims = newBatcher(s, claimBatches, s.metrics.claimBatch)
	t.releases = newBatcher(s, releaseBatches, s.metrics.releaseBatch)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		t.claims.run(ctx)
	}()
	go func() {
		defer wg.Done()
		t.releases.run(ctx)
	}()
	if t.routes != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Off the leader loop: it reads every session once.
			t.routes.recallCustody(st)
			s.removeDeadRoutes(ctx, t.routes, t.leases)
		}()
	}
	s.term.Store(t)
	log.Info("leader ready", logging.KeyRaftIndex, st.Index(), "members", len(st.Members()))
	defer func() {
		s.term.Store(nil)
		s.metrics.votersRefused.Set(0)
		wg.Wait()
		log.Info("leader stepped down")
	}()

	tick := max(min(s.cfg.LeaseTTL/10, time.Second), 5*time.Millisecond)
	ticker := time.NewTicker(tick)
	defer ticker.Stop()
	lastReconcile := time.Time{}
	missing := map[string]time.Time{}
	refused := map[string]int{}
	s.batchReleasesIfAgreed(t)
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		case <-t.kick:
		}
		s.expireLeases(ctx, t)
		s.runCustody(ctx, t)
		if time.Since(lastReconcile) >= s.cfg.ReconcileInterval {
			lastReconcile = time.Now()
			s.reconcileVoters(missing, refused)
			s.batchReleasesIfAgreed(t)
		}
	}
}

// batchReleasesIfAgreed sets whether releases go in ReleaseSessions
// entries: only once every voter advertises that it applies them. A node of
// an earlier version stops at an entry it cannot decode, so during a
// rolling update from one, or while a voter is missing from gossip (its
// version unknown), each release is an entry of its own.
func (s *Server) batchReleasesIfAgreed(t *leaderTerm) {
	ok, why := s.votersApply(fsm.CmdReleaseSessions)
	if t.releaseBatches.Swap(ok) != ok {
		if ok {
			s.logger.Info("releases batched: every voter applies ReleaseSessions entries")
		} else {
			s.logger.Warn("releases unbatched, an entry each", "reason", why)
		}
	}
}

// votersApply reports whether every voter advertises that it applies
// command ct, and if not, why.
func (s *Server) votersApply(ct fsm.CommandType) (bool, string) {
	if s.peers == nil {
		return false, "no gossip"
	}
	servers, err := s.node.Servers()
	if err != nil {
		return false, err.Error()
	}
	commands := map[string]int{}
	for _, m := range s.peers.Coordinators() {
		commands[m.Meta.ID] = m.Meta.Commands
	}
	for _, sv := range servers {
		if sv.Suffrage != raft.Voter {
			continue
		}
		c, ok := commands[string(sv.ID)]
		switch {
		case !ok:
			return false, fmt.Sprintf("voter %s is not in gossip", sv.ID)
		case c < int(ct):
			return false, fmt.Sprintf("voter %s applies commands up to %d, not %d", sv.ID, c, ct)
		}
	}
	return true, ""
}

// upsertMember writes a membership record at now, the leader's time. The
// same command deletes the records of members dead for longer than the
// retention.
func (s *Server) upsertMember(ctx context.Context, now time.Time, m *raftpb.MemberRecord) error {
	cmd := &raftpb.UpsertMemberCommand{NowUnixNano: now.UnixNano(), Member: m}
	if s.cfg.MemberRetention > 0 {
		cmd.PruneDeadBeforeUnixNano = now.Add(-s.cfg.MemberRetention).UnixNano()
	}
	resp, _, err := s.apply(ctx, fsm.CmdUpsertMember, cmd)
	if err != nil {
		return err
	}
	if pruned := resp.(*raftpb.UpsertMemberResult).GetPruned(); len(pruned) > 0 {
		s.metrics.membersPruned.Add(float64(len(pruned)))
		s.logger.Info("records of long-dead members deleted", "members", pruned, "retention", s.cfg.MemberRetention)
	}
	return nil
}

// expireLeases marks every member whose lease expired on this leader's clock.
func (s *Server) expireLeases(ctx context.Context, t *leaderTerm) {
	for _, l := range t.leases.Expired(s.now()) {
		err := s.upsertMember(ctx, s.now(), &raftpb.MemberRecord{MemberId: l.MemberID, Role: l.Role, Incarnation: l.Incarnation,
			Address: l.Address, State: raftpb.MemberState_MEMBER_STATE_EXPIRED})
		switch {
		case err == nil, errors.Is(err, fsm.ErrStaleIncarnation):
			t.leases.Remove(l.MemberID, l.Incarnation)
			if t.routes != nil {
				t.routes.forget(l.MemberID, l.Incarnation)
			}
			s.metrics.expired.Inc()
			s.logger.Info("lease expired", "member_id", l.MemberID, "incarnation", l.Incarnation, "role", l.Role.String())
		default:
			s.logger.Warn("cannot record lease expiry", "member_id", l.MemberID, logging.Err(err))
			return
		}
	}
}

// runCustody reassigns the sessions of every dirty edge whose owning
// incarnation is no longer alive to live custodians, in batched entries. An
// edge stays dirty until a scan finds nothing left to move; that scan also
// starts the grace before the edge's dead incarnations lose their routes.
func (s *Server) runCustody(ctx context.Context, t *leaderTerm) {
	t.dirtyMu.Lock()
	edges := make([]string, 0, len(t.dirty))
	for e := range t.dirty {
		edges = append(edges, e)
	}
	t.dirtyMu.Unlock()
	if len(edges) == 0 {
		return
	}
	sort.Strings(edges)
	st := s.fsm.State()
	now := s.now()
	var candidates []string
	incs := map[string]uint64{}
	for _, l := range t.leases.Valid(raftpb.MemberRole_MEMBER_ROLE_EDGE, raftpb.MemberState_MEMBER_STATE_ALIVE, now) {
		if m := st.Member(l.MemberID); m != nil && m.GetIncarnation() == l.Incarnation && m.GetState() == raftpb.MemberState_MEMBER_STATE_ALIVE {
			candidates = append(candidates, l.MemberID)
			incs[l.MemberID] = l.Incarnation
		}
	}
	for _, edge := range edges {
		rec := st.Member(edge)
		byInc := map[uint64][]*raftpb.SessionRecord{}
		st.SessionsOwnedBy(edge, func(r *raftpb.SessionRecord) bool {
			if rec == nil || rec.GetState() != raftpb.MemberState_MEMBER_STATE_ALIVE || r.GetOwnerIncarnation() != rec.GetIncarnation() {
				byInc[r.GetOwnerIncarnation()] = append(byInc[r.GetOwnerIncarnation()], r)
			}
			return true
		})
		if len(byInc) == 0 {
			t.dirtyMu.Lock()
			if t.dirty[edge] <= st.Index() {
				delete(t.dirty, edge)
			}
			t.dirtyMu.Unlock()
			if t.routes != nil {
				t.routes.adopted(rec, now, st.Index())
			}
			continue
		}
		// The FSM never moves a session to its own edge ID, whatever the
		// incarnation (applyReassignSessions), so a rejoined edge cannot
		// adopt its old incarnation's sessions: proposing it would write an
		// entry that moves nothing on every tick and leave those sessions
		// with the dead incarnation for good. A client reconnecting to the
		// rejoined edge takes its session from the custodian by a claim.
		custodians := slices.DeleteFunc(slices.Clone(candidates), func(c string) bool { return c == edge })
		if len(custodians) == 0 {
			s.logger.Warn("no live edge to take custody", logging.KeyEdgeID, edge)
			continue
		}
		for inc, recs := range byInc {
			for start := 0; start < len(recs); start += s.cfg.CustodyBatch {
				chunk := recs[start:min(start+s.cfg.CustodyBatch, len(recs))]
				cmd := &raftpb.ReassignSessionsCommand{NowUnixNano: now.UnixNano(), FromEdgeId: edge, FromIncarnation: inc}
				for _, r := range chunk {
					to := custodians[lease.Custodian(r.GetTenant(), r.GetClientId(), custodians)]
					cmd.Assignments = append(cmd.Assignments, &raftpb.Reassignment{Tenant: r.GetTenant(), ClientId: r.GetClientId(),
						ToEdgeId: to, ToIncarnation: incs[to]})
				}
				msg, _, err := s.apply(ctx, fsm.CmdReassignSessions, cmd)
				if err != nil {
					s.logger.Warn("custody reassignment failed", logging.KeyEdgeID, edge, logging.Err(err))
					return
				}
				res := msg.(*raftpb.ReassignSessionsResult)
				n := 0
				for i, ok := range res.GetApplied() {
					if ok {
						n++
						if t.routes != nil {
							a := cmd.Assignments[i]
							t.routes.assigned(edge, inc, a.GetToEdgeId(), a.GetToIncarnation(), res.GetEpoch())
							if origin, originInc := fsm.CustodyOrigin(chunk[i]); origin != "" && origin != edge {
								t.routes.assigned(origin, originInc, a.GetToEdgeId(), a.GetToIncarnation(), res.GetEpoch())
							}
						}
					}
				}
				s.metrics.custody.Add(float64(n))
				s.logger.Info("sessions reassigned to custodians", logging.KeyEdgeID, edge, "incarnation", inc, "sessions", n)
			}
		}
	}
}

// reconcileVoters adds every coordinator found by gossip that is not a voter
// yet, and, if DeadServerTimeout is set, removes voters missing from gossip
// for that long as long as the alive voters stay a majority without them.
//
// A coordinator that advertises an older command set than this one's is
// not added (refused, logged once per node): the log it would replay may
// hold entries it cannot decode, and a node stops at such an entry. That
// is a downgrade, never a rolling update, in which every node updated is
// a voter already; a voter's new address is taken whatever its version.
func (s *Server) reconcileVoters(missing map[string]time.Time, refused map[string]int) {
	if s.peers == nil {
		return
	}
	servers, err := s.node.Servers()
	if err != nil {
		return
	}
	known := map[string]raft.Server{}
	for _, sv := range servers {
		known[string(sv.ID)] = sv
	}
	alive := map[string]bool{}
	stillRefused := map[string]int{}
	defer func() {
		clear(refused)
		maps.Copy(refused, stillRefused)
		s.metrics.votersRefused.Set(float64(len(refused)))
	}()
	for _, m := range s.peers.Coordinators() {
		alive[m.Meta.ID] = true
		sv, ok := known[m.Meta.ID]
		if m.Meta.RaftAddr == "" || (ok && string(sv.Address) == m.Meta.RaftAddr) {
			continue
		}
		if !ok && m.Meta.Commands < int(fsm.NewestCommand) {
			if c, logged := refused[m.Meta.ID]; !logged || c != m.Meta.Commands {
				s.logger.Error("coordinator not added as a voter: it applies an older command set than this cluster's log may hold (a downgrade?)",
					"node_id", m.Meta.ID, "addr", m.Meta.RaftAddr, "applies_up_to", m.Meta.Commands, "cluster_applies_up_to", int(fsm.NewestCommand))
			}
			stillRefused[m.Meta.ID] = m.Meta.Commands
			continue
		}
		if err := s.node.AddVoter(m.Meta.ID, m.Meta.RaftAddr); err != nil {
			s.logger.Warn("cannot add voter", "node_id", m.Meta.ID, logging.Err(err))
			continue
		}
		s.logger.Info("added voter", "node_id", m.Meta.ID, "addr", m.Meta.RaftAddr)
	}
	if s.cfg.DeadServerTimeout <= 0 {
		return
	}
	aliveVoters := 0
	for id := range known {
		if alive[id] {
			aliveVoters++
			delete(missing, id)
		} else if _, ok := missing[id]; !ok {
			missing[id] = time.Now()
		}
	}
	for id, since := range missing {
		if _, ok := known[id]; !ok {
			delete(missing, id)
			continue
		}
		if time.Since(since) < s.cfg.DeadServerTimeout || aliveVoters <= (len(known)-1)/2 {
			continue
		}
		if err := s.node.RemoveServer(id); err != nil {
			s.logger.Warn("cannot remove dead voter", "node_id", id, logging.Err(err))
			continue
		}
		s.logger.Info("removed dead voter", "node_id", id, "missing_for", time.Since(since))
		delete(missing, id)
		delete(known, id)
	}
}

// installSlotTable writes the slot table of Config.RedisGroups groups if
// the cluster has none and K > 1 (no table means one group). K is fixed at
// install: a table in place is never changed here, since moving a slot
// would strand the sessions stored under it in their old group.
func (s *Server) installSlotTable(ctx context.Context, st *fsm.State) {
	k := max(s.cfg.RedisGroups, 1)
	if cur := st.SlotTable(); cur != nil {
		if have := int(slices.Max(cur.GetSlotGroups())) + 1; have != k {
			s.logger.Error("redis.groups differs from the installed slot table; keeping the table (K is fixed at install)",
				"redis_groups", k, "installed", have)
		}
		return
	}
	// One group gets its table too: a member reading the cluster's
	// config can then tell "one group" from "not installed yet", and waits
	// for the table rather than taking a K=1 it may be wrong about.
	for {
		res, _, err := s.apply(ctx, fsm.CmdSetSlotTable, &raftpb.SetSlotTableCommand{SlotGroups: slots.Even(k)})
		if err == nil {
			if r, _ := res.(*raftpb.SetSlotTableResult); r.GetSwapped() {
				s.logger.Info("slot table installed", "redis_groups", k)
			}
			return
		}
		s.logger.Warn("installing the slot table failed; retrying", logging.Err(err))
		select {
		case <-ctx.Done():
			return
		case <-time.After(100 * time.Millisecond):
		}
	}
}
