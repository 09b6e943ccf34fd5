package broker

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
	"github.com/golang-jwt/jwt/v5"
	"github.com/mochi-mqtt/server/v2/packets"
	"golang.org/x/crypto/bcrypt"

	"github.com/keelmq/keel/services/edge/internal/auth"
	"github.com/keelmq/keel/services/edge/internal/listener"
	"github.com/keelmq/keel/services/edge/internal/tlsconf"
)

// BenchmarkBroker_Connect is full MQTT 3.1.1 connects through a real
// listener of one edge, per authentication method: TCP (or TLS) connect,
// CONNECT, CONNACK, DISCONNECT, close. Clients connect concurrently (4 per
// CPU) with fresh client IDs, and run in the same process as the edge, so
// they share its CPUs; connects/s is the edge's rate on this machine.
//
//   - anonymous: no credentials checked, the floor of the connect path;
//   - bcrypt: the password file with bcrypt hashes at cost 10
//     (bcrypt.DefaultCost, as in the file's documented example). "cold"
//     verifies bcrypt on every connect (each user connects once per file
//     load; the file is reloaded every 512 connects, which drops the
//     verified-password cache); "cached" is the same user reconnecting,
//     which the file backend answers from its cache of verified passwords;
//   - argon2id: the same as bcrypt-cold with the argon2id hashes keelctl
//     writes (m=64 MiB, t=3, p=4);
//   - jwt-rs256: an RS256 token (2048-bit key) in the password, verified
//     against keys fetched once from an httptest JWKS endpoint and cached;
//   - mtls: a full TLS 1.3 handshake per connect (no session resumption),
//     ECDSA P-256 certificates from a test CA, the client certificate
//     verified and mapped to user and tenant (CN, OU), with the edge's own
//     TLS setup (tlsconf). The client's half of each handshake runs on the
//     same CPUs.
//
// Not run in CI (only compiled); for figures run for example
//
//	go test -run '^$' -bench BenchmarkBroker_Connect -benchtime 3s ./internal/broker/
func BenchmarkBroker_Connect(b *testing.B) {
	b.Run("method=anonymous", func(b *testing.B) {
		addr := benchAuthBroker(b, anonymous(), nil)
		benchConnects(b, tcpDialer(addr), func(uint64) (string, []byte) { return "", nil })
	})
	for _, tc := range []struct {
		name   string
		hash   func() string
		cached bool
	}{
		{"method=bcrypt-cold", func() string { return mustHash(auth.HashBcrypt([]byte("pw"), bcrypt.DefaultCost)) }, false},
		{"method=bcrypt-cached", func() string { return mustHash(auth.HashBcrypt([]byte("pw"), bcrypt.DefaultCost)) }, true},
		{"method=argon2id-cold", func() string { return mustHash(auth.HashArgon2id([]byte("pw"))) }, false},
	} {
		b.Run(tc.name, func(b *testing.B) {
			const users = 512
			fa := benchPasswordFile(b, tc.hash(), users)
			if tc.cached {
				// The first connect verifies the hash and caches the result.
				if _, err := fa.Authenticate(context.Background(), &auth.Request{Username: "u0@acme", Password: []byte("pw")}); err != nil {
					b.Fatal(err)
				}
			}
			addr := benchAuthBroker(b, fa, nil)
			benchConnects(b, tcpDialer(addr), func(n uint64) (string, []byte) {
				if tc.cached {
					return "u0@acme", []byte("pw")
				}
				if n > 0 && n%users == 0 {
					_ = fa.Reload() // forget verified passwords: every connect pays for the hash
				}
				return fmt.Sprintf("u%d@acme", n%users), []byte("pw")
			})
		})
	}
	b.Run("method=jwt-rs256", func(b *testing.B) {
		ja, tokens := benchJWT(b, 64)
		addr := benchAuthBroker(b, ja, nil)
		benchConnects(b, tcpDialer(addr), func(n uint64) (string, []byte) { return "", tokens[n%uint64(len(tokens))] })
	})
	b.Run("method=mtls", func(b *testing.B) {
		serverTLS, clientCerts, roots := benchPKI(b, 16)
		addr := benchAuthBroker(b, auth.CertAuthenticator{}, serverTLS)
		var next atomic.Uint64
		dial := func() (net.Conn, error) {
			cert := clientCerts[next.Add(1)%uint64(len(clientCerts))]
			return tls.Dial("tcp", addr, &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{cert},
				ServerName: "127.0.0.1", ClientSessionCache: nil, MinVersion: tls.VersionTLS12})
		}
		benchConnects(b, dial, func(uint64) (string, []byte) { return "", nil })
	})
}

