package app

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"

	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"
	"github.com/keelmq/keel/proto/gen/keel/edge/v1/edgev1connect"
)

// buildCommands builds the workspace commands (e.g.
// "./services/router/cmd/keel-router") in parallel and returns the
// binaries by command path.
func buildCommands(t *testing.T, pkgs ...string) map[string]string {
	t.Helper()
	root, err := testutil.RepoRoot()
	if err != nil {
		t.Skip(err)
	}
	dir := t.TempDir()
	bins := map[string]string{}
	errs := make([]error, len(pkgs))
	var wg sync.WaitGroup
	for i, pkg := range pkgs {
		bin := filepath.Join(dir, filepath.Base(pkg))
		bins[pkg] = bin
		wg.Go(func() {
			cmd := exec.Command("go", "build", "-o", bin, pkg)
			cmd.Dir = root
			if out, err := cmd.CombinedOutput(); err != nil {
				errs[i] = fmt.Errorf("build %s: %w: %s", pkg, err, out)
			}
		})
	}
	wg.Wait()
	require.NoError(t, errors.Join(errs...))
	return bins
}

// startProc runs bin with args until the test ends (SIGTERM, then SIGKILL
// after 10 s) and waits until /readyz on ops answers 200.
func startProc(t *testing.T, name, bin, ops string, args ...string) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	var logs syncBuffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("%s logs:\n%s", name, logs.String())
		}
	})
	waitReady(t, name, ops, 30*time.Second)
}

func waitReady(t *testing.T, name, ops string, within time.Duration) {
	t.Helper()
	testutil.Eventually(t, within, func() error {
		if code := readyz(ops); code != http.StatusOK {
			return fmt.Errorf("%s readyz %d", name, code)
		}
		return nil
	})
}

// readyz returns the status of /readyz on ops, 0 when it did not answer.
func readyz(ops string) int {
	resp, err := http.Get("http://" + ops + "/readyz")
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
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

// runningEdge is an edge run in this process by app.New and Run.
type runningEdge struct {
	*Edge
	mqtt, ops string
	api       edgev1connect.EdgeServiceClient
	stop      context.CancelFunc
	done      chan struct{} // closed when Run returned
	err       error         // Run's result
}

// startEdge runs an edge with the given flags (besides listeners on free
// loopback ports) until the test ends, and waits until it is ready.
func startEdge(t *testing.T, id string, flags ...string) *runningEdge {
	t.Helper()
	mqtt, ops, api := testutil.FreeAddr(t), testutil.FreeAddr(t), testutil.FreeAddr(t)
	var cfg Config
	fs := flag.NewFlagSet(id, flag.ContinueOnError)
	cfg.RegisterFlags(fs)
	require.NoError(t, fs.Parse(append([]string{"--auth.anonymous", "--mqtt.edge-id", id, "--mqtt.tcp-addr", mqtt, "--mqtt.ws-addr", "",
		"--ops.addr", ops, "--cluster.api-addr", api, "--stop-timeout", "5s", "--mqtt.sys-interval", "0"}, flags...)))
	e, err := New(cfg, testutil.Logger(t).With("edge", id))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	r := &runningEdge{Edge: e, mqtt: mqtt, ops: ops, stop: cancel, done: make(chan struct{}),
		api: edgev1connect.NewEdgeServiceClient(rpc.H2CClient(), "http://"+api, rpc.ClientOptions()...)}
	go func() {
		defer close(r.done)
		r.err = e.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-r.done:
		case <-time.After(20 * time.Second):
			t.Errorf("edge %s did not stop within 20s", id)
		}
	})
	waitReady(t, id, ops, 30*time.Second)
	return r
}

func (r *runningEdge) status(t *testing.T) *edgev1.StatusResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	resp, err := r.api.Status(ctx, connect.NewRequest(&edgev1.StatusRequest{}))
	require.NoError(t, err)
	return resp.Msg
}

func (r *runningEdge) drain(t *testing.T, req *edgev1.DrainRequest) *edgev1.DrainResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	resp, err := r.api.Drain(ctx, connect.NewRequest(req))
	require.NoError(t, err)
	return resp.Msg
}

