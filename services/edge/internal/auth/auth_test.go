package auth

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/bcrypt"
)

func TestCovers(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		pattern, filter string
		want            bool
	}{
		{"#", "a/b", true},
		{"#", "#", true},
		{"a/#", "a", true}, // [MQTT-4.7.1-2]
		{"a/#", "a/b/c", true},
		{"a/#", "b", false},
		{"a/+", "a/b", true},
		{"a/+", "a/+", true},
		{"a/+", "a/#", false},
		{"a/+", "a/b/c", false},
		{"a/b", "a/+", false},
		{"+/b", "a/b", true},
		{"#", "$SYS/x", false},     // [MQTT-4.7.2-1]
		{"+/x", "$SYS/x", false},   // [MQTT-4.7.2-1]
		{"$SYS/#", "$SYS/x", true}, // explicit $ pattern
		{"a/b", "a/b", true},
		{"a/b", "a/b/c", false},
	} {
		require.Equal(t, tc.want, covers(tc.pattern, tc.filter), "%s covers %s", tc.pattern, tc.filter)
	}
}

func TestACL_Bind(t *testing.T) {
	t.Parallel()
	acl := &ACL{Publish: []string{"devices/%c/#", "tenants/%t/users/%u"}, Subscribe: []string{"devices/%c/cmd/#"}}
	r := acl.Bind("acme", "alice", "dev1")
	require.True(t, r.CanPublish("devices/dev1/telemetry"))
	require.False(t, r.CanPublish("devices/dev2/telemetry"))
	require.True(t, r.CanPublish("tenants/acme/users/alice"))
	require.True(t, r.CanSubscribe("devices/dev1/cmd/#"))
	require.False(t, r.CanSubscribe("devices/+/cmd/#"))
	require.True(t, r.CanReceive("devices/dev1/cmd/x"))

	// A client ID that is a wildcard must not widen a placeholder rule.
	evil := acl.Bind("acme", "alice", "#")
	require.False(t, evil.CanPublish("devices/dev2/telemetry"))
	require.False(t, evil.CanSubscribe("devices/#"))
	// A nil ACL allows everything inside the tenant.
	var none *ACL
	require.True(t, none.Bind("acme", "u", "c").CanPublish("x"))
}

func writeFile(t *testing.T, path, body string) {
	t.Helper()
	require.NoError(t, os.WriteFile(path, []byte(body), 0o600))
}

func TestFileAuthenticator(t *testing.T) {
	t.Parallel()
	bc, err := bcrypt.GenerateFromPassword([]byte("s3cret"), bcrypt.MinCost)
	require.NoError(t, err)
	a2, err := HashArgon2id([]byte("hunter2"))
	require.NoError(t, err)
	path := filepath.Join(t.TempDir(), "passwd.yaml")
	writeFile(t, path, `
tenants:
  acme:
    acl: {publish: ["acme/#"], subscribe: ["acme/#"]}
    users:
      alice: {password: "`+string(bc)+`"}
      bob: {password: "`+a2+`", acl: {publish: ["#"], subscribe: ["#"]}}
  beta:
    users:
      alice: {password: "`+string(bc)+`"}
`)
	f, err := NewFileAuthenticator(path, nil)
	require.NoError(t, err)
	ctx := context.Background()

	id, err := f.Authenticate(ctx, &Request{Username: "alice@acme", Password: []byte("s3cret")})
	require.NoError(t, err)
	require.Equal(t, "acme", id.Tenant)
	require.Equal(t, []string{"acme/#"}, id.ACL.Publish, "tenant default ACL")

	id, err = f.Authenticate(ctx, &Request{Username: "bob", Password: []byte("hunter2")})
	require.NoError(t, err, "bare user name is unique")
	require.Equal(t, "acme", id.Tenant)

	// Twice: the second answer comes from the verified-password cache and
	// must refuse a wrong password all the same.
	for range 2 {
		_, err = f.Authenticate(ctx, &Request{Username: "bob", Password: []byte("hunter2")})
		require.NoError(t, err)
		_, err = f.Authenticate(ctx, &Request{Username: "bob", Password: []byte("hunter3")})
		require.ErrorIs(t, err, ErrBadCredentials)
	}
	_, err = f.Authenticate(ctx, &Request{Username: "alice", Password: []byte("s3cret")})
	require.ErrorIs(t, err, ErrBadCredentials, "alice is ambiguous without a tenant")
	_, err = f.Authenticate(ctx, &Request{Username: "alice@beta"})
	require.ErrorIs(t, err, ErrBadCredentials, "no password")
	_, err = f.Authenticate(ctx, &Request{Username: "nobody@acme", Password: []byte("x")})
	require.ErrorIs(t, err, ErrBadCredentials)
}

