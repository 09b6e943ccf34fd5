package server

import (
	"errors"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/libs/commonwire"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
)

// Write batches are decoded by hand (Handler): the protobuf runtime took a
// fifth of the service's CPU under an append stream, most of it reflection
// and an allocation per nested message (an entry, its msgID, a message and
// its msgID: four or more per record); BenchmarkDecodeWriteRequest.

// Field numbers of keel.persistence.v1 messages the decoder reads.
const (
	fReqBatchID, fReqOps                   = 1, 2
	fOpSession, fOpFence                   = 1, 2
	fOpAppend, fOpSend, fOpComplete        = 15, 16, 18
	fFenceEpoch, fFenceGroupEpoch          = 1, 2
	fAppendLimits, fAppendEntries, fAppMsg = 1, 2, 3
	fSendEntries, fCompletePacketIDs       = 1, 1
	fLimitsMaxLen, fLimitsDropOldest       = 1, 2
	fLimitsTenantQuota                     = 3
	fEntryMsgID, fEntryQoS, fEntryRetain   = 1, 2, 3
	fEntryPacketID, fEntryPubrel           = 5, 6
	fEntrySeq, fEntryTookQoS2              = 7, 8
)

// decodeWriteRequest decodes b into req exactly as proto.Unmarshal does
// (FuzzDecodeWriteRequest holds it to that). The common ops (append, send,
// complete) are decoded by hand from one copy of b, which their strings and
// payloads alias (Connect reuses b); an op holding anything else is
// decoded by the runtime, alone. A decoded string kept past the batch
// (in a cache, a map) keeps the whole batch's copy alive: clone it.
func decodeWriteRequest(b []byte, req *persistencev1.WriteRequest) error {
	proto.Reset(req)
	own := append([]byte(nil), b...)
	for len(own) > 0 {
		num, typ, rest, err := commonwire.Tag(own)
		if err != nil {
			return err
		}
		own = rest
		switch {
		case num == fReqBatchID && typ == protowire.VarintType:
			v, rest, err := commonwire.Varint(own)
			if err != nil {
				return err
			}
			req.BatchId = v
			own = rest
		case num == fReqOps && typ == protowire.BytesType:
			v, rest, err := commonwire.Bytes(own)
			if err != nil {
				return err
			}
			op, err := decodeWriteOp(v)
			if err != nil {
				return err
			}
			req.Ops = append(req.Ops, op)
			own = rest
		default:
			// A field of a newer version, or on another wire type: the
			// runtime keeps it, or refuses it, as it does.
			proto.Reset(req)
			return proto.Unmarshal(b, req)
		}
	}
	return nil
}

// writeOp holds an op's structs in one allocation.
type writeOp struct {
	op       persistencev1.WriteOp
	key      commonv1.SessionKey
	fence    persistencev1.Fence
	appendOp persistencev1.WriteOp_Append
	app      persistencev1.AppendOp
	limits   persistencev1.QueueLimits
	sendOp   persistencev1.WriteOp_Send
	send     persistencev1.SendOp
	complete persistencev1.WriteOp_Complete
	comp     persistencev1.CompleteOp
}

// entryOf and messageOf hold an entry, or a message, with its msgID.
type entryOf struct {
	e  persistencev1.Entry
	id commonv1.MsgID
}

type messageOf struct {
	m  commonv1.Message
	id commonv1.MsgID
}

func decodeWriteOp(b []byte) (*persistencev1.WriteOp, error) {
	x := new(writeOp)
	err := x.decode(b)
	if err == nil {
		return &x.op, nil
	}
	if !errors.Is(err, commonwire.ErrUncommon) {
		return nil, err
	}
	op := new(persistencev1.WriteOp)
	if err := proto.Unmarshal(b, op); err != nil {
		return nil, err
	}
	return op, nil
}

