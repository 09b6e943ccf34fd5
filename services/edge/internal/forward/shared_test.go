package forward

import (
	"context"
	"fmt"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"
	"github.com/keelmq/keel/services/edge/internal/broker"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// groupRoutes sends every message of one shared group to the listed peers.
type groupRoutes struct {
	name, filter string
	to           []Peer
}

func (g groupRoutes) Route(context.Context, string, string) (Route, error) {
	return Route{Groups: []GroupRoute{{Name: g.name, Filter: g.filter, Edges: g.to}}}, nil
}

// sharedPair is edge A, which publishes and keeps its group messages, and
// edge B, whose member of the group gets them.
type sharedPair struct {
	a, b *edge
	fwd  *Forwarder
}

func startSharedPair(t *testing.T) *sharedPair {
	t.Helper()
	a, b := startEdge(t, "edge-a"), startEdge(t, "edge-b")
	b.b.SetCluster(broker.Cluster{Reports: b.srv})
	f := connectForwarder(t, a, "edge-a")
	f.Resolver = groupRoutes{name: "g", filter: "t/+", to: []Peer{{ID: "edge-b", URL: b.api.URL}}}
	f.Redispatch = a.b.RedispatchShared
	f.Metrics = NewMetrics(nil)
	return &sharedPair{a: a, b: b, fwd: f}
}

// member connects a clean client to addr and joins $share/g/t/+ at QoS 1.
func member(t *testing.T, addr, id string) *mqtttest.Client {
	t.Helper()
	c := mqtttest.Dial(t, addr, 5)
	c.Connect(id, true, packets.Properties{})
	require.Equal(t, []byte{1}, c.Subscribe(1, "$share/g/t/+", 1).ReasonCodes)
	return c
}

// publishN publishes QoS 1 messages prefix0… on A and waits for every PUBACK.
func (p *sharedPair) publishN(t *testing.T, prefix string, n int) []string {
	t.Helper()
	pub := mqtttest.Dial(t, p.a.mqtt, 5)
	pub.Connect("pub-"+prefix, true, packets.Properties{})
	var sent []string
	for i := range n {
		payload := fmt.Sprintf("%s%d", prefix, i)
		pub.Publish(uint16(i+1), "t/x", 1, []byte(payload))
		sent = append(sent, payload)
	}
	for range n {
		pub.Expect(packets.Puback)
	}
	return sent
}

// readN reads n PUBLISHes, acknowledging each only when ack is set.
func readN(t *testing.T, c *mqtttest.Client, n int, ack bool) []string {
	t.Helper()
	var got []string
	for range n {
		pk := c.Expect(packets.Publish)
		got = append(got, string(pk.Payload))
		if ack {
			c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
		}
	}
	return got
}

func (p *sharedPair) held() float64 { return testutil.ToFloat64(p.fwd.Metrics.sharedHeld) }

// A QoS 1 group message forwarded to a member on another edge stays the
// publishing edge's until that member acknowledges it: the messages the
// member acknowledged are forgotten, and those it left unacknowledged when
// its session ended come back and go to a member on the publishing edge.
func TestForward_SharedMessageComesBackWhenMemberGoes(t *testing.T) {
	t.Parallel()
	p := startSharedPair(t)
	remote := member(t, p.b.mqtt, "remote")
	local := member(t, p.a.mqtt, "local") // not routed to: the route names edge B only

	sent := p.publishN(t, "m", 5)
	got := readN(t, remote, 5, false)
	require.Equal(t, sent, got)
	require.Equal(t, 5.0, p.held())

	// The member acknowledges the first two: those are its for good.
	for id := uint16(65535); id > 65533; id-- {
		remote.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: id})
	}
	require.Eventually(t, func() bool { return p.held() == 3 }, 5*time.Second, 10*time.Millisecond)

	// Its session ends with three unacknowledged: they come back to A.
	_ = remote.Conn.Close()
	require.Equal(t, sent[2:], readN(t, local, 3, true))
	require.Eventually(t, func() bool { return p.held() == 0 }, 5*time.Second, 10*time.Millisecond)
	require.Equal(t, 2.0, testutil.ToFloat64(p.fwd.Metrics.sharedOutcomes.WithLabelValues("acked")))
	require.Equal(t, 3.0, testutil.ToFloat64(p.fwd.Metrics.sharedOutcomes.WithLabelValues("member_gone")))
}

