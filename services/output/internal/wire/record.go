package wire

import (
	"fmt"
	"unsafe"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
)

var (
	messageDesc = (&commonv1.Message{}).ProtoReflect().Descriptor()
	recordDesc  = (&pluginv1.Record{}).ProtoReflect().Descriptor()
)

// Field numbers the host reads. The generated descriptors are the source;
// init checks these against them.
const (
	recordMessage  = 1 // Record.message, and the repeated records of every batch message
	writeSequence  = 2 // SinkServiceWriteRequest.sequence
	writeFollows   = 3 // SinkServiceWriteRequest.follows
	messageTenant  = 2
	messageTopic   = 3
	messagePayload = 4
	messageIngress = 7
)

func init() {
	mustField(recordDesc, recordMessage, "message")
	mustField((&pluginv1.SinkServiceWriteRequest{}).ProtoReflect().Descriptor(), writeSequence, "sequence")
	mustField((&pluginv1.SinkServiceWriteRequest{}).ProtoReflect().Descriptor(), writeFollows, "follows")
	mustField(messageDesc, messageTenant, "tenant")
	mustField(messageDesc, messageTopic, "topic")
	mustField(messageDesc, messagePayload, "payload")
	mustField(messageDesc, messageIngress, "ingress_unix_nano")
	for _, m := range []proto.Message{
		&pluginv1.SinkServiceWriteRequest{}, &pluginv1.TransformServiceTransformRequest{}, &pluginv1.TransformServiceTransformResponse{},
	} {
		mustField(m.ProtoReflect().Descriptor(), recordMessage, "records")
	}
}

// mustField panics unless md's field num is name: the numbers this package
// reads by hand must be the schema's.
func mustField(md protoreflect.MessageDescriptor, num protowire.Number, name protoreflect.Name) {
	if fd := md.Fields().ByNumber(num); fd == nil || fd.Name() != name {
		panic(fmt.Sprintf("wire: %s field %d is not %s", md.FullName(), num, name))
	}
}

// Record is one keel.output.plugin.v1.Record in wire form, with what the
// host reads of it.
type Record struct {
	// Enc is the encoded Record. Nothing writes to it once it is built.
	Enc []byte
	// Ingress is the message's ingress_unix_nano.
	Ingress int64
	// Payload is the length of the message's payload.
	Payload int
}

// Message describes one message as the host reads it.
type Message struct {
	// Tenant and Topic alias the record's bytes: they live as long as it.
	Tenant, Topic string
	Ingress       int64
	Payload       int
}

// read sets the fields of m that b, an encoded Message (or a piece of one)
// that passed [Check], holds. Like the runtime, the last occurrence of a
// field wins, and a field sent with another wire type is not that field.
func (m *Message) read(b []byte) {
	for len(b) > 0 {
		f, rest, _ := nextField(b)
		b = rest
		m.set(f)
	}
}

// set reads f into m if it is a field the host needs.
func (m *Message) set(f field) {
	switch {
	case f.typ == protowire.VarintType && f.num == messageIngress:
		x, _ := protowire.ConsumeVarint(f.val)
		m.Ingress = int64(x)
	case f.typ != protowire.BytesType:
	case f.num == messageTenant:
		m.Tenant = aliasString(f.val)
	case f.num == messageTopic:
		m.Topic = aliasString(f.val)
	case f.num == messagePayload:
		m.Payload = len(f.val)
	}
}

// aliasString returns v as a string without copying it.
func aliasString(v []byte) string {
	if len(v) == 0 {
		return ""
	}
	return unsafe.String(&v[0], len(v))
}

