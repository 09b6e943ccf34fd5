package server_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	client "github.com/keelmq/keel/libs/routerclient"
	"github.com/keelmq/keel/libs/testutil"
	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
)

// TestCluster_OtherViewUnsettles: a notification made under another
// membership view is refused (the sender retries until the two agree) and
// unsettles the receiver: its edges route to every edge and its Lookups say
// so, until every node agrees on the view, the edges re-sent their route
// sets, and the node settles again.
func TestCluster_OtherViewUnsettles(t *testing.T) {
	nodes := startCluster(t, 3)
	reg := prometheus.NewRegistry()
	ea := startEdgeCfg(t, client.Config{URL: nodes[0].url, EdgeID: "edge-a", Incarnation: 1, Registerer: reg})
	eb := startEdge(t, nodes[1].url, "edge-b", 1)
	ctx := t.Context()
	require.NoError(t, ea.Subscribe(ctx, "t1", "a/b"))
	r, err := eb.Route(ctx, "t1", "a/b")
	require.NoError(t, err)
	require.Equal(t, []string{"edge-a"}, r.Edges)
	require.False(t, r.All)
	snapshots := gathered(t, reg, "keel_edge_route_snapshots_total")

	view := nodes[0].node.View()
	_, err = apiClient(nodes[0].url).Notify(ctx, connect.NewRequest(&routerv1.NotifyRequest{SenderNodeId: "elsewhere", View: view + 1,
		Invalidation: &routerv1.RouteInvalidation{Tenant: "t1", Anchors: []string{"a/b"}}}))
	require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err), "another view is refused: %v", err)
	require.False(t, nodes[0].node.Settled())
	l, err := apiClient(nodes[0].url).Lookup(ctx, connect.NewRequest(&routerv1.LookupRequest{Tenant: "t1", Topic: "a/b"}))
	require.NoError(t, err)
	require.True(t, l.Msg.GetUnsettled())
	require.Equal(t, []string{"edge-a"}, l.Msg.GetEdgeIds())
	testutil.Eventually(t, 5*time.Second, func() error {
		if r, _, _ := ea.RouteAtOnce("t1", "x/y"); !r.All {
			return errors.New("edge-a not told")
		}
		return nil
	})
	r, err = eb.Route(ctx, "t1", "a/b")
	require.NoError(t, err)
	require.False(t, r.All, "node 1 has no reason to doubt its answers")

	// The same view is taken; a change written under another one is taken
	// too, and unsettles the receiver (the write may have dropped a route).
	_, err = apiClient(nodes[1].url).Notify(ctx, connect.NewRequest(&routerv1.NotifyRequest{SenderNodeId: "test", View: nodes[1].node.View()}))
	require.NoError(t, err)
	require.True(t, nodes[1].node.Settled())
	_, err = apiClient(nodes[1].url).Notify(ctx, connect.NewRequest(&routerv1.NotifyRequest{SenderNodeId: "test", View: nodes[1].node.View(), WriteView: view + 1}))
	require.NoError(t, err)
	require.False(t, nodes[1].node.Settled())

	testutil.Eventually(t, 15*time.Second, func() error {
		if !nodes[0].node.Settled() || !nodes[1].node.Settled() {
			return errors.New("nodes still settling")
		}
		if r, _, _ := ea.RouteAtOnce("t1", "x/y"); r.All {
			return errors.New("edge-a still routes to every edge")
		}
		return nil
	})
	require.Greater(t, gathered(t, reg, "keel_edge_route_snapshots_total"), snapshots, "edge-a re-sent its route set before the node settled")
	l, err = apiClient(nodes[0].url).Lookup(ctx, connect.NewRequest(&routerv1.LookupRequest{Tenant: "t1", Topic: "a/b"}))
	require.NoError(t, err)
	require.False(t, l.Msg.GetUnsettled())
	require.Equal(t, []string{"edge-a"}, l.Msg.GetEdgeIds())

	// A change forwarded under another view is applied (refusing it stalls
	// SUBACKs while the views differ), and every node stops trusting its
	// answers until the edges re-sent their route sets.
	_, err = apiClient(nodes[0].url).ApplyRoutes(ctx, connect.NewRequest(&routerv1.ApplyRoutesRequest{SenderNodeId: "elsewhere", View: view + 1,
		Deltas: []*routerv1.EdgeDelta{{EdgeId: "edge-a", Incarnation: 1, Delta: &routerv1.RouteDelta{Seq: 1 << 40, Op: routerv1.RouteOp_ROUTE_OP_ADD,
			Route: &routerv1.Route{Tenant: "t1", Filter: "x/y"}}}}}))
	require.NoError(t, err)
	for i, n := range nodes {
		require.False(t, n.node.Settled(), "node %d told to unsettle", i)
	}
	testutil.Eventually(t, 15*time.Second, func() error {
		for i, n := range nodes {
			if !n.node.Settled() {
				return fmt.Errorf("node %d still settling", i)
			}
		}
		return nil
	})
	l, err = apiClient(nodes[2].url).Lookup(ctx, connect.NewRequest(&routerv1.LookupRequest{Tenant: "t1", Topic: "x/y"}))
	require.NoError(t, err)
	require.Equal(t, []string{"edge-a"}, l.Msg.GetEdgeIds(), "the forwarded add was applied")
}

func gathered(t *testing.T, g prometheus.Gatherer, name string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	var v float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			v += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return v
}