func (x *writeOp) decode(b []byte) error {
	op := &x.op
	for len(b) > 0 {
		num, v, rest, err := commonwire.BytesField(b)
		if err != nil {
			return err
		}
		b = rest
		switch num {
		case fOpSession:
			if op.Session != nil {
				return commonwire.ErrUncommon // merged by the runtime
			}
			if err := commonwire.SessionKey(v, &x.key); err != nil {
				return err
			}
			op.Session = &x.key
		case fOpFence:
			if op.Fence != nil {
				return commonwire.ErrUncommon
			}
			if err := decodeFence(v, &x.fence); err != nil {
				return err
			}
			op.Fence = &x.fence
		case fOpAppend:
			if op.Op != nil {
				return commonwire.ErrUncommon // a oneof set twice: merged or replaced
			}
			if err := x.decodeAppend(v); err != nil {
				return err
			}
			x.appendOp.Append = &x.app
			op.Op = &x.appendOp
		case fOpSend:
			if op.Op != nil {
				return commonwire.ErrUncommon
			}
			entries, err := decodeEntries(v, fSendEntries, nil)
			if err != nil {
				return err
			}
			x.send.Entries = entries
			x.sendOp.Send = &x.send
			op.Op = &x.sendOp
		case fOpComplete:
			if op.Op != nil {
				return commonwire.ErrUncommon
			}
			ids, err := decodePacketIDs(v)
			if err != nil {
				return err
			}
			x.comp.PacketIds = ids
			x.complete.Complete = &x.comp
			op.Op = &x.complete
		default:
			return commonwire.ErrUncommon
		}
	}
	return nil
}

func decodeFence(b []byte, f *persistencev1.Fence) error {
	for len(b) > 0 {
		num, v, rest, err := commonwire.VarintField(b)
		if err != nil {
			return err
		}
		switch num {
		case fFenceEpoch:
			f.Epoch = v
		case fFenceGroupEpoch:
			f.GroupEpoch = v
		default:
			return commonwire.ErrUncommon
		}
		b = rest
	}
	return nil
}

func (x *writeOp) decodeAppend(b []byte) error {
	a := &x.app
	// The entries and messages, counted first, each take one allocation.
	var nEntries, nMsgs int
	for c := b; len(c) > 0; {
		num, typ, rest, err := commonwire.Tag(c)
		if err != nil {
			return err
		}
		n := protowire.ConsumeFieldValue(num, typ, rest)
		if n < 0 {
			return protowire.ParseError(n)
		}
		if typ == protowire.BytesType {
			switch num {
			case fAppendEntries:
				nEntries++
			case fAppMsg:
				nMsgs++
			}
		}
		c = rest[n:]
	}
	entries, err := decodeEntries(b, fAppendEntries, make([]entryOf, 0, nEntries))
	if err != nil {
		return err
	}
	a.Entries = entries
	msgs := make([]messageOf, nMsgs)
	if nMsgs > 0 {
		a.Messages = make([]*commonv1.Message, 0, nMsgs)
	}
	for len(b) > 0 {
		num, v, rest, err := commonwire.BytesField(b)
		if err != nil {
			return err
		}
		b = rest
		switch num {
		case fAppendLimits:
			if a.Limits != nil {
				return commonwire.ErrUncommon
			}
			if err := decodeLimits(v, &x.limits); err != nil {
				return err
			}
			a.Limits = &x.limits
		case fAppendEntries:
			// Decoded above.
		case fAppMsg:
			m := &msgs[len(a.Messages)]
			if err := commonwire.Message(v, &m.m, &m.id); err != nil {
				return err
			}
			a.Messages = append(a.Messages, &m.m)
		default:
			return commonwire.ErrUncommon
		}
	}
	return nil
}

