package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/services/edge/internal/auth"
	"github.com/keelmq/keel/services/edge/internal/tenancy"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	"github.com/keelmq/keel/proto/gen/keel/coordinator/v1/coordinatorv1connect"
)

// The file keelctl writes is one the edge loads, and admits the user.
func TestKeelctl_UsersFile(t *testing.T) {
	file := filepath.Join(t.TempDir(), "passwd.yaml")
	t.Setenv("KEEL_PASSWORD", "s3cret")
	var out bytes.Buffer
	ctx := context.Background()
	require.NoError(t, run(ctx, []string{"users", "add", "--file", file, "--publish", "devices/%c/#", "acme", "alice"}, &out, &out))
	require.NoError(t, run(ctx, []string{"users", "add", "--file", file, "acme", "bob"}, &out, &out))
	require.NoError(t, run(ctx, []string{"acl", "tenant", "--file", file, "--publish", "acme/#", "--subscribe", "acme/#", "acme"}, &out, &out))
	require.NoError(t, run(ctx, []string{"users", "remove", "--file", file, "acme", "bob"}, &out, &out))

	f, err := auth.NewFileAuthenticator(file, nil)
	require.NoError(t, err)
	id, err := f.Authenticate(ctx, &auth.Request{Username: "alice@acme", Password: []byte("s3cret")})
	require.NoError(t, err)
	require.Equal(t, []string{"devices/%c/#"}, id.ACL.Publish)
	_, err = f.Authenticate(ctx, &auth.Request{Username: "bob@acme", Password: []byte("s3cret")})
	require.ErrorIs(t, err, auth.ErrBadCredentials)

	out.Reset()
	require.NoError(t, run(ctx, []string{"users", "list", "--file", file, "-o", "json"}, &out, &out))
	var users []auth.UserInfo
	require.NoError(t, json.Unmarshal(out.Bytes(), &users))
	require.Len(t, users, 1)
	require.Equal(t, "alice", users[0].Username)

	require.Error(t, run(ctx, []string{"users", "add", "--file", file, "Bad Tenant", "x"}, &out, &out))
	require.Error(t, run(ctx, []string{"users", "bogus"}, &out, &out))
}

// fakeCoordinator answers BumpAclVersion, failing the first unavailable
// calls with Unavailable (no leader), and records the tenants bumped.
type fakeCoordinator struct {
	coordinatorv1connect.UnimplementedCoordinatorServiceHandler
	mu          sync.Mutex
	unavailable int
	tenants     []string
	version     uint64
}

func (f *fakeCoordinator) BumpAclVersion(_ context.Context, req *connect.Request[coordinatorv1.BumpAclVersionRequest]) (*connect.Response[coordinatorv1.BumpAclVersionResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.unavailable > 0 {
		f.unavailable--
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("no known leader"))
	}
	if t := req.Msg.GetTenant(); t != "" && !tenancy.ValidTenant(t) {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("bad tenant"))
	}
	f.tenants = append(f.tenants, req.Msg.GetTenant())
	f.version += 10
	return connect.NewResponse(&coordinatorv1.BumpAclVersionResponse{Version: f.version}), nil
}

func (f *fakeCoordinator) bumped() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.tenants...)
}

func startFakeCoordinator(t *testing.T, unavailable int) (*fakeCoordinator, string) {
	f := &fakeCoordinator{unavailable: unavailable}
	mux := http.NewServeMux()
	mux.Handle(coordinatorv1connect.NewCoordinatorServiceHandler(f))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = rpc.ServerProtocols() // h2c, as the coordinator serves it
	srv.Start()
	t.Cleanup(srv.Close)
	return f, srv.URL
}

// With --coordinator (or KEEL_COORDINATOR) every command that changes users
// or ACLs bumps the tenant's ACL version after the change, retrying while
// the coordinator has no leader; "acl bump" bumps alone, for one tenant or
// all. A change whose bump fails is saved, and the error says so.
func TestKeelctl_BumpsACLVersion(t *testing.T) {
	file := filepath.Join(t.TempDir(), "passwd.yaml")
	t.Setenv("KEEL_PASSWORD", "s3cret")
	coord, url := startFakeCoordinator(t, 2)
	var out bytes.Buffer
	ctx := context.Background()
	require.NoError(t, run(ctx, []string{"users", "add", "--file", file, "--coordinator", url, "acme", "alice"}, &out, &out))
	require.Contains(t, out.String(), "acl version of tenant acme is now 10")
	require.NoError(t, run(ctx, []string{"acl", "tenant", "--file", file, "--coordinator", url, "--publish", "x/#", "--subscribe", "x/#", "beta"}, &out, &out))
	t.Setenv("KEEL_COORDINATOR", url)
	require.NoError(t, run(ctx, []string{"users", "remove", "--file", file, "acme", "alice"}, &out, &out))
	require.NoError(t, run(ctx, []string{"acl", "bump", "--tenant", "gamma"}, &out, &out))
	out.Reset()
	require.NoError(t, run(ctx, []string{"acl", "bump", "--all"}, &out, &out))
	require.Contains(t, out.String(), "acl version of every tenant is now 50")
	require.Equal(t, []string{"acme", "beta", "acme", "gamma", ""}, coord.bumped())
	require.NoError(t, run(ctx, []string{"users", "list", "--file", file}, &out, &out), "listing bumps nothing")
	require.Len(t, coord.bumped(), 5)

	for _, args := range [][]string{
		{"acl", "bump"},
		{"acl", "bump", "--tenant", "acme", "--all"},
		{"acl", "bump", "--tenant", "Bad Tenant"},
		{"acl", "bump", "--tenant", "acme", "extra"},
	} {
		require.Error(t, run(ctx, args, &out, &out), "%v", args)
	}
	require.Len(t, coord.bumped(), 5)

	t.Setenv("KEEL_COORDINATOR", "")
	require.Error(t, run(ctx, []string{"acl", "bump", "--tenant", "acme"}, &out, &out), "no coordinator")
	short, cancel := context.WithTimeout(ctx, time.Second) // an unreachable coordinator is retried until the deadline
	defer cancel()
	err := run(short, []string{"users", "add", "--file", file, "--coordinator", "http://127.0.0.1:1", "acme", "bob"}, &out, &out)
	require.ErrorContains(t, err, "user bob@acme saved, but the edges were not told")
	users, lerr := auth.FileUserStore{Path: file}.ListUsers(ctx)
	require.NoError(t, lerr)
	require.Len(t, users, 1, "the change stays saved")
}
