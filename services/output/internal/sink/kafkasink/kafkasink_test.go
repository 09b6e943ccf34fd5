package kafkasink_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl"
	"github.com/segmentio/kafka-go/sasl/plain"
	"github.com/segmentio/kafka-go/sasl/scram"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
	"github.com/keelmq/keel/services/output/internal/meta"
	"github.com/keelmq/keel/services/output/internal/sink/kafkasink"
)

const topic = "mqtt-out"

// startCluster starts a one-broker kfake cluster on loopback with topic
// seeded (one partition, so that reading back is in write order).
func startCluster(t *testing.T, opts ...kfake.Opt) *kfake.Cluster {
	t.Helper()
	c, err := kfake.NewCluster(append([]kfake.Opt{kfake.NumBrokers(1), kfake.SeedTopics(1, topic)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return c
}

// sinkConfig is the sink configuration the tests start from: short
// timeouts and one attempt, so that a refused connection fails the write
// at once instead of after kafka-go's retries.
func sinkConfig(addr string) map[string]any {
	return map[string]any{"brokers": []string{addr}, "topic": topic, "linger": "1ms", "max_attempts": 1, "write_timeout": "3s"}
}

// configure configures a new sink, closed at the end of the test.
func configure(t *testing.T, cfg map[string]any) (*kafkasink.Sink, error) {
	t.Helper()
	b, err := json.Marshal(cfg)
	require.NoError(t, err)
	s := kafkasink.New(slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelError})))
	_, err = s.Configure(t.Context(), &pluginv1.SinkServiceConfigureRequest{Pipeline: "acme/test", ConfigJson: b})
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { _, _ = s.Close(context.Background(), &pluginv1.SinkServiceCloseRequest{}) })
	return s, nil
}

var sequence atomic.Uint64

// records returns n records of tenant acme on MQTT topic sensors/a.
func records(n int, tag string) []*pluginv1.Record {
	recs := make([]*pluginv1.Record, n)
	for i := range recs {
		recs[i] = &pluginv1.Record{Message: &commonv1.Message{
			Id:     &commonv1.MsgID{EdgeId: "edge-1", Incarnation: 1, Seq: uint64(i + 1)},
			Tenant: "acme", Topic: "sensors/a", ClientId: "c1", Qos: 1,
			Payload: fmt.Appendf(nil, "%s-%d", tag, i),
		}}
	}
	return recs
}

// write sends recs to s as the host would, one write following none.
func write(t *testing.T, s *kafkasink.Sink, recs []*pluginv1.Record) *pluginv1.SinkServiceWriteResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	resp, err := s.Write(ctx, &pluginv1.SinkServiceWriteRequest{Records: recs, Sequence: sequence.Add(1)})
	require.NoError(t, err)
	return resp
}

// writeOK writes recs and requires every record acknowledged.
func writeOK(t *testing.T, s *kafkasink.Sink, recs []*pluginv1.Record) {
	t.Helper()
	resp := write(t, s, recs)
	for _, f := range resp.GetFailures() {
		require.Failf(t, "record not written", "record %d: %s (retryable %v)", f.GetIndex(), f.GetMessage(), f.GetRetryable())
	}
}

// writeFails writes recs, requires every record to fail, retryable (the
// records stay in the host's buffer until the configuration is corrected),
// and returns the first failure's message.
func writeFails(t *testing.T, s *kafkasink.Sink, recs []*pluginv1.Record) string {
	t.Helper()
	resp := write(t, s, recs)
	require.Len(t, resp.GetFailures(), len(recs), "every record must fail")
	for _, f := range resp.GetFailures() {
		require.True(t, f.GetRetryable(), "record %d: %s", f.GetIndex(), f.GetMessage())
	}
	msg := resp.GetFailures()[0].GetMessage()
	t.Logf("write failed as expected: %s", msg)
	return msg
}

