package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/moby/moby/client"
	"github.com/stretchr/testify/require"
	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/network"
	"github.com/testcontainers/testcontainers-go/wait"
)

// Ports inside the containers. Every container has its own network
// namespace, so the defaults never collide.
const (
	coordAPIPort  = 7401
	coordRaftPort = 7400
	coordOpsPort  = "9101/tcp"
	routerAPIPort = 9300
	routerOpsPort = "9101/tcp"
	edgeAPIPort   = 7411
	edgeOpsPort   = "9100/tcp"
	edgeMQTTPort  = "1883/tcp"
	coordAlias    = "coordinator"
	routerAlias   = "router"
	persistAlias  = "persistence"
	persistPort   = 7402
	persistOps    = "9102/tcp"
	redisAlias    = "redis"
	replicaAlias  = "redis-replica"
)

// clusterConfig shapes a test cluster; the zero value is 3 edges on the
// services' defaults.
type clusterConfig struct {
	Edges int
	// LeaseTTL is the coordinator's membership lease (0: its default).
	LeaseTTL time.Duration
	// ForwardTimeout is the edges' --cluster.forward-timeout (0: default).
	ForwardTimeout time.Duration
	EdgeArgs       []string
	// Persistence runs a persistence instance over a Redis primary and
	// replica (every write confirmed by the replica), and the edges keep
	// their sessions there instead of on their own disks.
	Persistence bool
	// HA runs the topology the product runs (see startHA): 3 coordinators,
	// 3 routers, a Redis group of a primary and 2 replicas each fronted by
	// its persistence instance, and the edges (3 unless Edges says
	// otherwise), the edges reaching every service through a name shared
	// by its nodes, as through a Kubernetes Service. It implies
	// Persistence. Clients reach the edges through an access network of
	// their own, so an edge can be cut from the cluster while its clients
	// still reach it.
	HA bool
}

// keelCluster is one coordinator, one router and N edges on a private
// Docker network, every edge's MQTT port published on the host; or, with
// clusterConfig.HA, the product's topology.
type keelCluster struct {
	t   *testing.T
	cfg clusterConfig
	// nw is the private network of the light topology; with HA the
	// cluster network is clusterNet and the edges also join accessNet, the
	// network of their published MQTT and ops ports, so that cutting an
	// edge from clusterNet leaves its clients connected (see startHA).
	nw                    *testcontainers.DockerNetwork
	clusterNet, accessNet string
	routerNet             netip.Addr // the cluster network's subnet (HA)
	Coord                 *testcontainers.DockerContainer
	Router                *testcontainers.DockerContainer
	// Persist, Redis and Replica run only with clusterConfig.Persistence.
	Persist, Redis, Replica *testcontainers.DockerContainer
	// With HA: Coords[i] is coordinator-(i+1), Routers[i] router-(i+1),
	// Redises[i] redis-(i+1) (redis-1 starts as the primary) and
	// Persists[i] persistence-(i+1). Coord, Router, Persist and Redis are
	// then the first of each.
	Coords, Routers, Persists, Redises []*testcontainers.DockerContainer
	Edges                              []*testcontainers.DockerContainer // Edges[0] is edge-1
	mu                                 sync.Mutex                        // guards urls
	urls                               []string
	docker                             *testcontainers.DockerClient
	// Ready is when every container answered /readyz.
	Ready time.Time
}

func edgeAlias(i int) string { return fmt.Sprintf("edge-%d", i+1) }

// startCluster starts the cluster and waits until every container answers
// /readyz. The coordinator and the router start together, then every edge
// at once: an edge retries joining until the coordinator answers.
func startCluster(t *testing.T, cfg clusterConfig) *keelCluster {
	t.Helper()
	if cfg.Edges == 0 {
		cfg.Edges = 3
	}
	ctx := t.Context()
	began := time.Now()
	cli, err := testcontainers.NewDockerClientWithOpts(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = cli.Close() })
	k := &keelCluster{t: t, cfg: cfg, docker: cli}
	if cfg.HA {
		return k.startHA(began)
	}
	nw, err := network.New(ctx)
	testcontainers.CleanupNetwork(t, nw)
	require.NoError(t, err)
	k.nw = nw

	var wg sync.WaitGroup
	var coordErr, routerErr error
	wg.Go(func() { k.Coord, coordErr = k.runCoordinator() })
	wg.Go(func() { k.Router, routerErr = k.runRouter() })
	var persistErr error
	if cfg.Persistence {
		wg.Go(func() { persistErr = k.runPersistence() })
	}
	wg.Wait()
	require.NoError(t, coordErr, "coordinator")
	require.NoError(t, routerErr, "router")
	require.NoError(t, persistErr, "persistence")

	k.Edges = make([]*testcontainers.DockerContainer, cfg.Edges)
	errs := make([]error, cfg.Edges)
	for i := range cfg.Edges {
		wg.Go(func() { k.Edges[i], errs[i] = k.runEdge(i) })
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, edgeAlias(i))
	}
	// Stop every container at once before the cleanups remove them one by
	// one: an edge may take its whole stop timeout to close its streams.
	t.Cleanup(k.stopAll)
	k.urls = make([]string, cfg.Edges)
	for i, e := range k.Edges {
		k.urls[i] = mqttURL(t, e)
	}
	k.Ready = time.Now()
	t.Logf("cluster of %d edges ready in %v", cfg.Edges, k.Ready.Sub(began).Round(100*time.Millisecond))
	return k
}

