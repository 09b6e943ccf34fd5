package forward

import "github.com/prometheus/client_golang/prometheus"

// Metrics of the forward links, shared by every link of an edge.
type Metrics struct {
	frameMessages prometheus.Histogram
	frames        prometheus.Counter
	resent        prometheus.Counter

	sharedHeld      prometheus.Gauge
	sharedOutcomes  *prometheus.CounterVec // kind
	sharedAbandoned prometheus.Counter
	sharedUnkept    prometheus.Counter
}

// NewMetrics registers the forward metrics on reg (nil: not registered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		frameMessages: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "keel_edge_forward_frame_messages", Help: "Messages per frame sent to another edge.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 10), // to 512: a run may take a frame past maxFrameMessages
		}),
		frames: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_forward_frames_total", Help: "Frames sent to other edges.",
		}),
		resent: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_forward_frames_resent_total", Help: "Frames sent again after a forward stream reconnected.",
		}),
		sharedHeld: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "keel_edge_forward_shared_held",
			Help: "QoS 1 shared-group messages forwarded to members on other edges and kept here until their outcome is reported.",
		}),
		sharedOutcomes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_edge_forward_shared_outcomes_total",
			Help: "Outcomes other edges reported for kept shared-group messages, by kind: acked, refused, member_gone (the last two are re-dispatched).",
		}, []string{"kind"}),
		sharedAbandoned: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_forward_shared_abandoned_total",
			Help: "Kept shared-group messages given up without an outcome: this edge stopped or rejoined, while the edge holding them lives on.",
		}),
		sharedUnkept: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_forward_shared_unkept_total",
			Help: "QoS 1 shared-group messages forwarded without being kept, because the peer already had as many kept as allowed.",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.frameMessages, m.frames, m.resent, m.sharedHeld, m.sharedOutcomes, m.sharedAbandoned, m.sharedUnkept)
	}
	return m
}
