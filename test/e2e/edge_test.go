package e2e

import (
	"context"
	"fmt"
	"io"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/moby/moby/client"
	"github.com/stretchr/testify/require"
	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/network"
	"github.com/testcontainers/testcontainers-go/wait"
)

func image(service string) string { return "keel/" + service + ":" + imageTag }

// startEdge runs an edge container with the given extra flags.
func startEdge(t *testing.T, nw *testcontainers.DockerNetwork, alias string, args ...string) *testcontainers.DockerContainer {
	t.Helper()
	opts := []testcontainers.ContainerCustomizer{
		testcontainers.WithCmd(append([]string{"--auth.anonymous", "--mqtt.ws-addr", "", "--ops.addr", ":9100",
			"--data-dir", "/data", "--mqtt.edge-id", alias}, args...)...),
		testcontainers.WithExposedPorts("1883/tcp"),
		testcontainers.WithWaitStrategy(wait.ForLog("edge ready").WithStartupTimeout(60*time.Second),
			wait.ForListeningPort("1883/tcp").SkipInternalCheck()),
	}
	if nw != nil {
		opts = append(opts, network.WithNetwork([]string{alias}, nw))
	}
	c, err := testcontainers.Run(t.Context(), image("edge"), opts...)
	testcontainers.CleanupContainer(t, c)
	require.NoError(t, err)
	dumpLogsOnFailure(t, c, alias)
	return c
}

// dumpLogsOnFailure prints a container's logs when the test failed.
func dumpLogsOnFailure(t *testing.T, c *testcontainers.DockerContainer, name string) {
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		rc, err := c.Logs(context.Background())
		if err != nil {
			return
		}
		defer rc.Close()
		b, _ := io.ReadAll(rc)
		t.Logf("logs of %s:\n%s", name, b)
	})
}

func mqttURL(t *testing.T, c *testcontainers.DockerContainer) string {
	t.Helper()
	host, err := c.Host(t.Context())
	require.NoError(t, err)
	if host == "localhost" {
		// Docker's userland proxy also listens on [::]; a container without
		// IPv6 answers there with an immediate EOF. Use IPv4.
		host = "127.0.0.1"
	}
	port, err := c.MappedPort(t.Context(), "1883/tcp")
	require.NoError(t, err)
	return fmt.Sprintf("tcp://%s:%s", host, port.Port())
}