// When the edge holding a member leaves the membership (it died), the
// group messages it took and never reported acknowledged are re-dispatched
// by the publishing edge.
func TestForward_SharedMessageComesBackWhenEdgeDies(t *testing.T) {
	t.Parallel()
	p := startSharedPair(t)
	remote := member(t, p.b.mqtt, "remote")
	local := member(t, p.a.mqtt, "local")

	sent := p.publishN(t, "m", 4)
	require.Equal(t, sent, readN(t, remote, 4, false))
	p.fwd.PeerGone("edge-b")
	p.b.api.Close() // and nothing more reaches B
	require.Equal(t, sent, readN(t, local, 4, true))
	require.Zero(t, p.held())
}

// A member that refuses a group message (PUBACK reason ≥ 0x80) sends it
// back to the publishing edge, which gives it to another member.
func TestForward_SharedMessageRefusedGoesElsewhere(t *testing.T) {
	t.Parallel()
	p := startSharedPair(t)
	remote := mqtttest.Dial(t, p.b.mqtt, 5)
	remote.Connect("remote", true, packets.Properties{})
	require.Equal(t, []byte{1}, remote.Subscribe(1, "$share/g/t/+", 1).ReasonCodes)
	local := member(t, p.a.mqtt, "local")

	sent := p.publishN(t, "m", 1)
	pk := remote.Expect(packets.Publish)
	remote.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID,
		ReasonCode: packets.ErrUnspecifiedError.Code})
	require.Equal(t, sent, readN(t, local, 1, true))
	require.Equal(t, 1.0, testutil.ToFloat64(p.fwd.Metrics.sharedOutcomes.WithLabelValues("refused")))
}

// pendingOutcomes counts the outcomes srv keeps for an edge incarnation.
func pendingOutcomes(srv *Server, edge string, inc uint64) int {
	srv.mu.Lock()
	ob := srv.outboxes[peerKey{edge, inc}]
	srv.mu.Unlock()
	if ob == nil {
		return 0
	}
	ob.mu.Lock()
	defer ob.mu.Unlock()
	return len(ob.pending)
}

// When the publishing edge leaves before it heard that a member went, the
// edge that held the member re-dispatches the messages itself.
func TestForward_SharedMessageStaysWhenOriginGoes(t *testing.T) {
	t.Parallel()
	a, b := startEdge(t, "edge-a"), startEdge(t, "edge-b")
	b.b.SetCluster(broker.Cluster{Reports: b.srv})
	_, inc := a.b.ID()
	f := &Forwarder{Self: "edge-a", Incarnation: func() uint64 { return inc }, Bound: time.Second, Logger: a.srv.Logger,
		Resolver:   groupRoutes{name: "g", filter: "t/+", to: []Peer{{ID: "edge-b", URL: b.api.URL}}},
		Redispatch: a.b.RedispatchShared}
	stop := runForwarder(t, a, f)
	p := &sharedPair{a: a, b: b, fwd: f}

	remote := member(t, b.mqtt, "remote")
	sent := p.publishN(t, "m", 3)
	require.Equal(t, sent, readN(t, remote, 3, false))
	stop() // edge A stops: its stream to B ends
	_ = remote.Conn.Close()
	require.Eventually(t, func() bool { return pendingOutcomes(b.srv, "edge-a", inc) == 3 }, 5*time.Second, 10*time.Millisecond)

	other := member(t, b.mqtt, "other")
	b.srv.PeerGone("edge-a")
	require.Equal(t, sent, readN(t, other, 3, true))
	require.Zero(t, pendingOutcomes(b.srv, "edge-a", inc))
}

