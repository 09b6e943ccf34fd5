package app

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	client "github.com/keelmq/keel/libs/outputclient"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
	"github.com/keelmq/keel/services/output/internal/outputtest"
	"github.com/keelmq/keel/services/output/internal/pipeline"
	"github.com/keelmq/keel/services/output/internal/sink/kafkasink"
)

const benchPayload = 256

// BenchmarkOutput_Kafka measures messages/s into Kafka (kfake on loopback)
// with 256 B payloads over 16 MQTT topics, through one output instance (edge
// client → Connect Publish → pipeline → Kafka sink plugin, acks=all, batches
// of up to 5000) and, for the ratio, with kafka-go producing the same records
// directly with the same writer settings. The output path reports the
// end-to-end p99 (ingress → Kafka ack) from keel_output_latency_seconds.
//
// It loops over b.N rather than b.Loop because the timed region must include
// waiting for the last record's Kafka ack.
//
//	go test -run '^$' -bench BenchmarkOutput_Kafka -benchtime 200000x ./services/output/internal/app
func BenchmarkOutput_Kafka(b *testing.B) {
	payload := make([]byte, benchPayload)
	for i := range payload {
		payload[i] = byte('a' + i%26)
	}
	topics := make([]string, 16)
	for i := range topics {
		topics[i] = fmt.Sprintf("sensors/%02d/data", i)
	}

	// The output path's rate of the last run, for the ratio reported by the
	// direct path that runs after it (b.N above 1 only: a probe run of one
	// message measures nothing).
	var outputRate, mqttRate float64
	output := func(b *testing.B, rate int) {
		addr := outputtest.StartKafka(b, 16, kafkaTopic)
		h := startOutput(b, benchRules(addr))
		const queue = 100000
		c, _ := newClient(b, h, func(c *client.Config) { c.QueueRecords = queue; c.QueueBytes = 1 << 30; c.MaxBatch = 1024 })
		reg := h.out.Registry()
		pids := h.out.Host().PluginPIDs("acme/bench")
		cpu0 := cpuTime(b, append([]int{os.Getpid()}, pids...)...)
		b.ReportAllocs()
		b.SetBytes(benchPayload)
		b.ResetTimer()
		start := time.Now()
		for i := 0; i < b.N; i++ {
			if rate > 0 && i%100 == 0 {
				if d := time.Duration(float64(i)/float64(rate)*float64(time.Second)) - time.Since(start); d > 0 {
					time.Sleep(d)
				}
			}
			for c.QueueLen() > queue-2048 {
				time.Sleep(20 * time.Microsecond)
			}
			m := &commonv1.Message{
				Id:     &commonv1.MsgID{EdgeId: "edge-1", Incarnation: 1, Seq: uint64(i + 1)},
				Tenant: "acme", Topic: topics[i%len(topics)], Payload: payload, Qos: 1,
				ClientId: "bench", IngressUnixNano: time.Now().UnixNano(),
			}
			if !c.OfferMessage(m) {
				b.Fatal("queue full")
			}
		}
		waitWritten(b, h.out.Host(), reg, b.N)
		elapsed := time.Since(start)
		b.StopTimer()
		b.ReportMetric(float64(cpuTime(b, append([]int{os.Getpid()}, pids...)...)-cpu0)/1e3/float64(b.N), "cpu-us/msg")
		b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
		if rate == 0 && b.N > 1 {
			outputRate = float64(b.N) / elapsed.Seconds()
		}
		b.ReportMetric(histQuantile(b, reg, "keel_output_latency_seconds", 0.99)*1e3, "p99-ms")
		b.ReportMetric(histQuantile(b, reg, "keel_output_latency_seconds", 0.50)*1e3, "p50-ms")
		if writes := metric(b, reg, "keel_output_sink_write_seconds", nil); writes > 0 {
			b.ReportMetric(float64(b.N)/writes, "recs/write")
			b.ReportMetric(histSum(b, reg, "keel_output_sink_write_seconds")/writes*1e3, "ms/write")
		}
		require.Zero(b, metric(b, reg, "keel_output_dropped_total", nil))
	}
	b.Run("path=output", func(b *testing.B) { output(b, 0) })
	b.Run("path=output,rate=50000", func(b *testing.B) { output(b, 50000) })

	// From MQTT: QoS 1 publishers on a real keel-edge process, whose output
	// client sends to the same output service setup (toOutput), or sends it
	// nothing. The edge, the
	// publishers, the output service, its plugin and the broker share the
	// machine's cores.
	fromMQTT := func(b *testing.B, toOutput bool) {
		addr := outputtest.StartKafka(b, 16, kafkaTopic)
		rules := benchRules(addr)
		if !toOutput {
			rules = strings.Replace(rules, "sensors/#", "elsewhere/#", 1)
		}
		h := startOutput(b, rules)
		e := startEdge(b, h, "--output.queue-records", "1000000", "--output.queue-bytes", "1073741824", "--mqtt.sys-interval", "0")
		const publishers, window = 4, 500
		clients := make([]mqtt.Client, publishers)
		for i := range clients {
			clients[i] = mqtt.NewClient(mqtt.NewClientOptions().AddBroker("tcp://" + e.mqttAddr).
				SetClientID(fmt.Sprintf("bench-%d", i)).SetCleanSession(true).SetWriteTimeout(10 * time.Second))
			tok := clients[i].Connect()
			require.True(b, tok.WaitTimeout(10*time.Second))
			require.NoError(b, tok.Error())
			b.Cleanup(func() { clients[i].Disconnect(100) })
		}
		reg := h.out.Registry()
		pids := append([]int{os.Getpid(), e.pid}, h.out.Host().PluginPIDs("acme/bench")...)
		cpu0 := cpuTime(b, pids...)
		b.SetBytes(benchPayload)
		b.ResetTimer()
		start := time.Now()
		var g errgroup.Group
		for i, c := range clients {
			n := b.N / publishers
			if i < b.N%publishers {
				n++
			}
			g.Go(func() error {
				toks := make([]mqtt.Token, 0, window)
				for j := range n {
					if len(toks) == window {
						for _, tok := range toks {
							if !tok.WaitTimeout(30 * time.Second) {
								return errors.New("PUBACK overdue")
							}
							if err := tok.Error(); err != nil {
								return err
							}
						}
						toks = toks[:0]
					}
					toks = append(toks, c.Publish(topics[(j*publishers+i)%len(topics)], 1, false, payload))
				}
				for _, tok := range toks {
					tok.WaitTimeout(30 * time.Second)
				}
				return nil
			})
		}
		require.NoError(b, g.Wait())
		if !toOutput {
			elapsed := time.Since(start)
			b.StopTimer()
			b.ReportMetric(float64(cpuTime(b, pids...)-cpu0)/1e3/float64(b.N), "cpu-us/msg")
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
			require.Equal(b, float64(b.N), e.metric(b, "keel_edge_output_skipped_total", nil))
			return
		}
		waitWritten(b, h.out.Host(), reg, b.N)
		elapsed := time.Since(start)
		b.StopTimer()
		b.ReportMetric(float64(cpuTime(b, pids...)-cpu0)/1e3/float64(b.N), "cpu-us/msg")
		b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
		if b.N > 1 {
			mqttRate = float64(b.N) / elapsed.Seconds()
		}
		b.ReportMetric(histQuantile(b, reg, "keel_output_latency_seconds", 0.99)*1e3, "p99-ms")
		b.ReportMetric(histQuantile(b, reg, "keel_output_latency_seconds", 0.50)*1e3, "p50-ms")
		require.Zero(b, e.metric(b, "keel_edge_output_dropped_total", nil), "the edge dropped messages for the output")
		require.Zero(b, metric(b, reg, "keel_output_dropped_total", nil))
	}
	b.Run("path=mqtt", func(b *testing.B) { fromMQTT(b, true) })
	// The MQTT side alone: the same publishers and edge, no rule matching,
	// so nothing goes to the output service. Its rate bounds path=mqtt.
	b.Run("path=mqtt,rules=none", func(b *testing.B) { fromMQTT(b, false) })

	b.Run("path=direct", func(b *testing.B) {
		addr := outputtest.StartKafka(b, 16, kafkaTopic)
		w := &kafka.Writer{
			Addr: kafka.TCP(addr), Topic: kafkaTopic, Balancer: &kafka.Hash{}, RequiredAcks: kafka.RequireAll,
			BatchSize: 5000, BatchBytes: 4 << 20, BatchTimeout: time.Millisecond, MaxAttempts: 5,
		}
		b.Cleanup(func() { _ = w.Close() })
		cpu0 := cpuTime(b, os.Getpid())
		b.ReportAllocs()
		b.SetBytes(benchPayload)
		b.ResetTimer()
		start := time.Now()
		batch := make([]kafka.Message, 0, 5000)
		flush := func() {
			if err := w.WriteMessages(context.Background(), batch...); err != nil {
				b.Fatal(err)
			}
			batch = batch[:0]
		}
		// The same records the output path produces (sink headers included),
		// encoded by the Kafka sink's own conversion.
		for i := 0; i < b.N; i++ {
			rec := &pluginv1.Record{Message: &commonv1.Message{
				Id:     &commonv1.MsgID{EdgeId: "edge-1", Incarnation: 1, Seq: uint64(i + 1)},
				Tenant: "acme", Topic: topics[i%len(topics)], Payload: payload, Qos: 1,
				ClientId: "bench", IngressUnixNano: time.Now().UnixNano(),
			}}
			batch = append(batch, kafkasink.Messages([]*pluginv1.Record{rec}, "", "topic")...)
			if len(batch) == cap(batch) {
				flush()
			}
		}
		if len(batch) > 0 {
			flush()
		}
		elapsed := time.Since(start)
		b.StopTimer()
		b.ReportMetric(float64(cpuTime(b, os.Getpid())-cpu0)/1e3/float64(b.N), "cpu-us/msg")
		b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
		if outputRate > 0 && b.N > 1 {
			// The figure: the output path's rate over kafka-go's,
			// from the pair run one after the other.
			b.ReportMetric(outputRate/(float64(b.N)/elapsed.Seconds()), "output/direct")
			outputRate = 0
		}
		if mqttRate > 0 && b.N > 1 {
			b.ReportMetric(mqttRate/(float64(b.N)/elapsed.Seconds()), "mqtt/direct")
			mqttRate = 0
		}
	})
}

