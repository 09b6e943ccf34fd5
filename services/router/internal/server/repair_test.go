package server_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/keelmq/keel/libs/testutil"
	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
)

// TestCluster_ResentRouteSetsRepairAReplicaThatMissedKeys: a node that
// loaded its replicas while Olric moved partitions can miss keys in its
// scan. Its Bloom filter then rules the anchor out, and its wildcard
// replica lacks the route, for it and for every edge streaming to it, and
// nothing that changes no key would tell it. The route sets the edges
// re-send when the membership settles must: afterwards the node and its
// edges route to the subscriber again.
func TestCluster_ResentRouteSetsRepairAReplicaThatMissedKeys(t *testing.T) {
	nodes := startCluster(t, 3)
	sub := startEdge(t, nodes[0].url, "edge-sub", 1)
	pub := startEdge(t, nodes[1].url, "edge-pub", 1)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	for _, f := range []string{"k/+/1", "+/w/1"} {
		if err := sub.Subscribe(ctx, "t1", f); err != nil {
			t.Fatalf("subscribe %s: %v", f, err)
		}
	}
	routed := func(topic string) error {
		got := route(t, pub, "t1", topic)
		if !slices.Contains(got, "edge-sub") {
			return fmt.Errorf("%q on edge-pub: got %v", topic, got)
		}
		l, err := apiClient(nodes[1].url).Lookup(ctx, connect.NewRequest(&routerv1.LookupRequest{Tenant: "t1", Topic: topic}))
		if err != nil {
			return err
		}
		if !slices.Contains(renderLookup(l.Msg), "edge-sub") {
			return fmt.Errorf("lookup %q on node 1: got %v", topic, renderLookup(l.Msg))
		}
		return nil
	}
	for _, topic := range []string{"k/x/1", "q/w/1"} {
		testutil.Eventually(t, 10*time.Second, func() error { return routed(topic) })
	}

	nodes[1].node.ForgetRoutes("t1", "k", "+/w/1")
	// The loss is visible: the node's and its edge's answers lack them.
	for _, topic := range []string{"k/x/1", "q/w/1"} {
		testutil.Eventually(t, 10*time.Second, func() error {
			if routed(topic) == nil {
				return fmt.Errorf("%q still routed to edge-sub", topic)
			}
			return nil
		})
	}

	for _, n := range nodes {
		n.node.RequestResync()
	}
	for _, topic := range []string{"k/x/1", "q/w/1"} {
		testutil.Eventually(t, 10*time.Second, func() error { return routed(topic) })
	}
}

// TestCluster_ChangeResentToAnotherNodeIsNotifiedAgain: a key's owner that
// applied an edge's change, recorded it in the edge's record and died
// before notifying the other nodes leaves the edge without its ack. The
// edge re-sends the change on its next stream, to another node: that node
// must not take the record's word that the change is done, but apply it
// again, so that it is notified before the edge is told (and SUBACKs).
func TestCluster_ChangeResentToAnotherNodeIsNotifiedAgain(t *testing.T) {
	nodes := startCluster(t, 3)
	pub := startEdge(t, nodes[2].url, "edge-pub", 1)
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	d := &routerv1.RouteDelta{Seq: 1, Op: routerv1.RouteOp_ROUTE_OP_ADD, Route: &routerv1.Route{Tenant: "t1", Filter: "+/w/1"}}
	if err := nodes[0].node.ApplyAndDie(ctx, "edge-sub", 1, d); err != nil {
		t.Fatalf("apply: %v", err)
	}
	stream := apiClient(nodes[1].url).RouteSync(ctx)
	defer func() { _ = stream.CloseRequest() }()
	for _, m := range []*routerv1.RouteSyncRequest{
		{Msg: &routerv1.RouteSyncRequest_Hello{Hello: &routerv1.RouteSyncHello{EdgeId: "edge-sub", Incarnation: 1}}},
		{Msg: &routerv1.RouteSyncRequest_Deltas{Deltas: &routerv1.RouteDeltas{Deltas: []*routerv1.RouteDelta{d}}}},
	} {
		if err := stream.Send(m); err != nil {
			t.Fatalf("send: %v", err)
		}
	}
	for {
		resp, err := stream.Receive()
		if err != nil {
			t.Fatalf("receive: %v", err)
		}
		if a := resp.GetAck(); a != nil && a.GetSeq() >= 1 {
			break
		}
	}
	// Acknowledged: every node and the edges streaming to them route to it
	// now, not after some later repair.
	for _, n := range nodes {
		l, err := apiClient(n.url).Lookup(ctx, connect.NewRequest(&routerv1.LookupRequest{Tenant: "t1", Topic: "q/w/1"}))
		if err != nil {
			t.Fatalf("lookup on %s: %v", n.url, err)
		}
		if got := renderLookup(l.Msg); !slices.Contains(got, "edge-sub") {
			t.Errorf("lookup on %s after the ack: got %v", n.url, got)
		}
	}
	if got := route(t, pub, "t1", "q/w/1"); !slices.Contains(got, "edge-sub") {
		t.Errorf("edge-pub after the ack: got %v", got)
	}
}
