package broker

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"go.opentelemetry.io/otel/trace"

	"github.com/keelmq/keel/libs/tracing"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

// Proto returns the cluster form of m: outside topic and client ID, with its
// tenant, msgID and MQTT 5 properties.
func (m *Message) Proto() *commonv1.Message {
	tenant, topic, _ := tenancy.TenantOfTopic(m.Topic)
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
	return out
}

// fromProto builds the edge's form of a message another edge forwarded.
func (b *Broker) fromProto(pm *commonv1.Message) (*Message, error) {
	sc, err := b.scope(pm.GetTenant())
	if err != nil {
		return nil, fmt.Errorf("forwarded message: %w", err)
	}
	if pm.GetTopic() == "" || pm.GetQos() > 2 {
		return nil, fmt.Errorf("forwarded message: bad topic or QoS")
	}
	m := &Message{
		ID:      MsgID{Edge: pm.GetId().GetEdgeId(), Incarnation: pm.GetId().GetIncarnation(), Seq: pm.GetId().GetSeq()},
		Payload: pm.GetPayload(),
		QoS:     byte(pm.GetQos()),
		Retain:  pm.GetRetain(),
		Created: pm.GetIngressUnixNano(),
		Props: Props{ContentType: pm.GetContentType(), ResponseTopic: pm.GetResponseTopic(),
			CorrelationData: pm.GetCorrelationData()},
	}
	m.Topic, m.Origin = sc.TopicAndClientID(pm.GetTopic(), pm.GetClientId())
	if pm.GetPayloadFormat() > 0 {
		m.Props.PayloadFormat, m.Props.PayloadFormatFlag = byte(pm.GetPayloadFormat()), true
	}
	if pm.MessageExpiryInterval != nil {
		m.Props.MessageExpiryInterval = pm.GetMessageExpiryInterval()
		m.Expiry = pm.GetIngressUnixNano()/int64(time.Second) + int64(min(pm.GetMessageExpiryInterval(), uint32(b.cfg.MaxMessageExpiry)))
	}
	for _, u := range pm.GetUserProperties() {
		m.Props.User = append(m.Props.User, packets.UserProperty{Key: u.GetKey(), Val: u.GetValue()})
	}
	return m, nil
}

// DeliverForwarded takes a message another edge forwarded: it goes to this
// edge's local recipients only (it was offered to the output and forwarded
// at its ingress edge already). It returns once they took it.
//
// A sampled span in ctx (the forward server's deliver span, which joined
// the sender's trace) becomes the message's span here.
//
// A message that fails after members of shared groups here took it is sent
// again: those members are remembered for it (sharedPicks), and those of
// every QoS 2 message, which its publisher may send again.
func (b *Broker) DeliverForwarded(ctx context.Context, pm *commonv1.Message, shared SharedChoice) (failed error) {
	m, err := b.fromProto(pm)
	if err != nil {
		return err
	}
	defer func() { b.rememberDelivery(m, failed) }()
	// Looked up only while tracing is on: the span's key is not in the
	// stream's context, so the lookup walks all of it, for every message
	// (2% of a receiving edge's CPU with tracing off).
	if tracing.Enabled() {
		if span := trace.SpanFromContext(ctx); span.IsRecording() {
			m.span = span
		}
	}
	m.deferred = deferredFrom(ctx)
	m.quiet = m.deferred != nil && m.deferred.Quiet
	if m.Retain {
		_ = b.retain(m) // counted and logged; the publishing edge stored it too
	}
	// Published before sessions it matches left this edge, m may have to
	// go to their new owners too (handedOver). Decided once the recipients
	// here are known, and before they get it: relays that cannot be made
	// (an owner not known yet) refuse m with nothing delivered.
	var relays handedRelays
	// The handed-over index's generation once the recipients here are
	// matched (check runs after the match): see lateRelays.
	gen := b.handed.gen.Load()
	served, err := b.deliverLocal(m, shared, func(served []*shareGroup) error {
		gen = b.handed.gen.Load()
		var err error
		relays, err = b.handedRelaysFor(m, shared, served)
		return err
	})
	if errors.Is(err, errOwnerUnknown) {
		return err
	}
	// A group this edge was chosen for that has no member here any more may
	// have had one that left this edge before m came: m goes to it.
	if rerr := b.relayTo(ctx, m, relays.groups); rerr != nil {
		// Sent again, m is offered to the groups again (and reported then).
		return errors.Join(err, rerr)
	}
	if shared.Origin != nil {
		b.reportUnserved(m, shared, served, relays.relayed)
	}
	if err != nil || shared.Only {
		return err
	}
	// The session's new owner may not have been routed to. Decided again
	// now that m was delivered here: a session handed over meanwhile
	// (matched here, and gone before it got m) is among them.
	plain := relays.plain
	if b.handed.mayRelay(m) {
		var unknown bool
		if plain, unknown = b.handed.lateRelays(m, time.Now(), gen); unknown {
			b.m.handoverRelays.WithLabelValues("owner_unknown").Inc()
			return errOwnerUnknown
		}
	}
	return b.relayTo(ctx, m, plain)
}
