package remotestore

import (
	"cmp"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/keelmq/keel/libs/topic"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

// The persistence service refuses a whole batch when one of its ops is
// malformed, which would fail every caller sharing the batch. So the store
// checks each op against the service's limits (server.DefaultLimits) before
// it joins a batch, and refuses it alone.
const (
	maxOpEntries  = 4096 // entries, packet IDs or msgIDs per op
	maxBatchOps   = 4096 // ops per batch
	maxEdgeID     = 256  // bytes of a msgID's edge ID
	maxClientID   = 65535
	maxProperties = 64 << 10 // bytes of session properties, and of a message's MQTT 5 properties
	maxSubIDs     = 32       // subscription identifiers per entry
	maxSubID      = 268435455
)

// codec converts between the edge's durable records, whose names are
// internal (tenant-scoped), and the persistence API's, whose names are the
// ones clients use, with the tenant apart.
type codec struct {
	maxPayload int
	scopes     sync.Map // tenant → *tenancy.Scope
}

func (c *codec) scope(tenant string) (*tenancy.Scope, error) {
	if sc, ok := c.scopes.Load(tenant); ok {
		return sc.(*tenancy.Scope), nil
	}
	sc, err := tenancy.NewScope(tenant)
	if err != nil {
		return nil, fmt.Errorf("%w: tenant %.70q: %v", ErrInvalid, tenant, err)
	}
	actual, _ := c.scopes.LoadOrStore(tenant, sc)
	return actual.(*tenancy.Scope), nil
}

// key splits an internal client ID into the session key.
func sessionKey(id string) (*commonv1.SessionKey, error) {
	tenant, clientID, ok := tenancy.TenantOfClientID(id)
	if !ok || !tenancy.ValidTenant(tenant) {
		return nil, fmt.Errorf("%w: %.80q is not an internal client ID", ErrInvalid, id)
	}
	if len(clientID) > maxClientID || !utf8.ValidString(clientID) {
		return nil, fmt.Errorf("%w: client ID must be valid UTF-8 of at most %d bytes", ErrInvalid, maxClientID)
	}
	return &commonv1.SessionKey{Tenant: tenant, ClientId: clientID}, nil
}

// msgIDString is the edge's (and the store's) form of a msgID:
// "<edge>/<incarnation>/<seq>".
func msgIDString(id *commonv1.MsgID) string {
	return id.GetEdgeId() + "/" + strconv.FormatUint(id.GetIncarnation(), 10) + "/" + strconv.FormatUint(id.GetSeq(), 10)
}

// parseMsgID reverses msgIDString; the numbers are read from the right, so
// an edge ID may contain '/'.
func parseMsgID(s string) (*commonv1.MsgID, error) {
	i := strings.LastIndexByte(s, '/')
	if i < 0 {
		return nil, fmt.Errorf("%w: msgID %.80q has no sequence", ErrInvalid, s)
	}
	j := strings.LastIndexByte(s[:i], '/')
	if j <= 0 {
		return nil, fmt.Errorf("%w: msgID %.80q has no edge or incarnation", ErrInvalid, s)
	}
	seq, err := strconv.ParseUint(s[i+1:], 10, 64)
	if err != nil || seq == 0 {
		return nil, fmt.Errorf("%w: msgID %.80q: sequence must be a number from 1", ErrInvalid, s)
	}
	inc, err := strconv.ParseUint(s[j+1:i], 10, 64)
	if err != nil {
		return nil, fmt.Errorf("%w: msgID %.80q: %v", ErrInvalid, s, err)
	}
	if j > maxEdgeID || !utf8.ValidString(s[:j]) {
		return nil, fmt.Errorf("%w: msgID edge must be 1-%d bytes of UTF-8", ErrInvalid, maxEdgeID)
	}
	return &commonv1.MsgID{EdgeId: s[:j], Incarnation: inc, Seq: seq}, nil
}

// message converts a stored message for a session of tenant ("" for a
// retained message, whose topic names its tenant).
//
// Expiry is what the edge delivers by, so it travels as the interval from
// ingress to Expiry (the received interval, unless the edge capped it):
// the service computes the same instant from it, and so does messageIn.
func (c *codec) message(m *durable.Message, tenant string) (*commonv1.Message, error) {
	if m == nil {
		return nil, fmt.Errorf("%w: entry without its message", ErrInvalid)
	}
	id, err := parseMsgID(m.ID)
	if err != nil {
		return nil, err
	}
	t, name, ok := tenancy.TenantOfTopic(m.Topic)
	if !ok || !tenancy.ValidTenant(t) {
		return nil, fmt.Errorf("%w: message %s: %.80q is not an internal topic", ErrInvalid, m.ID, m.Topic)
	}
	if tenant != "" && t != tenant {
		return nil, fmt.Errorf("%w: message %s of tenant %q for a session of tenant %q", ErrInvalid, m.ID, t, tenant)
	}
	if err := topic.ValidateName(name, topic.Limits{}); err != nil {
		return nil, fmt.Errorf("%w: message %s: topic: %v", ErrInvalid, m.ID, err)
	}
	if len(m.Payload) > c.maxPayload {
		return nil, fmt.Errorf("%w: message %s: payload of %d bytes exceeds %d", ErrInvalid, m.ID, len(m.Payload), c.maxPayload)
	}
	if m.QoS > 2 {
		return nil, fmt.Errorf("%w: message %s: QoS %d", ErrInvalid, m.ID, m.QoS)
	}
	out := &commonv1.Message{Id: id, Tenant: t, Topic: name, Payload: m.Payload, Qos: uint32(m.QoS), Retain: m.Retain,
		IngressUnixNano: m.Created}
	if m.Origin != "" {
		if _, cid, ok := tenancy.TenantOfClientID(m.Origin); ok {
			out.ClientId = cid
		}
	}
	if hasProps(m.Props) {
		var p durable.Props
		if err := json.Unmarshal(m.Props, &p); err != nil {
			return nil, fmt.Errorf("%w: message %s: properties: %v", ErrInvalid, m.ID, err)
		}
		if p.PayloadFormat != nil {
			if *p.PayloadFormat > 1 {
				return nil, fmt.Errorf("%w: message %s: payload format %d", ErrInvalid, m.ID, *p.PayloadFormat)
			}
			out.PayloadFormat = uint32(*p.PayloadFormat)
		}
		out.ContentType, out.ResponseTopic, out.CorrelationData = p.ContentType, p.ResponseTopic, p.CorrelationData
		if len(p.User) > 0 {
			out.UserProperties = make([]*commonv1.UserProperty, len(p.User))
			for i, u := range p.User {
				out.UserProperties[i] = &commonv1.UserProperty{Key: u.Key, Value: u.Val}
			}
		}
	}
	if m.Expiry != 0 {
		left := max(m.Expiry-m.Created/int64(time.Second), 0)
		interval := uint32(min(left, int64(^uint32(0))))
		out.MessageExpiryInterval = &interval
	}
	if n := propsSize(out); n > maxProperties {
		return nil, fmt.Errorf("%w: message %s: properties of about %d bytes exceed %d", ErrInvalid, m.ID, n, maxProperties)
	}
	return out, nil
}

// hasProps reports whether p holds any property: the edge stores "{}" for a
// message without.
func hasProps(p json.RawMessage) bool {
	return len(p) > 0 && string(p) != "{}" && string(p) != "null"
}

// propsSize bounds from above the size of what the service stores as the
// message's properties (a protobuf of the message without id, topic and
// payload): each field's bytes with the largest tag and length prefix.
func propsSize(m *commonv1.Message) int {
	const field = 1 + 3 // tag, length up to 2 MiB
	n := 4 * field      // tenant, client ID, content type, response topic
	n += len(m.GetTenant()) + len(m.GetClientId()) + len(m.GetContentType()) + len(m.GetResponseTopic())
	n += field + len(m.GetCorrelationData())
	for _, u := range m.GetUserProperties() {
		n += 3*field + len(u.GetKey()) + len(u.GetValue())
	}
	return n + 16 // payload format, expiry interval
}

// messageIn converts a message read from the service back, for tenant.
func (c *codec) messageIn(m *commonv1.Message, tenant string) (*durable.Message, error) {
	if t := m.GetTenant(); t != "" {
		tenant = t
	}
	sc, err := c.scope(tenant)
	if err != nil {
		return nil, err
	}
	out := &durable.Message{ID: msgIDString(m.GetId()), Topic: sc.Topic(m.GetTopic()), Payload: m.GetPayload(),
		QoS: byte(m.GetQos()), Retain: m.GetRetain(), Created: m.GetIngressUnixNano()}
	if cid := m.GetClientId(); cid != "" {
		out.Origin = sc.ClientID(cid)
	}
	p := durable.Props{ContentType: m.GetContentType(), ResponseTopic: m.GetResponseTopic(), CorrelationData: m.GetCorrelationData()}
	if f := m.GetPayloadFormat(); f > 0 {
		b := byte(f)
		p.PayloadFormat = &b
	}
	for _, u := range m.GetUserProperties() {
		p.User = append(p.User, packets.UserProperty{Key: u.GetKey(), Val: u.GetValue()})
	}
	if m.MessageExpiryInterval != nil {
		p.Expiry = m.GetMessageExpiryInterval()
		out.Expiry = m.GetIngressUnixNano()/int64(time.Second) + int64(p.Expiry)
	}
	// Always present, as the edge writes it, so that readers need not care.
	if out.Props, err = json.Marshal(&p); err != nil {
		return nil, fmt.Errorf("message %s: properties: %w", out.ID, err)
	}
	return out, nil
}

// entry converts a queue or in-flight entry; withPacket keeps its packet ID
// and PUBREL state (a send), which an append has no use for.
func entry(e *durable.Entry, withPacket bool) (*persistencev1.Entry, error) {
	id, err := parseMsgID(e.MsgID)
	if err != nil {
		return nil, err
	}
	if e.QoS > 2 {
		return nil, fmt.Errorf("%w: entry %s: QoS %d", ErrInvalid, e.MsgID, e.QoS)
	}
	out := &persistencev1.Entry{MsgId: id, Qos: uint32(e.QoS), Retain: e.Retain, TookQos2: e.TookQoS2 && !withPacket}
	if len(e.SubIDs) > maxSubIDs {
		return nil, fmt.Errorf("%w: entry %s: %d subscription identifiers", ErrInvalid, e.MsgID, len(e.SubIDs))
	}
	for _, s := range e.SubIDs {
		switch {
		case s == 0:
			// 0 is no identifier; the service refuses it as one.
		case s < 0 || s > maxSubID:
			return nil, fmt.Errorf("%w: entry %s: subscription identifier %d", ErrInvalid, e.MsgID, s)
		default:
			out.SubscriptionIdentifiers = append(out.SubscriptionIdentifiers, uint32(s))
		}
	}
	if withPacket && e.QoS > 0 {
		if e.PacketID == 0 {
			return nil, fmt.Errorf("%w: entry %s: in flight without a packet ID", ErrInvalid, e.MsgID)
		}
		if e.Pubrel && e.QoS != 2 {
			return nil, fmt.Errorf("%w: entry %s: PUBREL state on a QoS %d delivery", ErrInvalid, e.MsgID, e.QoS)
		}
		out.PacketId, out.Pubrel = uint32(e.PacketID), e.Pubrel
	}
	return out, nil
}

// entryIn converts an entry read back (its message is joined by the caller).
func entryIn(e *persistencev1.Entry) durable.Entry {
	out := durable.Entry{Seq: e.GetSeq(), PacketID: uint16(e.GetPacketId()), MsgID: msgIDString(e.GetMsgId()),
		QoS: byte(e.GetQos()), Retain: e.GetRetain(), Pubrel: e.GetPubrel()}
	for _, s := range e.GetSubscriptionIdentifiers() {
		out.SubIDs = append(out.SubIDs, int(s))
	}
	return out
}

// subscription converts a subscription; its filter goes out in the form the
// client subscribed with ("$share/<group>/..." and "$queue/..." included).
func (c *codec) subscription(tenant string, sub *durable.Subscription) (*persistencev1.Subscription, error) {
	sc, err := c.scope(tenant)
	if err != nil {
		return nil, err
	}
	filter, err := outsideFilter(sc, sub.Filter)
	if err != nil {
		return nil, err
	}
	if sub.QoS > 2 || sub.RetainHandling > 2 || sub.Identifier < 0 || sub.Identifier > maxSubID {
		return nil, fmt.Errorf("%w: subscription %q: QoS %d, retain handling %d, identifier %d", ErrInvalid,
			filter, sub.QoS, sub.RetainHandling, sub.Identifier)
	}
	return &persistencev1.Subscription{Filter: filter, Qos: uint32(sub.QoS), NoLocal: sub.NoLocal,
		RetainAsPublished: sub.RetainAsPublished, RetainHandling: uint32(sub.RetainHandling),
		SubscriptionIdentifier: uint32(sub.Identifier)}, nil
}

func outsideFilter(sc *tenancy.Scope, internal string) (string, error) {
	filter, ok := sc.ExternalFilter(internal)
	if !ok {
		return "", fmt.Errorf("%w: filter %.80q is not of tenant %q", ErrInvalid, internal, sc.Tenant())
	}
	if err := topic.ValidateFilter(filter, topic.Limits{}); err != nil {
		return "", fmt.Errorf("%w: filter %.80q: %v", ErrInvalid, filter, err)
	}
	return filter, nil
}

func subscriptionIn(sc *tenancy.Scope, s *persistencev1.Subscription) durable.Subscription {
	filter, _ := sc.Filter(s.GetFilter())
	return durable.Subscription{Filter: filter, QoS: byte(s.GetQos()), NoLocal: s.GetNoLocal(),
		RetainAsPublished: s.GetRetainAsPublished(), RetainHandling: byte(s.GetRetainHandling()),
		Identifier: int(s.GetSubscriptionIdentifier())}
}

// sessionProps carries the parts of a session record the API has no field
// for, in the record's properties, which the service keeps opaque.
type sessionProps struct {
	Listener string          `json:"l,omitempty"`
	Username []byte          `json:"u,omitempty"`
	Clean    bool            `json:"c,omitempty"`
	Props    json.RawMessage `json:"p,omitempty"`
}

func (c *codec) sessionRecord(rec *durable.Session) (*persistencev1.Session, error) {
	switch rec.ProtocolVersion {
	case 3, 4, 5:
	default:
		return nil, fmt.Errorf("%w: session %q: protocol version %d", ErrInvalid, rec.ID, rec.ProtocolVersion)
	}
	props, err := json.Marshal(&sessionProps{Listener: rec.Listener, Username: rec.Username, Clean: rec.Clean, Props: rec.Props})
	if err != nil {
		return nil, fmt.Errorf("%w: session %q: properties: %v", ErrInvalid, rec.ID, err)
	}
	if len(props) > maxProperties {
		return nil, fmt.Errorf("%w: session %q: properties of %d bytes exceed %d", ErrInvalid, rec.ID, len(props), maxProperties)
	}
	out := &persistencev1.Session{ProtocolVersion: uint32(rec.ProtocolVersion), SessionExpiryInterval: rec.ExpiryInterval,
		DisconnectedUnixNano: rec.Disconnected, Properties: props}
	if w := rec.Will; w != nil {
		tenant, _, _ := tenancy.TenantOfClientID(rec.ID)
		m, err := c.message(w.Msg, tenant)
		if err != nil {
			return nil, fmt.Errorf("session %q: will: %w", rec.ID, err)
		}
		// A will's expiry interval counts from its publication, which has
		// not happened: it travels as received.
		if m.MessageExpiryInterval == nil && hasProps(w.Msg.Props) {
			var p durable.Props
			if json.Unmarshal(w.Msg.Props, &p) == nil && p.Expiry > 0 {
				m.MessageExpiryInterval = &p.Expiry
			}
		}
		out.Will = &persistencev1.Will{Message: m, DelayInterval: w.Delay}
	}
	return out, nil
}

func (c *codec) sessionIn(id string, s *persistencev1.Session) (durable.Session, error) {
	out := durable.Session{ID: id, ProtocolVersion: byte(s.GetProtocolVersion()), ExpiryInterval: s.GetSessionExpiryInterval(),
		Disconnected: s.GetDisconnectedUnixNano()}
	if len(s.GetProperties()) > 0 {
		var p sessionProps
		if err := json.Unmarshal(s.GetProperties(), &p); err != nil {
			return out, fmt.Errorf("session %q: properties: %w", id, err)
		}
		out.Listener, out.Username, out.Clean, out.Props = p.Listener, p.Username, p.Clean, p.Props
	}
	if w := s.GetWill(); w.GetMessage() != nil {
		tenant, _, _ := tenancy.TenantOfClientID(id)
		m, err := c.messageIn(w.GetMessage(), tenant)
		if err != nil {
			return out, fmt.Errorf("session %q: will: %w", id, err)
		}
		m.Expiry = 0 // counted from its publication
		out.Will = &durable.Will{Msg: m, Delay: w.GetDelayInterval()}
	}
	return out, nil
}

// orderInflight puts in-flight entries in the order they were most likely
// sent and numbers them (Order 1, 2, ...): the service keeps no send order.
// Packet IDs are no guide: the edge hands them out counting down and starts
// again at the top on every resumption. Sessions deliver in the order
// messages reached them, and messages of one publisher (the only order MQTT
// promises) reach a session in ingress order: so the order is ingress time,
// then msgID (whose sequence counts up per ingress edge incarnation).
func orderInflight(entries []durable.Entry) {
	slices.SortStableFunc(entries, func(a, b durable.Entry) int {
		if c := cmp.Compare(a.Msg.Created, b.Msg.Created); c != 0 {
			return c
		}
		ia, _ := parseMsgID(a.MsgID)
		ib, _ := parseMsgID(b.MsgID)
		if c := strings.Compare(ia.GetEdgeId(), ib.GetEdgeId()); c != 0 {
			return c
		}
		if c := cmp.Compare(ia.GetIncarnation(), ib.GetIncarnation()); c != 0 {
			return c
		}
		return cmp.Compare(ia.GetSeq(), ib.GetSeq())
	})
	for i := range entries {
		entries[i].Order = int64(i + 1)
	}
}
