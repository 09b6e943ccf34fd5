package forward

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/broker"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// switchRoutes answers with the route set last; while stale is set, with
// the failure of a route naming an edge that left the membership.
type switchRoutes struct {
	mu    sync.Mutex
	route Route
	stale string
}

func (s *switchRoutes) set(r Route, stale string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.route, s.stale = r, stale
}

func (s *switchRoutes) setEdges(to ...Peer) { s.set(Route{Edges: to}, "") }

func (s *switchRoutes) Route(context.Context, string, string) (Route, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stale != "" {
		return Route{}, fmt.Errorf("%w: route to unknown edge %q", ErrPeerLeft, s.stale)
	}
	return Route{Edges: slices.Clone(s.route.Edges), Groups: slices.Clone(s.route.Groups), Unsettled: s.route.Unsettled}, nil
}

// retries reads keel_edge_forward_retries_total{outcome}.
func retries(t *testing.T, reg *prometheus.Registry, outcome string) float64 {
	t.Helper()
	return testutil.CounterValue(t, reg, "keel_edge_forward_retries_total", map[string]string{"outcome": outcome})
}

// pastSkew is a wait past the clock skew allowed between edges (2 s in the
// broker): a session routable on an edge longer before a message than that
// is skipped when the message is routed again, as one that had it.
const pastSkew = 2100 * time.Millisecond

// rerouteCluster is a publishing edge A whose forwarder routes by a
// switchRoutes, a peer B that stops answering (it will leave the
// membership), and a live peer C.
type rerouteCluster struct {
	a, b, c *edge
	bURL    string
	reg     *prometheus.Registry
	routes  *switchRoutes
	fwd     *Forwarder
}

func startRerouteCluster(t *testing.T, bound time.Duration) *rerouteCluster {
	t.Helper()
	return startRerouteClusterWith(t, func(c *broker.Config) { c.ForwardBound = bound })
}

// startRerouteClusterWith is startRerouteCluster with edge A's broker
// configured by set.
func startRerouteClusterWith(t *testing.T, set func(*broker.Config)) *rerouteCluster {
	t.Helper()
	rc := &rerouteCluster{reg: prometheus.NewRegistry(), routes: &switchRoutes{}}
	rc.a = startEdgeWith(t, "edge-a", set, rc.reg)
	rc.b, rc.c = startEdge(t, "edge-b"), startEdge(t, "edge-c")
	rc.bURL = rc.b.api.URL
	rc.b.api.Close() // it stopped answering; it leaves the membership later
	_, inc := rc.a.b.ID()
	rc.fwd = &Forwarder{Self: "edge-a", Incarnation: func() uint64 { return inc }, Resolver: rc.routes, Bound: time.Minute, Logger: testutil.Logger(t)}
	runForwarder(t, rc.a, rc.fwd)
	return rc
}

// publishSeenEarly subscribes "early" to t/+ on edge-c at qos, longer ago
// than the clock skew, routes t/+ to edge-b and edge-c, and publishes t/x at
// qos on edge-a; early gets it (got) from edge-c, edge-b takes nothing.
func (rc *rerouteCluster) publishSeenEarly(t *testing.T, qos byte) (pub, early *mqtttest.Client, got packets.Packet) {
	t.Helper()
	early = mqtttest.Dial(t, rc.c.mqtt, 5)
	early.Connect("early", true, packets.Properties{})
	early.Subscribe(1, "t/+", qos)
	rc.routes.set(Route{Edges: []Peer{rc.peerB(), rc.peerC()}}, "")
	time.Sleep(pastSkew)
	pub = mqtttest.Dial(t, rc.a.mqtt, 5)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "t/x", qos, []byte("x"))
	got = early.Expect(packets.Publish)
	require.Equal(t, "x", string(got.Payload))
	return pub, early, got
}

