// Package tlsconf builds the edge's TLS configuration from files and keeps
// it current: the server certificate, the client CA pool and the CRL are
// read again when they change on disk, without dropping connections.
package tlsconf

import (
	"bytes"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"os"
	"sync/atomic"
	"time"
)

// Files names the PEM files of a listener's TLS setup.
type Files struct {
	Cert     string // server certificate chain
	Key      string // server private key
	ClientCA string // when set, clients must present a certificate it signed
	CRL      string // optional certificate revocation list (PEM or DER) of the client CA
}

// ErrRevoked reports a client certificate listed in the CRL.
var ErrRevoked = errors.New("client certificate revoked")

type state struct {
	cfg     *tls.Config
	revoked map[string]bool // serial numbers, as decimal strings
	digest  [32]byte        // of all the files, to notice changes
}

// Config serves a current *tls.Config.
type Config struct {
	files  Files
	logger *slog.Logger
	cur    atomic.Pointer[state]
}

// Load reads the files once.
func Load(files Files, logger *slog.Logger) (*Config, error) {
	c := &Config{files: files, logger: logger}
	st, err := c.build()
	if err != nil {
		return nil, err
	}
	c.cur.Store(st)
	return c, nil
}

// TLSConfig returns the config to hand to a listener. Every handshake uses
// the files as they were last read.
func (c *Config) TLSConfig() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			return c.cur.Load().cfg, nil
		},
	}
}

// Watch reads the files again every interval and swaps in a config when they
// changed; a set that fails to load leaves the last good one in force.
func (c *Config) Watch(done <-chan struct{}, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-t.C:
		}
		if err := c.Reload(); err != nil && c.logger != nil {
			c.logger.Error("tls files reload failed; keeping the previous ones", "error", err)
		}
	}
}

// Reload reads the files now.
func (c *Config) Reload() error {
	d, err := c.digest()
	if err != nil {
		return err
	}
	if d == c.cur.Load().digest {
		return nil
	}
	st, err := c.build()
	if err != nil {
		return err
	}
	c.cur.Store(st)
	if c.logger != nil {
		c.logger.Info("tls files reloaded", "cert", c.files.Cert, "client_ca", c.files.ClientCA, "crl", c.files.CRL)
	}
	return nil
}

func (c *Config) digest() ([32]byte, error) {
	h := sha256.New()
	for _, p := range []string{c.files.Cert, c.files.Key, c.files.ClientCA, c.files.CRL} {
		if p == "" {
			continue
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return [32]byte{}, err
		}
		h.Write(b)
	}
	var d [32]byte
	h.Sum(d[:0])
	return d, nil
}

func (c *Config) build() (*state, error) {
	d, err := c.digest()
	if err != nil {
		return nil, fmt.Errorf("tls: %w", err)
	}
	cert, err := tls.LoadX509KeyPair(c.files.Cert, c.files.Key)
	if err != nil {
		return nil, fmt.Errorf("tls: load key pair: %w", err)
	}
	st := &state{digest: d, cfg: &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}}
	if c.files.ClientCA == "" {
		return st, nil
	}
	pemBytes, err := os.ReadFile(c.files.ClientCA)
	if err != nil {
		return nil, fmt.Errorf("tls: client ca: %w", err)
	}
	pool := x509.NewCertPool()
	var cas []*x509.Certificate
	rest := pemBytes
	for {
		var block *pem.Block
		block, rest = pem.Decode(rest)
		if block == nil {
			break
		}
		if ca, err := x509.ParseCertificate(block.Bytes); err == nil {
			pool.AddCert(ca)
			cas = append(cas, ca)
		}
	}
	if len(cas) == 0 {
		return nil, fmt.Errorf("tls: client ca %s: no PEM certificates", c.files.ClientCA)
	}
	st.cfg.ClientCAs = pool
	st.cfg.ClientAuth = tls.RequireAndVerifyClientCert
	if c.files.CRL != "" {
		st.revoked, err = loadCRL(c.files.CRL, cas)
		if err != nil {
			return nil, err
		}
		revoked := st.revoked
		st.cfg.VerifyPeerCertificate = func(_ [][]byte, chains [][]*x509.Certificate) error {
			for _, chain := range chains {
				if len(chain) > 0 && revoked[chain[0].SerialNumber.String()] {
					return ErrRevoked
				}
			}
			return nil
		}
	}
	return st, nil
}

// loadCRL parses a CRL signed by one of cas.
func loadCRL(path string, cas []*x509.Certificate) (map[string]bool, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("tls: crl: %w", err)
	}
	if block, _ := pem.Decode(b); block != nil {
		b = block.Bytes
	}
	crl, err := x509.ParseRevocationList(b)
	if err != nil {
		return nil, fmt.Errorf("tls: crl %s: %w", path, err)
	}
	var signed bool
	for _, ca := range cas {
		if bytes.Equal(ca.RawSubject, crl.RawIssuer) && crl.CheckSignatureFrom(ca) == nil {
			signed = true
			break
		}
	}
	if !signed {
		return nil, fmt.Errorf("tls: crl %s: not signed by the client CA", path)
	}
	out := make(map[string]bool, len(crl.RevokedCertificateEntries))
	for _, e := range crl.RevokedCertificateEntries {
		out[new(big.Int).Set(e.SerialNumber).String()] = true
	}
	return out, nil
}
