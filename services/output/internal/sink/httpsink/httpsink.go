// Package httpsink is the HTTP sink plugin: it POSTs records to a URL, one
// request per record or, in batch mode, one JSON document per batch. Every
// request carries an HMAC-SHA256 signature when a secret is set. Transport
// errors, timeouts, 429 and 5xx answers are retried with exponential backoff
// up to max_attempts, then reported to the host as retryable (the host keeps
// the records and tries again later); other 4xx answers drop the record
// (counted by the host).
package httpsink

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"time"

	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
	"github.com/keelmq/keel/services/output/internal/meta"
)

// ID is the plugin ID.
const ID = "http"

// Header names of signed requests.
const (
	HeaderTimestamp = "X-Keel-Timestamp"
	HeaderSignature = "X-Keel-Signature"
	// HeaderUserProperty carries one MQTT 5 user property per value, as
	// url-encoded "key=value", in order (single-record mode).
	HeaderUserProperty = "X-Keel-User-Property"
)

// Defaults.
const (
	DefaultTimeout        = 5 * time.Second
	DefaultMaxAttempts    = 3
	DefaultBackoffMin     = 100 * time.Millisecond
	DefaultBackoffMax     = 2 * time.Second
	DefaultMaxBatch       = 100
	DefaultSingleMaxBatch = 100
)

// Config is the plugin's configuration.
type Config struct {
	// URL receives the requests. A record's destination, when set, is
	// resolved against it as a relative reference ("orders" → URL/../orders).
	URL string `json:"url"`
	// Method defaults to POST.
	Method string `json:"method"`
	// Timeout bounds one request, body included.
	Timeout meta.Duration `json:"timeout"`
	// MaxAttempts per request inside one Write.
	MaxAttempts int `json:"max_attempts"`
	// BackoffMin and BackoffMax bound the exponential backoff between attempts.
	BackoffMin meta.Duration `json:"backoff_min"`
	BackoffMax meta.Duration `json:"backoff_max"`
	// HMACSecret, when set, signs every request: HeaderSignature is
	// "sha256=" + hex(HMAC-SHA256(secret, timestamp + "." + body)) and
	// HeaderTimestamp the Unix seconds used.
	HMACSecret string `json:"hmac_secret"`
	// Batch sends one JSON document {"records": [...]} per batch.
	Batch bool `json:"batch"`
	// MaxBatchRecords caps a batch (the host never sends more).
	MaxBatchRecords int `json:"max_batch_records"`
	// Headers are added to every request (e.g. Authorization).
	Headers map[string]string `json:"headers"`
}

// BatchBody is the request body in batch mode.
type BatchBody struct {
	Records []BatchRecord `json:"records"`
}

// BatchRecord is one record of a batch body. Byte fields are base64 (std).
type BatchRecord struct {
	Tenant          string         `json:"tenant"`
	Topic           string         `json:"topic"`
	ClientID        string         `json:"client_id"`
	MsgID           string         `json:"msg_id"`
	QoS             uint32         `json:"qos"`
	Retain          bool           `json:"retain"`
	IngressUnixNano int64          `json:"ingress_unix_nano,omitempty"`
	ContentType     string         `json:"content_type,omitempty"`
	ResponseTopic   string         `json:"response_topic,omitempty"`
	CorrelationData []byte         `json:"correlation_data,omitempty"`
	UserProperties  []UserProperty `json:"user_properties,omitempty"`
	Destination     string         `json:"destination,omitempty"`
	Key             []byte         `json:"key,omitempty"`
	Headers         []UserProperty `json:"headers,omitempty"`
	Payload         []byte         `json:"payload"`
}

// UserProperty is a key/value pair.
type UserProperty struct {
	Key   string `json:"key"`
	Value string `json:"value"`
}

// Sign returns the signature header value for body at timestamp ts.
func Sign(secret []byte, ts string, body []byte) string {
	mac := hmac.New(sha256.New, secret)
	mac.Write([]byte(ts))
	mac.Write([]byte{'.'})
	mac.Write(body)
	return "sha256=" + hex.EncodeToString(mac.Sum(nil))
}

// Verify checks a signature made by [Sign], in constant time.
func Verify(secret []byte, ts string, body []byte, sig string) bool {
	return hmac.Equal([]byte(Sign(secret, ts, body)), []byte(sig))
}

