package server

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"unicode/utf8"

	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/libs/slots"
	"github.com/keelmq/keel/libs/topic"
	"github.com/keelmq/keel/services/persistence/internal/store"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
)

// Limits bound what one request may carry.
type Limits struct {
	MaxBatchOps   int // ops per batch
	MaxOpEntries  int // entries (packet IDs, msgIDs) per op
	MaxPayload    int // bytes per message payload
	MaxClientID   int // bytes
	MaxEdgeID     int // bytes of a msgID's edge ID
	MaxProperties int // bytes of session properties and of a message's MQTT 5 properties
}

// DefaultLimits are the limits used when a field is zero.
var DefaultLimits = Limits{MaxBatchOps: 4096, MaxOpEntries: 4096, MaxPayload: 1 << 20, MaxClientID: 65535,
	MaxEdgeID: 256, MaxProperties: 64 << 10}

func (l Limits) withDefaults() Limits {
	d := DefaultLimits
	for _, p := range []struct{ v, d *int }{{&l.MaxBatchOps, &d.MaxBatchOps}, {&l.MaxOpEntries, &d.MaxOpEntries},
		{&l.MaxPayload, &d.MaxPayload}, {&l.MaxClientID, &d.MaxClientID}, {&l.MaxEdgeID, &d.MaxEdgeID}, {&l.MaxProperties, &d.MaxProperties}} {
		if *p.v <= 0 {
			*p.v = *p.d
		}
	}
	return l
}

var tenantRE = regexp.MustCompile(`^[a-z0-9-]{1,63}$`)

// ValidTenant reports whether t is a tenant name requests may carry.
func ValidTenant(t string) bool { return tenantRE.MatchString(t) }

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{store.ErrInvalid}, args...)...)
}

type decoder struct {
	lim Limits
	// slots maps sessions and tenants to Redis groups (nil: one group);
	// group is this instance's. A session or tenant of another group is
	// refused: its state kept here would be where no resume looks.
	slots slots.Table
	group uint32
	// quotas bound each tenant's queued entries; a request cannot set them.
	quotas store.TenantQuotas
}

// sessionInGroup refuses a session of another group.
func (d decoder) sessionInGroup(k store.SessionKey) error {
	if g := d.slots.Session(k.Tenant, k.ClientID); g != d.group {
		return invalid("session %.70q of tenant %q is in slot %d of Redis group %d; this instance serves group %d",
			k.ClientID, k.Tenant, slots.Of(k.Tenant, k.ClientID), g, d.group)
	}
	return nil
}

// retainedTenant checks a tenant whose retained messages are read or
// written: valid, and of this group.
func (d decoder) retainedTenant(t string) error {
	if err := d.tenant(t); err != nil {
		return err
	}
	if g := d.slots.Tenant(t); g != d.group {
		return invalid("retained messages of tenant %q are in slot %d of Redis group %d; this instance serves group %d",
			t, slots.OfTenant(t), g, d.group)
	}
	return nil
}

func (d decoder) tenant(t string) error {
	if !tenantRE.MatchString(t) {
		return invalid("tenant %.70q must be 1-63 characters of [a-z0-9-]", t)
	}
	return nil
}

func (d decoder) sessionKey(k *commonv1.SessionKey) (store.SessionKey, error) {
	if k == nil {
		return store.SessionKey{}, invalid("session is required")
	}
	if err := d.tenant(k.GetTenant()); err != nil {
		return store.SessionKey{}, err
	}
	if len(k.GetClientId()) > d.lim.MaxClientID || !utf8.ValidString(k.GetClientId()) {
		return store.SessionKey{}, invalid("client ID must be valid UTF-8 of at most %d bytes", d.lim.MaxClientID)
	}
	sk := store.SessionKey{Tenant: k.GetTenant(), ClientID: k.GetClientId()}
	if err := sk.Validate(); err != nil {
		return sk, err
	}
	return sk, d.sessionInGroup(sk)
}

// MsgIDString is the store's form of a msgID: "<edge>/<incarnation>/<seq>",
// unambiguous because the two numbers are parsed from the right.
func MsgIDString(id *commonv1.MsgID) string {
	return id.GetEdgeId() + "/" + strconv.FormatUint(id.GetIncarnation(), 10) + "/" + strconv.FormatUint(id.GetSeq(), 10)
}

