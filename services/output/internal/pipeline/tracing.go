package pipeline

import (
	"go.opentelemetry.io/otel/attribute"

	"github.com/keelmq/keel/libs/tracing"
)

// tracer makes the output.sink.write span: one per sampled batch written
// to a sink (libs/tracing installs the provider; with none, nothing runs).
var tracer = tracing.NewTracer("github.com/keelmq/keel/services/output/internal/pipeline")

// Span attribute keys.
const (
	attrPipeline = attribute.Key("keel.output.pipeline")
	attrSink     = attribute.Key("keel.output.sink")
	attrRecords  = attribute.Key("keel.output.records")
	attrFailures = attribute.Key("keel.output.failures")
)
