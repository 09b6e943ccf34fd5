package app

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"

	client "github.com/keelmq/keel/libs/outputclient"
	"github.com/keelmq/keel/libs/testutil"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	"github.com/keelmq/keel/services/output/internal/meta"
	"github.com/keelmq/keel/services/output/internal/outputtest"
)

const kafkaTopic = "mqtt-out"

func kafkaRules(addr, extra string) string {
	return fmt.Sprintf(`
tenants:
  acme:
    rules:
      - name: to-kafka
        filters: ["sensors/#"]
        sink:
          plugin: kafka
          config: {brokers: [%q], topic: %s, linger: 1ms, max_attempts: 2, write_timeout: 2s}
        buffer: {records: 100000}
        max_batch: 500
%s`, addr, kafkaTopic, extra)
}

// wantHeaders is what the Kafka sink must attach to m, in order.
func wantHeaders(m *commonv1.Message) []kafka.Header {
	hs := []kafka.Header{
		{Key: meta.HeaderTenant, Value: []byte(m.GetTenant())},
		{Key: meta.HeaderTopic, Value: []byte(m.GetTopic())},
		{Key: meta.HeaderClientID, Value: []byte(m.GetClientId())},
		{Key: meta.HeaderMsgID, Value: []byte(meta.MsgID(m.GetId()))},
		{Key: meta.HeaderQoS, Value: []byte(strconv.Itoa(int(m.GetQos())))},
		{Key: meta.HeaderRetain, Value: []byte(strconv.FormatBool(m.GetRetain()))},
		{Key: meta.HeaderIngress, Value: []byte(strconv.FormatInt(m.GetIngressUnixNano(), 10))},
		{Key: meta.HeaderContentType, Value: []byte(m.GetContentType())},
		{Key: meta.HeaderResponseTopic, Value: []byte(m.GetResponseTopic())},
		{Key: meta.HeaderCorrelationData, Value: m.GetCorrelationData()},
	}
	for _, up := range m.GetUserProperties() {
		hs = append(hs, kafka.Header{Key: meta.UserPropertyHeader(up.GetKey()), Value: []byte(up.GetValue())})
	}
	return hs
}