// ParseMsgID reverses [MsgIDString].
func ParseMsgID(s string) (*commonv1.MsgID, error) {
	i := strings.LastIndexByte(s, '/')
	if i < 0 {
		return nil, fmt.Errorf("msgID %q: no sequence", s)
	}
	seq, err := strconv.ParseUint(s[i+1:], 10, 64)
	if err != nil {
		return nil, fmt.Errorf("msgID %q: %w", s, err)
	}
	j := strings.LastIndexByte(s[:i], '/')
	if j < 0 {
		return nil, fmt.Errorf("msgID %q: no incarnation", s)
	}
	inc, err := strconv.ParseUint(s[j+1:i], 10, 64)
	if err != nil {
		return nil, fmt.Errorf("msgID %q: %w", s, err)
	}
	return &commonv1.MsgID{EdgeId: s[:j], Incarnation: inc, Seq: seq}, nil
}

func (d decoder) msgID(id *commonv1.MsgID) (string, error) {
	switch {
	case id == nil:
		return "", invalid("msg_id is required")
	case id.GetEdgeId() == "" || len(id.GetEdgeId()) > d.lim.MaxEdgeID || !utf8.ValidString(id.GetEdgeId()):
		return "", invalid("msg_id edge_id must be 1-%d bytes of UTF-8", d.lim.MaxEdgeID)
	case id.GetSeq() == 0:
		return "", invalid("msg_id seq must be at least 1")
	}
	return MsgIDString(id), nil
}

func qos(q uint32) (byte, error) {
	if q > 2 {
		return 0, invalid("qos %d", q)
	}
	return byte(q), nil
}

func packetID(p uint32) (uint16, error) {
	if p == 0 || p > 65535 {
		return 0, invalid("packet_id %d: want 1-65535", p)
	}
	return uint16(p), nil
}

// message converts a message; tenant, if not empty, must be the message's.
// The MQTT 5 properties and publisher identity travel in Props as a
// protobuf of the message without id, topic and payload.
func (d decoder) message(m *commonv1.Message, tenant string) (*store.Message, error) {
	return d.messageOf(m, tenant, nil, "")
}

// messageOf is message for a message whose msgID should be entry's (id in
// the store's form): an append's entry and its message, where the ID is
// checked once and its string made once.
func (d decoder) messageOf(m *commonv1.Message, tenant string, entry *commonv1.MsgID, id string) (*store.Message, error) {
	if m == nil {
		return nil, invalid("message is required")
	}
	var err error
	if mid := m.GetId(); entry != nil && mid.GetEdgeId() == entry.GetEdgeId() && mid.GetIncarnation() == entry.GetIncarnation() && mid.GetSeq() == entry.GetSeq() {
		// The entry's ID, checked already.
	} else if id, err = d.msgID(mid); err != nil {
		return nil, err
	}
	if tenant != "" && m.GetTenant() != "" && m.GetTenant() != tenant {
		return nil, invalid("message tenant %.70q is not the session's", m.GetTenant())
	}
	if err := topic.ValidateName(m.GetTopic(), topic.Limits{}); err != nil {
		return nil, invalid("topic: %v", err)
	}
	if len(m.GetPayload()) > d.lim.MaxPayload {
		return nil, invalid("payload of %d bytes exceeds %d", len(m.GetPayload()), d.lim.MaxPayload)
	}
	q, err := qos(m.GetQos())
	if err != nil {
		return nil, err
	}
	if m.GetPayloadFormat() > 1 {
		return nil, invalid("payload_format %d", m.GetPayloadFormat())
	}
	pb, ok := appendProps(nil, m)
	if !ok {
		return nil, invalid("properties: a string that is not UTF-8")
	}
	if len(pb) > d.lim.MaxProperties {
		return nil, invalid("properties of %d bytes exceed %d", len(pb), d.lim.MaxProperties)
	}
	sm := &store.Message{ID: id, Topic: m.GetTopic(), Payload: m.GetPayload(), QoS: q, Retain: m.GetRetain(),
		Created: m.GetIngressUnixNano()}
	if len(pb) > 0 {
		sm.Props = pb
	}
	if m.MessageExpiryInterval != nil {
		sm.Expiry = m.GetIngressUnixNano()/1e9 + int64(m.GetMessageExpiryInterval())
	}
	return sm, nil
}