// readBack reads n messages of the topic from the start, through dialer
// (SASL and TLS as the cluster requires), and checks their payloads and
// metadata headers against recs.
func readBack(t *testing.T, addr string, dialer *kafka.Dialer, recs []*pluginv1.Record) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if dialer == nil {
		dialer = &kafka.Dialer{}
	}
	dialer.Timeout = 5 * time.Second
	r := kafka.NewReader(kafka.ReaderConfig{
		Brokers: []string{addr}, Topic: topic, Partition: 0, Dialer: dialer,
		MinBytes: 1, MaxBytes: 1 << 20, MaxWait: 50 * time.Millisecond,
	})
	defer func() { _ = r.Close() }()
	for i, rec := range recs {
		m, err := r.ReadMessage(ctx)
		require.NoError(t, err, "read message %d of %d", i, len(recs))
		require.Equal(t, string(rec.GetMessage().GetPayload()), string(m.Value))
		require.Equal(t, rec.GetMessage().GetTopic(), string(m.Key))
		require.Equal(t, meta.HeaderTenant, m.Headers[0].Key)
		require.Equal(t, rec.GetMessage().GetTenant(), string(m.Headers[0].Value))
	}
}

func TestConfigure_Invalid(t *testing.T) {
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "not.pem")
	require.NoError(t, os.WriteFile(notPEM, []byte("not a certificate"), 0o600))
	for name, tc := range map[string]struct {
		set  map[string]any
		want string
	}{
		"acks":             {map[string]any{"acks": "two"}, `acks "two"`},
		"sasl mechanism":   {map[string]any{"sasl": map[string]any{"mechanism": "gssapi", "username": "u"}}, "sasl.mechanism"},
		"sasl username":    {map[string]any{"sasl": map[string]any{"mechanism": "plain"}}, "sasl.username is required"},
		"ca file missing":  {map[string]any{"tls": map[string]any{"ca_file": filepath.Join(dir, "missing.pem")}}, "tls.ca_file"},
		"ca file not PEM":  {map[string]any{"tls": map[string]any{"ca_file": notPEM}}, "no PEM certificates"},
		"cert without key": {map[string]any{"tls": map[string]any{"cert_file": notPEM}}, "tls client certificate"},
	} {
		t.Run(name, func(t *testing.T) {
			cfg := sinkConfig("127.0.0.1:9092")
			for k, v := range tc.set {
				cfg[k] = v
			}
			_, err := configure(t, cfg)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// TestSASL runs each mechanism against a cluster whose only user has
// that mechanism: the right credentials write, a wrong password, the
// wrong mechanism or no SASL at all fail with an error naming SASL.
func TestSASL(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		mechanism, kfake, other string
		client                  func(user, pass string) sasl.Mechanism
	}{
		{"plain", "PLAIN", "scram-sha-256", func(u, p string) sasl.Mechanism { return plain.Mechanism{Username: u, Password: p} }},
		{"scram-sha-256", "SCRAM-SHA-256", "scram-sha-512", func(u, p string) sasl.Mechanism { return mustScram(scram.SHA256, u, p) }},
		{"scram-sha-512", "SCRAM-SHA-512", "plain", func(u, p string) sasl.Mechanism { return mustScram(scram.SHA512, u, p) }},
	} {
		t.Run(tc.mechanism, func(t *testing.T) {
			t.Parallel()
			c := startCluster(t, kfake.EnableSASL(), kfake.Superuser(tc.kfake, "keel", "s3cret"))
			addr := c.ListenAddrs()[0]
			withSASL := func(mechanism, pass string) map[string]any {
				cfg := sinkConfig(addr)
				cfg["sasl"] = map[string]any{"mechanism": mechanism, "username": "keel", "password": pass}
				return cfg
			}

			s, err := configure(t, withSASL(tc.mechanism, "s3cret"))
			require.NoError(t, err)
			recs := records(20, tc.mechanism)
			writeOK(t, s, recs)
			readBack(t, addr, &kafka.Dialer{SASLMechanism: tc.client("keel", "s3cret")}, recs)

			t.Run("wrong password", func(t *testing.T) {
				s, err := configure(t, withSASL(tc.mechanism, "wrong"))
				require.NoError(t, err, "credentials are checked by the broker, on write")
				require.Contains(t, writeFails(t, s, records(3, "x")), fmt.Sprintf("SASL %s authentication as %q failed", tc.mechanism, "keel"))
			})
			t.Run("wrong mechanism", func(t *testing.T) {
				s, err := configure(t, withSASL(tc.other, "s3cret"))
				require.NoError(t, err)
				require.Contains(t, writeFails(t, s, records(3, "x")), fmt.Sprintf("SASL %s authentication as %q failed", tc.other, "keel"))
			})
			t.Run("no sasl", func(t *testing.T) {
				s, err := configure(t, sinkConfig(addr))
				require.NoError(t, err)
				writeFails(t, s, records(3, "x"))
			})
		})
	}
}

func mustScram(algo scram.Algorithm, user, pass string) sasl.Mechanism {
	m, err := scram.Mechanism(algo, user, pass)
	if err != nil {
		panic(err)
	}
	return m
}

// pki is an in-memory CA with a server certificate for loopback and a
// client certificate, written as PEM files for the sink's configuration.
type pki struct {
	pool                                  *x509.CertPool
	server, client                        tls.Certificate
	caFile, clientCertFile, clientKeyFile string
}

func newPKI(t *testing.T) *pki {
	t.Helper()
	dir := t.TempDir()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "Keel test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	require.NoError(t, err)
	ca, err := x509.ParseCertificate(caDER)
	require.NoError(t, err)

	issue := func(serial int64, tmpl *x509.Certificate) (tls.Certificate, []byte, []byte) {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		require.NoError(t, err)
		tmpl.SerialNumber = big.NewInt(serial)
		tmpl.NotBefore, tmpl.NotAfter = time.Now().Add(-time.Hour), time.Now().Add(time.Hour)
		tmpl.KeyUsage = x509.KeyUsageDigitalSignature
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		require.NoError(t, err)
		keyDER, err := x509.MarshalPKCS8PrivateKey(key)
		require.NoError(t, err)
		certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
		keyPEM := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
		cert, err := tls.X509KeyPair(certPEM, keyPEM)
		require.NoError(t, err)
		return cert, certPEM, keyPEM
	}
	p := &pki{pool: x509.NewCertPool(), caFile: filepath.Join(dir, "ca.pem"),
		clientCertFile: filepath.Join(dir, "client.pem"), clientKeyFile: filepath.Join(dir, "client-key.pem")}
	p.pool.AddCert(ca)
	p.server, _, _ = issue(2, &x509.Certificate{
		Subject: pkix.Name{CommonName: "localhost"}, DNSNames: []string{"localhost"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	})
	var certPEM, keyPEM []byte
	p.client, certPEM, keyPEM = issue(3, &x509.Certificate{
		Subject: pkix.Name{CommonName: "keel-output"}, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
	require.NoError(t, os.WriteFile(p.caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), 0o600))
	require.NoError(t, os.WriteFile(p.clientCertFile, certPEM, 0o600))
	require.NoError(t, os.WriteFile(p.clientKeyFile, keyPEM, 0o600))
	return p
}

// TestTLS: with the CA the sink writes over TLS; without it, with the
// wrong server name or in plaintext it fails, naming the problem.
func TestTLS(t *testing.T) {
	t.Parallel()
	p := newPKI(t)
	c := startCluster(t, kfake.TLS(&tls.Config{Certificates: []tls.Certificate{p.server}, MinVersion: tls.VersionTLS12}))
	addr := c.ListenAddrs()[0]
	withTLS := func(tlsCfg map[string]any) map[string]any {
		cfg := sinkConfig(addr)
		cfg["tls"] = tlsCfg
		return cfg
	}

	s, err := configure(t, withTLS(map[string]any{"ca_file": p.caFile}))
	require.NoError(t, err)
	recs := records(20, "tls")
	writeOK(t, s, recs)
	readBack(t, addr, &kafka.Dialer{TLS: &tls.Config{RootCAs: p.pool, MinVersion: tls.VersionTLS12}}, recs)

	t.Run("server name", func(t *testing.T) {
		s, err := configure(t, withTLS(map[string]any{"ca_file": p.caFile, "server_name": "localhost"}))
		require.NoError(t, err)
		writeOK(t, s, records(1, "tls"))
	})
	t.Run("without CA", func(t *testing.T) {
		s, err := configure(t, withTLS(map[string]any{}))
		require.NoError(t, err)
		require.Contains(t, writeFails(t, s, records(3, "x")), "certificate signed by unknown authority")
	})
	t.Run("wrong server name", func(t *testing.T) {
		s, err := configure(t, withTLS(map[string]any{"ca_file": p.caFile, "server_name": "kafka.example.com"}))
		require.NoError(t, err)
		require.Contains(t, writeFails(t, s, records(3, "x")), "not kafka.example.com")
	})
	t.Run("plaintext", func(t *testing.T) {
		s, err := configure(t, sinkConfig(addr))
		require.NoError(t, err)
		writeFails(t, s, records(3, "x"))
	})
}

// TestMutualTLS: a broker that requires client certificates accepts the
// sink's configured one and refuses the sink without it.
func TestMutualTLS(t *testing.T) {
	t.Parallel()
	p := newPKI(t)
	c := startCluster(t, kfake.TLS(&tls.Config{
		Certificates: []tls.Certificate{p.server}, ClientCAs: p.pool,
		ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12,
	}))
	addr := c.ListenAddrs()[0]
	withTLS := func(tlsCfg map[string]any) map[string]any {
		cfg := sinkConfig(addr)
		cfg["tls"] = tlsCfg
		return cfg
	}

	s, err := configure(t, withTLS(map[string]any{"ca_file": p.caFile, "cert_file": p.clientCertFile, "key_file": p.clientKeyFile}))
	require.NoError(t, err)
	recs := records(20, "mtls")
	writeOK(t, s, recs)
	readBack(t, addr, &kafka.Dialer{TLS: &tls.Config{RootCAs: p.pool, Certificates: []tls.Certificate{p.client}, MinVersion: tls.VersionTLS12}}, recs)

	t.Run("without client certificate", func(t *testing.T) {
		s, err := configure(t, withTLS(map[string]any{"ca_file": p.caFile}))
		require.NoError(t, err)
		require.Contains(t, writeFails(t, s, records(3, "x")), "certificate required")
	})
}

// TestTLSWithSASL is the usual production setup: SCRAM over TLS.
func TestTLSWithSASL(t *testing.T) {
	t.Parallel()
	p := newPKI(t)
	c := startCluster(t, kfake.TLS(&tls.Config{Certificates: []tls.Certificate{p.server}, MinVersion: tls.VersionTLS12}),
		kfake.EnableSASL(), kfake.Superuser("SCRAM-SHA-512", "keel", "s3cret"))
	addr := c.ListenAddrs()[0]
	cfg := sinkConfig(addr)
	cfg["tls"] = map[string]any{"ca_file": p.caFile}
	cfg["sasl"] = map[string]any{"mechanism": "scram-sha-512", "username": "keel", "password": "s3cret"}
	s, err := configure(t, cfg)
	require.NoError(t, err)
	recs := records(20, "tls+sasl")
	writeOK(t, s, recs)
	readBack(t, addr, &kafka.Dialer{
		TLS:           &tls.Config{RootCAs: p.pool, MinVersion: tls.VersionTLS12},
		SASLMechanism: mustScram(scram.SHA512, "keel", "s3cret"),
	}, recs)
}

// TestAcks observes the acks of every produce request the broker gets:
// -1 (all replicas) unless the configuration asks for fewer.
func TestAcks(t *testing.T) {
	t.Parallel()
	for acks, want := range map[string]int16{"": -1, "all": -1, "one": 1, "none": 0} {
		t.Run(fmt.Sprintf("acks=%q", acks), func(t *testing.T) {
			t.Parallel()
			c := startCluster(t)
			var mu sync.Mutex
			var seen []int16
			c.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
				c.KeepControl()
				mu.Lock()
				seen = append(seen, req.(*kmsg.ProduceRequest).Acks)
				mu.Unlock()
				return nil, nil, false
			})
			addr := c.ListenAddrs()[0]
			cfg := sinkConfig(addr)
			if acks != "" {
				cfg["acks"] = acks
			}
			s, err := configure(t, cfg)
			require.NoError(t, err)
			recs := records(10, "acks")
			writeOK(t, s, recs[:5])
			writeOK(t, s, recs[5:])
			readBack(t, addr, nil, recs)

			mu.Lock()
			defer mu.Unlock()
			require.NotEmpty(t, seen, "no produce request reached the broker")
			for _, a := range seen {
				require.Equal(t, want, a, "acks of a produce request, all seen: %v", seen)
			}
		})
	}
}

// TestUserPropertyHeaders: a user property named like Keel's own headers
// reaches Kafka under its reserved prefix, so the record carries one
// keel-tenant header, the real one.
func TestUserPropertyHeaders(t *testing.T) {
	t.Parallel()
	c := startCluster(t)
	addr := c.ListenAddrs()[0]
	s, err := configure(t, sinkConfig(addr))
	require.NoError(t, err)
	recs := records(1, "props")
	recs[0].Message.UserProperties = []*commonv1.UserProperty{{Key: "keel-tenant", Value: "beta"}, {Key: "region", Value: "eu"}}
	writeOK(t, s, recs)

	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: []string{addr}, Topic: topic, MaxWait: 50 * time.Millisecond})
	defer func() { _ = r.Close() }()
	m, err := r.ReadMessage(ctx)
	require.NoError(t, err)
	var tenants []string
	props := map[string]string{}
	for _, h := range m.Headers {
		if strings.EqualFold(h.Key, meta.HeaderTenant) {
			tenants = append(tenants, string(h.Value))
		}
		props[h.Key] = string(h.Value)
	}
	require.Equal(t, []string{"acme"}, tenants)
	require.Equal(t, "beta", props[meta.UserPropertyPrefix+"keel-tenant"])
	require.Equal(t, "eu", props["region"])
}

