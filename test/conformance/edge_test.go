package conformance

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/bcrypt"
)

// edge is a broker under test: a keel-edge process started by startEdge, or
// the external broker named by KEEL_CONFORMANCE_ADDR.
type edge struct {
	TCP string // host:port of the MQTT over TCP listener
	WS  string // host:port of the WebSocket listener (path /mqtt); "" when unknown
	TLS string // host:port of the MQTT over TLS listener; "" when off
	Ops string // host:port of the ops endpoints

	external bool
	cmd      *exec.Cmd
	exited   chan struct{} // closed when the process has exited
	waitErr  error         // set before exited is closed
	stopOnce sync.Once
}

// skipIfExternal skips a test that needs an edge of its own (flags, restarts,
// Keel-specific behaviour) when the suite runs against an external broker.
func skipIfExternal(t *testing.T, why string) {
	t.Helper()
	if suite.external != "" {
		t.Skipf("needs keel-edge (%s); %s points at an external broker", why, envAddr)
	}
}

// startEdge starts a keel-edge with extraArgs on free loopback ports, waits
// until /readyz answers 200 and registers a cleanup that stops it with
// SIGTERM and checks it exits 0. Anonymous access is on unless extraArgs set
// an --auth.* flag. Passing --tls.cert also opens a TLS listener. Against an
// external broker it returns that broker, and skips when extraArgs is not
// empty.
func startEdge(t *testing.T, extraArgs ...string) *edge {
	t.Helper()
	if suite.skip != "" {
		t.Skip(suite.skip)
	}
	if suite.external != "" {
		if len(extraArgs) > 0 {
			t.Skipf("needs keel-edge started with %v; %s points at an external broker", extraArgs, envAddr)
		}
		return &edge{TCP: suite.external, WS: suite.wsAddr, external: true}
	}
	return startEdgeAt(t, "", extraArgs...)
}

// startEdgeAt is startEdge with the MQTT over TCP listener on tcpAddr (a
// free loopback port when empty).
func startEdgeAt(t *testing.T, tcpAddr string, extraArgs ...string) *edge {
	t.Helper()
	var lastErr error
	for attempt := 1; attempt <= 3; attempt++ {
		e, err := launchEdge(t, tcpAddr, extraArgs)
		if err == nil {
			return e
		}
		lastErr = err
		t.Logf("keel-edge start attempt %d failed: %v", attempt, err)
	}
	t.Fatalf("start keel-edge: %v", lastErr)
	return nil
}

func launchEdge(t *testing.T, tcpAddr string, extraArgs []string) (*edge, error) {
	if tcpAddr == "" {
		tcpAddr = freeAddr(t)
	}
	e := &edge{TCP: tcpAddr, WS: freeAddr(t), Ops: freeAddr(t), exited: make(chan struct{})}
	args := []string{
		"--mqtt.tcp-addr", e.TCP,
		"--mqtt.ws-addr", e.WS,
		"--ops.addr", e.Ops,
		"--data-dir", t.TempDir(),
		"--mqtt.edge-id", "conformance",
		"--log.level", "debug",
		"--log.format", "text",
		"--stop-timeout", "3s",
	}
	auth, tls := false, false
	for _, a := range extraArgs {
		auth = auth || strings.HasPrefix(a, "--auth.")
		tls = tls || strings.HasPrefix(a, "--tls.cert")
	}
	if !auth {
		args = append(args, "--auth.anonymous=true")
	}
	if tls {
		e.TLS = freeAddr(t)
		args = append(args, "--mqtt.tls-addr", e.TLS)
	}
	args = append(args, extraArgs...)
	e.cmd = exec.Command(suite.bin, args...)
	logs := &logWriter{t: t, prefix: "edge: "}
	e.cmd.Stdout, e.cmd.Stderr = logs, logs
	if err := e.cmd.Start(); err != nil {
		return nil, err
	}
	go func() {
		e.waitErr = e.cmd.Wait()
		close(e.exited)
	}()
	client := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(15 * time.Second)
	for {
		select {
		case <-e.exited:
			return nil, fmt.Errorf("keel-edge exited before it was ready: %v", e.waitErr)
		default:
		}
		resp, err := client.Get("http://" + e.Ops + "/readyz")
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(deadline) {
			_ = e.cmd.Process.Kill()
			<-e.exited
			return nil, fmt.Errorf("keel-edge not ready within 15s (last error %v)", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Cleanup(func() { e.stop(t) })
	return e, nil
}

// stop sends SIGTERM and checks the edge exits 0 within 5 s. Safe to call
// more than once; a no-op for an external broker.
func (e *edge) stop(t *testing.T) {
	t.Helper()
	if e.external {
		return
	}
	e.stopOnce.Do(func() {
		_ = e.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-e.exited:
			if e.waitErr != nil {
				t.Errorf("keel-edge did not exit cleanly after SIGTERM: %v", e.waitErr)
			}
		case <-time.After(5 * time.Second):
			_ = e.cmd.Process.Kill()
			<-e.exited
			t.Errorf("keel-edge did not exit within 5s of SIGTERM")
		}
	})
}

// freeAddr returns a loopback address with a port that was free a moment ago.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return addr
}

// logWriter sends each line written to it to t.Log.
type logWriter struct {
	t      *testing.T
	prefix string
	mu     sync.Mutex
	buf    []byte
}

func (w *logWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = append(w.buf, p...)
	for {
		i := bytes.IndexByte(w.buf, '\n')
		if i < 0 {
			break
		}
		w.t.Log(w.prefix + string(w.buf[:i]))
		w.buf = w.buf[i+1:]
	}
	return len(p), nil
}

// hashPassword returns a bcrypt hash of password at the lowest cost, so that
// tests authenticate quickly.
func hashPassword(t *testing.T, password string) string {
	t.Helper()
	h, err := bcrypt.GenerateFromPassword([]byte(password), bcrypt.MinCost)
	require.NoError(t, err)
	return string(h)
}

// writeFile writes content to a new file in the test's temporary directory
// and returns its path.
func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	require.NoError(t, os.WriteFile(path, []byte(content), 0o600))
	return path
}

// selfSignedCert writes a self-signed certificate for 127.0.0.1 and its key,
// returning their paths and the parsed certificate.
func selfSignedCert(t *testing.T) (certPath, keyPath string, cert *x509.Certificate) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "keel-conformance"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IPAddresses:           []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	cert, err = x509.ParseCertificate(der)
	require.NoError(t, err)
	keyDER, err := x509.MarshalECPrivateKey(key)
	require.NoError(t, err)
	certPath = writeFile(t, "cert.pem", string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})))
	keyPath = writeFile(t, "key.pem", string(pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})))
	return certPath, keyPath, cert
}