// publishes reads what c is sent until it has been quiet for a while,
// acknowledging each PUBLISH, and returns their topics.
func publishes(t *testing.T, c *mqtttest.Client) []string {
	t.Helper()
	var topics []string
	for {
		pk, err := c.Read(500 * time.Millisecond)
		if err != nil {
			return topics
		}
		if pk.FixedHeader.Type == packets.Publish {
			topics = append(topics, pk.TopicName)
			if pk.FixedHeader.Qos > 0 {
				c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
			}
		}
	}
}

// peer returns the status of the link to the peer edge id, nil if none.
func peer(st *edgev1.StatusResponse, id string) *edgev1.PeerStatus {
	for _, p := range st.GetPeers() {
		if p.GetEdgeId() == id {
			return p
		}
	}
	return nil
}

// Two real edges, in this process, with a real coordinator, router and
// persistence service: Status reports each edge's state, lease, clients,
// sessions, routes and forward links; Drain on edge A, through its API,
// turns A's readiness off, sends its MQTT 5 client DISCONNECT 0x9C with the
// server reference asked for, hands the persistent sessions (connected and
// offline) to edge B, which queues for them, and reports progress until
// DRAINED. A drained edge admits nobody, and stops without draining again.
// The drain closes connections as a server does, so their wills follow
// [MQTT-3.1.2-8]: one whose session ends with its connection goes out at
// once, one with a delay goes with its session and out from the custodian
// when the delay has passed, and one whose client comes back within its
// delay never goes.
func TestEdge_StatusAndDrain(t *testing.T) {
	if testing.Short() {
		t.Skip("starts service processes; skipped under -short")
	}
	bins := buildCommands(t, "./services/coordinator/cmd/keel-coordinator", "./services/router/cmd/keel-router",
		"./services/persistence/cmd/keel-persistence")
	began := time.Now()
	routerAPI, routerOps := testutil.FreeAddr(t), testutil.FreeAddr(t)
	coordAPI, coordOps := testutil.FreeAddr(t), testutil.FreeAddr(t)
	persistAPI, persistOps := testutil.FreeAddr(t), testutil.FreeAddr(t)
	const ttl = 10 * time.Second
	startProc(t, "router", bins["./services/router/cmd/keel-router"], routerOps, "--api.addr", routerAPI, "--ops.addr", routerOps,
		"--olric.single-node", "--router.rebuild-wait", "200ms", "--olric.bind-addr", "127.0.0.1",
		"--olric.port", fmt.Sprint(testutil.FreePort(t)), "--olric.memberlist-port", fmt.Sprint(testutil.FreePort(t)), "--log.level", "warn")
	startProc(t, "coordinator", bins["./services/coordinator/cmd/keel-coordinator"], coordOps, "--api.addr", coordAPI, "--ops.addr", coordOps,
		"--raft.bind-addr", testutil.FreeAddr(t), "--gossip.bind-addr", testutil.FreeAddr(t), "--raft.bootstrap-expect", "1",
		"--raft.node-id", "c1", "--raft.data-dir", t.TempDir(), "--lease-ttl", ttl.String(), "--log.level", "warn")
	startProc(t, "persistence", bins["./services/persistence/cmd/keel-persistence"], persistOps, "--api.addr", persistAPI,
		"--ops.addr", persistOps, "--data-dir", t.TempDir(), "--log.level", "warn")
	cluster := []string{"--cluster.coordinator", "http://" + coordAPI, "--cluster.router", "http://" + routerAPI,
		"--cluster.persistence", "http://" + persistAPI, "--cluster.forward-timeout", "5s", "--data-dir", ""}
	a := startEdge(t, "edge-a", cluster...)
	b := startEdge(t, "edge-b", cluster...)
	t.Logf("services and edges up in %v", time.Since(began).Round(time.Millisecond))

	// A ready edge, with nothing yet; a fenced one says so.
	st := a.status(t)
	require.Equal(t, "edge-a", st.GetEdgeId())
	require.Equal(t, edgev1.EdgeState_EDGE_STATE_READY, st.GetState())
	require.Equal(t, a.member.Incarnation(), st.GetIncarnation())
	require.NotZero(t, st.GetIncarnation())
	left := st.GetLeaseRemaining().AsDuration()
	require.Greater(t, left, time.Duration(0))
	require.LessOrEqual(t, left, ttl-leaseMargin)
	require.Zero(t, st.GetConnections())
	require.Zero(t, st.GetSessionsOwned()+st.GetSessionsInCustody()+st.GetRoutes())
	a.broker.Fence()
	require.Equal(t, edgev1.EdgeState_EDGE_STATE_FENCED, a.status(t).GetState())
	a.broker.Unfence()
	require.Equal(t, edgev1.EdgeState_EDGE_STATE_READY, a.status(t).GetState())

	// On A: an MQTT 5 client with a persistent session, subscribed to q/#,
	// and a will of delay 8 s; an MQTT 3.1.1 client with a clean session
	// and a will, subscribed to q/# too, and in a shared group; an MQTT 5
	// client with a persistent session and a will of delay 2 s, which does
	// not come back; and a persistent session whose client went away,
	// subscribed to o/#. That makes three routes. On B, a watcher of wills.
	watcher := mqtttest.Dial(t, b.mqtt, 5)
	watcher.Connect("watcher", true, packets.Properties{})
	require.Equal(t, []byte{1}, watcher.Subscribe(1, "wills/#", 1).ReasonCodes)
	dev, ack := connectWithWill(t, a.mqtt, 5, "dev", false, devWillDelay)
	require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
	require.Equal(t, []byte{1}, dev.Subscribe(1, "q/#", 1).ReasonCodes)
	v3, ack := connectWithWill(t, a.mqtt, 4, "v3", true, 0)
	require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
	require.Equal(t, []byte{1}, v3.Subscribe(1, "q/#", 1).ReasonCodes)
	gone, ack := connectWithWill(t, a.mqtt, 5, "gone", false, 2)
	require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
	require.Equal(t, []byte{1}, v3.Subscribe(2, "$share/g/q/#", 1).ReasonCodes)
	off := mqtttest.Dial(t, a.mqtt, 5)
	off.Connect("off", false, persistent)
	require.Equal(t, []byte{1}, off.Subscribe(1, "o/#", 1).ReasonCodes)
	off.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	expectClosed(t, off)
	testutil.Eventually(t, 5*time.Second, func() error {
		st = a.status(t)
		if st.GetConnections() != 3 || st.GetSessionsOwned() != 3 || st.GetSessionsInCustody() != 1 || st.GetRoutes() != 3 {
			return fmt.Errorf("connections %d, sessions %d with a connection, %d without, routes %d: want 3, 3, 1, 3",
				st.GetConnections(), st.GetSessionsOwned(), st.GetSessionsInCustody(), st.GetRoutes())
		}
		if p := peer(st, "edge-b"); p.GetIncarnation() != b.member.Incarnation() {
			return fmt.Errorf("peer edge-b: %v, want incarnation %d", p, b.member.Incarnation())
		}
		return nil
	})

	// A publish on B goes to A over B's forward link.
	pub := mqtttest.Dial(t, b.mqtt, 5)
	require.Equal(t, packets.CodeSuccess.Code, pub.Connect("pub", true, packets.Properties{}).ReasonCode)
	publish := func(id uint16, topic string) {
		t.Helper()
		pub.Publish(id, topic, 1, []byte(topic))
		require.Equal(t, id, pub.Expect(packets.Puback).PacketID)
	}
	publish(1, "q/before")
	require.Equal(t, []string{"q/before"}, publishes(t, dev))
	require.Contains(t, publishes(t, v3), "q/before")
	link := peer(b.status(t), "edge-a")
	require.NotNil(t, link)
	require.Equal(t, a.member.Incarnation(), link.GetIncarnation())
	require.True(t, link.GetConnected(), "B's forward stream to A is open")
	require.Zero(t, link.GetInflightBytes(), "A took everything")

	// Drain A. The first call starts it; readiness goes off at once.
	const ref = "edge-b.example:1883"
	drained := time.Now()
	resp := a.drain(t, &edgev1.DrainRequest{Deadline: durationpb.New(20 * time.Second), ServerReference: ref})
	require.Contains(t, []edgev1.EdgeState{edgev1.EdgeState_EDGE_STATE_DRAINING, edgev1.EdgeState_EDGE_STATE_DRAINED}, resp.GetState())
	require.NotEqual(t, http.StatusOK, readyz(a.ops), "readiness off from the start of the drain")
	got := expectClosed(t, dev)
	require.Len(t, got, 1, "one DISCONNECT, then the connection closes")
	require.Equal(t, packets.Disconnect, got[0].FixedHeader.Type)
	require.Equal(t, packets.ErrUseAnotherServer.Code, got[0].ReasonCode)
	require.Equal(t, ref, got[0].Properties.ServerReference)
	expectClosed(t, v3)
	expectClosed(t, gone)
	testutil.Eventually(t, 20*time.Second, func() error {
		resp = a.drain(t, &edgev1.DrainRequest{})
		if resp.GetState() != edgev1.EdgeState_EDGE_STATE_DRAINED {
			return fmt.Errorf("%v: %d connections, %d sessions left", resp.GetState(), resp.GetConnectionsRemaining(), resp.GetSessionsRemaining())
		}
		return nil
	})
	require.Zero(t, resp.GetConnectionsRemaining())
	require.Zero(t, resp.GetSessionsRemaining(), "the persistent sessions moved, the clean one ended")
	require.Equal(t, 1.0, promtest.ToFloat64(a.drains.WithLabelValues("api")), "one drain, however often asked")

	st = a.status(t)
	require.Equal(t, edgev1.EdgeState_EDGE_STATE_DRAINED, st.GetState())
	require.Zero(t, st.GetConnections()+st.GetSessionsOwned()+st.GetSessionsInCustody()+st.GetRoutes())
	require.NotZero(t, st.GetLeaseRemaining().AsDuration(), "a drained edge keeps its lease until it stops")
	require.NotEqual(t, http.StatusOK, readyz(a.ops))
	late := mqtttest.Dial(t, a.mqtt, 5)
	require.Equal(t, packets.ErrServerUnavailable.Code, late.Connect("late", true, packets.Properties{}).ReasonCode, "a drained edge admits nobody")

	// B holds the persistent sessions, offline, with their routes, and
	// queues for them until their clients come back.
	st = b.status(t)
	require.Equal(t, uint32(3), st.GetSessionsInCustody(), "dev, off and gone")
	require.Equal(t, uint32(3), st.GetRoutes(), "q/#, o/# and the watcher's wills/#: v3's clean session ended with its connection")
	publish(2, "q/while-away")
	publish(3, "o/while-away")
	dev = mqtttest.Dial(t, b.mqtt, 5)
	ack = dev.Connect("dev", false, persistent)
	require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
	devBack := time.Since(drained)
	require.Less(t, devBack, devWillDelay*time.Second-time.Second, "dev came back well within its will's delay")
	require.True(t, ack.SessionPresent, "dev's session moved to B")
	require.Equal(t, []string{"q/while-away"}, publishes(t, dev), "queued by B while dev was away")
	off = mqtttest.Dial(t, b.mqtt, 5)
	ack = off.Connect("off", false, persistent)
	require.True(t, ack.SessionPresent, "off's session moved to B")
	require.Equal(t, []string{"o/while-away"}, publishes(t, off))

	// v3's will went out from A as the drain closed its connection (its
	// session ended with it); gone's waited for its delay, counted from
	// that close, and went out from B, its custodian; dev came back within
	// its delay, and its will never goes. Each once.
	wills := map[string]time.Duration{}
	for deadline := time.Now().Add(10 * time.Second); len(wills) < 2 && time.Now().Before(deadline); {
		pk, err := watcher.Read(time.Until(deadline))
		require.NoError(t, err, "wills so far: %v", wills)
		if pk.FixedHeader.Type != packets.Publish {
			continue
		}
		_, seen := wills[pk.TopicName]
		require.False(t, seen, "%s published twice", pk.TopicName)
		wills[pk.TopicName] = time.Since(drained)
		watcher.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
	}
	require.Contains(t, wills, "wills/v3")
	require.Contains(t, wills, "wills/gone")
	require.GreaterOrEqual(t, wills["wills/gone"], 1500*time.Millisecond, "gone's will waited for its delay of 2 s")
	// Past dev's delay, counted from the drain's close: its will is
	// cancelled, not waiting still.
	for until := drained.Add(devWillDelay*time.Second + time.Second); time.Now().Before(until); {
		pk, err := watcher.Read(time.Until(until))
		if err == nil {
			require.NotEqual(t, packets.Publish, pk.FixedHeader.Type, "a will on %s after the first two", pk.TopicName)
		}
	}
	require.Equal(t, 1.0, counter(t, a.reg, "keel_edge_wills_published_total"), "v3's will, from the draining edge")
	require.Equal(t, 1.0, counter(t, b.reg, "keel_edge_wills_published_total"), "gone's will, from its custodian")

	// Stopping the drained edge drains nothing again, and is quick.
	stopping := time.Now()
	a.stop()
	select {
	case <-a.done:
		require.NoError(t, a.err)
	case <-time.After(10 * time.Second):
		t.Fatal("drained edge did not stop within 10s")
	}
	t.Logf("drained edge stopped in %v", time.Since(stopping).Round(time.Millisecond))
	require.Zero(t, promtest.ToFloat64(a.drains.WithLabelValues("stop")))
}

