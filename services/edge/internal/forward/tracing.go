package forward

import (
	"go.opentelemetry.io/otel/attribute"

	"github.com/keelmq/keel/libs/tracing"
)

// tracer makes the forward span (sending edge, per peer, for a sampled
// message) and the deliver span (receiving edge, child of the forward span
// through the frame's traceparent); see the broker's tracing.go for the
// whole tree.
var tracer = tracing.NewTracer("github.com/keelmq/keel/services/edge/internal/forward")

// Span attribute keys.
const (
	attrPeer = attribute.Key("keel.peer.edge_id") // forward: the receiving edge
	attrFrom = attribute.Key("keel.from.edge_id") // deliver: the sending edge
)
