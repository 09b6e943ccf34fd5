// Package auth decides who a connecting client is (its tenant and user) and
// what it may publish and subscribe to.
//
// An [Authenticator] turns the credentials of a CONNECT into an [Identity].
// Implementations here: [Anonymous] for development and [FileAuthenticator],
// a YAML password file with bcrypt or argon2id hashes that reloads on change.
// JWT, mTLS and database backends plug in behind the same interface.
package auth

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"time"
)

// Request is what an authenticator sees of a connecting client.
type Request struct {
	Listener        string
	Remote          string
	ClientID        string // as the client sent it; empty when the broker assigns one
	Username        string
	Password        []byte
	ProtocolVersion byte
	TLS             *tls.ConnectionState // nil on plain TCP and WS
}

// Identity is the outcome of a successful authentication.
type Identity struct {
	Tenant   string
	Username string
	// ACL limits what the client may do inside its tenant. Nil allows
	// everything inside the tenant; tenants stay isolated either way.
	ACL *ACL
	// ExpiresAt, when set, is when the credentials stop being valid (a
	// token's exp): the edge disconnects the client then.
	ExpiresAt time.Time
	// ACLSource is the backend that granted ACL when it can read it again
	// (the password file, PostgreSQL): after an ACL version bump the edge
	// re-binds connected clients to what it returns for ACLUser. Nil when
	// the ACL cannot change under a connection (a JWT carries its own).
	ACLSource ACLSource
	// ACLUser is the name ACLSource knows the user by.
	ACLUser string
}

// Authenticator checks credentials. It returns one of the sentinel errors of
// this package (wrapped or not) when the client must be refused, so the edge
// can answer with the precise CONNACK reason code.
type Authenticator interface {
	Authenticate(ctx context.Context, req *Request) (*Identity, error)
}

// Anonymous admits clients into one tenant with no ACL.
type Anonymous struct {
	Tenant string
	// OnlyWithoutCredentials admits only clients that present no user name
	// and no password. Set it when real credentials are checked as well, so
	// that wrong credentials are refused rather than admitted anonymously.
	OnlyWithoutCredentials bool
}

// Authenticate implements [Authenticator].
func (a Anonymous) Authenticate(_ context.Context, req *Request) (*Identity, error) {
	if a.OnlyWithoutCredentials && (req.Username != "" || req.Password != nil) {
		return nil, ErrBadCredentials
	}
	return &Identity{Tenant: a.Tenant}, nil
}

// Chain tries authenticators in order. A client is admitted by the first that
// admits it; the error of the last one is returned otherwise. ErrUnavailable
// from any of them wins over a refusal, so an outage never reads as bad
// credentials.
type Chain []Authenticator

// Authenticate implements [Authenticator].
func (c Chain) Authenticate(ctx context.Context, req *Request) (*Identity, error) {
	var last error = ErrBadCredentials
	unavailable := false
	for _, a := range c {
		id, err := a.Authenticate(ctx, req)
		if err == nil {
			return id, nil
		}
		unavailable = unavailable || errors.Is(err, ErrUnavailable)
		last = err
	}
	if unavailable && !errors.Is(last, ErrUnavailable) {
		return nil, fmt.Errorf("%w (and then: %w)", ErrUnavailable, last)
	}
	return nil, last
}
