package broker

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/hooks/storage"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

// storeTimeout bounds a wait for the durable store on a client's path.
const storeTimeout = 10 * time.Second

// restored is the state loaded at start, handed to mochi through the
// storage hooks so that it recreates the disconnected clients.
type restored struct {
	clients  []storage.Client
	subs     []storage.Subscription
	incoming []storage.Message // PUBREC records of inbound QoS 2 messages
	// ended are the records a single-node edge's stop kept of sessions
	// that ended with it, for their wills; wills are those of persistent
	// sessions that hold a will (restoredWills).
	ended, wills []durable.Session
}

// Restore attaches durable state and loads persistent sessions and
// retained messages from it. Call before Serve.
func (b *Broker) Restore(st DurableState) error {
	sessions, retained, err := st.Load()
	if err != nil {
		return fmt.Errorf("load durable state: %w", err)
	}
	b.store = st
	msgs := map[string]*Message{}
	toMsg := func(r *durable.Message) *Message {
		if m, ok := msgs[r.ID]; ok {
			return m
		}
		m := fromRecord(r)
		msgs[r.ID] = m
		return m
	}
	for i := range retained {
		b.retained.set(toMsg(&retained[i]))
	}
	rs := &restored{}
	queued, inflight := 0, 0
	for _, st := range sessions {
		rec := st.Session
		tenant, _, ok := tenancy.TenantOfClientID(rec.ID)
		if !ok {
			b.logger.Warn("skipping stored session with an invalid id", "client_id", rec.ID)
			continue
		}
		sc, err := b.scope(tenant)
		if err != nil {
			continue
		}
		if !rec.Persistent() {
			// Only the will of a session that ended is left.
			rs.ended = append(rs.ended, rec)
			continue
		}
		if rec.Will != nil {
			rs.wills = append(rs.wills, rec)
		}
		s, client, subs, incoming := b.adopt(st, sc, toMsg)
		b.indexSubs(s)
		rs.subs = append(rs.subs, subs...)
		rs.incoming = append(rs.incoming, incoming...)
		rs.clients = append(rs.clients, client)
		queued += len(st.Queue)
		inflight += len(st.Inflight)
		b.sessions[rec.ID] = s
	}
	b.restore = rs
	b.logger.Info("durable state loaded", "sessions", len(sessions), "queued", queued, "inflight", inflight, "retained", len(retained))
	return nil
}

// adopt builds the live session of a stored one, and what mochi must know
// of it: the offline client, its subscriptions and its inbound QoS 2 state.
// The session takes no message until the caller indexes its subscriptions
// (indexSubs), once it is whole.
func (b *Broker) adopt(st durable.SessionState, sc *tenancy.Scope, toMsg func(*durable.Message) *Message) (*session, storage.Client, []storage.Subscription, []storage.Message) {
	rec := st.Session
	var subs []storage.Subscription
	var incoming []storage.Message
	s := newSession(b, rec.ID, sc)
	// Its routes are not registered yet: a message routed again does not
	// skip it. importSession marks it routable once they are; a session
	// restored at start stays so, which costs at most a duplicate.
	s.routable.Store(math.MaxInt64)
	s.persistent, s.durable = true, true
	for _, sub := range st.Subs {
		x := &subscription{sess: s, full: sub.Filter, filter: sub.Filter, qos: sub.QoS, noLocal: sub.NoLocal,
			rap: sub.RetainAsPublished, rh: sub.RetainHandling}
		if sub.Identifier > 0 {
			x.ids = []int{sub.Identifier}
		}
		if group, inner, shared, _ := parseShare(sub.Filter); shared {
			x.filter = inner
			x.group = &shareGroup{name: group, filter: inner}
		}
		s.subs[sub.Filter] = x
		s.nsubs.Store(int32(len(s.subs)))
		subs = append(subs, storage.Subscription{Client: rec.ID, Filter: sub.Filter, Qos: sub.QoS,
			NoLocal: sub.NoLocal, RetainAsPublished: sub.RetainAsPublished, RetainHandling: sub.RetainHandling, Identifier: sub.Identifier})
	}
	for _, e := range st.Queue {
		m := toMsg(e.Msg)
		s.queue.push(delivery{msg: m, qos: e.QoS, retain: e.Retain, ids: e.SubIDs, seq: e.Seq})
		s.queueBytes += m.size()
		s.seq = max(s.seq, e.Seq)
	}
	for _, e := range st.Inflight {
		m := toMsg(e.Msg)
		d := delivery{msg: m, qos: e.QoS, retain: e.Retain, ids: e.SubIDs}
		pk := inflightPacket(&d, e.PacketID, e.Retain, e.Order)
		if e.Pubrel {
			pk = packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: e.PacketID, Created: e.Order}
		}
		s.resend = append(s.resend, pk)
		s.seq = max(s.seq, e.Seq)
	}
	slices.SortFunc(s.resend, func(a, b packets.Packet) int { return cmp.Compare(a.Created, b.Created) })
	// Remembered from the store, or handed over: a resend of one of these
	// under its msgID is not delivered again.
	for _, id := range st.TookQoS2 {
		s.rememberQoS2(parseMsgID(id))
	}
	for _, in := range st.Incoming {
		if in.Unconfirmed {
			// Not acknowledged: the client sends it again, and it is routed
			// under the same msgID, not answered as a duplicate.
			if s.unconfirmed == nil {
				s.unconfirmed = map[uint16]unconfirmedPub{}
			}
			s.unconfirmed[in.PacketID] = unconfirmedPub{id: parseMsgID(in.MsgID), fp: in.Fingerprint}
			continue
		}
		incoming = append(incoming, storage.Message{Client: rec.ID, PacketID: in.PacketID,
			FixedHeader: packets.FixedHeader{Type: packets.Pubrec}})
	}
	var props storage.ClientProperties
	_ = json.Unmarshal(rec.Props, &props)
	props.SessionExpiryInterval = rec.ExpiryInterval
	props.SessionExpiryIntervalFlag = rec.ExpiryInterval > 0
	client := storage.Client{ID: rec.ID, Listener: rec.Listener, Username: rec.Username,
		ProtocolVersion: rec.ProtocolVersion, Clean: rec.Clean, Properties: props}
	return s, client, subs, incoming
}

