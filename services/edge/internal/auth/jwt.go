package auth

import (
	"context"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/rsa"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/go-jose/go-jose/v4"
	"github.com/golang-jwt/jwt/v5"
)

// JWTConfig configures token authentication against an OIDC-style JWKS.
type JWTConfig struct {
	// JWKSURL is where the identity provider publishes its signing keys.
	JWKSURL string
	// Issuer and Audience, when set, must match the iss and aud claims.
	Issuer   string
	Audience string
	// Algorithms allowed; only asymmetric ones are accepted (no "none", no
	// HMAC, so a public key can never be used as an HMAC secret).
	Algorithms []string
	// Leeway is the clock skew tolerated on exp, nbf and iat.
	Leeway time.Duration
	// TenantClaim names the claim holding the tenant; DefaultTenant is used
	// when the token has none (empty: such tokens are refused).
	TenantClaim   string
	DefaultTenant string
	// UsernameClaim names the claim used as the user name (default "sub").
	UsernameClaim string
	// ACLClaim names a claim of the form {"publish": [...], "subscribe": [...]};
	// absent, the client may use every topic of its tenant.
	ACLClaim string
	// Refresh is how often keys are fetched again; an unknown kid triggers a
	// fetch at most once per MinRefresh.
	Refresh    time.Duration
	MinRefresh time.Duration
	// HTTPClient fetches the JWKS (default: 10 s timeout).
	HTTPClient *http.Client
}

