package auth

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

// PasswordFile is the YAML layout of a password file:
//
//	tenants:
//	  acme:
//	    acl:                      # default for users of the tenant without their own
//	      publish: ["devices/%c/#"]
//	      subscribe: ["devices/%c/#", "broadcast/#"]
//	    users:
//	      alice:
//	        password: "$2a$10$..."   # bcrypt, or $argon2id$v=19$m=...,t=...,p=...$salt$hash
//	        acl: {publish: ["#"], subscribe: ["#"]}
//
// A client names its tenant in the user name as "user@tenant". A bare "user"
// is accepted when exactly one tenant has that user.
type PasswordFile struct {
	Tenants map[string]TenantEntry `yaml:"tenants"`
}

// TenantEntry is one tenant of a [PasswordFile].
type TenantEntry struct {
	ACL   *ACL                 `yaml:"acl"`
	Users map[string]UserEntry `yaml:"users"`
}

// UserEntry is one user of a [TenantEntry].
type UserEntry struct {
	Password string `yaml:"password"`
	ACL      *ACL   `yaml:"acl"`
}

type userRecord struct {
	tenant, name string
	hash         string
	acl          *ACL
}

type fileState struct {
	byQualified map[string]*userRecord // "user@tenant"
	byName      map[string]*userRecord // bare user name, when unique
	verified    sync.Map               // "user@tenant" -> [32]byte digest of a password that verified
	salt        [16]byte
}

// FileAuthenticator authenticates against a YAML password file and reloads
// it when it changes on disk or when Reload is called (on SIGHUP). A file
// that fails to load leaves the last good one in force.
type FileAuthenticator struct {
	path   string
	logger *slog.Logger
	state  atomic.Pointer[fileState]

	mu      sync.Mutex // serialises reloads
	modTime time.Time
	size    int64
}

// NewFileAuthenticator loads path and returns an authenticator for it.
func NewFileAuthenticator(path string, logger *slog.Logger) (*FileAuthenticator, error) {
	f := &FileAuthenticator{path: path, logger: logger}
	if err := f.Reload(); err != nil {
		return nil, err
	}
	return f, nil
}

// LoadPasswordFile parses and validates a password file.
func LoadPasswordFile(path string) (*PasswordFile, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidFile, err)
	}
	var pf PasswordFile
	dec := yaml.NewDecoder(strings.NewReader(string(b)))
	dec.KnownFields(true)
	if err := dec.Decode(&pf); err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrInvalidFile, path, err)
	}
	for tenant, te := range pf.Tenants {
		if !tenancy.ValidTenant(tenant) {
			return nil, fmt.Errorf("%w: %s: tenant %q: want [a-z0-9-]{1,63}", ErrInvalidFile, path, tenant)
		}
		for user, ue := range te.Users {
			if user == "" || strings.Contains(user, "@") {
				return nil, fmt.Errorf("%w: %s: tenant %q: user %q: must be non-empty without '@'", ErrInvalidFile, path, tenant, user)
			}
			if _, err := parseHash(ue.Password); err != nil {
				return nil, fmt.Errorf("%w: %s: tenant %q: user %q: %w", ErrInvalidFile, path, tenant, user, err)
			}
		}
	}
	return &pf, nil
}

// Reload reads the file again. On error the previous state stays in force.
func (f *FileAuthenticator) Reload() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	st, err := os.Stat(f.path)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidFile, err)
	}
	pf, err := LoadPasswordFile(f.path)
	if err != nil {
		return err
	}
	s := &fileState{byQualified: map[string]*userRecord{}, byName: map[string]*userRecord{}}
	ambiguous := map[string]bool{}
	for tenant, te := range pf.Tenants {
		for user, ue := range te.Users {
			acl := ue.ACL
			if acl == nil {
				acl = te.ACL
			}
			rec := &userRecord{tenant: tenant, name: user, hash: ue.Password, acl: acl}
			s.byQualified[user+"@"+tenant] = rec
			if _, dup := s.byName[user]; dup {
				ambiguous[user] = true
			}
			s.byName[user] = rec
		}
	}
	for user := range ambiguous {
		delete(s.byName, user)
	}
	if _, err := randRead(s.salt[:]); err != nil {
		return err
	}
	f.state.Store(s)
	f.modTime, f.size = st.ModTime(), st.Size()
	if f.logger != nil {
		f.logger.Info("password file loaded", "path", f.path, "users", len(s.byQualified))
	}
	return nil
}

// Watch polls the file and reloads it when its size or modification time
// changes, until ctx ends. Polling (rather than inotify) follows Kubernetes
// ConfigMap updates, which swap a symlink.
func (f *FileAuthenticator) Watch(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		st, err := os.Stat(f.path)
		if err != nil {
			continue
		}
		f.mu.Lock()
		changed := !st.ModTime().Equal(f.modTime) || st.Size() != f.size
		f.mu.Unlock()
		if !changed {
			continue
		}
		if err := f.Reload(); err != nil && f.logger != nil {
			f.logger.Error("password file reload failed; keeping the previous one", "path", f.path, "error", err)
		}
	}
}

// Authenticate implements [Authenticator].
func (f *FileAuthenticator) Authenticate(_ context.Context, req *Request) (*Identity, error) {
	s := f.state.Load()
	var rec *userRecord
	if strings.Contains(req.Username, "@") {
		rec = s.byQualified[req.Username]
	} else {
		rec = s.byName[req.Username]
	}
	if rec == nil || req.Password == nil {
		return nil, ErrBadCredentials
	}
	key := rec.name + "@" + rec.tenant
	digest := digestOf(s.salt[:], req.Password)
	if v, ok := s.verified.Load(key); ok {
		d := v.([32]byte)
		if subtle.ConstantTimeCompare(d[:], digest[:]) == 1 {
			return &Identity{Tenant: rec.tenant, Username: rec.name, ACL: rec.acl, ACLSource: f, ACLUser: rec.name}, nil
		}
	}
	h, err := parseHash(rec.hash)
	if err != nil {
		return nil, ErrBadCredentials
	}
	if err := h.verify(req.Password); err != nil {
		if errors.Is(err, errMismatch) {
			return nil, ErrBadCredentials
		}
		return nil, fmt.Errorf("%w: %w", ErrBadCredentials, err)
	}
	// Remember the verified password (as a salted digest) so a reconnect storm
	// does not pay for bcrypt/argon2 on every connect. A reload drops it.
	s.verified.Store(key, digest)
	return &Identity{Tenant: rec.tenant, Username: rec.name, ACL: rec.acl, ACLSource: f, ACLUser: rec.name}, nil
}

// digestOf is a salted SHA-256 of a password, kept in memory to recognise a
// password that already verified without paying for bcrypt/argon2 again.
func digestOf(salt, pw []byte) [32]byte {
	h := sha256.New()
	h.Write(salt)
	h.Write(pw)
	var out [32]byte
	h.Sum(out[:0])
	return out
}
