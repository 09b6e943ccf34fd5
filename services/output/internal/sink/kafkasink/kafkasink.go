// Package kafkasink is the Kafka/Redpanda sink plugin, on segmentio/kafka-go.
//
// Every record becomes one Kafka message: value = payload, key = the MQTT
// topic by default (so that, with the hash balancer, one MQTT topic maps to
// one partition and keeps its order), headers = the keel-* metadata, the MQTT
// 5 user properties and any transform headers (see package meta). Writes wait
// for acks=all by default; Write returns once Kafka acknowledged the batch,
// which gives the host at-least-once delivery.
package kafkasink

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl"
	"github.com/segmentio/kafka-go/sasl/plain"
	"github.com/segmentio/kafka-go/sasl/scram"

	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
	"github.com/keelmq/keel/services/output/internal/meta"
	"github.com/keelmq/keel/services/output/internal/pluginkit"
)

// ID is the plugin ID.
const ID = "kafka"

// Defaults.
const (
	DefaultBatchSize    = 1000
	DefaultBatchBytes   = 4 << 20
	DefaultLinger       = 2 * time.Millisecond
	DefaultMaxAttempts  = 5
	DefaultWriteTimeout = 10 * time.Second
	// DefaultWritesInFlight lets the host send the next batch while one is
	// produced: its decoding and conversion overlap the produce request.
	DefaultWritesInFlight = 2
)

// Config is the plugin's configuration (the rule's sink.config section).
type Config struct {
	// Brokers are the bootstrap addresses ("host:port").
	Brokers []string `json:"brokers"`
	// Topic is the Kafka topic, unless a transform set the record's
	// destination. Without it, a record no transform gave a destination is
	// refused for good (the rest of its batch is still written).
	Topic string `json:"topic"`
	// Key selects the record key when a transform did not set one: "topic"
	// (default), "client_id" or "none".
	Key string `json:"key"`
	// Acks: "all" (default), "one" or "none".
	Acks string `json:"acks"`
	// BatchSize is the largest batch per partition and per Write.
	BatchSize int `json:"batch_size"`
	// BatchBytes caps a partition batch in bytes.
	BatchBytes int64 `json:"batch_bytes"`
	// Linger is how long a partial partition batch waits for more records.
	Linger meta.Duration `json:"linger"`
	// MaxAttempts is kafka-go's attempts per batch before Write reports a
	// (retryable) failure to the host, which retries again later.
	MaxAttempts int `json:"max_attempts"`
	// WriteTimeout bounds one produce request.
	WriteTimeout meta.Duration `json:"write_timeout"`
	// WritesInFlight is how many batches the host may send before the
	// first is acknowledged (default 2); they are produced one after the
	// other, in order. 1 sends one at a time.
	WritesInFlight int `json:"writes_in_flight"`
	// Compression: "", "gzip", "snappy", "lz4" or "zstd".
	Compression string `json:"compression"`
	// AutoCreateTopics lets the broker create missing topics.
	AutoCreateTopics bool `json:"auto_create_topics"`
	// TLS, when set, encrypts connections to the brokers.
	TLS *TLSConfig `json:"tls"`
	// SASL, when set, authenticates to the brokers.
	SASL *SASLConfig `json:"sasl"`
}

// TLSConfig configures TLS to the brokers.
type TLSConfig struct {
	CAFile             string `json:"ca_file"`
	CertFile           string `json:"cert_file"`
	KeyFile            string `json:"key_file"`
	ServerName         string `json:"server_name"`
	InsecureSkipVerify bool   `json:"insecure_skip_verify"`
}

// SASLConfig configures SASL authentication.
type SASLConfig struct {
	// Mechanism: "plain", "scram-sha-256" or "scram-sha-512".
	Mechanism string `json:"mechanism"`
	Username  string `json:"username"`
	Password  string `json:"password"`
}

func (c *Config) validate() error {
	var errs []error
	if len(c.Brokers) == 0 {
		errs = append(errs, errors.New("brokers: at least one address is required"))
	}
	switch c.Key {
	case "", "topic", "client_id", "none":
	default:
		errs = append(errs, fmt.Errorf("key %q: want topic, client_id or none", c.Key))
	}
	switch c.Acks {
	case "", "all", "one", "none":
	default:
		errs = append(errs, fmt.Errorf("acks %q: want all, one or none", c.Acks))
	}
	switch c.Compression {
	case "", "none", "gzip", "snappy", "lz4", "zstd":
	default:
		errs = append(errs, fmt.Errorf("compression %q: want gzip, snappy, lz4 or zstd", c.Compression))
	}
	if c.BatchSize < 0 || c.MaxAttempts < 0 || c.BatchBytes < 0 || c.WritesInFlight < 0 {
		errs = append(errs, errors.New("batch_size, batch_bytes, max_attempts and writes_in_flight must not be negative"))
	}
	if c.SASL != nil {
		switch c.SASL.Mechanism {
		case "plain", "scram-sha-256", "scram-sha-512":
		default:
			errs = append(errs, fmt.Errorf("sasl.mechanism %q: want plain, scram-sha-256 or scram-sha-512", c.SASL.Mechanism))
		}
		if c.SASL.Username == "" {
			errs = append(errs, errors.New("sasl.username is required"))
		}
	}
	return errors.Join(errs...)
}

