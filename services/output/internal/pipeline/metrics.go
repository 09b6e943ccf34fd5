package pipeline

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the output service's pipeline metrics. Label "rule" is the
// pipeline name (tenant/rule), "sink" the sink plugin ID.
type Metrics struct {
	In         *prometheus.CounterVec
	Out        *prometheus.CounterVec
	Retries    *prometheus.CounterVec
	Errors     *prometheus.CounterVec
	Dropped    *prometheus.CounterVec
	Filtered   *prometheus.CounterVec
	Latency    *prometheus.HistogramVec
	WriteTime  *prometheus.HistogramVec
	Restarts   *prometheus.CounterVec
	Buffered   *prometheus.GaugeVec
	Unmatched  prometheus.Counter
	Invalid    *prometheus.CounterVec
	Reloads    *prometheus.CounterVec
	PluginUp   *prometheus.GaugeVec
	registerer prometheus.Registerer
}

// NewMetrics registers the metrics on reg (nil: unregistered, for tests).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	rs := []string{"rule", "sink"}
	m := &Metrics{
		In: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "keel_output_records_in_total",
			Help: "Records taken into a pipeline's buffer."}, rs),
		Out: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "keel_output_records_out_total",
			Help: "Records the sink acknowledged."}, rs),
		Retries: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "keel_output_retries_total",
			Help: "Batches retried after a failed transform or sink write."}, rs),
		Errors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "keel_output_errors_total",
			Help: "Failed plugin calls, by stage (transform, sink, launch)."}, append(rs, "stage")),
		Dropped: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "keel_output_dropped_total",
			Help: "Records dropped, by reason: buffer_full, rejected (sink refused, not retryable), removed (rule deleted), shutdown."}, append(rs, "reason")),
		Filtered: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "keel_output_filtered_total",
			Help: "Records a transform removed on purpose."}, rs),
		Latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "keel_output_latency_seconds",
			Help:    "From MQTT ingress to the sink's acknowledgement.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 1.5, 26)}, rs),
		WriteTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "keel_output_sink_write_seconds",
			Help:    "Duration of one sink Write call (one batch).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)}, rs),
		Restarts: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "keel_output_plugin_restarts_total",
			Help: "Plugin processes relaunched after a crash, hang or exit, counted when the relaunch succeeds (failed attempts count in keel_output_errors_total{stage=\"launch\"})."}, []string{"rule", "plugin"}),
		Buffered: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "keel_output_buffered_records",
			Help: "Records waiting in a pipeline's buffer."}, []string{"rule"}),
		Unmatched: prometheus.NewCounter(prometheus.CounterOpts{Name: "keel_output_unmatched_total",
			Help: "Records received that matched no rule."}),
		Invalid: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "keel_output_invalid_records_total",
			Help: "Records refused on receipt, by reason: malformed, no_message, bad_tenant, no_topic."}, []string{"reason"}),
		Reloads: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "keel_output_rules_reloads_total",
			Help: "Rules reloads, by result (ok, error)."}, []string{"result"}),
		PluginUp: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "keel_output_plugin_up",
			Help: "1 while a pipeline's plugins are running and configured."}, []string{"rule"}),
	}
	if reg != nil {
		reg.MustRegister(m.In, m.Out, m.Retries, m.Errors, m.Dropped, m.Filtered, m.Latency, m.WriteTime,
			m.Restarts, m.Buffered, m.Unmatched, m.Invalid, m.Reloads, m.PluginUp)
	}
	return m
}

// pipeMetrics are one pipeline's curried metrics.
type pipeMetrics struct {
	in, out, retries, filtered          prometheus.Counter
	errTransform, errSink, errLaunch    prometheus.Counter
	dropFull, dropRejected, dropRemoved prometheus.Counter
	dropShutdown                        prometheus.Counter
	latency, writeTime                  prometheus.Observer
	buffered, up                        prometheus.Gauge
	m                                   *Metrics
	rule                                string
}

func (m *Metrics) forPipeline(rule, sink string) *pipeMetrics {
	return &pipeMetrics{
		in: m.In.WithLabelValues(rule, sink), out: m.Out.WithLabelValues(rule, sink),
		retries: m.Retries.WithLabelValues(rule, sink), filtered: m.Filtered.WithLabelValues(rule, sink),
		errTransform: m.Errors.WithLabelValues(rule, sink, "transform"), errSink: m.Errors.WithLabelValues(rule, sink, "sink"),
		errLaunch: m.Errors.WithLabelValues(rule, sink, "launch"),
		dropFull:  m.Dropped.WithLabelValues(rule, sink, "buffer_full"), dropRejected: m.Dropped.WithLabelValues(rule, sink, "rejected"),
		dropRemoved: m.Dropped.WithLabelValues(rule, sink, "removed"), dropShutdown: m.Dropped.WithLabelValues(rule, sink, "shutdown"),
		latency: m.Latency.WithLabelValues(rule, sink), writeTime: m.WriteTime.WithLabelValues(rule, sink),
		buffered: m.Buffered.WithLabelValues(rule), up: m.PluginUp.WithLabelValues(rule),
		m: m, rule: rule,
	}
}

func (pm *pipeMetrics) restart(plugin string) { pm.m.Restarts.WithLabelValues(pm.rule, plugin).Inc() }