// newRecord checks msg, an encoded keel.common.v1.Message, and wraps a copy
// of it as a Record; the returned Message aliases the copy. The copy goes
// into the free capacity of *slab (slab may be nil) when it has room, so
// that the records of one batch share one allocation.
func newRecord(msg []byte, slab *[]byte) (Record, Message, error) {
	need := protowire.SizeTag(recordMessage) + protowire.SizeBytes(len(msg))
	var enc []byte
	if slab != nil && cap(*slab)-len(*slab) >= need {
		start := len(*slab)
		*slab = protowire.AppendBytes(protowire.AppendTag(*slab, recordMessage, protowire.BytesType), msg)
		enc = (*slab)[start:len(*slab):len(*slab)]
	} else {
		enc = protowire.AppendBytes(protowire.AppendTag(make([]byte, 0, need), recordMessage, protowire.BytesType), msg)
	}
	// Checked and read in the copy, so that the strings alias it.
	var m Message
	if err := schemaOf(messageDesc).check(enc[len(enc)-len(msg):], &m); err != nil {
		return Record{}, Message{}, err // its room in the slab stays unused
	}
	return Record{Enc: enc, Ingress: m.Ingress, Payload: m.Payload}, m, nil
}

// parseRecord checks enc, an encoded Record, and returns it as a Record
// that aliases enc.
func parseRecord(enc []byte) (Record, error) {
	if err := Check(enc, recordDesc); err != nil {
		return Record{}, err
	}
	// The message may come in pieces, which the runtime merges.
	var m Message
	for b := enc; len(b) > 0; {
		f, rest, _ := nextField(b)
		b = rest
		if f.num == recordMessage && f.typ == protowire.BytesType {
			m.read(f.val)
		}
	}
	return Record{Enc: enc, Ingress: m.Ingress, Payload: m.Payload}, nil
}

// Records is a batch of records in a plugin request or response: every
// batch message of keel.output.plugin.v1 carries them as its field 1.
type Records []Record

// size is the encoded size of the batch message.
func (rs Records) size() int {
	n := 0
	for _, r := range rs {
		n += protowire.SizeTag(recordMessage) + protowire.SizeBytes(len(r.Enc))
	}
	return n
}

// SinkWrite is a sink write request (SinkServiceWriteRequest) with its
// records in wire form.
type SinkWrite struct {
	Records           Records
	Sequence, Follows uint64
}

func (w *SinkWrite) size() int {
	n := w.Records.size()
	if w.Sequence > 0 {
		n += protowire.SizeTag(writeSequence) + protowire.SizeVarint(w.Sequence)
	}
	if w.Follows > 0 {
		n += protowire.SizeTag(writeFollows) + protowire.SizeVarint(w.Follows)
	}
	return n
}

// AppendTo appends the request message to dst.
func (w *SinkWrite) AppendTo(dst []byte) []byte {
	dst = w.Records.AppendTo(dst)
	if w.Sequence > 0 {
		dst = protowire.AppendTag(dst, writeSequence, protowire.VarintType)
		dst = protowire.AppendVarint(dst, w.Sequence)
	}
	if w.Follows > 0 {
		dst = protowire.AppendTag(dst, writeFollows, protowire.VarintType)
		dst = protowire.AppendVarint(dst, w.Follows)
	}
	return dst
}

// AppendTo appends the batch message to dst.
func (rs Records) AppendTo(dst []byte) []byte {
	for _, r := range rs {
		dst = protowire.AppendTag(dst, recordMessage, protowire.BytesType)
		dst = protowire.AppendBytes(dst, r.Enc)
	}
	return dst
}

// ParseRecords reads a batch message whose records alias b. A malformed
// batch, or any malformed record in it, is an error: it comes from a plugin,
// and a plugin that sends one is broken.
func ParseRecords(b []byte) (Records, error) {
	var rs Records
	for len(b) > 0 {
		f, rest, err := nextField(b)
		if err != nil {
			return nil, err
		}
		b = rest
		if f.num != recordMessage || f.typ != protowire.BytesType {
			continue
		}
		r, err := parseRecord(f.val)
		if err != nil {
			return nil, err
		}
		rs = append(rs, r)
	}
	return rs, nil
}