var defaultJWTAlgorithms = []string{"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}

// JWTAuthenticator admits clients whose password is a JWT signed by a key of
// the configured JWKS.
type JWTAuthenticator struct {
	cfg    JWTConfig
	logger *slog.Logger
	parser *jwt.Parser

	mu       sync.Mutex
	keys     map[string]any // kid -> public key
	fetched  time.Time
	lastTry  time.Time
	fetchErr error
}

// NewJWTAuthenticator validates cfg and fetches the keys once.
func NewJWTAuthenticator(ctx context.Context, cfg JWTConfig, logger *slog.Logger) (*JWTAuthenticator, error) {
	if cfg.JWKSURL == "" {
		return nil, errors.New("jwt: a JWKS URL is required")
	}
	if len(cfg.Algorithms) == 0 {
		cfg.Algorithms = defaultJWTAlgorithms
	}
	for _, a := range cfg.Algorithms {
		if !slices.Contains(defaultJWTAlgorithms, a) {
			return nil, fmt.Errorf("jwt: algorithm %q not allowed: want asymmetric ones (%v)", a, defaultJWTAlgorithms)
		}
	}
	if cfg.UsernameClaim == "" {
		cfg.UsernameClaim = "sub"
	}
	if cfg.Refresh <= 0 {
		cfg.Refresh = 10 * time.Minute
	}
	if cfg.MinRefresh <= 0 {
		cfg.MinRefresh = 10 * time.Second
	}
	if cfg.HTTPClient == nil {
		cfg.HTTPClient = &http.Client{Timeout: 10 * time.Second}
	}
	opts := []jwt.ParserOption{jwt.WithValidMethods(cfg.Algorithms), jwt.WithLeeway(cfg.Leeway), jwt.WithExpirationRequired()}
	if cfg.Issuer != "" {
		opts = append(opts, jwt.WithIssuer(cfg.Issuer))
	}
	if cfg.Audience != "" {
		opts = append(opts, jwt.WithAudience(cfg.Audience))
	}
	a := &JWTAuthenticator{cfg: cfg, logger: logger, parser: jwt.NewParser(opts...)}
	if err := a.refresh(ctx, true); err != nil {
		return nil, err
	}
	return a, nil
}

// Authenticate implements [Authenticator]. The token travels in the
// password field; the user name is ignored.
func (a *JWTAuthenticator) Authenticate(ctx context.Context, req *Request) (*Identity, error) {
	if len(req.Password) == 0 {
		return nil, ErrBadCredentials
	}
	claims := jwt.MapClaims{}
	_, err := a.parser.ParseWithClaims(string(req.Password), claims, func(t *jwt.Token) (any, error) {
		kid, _ := t.Header["kid"].(string)
		return a.key(ctx, kid)
	})
	if err != nil {
		if errors.Is(err, ErrUnavailable) {
			return nil, err
		}
		if errors.Is(err, jwt.ErrTokenExpired) || errors.Is(err, jwt.ErrTokenNotValidYet) {
			return nil, fmt.Errorf("%w: %w", ErrNotAuthorized, err)
		}
		return nil, fmt.Errorf("%w: %w", ErrBadCredentials, err)
	}
	id := &Identity{Tenant: a.cfg.DefaultTenant}
	if a.cfg.TenantClaim != "" {
		if t, ok := claims[a.cfg.TenantClaim].(string); ok && t != "" {
			id.Tenant = t
		}
	}
	if id.Tenant == "" {
		return nil, fmt.Errorf("%w: token has no %q claim", ErrNotAuthorized, a.cfg.TenantClaim)
	}
	id.Username, _ = claims[a.cfg.UsernameClaim].(string)
	if a.cfg.ACLClaim != "" {
		if raw, ok := claims[a.cfg.ACLClaim]; ok {
			b, _ := json.Marshal(raw)
			var acl ACL
			if err := json.Unmarshal(b, &acl); err != nil {
				return nil, fmt.Errorf("%w: claim %q: %w", ErrNotAuthorized, a.cfg.ACLClaim, err)
			}
			id.ACL = &acl
		}
	}
	if exp, err := claims.GetExpirationTime(); err == nil && exp != nil {
		id.ExpiresAt = exp.Time
	}
	return id, nil
}

// key returns the public key for kid, fetching the JWKS again (rate
// limited) when the kid is unknown, as after a key rotation.
func (a *JWTAuthenticator) key(ctx context.Context, kid string) (any, error) {
	a.mu.Lock()
	k, ok := a.keys[kid]
	stale := time.Since(a.fetched) > a.cfg.Refresh
	a.mu.Unlock()
	if ok && !stale {
		return k, nil
	}
	if err := a.refresh(ctx, false); err != nil && !ok {
		return nil, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if k, ok := a.keys[kid]; ok {
		return k, nil
	}
	return nil, fmt.Errorf("unknown key id %q", kid)
}

func (a *JWTAuthenticator) refresh(ctx context.Context, force bool) error {
	a.mu.Lock()
	if !force && time.Since(a.lastTry) < a.cfg.MinRefresh {
		err := a.fetchErr
		a.mu.Unlock()
		return err
	}
	a.lastTry = time.Now()
	a.mu.Unlock()

	keys, err := a.fetch(ctx)
	a.mu.Lock()
	defer a.mu.Unlock()
	if err != nil {
		a.fetchErr = fmt.Errorf("%w: jwks: %w", ErrUnavailable, err)
		if a.logger != nil {
			a.logger.Warn("jwks fetch failed; keeping the keys we have", "url", a.cfg.JWKSURL, "error", err)
		}
		return a.fetchErr
	}
	a.keys, a.fetched, a.fetchErr = keys, time.Now(), nil
	return nil
}

func (a *JWTAuthenticator) fetch(ctx context.Context) (map[string]any, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, a.cfg.JWKSURL, nil)
	if err != nil {
		return nil, err
	}
	resp, err := a.cfg.HTTPClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("status %s", resp.Status)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return nil, err
	}
	var set jose.JSONWebKeySet
	if err := json.Unmarshal(body, &set); err != nil {
		return nil, err
	}
	keys := map[string]any{}
	for _, k := range set.Keys {
		if !k.IsPublic() || !k.Valid() {
			continue // never accept a symmetric or private key as a verification key
		}
		switch k.Key.(type) {
		case *rsa.PublicKey, *ecdsa.PublicKey, ed25519.PublicKey:
			keys[k.KeyID] = k.Key
		}
	}
	if len(keys) == 0 {
		return nil, errors.New("no usable public keys")
	}
	return keys, nil
}
