package server

import (
	"strconv"

	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	leaderChanges prometheus.Counter
	applyDuration *prometheus.HistogramVec
	claims        *prometheus.CounterVec
	claimBatch    prometheus.Histogram
	releaseBatch  prometheus.Histogram
	releases      *prometheus.CounterVec
	custody       prometheus.Counter
	expired       prometheus.Counter
	forwarded     *prometheus.CounterVec
	routeRemovals *prometheus.CounterVec
	membersPruned prometheus.Counter
	votersRefused prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer, s *Server) *metrics {
	m := &metrics{
		leaderChanges: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_coordinator_raft_leader_changes_total", Help: "Times this node gained or lost leadership."}),
		applyDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "keel_coordinator_raft_apply_duration_seconds", Help: "Time from proposal to applied on the leader, by command.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14)}, []string{"command"}),
		claims: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_coordinator_claims_total", Help: "Session claims answered, by result: granted, lease_invalid, invalid_argument (refused for their content, by any node), owner_changed (not owned by the expected owner), superseded (a request ID answered after a newer claim of its session), conflict (met a claim of the same session in every retry), not_applied."}, []string{"result"}),
		claimBatch: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "keel_coordinator_claim_batch_size", Help: "Claims per Raft entry.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 12)}),
		releases: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_coordinator_releases_total", Help: "Session releases answered, by result: released, absent, stale_epoch, not_owner, invalid_argument (refused for their content, by any node), not_applied."}, []string{"result"}),
		releaseBatch: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "keel_coordinator_release_batch_size", Help: "Session releases per Raft entry.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 12)}),
		custody: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_coordinator_custody_reassigned_total", Help: "Sessions reassigned to custodians."}),
		expired: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_coordinator_leases_expired_total", Help: "Member leases that expired on this leader's clock."}),
		forwarded: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_coordinator_forwarded_total", Help: "Requests forwarded to the leader, by procedure."}, []string{"procedure"}),
		membersPruned: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_coordinator_members_pruned_total", Help: "Records of members dead for longer than the retention that this leader deleted."}),
		votersRefused: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "keel_coordinator_voters_refused",
			Help: "Coordinators in gossip that this leader does not add as voters because they apply an older command set than its own (a downgrade); 0 on followers."}),
		routeRemovals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_coordinator_dead_edge_route_removals_total",
			Help: "RemoveEdge calls the leader made to the router for dead edges, by outcome (ok; unconfirmed: made once the adoption wait ran out although a live custodian had not reported its sessions adopted; error)."}, []string{"outcome"}),
	}
	// Both outcomes exist from the start, so a rate or an alert on errors
	// works before the first failure.
	m.routeRemovals.WithLabelValues("ok")
	m.routeRemovals.WithLabelValues("unconfirmed")
	m.routeRemovals.WithLabelValues("error")
	for _, r := range claimResults {
		m.claims.WithLabelValues(r)
	}
	for _, r := range releaseResults {
		m.releases.WithLabelValues(r)
	}
	if reg == nil {
		return m
	}
	stat := func(name, help, key string) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, func() float64 {
			r := s.node.Raft()
			if r == nil {
				return 0
			}
			v, _ := strconv.ParseFloat(r.Stats()[key], 64)
			return v
		})
	}
	reg.MustRegister(m.leaderChanges, m.applyDuration, m.claims, m.claimBatch, m.releases, m.releaseBatch, m.custody, m.expired, m.forwarded, m.routeRemovals, m.membersPruned, m.votersRefused,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "keel_coordinator_dead_edge_routes_pending",
			Help: "Dead edges whose routes the leader has yet to remove from the router (waiting for custody, the grace, or a retry); 0 on followers."},
			func() float64 {
				if t := s.term.Load(); t != nil && t.routes != nil {
					return float64(t.routes.len())
				}
				return 0
			}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "keel_coordinator_raft_state",
			Help: "Raft state: 0 follower, 1 candidate, 2 leader, 3 shutdown."}, func() float64 {
			if r := s.node.Raft(); r != nil {
				return float64(r.State())
			}
			return float64(raft.Shutdown)
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "keel_coordinator_raft_commit_index", Help: "Highest committed log index."},
			func() float64 {
				if r := s.node.Raft(); r != nil {
					return float64(r.CommitIndex())
				}
				return 0
			}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "keel_coordinator_raft_applied_index", Help: "Highest log index applied to the FSM."},
			func() float64 {
				if r := s.node.Raft(); r != nil {
					return float64(r.AppliedIndex())
				}
				return 0
			}),
		stat("keel_coordinator_raft_last_snapshot_index", "Index of the latest snapshot.", "last_snapshot_index"),
		stat("keel_coordinator_raft_term", "Current Raft term.", "term"),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "keel_coordinator_fsm_sessions", Help: "Session ownership records."},
			func() float64 { return float64(s.fsm.State().SessionCount()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "keel_coordinator_fsm_members", Help: "Member records."},
			func() float64 { return float64(len(s.fsm.State().Members())) }),
	)
	return m
}
