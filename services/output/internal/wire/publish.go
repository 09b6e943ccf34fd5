package wire

import (
	"errors"
	"fmt"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"

	outputv1 "github.com/keelmq/keel/proto/gen/keel/output/v1"
)

// Field numbers of keel.output.v1.PublishRequest and OutputRecord.
const (
	publishBatchID     = 1
	publishEdgeID      = 2
	publishIncarnation = 3
	publishRecords     = 4
	outputMessage      = 1
	outputPipelines    = 2
)

func init() {
	pd := (&outputv1.PublishRequest{}).ProtoReflect().Descriptor()
	mustField(pd, publishBatchID, "batch_id")
	mustField(pd, publishEdgeID, "edge_id")
	mustField(pd, publishIncarnation, "incarnation")
	mustField(pd, publishRecords, "records")
	od := (&outputv1.OutputRecord{}).ProtoReflect().Descriptor()
	mustField(od, outputMessage, "message")
	mustField(od, outputPipelines, "pipelines")
}

// ErrNoMessage is the error of an output record without a message.
var ErrNoMessage = errors.New("record without a message")

// PublishBatch is a keel.output.v1.PublishRequest whose messages are kept
// in wire form. A Connect handler receives it through [Codec].
type PublishBatch struct {
	BatchID     uint64
	EdgeID      string
	Incarnation uint64
	Records     []Incoming
}

// Incoming is one OutputRecord of a batch.
type Incoming struct {
	Record  Record
	Message Message
	// Pipelines are the rules that matched on the edge; empty lets the host
	// match.
	Pipelines []string
	// Err says why the record cannot be taken: it is malformed. The rest of
	// the batch is not affected.
	Err error
}

// Unmarshal reads an encoded PublishRequest into p. The batch itself must
// be well formed; a malformed record only sets that record's Err. Nothing in
// p aliases b, which the caller may reuse.
//
// The records are copied into one allocation, which lives as long as any
// of them: one slow pipeline keeps its batch-mates' bytes too, at most one
// edge batch per record it holds.
func (p *PublishBatch) Unmarshal(b []byte) error {
	*p = PublishBatch{}
	// Each record gains at most a tag and a length over its bytes in b.
	slab := make([]byte, 0, len(b)+len(b)/8+16)
	for len(b) > 0 {
		f, rest, err := nextField(b)
		if err != nil {
			return fmt.Errorf("PublishRequest: %w", err)
		}
		b = rest
		switch {
		case f.typ == protowire.VarintType && f.num == publishBatchID:
			p.BatchID, _ = protowire.ConsumeVarint(f.val)
		case f.typ == protowire.VarintType && f.num == publishIncarnation:
			p.Incarnation, _ = protowire.ConsumeVarint(f.val)
		case f.typ != protowire.BytesType:
		case f.num == publishEdgeID:
			if !utf8.Valid(f.val) {
				return fmt.Errorf("%w: PublishRequest.edge_id: invalid UTF-8", ErrMalformed)
			}
			p.EdgeID = string(f.val)
		case f.num == publishRecords:
			p.Records = append(p.Records, readOutputRecord(f.val, &slab))
		}
	}
	return nil
}

// readOutputRecord reads one encoded OutputRecord, copying its message
// into slab if it has room.
func readOutputRecord(b []byte, slab *[]byte) Incoming {
	var in Incoming
	var msg []byte
	pieces := 0
	for len(b) > 0 {
		f, rest, err := nextField(b)
		if err != nil {
			return Incoming{Err: fmt.Errorf("OutputRecord: %w", err)}
		}
		b = rest
		if f.typ != protowire.BytesType {
			continue
		}
		switch f.num {
		case outputMessage:
			// A message sent in pieces is their merge: the concatenation
			// of pieces that are each whole.
			if pieces++; pieces == 1 {
				msg = f.val
				break
			}
			if pieces == 2 {
				if err := Check(msg, messageDesc); err != nil {
					return Incoming{Err: err}
				}
			}
			if err := Check(f.val, messageDesc); err != nil {
				return Incoming{Err: err}
			}
			msg = append(msg[:len(msg):len(msg)], f.val...)
		case outputPipelines:
			if !utf8.Valid(f.val) {
				return Incoming{Err: fmt.Errorf("%w: OutputRecord.pipelines: invalid UTF-8", ErrMalformed)}
			}
			in.Pipelines = append(in.Pipelines, string(f.val))
		}
	}
	if pieces == 0 {
		return Incoming{Err: ErrNoMessage}
	}
	r, m, err := newRecord(msg, slab)
	if err != nil {
		return Incoming{Err: err}
	}
	in.Record, in.Message = r, m
	return in
}