// indexSubs makes the subscriptions of s, a session adopt built, match
// published messages. Only once the session is whole: a publisher that
// found it earlier would queue into it while it was being built, unlocked,
// and the two writers of its queue could lose a message or leave an empty
// entry in it.
func (b *Broker) indexSubs(s *session) {
	s.mu.Lock()
	subs := make([]*subscription, 0, len(s.subs))
	for _, x := range s.subs {
		subs = append(subs, x)
	}
	s.mu.Unlock()
	for _, x := range subs {
		b.index.add(x)
	}
}

// The storage hooks mochi calls once, in Serve.

func (h *hook) StoredClients() ([]storage.Client, error) {
	if h.b.restore == nil {
		return nil, nil
	}
	return h.b.restore.clients, nil
}

func (h *hook) StoredSubscriptions() ([]storage.Subscription, error) {
	if h.b.restore == nil {
		return nil, nil
	}
	return h.b.restore.subs, nil
}

// StoredInflightMessages gives mochi the PUBREC records of inbound QoS 2
// messages, so a PUBLISH resent after a restart is not delivered twice.
// (Outbound in-flight messages are resent by the edge itself.)
func (h *hook) StoredInflightMessages() ([]storage.Message, error) {
	if h.b.restore == nil {
		return nil, nil
	}
	out := h.b.restore.incoming
	h.b.restore = nil // loaded once, last of the stored hooks; let it go
	return out, nil
}

func msgIDString(id MsgID) string {
	return id.Edge + "/" + strconv.FormatUint(id.Incarnation, 10) + "/" + strconv.FormatUint(id.Seq, 10)
}

func parseMsgID(s string) MsgID {
	i := strings.LastIndexByte(s, '/')
	j := strings.LastIndexByte(s[:max(i, 0)], '/')
	if i < 0 || j < 0 {
		return MsgID{Edge: s}
	}
	inc, _ := strconv.ParseUint(s[j+1:i], 10, 64)
	seq, _ := strconv.ParseUint(s[i+1:], 10, 64)
	return MsgID{Edge: s[:j], Incarnation: inc, Seq: seq}
}

// record returns the stored form of m, built once and shared.
func (m *Message) record() *durable.Message {
	if r := m.rec.Load(); r != nil {
		return r
	}
	p := durable.Props{ContentType: m.Props.ContentType, ResponseTopic: m.Props.ResponseTopic,
		CorrelationData: m.Props.CorrelationData, User: m.Props.User, Expiry: m.Props.MessageExpiryInterval}
	if m.Props.PayloadFormatFlag {
		f := m.Props.PayloadFormat
		p.PayloadFormat = &f
	}
	props, _ := json.Marshal(&p)
	r := &durable.Message{ID: msgIDString(m.ID), Topic: m.Topic, Payload: m.Payload, QoS: m.QoS, Retain: m.Retain,
		Props: props, Origin: m.Origin, Created: m.Created, Expiry: m.Expiry}
	m.rec.CompareAndSwap(nil, r)
	return m.rec.Load()
}

func fromRecord(r *durable.Message) *Message {
	m := &Message{ID: parseMsgID(r.ID), Topic: r.Topic, Payload: r.Payload, QoS: r.QoS, Retain: r.Retain,
		Origin: r.Origin, Created: r.Created, Expiry: r.Expiry}
	var p durable.Props
	if len(r.Props) > 0 && json.Unmarshal(r.Props, &p) == nil {
		m.Props = Props{ContentType: p.ContentType, ResponseTopic: p.ResponseTopic,
			CorrelationData: p.CorrelationData, User: p.User, MessageExpiryInterval: p.Expiry}
		if p.PayloadFormat != nil {
			m.Props.PayloadFormat, m.Props.PayloadFormatFlag = *p.PayloadFormat, true
		}
	}
	return m
}

