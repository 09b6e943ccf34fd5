package forward

import "github.com/prometheus/client_golang/prometheus"

// Metrics of the forward links, shared by every link of an edge.
type Metrics struct {
	frameMessages prometheus.Histogram
	frames        prometheus.Counter
	resent        prometheus.Counter
}

// NewMetrics registers the forward metrics on reg (nil: not registered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		frameMessages: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "keel_edge_forward_frame_messages", Help: "Messages per frame sent to another edge.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 9),
		}),
		frames: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_forward_frames_total", Help: "Frames sent to other edges.",
		}),
		resent: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_forward_frames_resent_total", Help: "Frames sent again after a forward stream reconnected.",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.frameMessages, m.frames, m.resent)
	}
	return m
}
