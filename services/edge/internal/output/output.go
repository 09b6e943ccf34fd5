// Package output hands the edge's messages to the output service: every
// application message goes into a bounded queue that never blocks MQTT
// delivery (drops are counted in keel_edge_output_dropped_total); the
// output service matches them against its rules.
package output

import (
	"context"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/keelmq/keel/libs/outputclient"
	"github.com/keelmq/keel/services/edge/internal/broker"
)

// Sink adapts the output client to the broker's Output interface.
type Sink struct {
	client *outputclient.Client
}

// New builds a sink sending to the output service at url.
func New(url, edgeID string, incarnation uint64, logger *slog.Logger, reg prometheus.Registerer) (*Sink, error) {
	c, err := outputclient.New(outputclient.Config{URL: url, EdgeID: edgeID, Incarnation: incarnation}, logger, reg)
	if err != nil {
		return nil, err
	}
	return &Sink{client: c}, nil
}

// Run streams to the output service until ctx ends.
func (s *Sink) Run(ctx context.Context) error { return s.client.Run(ctx) }

// Offer implements broker.Output. It never blocks.
func (s *Sink) Offer(m *broker.Message) bool { return s.client.Offer(m.Proto()) }

var _ broker.Output = (*Sink)(nil)