// benchRules is one rule writing every sensors/# message to Kafka at addr.
func benchRules(addr string) string {
	return fmt.Sprintf(`
tenants:
  acme:
    rules:
      - name: bench
        filters: ["sensors/#"]
        sink:
          plugin: kafka
          config: {brokers: [%q], topic: %s, linger: 1ms, batch_size: 5000}
        buffer: {records: 200000, bytes: 268435456}
        max_batch: 5000
`, addr, kafkaTopic)
}

// waitWritten waits until n records were written. It polls the pipelines'
// counters (cheap) rather than gathering the registry, whose process
// collector reads /proc and would take CPU from the path being measured.
func waitWritten(b *testing.B, host *pipeline.Host, reg prometheus.Gatherer, n int) {
	b.Helper()
	deadline := time.Now().Add(5 * time.Minute)
	written := func() (w uint64) {
		for _, st := range host.Status() {
			w += st.GetWrittenRecords()
		}
		return w
	}
	for written() < uint64(n) {
		if time.Now().After(deadline) {
			b.Fatalf("only %v of %d written", metric(b, reg, "keel_output_records_out_total", nil), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// cpuTime returns the user+sys CPU time the processes pids have used, from
// /proc/<pid>/stat (clock ticks, taken as 100 Hz), in nanoseconds.
func cpuTime(b *testing.B, pids ...int) time.Duration {
	b.Helper()
	var total time.Duration
	for _, pid := range pids {
		raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			b.Skipf("cpu time: %v", err)
		}
		// Fields after the parenthesised command name: state is field 3,
		// utime and stime are fields 14 and 15.
		f := strings.Fields(string(raw[bytes.LastIndexByte(raw, ')')+1:]))
		for _, i := range []int{14 - 3, 15 - 3} {
			v, err := strconv.ParseInt(f[i], 10, 64)
			require.NoError(b, err)
			total += time.Duration(v) * 10 * time.Millisecond
		}
	}
	return total
}

// histSum returns the sum of the samples of histogram family name.
func histSum(t testing.TB, g prometheus.Gatherer, name string) float64 {
	t.Helper()
	fams, err := g.Gather()
	require.NoError(t, err)
	var sum float64
	for _, f := range fams {
		if f.GetName() == name {
			for _, m := range f.GetMetric() {
				sum += m.GetHistogram().GetSampleSum()
			}
		}
	}
	return sum
}

// histQuantile interpolates quantile q linearly inside the histogram bucket
// that holds it.
func histQuantile(t testing.TB, g prometheus.Gatherer, name string, q float64) float64 {
	t.Helper()
	fams, err := g.Gather()
	require.NoError(t, err)
	type bkt struct {
		ub  float64
		cum uint64
	}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		cum := map[float64]uint64{}
		var total uint64
		for _, m := range f.GetMetric() {
			total += m.GetHistogram().GetSampleCount()
			for _, bk := range m.GetHistogram().GetBucket() {
				cum[bk.GetUpperBound()] += bk.GetCumulativeCount()
			}
		}
		var bs []bkt
		for ub, c := range cum {
			bs = append(bs, bkt{ub, c})
		}
		sort.Slice(bs, func(i, j int) bool { return bs[i].ub < bs[j].ub })
		rank := q * float64(total)
		lo, prev := 0.0, uint64(0)
		for _, bk := range bs {
			if float64(bk.cum) >= rank {
				if bk.cum == prev {
					return bk.ub
				}
				return lo + (bk.ub-lo)*(rank-float64(prev))/float64(bk.cum-prev)
			}
			lo, prev = bk.ub, bk.cum
		}
		return math.Inf(1)
	}
	return 0
}
