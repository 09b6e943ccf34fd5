package cluster

import (
	"bufio"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/slots"
	"github.com/keelmq/keel/libs/testutil"
)

// startRedisServer runs a redis-server that keeps nothing on disk, skipping
// the test when none is installed, and returns its address.
func startRedisServer(t *testing.T) string {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Skip("redis-server not installed: `make deps` installs the redis-server package")
	}
	port := testutil.FreePort(t)
	addr := "127.0.0.1:" + strconv.Itoa(port)
	cmd := exec.Command(bin, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", t.TempDir(), "--save", "",
		"--appendonly", "no", "--protected-mode", "no")
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	testutil.Eventually(t, 10*time.Second, func() error {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(time.Second))
		if _, err := c.Write([]byte("PING\r\n")); err != nil {
			return err
		}
		if line, err := bufio.NewReader(c).ReadString('\n'); err != nil || !strings.HasPrefix(line, "+PONG") {
			return fmt.Errorf("redis answered %q: %v", line, err)
		}
		return nil
	})
	return addr
}

// TestCluster_TwoRedisGroups runs a cluster installed with two Redis
// groups: a coordinator (--redis.groups 2), a router, one Redis and one
// persistence instance per group, and two edges given both groups'
// persistence URLs. Persistent sessions made on edge A, whose slots fall in
// both groups, get QoS 1 messages published on edge B while offline and
// resume on B with them; each session's keys are in its own group's Redis
// only.
func TestCluster_TwoRedisGroups(t *testing.T) {
	if testing.Short() {
		t.Skip("starts several processes; skipped under -short")
	}
	t.Parallel()
	dir := t.TempDir()
	routerBin := testutil.Build(t, dir, "./services/router/cmd/keel-router")
	persistBin := testutil.Build(t, dir, "./services/persistence/cmd/keel-persistence")
	edgeBin := testutil.Build(t, dir, "./services/edge/cmd/keel-edge")

	routerAPI, routerOps := testutil.FreeAddr(t), testutil.FreeAddr(t)
	startProcess(t, "router", routerBin, routerOps, "--api.addr", routerAPI, "--ops.addr", routerOps, "--olric.single-node",
		"--router.rebuild-wait", "200ms", "--olric.bind-addr", "127.0.0.1", "--olric.port", fmt.Sprint(testutil.FreePort(t)),
		"--olric.memberlist-port", fmt.Sprint(testutil.FreePort(t)), "--log.level", "warn")
	coordURL, _ := startCoordinator(t, 2*time.Second, "--router.url", "http://"+routerAPI, "--redis.groups", "2")

	var redisAddrs, persistURLs []string
	for g := range 2 {
		addr := startRedisServer(t)
		api, ops := testutil.FreeAddr(t), testutil.FreeAddr(t)
		startProcess(t, fmt.Sprintf("persistence-%d", g), persistBin, ops, "--api.addr", api, "--ops.addr", ops,
			"--api.advertise-addr", "http://"+api, "--member-id", fmt.Sprintf("p%d", g), "--coordinator.addr", coordURL,
			"--redis.addr", addr, "--redis.group-id", strconv.Itoa(g), "--redis.min-replicas", "0", "--unreplicated",
			"--log.level", "warn")
		redisAddrs = append(redisAddrs, addr)
		persistURLs = append(persistURLs, "http://"+api)
	}
	edges := map[string]string{}
	for _, id := range []string{"a", "b"} {
		mqtt, ops, api := testutil.FreeAddr(t), testutil.FreeAddr(t), testutil.FreeAddr(t)
		startProcess(t, "edge-"+id, edgeBin, ops, "--auth.anonymous", "--mqtt.tcp-addr", mqtt, "--mqtt.ws-addr", "",
			"--ops.addr", ops, "--data-dir", t.TempDir(), "--mqtt.edge-id", id, "--log.level", "warn",
			"--cluster.coordinator", coordURL, "--cluster.router", "http://"+routerAPI, "--cluster.api-addr", api,
			"--cluster.persistence", strings.Join(persistURLs, ","), "--cluster.forward-timeout", "2s")
		edges[id] = mqtt
	}

	table := slots.Even(2)
	var ids []string
	var in [2]int
	for i := 0; len(ids) < 6; i++ {
		id := fmt.Sprintf("dev-%d", i)
		if g := table.Session("default", id); in[g] < 3 {
			in[g]++
			ids = append(ids, id)
		}
	}
	for _, id := range ids {
		c := persistentSubscriber(t, edges["a"], id, "to/"+id, edges["b"], "first-"+id)
		_ = c.Conn.Close()
	}
	for _, id := range ids {
		publishAcked(t, edges["b"], "to/"+id+"/x", []byte("offline-"+id), 10*time.Second)
	}
	for _, id := range ids {
		c := connectResumed(t, edges["b"], id, 15*time.Second)
		require.Equal(t, []string{"offline-" + id}, receive(t, c, []string{"offline-" + id}), id)
		_ = c.Conn.Close()
	}

	for g, addr := range redisAddrs {
		held := map[string]bool{}
		for _, k := range redisKeys(t, addr, "*{default:dev-*") {
			tag := k[strings.Index(k, "{default:")+len("{default:") : strings.Index(k, "}")]
			held[tag] = true
		}
		for _, id := range ids {
			require.Equal(t, table.Session("default", id) == uint32(g), held[id], "session %s in the Redis of group %d", id, g)
		}
	}
}

// redisKeys returns the keys matching pattern (KEYS, over RESP by hand).
func redisKeys(t *testing.T, addr, pattern string) []string {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, time.Second)
	require.NoError(t, err)
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	_, err = fmt.Fprintf(c, "*2\r\n$4\r\nKEYS\r\n$%d\r\n%s\r\n", len(pattern), pattern)
	require.NoError(t, err)
	r := bufio.NewReader(c)
	line := func() string {
		l, err := r.ReadString('\n')
		require.NoError(t, err)
		return strings.TrimRight(l, "\r\n")
	}
	head := line()
	require.True(t, strings.HasPrefix(head, "*"), "KEYS answered %q", head)
	n, err := strconv.Atoi(head[1:])
	require.NoError(t, err)
	keys := make([]string, 0, n)
	for range n {
		line() // $<length>
		keys = append(keys, line())
	}
	return keys
}
