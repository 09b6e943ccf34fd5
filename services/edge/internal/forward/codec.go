package forward

import (
	"errors"
	"unicode/utf8"
	"unsafe"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"
)

// The edge API's handler decodes the frames of Forward streams with
// decodeForwardRequest (HandlerOptions): the runtime spent about 1.7 µs and
// 10 allocations per forwarded message on a frame (BenchmarkFrame_Decode),
// a sixth of a receiving edge's CPU at QoS 0 across edges.

// errUncommon stops the fast decoding of a part that holds something it
// leaves to the runtime: a field it does not read (user properties, relay
// and shared targets, a field of a newer version), a message field given
// twice (merged), or a field on an unexpected wire type.
var errUncommon = errors.New("uncommon encoding")

// decodeForwardRequest decodes b into req exactly as proto.Unmarshal does
// (FuzzDecodeForwardRequest holds it to that). Each forwarded message costs
// two allocations instead of about ten: its three structs in one, and one
// copy of its encoding, which its strings and payload alias (the connection
// reuses b). A message with anything uncommon in it is decoded by the
// runtime from its own bytes; a frame with anything uncommon at its top, as
// a whole.
func decodeForwardRequest(b []byte, req *edgev1.ForwardRequest) error {
	proto.Reset(req)
	if err := decodeFrameFast(b, req); err != nil {
		if !errors.Is(err, errUncommon) {
			return err
		}
		proto.Reset(req)
		return proto.Unmarshal(b, req)
	}
	return nil
}

func decodeFrameFast(b []byte, req *edgev1.ForwardRequest) error {
	for len(b) > 0 {
		num, typ, rest, err := consumeTag(b)
		if err != nil {
			return err
		}
		b = rest
		switch {
		case num == 1 && typ == protowire.BytesType:
			v, rest, err := consumeBytes(b)
			if err != nil {
				return err
			}
			if !utf8.Valid(v) {
				return errInvalidUTF8
			}
			req.EdgeId = string(v)
			b = rest
		case (num == 2 || num == 3 || num == 4 || num == 6) && typ == protowire.VarintType:
			v, rest, err := consumeVarint(b)
			if err != nil {
				return err
			}
			switch num {
			case 2:
				req.Incarnation = v
			case 3:
				req.TargetIncarnation = v
			case 4:
				req.Seq = v
			default:
				req.OutcomesConfirmed = v
			}
			b = rest
		case num == 5 && typ == protowire.BytesType:
			v, rest, err := consumeBytes(b)
			if err != nil {
				return err
			}
			fm, err := decodeForwardMessage(v)
			if err != nil {
				return err
			}
			req.Messages = append(req.Messages, fm)
			b = rest
		default:
			return errUncommon
		}
	}
	return nil
}

// errInvalidUTF8 is the runtime's refusal of a string field that is not
// UTF-8.
var errInvalidUTF8 = errors.New("string field contains invalid UTF-8")

// forwardedMessage holds a decoded message's three structs in one
// allocation.
type forwardedMessage struct {
	fm edgev1.ForwardMessage
	m  commonv1.Message
	id commonv1.MsgID
}

// decodeForwardMessage decodes one ForwardMessage, by hand when it holds
// only what forwarded messages commonly do, else with the runtime.
func decodeForwardMessage(b []byte) (*edgev1.ForwardMessage, error) {
	x := new(forwardedMessage)
	// The copy outlives the connection's buffer; strings and the payload
	// alias it, and nothing writes to it.
	own := append([]byte(nil), b...)
	err := x.decode(own)
	if err == nil {
		return &x.fm, nil
	}
	if !errors.Is(err, errUncommon) {
		return nil, err
	}
	fm := new(edgev1.ForwardMessage)
	if err := proto.Unmarshal(own, fm); err != nil {
		return nil, err
	}
	return fm, nil
}

