package broker

import (
	"math"
	"sync/atomic"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"go.opentelemetry.io/otel/trace"

	"github.com/keelmq/keel/services/edge/internal/durable"
)

// MsgID identifies an application message across the cluster: the edge that
// took it in, that edge's incarnation, and a sequence number.
type MsgID struct {
	Edge        string
	Incarnation uint64
	Seq         uint64
}

// Message is one application message inside the edge. It is immutable once
// built and shared by every recipient.
type Message struct {
	ID      MsgID
	Topic   string // internal form
	Payload []byte
	QoS     byte
	Retain  bool
	// Props carries the MQTT 5 properties forwarded to subscribers: payload
	// format, content type, response topic, correlation data, user properties
	// and message expiry. Topic alias and subscription identifiers are per
	// connection and never stored here.
	Props   Props
	Origin  string // internal client ID of the publisher; empty for the broker
	Created int64  // unix nanoseconds at ingress
	Expiry  int64  // unix seconds after which it must not be delivered; 0 never

	rec atomic.Pointer[durable.Message] // stored form, built on first need
	// span is the message's sampled span on this edge (its publish, or its
	// delivery from another edge); nil when its trace is not sampled, so
	// an untraced message costs one nil check per traced step.
	span trace.Span
	// deferred, when set, collects the durable writes its delivery
	// submitted instead of waiting for each (see [DeferWrites]).
	deferred *Deferred
	// picks holds the members of shared groups that took the message here
	// (QoS 1/2), remembered if it fails (sharedPicks).
	picks []groupPick
	// edges holds the edges chosen to serve shared groups for a QoS 2
	// message published here (EdgeFor), remembered if its publisher is
	// not acknowledged (sharedPicks): the resend goes to them again.
	edges []edgePick
	// quiet: nothing arrived behind the message (its publisher had nothing
	// more to read, or its frame carried it alone), so its deliveries to
	// idle sessions may be written alone (writeAlone); alones counts those.
	quiet  bool
	alones atomic.Int32
	// forwarding tells of the copies of the message that its last
	// forwarding (Peers.Forward) sent to other edges: 0 while none was
	// told of, then 1 + the copies not taken yet, and below 0 once one
	// failed. The acknowledgement queue writes what it holds before a
	// wait that would block (sendAcks). A count rather than what Forward
	// waits for: a message can outlive its forwarding by far (retained,
	// queued).
	forwarding atomic.Int32
}

// forwardFailed is what a failed copy sets forwarding to: far enough
// below 0 that the other copies' reports never bring it back up.
const forwardFailed = math.MinInt32 / 2

// Forwarding records that n copies of m go to other edges, to be reported
// on by ForwardTaken or ForwardFailed each. It comes before they are sent,
// and after every copy of an earlier forwarding of m was reported on.
func (m *Message) Forwarding(n int) { m.forwarding.Store(int32(n) + 1) }

// ForwardTaken reports that one copy of m was taken by its edge.
func (m *Message) ForwardTaken() { m.forwarding.Add(-1) }

// ForwardFailed reports that one copy of m was not taken.
func (m *Message) ForwardFailed() { m.forwarding.Store(forwardFailed) }

// ForwardsTaken reports whether every copy of m's last forwarding was
// taken; false when nothing told of one.
func (m *Message) ForwardsTaken() bool { return m.forwarding.Load() == 1 }

// edgePick is the edge chosen to serve one shared group for a message.
type edgePick struct {
	group GroupKey // outside form
	edge  string
}

// EdgeFor returns the edge chosen before to serve shared group g (in the
// tenant's outside form) for m, "" if none: a QoS 2 message sent again by
// a publisher that was not acknowledged goes to the edge its first copy
// went to, whose member may have it already. Another edge would give it
// to a second member of the group ([MQTT-4.8.2-5], invariant 2).
func (m *Message) EdgeFor(g GroupKey) string {
	for _, p := range m.edges {
		if p.group == g {
			return p.edge
		}
	}
	return ""
}

// ChoseEdge records that edge serves shared group g for m (see EdgeFor).
// The forwarder records its choices for QoS 2 messages as it makes them.
func (m *Message) ChoseEdge(g GroupKey, edge string) {
	for i := range m.edges {
		if m.edges[i].group == g {
			m.edges[i].edge = edge
			return
		}
	}
	m.edges = append(m.edges, edgePick{group: g, edge: edge})
}

// Span returns the message's sampled span, nil when it is not traced.
func (m *Message) Span() trace.Span { return m.span }

// remainingExpiry returns the message expiry interval to send, and whether
// the message has already expired.
func (m *Message) remainingExpiry(now int64) (uint32, bool) {
	if m.Expiry == 0 {
		return 0, false
	}
	left := m.Expiry - now
	if left <= 0 {
		return 0, true
	}
	return uint32(left), false
}

func (m *Message) size() int { return len(m.Topic) + len(m.Payload) + 64 }

// msgIDs hands out message IDs for one edge incarnation.
type msgIDs struct {
	edge        string
	incarnation uint64
	seq         atomic.Uint64
}

func newMsgIDs(edge string) *msgIDs {
	return &msgIDs{edge: edge, incarnation: uint64(time.Now().UnixNano())}
}

func (g *msgIDs) next() MsgID {
	return MsgID{Edge: g.edge, Incarnation: g.incarnation, Seq: g.seq.Add(1)}
}

// Props are the MQTT 5 properties that travel with a message, named as in
// mochi's packets.Properties: only these, because a message is allocated
// per publish and mochi's struct is four times the size.
type Props struct {
	PayloadFormat         byte
	PayloadFormatFlag     bool
	MessageExpiryInterval uint32
	ContentType           string
	ResponseTopic         string
	CorrelationData       []byte
	User                  []packets.UserProperty
}

// packet returns p in mochi's form.
func (p *Props) packet() packets.Properties {
	return packets.Properties{
		PayloadFormat:         p.PayloadFormat,
		PayloadFormatFlag:     p.PayloadFormatFlag,
		MessageExpiryInterval: p.MessageExpiryInterval,
		ContentType:           p.ContentType,
		ResponseTopic:         p.ResponseTopic,
		CorrelationData:       p.CorrelationData,
		User:                  p.User,
	}
}

// forwardProps copies the properties of an incoming PUBLISH that travel with
// the message (MQTT 5.0 §3.3.2.3: the server forwards them unaltered).
func forwardProps(p *packets.Properties) Props {
	return Props{
		PayloadFormat:         p.PayloadFormat,
		PayloadFormatFlag:     p.PayloadFormatFlag,
		ContentType:           p.ContentType,
		ResponseTopic:         p.ResponseTopic,
		CorrelationData:       p.CorrelationData,
		User:                  p.User,
		MessageExpiryInterval: p.MessageExpiryInterval,
	}
}