// A peer that reports nothing (an edge of an earlier version) does not
// make the publishing edge keep group messages without bound.
func TestForward_SharedMessagesKeptUpToABound(t *testing.T) {
	t.Parallel()
	p := startSharedPair(t)
	p.fwd.MaxHeldPerPeer = 2
	remote := member(t, p.b.mqtt, "remote")
	sent := p.publishN(t, "m", 4)
	require.Equal(t, sent, readN(t, remote, 4, false))
	require.Equal(t, 2.0, p.held())
	require.Equal(t, 2.0, testutil.ToFloat64(p.fwd.Metrics.sharedUnkept))
}

// An edge chosen for a group it has no member of any more gives the
// message back at once; the publishing edge gives it to another member.
func TestForward_SharedMessageComesBackFromAnEdgeWithoutMembers(t *testing.T) {
	t.Parallel()
	p := startSharedPair(t) // the route still names edge B, whose member left
	local := member(t, p.a.mqtt, "local")
	sent := p.publishN(t, "m", 3)
	require.Equal(t, sent, readN(t, local, 3, true))
	require.Eventually(t, func() bool { return p.held() == 0 }, 5*time.Second, 10*time.Millisecond)
	require.Equal(t, 3.0, testutil.ToFloat64(p.fwd.Metrics.sharedOutcomes.WithLabelValues("member_gone")))
}

// A group message delivered at QoS 0 (the member subscribed so) needs no
// acknowledgement: the publishing edge keeps it only until it is taken.
func TestForward_SharedMessageAtQoS0IsNotKept(t *testing.T) {
	t.Parallel()
	p := startSharedPair(t)
	remote := mqtttest.Dial(t, p.b.mqtt, 5)
	remote.Connect("remote", true, packets.Properties{})
	require.Equal(t, []byte{0}, remote.Subscribe(1, "$share/g/t/+", 0).ReasonCodes)
	sent := p.publishN(t, "m", 3)
	require.Equal(t, sent, readN(t, remote, 3, false))
	require.Eventually(t, func() bool { return p.held() == 0 }, 5*time.Second, 10*time.Millisecond)
	require.Equal(t, 3.0, testutil.ToFloat64(p.fwd.Metrics.sharedOutcomes.WithLabelValues("acked")))
}

// While a sender's old stream lingers beside its new one, an outcome goes
// out on the new one: the old stream's sender, woken for it, passes the
// wake on.
func TestServer_OutcomesGoOnTheNewestStream(t *testing.T) {
	t.Parallel()
	for round := range 20 {
		srv := &Server{Deliver: &countingDeliverer{}}
		ts := serveAPI(t, srv)
		open := func(seq uint64) *connect.BidiStreamForClient[edgev1.ForwardRequest, edgev1.ForwardResponse] {
			st := NewLink("a", 1, "b", ts.URL, nil, nil).client.Forward(t.Context())
			t.Cleanup(func() { // before the server closes, which waits for its streams
				_ = st.CloseRequest()
				_ = st.CloseResponse()
			})
			require.NoError(t, st.Send(&edgev1.ForwardRequest{EdgeId: "a", Incarnation: 1, Seq: seq}))
			resp, err := st.Receive()
			require.NoError(t, err)
			require.Equal(t, seq, resp.GetTakenSeq())
			return st
		}
		open(1) // the old stream, still open
		st := open(2)
		require.True(t, srv.ReportShared(broker.ShareOrigin{Edge: "a", Incarnation: 1},
			&broker.Message{ID: broker.MsgID{Edge: "a", Incarnation: 1, Seq: 9}}, broker.GroupKey{Name: "g", Filter: "t/+"}, broker.ShareAcked))
		got := make(chan *edgev1.ForwardResponse, 1)
		go func() {
			if resp, err := st.Receive(); err == nil {
				got <- resp
			}
		}()
		select {
		case resp := <-got:
			require.Len(t, resp.GetSharedOutcomes(), 1)
		case <-time.After(2 * time.Second):
			t.Fatalf("round %d: the outcome never reached the newest stream", round)
		}
	}
}

