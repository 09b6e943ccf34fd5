package auth

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/bcrypt"
)

// startPostgres runs a throwaway PostgreSQL server from the Debian packages
// on a free loopback port and returns its DSN. As root it runs the server as
// the postgres user, which PostgreSQL requires.
func startPostgres(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("postgres: skipped under -short")
	}
	bins, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
	if len(bins) == 0 {
		t.Skip("postgres: initdb not found; `make deps` installs the postgresql package")
	}
	sort.Strings(bins)
	bin := filepath.Dir(bins[len(bins)-1])
	dir, err := os.MkdirTemp("", "keel-pg-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o777))
	run := func(name string, args ...string) *exec.Cmd {
		path := filepath.Join(bin, name)
		if os.Geteuid() == 0 {
			return exec.Command("runuser", append([]string{"-u", "postgres", "--", path}, args...)...)
		}
		return exec.Command(path, args...)
	}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Skip("postgres: running as root and there is no postgres user to run the server as")
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		require.NoError(t, os.Chown(dir, uid, gid))
	}
	data := filepath.Join(dir, "data")
	if out, err := run("initdb", "-D", data, "-A", "trust", "-U", "keel", "--no-sync").CombinedOutput(); err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	srv := run("postgres", "-D", data, "-p", strconv.Itoa(port), "-k", dir, "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off")
	srv.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	logf, _ := os.Create(filepath.Join(dir, "postgres.log"))
	srv.Stdout, srv.Stderr = logf, logf
	require.NoError(t, srv.Start())
	t.Cleanup(func() {
		_ = syscall.Kill(-srv.Process.Pid, syscall.SIGINT) // fast shutdown
		done := make(chan struct{})
		go func() { _ = srv.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(-srv.Process.Pid, syscall.SIGKILL)
		}
	})
	dsn := fmt.Sprintf("postgres://keel@127.0.0.1:%d/postgres?sslmode=disable", port)
	deadline := time.Now().Add(20 * time.Second)
	for {
		pool, err := pgxpool.New(context.Background(), dsn)
		if err == nil {
			err = pool.Ping(context.Background())
			pool.Close()
		}
		if err == nil {
			return dsn
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(dir, "postgres.log"))
			t.Fatalf("postgres did not start: %v\n%s", err, b)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestPostgresAuthenticator(t *testing.T) {
	t.Parallel()
	dsn := startPostgres(t)
	ctx := context.Background()
	a, err := NewPostgresAuthenticator(ctx, PostgresConfig{DSN: dsn, Migrate: true, CacheTTL: 3 * time.Second, NegativeTTL: 50 * time.Millisecond}, nil)
	require.NoError(t, err)
	t.Cleanup(a.Close)
	// Migrations are idempotent.
	require.NoError(t, ApplyMigrations(ctx, a.pool))

	hash, _ := bcrypt.GenerateFromPassword([]byte("pw"), bcrypt.MinCost)
	argon, _ := HashArgon2id([]byte("pw2"))
	_, err = a.pool.Exec(ctx, `INSERT INTO keel_tenants (name, acl) VALUES ('acme', '{"publish":["acme/#"],"subscribe":["acme/#"]}'), ('beta', NULL)`)
	require.NoError(t, err)
	_, err = a.pool.Exec(ctx, `INSERT INTO keel_users (tenant, username, password_hash, acl) VALUES
		('acme', 'alice', $1, NULL), ('acme', 'bob', $2, '{"publish":["#"],"subscribe":["#"]}'), ('beta', 'alice', $1, NULL)`, string(hash), argon)
	require.NoError(t, err)

	id, err := a.Authenticate(ctx, &Request{Username: "alice@acme", Password: []byte("pw")})
	require.NoError(t, err)
	require.Equal(t, "acme", id.Tenant)
	require.Equal(t, []string{"acme/#"}, id.ACL.Publish, "tenant default ACL")
	id, err = a.Authenticate(ctx, &Request{Username: "bob", Password: []byte("pw2")})
	require.NoError(t, err, "bare name, unique, argon2id")
	require.Equal(t, []string{"#"}, id.ACL.Publish)
	_, err = a.Authenticate(ctx, &Request{Username: "alice", Password: []byte("pw")})
	require.ErrorIs(t, err, ErrBadCredentials, "ambiguous bare name")
	_, err = a.Authenticate(ctx, &Request{Username: "alice@acme", Password: []byte("nope")})
	require.ErrorIs(t, err, ErrBadCredentials)
	_, err = a.Authenticate(ctx, &Request{Username: "carol@acme", Password: []byte("pw")})
	require.ErrorIs(t, err, ErrBadCredentials)

	// Revoked: refused once the cache TTL has passed, not before. (The TTL
	// is long enough for a loaded CI machine to reach the second check.)
	_, err = a.Authenticate(ctx, &Request{Username: "alice@acme", Password: []byte("pw")})
	require.NoError(t, err)
	_, err = a.pool.Exec(ctx, `UPDATE keel_users SET disabled = true WHERE tenant = 'acme' AND username = 'alice'`)
	require.NoError(t, err)
	_, err = a.Authenticate(ctx, &Request{Username: "alice@acme", Password: []byte("pw")})
	require.NoError(t, err, "within the cache TTL")
	require.Eventually(t, func() bool {
		_, err := a.Authenticate(ctx, &Request{Username: "alice@acme", Password: []byte("pw")})
		return err != nil
	}, 15*time.Second, 50*time.Millisecond)

	// Outage: cached users still get in within the TTL; others get
	// "unavailable", never "bad credentials".
	_, err = a.Authenticate(ctx, &Request{Username: "alice@beta", Password: []byte("pw")})
	require.NoError(t, err)
	down, err := NewPostgresAuthenticator(ctx, PostgresConfig{DSN: "postgres://keel@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=1", QueryTimeout: time.Second}, nil)
	require.NoError(t, err) // pgxpool connects lazily
	t.Cleanup(down.Close)
	_, err = down.Authenticate(ctx, &Request{Username: "alice@beta", Password: []byte("pw")})
	require.ErrorIs(t, err, ErrUnavailable)
}