func (rc *rerouteCluster) peerB() Peer { return Peer{ID: "edge-b", URL: rc.bURL} }
func (rc *rerouteCluster) peerC() Peer { return Peer{ID: "edge-c", URL: rc.c.api.URL} }

// A QoS 1 message forwarded to an edge that leaves the cluster before
// taking it is routed again once the routes name the edges its sessions
// went to, and acknowledged when they took it: the publisher is not closed
// (DESIGN: PUBLISH, re-resolve and retry). An edge that took it the first
// time gives it only to the sessions that became routable there since:
// its subscriber from before gets it once, the one that arrived after gets
// it too.
func TestForward_RoutedAgainAfterPeerLeft(t *testing.T) {
	t.Parallel()
	rc := startRerouteCluster(t, 20*time.Second)
	pub, early, got := rc.publishSeenEarly(t, 1)
	early.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
	_, err := pub.Read(300 * time.Millisecond)
	require.Error(t, err, "nothing while edge-b may still take it")

	// edge-b's session turns up on edge-c, and edge-b leaves: its routes
	// outlive it for a while (the route names an edge gone), then name
	// edge-c alone.
	rc.routes.set(Route{}, "edge-b")
	rc.fwd.PeerGone("edge-b")
	late := mqtttest.Dial(t, rc.c.mqtt, 5)
	late.Connect("late", true, packets.Properties{})
	late.Subscribe(1, "t/+", 1)
	time.Sleep(300 * time.Millisecond)
	_, err = pub.Read(10 * time.Millisecond)
	require.Error(t, err, "not acknowledged while a route names the edge that left")
	rc.routes.set(Route{Edges: []Peer{rc.peerC()}}, "")

	require.Equal(t, packets.Puback, pub.Expect(packets.Puback).FixedHeader.Type)
	got = late.Expect(packets.Publish)
	require.Equal(t, "x", string(got.Payload))
	_, err = early.Read(300 * time.Millisecond)
	require.Error(t, err, "the subscriber that had it gets no second copy")
	require.Equal(t, 1.0, retries(t, rc.reg, "taken"))
	require.Zero(t, retries(t, rc.reg, "gave_up"))
}

// startGroupRerouteCluster is a reroute cluster whose edge A re-dispatches
// group messages and whose edge C reports on them, with a member of
// $share/g/t/+ on edge C and a route for the group to edge B.
func startGroupRerouteCluster(t *testing.T) (*rerouteCluster, *mqtttest.Client, GroupRoute) {
	t.Helper()
	rc := startRerouteCluster(t, 20*time.Second)
	rc.fwd.Redispatch = rc.a.b.RedispatchShared
	rc.c.b.SetCluster(broker.Cluster{Reports: rc.c.srv})
	member := mqtttest.Dial(t, rc.c.mqtt, 5)
	member.Connect("member", true, packets.Properties{})
	member.Subscribe(1, "$share/g/t/+", 1)
	return rc, member, GroupRoute{Name: "g", Filter: "t/+", Edges: []Peer{rc.peerB()}}
}

// A QoS 1 group message whose chosen edge left before taking it goes to a
// member elsewhere when routed again: the link kept it for a report, but
// re-dispatches only what a peer took. The edge's plain subscribers that
// had it get nothing twice.
func TestForward_GroupOfAnEdgeThatLeftGetsAMemberAgain(t *testing.T) {
	t.Parallel()
	rc, member, group := startGroupRerouteCluster(t)
	plain := mqtttest.Dial(t, rc.c.mqtt, 5)
	plain.Connect("plain", true, packets.Properties{})
	plain.Subscribe(1, "t/+", 1)
	rc.routes.set(Route{Edges: []Peer{rc.peerC()}, Groups: []GroupRoute{group}}, "")
	time.Sleep(pastSkew)

	pub := mqtttest.Dial(t, rc.a.mqtt, 5)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "t/x", 1, []byte("x"))
	got := plain.Expect(packets.Publish)
	plain.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
	_, err := member.Read(300 * time.Millisecond)
	require.Error(t, err, "the group was given to edge-b")

	group.Edges = []Peer{rc.peerC()}
	rc.routes.set(Route{Edges: []Peer{rc.peerC()}, Groups: []GroupRoute{group}}, "")
	rc.fwd.PeerGone("edge-b")
	require.Equal(t, packets.Puback, pub.Expect(packets.Puback).FixedHeader.Type)
	got = member.Expect(packets.Publish)
	require.Equal(t, "x", string(got.Payload))
	_, err = plain.Read(300 * time.Millisecond)
	require.Error(t, err, "the plain subscriber had it")
}

