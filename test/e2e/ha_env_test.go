package e2e

import (
	"bufio"
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	mobynet "github.com/moby/moby/api/types/network"
	"github.com/moby/moby/client"
	"github.com/stretchr/testify/require"
	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/network"
	"github.com/testcontainers/testcontainers-go/wait"
)

// The HA topology (clusterConfig.HA) is what the product runs (the Helm
// chart in deploy/helm): three coordinators forming one Raft group through
// memberlist, three routers forming one Olric cluster, one Redis group of a
// primary and two replicas with a persistence instance per node, and the
// edges. Every node has its own name on the cluster network (coordinator-1,
// router-2, persistence-3, redis-1, edge-2, ...) and the nodes of a service
// also share the service's name (coordinator, router, persistence), which
// Docker's DNS answers with every live node: the edges reach the services
// through it as they would through a Kubernetes Service.

// haNodes is the size of each replicated service of the HA topology.
const haNodes = 3

const redisPort = 6379

func nodeAlias(svc string, i int) string { return fmt.Sprintf("%s-%d", svc, i+1) }

// startHA starts the HA topology on two networks of its own: the cluster
// network, where every service has its names, and the access network of
// the edges' published ports.
//
// Docker (20.10 here) publishes a container's ports on the endpoint of its
// gateway network, and picks that network among those the container is
// attached to by name. The access network is named to sort first, so the
// edges' ports stay on it when an edge is disconnected from the cluster
// network and connected again, and their clients stay connected through
// the cut.
//
// The routers get fixed addresses on the cluster network (see runHARouter),
// so it has a subnet of its own.
func (k *keelCluster) startHA(began time.Time) *keelCluster {
	t := k.t
	ctx := t.Context()
	k.cfg.Persistence = true
	base := "keel-e2e-" + strings.ReplaceAll(uuid.NewString(), "-", "")[:12]
	k.accessNet = base + "-a-access"
	k.clusterNet = base + "-b-cluster"
	k.createNetwork(ctx, k.accessNet, nil)
	for attempt := 0; ; attempt++ {
		k.routerNet = netip.AddrFrom4([4]byte{10, byte(150 + rand.IntN(100)), byte(rand.IntN(256)), 0})
		err := k.createNetwork(ctx, k.clusterNet, &mobynet.IPAM{Driver: "default", Config: []mobynet.IPAMConfig{{
			Subnet:  netip.PrefixFrom(k.routerNet, 24),
			IPRange: netip.PrefixFrom(k.routerNet, 25), // dynamic addresses: .1 to .127
			Gateway: k.routerNet.Next(),
		}}})
		if err == nil {
			break
		}
		require.Less(t, attempt, 10, "creating the cluster network: %v", err)
	}

	n := haNodes
	k.Coords = make([]*testcontainers.DockerContainer, n)
	k.Routers = make([]*testcontainers.DockerContainer, n)
	k.Redises = make([]*testcontainers.DockerContainer, n)
	k.Persists = make([]*testcontainers.DockerContainer, n)
	errs := make([]error, 4*n)
	var wg sync.WaitGroup
	// Every service starts at once: bootstrap waits for 3 coordinators in
	// gossip, Olric for a quorum of routers, and persistence retries its
	// lease and the group record until a coordinator leader answers.
	for i := range n {
		wg.Go(func() { k.Coords[i], errs[i] = k.runHACoordinator(i) })
		wg.Go(func() { k.Routers[i], errs[n+i] = k.runHARouter(i) })
		wg.Go(func() {
			if k.Redises[i], errs[2*n+i] = k.runHARedis(i); errs[2*n+i] == nil {
				k.Persists[i], errs[3*n+i] = k.runHAPersistence(i)
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "%s", nodeAlias([]string{"coordinator", "router", "redis/persistence", "persistence"}[i/n], i%n))
	}
	k.Coord, k.Router, k.Redis, k.Persist = k.Coords[0], k.Routers[0], k.Redises[0], k.Persists[0]
	core := time.Now()

	k.Edges = make([]*testcontainers.DockerContainer, k.cfg.Edges)
	edgeErrs := make([]error, k.cfg.Edges)
	for i := range k.cfg.Edges {
		wg.Go(func() { k.Edges[i], edgeErrs[i] = k.runEdge(i) })
	}
	wg.Wait()
	for i, err := range edgeErrs {
		require.NoError(t, err, edgeAlias(i))
	}
	t.Cleanup(k.stopAll)
	k.urls = make([]string, k.cfg.Edges)
	for i, e := range k.Edges {
		k.urls[i] = mqttURL(t, e)
	}
	k.Ready = time.Now()
	t.Logf("HA cluster (%d coordinators, %d routers, %d Redis nodes and persistence instances, %d edges) ready in %v (core services in %v)",
		n, n, n, k.cfg.Edges, k.Ready.Sub(began).Round(100*time.Millisecond), core.Sub(began).Round(100*time.Millisecond))
	return k
}

// createNetwork creates a bridge network named name, removed at cleanup;
// the access network must exist, so its error fails the test, while an
// error with ipam is returned (the subnet may be taken).
func (k *keelCluster) createNetwork(ctx context.Context, name string, ipam *mobynet.IPAM) error {
	_, err := k.docker.NetworkCreate(ctx, name, client.NetworkCreateOptions{Driver: "bridge", Labels: testcontainers.GenericLabels(), IPAM: ipam})
	if err != nil && ipam == nil {
		require.NoError(k.t, err, "network %s", name)
	}
	if err == nil {
		k.t.Cleanup(func() { _, _ = k.docker.NetworkRemove(context.Background(), name, client.NetworkRemoveOptions{}) })
	}
	return err
}

// routerIP is the fixed address of router i on the cluster network.
func (k *keelCluster) routerIP(i int) netip.Addr {
	a := k.routerNet.As4()
	a[3] = byte(201 + i)
	return netip.AddrFrom4(a)
}

// onCluster attaches a container to the cluster network under its own name
// and, if shared is set, its service's.
func (k *keelCluster) onCluster(alias, shared string) testcontainers.ContainerCustomizer {
	aliases := []string{alias}
	if shared != "" {
		aliases = append(aliases, shared)
	}
	return network.WithNetworkName(aliases, k.clusterNet)
}

func (k *keelCluster) runHACoordinator(i int) (*testcontainers.DockerContainer, error) {
	alias := nodeAlias(coordAlias, i)
	var join []string
	for j := range haNodes {
		join = append(join, fmt.Sprintf("%s:7946", nodeAlias(coordAlias, j)))
	}
	args := []string{"--raft.bootstrap-expect", strconv.Itoa(haNodes), "--raft.node-id", alias, "--raft.data-dir", "/data/raft",
		"--raft.advertise-addr", fmt.Sprintf("%s:%d", alias, coordRaftPort),
		"--api.advertise-addr", fmt.Sprintf("%s:%d", alias, coordAPIPort),
		"--gossip.join", strings.Join(join, ","), "--gossip.join-interval", "500ms",
		"--router.url", fmt.Sprintf("http://%s:%d", routerAlias, routerAPIPort), "--custody.route-grace", "1s"}
	if k.cfg.LeaseTTL > 0 {
		args = append(args, "--lease-ttl", k.cfg.LeaseTTL.String())
	}
	return k.run(alias, "coordinator", args, []string{coordOpsPort}, coordOpsPort, k.onCluster(alias, coordAlias))
}

func (k *keelCluster) runHARouter(i int) (*testcontainers.DockerContainer, error) {
	alias := nodeAlias(routerAlias, i)
	var peers []string
	for j := range haNodes {
		peers = append(peers, nodeAlias(routerAlias, j)+":3322")
	}
	// Olric's data address is the node's own, fixed IP, as the Helm chart
	// passes the pod IP: the router takes "address:port" as its node ID and
	// other nodes look its API up under the name Olric gives the member,
	// which is always an IP (Olric resolves a host name, and replaces
	// 0.0.0.0 by an interface address). With the default 0.0.0.0, or a
	// host name, the two differ and no node finds another's API: every
	// route whose shard another node owns fails ("address of router node
	// 172.x.y.z:3320: store: key not found"), and SUBACK says 0x80.
	// Replica count 2, write quorum 2, member quorum 2 (the defaults).
	ip := k.routerIP(i)
	args := []string{"--api.addr", fmt.Sprintf(":%d", routerAPIPort), "--ops.addr", ":9101",
		"--router.advertise-url", fmt.Sprintf("http://%s:%d", alias, routerAPIPort),
		"--olric.bind-addr", ip.String(), "--olric.peers", strings.Join(peers, ",")}
	fixed := testcontainers.WithEndpointSettingsModifier(func(eps map[string]*mobynet.EndpointSettings) {
		if ep := eps[k.clusterNet]; ep != nil {
			ep.IPAMConfig = &mobynet.EndpointIPAMConfig{IPv4Address: ip}
		}
	})
	return k.run(alias, "router", args, []string{routerOpsPort}, routerOpsPort, k.onCluster(alias, routerAlias), fixed)
}

// runHARedis starts Redis node i: redis-1 the first primary, the others its
// replicas, every node refusing writes without a replica in sync as in the
// product (min-replicas-to-write 1, max lag 2 s).
func (k *keelCluster) runHARedis(i int) (*testcontainers.DockerContainer, error) {
	alias := nodeAlias(redisAlias, i)
	args := []string{"--bind", "0.0.0.0", "--protected-mode", "no", "--save", "", "--appendonly", "yes",
		"--min-replicas-to-write", "1", "--min-replicas-max-lag", "2",
		// The first sync at once, not after 5 s: writes wait for a replica.
		"--repl-diskless-sync-delay", "0"}
	if i > 0 {
		args = append(args, "--replicaof", nodeAlias(redisAlias, 0), strconv.Itoa(redisPort))
	}
	c, err := testcontainers.Run(context.Background(), image("redis"),
		k.onCluster(alias, ""),
		testcontainers.WithCmd(args...),
		testcontainers.WithWaitStrategy(wait.ForLog("Ready to accept connections").WithStartupTimeout(60*time.Second)))
	testcontainers.CleanupContainer(k.t, c, testcontainers.StopTimeout(time.Second))
	if c != nil {
		dumpLogs(k.t, c, alias)
	}
	return c, err
}

// runHAPersistence starts persistence instance i beside Redis node i, with
// the flags of services/persistence's own cluster test: every instance
// names redis-1 as the group's first primary (the record in the
// coordinator is the authority after that) and fails the group over within
// about a second of the primary going silent.
func (k *keelCluster) runHAPersistence(i int) (*testcontainers.DockerContainer, error) {
	alias := nodeAlias(persistAlias, i)
	var replicas []string
	for j := 1; j < haNodes; j++ {
		replicas = append(replicas, fmt.Sprintf("%s:%d", nodeAlias(redisAlias, j), redisPort))
	}
	args := []string{"--redis.addr", fmt.Sprintf("%s:%d", nodeAlias(redisAlias, 0), redisPort),
		"--redis.replicas", strings.Join(replicas, ","), "--redis.min-replicas", "1",
		"--redis.wait-timeout", "500ms", "--lease-margin", "500ms",
		"--failover.check-interval", "100ms", "--failover.down-after", "1s", "--failover.promotion-lease-ttl", "5s",
		"--failover.reconcile-interval", "1s", "--stop-timeout", "5s",
		"--member-id", alias, "--api.addr", fmt.Sprintf(":%d", persistPort),
		"--api.advertise-addr", fmt.Sprintf("http://%s:%d", alias, persistPort),
		"--coordinator.addr", fmt.Sprintf("http://%s:%d", coordAlias, coordAPIPort)}
	args = append(args, strings.Fields(os.Getenv("KEEL_E2E_PERSISTENCE_ARGS"))...)
	return k.run(alias, "persistence", args, []string{persistOps}, persistOps, k.onCluster(alias, persistAlias))
}

// RestartEdge stops edge i with SIGTERM (it drains: readiness off, its
// sessions to custodians, its clients disconnected with 0x8B), waiting up
// to grace before Docker kills it, and starts the same container again:
// same name, same edge ID, a new incarnation. It returns how long the
// stop took and the exit code of the stopped edge (137: Docker killed it
// after the grace); the edge's URL is updated once it is ready again (its
// host port changes).
func (k *keelCluster) RestartEdge(i int, grace time.Duration) (stopped time.Duration, exitCode int) {
	k.t.Helper()
	c := k.Edges[i]
	began := time.Now()
	require.NoError(k.t, c.Stop(context.Background(), &grace), "stop %s", edgeAlias(i))
	stopped = time.Since(began)
	st, err := c.State(context.Background())
	require.NoError(k.t, err)
	require.NoError(k.t, c.Start(context.Background()), "start %s again", edgeAlias(i))
	k.setURL(i, mqttURL(k.t, c))
	return stopped, st.ExitCode
}

// CutEdge disconnects edge i from the cluster network: it reaches no other
// service and nothing reaches it, but its clients (on the access network)
// stay connected.
func (k *keelCluster) CutEdge(i int) {
	k.t.Helper()
	require.NotEmpty(k.t, k.clusterNet, "CutEdge needs the HA topology")
	_, err := k.docker.NetworkDisconnect(context.Background(), k.clusterNet,
		client.NetworkDisconnectOptions{Container: k.Edges[i].GetContainerID(), Force: true})
	require.NoError(k.t, err)
}

// HealEdge connects edge i to the cluster network again under its name.
func (k *keelCluster) HealEdge(i int) {
	k.t.Helper()
	_, err := k.docker.NetworkConnect(context.Background(), k.clusterNet, client.NetworkConnectOptions{
		Container: k.Edges[i].GetContainerID(), EndpointConfig: &mobynet.EndpointSettings{Aliases: []string{edgeAlias(i)}}})
	require.NoError(k.t, err)
}

// metrics reads the Prometheus text exposition of a container's ops port
// and returns the samples whose name starts with prefix, keyed by the
// sample as written (name and labels).
func metrics(ctx context.Context, c *testcontainers.DockerContainer, port, prefix string) (map[string]float64, error) {
	ep, err := c.PortEndpoint(ctx, port, "http")
	if err != nil {
		return nil, err
	}
	ep = strings.Replace(ep, "localhost", "127.0.0.1", 1)
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, ep+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET /metrics: %s", resp.Status)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, prefix) {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		if v, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
			out[line[:i]] = v
		}
	}
	return out, sc.Err()
}

