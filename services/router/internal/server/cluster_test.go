package server_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	client "github.com/keelmq/keel/libs/routerclient"
	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/libs/testutil"
	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
	"github.com/keelmq/keel/proto/gen/keel/router/v1/routerv1connect"
	"github.com/keelmq/keel/services/router/internal/server"
	"github.com/keelmq/keel/services/router/internal/store"
)

type testNode struct {
	st     *store.Store
	node   *server.Node
	url    string
	cancel context.CancelFunc
	done   chan struct{}
	srv    *http.Server

	// What start needs to run the node (again).
	cfg         store.Config
	logger      *slog.Logger
	rebuildWait time.Duration
	handler     func(h http.Handler) http.Handler
}

// start runs the node's Olric member, router node and API on tn.url and
// returns once the node is ready; after a stop it starts it again under the
// same names and ports, as a restarted process would.
//
// On an error, what it started is stopped again.
func (tn *testNode) start(t testing.TB, ln net.Listener) (err error) {
	tn.cancel, tn.srv, tn.st = nil, nil, nil
	defer func() {
		if err != nil {
			tn.stop()
		}
	}()
	if ln == nil {
		if ln, err = net.Listen("tcp", strings.TrimPrefix(tn.url, "http://")); err != nil {
			return err
		}
	}
	st, err := store.New(tn.cfg, tn.logger)
	if err != nil {
		_ = ln.Close()
		return err
	}
	if err := st.Start(t.Context()); err != nil {
		_ = ln.Close()
		return err
	}
	tn.st = st
	node, err := server.New(server.Config{AdvertiseURL: tn.url, RebuildWait: tn.rebuildWait}, tn.st, nil, tn.logger)
	if err != nil {
		_ = ln.Close()
		return err
	}
	tn.node = node
	mux := http.NewServeMux()
	mux.Handle(routerv1connect.NewRouterServiceHandler(node, rpc.HandlerOptions()...))
	var h http.Handler = mux
	if tn.handler != nil {
		h = tn.handler(h)
	}
	tn.srv = &http.Server{Handler: h, Protocols: rpc.ServerProtocols()}
	go func() { _ = tn.srv.Serve(ln) }()
	ctx, cancel := context.WithCancel(context.Background())
	tn.cancel, tn.done = cancel, make(chan struct{})
	ready, done := make(chan struct{}), tn.done
	go func() { defer close(done); _ = node.Run(ctx, func() { close(ready) }) }()
	select {
	case <-ready:
		return nil
	case <-time.After(20 * time.Second):
		return errors.New("node not ready")
	}
}

// kill stops tn the hard way for an in-process node: the API server first,
// which cuts every edge stream and peer call mid-flight, then the node and
// its Olric member.
func (tn *testNode) kill() {
	_ = tn.srv.Close()
	tn.stop()
}

// stop ends whatever of the node runs; it may be called again.
func (tn *testNode) stop() {
	if tn.cancel != nil {
		tn.cancel()
		<-tn.done
		tn.cancel = nil
	}
	if tn.srv != nil {
		_ = tn.srv.Close()
	}
	if tn.st != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = tn.st.Stop(ctx)
	}
}

// startCluster starts n router nodes over loopback, each with an embedded
// Olric member (replica count and write quorum min(2, n), member quorum a
// majority) and its Connect API, and returns once all serve.
func startCluster(t *testing.T, n int) []*testNode { return startClusterB(t, n) }

func startClusterB(t testing.TB, n int) []*testNode { return startClusterWrap(t, n, nil) }

// startClusterWrap is startClusterB with node i's API handler wrapped by
// wrap(i, handler) when wrap is set (fault injection).
func startClusterWrap(t testing.TB, n int, wrap func(i int, h http.Handler) http.Handler) []*testNode {
	return startClusterOn(t, loopback(n), wrap)
}

// loopback returns n Olric bind addresses 127.0.0.1.
func loopback(n int) []string { return slices.Repeat([]string{"127.0.0.1"}, n) }

// startClusterOn is startClusterWrap with node i's Olric member bound to
// binds[i] (an IP, a host name or 0.0.0.0).
func startClusterOn(t testing.TB, binds []string, wrap func(i int, h http.Handler) http.Handler) []*testNode {
	t.Helper()
	if testing.Short() {
		t.Skip("multi-node olric cluster")
	}
	// NOTE(router): Olric members started at the same instant sometimes
	// disagree on the cluster coordinator ("unrecognized cluster
	// coordinator") and never converge; start afresh on new ports then.
	for attempt := 1; ; attempt++ {
		nodes, err := tryStartClusterOn(t, binds, time.Millisecond, wrap)
		if err == nil {
			return nodes
		}
		if attempt == 3 {
			require.NoError(t, err)
		}
		t.Logf("cluster start attempt %d failed: %v", attempt, err)
	}
}

