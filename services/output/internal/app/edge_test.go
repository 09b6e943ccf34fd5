package app

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
	"github.com/eclipse/paho.golang/paho"
	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	client "github.com/keelmq/keel/libs/outputclient"
	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/output/internal/meta"
	"github.com/keelmq/keel/services/output/internal/outputtest"
)

// edgeBuild is the keel-edge binary, built once for every test that runs
// one; TestMain removes its directory.
var edgeBuild struct {
	once      sync.Once
	dir, path string
}

func keelEdgeBinary(t testing.TB) string {
	t.Helper()
	edgeBuild.once.Do(func() {
		dir, err := os.MkdirTemp("", "keel-edge-")
		require.NoError(t, err)
		edgeBuild.dir = dir
		edgeBuild.path = testutil.Build(t, dir, "./services/edge/cmd/keel-edge")
	})
	require.NotEmpty(t, edgeBuild.path, "keel-edge was not built (see the first test that needed it)")
	return edgeBuild.path
}

// edgeProcess is a keel-edge process of tenant acme (anonymous) sending to
// an output service.
type edgeProcess struct {
	mqttAddr, opsAddr string
	pid               int
}

// startEdge runs keel-edge against h with extra flags and returns once its
// output stream has the rules' filters. It is stopped at cleanup.
func startEdge(t testing.TB, h *harness, args ...string) *edgeProcess {
	t.Helper()
	e := &edgeProcess{mqttAddr: testutil.FreeAddr(t), opsAddr: testutil.FreeAddr(t)}
	cmd := exec.Command(keelEdgeBinary(t), append([]string{"--auth.anonymous", "--auth.anonymous-tenant", "acme",
		"--mqtt.tcp-addr", e.mqttAddr, "--mqtt.ws-addr", "", "--ops.addr", e.opsAddr, "--data-dir", t.TempDir(),
		"--output.url", h.url, "--log.level", "warn"}, args...)...)
	var logs strings.Builder
	cmd.Stdout, cmd.Stderr = &logs, &logs
	require.NoError(t, cmd.Start())
	e.pid = cmd.Process.Pid
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("edge logs:\n%s", logs.String())
		}
	})
	testutil.Eventually(t, 20*time.Second, func() error {
		c, err := net.Dial("tcp", e.opsAddr)
		if err == nil {
			_ = c.Close()
		}
		return err
	})
	testutil.Eventually(t, 20*time.Second, func() error {
		if v := e.metric(t, "keel_edge_output_filters_version", nil); v != float64(h.out.Host().Filters().Proto.GetVersion()) {
			return fmt.Errorf("edge filters version %v", v)
		}
		return nil
	})
	return e
}

// metric sums the edge's samples of name whose labels include labels.
func (e *edgeProcess) metric(t testing.TB, name string, labels map[string]string) float64 {
	t.Helper()
	return testutil.MetricSum(t, e.opsAddr, name, labels)
}

// connectV5 connects an MQTT 5 client to the edge.
func connectV5(t *testing.T, addr, clientID string) *paho.Client {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	require.NoError(t, err)
	c := paho.NewClient(paho.ClientConfig{Conn: packets.NewThreadSafeConn(conn)})
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	ca, err := c.Connect(ctx, &paho.Connect{ClientID: clientID, CleanStart: true, KeepAlive: 30})
	require.NoError(t, err)
	require.Zero(t, ca.ReasonCode)
	t.Cleanup(func() { _ = c.Disconnect(&paho.Disconnect{}) })
	return c
}