func mustHash(h string, err error) string {
	if err != nil {
		panic(err)
	}
	return h
}

// benchAuthBroker runs a broker with authn on a loopback listener (TLS when
// tlsCfg is set) and returns its address.
func benchAuthBroker(b *testing.B, authn auth.Authenticator, tlsCfg *tls.Config) string {
	b.Helper()
	cfg := DefaultConfig()
	cfg.EdgeID = "bench"
	brk, err := New(cfg, authn, nil, nil)
	if err != nil {
		b.Fatal(err)
	}
	l := listener.NewTCP("bench", "127.0.0.1:0", tlsCfg)
	if err := brk.AddListener(l); err != nil {
		b.Fatal(err)
	}
	if err := brk.Serve(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = brk.Close() })
	return l.Address()
}

func tcpDialer(addr string) func() (net.Conn, error) {
	return func() (net.Conn, error) { return net.Dial("tcp", addr) }
}

var benchClientSeq atomic.Uint64

// benchConnects runs b.N connects concurrently; creds gives the user name
// and password of the n-th connect (a nil password sends none).
func benchConnects(b *testing.B, dial func() (net.Conn, error), creds func(n uint64) (user string, pw []byte)) {
	var seq atomic.Uint64
	disconnect := []byte{packets.Disconnect << 4, 0}
	b.SetParallelism(4)
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		connack := make([]byte, 4)
		var buf bytes.Buffer
		for pb.Next() {
			user, pw := creds(seq.Add(1) - 1)
			pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, ProtocolVersion: 4,
				Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: true, Keepalive: 60,
					ClientIdentifier: fmt.Sprintf("c%d", benchClientSeq.Add(1))}}
			if user != "" {
				pk.Connect.UsernameFlag, pk.Connect.Username = true, []byte(user)
			}
			if pw != nil {
				pk.Connect.PasswordFlag, pk.Connect.Password = true, pw
			}
			buf.Reset()
			if err := pk.ConnectEncode(&buf); err != nil {
				b.Error(err)
				return
			}
			c, err := dial()
			if err != nil {
				b.Error(err)
				return
			}
			_, err = c.Write(buf.Bytes())
			if err == nil {
				_, err = io.ReadFull(c, connack)
			}
			if err == nil && connack[3] != 0 {
				err = fmt.Errorf("connack return code %#x", connack[3])
			}
			if err == nil {
				_, err = c.Write(disconnect)
			}
			_ = c.Close()
			if err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "connects/s")
}

// benchPasswordFile writes a password file of tenant acme with users
// u0..u<n-1>, all with hash, and loads it.
func benchPasswordFile(b *testing.B, hash string, n int) *auth.FileAuthenticator {
	b.Helper()
	var sb strings.Builder
	sb.WriteString("tenants:\n  acme:\n    users:\n")
	for i := range n {
		fmt.Fprintf(&sb, "      u%d: {password: %q}\n", i, hash)
	}
	path := filepath.Join(b.TempDir(), "users.yaml")
	if err := os.WriteFile(path, []byte(sb.String()), 0o600); err != nil {
		b.Fatal(err)
	}
	fa, err := auth.NewFileAuthenticator(path, nil)
	if err != nil {
		b.Fatal(err)
	}
	return fa
}