// tryStartCluster starts n router nodes over a new table; lookups wait
// rebuildWait for the edges (see Config.RebuildWait).
func tryStartCluster(t testing.TB, n int, rebuildWait time.Duration) ([]*testNode, error) {
	return tryStartClusterWrap(t, n, rebuildWait, nil)
}

func tryStartClusterWrap(t testing.TB, n int, rebuildWait time.Duration, wrap func(i int, h http.Handler) http.Handler) ([]*testNode, error) {
	return tryStartClusterOn(t, loopback(n), rebuildWait, wrap)
}

// tryStartClusterOn is tryStartClusterWrap with node i's Olric member bound
// to binds[i]. The peers list a node by its bind address, as a host name
// when it is one (as with Kubernetes' or Docker's DNS names), and by the IP
// Olric picks for 0.0.0.0 (where Olric listens then).
func tryStartClusterOn(t testing.TB, binds []string, rebuildWait time.Duration, wrap func(i int, h http.Handler) http.Handler) ([]*testNode, error) {
	n := len(binds)
	rc := min(2, n)
	cfgs := make([]store.Config, n)
	var peers []string
	for i := range cfgs {
		cfgs[i] = store.Config{BindAddr: binds[i], Port: testutil.FreePort(t), MemberlistPort: testutil.FreePort(t),
			ReplicaCount: rc, WriteQuorum: rc, ReadQuorum: 1, MemberCountQuorum: n/2 + 1, ReadRepair: true, Env: "local", StartTimeout: 20 * time.Second}
		host := binds[i]
		if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
			var err error
			host, err = store.ResolveAddr(host)
			require.NoError(t, err)
		}
		peers = append(peers, net.JoinHostPort(host, strconv.Itoa(cfgs[i].MemberlistPort)))
	}
	nodes := make([]*testNode, n)
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range cfgs {
		for j, p := range peers {
			if j != i {
				cfgs[i].Peers = append(cfgs[i].Peers, p)
			}
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		tn := &testNode{url: "http://" + ln.Addr().String(), cfg: cfgs[i], logger: testutil.Logger(t).With("node", i), rebuildWait: rebuildWait}
		if wrap != nil {
			tn.handler = func(h http.Handler) http.Handler { return wrap(i, h) }
		}
		nodes[i] = tn
		wg.Go(func() { errs[i] = tn.start(t, ln) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		for _, tn := range nodes {
			tn.stop()
		}
		return nil, err
	}
	var once sync.Map
	for _, tn := range nodes {
		t.Cleanup(func() {
			if _, dup := once.LoadOrStore(tn, true); !dup {
				tn.stop()
			}
		})
	}
	// Every node sees every other.
	testutil.Eventually(t, 10*time.Second, func() error {
		for _, tn := range nodes {
			st, err := apiClient(tn.url).Status(t.Context(), connect.NewRequest(&routerv1.StatusRequest{}))
			if err != nil {
				return err
			}
			if len(st.Msg.GetRouterMembers()) != n {
				return fmt.Errorf("node %s sees %d members", tn.url, len(st.Msg.GetRouterMembers()))
			}
			// A new table keeps its nodes unsettled for the rebuild wait:
			// the tests that set a long one look at the wait itself.
			if !st.Msg.GetSettled() && rebuildWait < time.Second {
				return fmt.Errorf("node %s is settling the membership", tn.url)
			}
		}
		return nil
	})
	return nodes, nil
}

func httpClient() *http.Client { return rpc.H2CClient() }

// apiHTTP is shared by every apiClient: a transport per call kept its
// connection open, and a test polling Lookups ran out of file descriptors.
var apiHTTP = sync.OnceValue(httpClient)

func apiClient(url string) routerv1connect.RouterServiceClient {
	return routerv1connect.NewRouterServiceClient(apiHTTP(), url, connect.WithGRPC())
}

// startEdge runs a routing client for edge id against url and waits until
// it is ready.
func startEdgeB(b testing.TB, url, id string) *client.Client { return startEdge(b, url, id, 1) }

func startEdge(t testing.TB, url, id string, inc uint64) *client.Client {
	t.Helper()
	return startEdgeCfg(t, client.Config{URL: url, EdgeID: id, Incarnation: inc})
}

// startEdgeCfg runs a routing client with cfg (HTTP client and logger filled
// in when unset) until the test ends, and waits until it is ready.
func startEdgeCfg(t testing.TB, cfg client.Config) *client.Client {
	t.Helper()
	if cfg.HTTPClient == nil {
		cfg.HTTPClient = httpClient()
	}
	cfg.Logger = testutil.Logger(t).With("edge", cfg.EdgeID)
	c, err := client.New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	testutil.Eventually(t, 10*time.Second, func() error {
		if !c.Ready() {
			return errors.New("edge not ready")
		}
		return nil
	})
	return c
}

func route(t *testing.T, c *client.Client, tenant, name string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	r, err := c.Route(ctx, tenant, name)
	require.NoError(t, err)
	out := append([]string(nil), r.Edges...)
	for _, g := range r.Groups {
		for _, e := range g.Edges {
			out = append(out, "$share/"+g.Name+"/"+g.Filter+"@"+e)
		}
	}
	return out
}

// TestCluster_RouteVisibleAcrossNodes: a route registered through node A is
// returned by Lookup on node B, and an edge on B that had cached a negative
// answer for the topic routes a publish that starts after SUBACK on A.
func TestCluster_RouteVisibleAcrossNodes(t *testing.T) {
	nodes := startCluster(t, 3)
	ea := startEdge(t, nodes[0].url, "edge-a", 1)
	eb := startEdge(t, nodes[1].url, "edge-b", 1)
	ctx := t.Context()

	// B caches a negative answer (or its Bloom says no).
	require.Empty(t, route(t, eb, "t1", "devices/42/cmd/reboot"))
	require.NoError(t, ea.Subscribe(ctx, "t1", "devices/42/cmd/#"))
	// After SUBACK: routed at once, no sleep.
	require.Equal(t, []string{"edge-a"}, route(t, eb, "t1", "devices/42/cmd/reboot"))

	resp, err := apiClient(nodes[2].url).Lookup(ctx, connect.NewRequest(&routerv1.LookupRequest{Tenant: "t1", Topic: "devices/42/cmd/x"}))
	require.NoError(t, err)
	require.Equal(t, []string{"edge-a"}, resp.Msg.GetEdgeIds())
	// Tenant isolation.
	resp, err = apiClient(nodes[2].url).Lookup(ctx, connect.NewRequest(&routerv1.LookupRequest{Tenant: "t2", Topic: "devices/42/cmd/x"}))
	require.NoError(t, err)
	require.Empty(t, resp.Msg.GetEdgeIds())

	// Wildcard-first and shared routes, seen from the other edge's trie.
	require.NoError(t, ea.Subscribe(ctx, "t1", "+/42/status"))
	require.NoError(t, ea.Subscribe(ctx, "t1", "$share/g1/devices/+/cmd/#"))
	require.ElementsMatch(t, []string{"edge-a"}, route(t, eb, "t1", "x/42/status"))
	require.Empty(t, route(t, eb, "t1", "$SYS/42/status"))
	require.ElementsMatch(t, []string{"edge-a", "$share/g1/devices/+/cmd/#@edge-a"}, route(t, eb, "t1", "devices/42/cmd/x"))

	// Unsubscribe: gone everywhere.
	require.NoError(t, ea.Unsubscribe(ctx, "t1", "devices/42/cmd/#"))
	require.NoError(t, ea.Unsubscribe(ctx, "t1", "+/42/status"))
	require.Equal(t, []string{"$share/g1/devices/+/cmd/#@edge-a"}, route(t, eb, "t1", "devices/42/cmd/x"))
	require.Empty(t, route(t, eb, "t1", "x/42/status"))
}

// TestCluster_ConcurrentSubscribe: two edges subscribing to the same topic
// through different router nodes at the same instant are both kept (the
// lost-update race on a shared value).
func TestCluster_ConcurrentSubscribe(t *testing.T) {
	nodes := startCluster(t, 3)
	edges := make([]*client.Client, 3)
	for i := range edges {
		edges[i] = startEdge(t, nodes[i].url, fmt.Sprintf("edge-%d", i), 1)
	}
	for round := range 10 {
		var wg sync.WaitGroup
		filter := fmt.Sprintf("race/%d", round)
		for _, e := range edges {
			wg.Go(func() { require.NoError(t, e.Subscribe(t.Context(), "t1", filter)) })
		}
		wg.Wait()
		for _, n := range nodes {
			resp, err := apiClient(n.url).Lookup(t.Context(), connect.NewRequest(&routerv1.LookupRequest{Tenant: "t1", Topic: filter}))
			require.NoError(t, err)
			require.Equal(t, []string{"edge-0", "edge-1", "edge-2"}, resp.Msg.GetEdgeIds())
		}
	}
}

// TestCluster_DeadEdge: RemoveEdge drops a dead edge's routes from every
// lookup and every edge trie.
func TestCluster_DeadEdge(t *testing.T) {
	nodes := startCluster(t, 3)
	ea := startEdge(t, nodes[0].url, "edge-a", 1)
	eb := startEdge(t, nodes[1].url, "edge-b", 1)
	ctx := t.Context()
	require.NoError(t, ea.Subscribe(ctx, "t1", "a/b"))
	require.NoError(t, ea.Subscribe(ctx, "t1", "#"))
	require.NoError(t, eb.Subscribe(ctx, "t1", "a/b"))
	require.Equal(t, []string{"edge-a", "edge-b"}, route(t, eb, "t1", "a/b"))
	resp, err := apiClient(nodes[2].url).RemoveEdge(ctx, connect.NewRequest(&routerv1.RemoveEdgeRequest{EdgeId: "edge-a", Incarnation: 1}))
	require.NoError(t, err)
	require.EqualValues(t, 2, resp.Msg.GetRoutesRemoved())
	require.Equal(t, []string{"edge-b"}, route(t, eb, "t1", "a/b"))
	require.Empty(t, route(t, eb, "t1", "x"))
	for _, n := range nodes {
		l, err := apiClient(n.url).Lookup(ctx, connect.NewRequest(&routerv1.LookupRequest{Tenant: "t1", Topic: "a/b"}))
		require.NoError(t, err)
		require.Equal(t, []string{"edge-b"}, l.Msg.GetEdgeIds())
	}
}

// TestCluster_BadInput: invalid filters, oversized filters, bad tenants and
// garbage frames are refused with InvalidArgument and nothing is stored.
func TestCluster_BadInput(t *testing.T) {
	nodes := startCluster(t, 1)
	api := apiClient(nodes[0].url)
	ctx := t.Context()
	for _, req := range []*routerv1.LookupRequest{
		{Tenant: "T!", Topic: "a"}, {Tenant: "t1", Topic: "a/+"}, {Tenant: "t1", Topic: ""}, {Tenant: "t1", Topic: string(make([]byte, 5000))},
	} {
		_, err := api.Lookup(ctx, connect.NewRequest(req))
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%v", req)
	}
	for _, msgs := range [][]*routerv1.RouteSyncRequest{
		{{Msg: &routerv1.RouteSyncRequest_Ack{Ack: &routerv1.RouteSyncAck{}}}}, // no hello
		{hello("e1"), deltas(&routerv1.RouteDelta{Seq: 1, Op: routerv1.RouteOp_ROUTE_OP_ADD, Route: &routerv1.Route{Tenant: "t1", Filter: "a/#/b"}})},
		{hello("e1"), deltas(&routerv1.RouteDelta{Seq: 1, Op: routerv1.RouteOp_ROUTE_OP_ADD, Route: &routerv1.Route{Tenant: "BAD", Filter: "a"}})},
		{hello("e1"), deltas(&routerv1.RouteDelta{Seq: 1, Op: routerv1.RouteOp_ROUTE_OP_ADD, Route: &routerv1.Route{Tenant: "t1", Filter: string(make([]byte, 3000))}})},
		{hello("e1"), deltas(&routerv1.RouteDelta{Seq: 1, Route: &routerv1.Route{Tenant: "t1", Filter: "a"}})}, // no op
		{hello("e1"), deltas(&routerv1.RouteDelta{Seq: 1, Op: routerv1.RouteOp_ROUTE_OP_ADD, Route: &routerv1.Route{Tenant: "t1", Filter: "ok"}},
			&routerv1.RouteDelta{Seq: 2, Op: routerv1.RouteOp_ROUTE_OP_ADD, Route: &routerv1.Route{Tenant: "t1", Filter: "$share/g/x"}})},
		{hello("e1"), {}}, // empty oneof
	} {
		st := api.RouteSync(ctx)
		for _, m := range msgs {
			_ = st.Send(m)
		}
		var err error
		for err == nil {
			_, err = st.Receive()
		}
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%v", err)
		_ = st.CloseRequest()
	}
	// Nothing stored: the valid "ok" sent beside an invalid delta is absent.
	l, err := api.Lookup(ctx, connect.NewRequest(&routerv1.LookupRequest{Tenant: "t1", Topic: "ok"}))
	require.NoError(t, err)
	require.Empty(t, l.Msg.GetEdgeIds())
}

func hello(id string) *routerv1.RouteSyncRequest {
	return &routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Hello{Hello: &routerv1.RouteSyncHello{EdgeId: id, Incarnation: 1}}}
}

func deltas(ds ...*routerv1.RouteDelta) *routerv1.RouteSyncRequest {
	return &routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Deltas{Deltas: &routerv1.RouteDeltas{Deltas: ds}}}
}