// TestWrite_RecordsWithoutTopic: with no sink topic, a record that no
// transform gave a destination is refused on its own, not retryable, and
// the rest of its batch still reaches Kafka; a record the broker refuses
// is reported under its own index in the batch.
func TestWrite_RecordsWithoutTopic(t *testing.T) {
	t.Parallel()
	const refusedTopic = "mqtt-refused"
	c := startCluster(t, kfake.SeedTopics(1, refusedTopic))
	c.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		preq := req.(*kmsg.ProduceRequest)
		if len(preq.Topics) == 0 || preq.Topics[0].Topic != refusedTopic {
			return nil, nil, false
		}
		resp := preq.ResponseKind().(*kmsg.ProduceResponse)
		for _, rt := range preq.Topics {
			st := kmsg.NewProduceResponseTopic()
			st.Topic = rt.Topic
			for _, rp := range rt.Partitions {
				sp := kmsg.NewProduceResponseTopicPartition()
				sp.Partition = rp.Partition
				sp.ErrorCode = kerr.TopicAuthorizationFailed.Code
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	})
	addr := c.ListenAddrs()[0]
	cfg := sinkConfig(addr)
	delete(cfg, "topic")
	s, err := configure(t, cfg)
	require.NoError(t, err)

	recs := records(10, "mixed")
	topicless := []uint32{0, 4, 9}
	const refused = 6
	var produced []*pluginv1.Record
	for i, r := range recs {
		switch {
		case slices.Contains(topicless, uint32(i)):
		case i == refused:
			r.Destination = refusedTopic
		default:
			r.Destination = topic
			produced = append(produced, r)
		}
	}
	resp := write(t, s, recs)
	readBack(t, addr, nil, produced)

	failed := map[uint32]*pluginv1.RecordFailure{}
	for _, f := range resp.GetFailures() {
		require.NotContains(t, failed, f.GetIndex(), "record %d reported twice", f.GetIndex())
		failed[f.GetIndex()] = f
	}
	for _, i := range topicless {
		require.Contains(t, failed, i, "record %d has no topic: unless reported failed, the host counts it written", i)
		require.False(t, failed[i].GetRetryable(), "no retry gives record %d a topic", i)
		require.Contains(t, failed[i].GetMessage(), "no kafka topic")
	}
	require.Contains(t, failed, uint32(refused), "the record the broker refused must be reported under its own index")
	require.False(t, failed[refused].GetRetryable(), failed[refused].GetMessage())
	require.Len(t, failed, len(topicless)+1, "the records with a topic the broker accepts must not fail")
}
