package app

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/output/internal/meta"
	"github.com/keelmq/keel/services/output/internal/outputtest"
)

// repoRoot finds the directory holding go.work.
func repoRoot(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	require.NoError(t, err)
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.work")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Skip("go.work not found: the edge cannot be built here")
		}
		dir = parent
	}
}

// TestOutput_FromEdge_MQTTToKafka is the whole path: MQTT clients publish
// to a real keel-edge process, which sends the messages a rule matches to
// this output service, whose Kafka plugin writes them to a kfake broker;
// kafka-go reads them back with their MQTT metadata. Messages no rule
// matches stay on the edge (keel_edge_output_skipped_total) and never reach
// the output service.
func TestOutput_FromEdge_MQTTToKafka(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	t.Parallel()
	root := repoRoot(t)
	bin := filepath.Join(t.TempDir(), "keel-edge")
	build := exec.Command("go", "build", "-o", bin, "./services/edge/cmd/keel-edge")
	build.Dir = root
	out, err := build.CombinedOutput()
	require.NoError(t, err, "build keel-edge: %s", out)

	addr := outputtest.StartKafka(t, 4, kafkaTopic)
	h := startOutput(t, kafkaRules(addr, ""))
	mqttAddr, opsAddr := testutil.FreeAddr(t), testutil.FreeAddr(t)
	edge := exec.Command(bin, "--auth.anonymous", "--auth.anonymous-tenant", "acme", "--mqtt.tcp-addr", mqttAddr,
		"--mqtt.ws-addr", "", "--ops.addr", opsAddr, "--data-dir", t.TempDir(), "--output.url", h.url, "--log.level", "warn")
	var logs strings.Builder
	edge.Stdout, edge.Stderr = &logs, &logs
	require.NoError(t, edge.Start())
	t.Cleanup(func() {
		_ = edge.Process.Signal(syscall.SIGTERM)
		_ = edge.Wait()
		if t.Failed() {
			t.Logf("edge logs:\n%s", logs.String())
		}
	})

	opts := mqtt.NewClientOptions().AddBroker("tcp://" + mqttAddr).SetClientID("pub").SetConnectRetry(true).
		SetConnectRetryInterval(100 * time.Millisecond).SetConnectTimeout(5 * time.Second)
	c := mqtt.NewClient(opts)
	tok := c.Connect()
	require.True(t, tok.WaitTimeout(15*time.Second), "connect to the edge")
	require.NoError(t, tok.Error())
	defer c.Disconnect(100)
	// The edge has the rules' filters once its stream is open.
	edgeMetric := func(name string) float64 { return testutil.Metric(t, opsAddr, name) }
	testutil.Eventually(t, 20*time.Second, func() error {
		if v := edgeMetric("keel_edge_output_filters_version"); v != float64(h.out.Host().Filters().Proto.GetVersion()) {
			return fmt.Errorf("edge filters version %v", v)
		}
		return nil
	})
	publish := func(topic string, i int) {
		t.Helper()
		pt := c.Publish(topic, 1, false, fmt.Appendf(nil, "m%d", i))
		require.True(t, pt.WaitTimeout(5*time.Second))
		require.NoError(t, pt.Error())
	}
	const n, other = 50, 20
	for i := range n {
		publish(fmt.Sprintf("sensors/%d", i%3), i)
		if i < other {
			publish(fmt.Sprintf("other/%d", i%3), i)
		}
	}
	testutil.Eventually(t, 20*time.Second, func() error {
		if w := metric(t, h.out.Registry(), "keel_output_records_out_total", nil); int(w) < n {
			return fmt.Errorf("written %v of %d", w, n)
		}
		return nil
	})
	require.Equal(t, float64(other), edgeMetric("keel_edge_output_skipped_total"))
	require.Equal(t, float64(n), edgeMetric("keel_edge_output_sent_total"))
	require.Zero(t, metric(t, h.out.Registry(), "keel_output_unmatched_total", nil))
	msgs := outputtest.ReadKafka(t, addr, kafkaTopic, 4, n, 20*time.Second)
	require.Len(t, msgs, n)
	for _, km := range msgs {
		require.Equal(t, "acme", header(km.Headers, meta.HeaderTenant))
		require.Equal(t, "pub", header(km.Headers, meta.HeaderClientID))
		require.Equal(t, "1", header(km.Headers, meta.HeaderQoS))
		require.True(t, strings.HasPrefix(string(km.Key), "sensors/"))
		require.NotEmpty(t, header(km.Headers, meta.HeaderMsgID))
	}
}
