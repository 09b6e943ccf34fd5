package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
	"regexp"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/libs/testutil"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"
	"github.com/keelmq/keel/proto/gen/keel/edge/v1/edgev1connect"
	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
	"github.com/keelmq/keel/proto/gen/keel/router/v1/routerv1connect"
)

// buildServices builds the named service commands of the repository in
// parallel and returns the binaries by name.
func buildServices(t *testing.T, names ...string) map[string]string {
	t.Helper()
	if testing.Short() {
		t.Skip("builds and starts service processes; skipped under -short")
	}
	root, err := testutil.RepoRoot()
	require.NoError(t, err)
	dir := t.TempDir()
	bins := map[string]string{}
	errs := make([]error, len(names))
	var wg sync.WaitGroup
	for i, name := range names {
		bin := filepath.Join(dir, "keel-"+name)
		bins[name] = bin
		wg.Go(func() {
			cmd := exec.Command("go", "build", "-o", bin, "./services/"+name+"/cmd/keel-"+name)
			cmd.Dir = root
			if out, err := cmd.CombinedOutput(); err != nil {
				errs[i] = fmt.Errorf("build %s: %w: %s", name, err, out)
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	return bins
}

// startService runs bin with args until the test ends and waits until
// /readyz on ops answers 200. The process can be stopped earlier.
// startCore starts a single-node router and a coordinator with lease TTL
// ttl, and the extra starts, in parallel; it returns the router's and the
// coordinator's API addresses.
func startCore(t *testing.T, bins map[string]string, ttl string, extra ...func()) (routerAPI, coordAPI string) {
	t.Helper()
	routerAPI, routerOps := testutil.FreeAddr(t), testutil.FreeAddr(t)
	coordAPI, coordOps := testutil.FreeAddr(t), testutil.FreeAddr(t)
	var wg sync.WaitGroup
	wg.Go(func() {
		startService(t, "router", bins["router"], routerOps, "--api.addr", routerAPI, "--ops.addr", routerOps, "--olric.single-node",
			"--router.rebuild-wait", "200ms", "--olric.bind-addr", "127.0.0.1", "--olric.port", fmt.Sprint(testutil.FreePort(t)),
			"--olric.memberlist-port", fmt.Sprint(testutil.FreePort(t)), "--log.level", "warn")
	})
	wg.Go(func() {
		startService(t, "coordinator", bins["coordinator"], coordOps, "--api.addr", coordAPI, "--ops.addr", coordOps,
			"--raft.bind-addr", testutil.FreeAddr(t), "--gossip.bind-addr", testutil.FreeAddr(t), "--raft.bootstrap-expect", "1",
			"--raft.node-id", "c1", "--raft.data-dir", t.TempDir(), "--lease-ttl", ttl, "--log.level", "warn")
	})
	for _, f := range extra {
		wg.Go(f)
	}
	wg.Wait()
	return routerAPI, coordAPI
}

func startService(t *testing.T, name, bin, ops string, args ...string) *serviceProc {
	t.Helper()
	cmd := exec.Command(bin, args...)
	p := &serviceProc{cmd: cmd, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = &p.logs, &p.logs
	require.NoError(t, cmd.Start())
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		if !p.stop(10 * time.Second) {
			_ = cmd.Process.Kill()
			<-p.done
		}
		if t.Failed() {
			t.Logf("%s logs:\n%s", name, p.logs.String())
		}
	})
	testutil.Eventually(t, 30*time.Second, func() error {
		resp, err := http.Get("http://" + ops + "/readyz")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("%s readyz %d", name, resp.StatusCode)
		}
		return nil
	})
	return p
}

// serviceProc is a service process a test started.
type serviceProc struct {
	cmd  *exec.Cmd
	logs syncBuffer
	done chan struct{} // closed once the process exited
	err  error         // its exit status
}

// stop sends SIGTERM (unless the process exited) and reports whether it
// exited within timeout.
func (p *serviceProc) stop(timeout time.Duration) bool {
	select {
	case <-p.done:
		return true
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return true
	case <-time.After(timeout):
		return false
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Against a real coordinator, router node and persistence instance:
// cluster status shows the Raft leader and the members, routes shows the
// edges a topic goes to, session show the owner and the stored session, in
// tables and as JSON; bad invocations fail with a clear error.
func TestKeelctl_ClusterCommands(t *testing.T) {
	bins := buildServices(t, "coordinator", "router", "persistence")
	persistAPI, persistOps := testutil.FreeAddr(t), testutil.FreeAddr(t)
	routerAPI, coordAPI := startCore(t, bins, "60s", func() {
		startService(t, "persistence", bins["persistence"], persistOps, "--api.addr", persistAPI, "--ops.addr", persistOps,
			"--data-dir", t.TempDir(), "--log.level", "warn")
	})
	if t.Failed() {
		return
	}
	coordURL, routerURL, persistURL := "http://"+coordAPI, "http://"+routerAPI, "http://"+persistAPI
	ctx := t.Context()

	// An edge joins, claims a session and registers routes.
	coord := coordinatorClient(coordURL)
	_, err := call(ctx, "join", coordURL, coord.RenewLease, &coordinatorv1.RenewLeaseRequest{MemberId: "edge-a",
		Role: coordinatorv1.MemberRole_MEMBER_ROLE_EDGE, Incarnation: 7, Address: "http://127.0.0.1:1",
		State: coordinatorv1.MemberState_MEMBER_STATE_ALIVE})
	require.NoError(t, err)
	claim, err := call(ctx, "claim", coordURL, coord.ClaimSession, &coordinatorv1.ClaimSessionRequest{RequestId: "r1",
		Session: &commonv1.SessionKey{Tenant: "acme", ClientId: "dev-1"}, EdgeId: "edge-a", Incarnation: 7})
	require.NoError(t, err)
	syncRoutes(t, routerURL, "edge-a", 7,
		&routerv1.Route{Tenant: "acme", Filter: "devices/+/temp"},
		&routerv1.Route{Tenant: "acme", Filter: "devices/#", ShareGroup: "workers"})

	var out bytes.Buffer
	runOK := func(args ...string) string {
		t.Helper()
		out.Reset()
		require.NoError(t, run(ctx, args, &out, &out), "%v: %s", args, out.String())
		return out.String()
	}

	// cluster status. A router that starts a new table is unsettled for its
	// rebuild wait and a settle round (about 1.5 s here); then it says so.
	var table string
	testutil.Eventually(t, 20*time.Second, func() error {
		table = runOK("cluster", "status", "--coordinator", coordURL, "--router", routerURL)
		if !regexp.MustCompile(`(?m)^\S+\s+\S+\s+\d+\s+\d+\s+\d+\s+settled$`).MatchString(table) {
			return errors.New("router not settled yet")
		}
		return nil
	})
	t.Logf("cluster status:\n%s", table)
	require.Regexp(t, `(?m)^NODE\s+RAFT STATE\s+LEADER`, table)
	require.Regexp(t, `(?m)^c1\s+leader\s+c1\s`, table)
	require.Regexp(t, `(?m)^edge-a\s+edge\s+alive\s+7\s+http://127.0.0.1:1$`, table)
	require.Regexp(t, `(?m)^REDIS GROUP\s+PRIMARY`, table)
	require.Regexp(t, `(?m)^ROUTER NODE\s+ROUTER MEMBERS\s+ROUTE KEYS\s+WILDCARD ROUTES\s+CONNECTED EDGES\s+ANSWERS$`, table)
	var st struct {
		Coordinator struct {
			NodeID    string `json:"node_id"`
			RaftState string `json:"raft_state"`
			LeaderID  string `json:"leader_id"`
			Members   []struct {
				MemberID    string `json:"member_id"`
				Role        string `json:"role"`
				Incarnation string `json:"incarnation"`
			} `json:"members"`
		} `json:"coordinator"`
		Snapshot struct {
			Config struct {
				RedisGroupCount int `json:"redis_group_count"`
			} `json:"config"`
		} `json:"snapshot"`
		Router *struct {
			NodeID         string `json:"node_id"`
			ConnectedEdges int    `json:"connected_edges"`
		} `json:"router"`
	}
	require.NoError(t, json.Unmarshal([]byte(runOK("cluster", "status", "--coordinator", coordURL, "--router", routerURL, "-o", "json")), &st), out.String())
	require.Equal(t, "c1", st.Coordinator.NodeID)
	require.Equal(t, "RAFT_STATE_LEADER", st.Coordinator.RaftState)
	require.Equal(t, "c1", st.Coordinator.LeaderID)
	require.Len(t, st.Coordinator.Members, 1)
	require.Equal(t, "edge-a", st.Coordinator.Members[0].MemberID)
	require.Equal(t, "MEMBER_ROLE_EDGE", st.Coordinator.Members[0].Role)
	require.Equal(t, "7", st.Coordinator.Members[0].Incarnation)
	require.NotNil(t, st.Router)
	require.Equal(t, 1, st.Router.ConnectedEdges)
	t.Setenv("KEEL_COORDINATOR", coordURL)
	var noRouter map[string]json.RawMessage
	require.NoError(t, json.Unmarshal([]byte(runOK("cluster", "status", "-o", "json")), &noRouter))
	require.Contains(t, noRouter, "coordinator")
	require.NotContains(t, noRouter, "router", "no router without --router")

	// routes
	table = runOK("routes", "--router", routerURL, "--tenant", "acme", "devices/d1/temp")
	t.Logf("routes:\n%s", table)
	require.Regexp(t, `(?m)^KIND\s+SHARE GROUP\s+FILTER\s+EDGES$`, table)
	require.Regexp(t, `(?m)^direct\s+-\s+-\s+edge-a$`, table)
	require.Regexp(t, `(?m)^shared\s+workers\s+devices/#\s+edge-a$`, table)
	var lookup struct {
		Lookup struct {
			EdgeIDs      []string `json:"edge_ids"`
			SharedGroups []struct {
				Group   string   `json:"group"`
				Filter  string   `json:"filter"`
				EdgeIDs []string `json:"edge_ids"`
			} `json:"shared_groups"`
		} `json:"lookup"`
	}
	require.NoError(t, json.Unmarshal([]byte(runOK("routes", "--router", routerURL, "--tenant", "acme", "-o", "json", "devices/d1/temp")), &lookup))
	require.Equal(t, []string{"edge-a"}, lookup.Lookup.EdgeIDs)
	require.Len(t, lookup.Lookup.SharedGroups, 1)
	require.Equal(t, "workers", lookup.Lookup.SharedGroups[0].Group)
	table = runOK("routes", "--router", routerURL, "--tenant", "acme", "devices/d1/hum")
	require.NotContains(t, table, "direct")
	require.Regexp(t, `(?m)^shared\s+workers\s+devices/#\s+edge-a$`, table)
	require.Contains(t, runOK("routes", "--router", routerURL, "--tenant", "other", "devices/d1/temp"), "no routes match")

	// session show
	table = runOK("session", "show", "--persistence", persistURL, "--tenant", "acme", "dev-1")
	t.Logf("session show:\n%s", table)
	require.Regexp(t, `(?m)^OWNER\s+edge-a \(incarnation 7, connection\)$`, table)
	require.Regexp(t, fmt.Sprintf(`(?m)^EPOCH\s+%d \(granted `, claim.GetGrant().GetEpoch()), table)
	require.Regexp(t, `(?m)^STORED\s+\(no session stored\)$`, table)
	require.Regexp(t, `(?m)^QUEUE\s+0$`, table)
	var sess struct {
		Ownership struct {
			Session struct {
				Epoch       string `json:"epoch"`
				OwnerEdgeID string `json:"owner_edge_id"`
			} `json:"session"`
		} `json:"ownership"`
		Stored *json.RawMessage `json:"stored"`
	}
	require.NoError(t, json.Unmarshal([]byte(runOK("session", "show", "--persistence", persistURL, "--tenant", "acme", "-o", "json", "dev-1")), &sess))
	require.Equal(t, "edge-a", sess.Ownership.Session.OwnerEdgeID)
	require.Equal(t, fmt.Sprint(claim.GetGrant().GetEpoch()), sess.Ownership.Session.Epoch)
	require.NotNil(t, sess.Stored)
	require.Regexp(t, `(?m)^OWNER\s+\(none\)$`, runOK("session", "show", "--tenant", "acme", "nobody"))

	// errors
	t.Setenv("KEEL_COORDINATOR", "")
	for _, args := range [][]string{
		{"cluster", "status"},
		{"cluster", "status", "--coordinator", coordURL, "-o", "yaml"},
		{"cluster", "bogus", "--coordinator", coordURL},
		{"routes", "--router", routerURL, "devices/x"},
		{"routes", "--tenant", "acme", "devices/x"},
		{"routes", "--router", routerURL, "--tenant", "acme", "devices/+"},
		{"session", "show", "--tenant", "acme", "dev-1"},
		{"session", "show", "--coordinator", coordURL, "dev-1"},
		{"edge", "drain"},
		{"session", "kick", "--tenant", "acme", "dev-1"},
		{"redis", "failover"},
	} {
		out.Reset()
		err := run(ctx, args, &out, &out)
		require.Error(t, err, "%v", args)
		t.Logf("%v: %v", args, err)
	}
	err = run(ctx, []string{"raft", "remove-peer", "--coordinator", coordURL, "c9"}, &out, &out)
	require.ErrorContains(t, err, `node "c9" is not in the raft configuration`)
	require.Equal(t, connect.CodeNotFound, connect.CodeOf(err))
	require.Error(t, run(ctx, []string{"raft", "remove-peer", "--coordinator", coordURL}, &out, &out), "no node id")
	require.Regexp(t, `(?m)^c1\s+leader\s+c1\s`, runOK("cluster", "status", "--coordinator", coordURL), "c1 stays")

	short, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	require.ErrorContains(t, run(short, []string{"cluster", "status", "--coordinator", "http://127.0.0.1:1"}, &out, &out),
		"coordinator status at http://127.0.0.1:1")
}

// syncRoutes registers routes for an edge incarnation over a RouteSync
// stream, as an edge does, and waits for the router's ack. The stream stays
// open until the test ends.
func syncRoutes(t *testing.T, url, edge string, inc uint64, routes ...*routerv1.Route) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	c := routerv1connect.NewRouterServiceClient(rpc.H2CClient(), url, rpc.ClientOptions()...)
	stream := c.RouteSync(ctx)
	t.Cleanup(func() {
		cancel()
		_ = stream.CloseRequest()
		_ = stream.CloseResponse()
	})
	require.NoError(t, stream.Send(&routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Hello{
		Hello: &routerv1.RouteSyncHello{EdgeId: edge, Incarnation: inc}}}))
	var deltas []*routerv1.RouteDelta
	for i, r := range routes {
		deltas = append(deltas, &routerv1.RouteDelta{Seq: uint64(i + 1), Route: r, Op: routerv1.RouteOp_ROUTE_OP_ADD, Count: 1})
	}
	require.NoError(t, stream.Send(&routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Deltas{
		Deltas: &routerv1.RouteDeltas{Deltas: deltas}}}))
	acked := make(chan error, 1)
	go func() {
		done := false
		for {
			msg, err := stream.Receive()
			if err != nil {
				if !done {
					acked <- err
				}
				return
			}
			if msg.GetResync() != nil {
				if err := stream.Send(&routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Snapshot{
					Snapshot: &routerv1.RouteSetSnapshot{Seq: uint64(len(routes)), Routes: routes, Last: true}}}); err != nil {
					acked <- err
					return
				}
			}
			if a := msg.GetAck(); a != nil && a.GetSeq() >= uint64(len(routes)) && !done {
				done = true
				if len(a.GetRejected()) > 0 {
					acked <- fmt.Errorf("rejected: %v", a.GetRejected())
					return
				}
				acked <- nil
			}
			if msg.GetSeq() > 0 {
				_ = stream.Send(&routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Ack{
					Ack: &routerv1.RouteSyncAck{RouterSeq: msg.GetSeq()}}})
			}
		}
	}()
	select {
	case err := <-acked:
		require.NoError(t, err)
	case <-time.After(15 * time.Second):
		t.Fatal("routes not acknowledged")
	}
}