func TestFileAuthenticator_ReloadKeepsLastGood(t *testing.T) {
	t.Parallel()
	bc, _ := bcrypt.GenerateFromPassword([]byte("pw"), bcrypt.MinCost)
	path := filepath.Join(t.TempDir(), "passwd.yaml")
	writeFile(t, path, "tenants:\n  acme:\n    users:\n      u: {password: \""+string(bc)+"\"}\n")
	f, err := NewFileAuthenticator(path, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go f.Watch(ctx, 10*time.Millisecond)

	// A broken file is refused and the old one stays in force.
	writeFile(t, path, "tenants: [not a map\n")
	require.Error(t, f.Reload())
	_, err = f.Authenticate(ctx, &Request{Username: "u@acme", Password: []byte("pw")})
	require.NoError(t, err)

	// A good change is picked up by the watcher: u is revoked, v added.
	writeFile(t, path, "tenants:\n  acme:\n    users:\n      v: {password: \""+string(bc)+"\"}\n")
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, err = f.Authenticate(ctx, &Request{Username: "u@acme", Password: []byte("pw")})
		if errors.Is(err, ErrBadCredentials) {
			break
		}
		require.True(t, time.Now().Before(deadline), "reload not seen")
		time.Sleep(10 * time.Millisecond)
	}
	_, err = f.Authenticate(ctx, &Request{Username: "v@acme", Password: []byte("pw")})
	require.NoError(t, err)
}

func TestLoadPasswordFile_Errors(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for name, body := range map[string]string{
		"bad_tenant":   "tenants:\n  Acme:\n    users: {}\n",
		"bad_hash":     "tenants:\n  acme:\n    users:\n      u: {password: plain}\n",
		"unknown_key":  "tenants:\n  acme:\n    userz: {}\n",
		"at_in_user":   "tenants:\n  acme:\n    users:\n      a@b: {password: \"$2a$10$abcdefghijklmnopqrstuv1234567890123456789012345678901\"}\n",
		"bad_argon2id": "tenants:\n  acme:\n    users:\n      u: {password: \"$argon2id$v=19$m=0,t=1,p=1$c2FsdA$a2V5\"}\n",
	} {
		path := filepath.Join(dir, name+".yaml")
		writeFile(t, path, body)
		_, err := LoadPasswordFile(path)
		require.ErrorIs(t, err, ErrInvalidFile, name)
	}
}

func TestChain_UnavailableIsNotBadCredentials(t *testing.T) {
	t.Parallel()
	down := authFunc(func(context.Context, *Request) (*Identity, error) { return nil, ErrUnavailable })
	_, err := Chain{down}.Authenticate(context.Background(), &Request{})
	require.ErrorIs(t, err, ErrUnavailable)
	id, err := Chain{down, Anonymous{Tenant: "dev"}}.Authenticate(context.Background(), &Request{})
	require.NoError(t, err)
	require.Equal(t, "dev", id.Tenant)
}

type authFunc func(context.Context, *Request) (*Identity, error)

func (f authFunc) Authenticate(ctx context.Context, r *Request) (*Identity, error) { return f(ctx, r) }