// run starts a container; it is registered for cleanup (and for its logs
// on failure) even when it failed to become ready.
func (k *keelCluster) run(name, svc string, args []string, ports []string, ops string, nets ...testcontainers.ContainerCustomizer) (*testcontainers.DockerContainer, error) {
	if lvl := os.Getenv("KEEL_E2E_LOG_LEVEL"); lvl != "" {
		args = append(args, "--log.level", lvl)
	}
	if len(nets) == 0 {
		nets = []testcontainers.ContainerCustomizer{network.WithNetwork([]string{name}, k.nw)}
	}
	c, err := testcontainers.Run(context.Background(), image(svc), append(nets,
		testcontainers.WithCmd(args...),
		testcontainers.WithExposedPorts(ports...),
		testcontainers.WithWaitStrategy(wait.ForHTTP("/readyz").WithPort(ops).WithForcedIPv4LocalHost().
			WithPollInterval(50*time.Millisecond).WithStartupTimeout(90*time.Second)))...)
	// Nothing is checked after the test, so the graceful stop is cut short:
	// ten idle seconds per container would dominate the suite's time.
	testcontainers.CleanupContainer(k.t, c, testcontainers.StopTimeout(2*time.Second))
	if c != nil {
		dumpLogs(k.t, c, name)
	}
	return c, err
}

func (k *keelCluster) runCoordinator() (*testcontainers.DockerContainer, error) {
	args := []string{"--raft.bootstrap-expect", "1", "--raft.node-id", "c1", "--raft.data-dir", "/data/raft",
		"--raft.advertise-addr", fmt.Sprintf("%s:%d", coordAlias, coordRaftPort),
		"--api.advertise-addr", fmt.Sprintf("%s:%d", coordAlias, coordAPIPort),
		"--router.url", fmt.Sprintf("http://%s:%d", routerAlias, routerAPIPort), "--custody.route-grace", "1s"}
	if k.cfg.LeaseTTL > 0 {
		args = append(args, "--lease-ttl", k.cfg.LeaseTTL.String())
	}
	return k.run(coordAlias, "coordinator", args, []string{coordOpsPort}, coordOpsPort)
}

func (k *keelCluster) runRouter() (*testcontainers.DockerContainer, error) {
	// One node: Olric talks to nobody else, so loopback is an address it can
	// bind and "reach" inside the container.
	args := []string{"--olric.single-node", "--olric.bind-addr", "127.0.0.1",
		"--api.addr", fmt.Sprintf(":%d", routerAPIPort), "--ops.addr", ":9101"}
	return k.run(routerAlias, "router", args, []string{routerOpsPort}, routerOpsPort)
}

// runPersistence starts Redis, its replica and the persistence instance in
// front of them.
func (k *keelCluster) runPersistence() error {
	redis := func(alias string, extra ...string) (*testcontainers.DockerContainer, error) {
		args := append([]string{"--bind", "0.0.0.0", "--protected-mode", "no", "--save", "", "--appendonly", "yes"}, extra...)
		c, err := testcontainers.Run(context.Background(), image("redis"),
			network.WithNetwork([]string{alias}, k.nw),
			testcontainers.WithCmd(args...),
			testcontainers.WithWaitStrategy(wait.ForLog("Ready to accept connections").WithStartupTimeout(60*time.Second)))
		testcontainers.CleanupContainer(k.t, c, testcontainers.StopTimeout(time.Second))
		if c != nil {
			dumpLogs(k.t, c, alias)
		}
		return c, err
	}
	var err error
	if k.Redis, err = redis(redisAlias); err != nil {
		return err
	}
	if k.Replica, err = redis(replicaAlias, "--replicaof", redisAlias, "6379"); err != nil {
		return err
	}
	args := []string{"--redis.addr", redisAlias + ":6379", "--redis.replicas", replicaAlias + ":6379", "--redis.min-replicas", "1",
		"--api.addr", fmt.Sprintf(":%d", persistPort), "--api.advertise-addr", fmt.Sprintf("%s:%d", persistAlias, persistPort),
		"--coordinator.addr", fmt.Sprintf("http://%s:%d", coordAlias, coordAPIPort)}
	k.Persist, err = k.run(persistAlias, "persistence", args, []string{persistOps}, persistOps)
	return err
}

