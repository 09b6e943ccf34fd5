package auth

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func verified(leaf *x509.Certificate) *tls.ConnectionState {
	return &tls.ConnectionState{VerifiedChains: [][]*x509.Certificate{{leaf}}}
}

func TestCertAuthenticator(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	leaf := &x509.Certificate{Subject: pkix.Name{CommonName: "device-1", OrganizationalUnit: []string{"acme"}, Organization: []string{"beta"}},
		DNSNames: []string{"d1.acme.example"}, NotAfter: time.Now().Add(time.Hour)}

	id, err := CertAuthenticator{}.Authenticate(ctx, &Request{TLS: verified(leaf)})
	require.NoError(t, err)
	require.Equal(t, "acme", id.Tenant)
	require.Equal(t, "device-1", id.Username)
	require.Equal(t, leaf.NotAfter, id.ExpiresAt)

	id, err = CertAuthenticator{IdentityFrom: "san-dns", TenantFrom: "o"}.Authenticate(ctx, &Request{TLS: verified(leaf)})
	require.NoError(t, err)
	require.Equal(t, "beta", id.Tenant)
	require.Equal(t, "d1.acme.example", id.Username)

	_, err = CertAuthenticator{}.Authenticate(ctx, &Request{})
	require.ErrorIs(t, err, ErrBadCredentials, "no certificate")
	_, err = CertAuthenticator{}.Authenticate(ctx, &Request{TLS: &tls.ConnectionState{}})
	require.ErrorIs(t, err, ErrBadCredentials, "unverified certificate")
	_, err = CertAuthenticator{TenantFrom: "fixed:"}.Authenticate(ctx, &Request{TLS: verified(leaf)})
	require.ErrorIs(t, err, ErrNotAuthorized, "empty tenant")

	// Certificate and password: both must admit, into the same tenant.
	pw := authFunc(func(_ context.Context, r *Request) (*Identity, error) {
		if string(r.Password) != "pw" {
			return nil, ErrBadCredentials
		}
		return &Identity{Tenant: "acme", ACL: &ACL{Publish: []string{"x"}}}, nil
	})
	id, err = CertAuthenticator{Password: pw}.Authenticate(ctx, &Request{TLS: verified(leaf), Password: []byte("pw")})
	require.NoError(t, err)
	require.Equal(t, []string{"x"}, id.ACL.Publish)
	_, err = CertAuthenticator{Password: pw}.Authenticate(ctx, &Request{TLS: verified(leaf), Password: []byte("no")})
	require.ErrorIs(t, err, ErrBadCredentials)
	_, err = CertAuthenticator{TenantFrom: "o", Password: pw}.Authenticate(ctx, &Request{TLS: verified(leaf), Password: []byte("pw")})
	require.ErrorIs(t, err, ErrNotAuthorized, "tenants disagree")
}
