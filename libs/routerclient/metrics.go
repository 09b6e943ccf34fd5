package routerclient

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the client's Prometheus metrics. Counts that Route updates are
// read from [Stats] at scrape time, so the publish path pays nothing for them.
type metrics struct {
	lookupSeconds prometheus.Histogram
	streamErrors  prometheus.Counter
	snapshots     prometheus.Counter
}

func newMetrics(reg prometheus.Registerer, c *Client) (*metrics, error) {
	m := &metrics{
		lookupSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "keel_edge_route_lookup_seconds",
			Help: "Latency of Lookup RPCs to the router, failed ones included.", Buckets: prometheus.ExponentialBuckets(50e-6, 2, 14)}),
		streamErrors: prometheus.NewCounter(prometheus.CounterOpts{Name: "keel_edge_route_stream_errors_total",
			Help: "RouteSync streams that ended with an error (the client reconnects)."}),
		snapshots: prometheus.NewCounter(prometheus.CounterOpts{Name: "keel_edge_route_snapshots_total",
			Help: "Full route set snapshots sent to the router (digest mismatch or resync)."}),
	}
	if reg == nil {
		return m, nil
	}
	stat := func(f func(Stats) uint64) func() float64 {
		return func() float64 { return float64(f(c.Stats())) }
	}
	probe := func(result string, f func(Stats) uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "keel_edge_route_anchor_probes_total",
			Help:        "Anchor probes by result: cache_hit, bloom_negative, or miss (needs a Lookup).",
			ConstLabels: prometheus.Labels{"result": result}}, stat(f))
	}
	cs := []prometheus.Collector{
		m.lookupSeconds, m.streamErrors, m.snapshots,
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "keel_edge_route_requests_total",
			Help: "Route calls (one per publish)."}, stat(func(s Stats) uint64 { return s.Routes })),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "keel_edge_route_local_answers_total",
			Help: "Route calls answered from the edge's trie, cache and Bloom filters with no RPC; divided by keel_edge_route_requests_total it is the edge cache hit ratio."},
			stat(func(s Stats) uint64 { return s.Local })),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "keel_edge_route_unsettled_answers_total",
			Help: "Route answers given while the router settled a membership change: the publish went to every edge."},
			stat(func(s Stats) uint64 { return s.Unsettled })),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "keel_edge_route_unsettled",
			Help: "1 while the router says its answers may miss routes (publishes go to every edge)."}, func() float64 {
			c.mu.Lock()
			defer c.mu.Unlock()
			if c.unsettled {
				return 1
			}
			return 0
		}),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "keel_edge_route_lookups_total",
			Help: "Successful Lookup RPCs."}, stat(func(s Stats) uint64 { return s.Lookups })),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "keel_edge_route_lookup_errors_total",
			Help: "Failed Lookup RPCs (retried)."}, stat(func(s Stats) uint64 { return s.LookupErrors })),
		probe("cache_hit", func(s Stats) uint64 { return s.CacheHits }),
		probe("bloom_negative", func(s Stats) uint64 { return s.BloomNegatives }),
		probe("miss", func(s Stats) uint64 { return s.Misses }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "keel_edge_route_cache_entries",
			Help: "Anchor answers held in the route cache, expired ones included."}, func() float64 {
			c.mu.Lock()
			defer c.mu.Unlock()
			return float64(len(c.cache))
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "keel_edge_route_ready",
			Help: "1 while the client holds the full wildcard table and Bloom filters under a live lease."}, func() float64 {
			c.mu.Lock()
			defer c.mu.Unlock()
			if c.validLocked(time.Now()) {
				return 1
			}
			return 0
		}),
	}
	for _, col := range cs {
		if err := reg.Register(col); err != nil {
			return nil, err
		}
	}
	return m, nil
}