func header(hs []kafka.Header, key string) string {
	for _, h := range hs {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// TestOutput_Kafka_EndToEnd streams messages on three MQTT topics of tenant
// acme through the Connect API (edge-side client) into the Kafka sink plugin
// and a kfake broker, plus messages of another tenant that no rule matches,
// which the client leaves out once it has the rules' filters. It reads the
// topic back with kafka-go and with kcat and checks payloads, keys, headers,
// tenant isolation and exact per-topic order.
func TestOutput_Kafka_EndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	t.Parallel()
	addr := outputtest.StartKafka(t, 4, kafkaTopic)
	h := startOutput(t, kafkaRules(addr, ""))
	c, creg := newClient(t, h, nil)
	waitFilters(t, c, h)

	topics := []string{"sensors/a/temp", "sensors/b/temp", "sensors/c"}
	const perTopic = 100
	sent := map[string]*commonv1.Message{}
	seq := uint64(0)
	for i := range perTopic {
		for _, tp := range topics {
			seq++
			m := outputtest.Message("acme", tp, seq, fmt.Appendf(nil, `{"i":%d,"topic":%q}`, i, tp))
			sent[meta.MsgID(m.GetId())] = m
			require.True(t, c.OfferMessage(m))
			// Another tenant, same topic: matches no rule, must not appear.
			require.True(t, c.OfferMessage(outputtest.Message("beta", tp, 100000+seq, []byte("beta"))))
		}
	}
	total := perTopic * len(topics)
	testutil.Eventually(t, 20*time.Second, func() error {
		if w := metric(t, h.out.Registry(), "keel_output_records_out_total", nil); int(w) < total {
			return fmt.Errorf("written %v of %d", w, total)
		}
		return nil
	})
	require.Zero(t, metric(t, h.out.Registry(), "keel_output_unmatched_total", nil), "the edge sent a message no rule matches")
	require.Equal(t, float64(total), metric(t, creg, "keel_edge_output_skipped_total", nil))

	msgs := outputtest.ReadKafka(t, addr, kafkaTopic, 4, total, 30*time.Second)
	require.Len(t, msgs, total)
	lastSeq := map[string]uint64{}
	partOf := map[string]int{}
	for _, km := range msgs {
		id := header(km.Headers, meta.HeaderMsgID)
		m := sent[id]
		require.NotNil(t, m, "unexpected record %s (tenant %s)", id, header(km.Headers, meta.HeaderTenant))
		require.Equal(t, m.GetPayload(), km.Value)
		require.Equal(t, m.GetTopic(), string(km.Key), "key = MQTT topic")
		require.Equal(t, wantHeaders(m), km.Headers)
		// Per-topic order: one partition per MQTT topic, seq increasing.
		if p, ok := partOf[m.GetTopic()]; ok {
			require.Equal(t, p, km.Partition, "topic %s spread over partitions", m.GetTopic())
		}
		partOf[m.GetTopic()] = km.Partition
		require.Greater(t, m.GetId().GetSeq(), lastSeq[m.GetTopic()], "order of %s", m.GetTopic())
		lastSeq[m.GetTopic()] = m.GetId().GetSeq()
	}

	t.Run("kcat", func(t *testing.T) { requireKcatAgrees(t, addr, msgs) })
}

// requireKcatAgrees reads the topic back with kcat and requires exactly the
// records kafka-go read (msgs, sorted by partition and offset): partitions,
// offsets, keys, payloads and headers.
func requireKcatAgrees(t *testing.T, addr string, msgs []kafka.Message) {
	t.Helper()
	kcat, err := exec.LookPath("kcat")
	if err != nil {
		t.Skip("kcat not installed (Debian package kcat); skipping the kcat read-back")
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, kcat, "-b", addr, "-C", "-t", kafkaTopic, "-o", "beginning", "-e", "-q", "-J").Output()
	require.NoError(t, err)
	type env struct {
		Partition int      `json:"partition"`
		Offset    int64    `json:"offset"`
		Key       string   `json:"key"`
		Payload   string   `json:"payload"`
		Headers   []string `json:"headers"`
	}
	var got []env
	for line := range bytes.SplitSeq(bytes.TrimSpace(out), []byte("\n")) {
		var e env
		require.NoError(t, json.Unmarshal(line, &e), "kcat line %s", line)
		got = append(got, e)
	}
	require.Len(t, got, len(msgs))
	slices.SortFunc(got, func(a, b env) int {
		if a.Partition != b.Partition {
			return a.Partition - b.Partition
		}
		return int(a.Offset - b.Offset)
	})
	for i, e := range got {
		km := msgs[i]
		require.Equal(t, km.Partition, e.Partition)
		require.Equal(t, km.Offset, e.Offset)
		require.Equal(t, string(km.Key), e.Key)
		require.Equal(t, string(km.Value), e.Payload)
		// kcat prints headers as a flat [k, v, k, v] list of JSON strings,
		// so a value that is not UTF-8 (binary correlation data) cannot be
		// read back exactly from it; every other value must match.
		require.Len(t, e.Headers, 2*len(km.Headers))
		for j, hd := range km.Headers {
			require.Equal(t, hd.Key, e.Headers[2*j])
			if utf8.Valid(hd.Value) {
				require.Equal(t, string(hd.Value), e.Headers[2*j+1], "header %s", hd.Key)
			}
		}
	}
}

// TestOutput_Kafka_PluginKilled kill -9s the Kafka sink plugin while a
// stream of messages flows and checks that the host restarts it and that no
// message is lost (the batch in flight is sent again: duplicates allowed).
func TestOutput_Kafka_PluginKilled(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	t.Parallel()
	testPluginFault(t, syscall.SIGKILL, "")
}

// TestOutput_Kafka_TransformKilled kill -9s a transform plugin in front of
// the Kafka sink mid-stream: the host restarts it and nothing is lost.
func TestOutput_Kafka_TransformKilled(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	t.Parallel()
	testPluginFault(t, syscall.SIGKILL, `        transforms:
          - plugin: filter
            config: {user_properties: [{key: region}]}
`)
}

// TestOutput_Kafka_PluginHung stops the sink plugin with SIGSTOP (a hung
// plugin: its Write never returns) and checks that the host kills it after
// the rule's write_timeout, restarts it, and delivers everything.
func TestOutput_Kafka_PluginHung(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	t.Parallel()
	testPluginFault(t, syscall.SIGSTOP, "        write_timeout: 1s\n")
}

// testPluginFault sends sig to the rule's first plugin process (its first
// transform, or the sink when it has none) a third of the way into a stream.
func testPluginFault(t *testing.T, sig syscall.Signal, extra string) {
	addr := outputtest.StartKafka(t, 4, kafkaTopic)
	h := startOutput(t, kafkaRules(addr, "")+extra)
	c, _ := newClient(t, h, func(c *client.Config) { c.QueueRecords = 100000 })
	const n = 3000
	const rule = "acme/to-kafka"
	pids := h.out.Host().PluginPIDs(rule)
	require.Len(t, pids, 1+strings.Count(extra, "- plugin:"))
	victim := pids[0]
	require.NotZero(t, victim)

	sent := make(map[string]bool, n)
	for i := range n {
		m := outputtest.Message("acme", fmt.Sprintf("sensors/%d", i%7), uint64(i+1), fmt.Appendf(nil, "m%d", i))
		sent[meta.MsgID(m.GetId())] = true
		require.True(t, c.OfferMessage(m))
		if i == n/3 {
			require.NoError(t, syscall.Kill(victim, sig))
		}
		if i%100 == 0 {
			time.Sleep(5 * time.Millisecond)
		}
	}
	testutil.Eventually(t, 30*time.Second, func() error {
		if r := metric(t, h.out.Registry(), "keel_output_plugin_restarts_total", map[string]string{"rule": rule}); r < 1 {
			return fmt.Errorf("restarts %v", r)
		}
		st := h.out.Host().Status()[0]
		if st.GetWrittenRecords() < n {
			return fmt.Errorf("written %d of %d (buffered %d)", st.GetWrittenRecords(), n, st.GetBufferedRecords())
		}
		return nil
	})
	newPid := h.out.Host().PluginPIDs(rule)[0]
	require.NotEqual(t, victim, newPid, "plugin restarted under a new pid")

	msgs := outputtest.ReadKafka(t, addr, kafkaTopic, 4, n, 30*time.Second)
	got := map[string]int{}
	for _, km := range msgs {
		got[header(km.Headers, meta.HeaderMsgID)]++
	}
	var missing []string
	for id := range sent {
		if got[id] == 0 {
			missing = append(missing, id)
		}
	}
	require.Empty(t, missing, "lost messages")
	t.Logf("signal %v: %d records in Kafka for %d messages (%d duplicates), restarts %v", sig, len(msgs), n, len(msgs)-n,
		metric(t, h.out.Registry(), "keel_output_plugin_restarts_total", nil))
	require.Zero(t, metric(t, h.out.Registry(), "keel_output_dropped_total", nil))
	require.Zero(t, metric(t, h.out.Registry(), "keel_output_filtered_total", nil))
}

// TestOutput_Kafka_OrderWhileProducesFail: the sink takes two batches at
// once, and Kafka refuses runs of produce requests (more than the sink's
// attempts, so the host retries): every message arrives, and per MQTT
// topic the first copies come in publish order, since no batch is written
// ahead of one still to be retried.
func TestOutput_Kafka_OrderWhileProducesFail(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	t.Parallel()
	cl := outputtest.StartKafkaCluster(t, 4, kafkaTopic)
	var produces, refused atomic.Int64
	cl.ControlKey(int16(kmsg.Produce), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		cl.KeepControl()
		if produces.Add(1)%16 >= 4 {
			return nil, nil, false
		}
		req := kreq.(*kmsg.ProduceRequest)
		resp := req.ResponseKind().(*kmsg.ProduceResponse)
		for _, tp := range req.Topics {
			rt := kmsg.NewProduceResponseTopic()
			rt.Topic = tp.Topic
			for _, p := range tp.Partitions {
				rp := kmsg.NewProduceResponseTopicPartition()
				rp.Partition = p.Partition
				rp.ErrorCode = kerr.NotEnoughReplicas.Code
				rt.Partitions = append(rt.Partitions, rp)
			}
			resp.Topics = append(resp.Topics, rt)
		}
		refused.Add(1)
		return resp, nil, true
	})
	addr := cl.ListenAddrs()[0]
	h := startOutput(t, kafkaRules(addr, ""))
	c, _ := newClient(t, h, func(c *client.Config) { c.QueueRecords = 100000 })
	waitFilters(t, c, h)

	const n = 3000
	topicOf := func(i int) string { return fmt.Sprintf("sensors/%d", i%7) }
	for i := range n {
		require.True(t, c.OfferMessage(outputtest.Message("acme", topicOf(i), uint64(i+1), fmt.Appendf(nil, "m%d", i))))
		if i%50 == 0 {
			time.Sleep(2 * time.Millisecond) // many batches, so that two are in flight
		}
	}
	testutil.Eventually(t, 60*time.Second, func() error {
		if w := h.out.Host().Status()[0].GetWrittenRecords(); w < n {
			return fmt.Errorf("written %d of %d", w, n)
		}
		return nil
	})
	require.Positive(t, metric(t, h.out.Registry(), "keel_output_retries_total", nil), "the host retried batches")

	msgs := outputtest.ReadKafka(t, addr, kafkaTopic, 4, n, 30*time.Second)
	seen := map[uint64]bool{}
	last := map[string]uint64{}
	for _, km := range msgs {
		var seq uint64
		_, err := fmt.Sscanf(string(km.Value), "m%d", &seq)
		require.NoError(t, err)
		seq++
		if seen[seq] {
			continue // a copy sent again
		}
		seen[seq] = true
		tp := topicOf(int(seq - 1))
		require.Greater(t, seq, last[tp], "order of %s", tp)
		last[tp] = seq
	}
	require.Len(t, seen, n, "every message arrived")
	t.Logf("%d produce requests refused; %d records in Kafka for %d messages; %v host retries", refused.Load(), len(msgs), n,
		metric(t, h.out.Registry(), "keel_output_retries_total", nil))
	require.Zero(t, metric(t, h.out.Registry(), "keel_output_dropped_total", nil))
}
