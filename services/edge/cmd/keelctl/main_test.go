package main

import (
	"bytes"
	"context"
	"encoding/json"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/auth"
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