// TestOutput_FromEdge_MQTT5ToKafka is the whole path with MQTT 5 metadata:
// an MQTT 5 client publishes to a real keel-edge process, which sends the
// messages a rule matches to this output service, whose Kafka plugin writes
// them to a kfake broker; kafka-go and kcat read them back. Payloads, keys,
// every header (user properties included, a forged "keel-tenant" among
// them) and per-topic order are exact. Messages no rule matches stay on the
// edge (keel_edge_output_skipped_total) and never reach the output service.
func TestOutput_FromEdge_MQTT5ToKafka(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	t.Parallel()
	addr := outputtest.StartKafka(t, 4, kafkaTopic)
	h := startOutput(t, kafkaRules(addr, ""))
	e := startEdge(t, h)
	pub := connectV5(t, e.mqttAddr, "pub5")

	props := func(topic string, i int) *paho.PublishProperties {
		return &paho.PublishProperties{
			ContentType:     "application/json",
			ResponseTopic:   topic + "/reply",
			CorrelationData: []byte{0x00, 0xff, byte(i)},
			PayloadFormat:   new(byte(1)),
			User: paho.UserProperties{
				{Key: "site", Value: "lyon"},
				{Key: "i", Value: strconv.Itoa(i)},
				{Key: "site", Value: "ñ✓ 漢字"},
				{Key: meta.HeaderTenant, Value: "forged"},
			},
		}
	}
	topics := []string{"sensors/a/temp", "sensors/b/temp", "sensors/c"}
	const perTopic, other = 40, 20
	publish := func(topic string, i int) {
		t.Helper()
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		_, err := pub.Publish(ctx, &paho.Publish{QoS: 1, Topic: topic, Payload: fmt.Appendf(nil, `{"i":%d}`, i), Properties: props(topic, i)})
		require.NoError(t, err)
	}
	for i := range perTopic {
		for _, tp := range topics {
			publish(tp, i)
		}
		if i < other {
			publish("other/x", i)
		}
	}
	total := perTopic * len(topics)
	testutil.Eventually(t, 20*time.Second, func() error {
		if w := metric(t, h.out.Registry(), "keel_output_records_out_total", nil); int(w) < total {
			return fmt.Errorf("written %v of %d", w, total)
		}
		return nil
	})
	require.Equal(t, float64(other), e.metric(t, "keel_edge_output_skipped_total", nil))
	require.Equal(t, float64(total), e.metric(t, "keel_edge_output_sent_total", nil))
	require.Zero(t, metric(t, h.out.Registry(), "keel_output_unmatched_total", nil))

	msgs := outputtest.ReadKafka(t, addr, kafkaTopic, 4, total, 30*time.Second)
	require.Len(t, msgs, total)
	next := map[string]int{}
	partOf := map[string]int{}
	ids := map[string]bool{}
	for _, km := range msgs {
		topic := string(km.Key)
		i := next[topic]
		next[topic]++
		require.Equal(t, fmt.Sprintf(`{"i":%d}`, i), string(km.Value), "order and payload of %s", topic)
		if p, ok := partOf[topic]; ok {
			require.Equal(t, p, km.Partition, "topic %s spread over partitions", topic)
		}
		partOf[topic] = km.Partition
		id, ingress := header(km.Headers, meta.HeaderMsgID), header(km.Headers, meta.HeaderIngress)
		require.Regexp(t, `^[^:]+:[0-9]+:[0-9]+$`, id)
		require.False(t, ids[id], "msgID %s twice", id)
		ids[id] = true
		_, err := strconv.ParseInt(ingress, 10, 64)
		require.NoError(t, err, "ingress %q", ingress)
		p := props(topic, i)
		want := []kafka.Header{
			{Key: meta.HeaderTenant, Value: []byte("acme")},
			{Key: meta.HeaderTopic, Value: []byte(topic)},
			{Key: meta.HeaderClientID, Value: []byte("pub5")},
			{Key: meta.HeaderMsgID, Value: []byte(id)},
			{Key: meta.HeaderQoS, Value: []byte("1")},
			{Key: meta.HeaderRetain, Value: []byte("false")},
			{Key: meta.HeaderIngress, Value: []byte(ingress)},
			{Key: meta.HeaderContentType, Value: []byte(p.ContentType)},
			{Key: meta.HeaderResponseTopic, Value: []byte(p.ResponseTopic)},
			{Key: meta.HeaderCorrelationData, Value: p.CorrelationData},
			{Key: meta.HeaderPayloadFormat, Value: []byte("1")},
		}
		for _, up := range p.User {
			want = append(want, kafka.Header{Key: meta.UserPropertyHeader(up.Key), Value: []byte(up.Value)})
		}
		require.Equal(t, want, km.Headers, "headers of %s #%d", topic, i)
	}
	for _, tp := range topics {
		require.Equal(t, perTopic, next[tp], "records of %s", tp)
	}
	t.Run("kcat", func(t *testing.T) { requireKcatAgrees(t, addr, msgs) })
}

