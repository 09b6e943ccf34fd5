package remotestore

import "github.com/prometheus/client_golang/prometheus"

// Op outcomes, the status label of keel_edge_persistence_ops_total.
const (
	statusOK = iota
	statusFenced
	statusNotReplicated
	statusGroupFenced
	statusInvalid
	statusUnavailable
	statusBroken  // the stream ended before the answer
	statusExpired // waited too long for a stream
	statusClosed
	statusQuota // an offline enqueue refused by the tenant's queue bound
	numStatus
)

var statusNames = [numStatus]string{"ok", "fenced", "not_replicated", "group_fenced", "invalid", "unavailable",
	"broken", "expired", "closed", "tenant_quota"}

type metrics struct {
	batches    prometheus.Counter
	batchOps   prometheus.Histogram
	ops        *prometheus.CounterVec
	write      prometheus.Histogram
	reconnects prometheus.Counter
	byStatus   [numStatus]prometheus.Counter
}

// newMetrics registers the store's metrics on reg (nil: not registered).
func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		batches: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_persistence_batches_total", Help: "Write batches sent to the persistence service.",
		}),
		batchOps: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "keel_edge_persistence_batch_ops", Help: "Ops per write batch sent to the persistence service.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 12),
		}),
		ops: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_edge_persistence_ops_total", Help: "Write ops answered, by outcome.",
		}, []string{"status"}),
		write: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "keel_edge_persistence_write_seconds", Help: "Time from sending a write batch to its answer.",
			Buckets: prometheus.ExponentialBuckets(50e-6, 2, 16),
		}),
		reconnects: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_persistence_stream_reconnects_total", Help: "Write streams to the persistence service opened after one ended.",
		}),
	}
	// Every status is exported from the start, so a rate over it exists
	// before the first failure; and the hot path looks no label up.
	for i, name := range statusNames {
		m.byStatus[i] = m.ops.WithLabelValues(name)
	}
	if reg != nil {
		reg.MustRegister(m.batches, m.batchOps, m.ops, m.write, m.reconnects)
	}
	return m
}