// persistSession writes or removes the stored record of the session cl
// establishes, before its CONNACK. The record written is kept in c.record.
//
// The write and the session copy's note of whose record the store holds
// (session.record) change together, under the session's record lock
// (recordWrites): an older connection of the client whose end writes the
// record (dropStoredWill, storeDisconnectExpiry) does so before this
// write, or finds the record is not its own any more and writes nothing.
// Its check alone, made while this connection is not yet bound, would
// pass, and its write would put the older record back over this one (or
// delete it) after this connection's CONNACK.
func (b *Broker) persistSession(cl *mqtt.Client, c *conn) error {
	if b.store == nil {
		return nil
	}
	rec := b.willRecord(sessionRecord(cl, c), c)
	if rec != nil {
		rec.Props = recordProps(cl)
	}
	ctx, cancel := context.WithTimeout(context.Background(), storeTimeout)
	defer cancel()
	unlock, err := b.recordWrites.lock(ctx, cl.ID)
	if err != nil {
		return err
	}
	defer unlock()
	s := b.session(cl.ID)
	if s != nil && s.claimedAfter(c.epoch) || b.establishedClaims.newest(cl.ID) > c.epoch {
		// A newer CONNECT of the client took the session on, or ended it
		// (its establishment stopped waiting for this one's): the stored
		// record is that connection's, and this one is not bound.
		return errRecordSuperseded
	}
	if rec == nil {
		// Only a session that was stored has a record to remove; a clean
		// session without a will costs the store nothing.
		if s != nil && s.stored() {
			if err := b.store.DeleteSession(ctx, cl.ID, true); err != nil {
				return err
			}
		}
	} else {
		if err := b.store.PutSession(ctx, *rec); err != nil {
			return err
		}
		c.stored = rec
		if rec.Will != nil {
			c.record = rec
		}
	}
	if s != nil {
		// The record an older connection's will was kept in is replaced:
		// dropping that will from the store is this write's now.
		s.mu.Lock()
		s.record = c.record
		s.mu.Unlock()
	}
	return nil
}

// sessionRecord is the record of cl's session, without its will and the
// client's properties (recordProps).
func sessionRecord(cl *mqtt.Client, c *conn) durable.Session {
	return durable.Session{ID: cl.ID, Listener: c.listener, Username: cl.Properties.Username,
		ProtocolVersion: cl.Properties.ProtocolVersion, Clean: cl.Properties.Clean,
		ExpiryInterval: cl.Properties.Props.SessionExpiryInterval}
}

// recordProps is the stored form of the CONNECT properties of cl that a
// session restored from its record gives back to mochi.
func recordProps(cl *mqtt.Client) json.RawMessage {
	props, _ := json.Marshal(storage.ClientProperties{
		ReceiveMaximum: cl.Properties.Props.ReceiveMaximum, TopicAliasMaximum: cl.Properties.Props.TopicAliasMaximum,
		MaximumPacketSize: cl.Properties.Props.MaximumPacketSize, User: cl.Properties.Props.User,
		RequestProblemInfo: cl.Properties.Props.RequestProblemInfo, RequestProblemInfoFlag: cl.Properties.Props.RequestProblemInfoFlag,
		RequestResponseInfo: cl.Properties.Props.RequestResponseInfo,
	})
	return props
}

// errRecordSuperseded refuses to store the record of a connection whose
// session a newer claim here took on before it was stored.
var errRecordSuperseded = errors.New("session taken on by a newer connection before its record was stored")

// packet is sub as mochi keeps a subscription.
func (sub *subscription) packet() packets.Subscription {
	r := subRecord(sub)
	return packets.Subscription{Filter: r.Filter, Qos: r.QoS, NoLocal: r.NoLocal, RetainAsPublished: r.RetainAsPublished,
		RetainHandling: r.RetainHandling, Identifier: r.Identifier}
}

func subRecord(sub *subscription) durable.Subscription {
	r := durable.Subscription{Filter: sub.full, QoS: sub.qos, NoLocal: sub.noLocal, RetainAsPublished: sub.rap, RetainHandling: sub.rh}
	if len(sub.ids) > 0 {
		r.Identifier = sub.ids[0]
	}
	return r
}

func entryOf(d *delivery, packetID uint16, order int64) durable.Entry {
	return durable.Entry{Seq: d.seq, PacketID: packetID, Order: order, MsgID: msgIDString(d.msg.ID), QoS: d.qos, Retain: d.retain,
		SubIDs: d.ids, TookQoS2: tracksQoS2(d), Msg: d.msg.record()}
}