// TestOutput_FromEdge_StalledSinkLeavesMQTTAlone stalls the HTTP sink for
// 10 s while an MQTT client publishes through a real keel-edge to a
// subscriber on the same edge. Publish-to-delivery latency is measured
// before and during the stall and must stay within noise of the baseline
// (a blocked path would add seconds); every message reaches the
// subscriber; and the drop counters account for every message that did not
// reach the sink: delivered to the sink + dropped at the edge's queue +
// refused by the output's full buffer = published.
func TestOutput_FromEdge_StalledSinkLeavesMQTTAlone(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	t.Parallel()
	sink := newHTTPCollector(t)
	// The sink may take a batch twice (a retry); count each message once.
	atSink := func() int {
		ids := map[string]bool{}
		for _, rec := range sink.received() {
			ids[rec.MsgID] = true
		}
		return len(ids)
	}
	h := startOutput(t, fmt.Sprintf(`
tenants:
  acme:
    rules:
      - name: to-http
        filters: ["sensors/#"]
        sink:
          plugin: http
          config: {url: %q, batch: true, max_batch_records: 50, timeout: 60s, max_attempts: 2}
        buffer: {records: 200}
        max_batch: 50
`, sink.url))
	e := startEdge(t, h, "--output.queue-records", "300")

	// Each payload carries its send time; the subscriber notes the latency.
	type sample struct {
		seq     uint64
		latency time.Duration
	}
	var recvMu sync.Mutex
	var received []sample
	sub := mqtt.NewClient(mqtt.NewClientOptions().AddBroker("tcp://" + e.mqttAddr).SetClientID("sub").SetCleanSession(true).
		SetOrderMatters(false).SetDefaultPublishHandler(func(_ mqtt.Client, m mqtt.Message) {
		p := m.Payload()
		lat := time.Since(time.Unix(0, int64(binary.BigEndian.Uint64(p[8:]))))
		recvMu.Lock()
		received = append(received, sample{binary.BigEndian.Uint64(p), lat})
		recvMu.Unlock()
	}))
	require.True(t, sub.Connect().WaitTimeout(10*time.Second))
	t.Cleanup(func() { sub.Disconnect(100) })
	require.True(t, sub.Subscribe("sensors/#", 1, nil).WaitTimeout(10*time.Second))
	pub := mqtt.NewClient(mqtt.NewClientOptions().AddBroker("tcp://" + e.mqttAddr).SetClientID("pub").SetCleanSession(true))
	require.True(t, pub.Connect().WaitTimeout(10*time.Second))
	t.Cleanup(func() { pub.Disconnect(100) })

	// 500 messages/s, QoS 1, acknowledgements awaited in batches so the
	// publisher never runs far ahead of the edge.
	var published uint64
	publishFor := func(d time.Duration) (first, last uint64) {
		first = published + 1
		var toks []mqtt.Token
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		for end := time.Now().Add(d); time.Now().Before(end); <-tick.C {
			published++
			p := make([]byte, 64)
			binary.BigEndian.PutUint64(p, published)
			binary.BigEndian.PutUint64(p[8:], uint64(time.Now().UnixNano()))
			toks = append(toks, pub.Publish(fmt.Sprintf("sensors/%d", published%4), 1, false, p))
			if len(toks) == 50 {
				for _, tok := range toks {
					require.True(t, tok.WaitTimeout(10*time.Second))
					require.NoError(t, tok.Error())
				}
				toks = toks[:0]
			}
		}
		for _, tok := range toks {
			require.True(t, tok.WaitTimeout(10*time.Second))
			require.NoError(t, tok.Error())
		}
		return first, published
	}
	waitReceived := func() {
		t.Helper()
		testutil.Eventually(t, 20*time.Second, func() error {
			recvMu.Lock()
			defer recvMu.Unlock()
			if uint64(len(received)) < published {
				return fmt.Errorf("subscriber has %d of %d", len(received), published)
			}
			return nil
		})
	}
	latencies := func(first, last uint64) []time.Duration {
		recvMu.Lock()
		defer recvMu.Unlock()
		var ls []time.Duration
		for _, s := range received {
			if s.seq >= first && s.seq <= last {
				ls = append(ls, s.latency)
			}
		}
		slices.Sort(ls)
		return ls
	}
	q := func(ls []time.Duration, f float64) time.Duration { return ls[int(float64(len(ls)-1)*f)] }

	publishFor(500 * time.Millisecond) // warm-up
	b0, b1 := publishFor(2 * time.Second)
	waitReceived()
	base := latencies(b0, b1)

	sink.stall()
	stallStart := time.Now()
	s0, s1 := publishFor(10 * time.Second)
	waitReceived()
	during := latencies(s0, s1)
	sink.release()
	t.Logf("publish-to-delivery over MQTT: before the stall p50 %v p99 %v max %v (%d msgs); during the %v stall p50 %v p99 %v max %v (%d msgs)",
		q(base, .5), q(base, .99), base[len(base)-1], len(base), time.Since(stallStart).Round(time.Millisecond),
		q(during, .5), q(during, .99), during[len(during)-1], len(during))
	require.Len(t, during, int(s1-s0+1), "every message published during the stall reached the subscriber")
	// A delivery path blocked by the sink would add up to 10 s (or fail
	// waitReceived); the margin is for a loaded machine's noise.
	require.Less(t, q(during, .99), q(base, .99)+time.Second, "a stalled sink slowed MQTT delivery")

	// Every published message reached the sink or is counted as dropped.
	queueFull := func() float64 {
		return e.metric(t, "keel_edge_output_dropped_total", map[string]string{"reason": client.ReasonQueueFull})
	}
	refused := func() float64 {
		return e.metric(t, "keel_edge_output_dropped_total", map[string]string{"reason": client.ReasonRefused})
	}
	testutil.Eventually(t, 30*time.Second, func() error {
		if got := float64(atSink()) + queueFull() + refused(); got != float64(published) {
			return fmt.Errorf("at the sink %d + dropped at the edge %v + refused %v != published %d", atSink(), queueFull(), refused(), published)
		}
		return nil
	})
	t.Logf("published %d: %d at the sink, %v dropped from the edge's queue, %v refused by the output's buffer", published, atSink(), queueFull(), refused())
	require.Positive(t, queueFull()+refused(), "the stall dropped nothing: the test did not fill the buffers")
	require.Equal(t, refused(), metric(t, h.out.Registry(), "keel_output_dropped_total", map[string]string{"reason": "buffer_full"}))
}