// sum adds the samples of one metric (every label set).
func sum(m map[string]float64, name string) float64 {
	var s float64
	for k, v := range m {
		if k == name || strings.HasPrefix(k, name+"{") {
			s += v
		}
	}
	return s
}

// Leader returns the index of the coordinator that reports itself Raft
// leader (keel_coordinator_raft_state 2), or -1 if none or several do.
func (k *keelCluster) Leader() int {
	leader := -1
	for i, c := range k.Coords {
		m, err := metrics(context.Background(), c, coordOpsPort, "keel_coordinator_raft_state")
		if err != nil {
			continue
		}
		if m["keel_coordinator_raft_state"] == 2 {
			if leader >= 0 {
				return -1
			}
			leader = i
		}
	}
	return leader
}

// WaitLeader waits until exactly one coordinator other than the excluded
// ones reports itself leader.
func (k *keelCluster) WaitLeader(within time.Duration, exclude ...int) int {
	k.t.Helper()
	leader := -1
	require.Eventually(k.t, func() bool {
		leader = k.Leader()
		for _, x := range exclude {
			if leader == x {
				return false
			}
		}
		return leader >= 0
	}, within, 100*time.Millisecond, "a coordinator leader")
	return leader
}

// EdgeConnections returns keel_edge_connections summed over the running
// edges (an edge that does not answer counts 0 and is reported).
func (k *keelCluster) EdgeConnections() (total int, perEdge []int, err error) {
	perEdge = make([]int, len(k.Edges))
	for i, e := range k.Edges {
		m, merr := metrics(context.Background(), e, edgeOpsPort, "keel_edge_connections")
		if merr != nil {
			err = fmt.Errorf("%s: %w", edgeAlias(i), merr)
			continue
		}
		perEdge[i] = int(sum(m, "keel_edge_connections"))
		total += perEdge[i]
	}
	return total, perEdge, err
}

// haConfig is the HA topology with the given lease TTL (0: the
// coordinator's default, 10 s).
func haConfig(ttl time.Duration) clusterConfig {
	return clusterConfig{HA: true, LeaseTTL: ttl}
}

// requireHAReady waits for one coordinator leader and logs it.
func requireHAReady(t *testing.T, k *keelCluster) {
	t.Helper()
	l := k.WaitLeader(30 * time.Second)
	t.Logf("coordinator leader: %s", nodeAlias(coordAlias, l))
}