// BenchmarkCluster_Lookup measures Lookup latency on loopback against a
// 3-node cluster with 1,000 anchored routes (gRPC over h2c).
func BenchmarkCluster_Lookup(b *testing.B) {
	nodes := startClusterB(b, 3)
	e := startEdgeB(b, nodes[0].url, "edge-a")
	for i := range 1000 {
		if err := e.Subscribe(context.Background(), "t1", fmt.Sprintf("devices/%d/cmd/#", i)); err != nil {
			b.Fatal(err)
		}
	}
	api := apiClient(nodes[1].url)
	b.ReportAllocs()
	i := 0
	var lat []time.Duration
	for b.Loop() {
		start := time.Now()
		resp, err := api.Lookup(context.Background(), connect.NewRequest(&routerv1.LookupRequest{Tenant: "t1", Topic: fmt.Sprintf("devices/%d/cmd/x", i%1000), EdgeId: "edge-b", Incarnation: 1}))
		if err != nil || len(resp.Msg.GetEdgeIds()) != 1 {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(start))
		i++
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)*50/100].Microseconds()), "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
}

// A router that starts a new, empty table refuses lookups (Unavailable)
// until the edges have had time to register their routes again: an answer
// from the half-built table would leave their subscribers out, and the
// publisher would be acknowledged for a message they never get. Once an
// edge re-registered, its route is in the answer.
func TestCluster_NewTableWaitsForEdges(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a router node")
	}
	t.Parallel()
	const wait = 2 * time.Second
	nodes, err := tryStartCluster(t, 1, wait)
	require.NoError(t, err)
	started := time.Now()
	api := apiClient(nodes[0].url)
	_, err = api.Lookup(t.Context(), connect.NewRequest(&routerv1.LookupRequest{Tenant: "t1", Topic: "a/b"}))
	require.Equal(t, connect.CodeUnavailable, connect.CodeOf(err), "lookup on a table still being rebuilt: %v", err)

	e := startEdge(t, nodes[0].url, "edge-1", 1)
	require.NoError(t, e.Subscribe(t.Context(), "t1", "a/+"))
	testutil.Eventually(t, 10*time.Second, func() error {
		resp, err := api.Lookup(t.Context(), connect.NewRequest(&routerv1.LookupRequest{Tenant: "t1", Topic: "a/b"}))
		if err != nil {
			return err
		}
		if len(resp.Msg.GetEdgeIds()) != 1 {
			return fmt.Errorf("edges %v", resp.Msg.GetEdgeIds())
		}
		return nil
	})
	require.GreaterOrEqual(t, time.Since(started), wait-100*time.Millisecond)
}

