package broker

import (
	"context"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/keelmq/keel/libs/tracing"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

// Spans of the edge (libs/tracing installs the provider; with none, none
// of this runs):
//
//	mqtt.connect   root, per CONNECT that authenticated or failed to
//	├─ auth        the authenticator's answer
//	└─ cluster.claim  the session claim (and under it the takeover and
//	               store calls, through the Connect interceptor)
//	mqtt.publish   root, per inbound PUBLISH whose trace is sampled, until
//	│              its PUBACK/PUBREC (or refusal)
//	├─ output      hand-off to the output service's queue
//	├─ forward     per peer edge, until the peer took it (forward package);
//	│  └─ deliver  on the peer edge, joined by the frame's traceparent
//	│     └─ persist
//	└─ persist     a durable session's stored copy of the message
//
// Only sampled messages carry a span (Message.span), so the decision is
// made once per publish and an unsampled message costs a nil check per
// step.
var tracer = tracing.NewTracer("github.com/keelmq/keel/services/edge/internal/broker")

// Span attribute keys (OpenTelemetry messaging conventions where they fit).
const (
	attrQoS         = attribute.Key("mqtt.qos")
	attrRetain      = attribute.Key("mqtt.retain")
	attrMsgID       = attribute.Key("messaging.message.id")
	attrTopic       = attribute.Key("messaging.destination.name")
	attrTopicLen    = attribute.Key("keel.topic.length")
	attrPayloadSize = attribute.Key("messaging.message.body.size")
	attrVersion     = attribute.Key("mqtt.protocol_version")
	attrListener    = attribute.Key("keel.listener")
	attrStore       = attribute.Key("keel.store")
	attrOffered     = attribute.Key("keel.output.offered")
)

// maxTracedTopic is the longest topic recorded on a span: longer ones may
// carry identifiers and only their length is recorded.
const maxTracedTopic = 64

// startPublish starts the span of an inbound PUBLISH in sc and returns it
// when its trace is sampled, nil otherwise (deciding costs no allocation).
func startPublish(sc *tenancy.Scope, m *Message) trace.Span {
	_, span := tracer.StartRoot(context.Background(), "mqtt.publish", trace.SpanKindServer, sc.Tenant())
	if span == nil {
		return nil
	}
	external, _ := sc.ExternalTopic(m.Topic)
	// Few attributes: each one is copied again on End and on export.
	var buf [5]attribute.KeyValue
	attrs := append(buf[:0], attrQoS.Int(int(m.QoS)), attrMsgID.String(msgIDString(m.ID)), attrPayloadSize.Int(len(m.Payload)))
	if len(external) <= maxTracedTopic {
		attrs = append(attrs, attrTopic.String(external))
	} else {
		attrs = append(attrs, attrTopicLen.Int(len(external)))
	}
	if m.Retain {
		attrs = append(attrs, attrRetain.Bool(true))
	}
	span.SetAttributes(attrs...)
	return span
}

// startConnect starts the span of a CONNECT once it authenticated (tenant
// known, for the sampler) or failed to, back-dated to its arrival, with an
// auth child covering the authenticator's answer.
func startConnect(cl *mqtt.Client, tenant string, arrived, authenticated time.Time, authErr error) (context.Context, trace.Span) {
	opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindServer), trace.WithTimestamp(arrived)}
	if tenant != "" {
		opts = append(opts, trace.WithAttributes(tracing.TenantKey.String(tenant)))
	}
	ctx, span := tracer.Start(context.Background(), "mqtt.connect", opts...)
	if !span.IsRecording() {
		return ctx, span
	}
	span.SetAttributes(attrVersion.Int(int(cl.Properties.ProtocolVersion)), attrListener.String(cl.Net.Listener))
	_, auth := tracer.Start(ctx, "auth", trace.WithTimestamp(arrived))
	endSpan(auth, authErr)
	auth.End(trace.WithTimestamp(authenticated))
	return ctx, span
}

// childSpan starts a span under m's span; nil when m is not traced.
func childSpan(m *Message, name string, attrs ...attribute.KeyValue) trace.Span {
	if m == nil || m.span == nil {
		return nil
	}
	_, span := tracer.Start(trace.ContextWithSpan(context.Background(), m.span), name, trace.WithAttributes(attrs...))
	return span
}

// endSpan records err on span, if any; it does not end the span.
func endSpan(span trace.Span, err error) {
	if span == nil || err == nil || !span.IsRecording() {
		return
	}
	span.RecordError(err)
	span.SetStatus(codes.Error, err.Error())
}

// finishSpan records err on span and ends it; span may be nil.
func finishSpan(span trace.Span, err error) {
	if span == nil {
		return
	}
	endSpan(span, err)
	span.End()
}

// offerTraced hands a traced message to the output queue in an output
// span (none when no output service is configured).
func (b *Broker) offerTraced(m *Message) {
	if _, none := b.cluster.Output.(noOutput); none {
		return
	}
	span := childSpan(m, "output")
	ok := b.cluster.Output.Offer(m)
	if !ok {
		b.m.dropped.WithLabelValues("output_queue_full").Inc()
	}
	span.SetAttributes(attrOffered.Bool(ok))
	span.End()
}
