// Package metrics holds the persistence service's Prometheus metrics, named
// keel_persistence_<thing>_<unit>.
package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/keelmq/keel/services/persistence/internal/store"
)

// Metrics are the service's metrics. A nil *Metrics is valid and records
// nothing, for tests and tools.
type Metrics struct {
	// Ops counts write ops by kind and result status (rate: ops/s by kind).
	Ops *prometheus.CounterVec
	// Records counts records written by op kind (entries of an append, ...).
	Records *prometheus.CounterVec
	// BatchOps and BatchRecords are the sizes of Write batches.
	BatchOps, BatchRecords prometheus.Histogram
	// WriteLatency is from a batch's arrival to its answer.
	WriteLatency prometheus.Histogram
	// CommitCalls is the script calls per Redis pipeline (group commit).
	CommitCalls prometheus.Histogram
	// CommitLatency is one pipeline with its WAIT.
	CommitLatency prometheus.Histogram
	// WaitTimeouts counts pipelines whose WAIT did not see enough replicas.
	WaitTimeouts prometheus.Counter
	// QueueDrops counts queue entries dropped (oldest) or refused (newest,
	// by the session's bound or, tenant_quota, the tenant's), and entries
	// removed because their message is gone (expired).
	QueueDrops *prometheus.CounterVec
	// Failovers counts promotions this instance ran, and RecordChanges the
	// group records it followed.
	Failovers, RecordChanges prometheus.Counter
	// Unreplicated is 1 when the operator switched replication off.
	Unreplicated prometheus.Gauge
	// GroupEpoch is the record epoch this instance follows.
	GroupEpoch prometheus.Gauge
	// PrimaryUp is 1 while the recorded primary answers.
	PrimaryUp prometheus.Gauge
	// Switchovers counts operator switchovers run by this instance, by
	// result; SwitchoverPause is how long each paused the old primary.
	Switchovers     *prometheus.CounterVec
	SwitchoverPause prometheus.Histogram
	// RedisMemory is the primary's used_memory and maxmemory (kind "used",
	// "max"); AboveHighWater is 1 while appends are refused for memory.
	RedisMemory    *prometheus.GaugeVec
	AboveHighWater prometheus.Gauge
}

// New registers the metrics with reg.
func New(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Ops: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "keel_persistence_ops_total",
			Help: "Write ops by kind and result status."}, []string{"kind", "status"}),
		Records: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "keel_persistence_records_total",
			Help: "Records written by op kind."}, []string{"kind"}),
		BatchOps: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "keel_persistence_batch_ops",
			Help: "Ops per Write batch.", Buckets: prometheus.ExponentialBuckets(1, 2, 13)}),
		BatchRecords: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "keel_persistence_batch_records",
			Help: "Records per Write batch.", Buckets: prometheus.ExponentialBuckets(1, 2, 13)}),
		WriteLatency: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "keel_persistence_write_duration_seconds",
			Help: "Write batch latency, arrival to answer.", Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16)}),
		CommitCalls: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "keel_persistence_commit_calls",
			Help: "Script calls per Redis pipeline.", Buckets: prometheus.ExponentialBuckets(1, 2, 10)}),
		CommitLatency: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "keel_persistence_commit_duration_seconds",
			Help: "One Redis pipeline with its WAIT.", Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16)}),
		WaitTimeouts: prometheus.NewCounter(prometheus.CounterOpts{Name: "keel_persistence_wait_timeouts_total",
			Help: "Pipelines whose WAIT returned fewer replicas than required."}),
		QueueDrops: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "keel_persistence_queue_drops_total",
			Help: "Queue entries dropped (dropped_oldest) or refused (refused_newest) by a session's queue bound, refused by the tenant's (tenant_quota), and entries removed on load because their message expired (message_gone)."}, []string{"reason"}),
		Failovers: prometheus.NewCounter(prometheus.CounterOpts{Name: "keel_persistence_failovers_total",
			Help: "Redis promotions run by this instance."}),
		RecordChanges: prometheus.NewCounter(prometheus.CounterOpts{Name: "keel_persistence_record_changes_total",
			Help: "Group record changes this instance followed."}),
		Unreplicated: prometheus.NewGauge(prometheus.GaugeOpts{Name: "keel_persistence_unreplicated",
			Help: "1 when writes are acknowledged without any replica (operator switch); alert on it."}),
		GroupEpoch: prometheus.NewGauge(prometheus.GaugeOpts{Name: "keel_persistence_group_record_epoch",
			Help: "Record epoch of the Redis group this instance follows."}),
		PrimaryUp: prometheus.NewGauge(prometheus.GaugeOpts{Name: "keel_persistence_primary_up",
			Help: "1 while the recorded Redis primary answers."}),
		RedisMemory: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "keel_persistence_redis_memory_bytes",
			Help: "Redis primary memory: used_memory (kind=used) and maxmemory (kind=max, 0: none)"}, []string{"kind"}),
		AboveHighWater: prometheus.NewGauge(prometheus.GaugeOpts{Name: "keel_persistence_redis_above_high_water",
			Help: "1 while the primary's memory is above --redis.high-water of maxmemory and appends are refused"}),
		Switchovers: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "keel_persistence_switchovers_total",
			Help: "Operator Redis switchovers run by this instance, by result: ok, not_in_sync, busy, refused, bad_request, failed (undone), unknown."},
			[]string{"result"}),
		SwitchoverPause: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "keel_persistence_switchover_pause_seconds",
			Help: "How long a switchover paused writes on the old primary.", Buckets: prometheus.ExponentialBuckets(0.01, 2, 14)}),
	}
	reg.MustRegister(m.Ops, m.Records, m.BatchOps, m.BatchRecords, m.WriteLatency, m.CommitCalls, m.CommitLatency,
		m.WaitTimeouts, m.QueueDrops, m.Failovers, m.RecordChanges, m.Unreplicated, m.GroupEpoch, m.PrimaryUp,
		m.Switchovers, m.SwitchoverPause, m.RedisMemory, m.AboveHighWater)
	for _, r := range []string{"ok", "not_in_sync", "busy", "refused", "bad_request", "failed", "unknown"} {
		m.Switchovers.WithLabelValues(r)
	}
	for _, k := range store.OpKinds() {
		m.Records.WithLabelValues(k.String())
	}
	return m
}

// Memory is a redisstore.MemoryObserver.
func (m *Metrics) Memory(used, limit int64, full bool) {
	if m == nil {
		return
	}
	m.RedisMemory.WithLabelValues("used").Set(float64(used))
	m.RedisMemory.WithLabelValues("max").Set(float64(limit))
	v := 0.0
	if full {
		v = 1
	}
	m.AboveHighWater.Set(v)
}

// Committed implements redisstore.Observer.
func (m *Metrics) Committed(calls int, d time.Duration, waited, replicated bool) {
	if m == nil {
		return
	}
	m.CommitCalls.Observe(float64(calls))
	m.CommitLatency.Observe(d.Seconds())
	if waited && !replicated {
		m.WaitTimeouts.Inc()
	}
}
