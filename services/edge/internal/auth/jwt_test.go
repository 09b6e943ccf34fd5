package auth

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
	"github.com/golang-jwt/jwt/v5"
	"github.com/stretchr/testify/require"
)

// idp is a test identity provider: a JWKS endpoint whose keys can rotate.
type idp struct {
	mu      sync.Mutex
	keys    []jose.JSONWebKey
	fetches atomic.Int32
	srv     *httptest.Server
}

func newIDP(t *testing.T) *idp {
	p := &idp{}
	p.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		p.fetches.Add(1)
		p.mu.Lock()
		defer p.mu.Unlock()
		_ = json.NewEncoder(w).Encode(jose.JSONWebKeySet{Keys: p.keys})
	}))
	t.Cleanup(p.srv.Close)
	return p
}

func (p *idp) publish(kid, alg string, pub crypto.PublicKey) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.keys = append(p.keys, jose.JSONWebKey{Key: pub, KeyID: kid, Algorithm: alg, Use: "sig"})
}

func sign(t *testing.T, method jwt.SigningMethod, kid string, key any, claims jwt.MapClaims) []byte {
	t.Helper()
	tok := jwt.NewWithClaims(method, claims)
	tok.Header["kid"] = kid
	s, err := tok.SignedString(key)
	require.NoError(t, err)
	return []byte(s)
}

func goodClaims() jwt.MapClaims {
	return jwt.MapClaims{
		"iss": "https://idp.test", "aud": "keel", "sub": "device-1", "tenant": "acme",
		"exp": time.Now().Add(time.Hour).Unix(), "nbf": time.Now().Add(-time.Minute).Unix(),
		"acl": map[string]any{"publish": []string{"devices/%u/#"}, "subscribe": []string{"cmd/%u/#"}},
	}
}

func TestJWTAuthenticator(t *testing.T) {
	t.Parallel()
	p := newIDP(t)
	rsaKey, err := rsa.GenerateKey(rand.Reader, 2048)
	require.NoError(t, err)
	ecKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	edPub, edKey, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	p.publish("rsa-1", "RS256", &rsaKey.PublicKey)
	p.publish("ec-1", "ES256", &ecKey.PublicKey)
	p.publish("ed-1", "EdDSA", edPub)

	ctx := context.Background()
	a, err := NewJWTAuthenticator(ctx, JWTConfig{JWKSURL: p.srv.URL, Issuer: "https://idp.test", Audience: "keel",
		TenantClaim: "tenant", ACLClaim: "acl", Leeway: 5 * time.Second, MinRefresh: time.Millisecond}, nil)
	require.NoError(t, err)

	for _, tc := range []struct {
		name   string
		method jwt.SigningMethod
		kid    string
		key    any
	}{
		{"rs256", jwt.SigningMethodRS256, "rsa-1", rsaKey},
		{"es256", jwt.SigningMethodES256, "ec-1", ecKey},
		{"eddsa", jwt.SigningMethodEdDSA, "ed-1", edKey},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id, err := a.Authenticate(ctx, &Request{Password: sign(t, tc.method, tc.kid, tc.key, goodClaims())})
			require.NoError(t, err)
			require.Equal(t, "acme", id.Tenant)
			require.Equal(t, "device-1", id.Username)
			require.Equal(t, []string{"devices/%u/#"}, id.ACL.Publish)
			require.WithinDuration(t, time.Now().Add(time.Hour), id.ExpiresAt, 5*time.Second)
		})
	}

	otherKey, _ := rsa.GenerateKey(rand.Reader, 2048)
	expired := goodClaims()
	expired["exp"] = time.Now().Add(-time.Minute).Unix()
	wrongAud := goodClaims()
	wrongAud["aud"] = "someone-else"
	noTenant := goodClaims()
	delete(noTenant, "tenant")
	pubDER, _ := x509.MarshalPKIXPublicKey(&rsaKey.PublicKey)
	noneTok, _ := jwt.NewWithClaims(jwt.SigningMethodNone, goodClaims()).SignedString(jwt.UnsafeAllowNoneSignatureType)
	for _, tc := range []struct {
		name  string
		token []byte
		want  error
	}{
		{"forged", sign(t, jwt.SigningMethodRS256, "rsa-1", otherKey, goodClaims()), ErrBadCredentials},
		{"expired", sign(t, jwt.SigningMethodRS256, "rsa-1", rsaKey, expired), ErrNotAuthorized},
		{"wrong_audience", sign(t, jwt.SigningMethodRS256, "rsa-1", rsaKey, wrongAud), ErrBadCredentials},
		{"no_tenant", sign(t, jwt.SigningMethodRS256, "rsa-1", rsaKey, noTenant), ErrNotAuthorized},
		{"alg_none", []byte(noneTok), ErrBadCredentials},
		// HS/RS confusion: an HMAC token "signed" with the public key.
		{"hs256_with_public_key", sign(t, jwt.SigningMethodHS256, "rsa-1", pubDER, goodClaims()), ErrBadCredentials},
		{"key_of_wrong_type", sign(t, jwt.SigningMethodES256, "rsa-1", ecKey, goodClaims()), ErrBadCredentials},
		{"garbage", []byte("not.a.token"), ErrBadCredentials},
		{"empty", nil, ErrBadCredentials},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := a.Authenticate(ctx, &Request{Password: tc.token})
			require.ErrorIs(t, err, tc.want)
		})
	}

	// Rotation: a token signed by a key published after start is accepted
	// once the unknown kid triggers a fetch.
	t.Run("rotation", func(t *testing.T) {
		newKey, _ := rsa.GenerateKey(rand.Reader, 2048)
		p.publish("rsa-2", "RS256", &newKey.PublicKey)
		before := p.fetches.Load()
		_, err := a.Authenticate(ctx, &Request{Password: sign(t, jwt.SigningMethodRS256, "rsa-2", newKey, goodClaims())})
		require.NoError(t, err)
		require.Greater(t, p.fetches.Load(), before)
	})
}

// Unknown key IDs cannot make the edge hammer the identity provider.
func TestJWTAuthenticator_RefreshRateLimited(t *testing.T) {
	t.Parallel()
	p := newIDP(t)
	k, _ := rsa.GenerateKey(rand.Reader, 2048)
	p.publish("k", "RS256", &k.PublicKey)
	a, err := NewJWTAuthenticator(context.Background(), JWTConfig{JWKSURL: p.srv.URL, DefaultTenant: "d", MinRefresh: time.Hour}, nil)
	require.NoError(t, err)
	for range 20 {
		_, err := a.Authenticate(context.Background(), &Request{Password: sign(t, jwt.SigningMethodRS256, "unknown", k, goodClaims())})
		require.ErrorIs(t, err, ErrBadCredentials)
	}
	require.LessOrEqual(t, p.fetches.Load(), int32(2))
}