// MessageOut converts a stored message back.
func MessageOut(sm *store.Message) *commonv1.Message {
	m := &commonv1.Message{}
	if len(sm.Props) > 0 {
		_ = proto.Unmarshal(sm.Props, m) // written by message above
	}
	m.Id, _ = ParseMsgID(sm.ID)
	m.Topic, m.Payload, m.Qos, m.Retain, m.IngressUnixNano = sm.Topic, sm.Payload, uint32(sm.QoS), sm.Retain, sm.Created
	return m
}

func (d decoder) entry(e *persistencev1.Entry, needPacketID bool) (store.Entry, error) {
	if e == nil {
		return store.Entry{}, invalid("entry is required")
	}
	id, err := d.msgID(e.GetMsgId())
	if err != nil {
		return store.Entry{}, err
	}
	q, err := qos(e.GetQos())
	if err != nil {
		return store.Entry{}, err
	}
	se := store.Entry{MsgID: id, QoS: q, Retain: e.GetRetain(), Pubrel: e.GetPubrel(), TookQoS2: e.GetTookQos2()}
	if len(e.GetSubscriptionIdentifiers()) > 32 {
		return store.Entry{}, invalid("%d subscription identifiers", len(e.GetSubscriptionIdentifiers()))
	}
	for _, s := range e.GetSubscriptionIdentifiers() {
		if s == 0 || s > 268435455 {
			return store.Entry{}, invalid("subscription identifier %d", s)
		}
		se.SubIDs = append(se.SubIDs, int(s))
	}
	if needPacketID && q > 0 {
		if se.PacketID, err = packetID(e.GetPacketId()); err != nil {
			return store.Entry{}, err
		}
	} else if e.GetPacketId() > 65535 {
		return store.Entry{}, invalid("packet_id %d", e.GetPacketId())
	}
	if se.Pubrel && q != 2 {
		return store.Entry{}, invalid("pubrel on a QoS %d entry", q)
	}
	if se.TookQoS2 && q != 2 {
		return store.Entry{}, invalid("took_qos2 on a QoS %d entry", q)
	}
	return se, nil
}

func (d decoder) subscription(s *persistencev1.Subscription) (store.Subscription, error) {
	if s == nil {
		return store.Subscription{}, invalid("subscription is required")
	}
	if err := topic.ValidateFilter(s.GetFilter(), topic.Limits{}); err != nil {
		return store.Subscription{}, invalid("filter: %v", err)
	}
	q, err := qos(s.GetQos())
	if err != nil {
		return store.Subscription{}, err
	}
	if s.GetRetainHandling() > 2 || s.GetSubscriptionIdentifier() > 268435455 {
		return store.Subscription{}, invalid("retain_handling %d or subscription_identifier %d", s.GetRetainHandling(), s.GetSubscriptionIdentifier())
	}
	return store.Subscription{Filter: s.GetFilter(), QoS: q, NoLocal: s.GetNoLocal(), RetainAsPublished: s.GetRetainAsPublished(),
		RetainHandling: byte(s.GetRetainHandling()), Identifier: int(s.GetSubscriptionIdentifier())}, nil
}

func (d decoder) session(s *persistencev1.Session, tenant string) (store.Session, error) {
	if s == nil {
		return store.Session{}, invalid("session record is required")
	}
	switch s.GetProtocolVersion() {
	case 3, 4, 5:
	default:
		return store.Session{}, invalid("protocol_version %d", s.GetProtocolVersion())
	}
	if len(s.GetProperties()) > d.lim.MaxProperties {
		return store.Session{}, invalid("properties of %d bytes", len(s.GetProperties()))
	}
	ss := store.Session{ProtocolVersion: byte(s.GetProtocolVersion()), ExpiryInterval: s.GetSessionExpiryInterval(),
		Disconnected: s.GetDisconnectedUnixNano(), Props: s.GetProperties()}
	if w := s.GetWill(); w != nil {
		if _, err := d.message(w.GetMessage(), tenant); err != nil {
			return store.Session{}, fmt.Errorf("will: %w", err)
		}
		b, err := proto.Marshal(w)
		if err != nil {
			return store.Session{}, invalid("will: %v", err)
		}
		ss.Will = b
	}
	return ss, nil
}

// SessionOut converts a stored session record back.
func SessionOut(s *store.Session) *persistencev1.Session {
	if s == nil {
		return nil
	}
	out := &persistencev1.Session{ProtocolVersion: uint32(s.ProtocolVersion), SessionExpiryInterval: s.ExpiryInterval,
		DisconnectedUnixNano: s.Disconnected, Properties: s.Props}
	if len(s.Will) > 0 {
		w := &persistencev1.Will{}
		if proto.Unmarshal(s.Will, w) == nil {
			out.Will = w
		}
	}
	return out
}