// devWillDelay is the will delay of TestEdge_StatusAndDrain's client that
// comes back, in seconds.
const devWillDelay = 8

// counter returns the value of the counter name (with no labels) in reg.
func counter(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			require.Len(t, mf.GetMetric(), 1, name)
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// fakeLife records what the edge API passes on.
type fakeLife struct {
	deadline time.Duration
	ref      string
	calls    int
}

func (f *fakeLife) status() *edgev1.StatusResponse {
	return &edgev1.StatusResponse{EdgeId: "edge-f", State: edgev1.EdgeState_EDGE_STATE_READY}
}

func (f *fakeLife) drain(deadline time.Duration, ref string) *edgev1.DrainResponse {
	f.calls++
	f.deadline, f.ref = deadline, ref
	return &edgev1.DrainResponse{State: edgev1.EdgeState_EDGE_STATE_DRAINING}
}

// The edge API passes Drain's deadline (0 when unset: the edge's default)
// and server reference on, and refuses bad ones; an edge API without a
// lifecycle answers Unimplemented.
func TestEdgeAPI_DrainArguments(t *testing.T) {
	t.Parallel()
	life := &fakeLife{}
	api := &edgeAPI{Life: life}
	ctx := t.Context()
	_, err := api.Drain(ctx, connect.NewRequest(&edgev1.DrainRequest{Deadline: durationpb.New(30 * time.Second), ServerReference: "lb:1883"}))
	require.NoError(t, err)
	require.Equal(t, 30*time.Second, life.deadline)
	require.Equal(t, "lb:1883", life.ref)
	_, err = api.Drain(ctx, connect.NewRequest(&edgev1.DrainRequest{}))
	require.NoError(t, err)
	require.Zero(t, life.deadline)
	require.Empty(t, life.ref)
	for _, req := range []*edgev1.DrainRequest{
		{Deadline: durationpb.New(-time.Second)},
		{ServerReference: "bad\x00ref"},
		{ServerReference: "\xff"},
		{ServerReference: strings.Repeat("x", 1<<16)},
	} {
		_, err := api.Drain(ctx, connect.NewRequest(req))
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%v", err)
	}
	require.Equal(t, 2, life.calls)
	st, err := api.Status(ctx, connect.NewRequest(&edgev1.StatusRequest{}))
	require.NoError(t, err)
	require.Equal(t, "edge-f", st.Msg.GetEdgeId())

	none := &edgeAPI{}
	_, err = none.Drain(ctx, connect.NewRequest(&edgev1.DrainRequest{}))
	require.Equal(t, connect.CodeUnimplemented, connect.CodeOf(err))
	_, err = none.Status(ctx, connect.NewRequest(&edgev1.StatusRequest{}))
	require.Equal(t, connect.CodeUnimplemented, connect.CodeOf(err))
}