// While a new table waits for the edges, the edges do not answer publishes
// from what the node sent them either: its Bloom filters and wildcard table
// hold only the routes registered so far, and a filter that rules out the
// anchor of an edge not registered again yet would have that edge's
// subscribers miss the message. The node is unsettled meanwhile, so the
// edges send every publish to every edge; once the wait is over and the
// route sets are in, answers are exact again.
func TestCluster_NoLocalAnswerFromANewTable(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a router node")
	}
	t.Parallel()
	const wait = 4 * time.Second
	nodes, err := tryStartCluster(t, 1, wait)
	require.NoError(t, err)
	started := time.Now()
	e1 := startEdge(t, nodes[0].url, "edge-1", 1)
	require.NoError(t, e1.Subscribe(t.Context(), "t1", "a/x"))
	e2 := startEdge(t, nodes[0].url, "edge-2", 1)
	// The filter of t1 (which holds a/x) reaches edge-2, and rules out b/y,
	// as if the edge subscribed to it had not registered again yet: edge-2
	// answers b/y without a lookup, to every edge.
	testutil.Eventually(t, 2*time.Second, func() error {
		if _, ok, err := e2.RouteAtOnce("t1", "b/y"); err != nil || !ok {
			return fmt.Errorf("b/y needs a lookup (%v): no filter yet", err)
		}
		return nil
	})
	res, _, err := e2.RouteAtOnce("t1", "b/y")
	require.NoError(t, err)
	require.Less(t, time.Since(started), wait, "the table is still being rebuilt")
	require.True(t, res.All, "answered from a table still being rebuilt: %+v", res)
	require.False(t, nodes[0].node.Settled())

	testutil.Eventually(t, 20*time.Second, func() error {
		if res, ok, err := e2.RouteAtOnce("t1", "b/y"); err != nil || !ok || res.All || len(res.Edges) > 0 {
			return fmt.Errorf("b/y: ok %v, %+v, %v", ok, res, err)
		}
		return nil
	})
	require.GreaterOrEqual(t, time.Since(started), wait-100*time.Millisecond)
	require.True(t, nodes[0].node.Settled())
	require.Equal(t, []string{"edge-1"}, route(t, e2, "t1", "a/x"))
}

