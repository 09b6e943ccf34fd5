package auth

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/bcrypt"
)

// PostgreSQL after an ACL change: InvalidateACLs drops the cached users of
// the tenant (so the next connect sees the new ACL at once, not after the
// cache TTL) and leaves other tenants' cached; ReadACLs reads the ACLs of
// many users in one query, with the tenant default where a user has none,
// and leaves out disabled and unknown users.
func TestPostgres_ReadAndInvalidateACLs(t *testing.T) {
	t.Parallel()
	dsn := startPostgres(t)
	ctx := context.Background()
	a, err := NewPostgresAuthenticator(ctx, PostgresConfig{DSN: dsn, Migrate: true, CacheTTL: time.Hour, NegativeTTL: time.Hour}, nil)
	require.NoError(t, err)
	t.Cleanup(a.Close)
	hash, _ := bcrypt.GenerateFromPassword([]byte("pw"), bcrypt.MinCost)
	_, err = a.pool.Exec(ctx, `INSERT INTO keel_tenants (name, acl) VALUES ('acme', '{"publish":["acme/#"],"subscribe":["acme/#"]}'), ('beta', NULL)`)
	require.NoError(t, err)
	_, err = a.pool.Exec(ctx, `INSERT INTO keel_users (tenant, username, password_hash, acl) VALUES
		('acme', 'alice', $1, NULL), ('acme', 'bob', $1, '{"publish":["#"],"subscribe":["#"]}'),
		('acme', 'eve', $1, NULL), ('beta', 'carol', $1, '{"publish":["b/#"],"subscribe":["b/#"]}')`, string(hash))
	require.NoError(t, err)

	login := func(user string) (*Identity, error) {
		return a.Authenticate(ctx, &Request{Username: user, Password: []byte("pw")})
	}
	id, err := login("bob@acme")
	require.NoError(t, err)
	require.Equal(t, []string{"#"}, id.ACL.Publish)
	require.Equal(t, a, id.ACLSource)
	require.Equal(t, "bob", id.ACLUser)
	id, err = login("carol@beta")
	require.NoError(t, err)
	require.Equal(t, []string{"b/#"}, id.ACL.Publish)
	_, err = login("dave@acme")
	require.ErrorIs(t, err, ErrBadCredentials)

	_, err = a.pool.Exec(ctx, `UPDATE keel_users SET acl = '{"publish":["bob/#"],"subscribe":["bob/#"]}' WHERE username = 'bob'`)
	require.NoError(t, err)
	_, err = a.pool.Exec(ctx, `UPDATE keel_users SET acl = '{"publish":["c/#"],"subscribe":["c/#"]}' WHERE username = 'carol'`)
	require.NoError(t, err)
	_, err = a.pool.Exec(ctx, `UPDATE keel_users SET disabled = true WHERE username = 'eve'`)
	require.NoError(t, err)
	_, err = a.pool.Exec(ctx, `INSERT INTO keel_users (tenant, username, password_hash) VALUES ('acme', 'dave', $1)`, string(hash))
	require.NoError(t, err)
	id, err = login("bob@acme")
	require.NoError(t, err)
	require.Equal(t, []string{"#"}, id.ACL.Publish, "cached for an hour")

	require.NoError(t, a.InvalidateACLs([]string{"acme"}))
	id, err = login("bob@acme")
	require.NoError(t, err)
	require.Equal(t, []string{"bob/#"}, id.ACL.Publish, "read again after the invalidation")
	_, err = login("dave@acme")
	require.NoError(t, err, "a cached 'no such user' went too")
	id, err = login("carol@beta")
	require.NoError(t, err)
	require.Equal(t, []string{"b/#"}, id.ACL.Publish, "another tenant's users stay cached")
	require.NoError(t, a.InvalidateACLs([]string{""}))
	id, err = login("carol@beta")
	require.NoError(t, err)
	require.Equal(t, []string{"c/#"}, id.ACL.Publish, "the empty tenant invalidates every tenant")

	acls, err := a.ReadACLs(ctx, "acme", []string{"alice", "bob", "eve", "nobody", "carol"})
	require.NoError(t, err)
	require.Len(t, acls, 2, "eve is disabled, nobody unknown, carol in another tenant: %v", acls)
	require.Equal(t, []string{"acme/#"}, acls["alice"].Publish, "the tenant default")
	require.Equal(t, []string{"bob/#"}, acls["bob"].Subscribe)
}

// The password file as a source: ReadACLs answers from the file as last
// loaded, InvalidateACLs loads it again, and a file that does not load
// leaves the previous one in force.
func TestFile_ReadAndInvalidateACLs(t *testing.T) {
	t.Parallel()
	hash, _ := bcrypt.GenerateFromPassword([]byte("pw"), bcrypt.MinCost)
	path := filepath.Join(t.TempDir(), "users.yaml")
	write := func(aliceACL string) {
		require.NoError(t, os.WriteFile(path, fmt.Appendf(nil, `tenants:
  acme:
    acl: {publish: ["acme/#"], subscribe: ["acme/#"]}
    users:
      alice: {password: %q%s}
      bob: {password: %q}
`, hash, aliceACL, hash), 0o600))
	}
	write(`, acl: {publish: ["a/#"], subscribe: ["a/#"]}`)
	f, err := NewFileAuthenticator(path, nil)
	require.NoError(t, err)
	id, err := f.Authenticate(context.Background(), &Request{Username: "alice@acme", Password: []byte("pw")})
	require.NoError(t, err)
	require.Equal(t, f, id.ACLSource)
	require.Equal(t, "alice", id.ACLUser)

	write("")
	acls, err := f.ReadACLs(context.Background(), "acme", []string{"alice", "bob", "carol"})
	require.NoError(t, err)
	require.Equal(t, []string{"a/#"}, acls["alice"].Publish, "not reloaded yet")
	require.NoError(t, f.InvalidateACLs([]string{"acme"}))
	acls, err = f.ReadACLs(context.Background(), "acme", []string{"alice", "bob", "carol"})
	require.NoError(t, err)
	require.Len(t, acls, 2)
	require.Equal(t, []string{"acme/#"}, acls["alice"].Publish, "now the tenant default")
	acls, err = f.ReadACLs(context.Background(), "beta", []string{"alice"})
	require.NoError(t, err)
	require.Empty(t, acls)

	require.NoError(t, os.WriteFile(path, []byte("tenants: [broken"), 0o600))
	require.Error(t, Chain{f}.InvalidateACLs([]string{"acme"}))
	acls, err = f.ReadACLs(context.Background(), "acme", []string{"alice"})
	require.NoError(t, err)
	require.Contains(t, acls, "alice", "the last good file stays in force")
}
