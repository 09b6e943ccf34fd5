package broker

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the edge's MQTT metrics. Label values are fixed sets, never
// client or topic names.
type metrics struct {
	connections       prometheus.GaugeFunc
	connects          *prometheus.CounterVec // result
	disconnects       *prometheus.CounterVec // reason
	authFailures      *prometheus.CounterVec // reason
	messagesIn        *prometheus.CounterVec // qos
	bytesIn           *prometheus.CounterVec
	messagesOut       *prometheus.CounterVec // qos
	bytesOut          *prometheus.CounterVec
	dropped           *prometheus.CounterVec // cause
	packetErrors      *prometheus.CounterVec // reason
	inflight          prometheus.GaugeFunc
	retained          prometheus.GaugeFunc
	subscriptions     prometheus.GaugeFunc
	sessions          prometheus.GaugeFunc
	publishWait       prometheus.Histogram
	slowConsumers     prometheus.Counter
	willsPublished    prometheus.Counter
	sharedRedispatch  *prometheus.CounterVec // outcome
	fencedSessions    prometheus.Counter
	throttledPubs     prometheus.Counter
	bans              prometheus.Counter
	acksDeferred      prometheus.Counter
	routedBehind      prometheus.Counter
	duplicatePubs     prometheus.Counter
	qos2Rerouted      prometheus.Counter
	retainedNotStored prometheus.Counter
	takeovers         prometheus.Counter
	takeoverRedirects prometheus.Counter
	lapsedDropped     prometheus.Counter
	handoverRelays    *prometheus.CounterVec
	forwardRetries    *prometheus.CounterVec
	relaysReceived    *prometheus.CounterVec
	resumedFromStore  prometheus.Counter
	adoptedSessions   *prometheus.CounterVec
	drainedSessions   *prometheus.CounterVec // outcome
	loadScore         prometheus.GaugeFunc
	aclRevoked        prometheus.Counter
	aclRefreshes      *prometheus.CounterVec // outcome
	writesAlone       *prometheus.CounterVec // outcome
}