// TestOutput_FromEdge_TransformsToHTTP runs both transform plugins as
// processes between a real keel-edge and the HTTP sink: the filter keeps an
// order only from region eu with a positive JSON total, and json-map
// rewrites what passes into a new document keyed by the customer and sent
// with the topic's second level as its destination.
func TestOutput_FromEdge_TransformsToHTTP(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	t.Parallel()
	sink := newHTTPCollector(t)
	h := startOutput(t, fmt.Sprintf(`
tenants:
  acme:
    rules:
      - name: orders
        filters: ["orders/#"]
        transforms:
          - plugin: filter
            config: {user_properties: [{key: region, value: eu}], json: [{path: total, gt: 0}]}
          - plugin: json-map
            config:
              fields: {id: msg_id, shop: topic_level.1, site: user_properties.site, order.total: payload.total, order.lines: payload.lines}
              key: payload.customer
              destination: topic_level.1
        sink:
          plugin: http
          config: {url: %q, batch: true}
        max_batch: 10
`, sink.url))
	e := startEdge(t, h)
	pub := connectV5(t, e.mqttAddr, "shop-pub")
	publish := func(topic, region, payload string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		_, err := pub.Publish(ctx, &paho.Publish{QoS: 1, Topic: topic, Payload: []byte(payload),
			Properties: &paho.PublishProperties{User: paho.UserProperties{{Key: "region", Value: region}, {Key: "site", Value: "lyon"}}}})
		require.NoError(t, err)
	}
	publish("orders/paris", "us", `{"customer":"c1","total":10,"lines":[1]}`)     // wrong region
	publish("orders/paris", "eu", `{"customer":"c2","total":0,"lines":[]}`)       // total not > 0
	publish("orders/paris", "eu", `not json`)                                     // no total
	publish("orders/paris", "eu", `{"customer":"c3","total":12.5,"lines":[1,2]}`) // kept
	publish("orders/berlin", "eu", `{"customer":"c4","total":3,"lines":[3]}`)     // kept

	testutil.Eventually(t, 20*time.Second, func() error {
		if n := len(sink.received()); n < 2 {
			return fmt.Errorf("the sink got %d of 2 records", n)
		}
		return nil
	})
	// Nothing the filter should have dropped comes after them.
	time.Sleep(500 * time.Millisecond)
	kept := sink.received()
	require.Len(t, kept, 2)
	for i, want := range []struct{ key, shop, total, lines string }{
		{"c3", "paris", "12.5", "[1,2]"},
		{"c4", "berlin", "3", "[3]"},
	} {
		rec := kept[i]
		require.Equal(t, want.shop, rec.Destination)
		require.Equal(t, want.key, string(rec.Key))
		require.Equal(t, "orders/"+want.shop, rec.Topic)
		require.Regexp(t, `^[^:]+:[0-9]+:[0-9]+$`, rec.MsgID)
		require.JSONEq(t, fmt.Sprintf(`{"id":%q,"shop":%q,"site":"lyon","order":{"total":%s,"lines":%s}}`,
			rec.MsgID, want.shop, want.total, want.lines), string(rec.Payload))
	}
	require.Equal(t, 5.0, e.metric(t, "keel_edge_output_sent_total", nil))
	require.Equal(t, 3.0, metric(t, h.out.Registry(), "keel_output_filtered_total", nil))
}
