package tlsconf

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

type ca struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newCA(t *testing.T, name string) *ca {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	cert, _ := x509.ParseCertificate(der)
	return &ca{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue returns a PEM certificate and key signed by c.
func (c *ca) issue(t *testing.T, serial int64, subject pkix.Name, notAfter time.Time, server bool) (certPEM, keyPEM []byte) {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: subject,
		NotBefore: time.Now().Add(-2 * time.Hour), NotAfter: notAfter, KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1)}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, c.cert, &key.PublicKey, c.key)
	require.NoError(t, err)
	kd, _ := x509.MarshalECPrivateKey(key)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kd})
}

func (c *ca) crl(t *testing.T, serials ...int64) []byte {
	t.Helper()
	var entries []x509.RevocationListEntry
	for _, s := range serials {
		entries = append(entries, x509.RevocationListEntry{SerialNumber: big.NewInt(s), RevocationTime: time.Now()})
	}
	der, err := x509.CreateRevocationList(rand.Reader, &x509.RevocationList{Number: big.NewInt(time.Now().UnixNano()),
		ThisUpdate: time.Now(), NextUpdate: time.Now().Add(time.Hour), RevokedCertificateEntries: entries}, c.cert, c.key)
	require.NoError(t, err)
	return pem.EncodeToMemory(&pem.Block{Type: "X509 CRL", Bytes: der})
}

func write(t *testing.T, dir, name string, b []byte) string {
	t.Helper()
	p := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(p, b, 0o600))
	return p
}

// Only a valid client certificate completes the handshake: expired, foreign
// and revoked ones are refused, and a CRL update is picked up without a
// restart.
func TestConfig_ClientCertificates(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	root, other := newCA(t, "keel test ca"), newCA(t, "someone else")
	srvCert, srvKey := root.issue(t, 100, pkix.Name{CommonName: "edge"}, time.Now().Add(time.Hour), true)
	files := Files{
		Cert: write(t, dir, "srv.pem", srvCert), Key: write(t, dir, "srv.key", srvKey),
		ClientCA: write(t, dir, "ca.pem", root.pem), CRL: write(t, dir, "crl.pem", root.crl(t, 7)),
	}
	c, err := Load(files, nil)
	require.NoError(t, err)
	ln, err := tls.Listen("tcp", "127.0.0.1:0", c.TLSConfig())
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { _ = conn.(*tls.Conn).Handshake(); _, _ = conn.Write([]byte("x")); _ = conn.Close() }()
		}
	}()
	pool := x509.NewCertPool()
	pool.AddCert(root.cert)
	dialWith := func(certPEM, keyPEM []byte) error {
		cert, err := tls.X509KeyPair(certPEM, keyPEM)
		require.NoError(t, err)
		conn, err := tls.Dial("tcp", ln.Addr().String(), &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}})
		if err != nil {
			return err
		}
		defer conn.Close()
		_, err = conn.Read(make([]byte, 1)) // TLS 1.3 reports a refused certificate on the first read
		return err
	}
	id := pkix.Name{CommonName: "device-1", OrganizationalUnit: []string{"acme"}}
	require.NoError(t, dialWith(root.issue(t, 1, id, time.Now().Add(time.Hour), false)), "valid")
	require.Error(t, dialWith(root.issue(t, 2, id, time.Now().Add(-time.Minute), false)), "expired")
	require.Error(t, dialWith(other.issue(t, 3, id, time.Now().Add(time.Hour), false)), "wrong ca")
	revokedCert, revokedKey := root.issue(t, 7, id, time.Now().Add(time.Hour), false)
	require.Error(t, dialWith(revokedCert, revokedKey), "revoked")

	laterCert, laterKey := root.issue(t, 8, id, time.Now().Add(time.Hour), false)
	require.NoError(t, dialWith(laterCert, laterKey))
	write(t, dir, "crl.pem", root.crl(t, 7, 8))
	require.NoError(t, c.Reload())
	require.Error(t, dialWith(laterCert, laterKey), "revoked by the reloaded CRL")

	// A CRL from another CA is refused, and the last good one stays.
	write(t, dir, "crl.pem", other.crl(t))
	require.Error(t, c.Reload())
	require.Error(t, dialWith(laterCert, laterKey))
}