// benchJWT serves an RS256 JWKS from an httptest server and returns an
// authenticator that fetched it, and n tokens for distinct devices.
func benchJWT(b *testing.B, n int) (*auth.JWTAuthenticator, [][]byte) {
	b.Helper()
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		b.Fatal(err)
	}
	jwks, _ := json.Marshal(jose.JSONWebKeySet{Keys: []jose.JSONWebKey{{Key: &key.PublicKey, KeyID: "k1", Algorithm: "RS256", Use: "sig"}}})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(jwks) }))
	b.Cleanup(srv.Close)
	ja, err := auth.NewJWTAuthenticator(context.Background(), auth.JWTConfig{JWKSURL: srv.URL, Issuer: "https://idp.test",
		Audience: "keel", TenantClaim: "tenant", ACLClaim: "acl", Leeway: 30 * time.Second}, nil)
	if err != nil {
		b.Fatal(err)
	}
	tokens := make([][]byte, n)
	for i := range tokens {
		tok := jwt.NewWithClaims(jwt.SigningMethodRS256, jwt.MapClaims{
			"iss": "https://idp.test", "aud": "keel", "sub": fmt.Sprintf("device-%d", i), "tenant": "acme",
			"exp": time.Now().Add(time.Hour).Unix(), "nbf": time.Now().Add(-time.Minute).Unix(),
			"acl": map[string]any{"publish": []string{"devices/%u/#"}, "subscribe": []string{"cmd/%u/#"}},
		})
		tok.Header["kid"] = "k1"
		s, err := tok.SignedString(key)
		if err != nil {
			b.Fatal(err)
		}
		tokens[i] = []byte(s)
	}
	return ja, tokens
}

// benchPKI makes a test CA, a server certificate for 127.0.0.1 loaded
// through tlsconf as the edge loads its files, and n client certificates
// (CN device-i, OU acme). Every key is ECDSA P-256.
func benchPKI(b *testing.B, n int) (*tls.Config, []tls.Certificate, *x509.CertPool) {
	b.Helper()
	newKey := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			b.Fatal(err)
		}
		return k
	}
	serial := int64(0)
	issue := func(tmpl *x509.Certificate, parent *x509.Certificate, parentKey *ecdsa.PrivateKey, key *ecdsa.PrivateKey) *x509.Certificate {
		serial++
		tmpl.SerialNumber = big.NewInt(serial)
		tmpl.NotBefore, tmpl.NotAfter = time.Now().Add(-time.Hour), time.Now().Add(24*time.Hour)
		if parent == nil {
			parent, parentKey = tmpl, key
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
		if err != nil {
			b.Fatal(err)
		}
		c, err := x509.ParseCertificate(der)
		if err != nil {
			b.Fatal(err)
		}
		return c
	}
	caKey := newKey()
	ca := issue(&x509.Certificate{Subject: pkix.Name{CommonName: "keel bench ca"}, IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}, nil, nil, caKey)
	srvKey := newKey()
	srv := issue(&x509.Certificate{Subject: pkix.Name{CommonName: "edge"}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, KeyUsage: x509.KeyUsageDigitalSignature}, ca, caKey, srvKey)

	dir := b.TempDir()
	writePEM := func(name, typ string, der []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			b.Fatal(err)
		}
		return p
	}
	srvKeyDER, _ := x509.MarshalECPrivateKey(srvKey)
	files := tlsconf.Files{Cert: writePEM("server.pem", "CERTIFICATE", srv.Raw), Key: writePEM("server.key", "EC PRIVATE KEY", srvKeyDER),
		ClientCA: writePEM("ca.pem", "CERTIFICATE", ca.Raw)}
	tc, err := tlsconf.Load(files, nil)
	if err != nil {
		b.Fatal(err)
	}
	certs := make([]tls.Certificate, n)
	for i := range certs {
		k := newKey()
		c := issue(&x509.Certificate{Subject: pkix.Name{CommonName: fmt.Sprintf("device-%d", i), OrganizationalUnit: []string{"acme"}},
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}, KeyUsage: x509.KeyUsageDigitalSignature}, ca, caKey, k)
		certs[i] = tls.Certificate{Certificate: [][]byte{c.Raw}, PrivateKey: k, Leaf: c}
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	return tc.TLSConfig(), certs, roots
}