// A QoS 1 group message routed while the router was settling goes to every
// edge, each to serve its own members; when the only edge with members
// left before taking it, the group is owed a member when the message is
// routed again, although no edge was chosen for it the first time.
func TestForward_GroupOfAnEdgeThatLeftWhileUnsettledGetsAMemberAgain(t *testing.T) {
	t.Parallel()
	rc := startRerouteCluster(t, 20*time.Second)
	rc.fwd.Redispatch = rc.a.b.RedispatchShared
	rc.c.b.SetCluster(broker.Cluster{Reports: rc.c.srv})
	group := GroupRoute{Name: "g", Filter: "t/+", Edges: []Peer{rc.peerB()}}
	rc.routes.set(Route{Unsettled: true, Edges: []Peer{rc.peerB(), rc.peerC()}, Groups: []GroupRoute{group}}, "")
	pub := mqtttest.Dial(t, rc.a.mqtt, 5)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "t/x", 1, []byte("x"))
	_, err := pub.Read(300 * time.Millisecond)
	require.Error(t, err, "nothing while edge-b may still take it")

	// The member's session turns up on edge-c, and edge-b leaves.
	member := mqtttest.Dial(t, rc.c.mqtt, 5)
	member.Connect("member", true, packets.Properties{})
	member.Subscribe(1, "$share/g/t/+", 1)
	group.Edges = []Peer{rc.peerC()}
	rc.routes.set(Route{Edges: []Peer{rc.peerC()}, Groups: []GroupRoute{group}}, "")
	rc.fwd.PeerGone("edge-b")
	require.Equal(t, packets.Puback, pub.Expect(packets.Puback).FixedHeader.Type)
	got := member.Expect(packets.Publish)
	require.Equal(t, "x", string(got.Payload))
}

// A group owed a member when a message is routed again is not given up for
// an unsettled answer that names no edge for it: such an answer may just
// not know the member yet (its edge has not registered its routes again).
// The message is routed again until an answer names one, and the publisher
// is acknowledged only then.
func TestForward_GroupOwedWaitsForSettledRoutes(t *testing.T) {
	t.Parallel()
	rc, member, group := startGroupRerouteCluster(t)
	rc.routes.set(Route{Edges: []Peer{rc.peerC()}, Groups: []GroupRoute{group}}, "")

	pub := mqtttest.Dial(t, rc.a.mqtt, 5)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "t/x", 1, []byte("x"))
	_, err := member.Read(300 * time.Millisecond)
	require.Error(t, err, "the group was given to edge-b")

	// edge-b leaves while the router settles: its answer names every live
	// edge, and no edge for the group yet.
	rc.routes.set(Route{Unsettled: true, Edges: []Peer{rc.peerC()}}, "")
	rc.fwd.PeerGone("edge-b")
	_, err = pub.Read(600 * time.Millisecond)
	require.Error(t, err, "not acknowledged while no edge is known for the group")
	_, err = member.Read(10 * time.Millisecond)
	require.Error(t, err)

	group.Edges = []Peer{rc.peerC()}
	rc.routes.set(Route{Edges: []Peer{rc.peerC()}, Groups: []GroupRoute{group}}, "")
	require.Equal(t, packets.Puback, pub.Expect(packets.Puback).FixedHeader.Type)
	require.Equal(t, "x", string(member.Expect(packets.Publish).Payload))
	require.Equal(t, 1.0, retries(t, rc.reg, "taken"))
	require.Zero(t, retries(t, rc.reg, "gave_up"))
}

