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
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	"github.com/keelmq/keel/services/edge/internal/broker"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
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
func (s *Sink) Offer(m *broker.Message) bool {
	tenant, topic, ok := tenancy.TenantOfTopic(m.Topic)
	if !ok {
		return false
	}
	var clientID string
	if m.Origin != "" {
		_, clientID, _ = tenancy.TenantOfClientID(m.Origin)
	}
	out := &commonv1.Message{
		Id:              &commonv1.MsgID{EdgeId: m.ID.Edge, Incarnation: m.ID.Incarnation, Seq: m.ID.Seq},
		Tenant:          tenant,
		Topic:           topic,
		Payload:         m.Payload,
		Qos:             uint32(m.QoS),
		Retain:          m.Retain,
		IngressUnixNano: m.Created,
		ClientId:        clientID,
		ContentType:     m.Props.ContentType,
		ResponseTopic:   m.Props.ResponseTopic,
		CorrelationData: m.Props.CorrelationData,
	}
	if m.Props.PayloadFormatFlag {
		out.PayloadFormat = uint32(m.Props.PayloadFormat)
	}
	if e := m.Props.MessageExpiryInterval; e > 0 {
		out.MessageExpiryInterval = &e
	}
	for _, u := range m.Props.User {
		out.UserProperties = append(out.UserProperties, &commonv1.UserProperty{Key: u.Key, Value: u.Val})
	}
	return s.client.Offer(out)
}

var _ broker.Output = (*Sink)(nil)
