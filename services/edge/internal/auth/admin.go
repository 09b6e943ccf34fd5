package auth

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.yaml.in/yaml/v3"

	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

// UserStore is where operators manage users: a password file or PostgreSQL.
type UserStore interface {
	PutUser(ctx context.Context, tenant, user, password string, acl *ACL) error
	DeleteUser(ctx context.Context, tenant, user string) error
	SetTenantACL(ctx context.Context, tenant string, acl *ACL) error
	ListUsers(ctx context.Context) ([]UserInfo, error)
}

// UserInfo is one user as listed by a [UserStore].
type UserInfo struct {
	Tenant   string `json:"tenant"`
	Username string `json:"username"`
	ACL      *ACL   `json:"acl,omitempty"`
	Disabled bool   `json:"disabled,omitempty"`
}

// FileUserStore edits a password file in place (atomically: write, then
// rename), which running edges pick up on their next reload.
type FileUserStore struct{ Path string }

func (f FileUserStore) load() (*PasswordFile, error) {
	pf := &PasswordFile{Tenants: map[string]TenantEntry{}}
	if _, err := os.Stat(f.Path); os.IsNotExist(err) {
		return pf, nil
	}
	loaded, err := LoadPasswordFile(f.Path)
	if err != nil {
		return nil, err
	}
	if loaded.Tenants != nil {
		pf = loaded
	}
	return pf, nil
}

func (f FileUserStore) save(pf *PasswordFile) error {
	var buf bytes.Buffer
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(pf); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(f.Path), ".passwd-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(buf.Bytes()); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(0o600); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), f.Path)
}

// PutUser adds or replaces a user with an argon2id hash of password.
func (f FileUserStore) PutUser(_ context.Context, tenant, user, password string, acl *ACL) error {
	if !tenancy.ValidTenant(tenant) {
		return fmt.Errorf("%w: %q", tenancy.ErrInvalidTenant, tenant)
	}
	hash, err := HashArgon2id([]byte(password))
	if err != nil {
		return err
	}
	pf, err := f.load()
	if err != nil {
		return err
	}
	te := pf.Tenants[tenant]
	if te.Users == nil {
		te.Users = map[string]UserEntry{}
	}
	te.Users[user] = UserEntry{Password: hash, ACL: acl}
	pf.Tenants[tenant] = te
	return f.save(pf)
}

// DeleteUser removes a user.
func (f FileUserStore) DeleteUser(_ context.Context, tenant, user string) error {
	pf, err := f.load()
	if err != nil {
		return err
	}
	te, ok := pf.Tenants[tenant]
	if _, found := te.Users[user]; !ok || !found {
		return fmt.Errorf("no user %s@%s", user, tenant)
	}
	delete(te.Users, user)
	pf.Tenants[tenant] = te
	return f.save(pf)
}

// SetTenantACL sets the default ACL of a tenant's users.
func (f FileUserStore) SetTenantACL(_ context.Context, tenant string, acl *ACL) error {
	if !tenancy.ValidTenant(tenant) {
		return fmt.Errorf("%w: %q", tenancy.ErrInvalidTenant, tenant)
	}
	pf, err := f.load()
	if err != nil {
		return err
	}
	te := pf.Tenants[tenant]
	te.ACL = acl
	pf.Tenants[tenant] = te
	return f.save(pf)
}

// ListUsers lists users sorted by tenant and name.
func (f FileUserStore) ListUsers(context.Context) ([]UserInfo, error) {
	pf, err := f.load()
	if err != nil {
		return nil, err
	}
	var out []UserInfo
	for tenant, te := range pf.Tenants {
		for name, u := range te.Users {
			out = append(out, UserInfo{Tenant: tenant, Username: name, ACL: u.ACL})
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Tenant != out[j].Tenant {
			return out[i].Tenant < out[j].Tenant
		}
		return out[i].Username < out[j].Username
	})
	return out, nil
}

// PostgresUserStore manages users in PostgreSQL.
type PostgresUserStore struct{ Pool *pgxpool.Pool }

func aclJSON(acl *ACL) []byte {
	if acl == nil {
		return nil
	}
	b, _ := json.Marshal(acl)
	return b
}

// PutUser adds or replaces a user (and its tenant, if new).
func (p PostgresUserStore) PutUser(ctx context.Context, tenant, user, password string, acl *ACL) error {
	hash, err := HashArgon2id([]byte(password))
	if err != nil {
		return err
	}
	if _, err := p.Pool.Exec(ctx, `INSERT INTO keel_tenants (name) VALUES ($1) ON CONFLICT DO NOTHING`, tenant); err != nil {
		return err
	}
	_, err = p.Pool.Exec(ctx, `INSERT INTO keel_users (tenant, username, password_hash, acl) VALUES ($1, $2, $3, $4)
		ON CONFLICT (tenant, username) DO UPDATE SET password_hash = $3, acl = $4, disabled = false, updated_at = now()`,
		tenant, user, hash, aclJSON(acl))
	return err
}

// DeleteUser removes a user.
func (p PostgresUserStore) DeleteUser(ctx context.Context, tenant, user string) error {
	tag, err := p.Pool.Exec(ctx, `DELETE FROM keel_users WHERE tenant = $1 AND username = $2`, tenant, user)
	if err == nil && tag.RowsAffected() == 0 {
		err = fmt.Errorf("no user %s@%s", user, tenant)
	}
	return err
}

// SetTenantACL sets a tenant's default ACL.
func (p PostgresUserStore) SetTenantACL(ctx context.Context, tenant string, acl *ACL) error {
	_, err := p.Pool.Exec(ctx, `INSERT INTO keel_tenants (name, acl) VALUES ($1, $2) ON CONFLICT (name) DO UPDATE SET acl = $2`, tenant, aclJSON(acl))
	return err
}

// ListUsers lists users sorted by tenant and name.
func (p PostgresUserStore) ListUsers(ctx context.Context) ([]UserInfo, error) {
	rows, err := p.Pool.Query(ctx, `SELECT tenant, username, acl, disabled FROM keel_users ORDER BY tenant, username`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []UserInfo
	for rows.Next() {
		var u UserInfo
		var acl []byte
		if err := rows.Scan(&u.Tenant, &u.Username, &acl, &u.Disabled); err != nil {
			return nil, err
		}
		if len(acl) > 0 {
			u.ACL = &ACL{}
			if err := json.Unmarshal(acl, u.ACL); err != nil {
				return nil, err
			}
		}
		out = append(out, u)
	}
	return out, rows.Err()
}