// Sink is the HTTP sink. Use [New].
type Sink struct {
	logger *slog.Logger
	now    func() time.Time

	mu       sync.Mutex
	cfg      Config
	base     *url.URL
	client   *http.Client
	pipeline string
}

// New returns an unconfigured sink.
func New(logger *slog.Logger) *Sink { return &Sink{logger: logger, now: time.Now} }

// Configure validates and applies the configuration.
func (s *Sink) Configure(_ context.Context, req *pluginv1.SinkServiceConfigureRequest) (*pluginv1.SinkServiceConfigureResponse, error) {
	var cfg Config
	if err := meta.DecodeConfig(req.GetConfigJson(), &cfg); err != nil {
		return nil, err
	}
	u, err := url.Parse(cfg.URL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("http sink config: url %q: want an absolute http(s) URL", cfg.URL)
	}
	if cfg.Method == "" {
		cfg.Method = http.MethodPost
	}
	if cfg.MaxAttempts <= 0 {
		cfg.MaxAttempts = DefaultMaxAttempts
	}
	if cfg.MaxBatchRecords <= 0 {
		cfg.MaxBatchRecords = DefaultMaxBatch
	}
	s.mu.Lock()
	s.cfg, s.base, s.pipeline = cfg, u, req.GetPipeline()
	s.client = &http.Client{Timeout: cfg.Timeout.Or(DefaultTimeout)}
	s.mu.Unlock()
	s.logger.Info("http sink configured", "pipeline", req.GetPipeline(), "url", u.Redacted(), "batch", cfg.Batch,
		"hmac_secret_set", cfg.HMACSecret != "", "timeout", cfg.Timeout.Or(DefaultTimeout).String())
	return &pluginv1.SinkServiceConfigureResponse{
		Info:            &pluginv1.PluginInfo{Id: ID, Version: "1"},
		MaxBatchRecords: uint32(cfg.MaxBatchRecords),
	}, nil
}

// errPermanent marks an answer no retry will fix (4xx other than 408/429).
var errPermanent = errors.New("permanent http failure")

// Write sends the batch. In single mode records go one by one, in order; the
// first that cannot be sent stops the batch and the rest are reported
// retryable, so that a retry keeps their order.
func (s *Sink) Write(ctx context.Context, req *pluginv1.SinkServiceWriteRequest) (*pluginv1.SinkServiceWriteResponse, error) {
	s.mu.Lock()
	cfg, base, client := s.cfg, s.base, s.client
	s.mu.Unlock()
	if client == nil {
		return nil, errors.New("http sink: not configured")
	}
	recs := req.GetRecords()
	resp := &pluginv1.SinkServiceWriteResponse{}
	if cfg.Batch {
		if len(recs) == 0 {
			return resp, nil
		}
		body, err := json.Marshal(batchBody(recs))
		if err != nil {
			return nil, fmt.Errorf("encode batch: %w", err)
		}
		err = s.send(ctx, &cfg, client, base.String(), "application/json", nil, body)
		if err != nil {
			for i := range recs {
				resp.Failures = append(resp.Failures, &pluginv1.RecordFailure{Index: uint32(i), Retryable: !errors.Is(err, errPermanent), Message: err.Error()})
			}
		}
		return resp, nil
	}
	for i, r := range recs {
		target := base.String()
		if d := r.GetDestination(); d != "" {
			ref, err := url.Parse(d)
			if err != nil {
				resp.Failures = append(resp.Failures, &pluginv1.RecordFailure{Index: uint32(i), Message: "bad destination: " + err.Error()})
				continue
			}
			target = base.ResolveReference(ref).String()
		}
		m := r.GetMessage()
		hdr := http.Header{}
		for _, h := range meta.Headers(r, false) {
			hdr.Add("X-"+http.CanonicalHeaderKey(h.Key), headerValue(h))
		}
		for _, up := range m.GetUserProperties() {
			hdr.Add(HeaderUserProperty, url.QueryEscape(up.GetKey())+"="+url.QueryEscape(up.GetValue()))
		}
		ct := m.GetContentType()
		if ct == "" {
			ct = "application/octet-stream"
		}
		if err := s.send(ctx, &cfg, client, target, ct, hdr, m.GetPayload()); err != nil {
			if errors.Is(err, errPermanent) {
				resp.Failures = append(resp.Failures, &pluginv1.RecordFailure{Index: uint32(i), Message: err.Error()})
				continue
			}
			for j := i; j < len(recs); j++ {
				resp.Failures = append(resp.Failures, &pluginv1.RecordFailure{Index: uint32(j), Retryable: true, Message: err.Error()})
			}
			break
		}
	}
	return resp, nil
}