// When the routes go on naming the edge that left past the forward bound,
// the publisher is closed without an acknowledgement, and sends again.
func TestForward_RoutedAgainWithinTheBoundOnly(t *testing.T) {
	t.Parallel()
	rc := startRerouteCluster(t, 2*time.Second)
	rc.routes.set(Route{Edges: []Peer{rc.peerB()}}, "")
	pub := mqtttest.Dial(t, rc.a.mqtt, 5)
	pub.Connect("pub", true, packets.Properties{})
	start := time.Now()
	pub.Publish(1, "t/x", 1, []byte("x"))
	rc.routes.set(Route{}, "edge-b")
	rc.fwd.PeerGone("edge-b")
	expectClosedUnacknowledged(t, pub, 10*time.Second)
	require.GreaterOrEqual(t, time.Since(start), time.Second, "routed again until near the bound")
	require.Equal(t, 1.0, retries(t, rc.reg, "gave_up"))
	require.Zero(t, retries(t, rc.reg, "taken"))
}

// A QoS 2 message routed again reaches a subscriber that had it once only:
// on the edge that took it the first time the subscriber is skipped, and
// the new copy keeps the message's ID.
func TestForward_QoS2RoutedAgainOnce(t *testing.T) {
	t.Parallel()
	rc := startRerouteCluster(t, 20*time.Second)
	pub, early, _ := rc.publishSeenEarly(t, 2)
	rc.routes.set(Route{Edges: []Peer{rc.peerC()}}, "")
	rc.fwd.PeerGone("edge-b")
	require.Equal(t, packets.Pubrec, pub.Expect(packets.Pubrec).FixedHeader.Type)
	_, err := early.Read(300 * time.Millisecond)
	require.Error(t, err, "no second copy of a QoS 2 message")
	require.Equal(t, 1.0, retries(t, rc.reg, "taken"))
}

// A publish whose routes still name an edge that left the cluster (they
// outlive it until its sessions are adopted) waits for the routes to name
// live edges, also without forward-retry: nothing of it was delivered, so
// it is routed as if published then. Its publisher keeps the connection,
// rather than being closed and sending its whole window again, over and
// over, until the routes catch up.
func TestForward_StaleRouteWaitsForLiveEdges(t *testing.T) {
	t.Parallel()
	rc := startRerouteClusterWith(t, func(c *broker.Config) { c.ResolveBound = 20 * time.Second })
	sub := mqtttest.Dial(t, rc.c.mqtt, 5)
	sub.Connect("sub", true, packets.Properties{})
	sub.Subscribe(1, "t/+", 1)
	rc.routes.set(Route{}, "edge-b")
	pub := mqtttest.Dial(t, rc.a.mqtt, 5)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "t/x", 1, []byte("x"))
	_, err := pub.Read(500 * time.Millisecond)
	require.Error(t, err, "neither acknowledged nor closed while the route names the edge that left")

	rc.routes.set(Route{Edges: []Peer{rc.peerC()}}, "")
	require.Equal(t, uint16(1), pub.Expect(packets.Puback).PacketID)
	require.Equal(t, "x", string(sub.Expect(packets.Publish).Payload))
	require.Positive(t, retries(t, rc.reg, "taken"))

	// A message an edge that left did not take after it was sent is not
	// routed again without forward-retry: the publisher is closed.
	rc.routes.set(Route{Edges: []Peer{rc.peerB(), rc.peerC()}}, "")
	pub.Publish(2, "t/x", 1, []byte("y"))
	require.Equal(t, "y", string(sub.Expect(packets.Publish).Payload))
	rc.fwd.PeerGone("edge-b")
	expectClosedUnacknowledged(t, pub, 5*time.Second)
}