func newMetrics(reg prometheus.Registerer, b *Broker) *metrics {
	m := &metrics{
		connections: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "keel_edge_connections", Help: "Connected MQTT clients.",
		}, func() float64 { return float64(atomic.LoadInt64(&b.server.Info.ClientsConnected)) }),
		connects: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_edge_connects_total", Help: "CONNECT attempts by result.",
		}, []string{"result"}),
		disconnects: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_edge_disconnects_total", Help: "Closed connections by reason.",
		}, []string{"reason"}),
		authFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_edge_auth_failures_total", Help: "Refused authentications by reason.",
		}, []string{"reason"}),
		messagesIn: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_edge_messages_in_total", Help: "PUBLISH packets accepted from clients, by QoS.",
		}, []string{"qos"}),
		bytesIn: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_edge_message_bytes_in_total", Help: "Payload bytes accepted from clients, by QoS.",
		}, []string{"qos"}),
		messagesOut: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_edge_messages_out_total", Help: "PUBLISH packets sent to clients, by QoS.",
		}, []string{"qos"}),
		bytesOut: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_edge_message_bytes_out_total", Help: "PUBLISH bytes written to clients, by QoS.",
		}, []string{"qos"}),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_edge_messages_dropped_total", Help: "Messages not delivered to a recipient, by cause.",
		}, []string{"cause"}),
		packetErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_edge_packet_errors_total", Help: "Refused or malformed packets, by reason.",
		}, []string{"reason"}),
		inflight: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "keel_edge_inflight_messages", Help: "QoS 1/2 messages awaiting acknowledgement.",
		}, func() float64 { return float64(atomic.LoadInt64(&b.server.Info.Inflight)) }),
		retained: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "keel_edge_retained_messages", Help: "Retained messages stored.",
		}, func() float64 { return float64(b.retained.len()) }),
		subscriptions: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "keel_edge_subscriptions", Help: "Subscriptions held.",
		}, func() float64 { return float64(b.index.count.Load()) }),
		sessions: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "keel_edge_sessions", Help: "Sessions held, connected or not.",
		}, func() float64 { return float64(b.sessionCount()) }),
		publishWait: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "keel_edge_publish_backpressure_seconds", Help: "Time a publisher waited for a full subscriber queue.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 4, 10),
		}),
		slowConsumers: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_slow_consumer_disconnects_total", Help: "Non-persistent clients disconnected with 0x97 because their queue stayed full.",
		}),
		willsPublished: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_wills_published_total", Help: "Will messages published.",
		}),
		sharedRedispatch: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_edge_shared_redispatched_total",
			Help: "Shared-group messages whose member's session ended (or whose client refused them) before acknowledging, by outcome: local, forwarded (to another edge's member), returned (to the edge that forwarded it, which keeps it and re-dispatches it), queued (for an offline persistent member), refused, no_member (dropped), qos2_dropped (committed to the member that went).",
		}, []string{"outcome"}),
		fencedSessions: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_sessions_fenced_total",
			Help: "Sessions given up because the store refused a write as fenced: a newer owner holds them.",
		}),
		throttledPubs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_publish_throttled_total", Help: "Publishes delayed by the per-client rate limit.",
		}),
		acksDeferred: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_publish_acks_deferred_total", Help: "QoS 1/2 publishes acknowledged after other edges took them, off the reading goroutine.",
		}),
		duplicatePubs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_publish_duplicates_ignored_total", Help: "PUBLISH packets ignored because their packet ID was still awaiting its acknowledgement.",
		}),
		qos2Rerouted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_publish_qos2_rerouted_total", Help: "QoS 2 publishes sent again after they were not acknowledged, routed under the msgID of their first copy.",
		}),
		retainedNotStored: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_retained_not_stored_total", Help: "Retained messages the store did not take; at QoS 1/2 their publish is not acknowledged.",
		}),
		takeovers: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_sessions_taken_over_total", Help: "Sessions given up to another edge that claimed them.",
		}),
		routedBehind: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_publishes_routed_behind_total",
			Help: "Publishes whose routes needed a call to the router (or followed one on the same topic), routed off the client's read loop.",
		}),
		takeoverRedirects: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_takeover_redirects_total",
			Help: "Takeovers sent on to another edge by the previous owner, which held no copy of the session because its own takeover from that edge had failed.",
		}),
		handoverRelays: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_edge_handover_relays_total",
			Help: "Attempts to relay a QoS 1/2 message, published before a session it matches was handed over to another edge and arriving after, to the session's new owner, by outcome (ok: the new owners took it; error: not taken, the sender sends it again; owner_unknown: not taken, the coordinator has not named the new owner of a fenced copy yet). A message counts once per attempt: again each time its sender sends it again, and once for its shared groups and once for its plain subscriptions when it is relayed for both.",
		}, []string{"outcome"}),
		relaysReceived: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_edge_relays_received_total",
			Help: "Messages relayed here by the previous owner of a session taken over, by order: kept (queued ahead of newer ones while the session settled), late (after the settle: newer ones may have been sent first).",
		}, []string{"order"}),
		forwardRetries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_edge_forward_retries_total",
			Help: "QoS 1/2 publishes routed again because an edge they were forwarded to left the cluster before taking them, by outcome (attempt: one routing again; taken: every edge with a match took it, it is acknowledged; gave_up: not within the forward bound, or the publisher left, it is not acknowledged).",
		}, []string{"outcome"}),
		lapsedDropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_lapsed_sessions_dropped_total",
			Help: "Sessions this edge held when its lease ran out, dropped when it rejoined under a new incarnation (their custodians or new owners serve them).",
		}),
		resumedFromStore: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_sessions_resumed_from_store_total", Help: "Persistent sessions resumed from the shared store because no live edge handed them over.",
		}),
		adoptedSessions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_edge_custody_sessions_total", Help: "Sessions of dead or draining edges assigned to this edge by the coordinator, by outcome.",
		}, []string{"outcome"}),
		drainedSessions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_edge_drained_sessions_total", Help: "Persistent sessions at a drain, by outcome: moved to a custodian edge, or stayed in this edge's store.",
		}, []string{"outcome"}),
		loadScore: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "keel_edge_load_score", Help: "Load of this edge for autoscaling, 1 being full: the larger of connections over --mqtt.load-connections and inbound messages per second over --mqtt.load-message-rate.",
		}, func() float64 { return b.loadScoreValue() }),
		bans: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_auth_bans_total", Help: "Bans of an IP address after repeated authentication failures.",
		}),
		aclRevoked: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "keel_edge_acl_revoked_subscriptions_total", Help: "Subscriptions removed because an ACL change no longer allows them (the client is not told: MQTT has no server-initiated unsubscribe).",
		}),
		aclRefreshes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_edge_acl_refreshes_total", Help: "Refreshes of the connected clients' ACLs after ACL version bumps, by outcome (ok, error: retried).",
		}, []string{"outcome"}),
		writesAlone: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_edge_deliveries_written_alone_total",
			Help: "Deliveries to an idle session written by the goroutine that queued them, by outcome (whole; partial: the socket took part, a writer wrote the rest; refused: it took none, a writer wrote it).",
		}, []string{"outcome"}),
	}
	reg.MustRegister(m.bans, m.connections, m.connects, m.disconnects, m.authFailures, m.messagesIn, m.bytesIn,
		m.messagesOut, m.bytesOut, m.dropped, m.packetErrors, m.inflight, m.retained, m.subscriptions,
		m.sessions, m.publishWait, m.slowConsumers, m.willsPublished, m.sharedRedispatch, m.fencedSessions, m.throttledPubs,
		m.acksDeferred, m.routedBehind, m.duplicatePubs, m.qos2Rerouted, m.retainedNotStored, m.takeovers, m.takeoverRedirects, m.handoverRelays, m.relaysReceived, m.forwardRetries, m.lapsedDropped, m.resumedFromStore, m.adoptedSessions, m.drainedSessions, m.loadScore,
		m.aclRevoked, m.aclRefreshes, m.writesAlone)
	return m
}

var qosLabel = [3]string{"0", "1", "2"}