func (k *keelCluster) runEdge(i int) (*testcontainers.DockerContainer, error) {
	alias := edgeAlias(i)
	args := []string{"--auth.anonymous", "--mqtt.ws-addr", "", "--ops.addr", ":9100", "--data-dir", "/data",
		"--mqtt.edge-id", alias,
		"--cluster.coordinator", fmt.Sprintf("http://%s:%d", coordAlias, coordAPIPort),
		"--cluster.router", fmt.Sprintf("http://%s:%d", routerAlias, routerAPIPort),
		"--cluster.api-addr", fmt.Sprintf(":%d", edgeAPIPort),
		"--cluster.advertise-addr", fmt.Sprintf("%s:%d", alias, edgeAPIPort)}
	if k.cfg.ForwardTimeout > 0 {
		args = append(args, "--cluster.forward-timeout", k.cfg.ForwardTimeout.String())
	}
	if k.cfg.Persistence {
		args = append(args, "--cluster.persistence", fmt.Sprintf("http://%s:%d", persistAlias, persistPort))
	}
	args = append(args, k.cfg.EdgeArgs...)
	args = append(args, strings.Fields(os.Getenv("KEEL_E2E_EDGE_ARGS"))...)
	var nets []testcontainers.ContainerCustomizer
	if k.accessNet != "" {
		// The access network first: it sorts first by name too, so Docker
		// keeps the published ports on it (see startHA). No name there:
		// the other edges must reach this one only through the cluster
		// network, or cutting it from that network would cut nothing
		// between edges.
		nets = append(nets, network.WithNetworkName(nil, k.accessNet), network.WithNetworkName([]string{alias}, k.clusterNet))
	}
	return k.run(alias, "edge", args, []string{edgeMQTTPort, edgeOpsPort}, edgeOpsPort, nets...)
}

// URL is the host's MQTT URL of edge i (0-based); it changes when the edge
// restarts.
func (k *keelCluster) URL(i int) string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.urls[i]
}

func (k *keelCluster) setURL(i int, url string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.urls[i] = url
}

func (k *keelCluster) all() []*testcontainers.DockerContainer {
	all := []*testcontainers.DockerContainer{k.Coord, k.Router, k.Persist, k.Redis, k.Replica}
	for _, cs := range [][]*testcontainers.DockerContainer{k.Coords, k.Routers, k.Persists, k.Redises, k.Edges} {
		all = append(all, cs...)
	}
	seen := map[*testcontainers.DockerContainer]bool{nil: true}
	out := all[:0]
	for _, c := range all {
		if !seen[c] {
			seen[c] = true
			out = append(out, c)
		}
	}
	return out
}

func (k *keelCluster) stopAll() {
	stop := 2 * time.Second
	var wg sync.WaitGroup
	for _, c := range k.all() {
		if c == nil {
			continue
		}
		wg.Go(func() {
			// A paused container cannot stop; unpausing a running one fails
			// harmlessly.
			_, _ = k.docker.ContainerUnpause(context.Background(), c.GetContainerID(), client.ContainerUnpauseOptions{})
			_ = c.Stop(context.Background(), &stop)
		})
	}
	wg.Wait()
}

// KillRouter kills the router with SIGKILL: no graceful stop, no goodbye
// to the edges' streams. The container stays (stopped) for its logs.
func (k *keelCluster) KillRouter() {
	k.t.Helper()
	_, err := k.docker.ContainerKill(context.Background(), k.Router.GetContainerID(), client.ContainerKillOptions{Signal: "KILL"})
	require.NoError(k.t, err)
}

// StartRouter starts a new, empty router under the same alias and returns
// once it is ready.
func (k *keelCluster) StartRouter() {
	k.t.Helper()
	r, err := k.runRouter()
	require.NoError(k.t, err, "new router")
	k.Router = r
}

