package app

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	client "github.com/keelmq/keel/libs/outputclient"
	"github.com/keelmq/keel/libs/testutil"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	outputv1 "github.com/keelmq/keel/proto/gen/keel/output/v1"
	"github.com/keelmq/keel/proto/gen/keel/output/v1/outputv1connect"
	"github.com/keelmq/keel/services/output/internal/meta"
	"github.com/keelmq/keel/services/output/internal/outputtest"
	"github.com/keelmq/keel/services/output/internal/sink/httpsink"
)

const hmacSecret = "s3cret"

func httpRules(url, timeout, secret string, buffer int) string {
	return fmt.Sprintf(`
tenants:
  acme:
    rules:
      - name: to-http
        filters: ["sensors/#"]
        transforms:
          - plugin: filter
            config: {user_properties: [{key: region, value: eu}]}
        sink:
          plugin: http
          config: {url: %q, batch: true, max_batch_records: 20, timeout: %s, max_attempts: 2, backoff_min: 10ms, backoff_max: 50ms, hmac_secret: %q}
        buffer: {records: %d}
        max_batch: 20
`, url, timeout, secret, buffer)
}

// TestOutput_HTTP_RetriesSignaturesBatches runs the HTTP sink in batch mode
// against a server that first answers 500, then stalls past the sink's
// timeout, then recovers. Every request must be signed correctly, every
// accepted body must be a well-formed batch, and once the server recovers
// every message must have arrived (duplicates allowed, nothing lost). A
// filter transform in front drops the messages without region=eu.
func TestOutput_HTTP_RetriesSignaturesBatches(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	t.Setenv("TEST_HMAC_SECRET", hmacSecret)
	var (
		mu       sync.Mutex
		requests int
		got      = map[string]httpsink.BatchRecord{}
		badSig   int
		biggest  int          // most records in one body
		phase    atomic.Int32 // 0: 500s, 1: stall, 2: ok
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		requests++
		if !httpsink.Verify([]byte(hmacSecret), r.Header.Get(httpsink.HeaderTimestamp), body, r.Header.Get(httpsink.HeaderSignature)) {
			badSig++
		}
		var sent httpsink.BatchBody
		if json.Unmarshal(body, &sent) == nil {
			biggest = max(biggest, len(sent.Records))
		}
		mu.Unlock()
		switch phase.Load() {
		case 0:
			w.WriteHeader(http.StatusInternalServerError)
			return
		case 1:
			select {
			case <-time.After(2 * time.Second):
			case <-r.Context().Done():
			}
			return
		}
		var b httpsink.BatchBody
		if err := json.Unmarshal(body, &b); err != nil || r.Header.Get("Content-Type") != "application/json" {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		mu.Lock()
		for _, rec := range b.Records {
			got[rec.MsgID] = rec
		}
		mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(srv.Close)

	h := startOutput(t, httpRules(srv.URL, "200ms", "${TEST_HMAC_SECRET}", 10000))
	c, _ := newClient(t, h, nil)
	const n = 200
	want := map[string]*commonv1.Message{}
	for i := range n {
		m := outputtest.Message("acme", fmt.Sprintf("sensors/%d", i%3), uint64(i+1), fmt.Appendf(nil, `{"i":%d}`, i))
		if i%4 == 3 {
			m.UserProperties = m.UserProperties[1:2] // no region: filtered out
		} else {
			want[meta.MsgID(m.GetId())] = m
		}
		require.True(t, c.OfferMessage(m))
	}
	reqs := func() int { mu.Lock(); defer mu.Unlock(); return requests }
	testutil.Eventually(t, 10*time.Second, func() error {
		if r := reqs(); r < 6 {
			return fmt.Errorf("%d requests", r)
		}
		return nil
	})
	phase.Store(1)
	before := reqs()
	testutil.Eventually(t, 10*time.Second, func() error {
		if r := reqs(); r < before+3 {
			return fmt.Errorf("%d stalled requests", r-before)
		}
		return nil
	})
	phase.Store(2)
	testutil.Eventually(t, 20*time.Second, func() error {
		mu.Lock()
		defer mu.Unlock()
		if len(got) < len(want) {
			return fmt.Errorf("received %d of %d", len(got), len(want))
		}
		return nil
	})
	mu.Lock()
	defer mu.Unlock()
	require.Zero(t, badSig, "requests with a bad signature")
	require.LessOrEqual(t, biggest, 20, "a body over max_batch_records")
	for id, rec := range got {
		m := want[id]
		require.NotNil(t, m, "unexpected record %s (filtered?)", id)
		require.Equal(t, "acme", rec.Tenant)
		require.Equal(t, m.GetTopic(), rec.Topic)
		require.Equal(t, m.GetClientId(), rec.ClientID)
		require.Equal(t, uint32(1), rec.QoS)
		require.Equal(t, m.GetRetain(), rec.Retain)
		require.Equal(t, m.GetIngressUnixNano(), rec.IngressUnixNano)
		require.Equal(t, "application/json", rec.ContentType)
		require.Equal(t, m.GetResponseTopic(), rec.ResponseTopic)
		require.Equal(t, m.GetCorrelationData(), rec.CorrelationData)
		require.Equal(t, m.GetPayload(), rec.Payload)
		require.Equal(t, []httpsink.UserProperty{{Key: "region", Value: "eu"}, {Key: "seq", Value: fmt.Sprint(m.GetId().GetSeq())}, {Key: "region", Value: "eu-2"}}, rec.UserProperties)
	}
	reg := h.out.Registry()
	require.Positive(t, metric(t, reg, "keel_output_retries_total", map[string]string{"rule": "acme/to-http"}))
	require.Positive(t, metric(t, reg, "keel_output_errors_total", map[string]string{"rule": "acme/to-http", "stage": "sink"}))
	require.Equal(t, float64(n-len(want)), metric(t, reg, "keel_output_filtered_total", nil))
	require.Zero(t, metric(t, reg, "keel_output_dropped_total", nil))
	t.Logf("%d requests for %d records", requests, len(want))
}

// TestOutput_Isolation_StalledSink stalls the HTTP sink for 10 s while an
// edge keeps publishing. The Publish caller must not notice: the round trip
// of a Publish batch and the edge client's Offer stay fast (measured before
// and during the stall), the pipeline's small buffer fills and the surplus
// is dropped and counted on both sides; after the stall the buffered records
// are delivered.
func TestOutput_Isolation_StalledSink(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	t.Parallel()
	sink := newHTTPCollector(t)
	const buffer = 200
	h := startOutput(t, httpRules(sink.url, "30s", hmacSecret, buffer))

	// A raw Publish stream, to time each batch's acknowledgement.
	api := outputv1connect.NewOutputServiceClient(h2cClient(), h.url)
	st := api.Publish(t.Context())
	seq := uint64(0)
	var dropped uint32
	publish := func(n int) time.Duration {
		req := &outputv1.PublishRequest{BatchId: seq + 1, EdgeId: "edge-raw"}
		for range n {
			seq++
			req.Records = append(req.Records, &outputv1.OutputRecord{Message: outputtest.Message("acme", "sensors/x", seq, []byte(`{"v":1}`))})
		}
		start := time.Now()
		require.NoError(t, st.Send(req))
		for {
			resp, err := st.Receive()
			require.NoError(t, err)
			if resp.GetFilters() != nil {
				continue // not an ack
			}
			require.Equal(t, req.GetBatchId(), resp.GetBatchId())
			dropped += resp.GetDropped()
			return time.Since(start)
		}
	}
	measure := func(d time.Duration) []time.Duration {
		var rtts []time.Duration
		for end := time.Now().Add(d); time.Now().Before(end); {
			rtts = append(rtts, publish(10))
			time.Sleep(5 * time.Millisecond)
		}
		slices.Sort(rtts)
		return rtts
	}
	p99 := func(d []time.Duration) time.Duration { return d[len(d)*99/100] }

	base := measure(time.Second)
	// Delivered before the stall, but for what the acks said was dropped
	// (a loaded machine can fill even the unstalled buffer); the bound is
	// generous for a loaded CI machine (the latencies measured here are
	// what the test is about).
	want := len(base)*10 - int(dropped)
	testutil.Eventually(t, 20*time.Second, func() error {
		if sink.total() < want {
			return fmt.Errorf("delivered %d of %d (%d dropped)", sink.total(), len(base)*10, dropped)
		}
		return nil
	})

	// The edge-side client, offering in parallel; time every Offer.
	c, creg := newClient(t, h, func(c *client.Config) { c.QueueRecords = 500 })
	sink.stall()
	stallStart := time.Now()
	var offerMax atomic.Int64
	stopOffers := make(chan struct{})
	offersDone := make(chan struct{})
	go func() {
		defer close(offersDone)
		for i := 0; ; i++ {
			select {
			case <-stopOffers:
				return
			default:
			}
			m := outputtest.Message("acme", "sensors/y", 1_000_000+uint64(i), []byte(`{"v":2}`))
			s := time.Now()
			c.OfferMessage(m)
			if d := time.Since(s).Nanoseconds(); d > offerMax.Load() {
				offerMax.Store(d)
			}
			if i%10 == 0 {
				time.Sleep(time.Millisecond) // ~10k offers/s
			}
		}
	}()
	during := measure(8 * time.Second)
	close(stopOffers)
	<-offersDone
	for time.Since(stallStart) < 10*time.Second {
		time.Sleep(50 * time.Millisecond)
	}
	sink.release()

	t.Logf("publish ack round trip: before stall p50 %v p99 %v max %v (%d batches); during 10 s stall p50 %v p99 %v max %v (%d batches)",
		base[len(base)/2], p99(base), base[len(base)-1], len(base), during[len(during)/2], p99(during), during[len(during)-1], len(during))
	t.Logf("edge client Offer max %v during the stall; client stats %+v", time.Duration(offerMax.Load()), c.Stats())
	require.Less(t, p99(during), 250*time.Millisecond, "a stalled sink slowed the Publish caller")
	require.Less(t, time.Duration(offerMax.Load()), 50*time.Millisecond, "Offer blocked")

	reg := h.out.Registry()
	outDropped := metric(t, reg, "keel_output_dropped_total", map[string]string{"reason": "buffer_full"})
	require.Positive(t, dropped, "raw stream saw no drops")
	require.Positive(t, outDropped)
	testutil.Eventually(t, 10*time.Second, func() error {
		// Every drop the output counted was reported to some caller.
		edgeRefused := metric(t, creg, "keel_edge_output_dropped_total", map[string]string{"reason": client.ReasonRefused})
		if float64(dropped)+edgeRefused != outDropped {
			return fmt.Errorf("acks reported %v+%v drops, output counted %v", dropped, edgeRefused, outDropped)
		}
		return nil
	})
	// After the stall, what was buffered is delivered.
	testutil.Eventually(t, 15*time.Second, func() error {
		if b := h.out.Host().Buffered(); b > 0 {
			return fmt.Errorf("%d still buffered", b)
		}
		return nil
	})
	in := metric(t, reg, "keel_output_records_in_total", nil)
	out := metric(t, reg, "keel_output_records_out_total", nil)
	require.Equal(t, in, out, "records taken into the buffer but not delivered")
}
