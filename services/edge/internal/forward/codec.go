package forward

import (
	"errors"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/libs/commonwire"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"
)

// The edge API's handler decodes the frames of Forward streams with
// decodeForwardRequest (HandlerOptions): the runtime spent about 1.7 µs and
// 10 allocations per forwarded message on a frame (BenchmarkFrame_Decode),
// a sixth of a receiving edge's CPU at QoS 0 across edges.

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
		if !errors.Is(err, commonwire.ErrUncommon) {
			return err
		}
		proto.Reset(req)
		return proto.Unmarshal(b, req)
	}
	return nil
}

func decodeFrameFast(b []byte, req *edgev1.ForwardRequest) error {
	for len(b) > 0 {
		num, typ, rest, err := commonwire.Tag(b)
		if err != nil {
			return err
		}
		b = rest
		switch {
		case num == 1 && typ == protowire.BytesType:
			v, rest, err := commonwire.Bytes(b)
			if err != nil {
				return err
			}
			if !commonwire.ValidUTF8(v) {
				return commonwire.ErrInvalidUTF8
			}
			req.EdgeId = string(v)
			b = rest
		case (num == 2 || num == 3 || num == 4 || num == 6) && typ == protowire.VarintType:
			v, rest, err := commonwire.Varint(b)
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
			v, rest, err := commonwire.Bytes(b)
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
			return commonwire.ErrUncommon
		}
	}
	return nil
}

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
	if !errors.Is(err, commonwire.ErrUncommon) {
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
		num, typ, rest, err := commonwire.Tag(b)
		if err != nil {
			return err
		}
		b = rest
		switch {
		case num == 1 && typ == protowire.BytesType:
			if fm.Message != nil {
				return commonwire.ErrUncommon // merged by the runtime
			}
			v, rest, err := commonwire.Bytes(b)
			if err != nil {
				return err
			}
			if err := commonwire.Message(v, &x.m, &x.id); err != nil {
				return err
			}
			fm.Message = &x.m
			b = rest
		case (num == 2 || num == 6) && typ == protowire.BytesType:
			v, rest, err := commonwire.Bytes(b)
			if err != nil {
				return err
			}
			s, err := commonwire.AliasString(v)
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
			v, rest, err := commonwire.Varint(b)
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
			return commonwire.ErrUncommon
		}
	}
	return nil
}