// A group message re-dispatched while the router settles is not dropped
// for an answer that names no other edge with members: the answer may not
// know them yet. It goes to a member once an answer names its edge.
func TestForward_SharedRedispatchWaitsForSettledRoutes(t *testing.T) {
	t.Parallel()
	a, b, c := startEdge(t, "edge-a"), startEdge(t, "edge-b"), startEdge(t, "edge-c")
	b.b.SetCluster(broker.Cluster{Reports: b.srv})
	c.b.SetCluster(broker.Cluster{Reports: c.srv})
	routes := &switchRoutes{}
	peerB, peerC := Peer{ID: "edge-b", URL: b.api.URL}, Peer{ID: "edge-c", URL: c.api.URL}
	routes.set(Route{Groups: []GroupRoute{{Name: "g", Filter: "t/+", Edges: []Peer{peerB}}}}, "")
	f := connectForwarder(t, a, "edge-a")
	f.Resolver, f.Redispatch, f.Metrics = routes, a.b.RedispatchShared, NewMetrics(nil)
	p := &sharedPair{a: a, b: b, fwd: f}

	remote := member(t, b.mqtt, "remote")
	sent := p.publishN(t, "m", 1)
	require.Equal(t, sent, readN(t, remote, 1, false))

	// A member joins on edge-c while the router settles, and its answer
	// does not name edge-c for the group yet. The member on edge-b goes
	// without acknowledging.
	routes.set(Route{Unsettled: true, Edges: []Peer{peerB, peerC},
		Groups: []GroupRoute{{Name: "g", Filter: "t/+", Edges: []Peer{peerB}}}}, "")
	other := member(t, c.mqtt, "other")
	_ = remote.Conn.Close()
	_, err := other.Read(700 * time.Millisecond)
	require.Error(t, err, "no edge with a member is known yet")

	routes.set(Route{Groups: []GroupRoute{{Name: "g", Filter: "t/+", Edges: []Peer{peerB, peerC}}}}, "")
	require.Equal(t, sent, readN(t, other, 1, true))
	require.Eventually(t, func() bool { return p.held() == 0 }, 5*time.Second, 10*time.Millisecond)
}

// unsettledRoutes answers as the router does while settling a membership
// change: every edge, and a group that names edge-a alone, which the
// router may have written over.
type unsettledRoutes struct{ b Peer }

func (u unsettledRoutes) Route(context.Context, string, string) (Route, error) {
	return Route{Unsettled: true, Edges: []Peer{{ID: "edge-a"}, u.b},
		Groups: []GroupRoute{{Name: "g", Filter: "t/+", Edges: []Peer{{ID: "edge-a"}}}}}, nil
}

// TestForward_UnsettledRoutesServeEveryGroupMember: while the router is
// settling, a group's member on another edge gets the message although the
// answer names only this edge for the group: every edge serves its own
// members of every matching group (one copy per edge for the while).
func TestForward_UnsettledRoutesServeEveryGroupMember(t *testing.T) {
	p := startSharedPair(t)
	p.fwd.Resolver = unsettledRoutes{b: Peer{ID: "edge-b", URL: p.b.api.URL}}
	mb := member(t, p.b.mqtt, "member-b")
	ma := member(t, p.a.mqtt, "member-a")
	sent := p.publishN(t, "u", 3)
	require.Equal(t, sent, readN(t, mb, 3, true), "the member on the other edge is served")
	require.Equal(t, sent, readN(t, ma, 3, true), "and the one here")
}
