package server

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	routes          *prometheus.CounterVec // changes applied by kind and op
	lookups         prometheus.Counter
	lookupSeconds   prometheus.Histogram
	applySeconds    prometheus.Histogram // route visibility lag: delta received to durable and notified
	resyncs         prometheus.Counter
	wildcardRoutes  prometheus.Gauge
	wildcardRejects prometheus.Counter
	edges           prometheus.Gauge
	forwards        prometheus.Counter
	bloomRebuilds   prometheus.Counter
	cachers         prometheus.Gauge
	lookupsRefused  prometheus.Counter
	notifyOutboxes  prometheus.Gauge
	settled         prometheus.Gauge
	unsettled       prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		routes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "keel_router_route_changes_total",
			Help: "Route changes applied by this node as key owner, by kind (anchored, wildcard, shared) and op."}, []string{"kind", "op"}),
		lookups: prometheus.NewCounter(prometheus.CounterOpts{Name: "keel_router_lookups_total", Help: "Lookup calls served."}),
		lookupSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "keel_router_lookup_seconds",
			Help: "Lookup latency.", Buckets: prometheus.ExponentialBuckets(50e-6, 2, 14)}),
		applySeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "keel_router_route_visibility_seconds",
			Help: "Route visibility lag: delta batch received to durable in Olric and invalidations acknowledged.", Buckets: prometheus.ExponentialBuckets(100e-6, 2, 16)}),
		resyncs:         prometheus.NewCounter(prometheus.CounterOpts{Name: "keel_router_resyncs_total", Help: "Full route set snapshots received from edges."}),
		wildcardRoutes:  prometheus.NewGauge(prometheus.GaugeOpts{Name: "keel_router_wildcard_routes", Help: "Wildcard-first routes held in this node's replica, all tenants."}),
		wildcardRejects: prometheus.NewCounter(prometheus.CounterOpts{Name: "keel_router_wildcard_rejects_total", Help: "Wildcard-first route adds refused by the per-tenant cap."}),
		edges:           prometheus.NewGauge(prometheus.GaugeOpts{Name: "keel_router_connected_edges", Help: "Edges with an open RouteSync stream to this node."}),
		forwards:        prometheus.NewCounter(prometheus.CounterOpts{Name: "keel_router_forwarded_deltas_total", Help: "Deltas forwarded to the owning router node."}),
		bloomRebuilds:   prometheus.NewCounter(prometheus.CounterOpts{Name: "keel_router_bloom_rebuilds_total", Help: "Tenant anchor Bloom filters created or rebuilt larger (each is sent whole to every edge)."}),
		cachers:         prometheus.NewGauge(prometheus.GaugeOpts{Name: "keel_router_cacher_records", Help: "(tenant, anchor, edge) cache records kept for invalidation, after the last sweep."}),
		lookupsRefused:  prometheus.NewCounter(prometheus.CounterOpts{Name: "keel_router_lookups_refused_total", Help: "Lookups refused while the node loads its replicas, or while a new table waits for the edges to register their routes."}),
		notifyOutboxes: prometheus.NewGauge(prometheus.GaugeOpts{Name: "keel_router_notify_backlog_nodes",
			Help: "Router nodes this node holds undelivered notifications for (they did not answer within a cache lease)."}),
		settled: prometheus.NewGauge(prometheus.GaugeOpts{Name: "keel_router_settled",
			Help: "1 while this node's route answers are complete; 0 while a router membership change is being settled (its edges send every publish to every edge)."}),
		unsettled: prometheus.NewCounter(prometheus.CounterOpts{Name: "keel_router_unsettles_total",
			Help: "Times this node's route answers became unsettled by a router membership change."}),
	}
	if reg != nil {
		reg.MustRegister(m.routes, m.lookups, m.lookupSeconds, m.applySeconds, m.resyncs, m.wildcardRoutes, m.wildcardRejects, m.edges, m.forwards, m.bloomRebuilds, m.cachers, m.lookupsRefused, m.notifyOutboxes, m.settled, m.unsettled)
	}
	return m
}