// Sink is the Kafka sink. The zero value is not usable; use [New].
type Sink struct {
	logger *slog.Logger

	mu       sync.Mutex
	cfg      Config
	writer   *kafka.Writer
	auth     *saslWatch // nil without SASL
	keyMode  string
	topic    string
	pipeline string

	chain pluginkit.WriteChain
}

// New returns an unconfigured sink.
func New(logger *slog.Logger) *Sink { return &Sink{logger: logger} }

// Configure validates the configuration and opens the writer.
func (s *Sink) Configure(_ context.Context, req *pluginv1.SinkServiceConfigureRequest) (*pluginv1.SinkServiceConfigureResponse, error) {
	var cfg Config
	if err := meta.DecodeConfig(req.GetConfigJson(), &cfg); err != nil {
		return nil, err
	}
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("kafka sink config: %w", err)
	}
	w, auth, err := newWriter(&cfg)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	old := s.writer
	s.cfg, s.writer, s.auth, s.pipeline = cfg, w, auth, req.GetPipeline()
	s.keyMode = cfg.Key
	if s.keyMode == "" {
		s.keyMode = "topic"
	}
	s.topic = cfg.Topic
	s.mu.Unlock()
	if old != nil {
		_ = old.Close()
	}
	s.logger.Info("kafka sink configured", "pipeline", req.GetPipeline(), "brokers", strings.Join(cfg.Brokers, ","),
		"topic", cfg.Topic, "acks", w.RequiredAcks.String(), "tls", cfg.TLS != nil, "sasl", cfg.SASL != nil,
		"sasl_password_set", cfg.SASL != nil && cfg.SASL.Password != "")
	inFlight := cfg.WritesInFlight
	if inFlight == 0 {
		inFlight = DefaultWritesInFlight
	}
	return &pluginv1.SinkServiceConfigureResponse{
		Info:              &pluginv1.PluginInfo{Id: ID, Version: "1"},
		MaxBatchRecords:   uint32(w.BatchSize),
		MaxWritesInFlight: uint32(inFlight),
	}, nil
}

func newWriter(cfg *Config) (*kafka.Writer, *saslWatch, error) {
	tr := &kafka.Transport{DialTimeout: 5 * time.Second, ClientID: "keel-output"}
	if cfg.TLS != nil {
		t, err := tlsConfig(cfg.TLS)
		if err != nil {
			return nil, nil, err
		}
		tr.TLS = t
	}
	var auth *saslWatch
	if cfg.SASL != nil {
		var mech sasl.Mechanism
		switch cfg.SASL.Mechanism {
		case "plain":
			mech = plain.Mechanism{Username: cfg.SASL.Username, Password: cfg.SASL.Password}
		default:
			algo := scram.SHA256
			if cfg.SASL.Mechanism == "scram-sha-512" {
				algo = scram.SHA512
			}
			m, err := scram.Mechanism(algo, cfg.SASL.Username, cfg.SASL.Password)
			if err != nil {
				return nil, nil, fmt.Errorf("sasl: %w", err)
			}
			mech = m
		}
		auth = &saslWatch{Mechanism: mech, mechanism: cfg.SASL.Mechanism, username: cfg.SASL.Username}
		tr.SASL = auth
	}
	acks := kafka.RequireAll
	switch cfg.Acks {
	case "one":
		acks = kafka.RequireOne
	case "none":
		acks = kafka.RequireNone
	}
	var comp kafka.Compression
	switch cfg.Compression {
	case "gzip":
		comp = kafka.Gzip
	case "snappy":
		comp = kafka.Snappy
	case "lz4":
		comp = kafka.Lz4
	case "zstd":
		comp = kafka.Zstd
	}
	batch := cfg.BatchSize
	if batch == 0 {
		batch = DefaultBatchSize
	}
	batchBytes := cfg.BatchBytes
	if batchBytes == 0 {
		batchBytes = DefaultBatchBytes
	}
	attempts := cfg.MaxAttempts
	if attempts == 0 {
		attempts = DefaultMaxAttempts
	}
	return &kafka.Writer{
		Addr:                   kafka.TCP(cfg.Brokers...),
		Balancer:               &kafka.Hash{},
		MaxAttempts:            attempts,
		WriteBackoffMin:        50 * time.Millisecond,
		WriteBackoffMax:        time.Second,
		BatchSize:              batch,
		BatchBytes:             batchBytes,
		BatchTimeout:           cfg.Linger.Or(DefaultLinger),
		WriteTimeout:           cfg.WriteTimeout.Or(DefaultWriteTimeout),
		ReadTimeout:            cfg.WriteTimeout.Or(DefaultWriteTimeout),
		RequiredAcks:           acks,
		Compression:            comp,
		Transport:              tr,
		AllowAutoTopicCreation: cfg.AutoCreateTopics,
	}, auth, nil
}

