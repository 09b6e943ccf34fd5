// Package outputtest holds test helpers shared by the output service's
// packages: plugin binaries that run the built-in plugins from the test
// binary itself, a kfake Kafka cluster on loopback, and a Kafka reader.
//
// A package whose tests launch plugins calls [MaybeServePlugin] first thing
// in its TestMain. It is imported only from _test.go files.
package outputtest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	"github.com/keelmq/keel/services/output/internal/builtin"
	"github.com/keelmq/keel/services/output/internal/rules"
)

// pluginEnv names the plugin a re-executed test binary serves.
const pluginEnv = "KEEL_OUTPUT_TEST_PLUGIN"

// MaybeServePlugin serves a plugin and exits when this process was started
// as one by a [PluginDir] wrapper; otherwise it returns at once.
func MaybeServePlugin() {
	id := os.Getenv(pluginEnv)
	if id == "" {
		return
	}
	if err := builtin.Serve(id); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(0)
}

// PluginDir returns a directory of keel-output-<id> wrappers, one per
// built-in plugin, each exec'ing this test binary as that plugin (so the pid
// go-plugin reports is the plugin's own). It is the same code the
// cmd/keel-output-<id> binaries run.
func PluginDir(t testing.TB) string {
	t.Helper()
	exe, err := os.Executable()
	require.NoError(t, err)
	dir := t.TempDir()
	for _, id := range builtin.IDs() {
		script := fmt.Sprintf("#!/bin/sh\n%s=%s exec %q \"$@\"\n", pluginEnv, id, exe)
		require.NoError(t, os.WriteFile(filepath.Join(dir, rules.BinaryPrefix+id), []byte(script), 0o755))
	}
	return dir
}

// StartKafka starts a one-broker kfake cluster on loopback with topics
// seeded (partitions each) and returns its address.
func StartKafka(t testing.TB, partitions int32, topics ...string) string {
	t.Helper()
	return StartKafkaCluster(t, partitions, topics...).ListenAddrs()[0]
}

// StartKafkaCluster is StartKafka returning the cluster, for tests that
// control its answers.
func StartKafkaCluster(t testing.TB, partitions int32, topics ...string) *kfake.Cluster {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, topics...), kfake.AllowAutoTopicCreation())
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return c
}

// ReadKafka reads every partition of topic from the start until want
// messages were read or timeout passes, and returns them sorted by
// (partition, offset).
func ReadKafka(t testing.TB, addr, topic string, partitions, want int, timeout time.Duration) []kafka.Message {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var out []kafka.Message
	for p := range partitions {
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: []string{addr}, Topic: topic, Partition: p, MinBytes: 1, MaxBytes: 10 << 20, MaxWait: 50 * time.Millisecond})
		conn, err := kafka.DialLeader(ctx, "tcp", addr, topic, p)
		require.NoError(t, err)
		last, err := conn.ReadLastOffset()
		require.NoError(t, err)
		_ = conn.Close()
		for off := int64(0); off < last; off++ {
			m, err := r.ReadMessage(ctx)
			require.NoError(t, err, "read %s/%d at %d of %d", topic, p, off, last)
			out = append(out, m)
		}
		_ = r.Close()
	}
	sort.SliceStable(out, func(i, j int) bool {
		if out[i].Partition != out[j].Partition {
			return out[i].Partition < out[j].Partition
		}
		return out[i].Offset < out[j].Offset
	})
	if want >= 0 && len(out) < want {
		t.Logf("read %d of %d messages from %s", len(out), want, topic)
	}
	return out
}

// Message builds a test message with every metadata field set.
func Message(tenant, topic string, seq uint64, payload []byte) *commonv1.Message {
	return &commonv1.Message{
		Id:     &commonv1.MsgID{EdgeId: "edge-1", Incarnation: 7, Seq: seq},
		Tenant: tenant, Topic: topic, Payload: payload, Qos: 1, Retain: seq%5 == 0,
		IngressUnixNano: time.Now().UnixNano(), ClientId: "client-" + topic,
		ContentType: "application/json", ResponseTopic: "reply/" + topic, CorrelationData: []byte{0, 1, byte(seq)},
		UserProperties: []*commonv1.UserProperty{{Key: "region", Value: "eu"}, {Key: "seq", Value: fmt.Sprint(seq)}, {Key: "region", Value: "eu-2"}},
	}
}