// Kill kills a container with SIGKILL: no graceful stop, no drain.
func (k *keelCluster) Kill(c *testcontainers.DockerContainer) {
	k.t.Helper()
	_, err := k.docker.ContainerKill(context.Background(), c.GetContainerID(), client.ContainerKillOptions{Signal: "KILL"})
	require.NoError(k.t, err)
}

func (k *keelCluster) Pause(c *testcontainers.DockerContainer) {
	k.t.Helper()
	_, err := k.docker.ContainerPause(context.Background(), c.GetContainerID(), client.ContainerPauseOptions{})
	require.NoError(k.t, err)
}

func (k *keelCluster) Unpause(c *testcontainers.DockerContainer) {
	k.t.Helper()
	_, err := k.docker.ContainerUnpause(context.Background(), c.GetContainerID(), client.ContainerUnpauseOptions{})
	require.NoError(k.t, err)
}

// dumpLogs prints a container's logs when the test failed, or always when
// KEEL_E2E_LOGS=1 (to read what the product did in a passing run).
func dumpLogs(t *testing.T, c *testcontainers.DockerContainer, name string) {
	t.Cleanup(func() {
		if !t.Failed() && os.Getenv("KEEL_E2E_LOGS") != "1" {
			return
		}
		rc, err := c.Logs(context.Background())
		if err != nil {
			return
		}
		defer rc.Close()
		var b strings.Builder
		buf := make([]byte, 32<<10)
		for {
			n, err := rc.Read(buf)
			b.Write(buf[:n])
			if err != nil {
				break
			}
		}
		t.Logf("logs of %s:\n%s", name, b.String())
	})
}

// mqttOpts are the options every test client starts from: MQTT 3.1.1,
// no automatic reconnection (a test decides when to come back), handlers
// called in arrival order.
func mqttOpts(url, id string, clean bool) *mqtt.ClientOptions {
	return mqtt.NewClientOptions().AddBroker(url).SetClientID(id).SetCleanSession(clean).
		SetProtocolVersion(4).SetAutoReconnect(false).SetConnectRetry(false).SetOrderMatters(true).
		SetConnectTimeout(10 * time.Second).SetKeepAlive(30 * time.Second).SetWriteTimeout(10 * time.Second)
}

// dial connects with opts, retrying briefly: right after a container
// starts, or while an edge is fenced, a CONNECT may be refused.
func dial(opts *mqtt.ClientOptions, within time.Duration) (mqtt.Client, error) {
	deadline := time.Now().Add(within)
	for {
		c := mqtt.NewClient(opts)
		tok := c.Connect()
		var err error
		if !tok.WaitTimeout(15 * time.Second) {
			err = fmt.Errorf("connect timed out")
		} else {
			err = tok.Error()
		}
		if err == nil {
			return c, nil
		}
		c.Disconnect(0)
		if time.Now().After(deadline) {
			return nil, err
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// mustDial is dial for the test goroutine; the client is disconnected at
// cleanup.
func mustDial(t *testing.T, opts *mqtt.ClientOptions) mqtt.Client {
	t.Helper()
	c, err := dial(opts, 20*time.Second)
	require.NoError(t, err, "connect %s", opts.ClientID)
	t.Cleanup(func() { c.Disconnect(50) })
	return c
}

// subscribe connects a subscriber of the checker, subscribes it to its
// filters and marks its window open at the SUBACK.
func subscribe(t *testing.T, url, clientID string, clean bool, s *Subscriber, lost mqtt.ConnectionLostHandler) mqtt.Client {
	t.Helper()
	opts := mqttOpts(url, clientID, clean).SetDefaultPublishHandler(s.Handler())
	if lost != nil {
		opts.SetConnectionLostHandler(lost)
	}
	c := mustDial(t, opts)
	requireSubscribe(t, c, s)
	return c
}

func requireSubscribe(t *testing.T, c mqtt.Client, s *Subscriber) {
	t.Helper()
	filters := map[string]byte{}
	for _, f := range s.Filters {
		filters[f] = s.QoS
	}
	tok := c.SubscribeMultiple(filters, nil)
	require.True(t, tok.WaitTimeout(20*time.Second), "SUBACK for %s", s.Name)
	require.NoError(t, tok.Error())
	for f, code := range tok.(*mqtt.SubscribeToken).Result() {
		require.Less(t, code, byte(0x80), "subscription %s of %s refused", f, s.Name)
	}
	s.Subscribed()
}
