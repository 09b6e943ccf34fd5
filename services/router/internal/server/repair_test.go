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