func (x *forwardedMessage) decode(b []byte) error {
	fm := &x.fm
	for len(b) > 0 {
		num, typ, rest, err := consumeTag(b)
		if err != nil {
			return err
		}
		b = rest
		switch {
		case num == 1 && typ == protowire.BytesType:
			if fm.Message != nil {
				return errUncommon // merged by the runtime
			}
			v, rest, err := consumeBytes(b)
			if err != nil {
				return err
			}
			if err := x.decodeMessage(v); err != nil {
				return err
			}
			fm.Message = &x.m
			b = rest
		case (num == 2 || num == 6) && typ == protowire.BytesType:
			v, rest, err := consumeBytes(b)
			if err != nil {
				return err
			}
			s, err := aliasString(v)
			if err != nil {
				return err
			}
			if num == 2 {
				fm.Filters = append(fm.Filters, s)
			} else {
				fm.Traceparent = s
			}
			b = rest
		case (num == 5 || num == 7 || num == 8) && typ == protowire.VarintType:
			v, rest, err := consumeVarint(b)
			if err != nil {
				return err
			}
			switch num {
			case 5:
				fm.SharedChosen = v != 0
			case 7:
				fm.SharedOnly = v != 0
			default:
				fm.SessionsSinceUnixNano = int64(v)
			}
			b = rest
		default:
			return errUncommon
		}
	}
	return nil
}

func (x *forwardedMessage) decodeMessage(b []byte) error {
	m := &x.m
	for len(b) > 0 {
		num, typ, rest, err := consumeTag(b)
		if err != nil {
			return err
		}
		b = rest
		switch typ {
		case protowire.BytesType:
			v, rest, err := consumeBytes(b)
			if err != nil {
				return err
			}
			b = rest
			switch num {
			case 1:
				if m.Id != nil {
					return errUncommon // merged by the runtime
				}
				if err := decodeMsgID(v, &x.id); err != nil {
					return err
				}
				m.Id = &x.id
			// Capped, so that an append to one never writes over the
			// fields after it in the shared copy.
			case 4:
				m.Payload = v[:len(v):len(v)]
			case 11:
				m.CorrelationData = v[:len(v):len(v)]
			case 2, 3, 8, 9, 10:
				s, err := aliasString(v)
				if err != nil {
					return err
				}
				switch num {
				case 2:
					m.Tenant = s
				case 3:
					m.Topic = s
				case 8:
					m.ClientId = s
				case 9:
					m.ContentType = s
				default:
					m.ResponseTopic = s
				}
			default:
				return errUncommon
			}
		case protowire.VarintType:
			v, rest, err := consumeVarint(b)
			if err != nil {
				return err
			}
			b = rest
			switch num {
			case 5:
				m.Qos = uint32(v)
			case 6:
				m.Retain = v != 0
			case 7:
				m.IngressUnixNano = int64(v)
			case 13:
				m.PayloadFormat = uint32(v)
			case 14:
				e := uint32(v)
				m.MessageExpiryInterval = &e
			default:
				return errUncommon
			}
		default:
			return errUncommon
		}
	}
	return nil
}

func decodeMsgID(b []byte, id *commonv1.MsgID) error {
	for len(b) > 0 {
		num, typ, rest, err := consumeTag(b)
		if err != nil {
			return err
		}
		b = rest
		switch {
		case num == 1 && typ == protowire.BytesType:
			v, rest, err := consumeBytes(b)
			if err != nil {
				return err
			}
			s, err := aliasString(v)
			if err != nil {
				return err
			}
			id.EdgeId = s
			b = rest
		case (num == 2 || num == 3) && typ == protowire.VarintType:
			v, rest, err := consumeVarint(b)
			if err != nil {
				return err
			}
			if num == 2 {
				id.Incarnation = v
			} else {
				id.Seq = v
			}
			b = rest
		default:
			return errUncommon
		}
	}
	return nil
}

// aliasString returns v as a string without copying it: v is part of a
// message's own copy of its encoding, which nothing writes to.
func aliasString(v []byte) (string, error) {
	if !utf8.Valid(v) {
		return "", errInvalidUTF8
	}
	if len(v) == 0 {
		return "", nil
	}
	return unsafe.String(&v[0], len(v)), nil
}

func consumeTag(b []byte) (protowire.Number, protowire.Type, []byte, error) {
	num, typ, n := protowire.ConsumeTag(b)
	if n < 0 {
		return 0, 0, nil, protowire.ParseError(n)
	}
	return num, typ, b[n:], nil
}

func consumeBytes(b []byte) (v, rest []byte, err error) {
	v, n := protowire.ConsumeBytes(b)
	if n < 0 {
		return nil, nil, protowire.ParseError(n)
	}
	return v, b[n:], nil
}

func consumeVarint(b []byte) (v uint64, rest []byte, err error) {
	v, n := protowire.ConsumeVarint(b)
	if n < 0 {
		return 0, nil, protowire.ParseError(n)
	}
	return v, b[n:], nil
}