// decodeEntries decodes the entries of a message whose field num holds
// them, into slab when it has room (the caller counted them), and
// ignores its other fields; nil when there are none, as the runtime.
func decodeEntries(b []byte, field protowire.Number, slab []entryOf) ([]*persistencev1.Entry, error) {
	var out []*persistencev1.Entry
	if cap(slab) > 0 {
		out = make([]*persistencev1.Entry, 0, cap(slab))
	}
	for len(b) > 0 {
		num, typ, rest, err := commonwire.Tag(b)
		if err != nil {
			return nil, err
		}
		if num != field || typ != protowire.BytesType {
			if field == fSendEntries {
				return nil, commonwire.ErrUncommon // SendOp has no other field
			}
			n := protowire.ConsumeFieldValue(num, typ, rest)
			if n < 0 {
				return nil, protowire.ParseError(n)
			}
			b = rest[n:]
			continue
		}
		v, rest, err := commonwire.Bytes(rest)
		if err != nil {
			return nil, err
		}
		b = rest
		var e *entryOf
		if len(slab) < cap(slab) {
			slab = slab[:len(slab)+1]
			e = &slab[len(slab)-1]
		} else {
			e = new(entryOf)
		}
		if err := decodeEntry(v, e); err != nil {
			return nil, err
		}
		out = append(out, &e.e)
	}
	return out, nil
}

func decodeEntry(b []byte, x *entryOf) error {
	e := &x.e
	for len(b) > 0 {
		num, typ, rest, err := commonwire.Tag(b)
		if err != nil {
			return err
		}
		b = rest
		if num == fEntryMsgID && typ == protowire.BytesType {
			if e.MsgId != nil {
				return commonwire.ErrUncommon // merged by the runtime
			}
			v, rest, err := commonwire.Bytes(b)
			if err != nil {
				return err
			}
			if err := commonwire.MsgID(v, &x.id); err != nil {
				return err
			}
			e.MsgId = &x.id
			b = rest
			continue
		}
		if typ != protowire.VarintType {
			return commonwire.ErrUncommon // subscription identifiers, packed
		}
		v, rest, err := commonwire.Varint(b)
		if err != nil {
			return err
		}
		b = rest
		switch num {
		case fEntryQoS:
			e.Qos = uint32(v)
		case fEntryRetain:
			e.Retain = v != 0
		case fEntryPacketID:
			e.PacketId = uint32(v)
		case fEntryPubrel:
			e.Pubrel = v != 0
		case fEntrySeq:
			e.Seq = v
		case fEntryTookQoS2:
			e.TookQos2 = v != 0
		default:
			return commonwire.ErrUncommon
		}
	}
	return nil
}

func decodeLimits(b []byte, l *persistencev1.QueueLimits) error {
	for len(b) > 0 {
		num, v, rest, err := commonwire.VarintField(b)
		if err != nil {
			return err
		}
		switch num {
		case fLimitsMaxLen:
			l.MaxLen = uint32(v)
		case fLimitsDropOldest:
			l.DropOldest = v != 0
		case fLimitsTenantQuota:
			l.TenantQuota = v != 0
		default:
			return commonwire.ErrUncommon
		}
		b = rest
	}
	return nil
}

// decodePacketIDs decodes CompleteOp's packet IDs, packed (as the runtime
// writes them) or not (as it also reads them).
func decodePacketIDs(b []byte) ([]uint32, error) {
	var ids []uint32
	for len(b) > 0 {
		num, typ, rest, err := commonwire.Tag(b)
		if err != nil {
			return nil, err
		}
		if num != fCompletePacketIDs {
			return nil, commonwire.ErrUncommon
		}
		switch typ {
		case protowire.VarintType:
			v, r, err := commonwire.Varint(rest)
			if err != nil {
				return nil, err
			}
			ids = append(ids, uint32(v))
			b = r
		case protowire.BytesType:
			v, r, err := commonwire.Bytes(rest)
			if err != nil {
				return nil, err
			}
			for len(v) > 0 {
				id, vr, err := commonwire.Varint(v)
				if err != nil {
					return nil, err
				}
				ids = append(ids, uint32(id))
				v = vr
			}
			b = r
		default:
			return nil, commonwire.ErrUncommon
		}
	}
	return ids, nil
}
