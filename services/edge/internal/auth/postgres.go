package auth

import (
	"context"
	"crypto/rand"
	"embed"
	"encoding/json"
	"fmt"
	"io/fs"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

//go:embed migrations/*.sql
var migrations embed.FS

// PostgresConfig configures the PostgreSQL credential backend.
type PostgresConfig struct {
	DSN string
	// CacheTTL bounds how long a verified password is trusted without asking
	// the database: a revoked user is refused at most this long after, and a
	// database outage refuses nobody who connected within it.
	CacheTTL time.Duration
	// NegativeTTL caches "no such user" answers, against floods of unknown
	// user names.
	NegativeTTL time.Duration
	// Migrate applies the schema on start.
	Migrate bool
	// QueryTimeout bounds one lookup.
	QueryTimeout time.Duration
}

// PostgresAuthenticator authenticates users stored in PostgreSQL.
type PostgresAuthenticator struct {
	cfg    PostgresConfig
	pool   *pgxpool.Pool
	logger *slog.Logger
	salt   [16]byte

	mu    sync.Mutex
	cache map[string]*pgEntry // "user@tenant" (or bare user) -> answer
}

type pgEntry struct {
	until    time.Time
	found    bool
	identity Identity
	hash     string
	verified [32]byte // digest of the last password that verified; zero if none
}

// NewPostgresAuthenticator connects (and migrates when asked).
func NewPostgresAuthenticator(ctx context.Context, cfg PostgresConfig, logger *slog.Logger) (*PostgresAuthenticator, error) {
	if cfg.CacheTTL <= 0 {
		cfg.CacheTTL = time.Minute
	}
	if cfg.NegativeTTL <= 0 {
		cfg.NegativeTTL = 5 * time.Second
	}
	if cfg.QueryTimeout <= 0 {
		cfg.QueryTimeout = 3 * time.Second
	}
	pool, err := pgxpool.New(ctx, cfg.DSN)
	if err != nil {
		return nil, fmt.Errorf("postgres auth: %w", err)
	}
	a := &PostgresAuthenticator{cfg: cfg, pool: pool, logger: logger, cache: map[string]*pgEntry{}}
	if _, err := rand.Read(a.salt[:]); err != nil {
		pool.Close()
		return nil, err
	}
	if cfg.Migrate {
		if err := ApplyMigrations(ctx, pool); err != nil {
			pool.Close()
			return nil, err
		}
	}
	return a, nil
}

// Close closes the connection pool.
func (a *PostgresAuthenticator) Close() { a.pool.Close() }

// Authenticate implements [Authenticator].
func (a *PostgresAuthenticator) Authenticate(ctx context.Context, req *Request) (*Identity, error) {
	if req.Username == "" || req.Password == nil {
		return nil, ErrBadCredentials
	}
	digest := digestOf(a.salt[:], req.Password)
	key := req.Username
	now := time.Now()

	a.mu.Lock()
	e := a.cache[key]
	a.mu.Unlock()
	if e != nil && now.Before(e.until) {
		if !e.found {
			return nil, ErrBadCredentials
		}
		if e.verified == digest {
			id := e.identity
			return &id, nil
		}
	} else {
		fresh, err := a.lookup(ctx, req.Username)
		if err != nil {
			return nil, err // ErrUnavailable: never read as bad credentials
		}
		e = fresh
		a.mu.Lock()
		a.cache[key] = e
		if len(a.cache) > 100_000 {
			for k, v := range a.cache {
				if now.After(v.until) {
					delete(a.cache, k)
				}
			}
		}
		a.mu.Unlock()
		if !e.found {
			return nil, ErrBadCredentials
		}
	}
	h, err := parseHash(e.hash)
	if err != nil {
		return nil, ErrBadCredentials
	}
	if err := h.verify(req.Password); err != nil {
		return nil, ErrBadCredentials
	}
	a.mu.Lock()
	e.verified = digest
	a.mu.Unlock()
	id := e.identity
	return &id, nil
}

func (a *PostgresAuthenticator) lookup(ctx context.Context, username string) (*pgEntry, error) {
	user, tenant, qualified := strings.Cut(username, "@")
	ctx, cancel := context.WithTimeout(ctx, a.cfg.QueryTimeout)
	defer cancel()
	const q = `SELECT u.tenant, u.username, u.password_hash, COALESCE(u.acl, t.acl)
	             FROM keel_users u JOIN keel_tenants t ON t.name = u.tenant
	            WHERE u.username = $1 AND ($2 = '' OR u.tenant = $2) AND NOT u.disabled
	            LIMIT 2`
	if !qualified {
		tenant = ""
	}
	rows, err := a.pool.Query(ctx, q, user, tenant)
	if err != nil {
		return nil, a.unavailable(err)
	}
	defer rows.Close()
	var found []*pgEntry
	for rows.Next() {
		var e pgEntry
		var acl []byte
		if err := rows.Scan(&e.identity.Tenant, &e.identity.Username, &e.hash, &acl); err != nil {
			return nil, a.unavailable(err)
		}
		if len(acl) > 0 {
			var x ACL
			if err := json.Unmarshal(acl, &x); err != nil {
				return nil, fmt.Errorf("%w: user %q: acl: %w", ErrNotAuthorized, username, err)
			}
			e.identity.ACL = &x
		}
		found = append(found, &e)
	}
	if err := rows.Err(); err != nil {
		return nil, a.unavailable(err)
	}
	if len(found) != 1 {
		// Unknown, or a bare name that several tenants use.
		return &pgEntry{until: time.Now().Add(a.cfg.NegativeTTL)}, nil
	}
	e := found[0]
	e.found, e.until = true, time.Now().Add(a.cfg.CacheTTL)
	e.identity.ACLSource, e.identity.ACLUser = a, e.identity.Username
	return e, nil
}

func (a *PostgresAuthenticator) unavailable(err error) error {
	if a.logger != nil {
		a.logger.Warn("postgres auth lookup failed", "error", err)
	}
	return fmt.Errorf("%w: postgres: %w", ErrUnavailable, err)
}

// ApplyMigrations applies the embedded schema migrations in order, each
// once, recording them in keel_schema_migrations.
func ApplyMigrations(ctx context.Context, pool *pgxpool.Pool) error {
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS keel_schema_migrations (name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	names, err := fs.Glob(migrations, "migrations/*.sql")
	if err != nil {
		return err
	}
	sort.Strings(names)
	for _, name := range names {
		body, err := migrations.ReadFile(name)
		if err != nil {
			return err
		}
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			tag, err := tx.Exec(ctx, `INSERT INTO keel_schema_migrations (name) VALUES ($1) ON CONFLICT DO NOTHING`, name)
			if err != nil || tag.RowsAffected() == 0 {
				return err // already applied
			}
			_, err = tx.Exec(ctx, string(body))
			return err
		})
		if err != nil {
			return fmt.Errorf("migrate %s: %w", name, err)
		}
	}
	return nil
}