// saslWatch is the configured SASL mechanism, watched so that a failed
// write can say that authentication failed: a broker may refuse
// credentials by closing the connection, which kafka-go reports as a bare
// "unexpected EOF".
type saslWatch struct {
	sasl.Mechanism
	mechanism, username string

	exchanges atomic.Uint64
	// open is the latest exchange started while it has not completed, else 0.
	open atomic.Uint64
}

// saslExchange is one authentication of one connection.
type saslExchange struct {
	sasl.StateMachine
	watch *saslWatch
	id    uint64
}

func (w *saslWatch) Start(ctx context.Context) (sasl.StateMachine, []byte, error) {
	sm, first, err := w.Mechanism.Start(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("SASL %s: %w", w.mechanism, err)
	}
	id := w.exchanges.Add(1)
	w.open.Store(id)
	return &saslExchange{StateMachine: sm, watch: w, id: id}, first, nil
}

func (x *saslExchange) Next(ctx context.Context, challenge []byte) (bool, []byte, error) {
	done, resp, err := x.StateMachine.Next(ctx, challenge)
	if done || err != nil {
		// A mechanism's own error is named here; only a broker that hung
		// up mid-exchange leaves the exchange open.
		x.watch.open.CompareAndSwap(x.id, 0)
	}
	if err != nil {
		return done, resp, fmt.Errorf("SASL %s: %w", x.watch.mechanism, err)
	}
	return done, resp, nil
}

// describe returns err's message, saying that authentication failed when
// the latest SASL exchange never completed.
func (w *saslWatch) describe(err error) string {
	if w != nil && w.open.Load() != 0 {
		return fmt.Sprintf("SASL %s authentication as %q failed: %v", w.mechanism, w.username, err)
	}
	return err.Error()
}

func tlsConfig(c *TLSConfig) (*tls.Config, error) {
	t := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: c.ServerName, InsecureSkipVerify: c.InsecureSkipVerify} //nolint:gosec // operator's explicit choice
	if c.CAFile != "" {
		pem, err := os.ReadFile(c.CAFile)
		if err != nil {
			return nil, fmt.Errorf("tls.ca_file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("tls.ca_file %s: no PEM certificates", c.CAFile)
		}
		t.RootCAs = pool
	}
	if c.CertFile != "" || c.KeyFile != "" {
		cert, err := tls.LoadX509KeyPair(c.CertFile, c.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("tls client certificate: %w", err)
		}
		t.Certificates = []tls.Certificate{cert}
	}
	return t, nil
}

// Messages converts records to Kafka messages, as Write sends them. The
// messages of one call share one header slice and one buffer for keys and
// header values (a few allocations per batch rather than per record).
func Messages(recs []*pluginv1.Record, defaultTopic, keyMode string) []kafka.Message {
	msgs := make([]kafka.Message, len(recs))
	nh, nb := 0, 0
	for _, r := range recs {
		h, b := meta.HeadersSize(r, true)
		nh, nb = nh+h, nb+b+len(r.GetMessage().GetTopic())+len(r.GetMessage().GetClientId())
	}
	hs := make([]kafka.Header, 0, nh)
	arena := make([]byte, 0, nb)
	for i, r := range recs {
		m := r.GetMessage()
		km := kafka.Message{Topic: defaultTopic, Value: m.GetPayload()}
		if r.GetDestination() != "" {
			km.Topic = r.GetDestination()
		}
		var key string
		switch {
		case len(r.GetKey()) > 0:
			km.Key = r.GetKey()
		case keyMode == "client_id":
			key = m.GetClientId()
		case keyMode == "none":
		default:
			key = m.GetTopic()
		}
		if km.Key == nil && keyMode != "none" {
			n := len(arena)
			arena = append(arena, key...)
			km.Key = arena[n:len(arena):len(arena)]
		}
		n := len(hs)
		hs, arena = meta.AppendHeaders(hs, arena, r, true)
		km.Headers = hs[n:len(hs):len(hs)]
		msgs[i] = km
	}
	return msgs
}