// TestCluster_BindAddrNotAnIP: router nodes whose Olric bind address is not
// the IP Olric names their member after — 0.0.0.0 (the default, as in the
// e2e containers) or a host name (as in Kubernetes or Docker networks) —
// still find each other's API: a route written through one node and owned
// by another is forwarded to its owner, stored, and read back through every
// node. A node once took the flag as given for its ID, registered its API
// address under it, and never found the owner Olric named "IP:port":
// "address of router node …: store: key not found", SUBACK 0x80.
func TestCluster_BindAddrNotAnIP(t *testing.T) {
	if testing.Short() {
		t.Skip("multi-node olric cluster")
	}
	for _, tc := range []struct {
		name  string
		binds []string
	}{
		{"unspecified", []string{"0.0.0.0", "0.0.0.0", "0.0.0.0"}},
		{"hostname", []string{"localhost", "127.0.0.1", "localhost"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := store.ResolveAddr(tc.binds[0]); err != nil {
				t.Skipf("this host has no address for %s: %v", tc.binds[0], err)
			}
			nodes := startClusterOn(t, tc.binds, nil)
			ctx := t.Context()
			var ids []string
			for _, tn := range nodes {
				ids = append(ids, tn.node.ID())
			}
			slices.Sort(ids)
			// The node IDs are the member names Olric reports.
			for i, tn := range nodes {
				st, err := apiClient(tn.url).Status(ctx, connect.NewRequest(&routerv1.StatusRequest{}))
				require.NoError(t, err)
				assert.Equal(t, ids, st.Msg.GetRouterMembers(), "members seen by node %d (%s)", i, tc.binds[i])
			}
			edges := make([]*client.Client, len(nodes))
			for i, tn := range nodes {
				edges[i] = startEdge(t, tn.url, fmt.Sprintf("edge-%d", i), 1)
			}
			// For every (writer, owner) pair of distinct nodes: a tenant whose
			// anchor the owner holds, subscribed to through the writer.
			for w := range nodes {
				for o := range nodes {
					if o == w {
						continue
					}
					tenant := ""
					for k := 0; tenant == ""; k++ {
						tt := fmt.Sprintf("t%d", k)
						owner, err := server.OwnerOfAnchor(tt, "dev", ids)
						require.NoError(t, err)
						if owner == nodes[o].node.ID() {
							tenant = tt
						}
					}
					filter := fmt.Sprintf("dev/%d/#", w)
					sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
					err := edges[w].Subscribe(sctx, tenant, filter)
					cancel()
					require.NoError(t, err, "subscribe through node %d, owner node %d", w, o)
					topic := fmt.Sprintf("dev/%d/x", w)
					want := []string{fmt.Sprintf("edge-%d", w)}
					for r, tn := range nodes {
						resp, err := apiClient(tn.url).Lookup(ctx, connect.NewRequest(&routerv1.LookupRequest{Tenant: tenant, Topic: topic}))
						require.NoError(t, err, "lookup on node %d", r)
						require.Equal(t, want, resp.Msg.GetEdgeIds(), "lookup on node %d (written through %d, owned by %d)", r, w, o)
					}
				}
			}
		})
	}
}
