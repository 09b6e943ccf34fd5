// Package output hands the edge's messages to the output service: every
// application message that one of the output service's rules matches goes
// into a bounded queue that never blocks MQTT delivery (drops are counted in
// keel_edge_output_dropped_total). The output service sends its rules' topic
// filters on the stream; the other messages are counted in
// keel_edge_output_skipped_total before anything is built for them.
package output

import (
	"context"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/keelmq/keel/libs/outputclient"
	"github.com/keelmq/keel/services/edge/internal/broker"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

// Sink adapts the output client to the broker's Output interface.
type Sink struct {
	client *outputclient.Client
}

// New builds a sink sending to the output service at url, with the queue
// bounds of cfg (zero values take the client's defaults).
func New(cfg outputclient.Config, url, edgeID string, incarnation uint64, logger *slog.Logger, reg prometheus.Registerer) (*Sink, error) {
	cfg.URL, cfg.EdgeID, cfg.Incarnation = url, edgeID, incarnation
	c, err := outputclient.New(cfg, logger, reg)
	if err != nil {
		return nil, err
	}
	return &Sink{client: c}, nil
}

// Run streams to the output service until ctx ends.
func (s *Sink) Run(ctx context.Context) error { return s.client.Run(ctx) }

// Offer implements broker.Output. It never blocks. The rules are matched on
// the outside topic of the message's tenant, which is how they are written
// and how the output service sees the message; its cluster form is built
// only for a message some rule matches.
func (s *Sink) Offer(m *broker.Message) bool {
	tenant, topic, _ := tenancy.TenantOfTopic(m.Topic)
	return s.client.Offer(tenant, topic, m.Proto)
}

var _ broker.Output = (*Sink)(nil)