// EntryOut converts a stored entry back.
func EntryOut(e store.Entry) *persistencev1.Entry {
	id, _ := ParseMsgID(e.MsgID)
	out := &persistencev1.Entry{MsgId: id, Qos: uint32(e.QoS), Retain: e.Retain, PacketId: uint32(e.PacketID), Pubrel: e.Pubrel, Seq: e.Seq}
	for _, s := range e.SubIDs {
		out.SubscriptionIdentifiers = append(out.SubscriptionIdentifiers, uint32(s))
	}
	return out
}

// DecodeBatch validates every op of a batch and converts it; any error
// rejects the whole batch, so nothing of a malformed batch is stored.
func (d decoder) batch(req *persistencev1.WriteRequest) ([]store.Op, error) {
	if len(req.GetOps()) == 0 {
		return nil, invalid("empty batch")
	}
	if len(req.GetOps()) > d.lim.MaxBatchOps {
		return nil, invalid("%d ops in a batch, at most %d", len(req.GetOps()), d.lim.MaxBatchOps)
	}
	ops := make([]store.Op, len(req.GetOps()))
	for i, w := range req.GetOps() {
		if err := d.op(w, &ops[i]); err != nil {
			return nil, fmt.Errorf("op %d: %w", i, err)
		}
	}
	return ops, nil
}