// Write produces the batch and waits for the acks. A batch sent behind
// another is produced after it (pluginkit.WriteChain).
func (s *Sink) Write(ctx context.Context, req *pluginv1.SinkServiceWriteRequest) (*pluginv1.SinkServiceWriteResponse, error) {
	s.mu.Lock()
	w, auth, topic, keyMode := s.writer, s.auth, s.topic, s.keyMode
	s.mu.Unlock()
	if w == nil {
		return nil, errors.New("kafka sink: not configured")
	}
	recs := req.GetRecords()
	msgs, at, refused := withTopic(Messages(recs, topic, keyMode))
	seq := req.GetSequence()
	ok, err := s.chain.Wait(ctx, req.GetFollows())
	if err != nil {
		return nil, err
	}
	if !ok {
		s.chain.Done(seq, false)
		return pluginkit.FailAll(len(recs), "an earlier batch is to be written first"), nil
	}
	if len(refused) > 0 {
		s.logger.Warn("kafka records refused", "pipeline", s.pipeline, "refused", len(refused), "records", len(recs), "reason", noTopic)
	}
	resp := &pluginv1.SinkServiceWriteResponse{}
	if len(msgs) > 0 {
		resp, err = s.produce(ctx, w, auth, msgs)
		if err != nil {
			s.chain.Done(seq, false)
			return nil, err
		}
	}
	if at != nil {
		for _, f := range resp.Failures {
			f.Index = at[f.Index]
		}
	}
	// The host counts every record not reported here as written.
	resp.Failures = append(resp.Failures, refused...)
	s.chain.Done(seq, !slices.ContainsFunc(resp.GetFailures(), (*pluginv1.RecordFailure).GetRetryable))
	return resp, nil
}

// noTopic is why a record is refused when neither the sink nor a transform
// named its topic; no retry can fix that, only a new configuration.
const noTopic = "no kafka topic: the sink has no topic and no transform set the record's destination"

// withTopic splits msgs: it returns those that have a topic, the batch
// index of each (nil when none was left out), and a failure, not
// retryable, for each left out.
func withTopic(msgs []kafka.Message) ([]kafka.Message, []uint32, []*pluginv1.RecordFailure) {
	var refused []*pluginv1.RecordFailure
	for i := range msgs {
		if msgs[i].Topic == "" {
			refused = append(refused, &pluginv1.RecordFailure{Index: uint32(i), Message: noTopic})
		}
	}
	if len(refused) == 0 {
		return msgs, nil, nil
	}
	kept := make([]kafka.Message, 0, len(msgs)-len(refused))
	at := make([]uint32, 0, len(msgs)-len(refused))
	for i := range msgs {
		if msgs[i].Topic != "" {
			kept = append(kept, msgs[i])
			at = append(at, uint32(i))
		}
	}
	return kept, at, refused
}

// produce writes msgs and reports the records that failed.
func (s *Sink) produce(ctx context.Context, w *kafka.Writer, auth *saslWatch, msgs []kafka.Message) (*pluginv1.SinkServiceWriteResponse, error) {
	resp := &pluginv1.SinkServiceWriteResponse{}
	err := w.WriteMessages(ctx, msgs...)
	if err == nil {
		return resp, nil
	}
	var werrs kafka.WriteErrors
	if errors.As(err, &werrs) {
		for i, e := range werrs {
			if e == nil {
				continue
			}
			resp.Failures = append(resp.Failures, &pluginv1.RecordFailure{Index: uint32(i), Retryable: retryable(e), Message: auth.describe(e)})
		}
		s.logger.Warn("kafka write failed", "pipeline", s.pipeline, "failed", werrs.Count(), "records", len(msgs), "error", auth.describe(err))
		return resp, nil
	}
	msg := auth.describe(err)
	s.logger.Warn("kafka write failed", "pipeline", s.pipeline, "records", len(msgs), "error", msg)
	// Failed authentication stays retryable too: the records wait in the
	// buffer while the credentials are corrected by a reload.
	for i := range msgs {
		resp.Failures = append(resp.Failures, &pluginv1.RecordFailure{Index: uint32(i), Retryable: true, Message: msg})
	}
	return resp, nil
}

// retryable is false only for errors that no retry can fix.
func retryable(err error) bool {
	var kerr kafka.Error
	if errors.As(err, &kerr) {
		switch kerr {
		case kafka.MessageSizeTooLarge, kafka.InvalidMessage, kafka.InvalidMessageSize,
			kafka.RecordListTooLarge, kafka.TopicAuthorizationFailed, kafka.InvalidTopic:
			return false
		}
	}
	return true
}

// Close flushes and closes the writer.
func (s *Sink) Close(context.Context, *pluginv1.SinkServiceCloseRequest) (*pluginv1.SinkServiceCloseResponse, error) {
	s.mu.Lock()
	w := s.writer
	s.writer = nil
	s.mu.Unlock()
	if w != nil {
		if err := w.Close(); err != nil {
			return nil, fmt.Errorf("close kafka writer: %w", err)
		}
	}
	return &pluginv1.SinkServiceCloseResponse{}, nil
}