// headerValue makes a header value safe for HTTP: binary values (correlation
// data) are base64.
func headerValue(h meta.Header) string {
	if h.Key == meta.HeaderCorrelationData {
		return base64.StdEncoding.EncodeToString(h.Value)
	}
	return string(h.Value)
}

func batchBody(recs []*pluginv1.Record) *BatchBody {
	b := &BatchBody{Records: make([]BatchRecord, len(recs))}
	for i, r := range recs {
		m := r.GetMessage()
		br := BatchRecord{
			Tenant: m.GetTenant(), Topic: m.GetTopic(), ClientID: m.GetClientId(), MsgID: meta.MsgID(m.GetId()),
			QoS: m.GetQos(), Retain: m.GetRetain(), IngressUnixNano: m.GetIngressUnixNano(),
			ContentType: m.GetContentType(), ResponseTopic: m.GetResponseTopic(), CorrelationData: m.GetCorrelationData(),
			Destination: r.GetDestination(), Key: r.GetKey(), Payload: m.GetPayload(),
		}
		if br.Payload == nil {
			br.Payload = []byte{}
		}
		for _, up := range m.GetUserProperties() {
			br.UserProperties = append(br.UserProperties, UserProperty{Key: up.GetKey(), Value: up.GetValue()})
		}
		for _, h := range r.GetHeaders() {
			br.Headers = append(br.Headers, UserProperty{Key: h.GetKey(), Value: string(h.GetValue())})
		}
		b.Records[i] = br
	}
	return b
}

// send performs one request with retries. It returns nil on 2xx, an error
// wrapping errPermanent on a 4xx that retrying cannot fix, and otherwise the
// last error once attempts run out or ctx ends.
func (s *Sink) send(ctx context.Context, cfg *Config, client *http.Client, target, contentType string, hdr http.Header, body []byte) error {
	backoff := cfg.BackoffMin.Or(DefaultBackoffMin)
	maxBackoff := cfg.BackoffMax.Or(DefaultBackoffMax)
	var last error
	for attempt := 1; ; attempt++ {
		last = s.attempt(ctx, cfg, client, target, contentType, hdr, body)
		if last == nil || errors.Is(last, errPermanent) {
			return last
		}
		if attempt >= cfg.MaxAttempts || ctx.Err() != nil {
			return last
		}
		s.logger.Debug("http request failed, retrying", "pipeline", s.pipeline, "attempt", attempt, "error", last)
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%w (last: %w)", ctx.Err(), last)
		case <-t.C:
		}
		backoff = min(2*backoff, maxBackoff)
	}
}

func (s *Sink) attempt(ctx context.Context, cfg *Config, client *http.Client, target, contentType string, hdr http.Header, body []byte) error {
	req, err := http.NewRequestWithContext(ctx, cfg.Method, target, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("%w: %w", errPermanent, err)
	}
	for k, vs := range hdr {
		req.Header[k] = vs
	}
	for k, v := range cfg.Headers {
		req.Header.Set(k, v)
	}
	req.Header.Set("Content-Type", contentType)
	req.Header.Set("User-Agent", "keel-output-http/1")
	if cfg.HMACSecret != "" {
		ts := strconv.FormatInt(s.now().Unix(), 10)
		req.Header.Set(HeaderTimestamp, ts)
		req.Header.Set(HeaderSignature, Sign([]byte(cfg.HMACSecret), ts, body))
	}
	res, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("http %s: %w", cfg.Method, err)
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(res.Body, 64<<10))
	_ = res.Body.Close()
	switch {
	case res.StatusCode >= 200 && res.StatusCode < 300:
		return nil
	case res.StatusCode == http.StatusRequestTimeout || res.StatusCode == http.StatusTooManyRequests || res.StatusCode >= 500:
		return fmt.Errorf("http status %d", res.StatusCode)
	default:
		return fmt.Errorf("%w: http status %d", errPermanent, res.StatusCode)
	}
}

// Close releases idle connections.
func (s *Sink) Close(context.Context, *pluginv1.SinkServiceCloseRequest) (*pluginv1.SinkServiceCloseResponse, error) {
	s.mu.Lock()
	c := s.client
	s.mu.Unlock()
	if c != nil {
		c.CloseIdleConnections()
	}
	return &pluginv1.SinkServiceCloseResponse{}, nil
}
