package httpsink

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
)

func TestSign_Verify(t *testing.T) {
	t.Parallel()
	sig := Sign([]byte("k"), "1700000000", []byte(`{"a":1}`))
	require.Regexp(t, `^sha256=[0-9a-f]{64}$`, sig)
	require.True(t, Verify([]byte("k"), "1700000000", []byte(`{"a":1}`), sig))
	require.False(t, Verify([]byte("k"), "1700000001", []byte(`{"a":1}`), sig))
	require.False(t, Verify([]byte("x"), "1700000000", []byte(`{"a":1}`), sig))
}

// Receivers check signatures with their own code, written from the README's
// formula, so the value is pinned twice: computed from that formula with
// crypto/hmac, and as a literal computed outside Go (printf '%s'
// '1700000000.{"id":42,"ok":true}' | openssl dgst -sha256 -hmac keel-secret).
const (
	kaSecret    = "keel-secret"
	kaTimestamp = "1700000000"
	kaBody      = `{"id":42,"ok":true}`
	kaSignature = "sha256=aa3a6a99231cf7ef78db74df368a8956ebebf799aa632d9e0f2b6fd086b89824"
)

// documentedSignature is the README's "sha256=" +
// hex(HMAC-SHA256(secret, timestamp + "." + body)).
func documentedSignature(secret, ts string, body []byte) string {
	mac := hmac.New(sha256.New, []byte(secret))
	mac.Write([]byte(ts + "." + string(body)))
	return "sha256=" + hex.EncodeToString(mac.Sum(nil))
}

func TestSign_KnownAnswer(t *testing.T) {
	t.Parallel()
	require.Equal(t, kaSignature, documentedSignature(kaSecret, kaTimestamp, []byte(kaBody)))
	require.Equal(t, kaSignature, Sign([]byte(kaSecret), kaTimestamp, []byte(kaBody)))
	require.True(t, Verify([]byte(kaSecret), kaTimestamp, []byte(kaBody), kaSignature))
}

// TestSink_Write_SignatureHeaders checks the headers a receiver gets, in
// both modes: the timestamp in Unix seconds and the signature over exactly
// the body sent.
func TestSink_Write_SignatureHeaders(t *testing.T) {
	t.Parallel()
	type got struct {
		ts, sig string
		body    []byte
	}
	reqs := make(chan got, 2)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		reqs <- got{ts: r.Header.Get("X-Keel-Timestamp"), sig: r.Header.Get("X-Keel-Signature"), body: b}
	}))
	t.Cleanup(srv.Close)
	rec := &pluginv1.Record{Message: &commonv1.Message{Tenant: "acme", Topic: "a/b", Payload: []byte(kaBody)}}
	for _, batch := range []bool{false, true} {
		s := New(testutil.Logger(t))
		s.now = func() time.Time { return time.Unix(1700000000, 999_000_000) }
		cfg := fmt.Sprintf(`{"url":%q,"hmac_secret":%q,"batch":%t}`, srv.URL, kaSecret, batch)
		_, err := s.Configure(t.Context(), &pluginv1.SinkServiceConfigureRequest{ConfigJson: []byte(cfg)})
		require.NoError(t, err)
		resp, err := s.Write(t.Context(), &pluginv1.SinkServiceWriteRequest{Records: []*pluginv1.Record{rec}})
		require.NoError(t, err)
		require.Empty(t, resp.GetFailures())
		r := <-reqs
		require.Equal(t, kaTimestamp, r.ts, "batch=%t", batch)
		require.Equal(t, documentedSignature(kaSecret, kaTimestamp, r.body), r.sig, "batch=%t", batch)
		if !batch {
			require.Equal(t, kaBody, string(r.body))
			require.Equal(t, kaSignature, r.sig)
		}
	}
}

// TestSink_Write_Single sends records one per request: headers carry the
// metadata, a 500 then a timeout are retried, a 400 drops only its record,
// and a record that keeps failing makes the rest retryable (order kept).
func TestSink_Write_Single(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var reqs []*http.Request
	var bodies []string
	calls := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		calls++
		n := calls
		mu.Unlock()
		switch {
		case n == 1:
			w.WriteHeader(http.StatusInternalServerError)
			return
		case n == 2:
			time.Sleep(300 * time.Millisecond) // past the 100ms timeout
			return
		case string(b) == "bad":
			w.WriteHeader(http.StatusBadRequest)
			return
		case string(b) == "down":
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		mu.Lock()
		reqs = append(reqs, r)
		bodies = append(bodies, string(b))
		mu.Unlock()
	}))
	t.Cleanup(srv.Close)
	s := New(testutil.Logger(t))
	_, err := s.Configure(t.Context(), &pluginv1.SinkServiceConfigureRequest{ConfigJson: []byte(`{"url":"` + srv.URL + `/in","timeout":"100ms","max_attempts":3,"backoff_min":"1ms","hmac_secret":"k","headers":{"Authorization":"Bearer t"}}`)})
	require.NoError(t, err)
	mk := func(p string) *pluginv1.Record {
		return &pluginv1.Record{Message: &commonv1.Message{Id: &commonv1.MsgID{EdgeId: "e", Incarnation: 1, Seq: 2}, Tenant: "acme", Topic: "a/b",
			ClientId: "c", Qos: 2, Payload: []byte(p), ContentType: "text/plain", CorrelationData: []byte{0xff},
			UserProperties: []*commonv1.UserProperty{{Key: "k 1", Value: "v=1"}}}}
	}
	resp, err := s.Write(t.Context(), &pluginv1.SinkServiceWriteRequest{Records: []*pluginv1.Record{mk("one"), mk("bad"), mk("two"), mk("down"), mk("three")}})
	require.NoError(t, err)
	require.Equal(t, []string{"one", "two"}, bodies)
	fails := resp.GetFailures()
	require.Len(t, fails, 3)
	require.Equal(t, uint32(1), fails[0].GetIndex())
	require.False(t, fails[0].GetRetryable())
	require.Equal(t, uint32(3), fails[1].GetIndex())
	require.True(t, fails[1].GetRetryable())
	require.Equal(t, uint32(4), fails[2].GetIndex())
	require.True(t, fails[2].GetRetryable())
	r := reqs[0]
	require.Equal(t, "/in", r.URL.Path)
	require.Equal(t, "acme", r.Header.Get("X-Keel-Tenant"))
	require.Equal(t, "a/b", r.Header.Get("X-Keel-Topic"))
	require.Equal(t, "e:1:2", r.Header.Get("X-Keel-Msg-Id"))
	require.Equal(t, "2", r.Header.Get("X-Keel-Qos"))
	require.Equal(t, base64.StdEncoding.EncodeToString([]byte{0xff}), r.Header.Get("X-Keel-Correlation-Data"))
	require.Equal(t, "k+1=v%3D1", r.Header.Get(HeaderUserProperty))
	require.Equal(t, "text/plain", r.Header.Get("Content-Type"))
	require.Equal(t, "Bearer t", r.Header.Get("Authorization"))
	require.True(t, Verify([]byte("k"), r.Header.Get(HeaderTimestamp), []byte("one"), r.Header.Get(HeaderSignature)))
}