func (d decoder) op(w *persistencev1.WriteOp, o *store.Op) error {
	if r, ok := w.GetOp().(*persistencev1.WriteOp_PutRetained); ok {
		if w.GetSession() != nil || w.GetFence() != nil {
			return invalid("put_retained takes no session or fence")
		}
		m := r.PutRetained.GetMessage()
		if m == nil {
			return invalid("message is required")
		}
		if err := d.retainedTenant(m.GetTenant()); err != nil {
			return err
		}
		sm, err := d.message(m, m.GetTenant())
		if err != nil {
			return err
		}
		*o = store.Op{Kind: store.OpPutRetained, Tenant: m.GetTenant(), Retained: sm}
		return nil
	}
	k, err := d.sessionKey(w.GetSession())
	if err != nil {
		return err
	}
	f := w.GetFence()
	if f.GetEpoch() == 0 {
		return invalid("fence with a session epoch is required")
	}
	*o = store.Op{Key: k, Fence: store.Fence{Epoch: f.GetEpoch(), GroupEpoch: f.GetGroupEpoch()}}
	count := func(n int) error {
		if n == 0 || n > d.lim.MaxOpEntries {
			return invalid("%d entries: want 1-%d", n, d.lim.MaxOpEntries)
		}
		return nil
	}
	switch x := w.GetOp().(type) {
	case *persistencev1.WriteOp_Activate:
		o.Kind = store.OpActivate
	case *persistencev1.WriteOp_PutSession:
		o.Kind = store.OpPutSession
		o.Session, err = d.session(x.PutSession.GetSession(), k.Tenant)
	case *persistencev1.WriteOp_DeleteSession:
		o.Kind = store.OpDeleteSession
	case *persistencev1.WriteOp_PutSubscription:
		o.Kind = store.OpPutSubscription
		o.Sub, err = d.subscription(x.PutSubscription.GetSubscription())
	case *persistencev1.WriteOp_DeleteSubscription:
		o.Kind = store.OpDeleteSubscription
		o.Filter = x.DeleteSubscription.GetFilter()
		if e := topic.ValidateFilter(o.Filter, topic.Limits{}); e != nil {
			err = invalid("filter: %v", e)
		}
	case *persistencev1.WriteOp_Append:
		o.Kind = store.OpAppend
		a := x.Append
		if err = count(len(a.GetEntries())); err != nil {
			return err
		}
		if len(a.GetMessages()) != len(a.GetEntries()) {
			return invalid("%d entries but %d messages", len(a.GetEntries()), len(a.GetMessages()))
		}
		o.Limits = store.QueueLimits{MaxLen: int(a.GetLimits().GetMaxLen()), DropOldest: a.GetLimits().GetDropOldest()}
		if a.GetLimits().GetTenantQuota() {
			o.Limits.TenantMax = d.quotas.Max(o.Key.Tenant)
		}
		o.Entries = make([]store.Entry, len(a.GetEntries()))
		o.Messages = make([]*store.Message, len(a.GetEntries()))
		for i := range a.GetEntries() {
			if o.Entries[i], err = d.entry(a.GetEntries()[i], false); err != nil {
				return fmt.Errorf("entry %d: %w", i, err)
			}
			if o.Messages[i], err = d.messageOf(a.GetMessages()[i], k.Tenant, a.GetEntries()[i].GetMsgId(), o.Entries[i].MsgID); err != nil {
				return fmt.Errorf("message %d: %w", i, err)
			}
			if o.Messages[i].ID != o.Entries[i].MsgID {
				return invalid("entry %d and its message have different msgIDs", i)
			}
			o.Entries[i].PacketID, o.Entries[i].Pubrel = 0, false
		}
	case *persistencev1.WriteOp_Send:
		o.Kind = store.OpSend
		if err = count(len(x.Send.GetEntries())); err != nil {
			return err
		}
		seen := map[uint16]bool{}
		for i, e := range x.Send.GetEntries() {
			se, err := d.entry(e, true)
			if err != nil {
				return fmt.Errorf("entry %d: %w", i, err)
			}
			se.TookQoS2 = false // an append's mark: a send records nothing
			if se.QoS > 0 {
				if seen[se.PacketID] {
					return invalid("packet_id %d twice", se.PacketID)
				}
				seen[se.PacketID] = true
			}
			o.Entries = append(o.Entries, se)
		}
	case *persistencev1.WriteOp_Pubrel:
		o.Kind = store.OpPubrel
		o.PacketID, err = packetID(x.Pubrel.GetPacketId())
	case *persistencev1.WriteOp_Complete:
		o.Kind = store.OpComplete
		if err = count(len(x.Complete.GetPacketIds())); err != nil {
			return err
		}
		for _, p := range x.Complete.GetPacketIds() {
			pid, err := packetID(p)
			if err != nil {
				return err
			}
			o.PacketIDs = append(o.PacketIDs, pid)
		}
	case *persistencev1.WriteOp_Dequeue:
		o.Kind = store.OpDequeue
		if err = count(len(x.Dequeue.GetMsgIds())); err != nil {
			return err
		}
		for _, id := range x.Dequeue.GetMsgIds() {
			s, err := d.msgID(id)
			if err != nil {
				return err
			}
			o.MsgIDs = append(o.MsgIDs, s)
		}
	case *persistencev1.WriteOp_PutIncoming:
		o.Kind = store.OpPutIncoming
		in := x.PutIncoming.GetIncoming()
		if o.Incoming.PacketID, err = packetID(in.GetPacketId()); err != nil {
			return err
		}
		o.Incoming.MsgID, err = d.msgID(in.GetMsgId())
		if err == nil && in.GetUnconfirmed() {
			o.Incoming.MsgID = unconfirmedValue(o.Incoming.MsgID, in.GetFingerprint())
		}
	case *persistencev1.WriteOp_DeleteIncoming:
		o.Kind = store.OpDeleteIncoming
		o.PacketID, err = packetID(x.DeleteIncoming.GetPacketId())
	default:
		return invalid("op kind is required")
	}
	return err
}

// The stores keep an inbound QoS 2 record's msgID as an opaque string. An
// unconfirmed one (not acknowledged to its publisher, to be routed again
// under the same msgID) is kept as "~<msgID>#<fingerprint, hex>". An edge ID
// may start with "~" and hold "#", but a msgID ends in "/<seq>": nothing
// after its last "#" is free of "/", so a value is unconfirmed only if what
// follows its last "#" parses as hex.
const unconfirmedMark = "~"

func unconfirmedValue(msgID string, fingerprint uint64) string {
	return unconfirmedMark + msgID + "#" + strconv.FormatUint(fingerprint, 16)
}

// IncomingOut is the API form of a stored inbound QoS 2 record.
func IncomingOut(in store.Incoming) *persistencev1.Incoming {
	out := &persistencev1.Incoming{PacketId: uint32(in.PacketID)}
	v := in.MsgID
	if rest, ok := strings.CutPrefix(v, unconfirmedMark); ok {
		if i := strings.LastIndexByte(rest, '#'); i >= 0 {
			if f, err := strconv.ParseUint(rest[i+1:], 16, 64); err == nil {
				v, out.Unconfirmed, out.Fingerprint = rest[:i], true, f
			}
		}
	}
	out.MsgId, _ = ParseMsgID(v)
	return out
}
