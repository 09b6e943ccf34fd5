// Package outputtest holds test helpers shared by the output service's
// packages: plugin binaries that run the built-in plugins from the test
// binary itself, a kfake Kafka cluster on loopback, and a Kafka reader.
//
// A package whose tests launch plugins calls [MaybeServePlugin] first thing
// in its TestMain. It is imported only from _test.go files.
package outputtest

import (
	"context"
	"errors"
	"fmt"
	"io"
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
//
// It fetches on a plain connection to the partition's leader, one fetch
// at a time, rather than through kafka-go's Reader: a fetch that fails
// (a loaded machine can time one out) is logged and tried again from the
// same offset, and a read that does not finish names the last error seen
// instead of only the context's deadline.
func ReadKafka(t testing.TB, addr, topic string, partitions, want int, timeout time.Duration) []kafka.Message {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var out []kafka.Message
	for p := range partitions {
		msgs, err := readPartition(ctx, t, addr, topic, p)
		require.NoError(t, err, "read %s/%d", topic, p)
		out = append(out, msgs...)
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

// readPartition reads one partition from offset 0 to its end as it was
// when the read began.
func readPartition(ctx context.Context, t testing.TB, addr, topic string, partition int) ([]kafka.Message, error) {
	var (
		out     []kafka.Message
		last    = int64(-1)
		lastErr error
	)
	for attempt := 0; ; attempt++ {
		if attempt > 0 {
			t.Logf("reading %s/%d at %d of %d: %v; trying again", topic, partition, len(out), last, lastErr)
			select {
			case <-ctx.Done():
				return out, fmt.Errorf("at %d of %d: %w (last error: %v)", len(out), last, ctx.Err(), lastErr)
			case <-time.After(100 * time.Millisecond):
			}
		}
		conn, err := kafka.DialLeader(ctx, "tcp", addr, topic, partition)
		if err != nil {
			lastErr = err
			continue
		}
		if last < 0 {
			if last, err = conn.ReadLastOffset(); err != nil {
				_ = conn.Close()
				lastErr = err
				continue
			}
		}
		out, lastErr = fetchUntil(ctx, conn, out, last)
		_ = conn.Close()
		if int64(len(out)) >= last {
			return out, nil
		}
	}
}

// fetchUntil appends the partition's messages from offset len(out) up to
// last, fetch by fetch, and stops at the first error.
func fetchUntil(ctx context.Context, conn *kafka.Conn, out []kafka.Message, last int64) ([]kafka.Message, error) {
	for int64(len(out)) < last {
		if _, err := conn.Seek(int64(len(out)), kafka.SeekAbsolute); err != nil {
			return out, err
		}
		deadline := time.Now().Add(5 * time.Second)
		if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
			deadline = d
		}
		if err := conn.SetReadDeadline(deadline); err != nil {
			return out, err
		}
		from := len(out)
		batch := conn.ReadBatchWith(kafka.ReadBatchConfig{MinBytes: 1, MaxBytes: 10 << 20, MaxWait: 100 * time.Millisecond})
		for int64(len(out)) < last {
			m, err := batch.ReadMessage()
			if err != nil {
				break
			}
			switch {
			case m.Offset < int64(len(out)):
				continue // the head of a record batch that began before the offset asked for
			case m.Offset > int64(len(out)):
				_ = batch.Close()
				return out, fmt.Errorf("fetch at offset %d returned offset %d", len(out), m.Offset)
			}
			out = append(out, m)
		}
		if err := batch.Close(); err != nil && !errors.Is(err, io.EOF) {
			return out, err
		}
		if len(out) == from {
			return out, fmt.Errorf("fetch at offset %d returned nothing", from)
		}
	}
	return out, nil
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