// fakeEdge answers Drain, draining a little more on every call, and Status.
type fakeEdge struct {
	edgev1connect.UnimplementedEdgeServiceHandler
	mu    sync.Mutex
	calls int
	req   *edgev1.DrainRequest
}

func (f *fakeEdge) Drain(_ context.Context, req *connect.Request[edgev1.DrainRequest]) (*connect.Response[edgev1.DrainResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	f.req = req.Msg
	left := uint32(max(0, 2-f.calls+1))
	state := edgev1.EdgeState_EDGE_STATE_DRAINING
	if left == 0 {
		state = edgev1.EdgeState_EDGE_STATE_DRAINED
	}
	return connect.NewResponse(&edgev1.DrainResponse{State: state, ConnectionsRemaining: left, SessionsRemaining: left}), nil
}

func (f *fakeEdge) Status(context.Context, *connect.Request[edgev1.StatusRequest]) (*connect.Response[edgev1.StatusResponse], error) {
	return connect.NewResponse(&edgev1.StatusResponse{EdgeId: "edge-a", Incarnation: 3, State: edgev1.EdgeState_EDGE_STATE_READY,
		Connections: 5, Routes: 2, Peers: []*edgev1.PeerStatus{{EdgeId: "edge-b", Incarnation: 4, Connected: true}}}), nil
}

// edge drain starts the drain with the given deadline and, with --wait,
// polls until the edge reports drained; edge status shows the edge.
func TestKeelctl_EdgeDrain(t *testing.T) {
	f := &fakeEdge{}
	mux := http.NewServeMux()
	mux.Handle(edgev1connect.NewEdgeServiceHandler(f))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = rpc.ServerProtocols() // h2c, as the edge serves it
	srv.Start()
	t.Cleanup(srv.Close)
	ctx := t.Context()
	var out bytes.Buffer
	require.NoError(t, run(ctx, []string{"edge", "drain", "--edge", srv.URL, "--deadline", "30s", "--server-reference", "edge-b:1883"}, &out, &out))
	require.Regexp(t, `(?m)^draining\s+2\s+2$`, out.String())
	require.Equal(t, 30*time.Second, f.req.GetDeadline().AsDuration())
	require.Equal(t, "edge-b:1883", f.req.GetServerReference())
	out.Reset()
	require.NoError(t, run(ctx, []string{"edge", "drain", "--edge", srv.URL, "--wait"}, &out, &out))
	t.Logf("edge drain --wait:\n%s", out.String())
	require.Regexp(t, `(?m)^draining\s+1\s+1\n(STATE.*\n)?drained\s+0\s+0\n`, out.String())
	require.Nil(t, f.req.GetDeadline(), "the edge's default deadline")
	out.Reset()
	require.NoError(t, run(ctx, []string{"edge", "drain", "--edge", srv.URL, "-o", "json"}, &out, &out))
	var drain struct {
		Drain struct {
			State string `json:"state"`
		} `json:"drain"`
	}
	require.NoError(t, json.Unmarshal(out.Bytes(), &drain))
	require.Equal(t, "EDGE_STATE_DRAINED", drain.Drain.State)
	out.Reset()
	require.NoError(t, run(ctx, []string{"edge", "status", "--edge", srv.URL}, &out, &out))
	t.Logf("edge status:\n%s", out.String())
	require.Regexp(t, `(?m)^edge-a\s+3\s+ready\s+0s\s+5\s+0\s+0\s+2$`, out.String())
	require.Regexp(t, `(?m)^edge-b\s+4\s+true\s+0\s+0$`, out.String())
}