func connect(t *testing.T, url, id string, clean bool, onMsg mqtt.MessageHandler) mqtt.Client {
	t.Helper()
	opts := mqtt.NewClientOptions().AddBroker(url).SetClientID(id).SetCleanSession(clean).
		SetConnectTimeout(10 * time.Second).SetAutoReconnect(false).SetDefaultPublishHandler(onMsg)
	c := mqtt.NewClient(opts)
	// Right after a container starts, Docker's port proxy can reset a
	// connection before the container's network is wired: retry briefly.
	var err error
	for attempt := 0; attempt < 10; attempt++ {
		tok := c.Connect()
		require.True(t, tok.WaitTimeout(15*time.Second), "connect %s", id)
		if err = tok.Error(); err == nil {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	require.NoError(t, err)
	t.Cleanup(func() { c.Disconnect(50) })
	return c
}

// TestE2E_Edge_PersistentSessionSurvivesRestart: QoS 1 messages published
// while a persistent subscriber is away are acknowledged, the edge container
// is stopped (SIGTERM) and started again on its data volume, and the
// subscriber gets every one of them, in order.
func TestE2E_Edge_PersistentSessionSurvivesRestart(t *testing.T) {
	needDocker(t)
	edge := startEdge(t, nil, "edge-1")
	got := make(chan string, 100)
	sub := connect(t, mqttURL(t, edge), "sub", false, func(_ mqtt.Client, m mqtt.Message) { got <- string(m.Payload()) })
	tok := sub.Subscribe("e2e/#", 1, nil)
	require.True(t, tok.WaitTimeout(10*time.Second))
	require.NoError(t, tok.Error())
	sub.Disconnect(50)

	pub := connect(t, mqttURL(t, edge), "pub", true, nil)
	const n = 20
	for i := range n {
		pt := pub.Publish("e2e/x", 1, false, fmt.Sprint(i))
		require.True(t, pt.WaitTimeout(10*time.Second))
		require.NoError(t, pt.Error(), "publish %d acknowledged", i)
	}
	pub.Disconnect(50)

	stop := 10 * time.Second
	require.NoError(t, edge.Stop(context.Background(), &stop))
	require.NoError(t, edge.Start(context.Background())) // the mapped port changes: read it again

	connect(t, mqttURL(t, edge), "sub", false, func(_ mqtt.Client, m mqtt.Message) { got <- string(m.Payload()) })
	for i := range n {
		select {
		case p := <-got:
			require.Equal(t, fmt.Sprint(i), p, "message %d in order", i)
		case <-time.After(15 * time.Second):
			t.Fatalf("message %d never arrived after the restart", i)
		}
	}
}

// TestE2E_Edge_FencedWhenCoordinatorPaused runs an edge in a cluster with
// one coordinator; pausing the coordinator past the lease makes the edge
// fence itself (clients disconnected, nobody admitted), and unpausing it
// lets the edge rejoin and serve again.
func TestE2E_Edge_FencedWhenCoordinatorPaused(t *testing.T) {
	needDocker(t)
	ctx := t.Context()
	nw, err := network.New(ctx)
	testcontainers.CleanupNetwork(t, nw)
	require.NoError(t, err)
	coord, err := testcontainers.Run(ctx, image("coordinator"),
		network.WithNetwork([]string{"coordinator"}, nw),
		testcontainers.WithCmd("--raft.bootstrap-expect", "1", "--raft.node-id", "c1", "--raft.data-dir", "/data/raft",
			"--raft.advertise-addr", "coordinator:7400", "--api.advertise-addr", "coordinator:7401", "--lease-ttl", "3s"),
		testcontainers.WithExposedPorts("9101/tcp"),
		testcontainers.WithWaitStrategy(wait.ForHTTP("/readyz").WithPort("9101/tcp").WithStartupTimeout(60*time.Second)))
	testcontainers.CleanupContainer(t, coord)
	require.NoError(t, err)

	edge := startEdge(t, nw, "edge-1", "--cluster.coordinator", "http://coordinator:7401")
	lost := make(chan error, 1)
	opts := mqtt.NewClientOptions().AddBroker(mqttURL(t, edge)).SetClientID("c").SetAutoReconnect(false).
		SetConnectionLostHandler(func(_ mqtt.Client, err error) { lost <- err })
	c := mqtt.NewClient(opts)
	require.True(t, c.Connect().WaitTimeout(10*time.Second))

	cli, err := testcontainers.NewDockerClientWithOpts(ctx)
	require.NoError(t, err)
	defer cli.Close()
	id := coord.GetContainerID()
	_, err = cli.ContainerPause(ctx, id, client.ContainerPauseOptions{})
	require.NoError(t, err)
	select {
	case <-lost:
	case <-time.After(20 * time.Second):
		t.Fatal("the edge did not fence itself when its lease could not be renewed")
	}
	refused := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(mqttURL(t, edge)).SetClientID("d").SetAutoReconnect(false))
	require.True(t, refused.Connect().WaitTimeout(10*time.Second))
	require.False(t, refused.IsConnected(), "a fenced edge admits nobody")

	_, err = cli.ContainerUnpause(ctx, id, client.ContainerUnpauseOptions{})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		c := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(mqttURL(t, edge)).SetClientID("e").SetAutoReconnect(false))
		tok := c.Connect()
		ok := tok.WaitTimeout(5*time.Second) && tok.Error() == nil
		if ok {
			c.Disconnect(50)
		}
		return ok
	}, 30*time.Second, 500*time.Millisecond, "the edge rejoins and serves again")
}
