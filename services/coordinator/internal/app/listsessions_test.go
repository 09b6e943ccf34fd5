package app

import (
	"context"
	"encoding/base64"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
)

// TestAPI_ListSessions lists the ownership records of a real three-node
// cluster through a follower (which forwards to the leader) and from the
// follower's own state: page by page with the continuation token, filtered
// by tenant, owner edge and client ID prefix, with the page size capped;
// a released session leaves the listing; malformed filters and tokens are
// InvalidArgument.
func TestAPI_ListSessions(t *testing.T) {
	t.Parallel()
	c := startCluster(t, 3, clusterOpts{fast: true})
	l := c.waitLeader(5 * time.Second)
	f := c.followers()[0].client()
	join(t, l.client(), "e1", 1, 2*time.Second)
	join(t, l.client(), "e2", 3, 2*time.Second)

	type sess struct{ tenant, client, owner string }
	var want []sess
	claims := map[string]*coordinatorv1.ClaimSessionsRequest{
		"e1": {EdgeId: "e1", Incarnation: 1},
		"e2": {EdgeId: "e2", Incarnation: 3},
	}
	for _, tenant := range []string{"acme", "globex"} {
		for i := range 12 {
			client := fmt.Sprintf("dev-%d", i)
			owner := "e1"
			if i%3 == 0 {
				owner = "e2"
			}
			claims[owner].Claims = append(claims[owner].Claims, &coordinatorv1.SessionClaim{Session: sk(tenant, client)})
			want = append(want, sess{tenant, client, owner})
		}
	}
	claims["e1"].Claims = append(claims["e1"].Claims, &coordinatorv1.SessionClaim{Session: sk("acme", "sensor")})
	want = append(want, sess{"acme", "sensor", "e1"})
	for _, req := range claims {
		resp, err := retry(t.Context(), 10*time.Second, func(ctx context.Context) (*connect.Response[coordinatorv1.ClaimSessionsResponse], error) {
			return f.ClaimSessions(ctx, connect.NewRequest(req))
		})
		require.NoError(t, err)
		for _, r := range resp.Msg.GetResults() {
			require.NotNil(t, r.GetGrant(), "%v", r.GetError())
		}
	}
	// The documented order: tenants grouped (shorter names first), client
	// IDs in byte order.
	slices.SortFunc(want, func(a, b sess) int {
		if d := len(a.tenant) - len(b.tenant); d != 0 {
			return d
		}
		return strings.Compare(a.tenant+"\x00"+a.client, b.tenant+"\x00"+b.client)
	})
	key := func(tenant, client, owner string) string { return tenant + "/" + client + "@" + owner }
	pick := func(keep func(sess) bool) []string {
		var out []string
		for _, s := range want {
			if keep(s) {
				out = append(out, key(s.tenant, s.client, s.owner))
			}
		}
		return out
	}

	list := func(cl client, req *coordinatorv1.ListSessionsRequest) (*coordinatorv1.ListSessionsResponse, error) {
		resp, err := retry(t.Context(), 10*time.Second, func(ctx context.Context) (*connect.Response[coordinatorv1.ListSessionsResponse], error) {
			return cl.ListSessions(ctx, connect.NewRequest(req))
		})
		if err != nil {
			return nil, err
		}
		return resp.Msg, nil
	}
	// all pages through a listing, checking every record, and returns the
	// sessions and the number of pages.
	all := func(cl client, req *coordinatorv1.ListSessionsRequest) ([]string, int) {
		t.Helper()
		var got []string
		pages := 0
		for {
			resp, err := list(cl, req)
			require.NoError(t, err)
			pages++
			require.Positive(t, resp.GetIndex())
			if req.GetPageSize() > 0 {
				require.LessOrEqual(t, len(resp.GetSessions()), int(req.GetPageSize()))
			}
			for _, r := range resp.GetSessions() {
				require.Positive(t, r.GetEpoch())
				require.Equal(t, coordinatorv1.SessionOwnerKind_SESSION_OWNER_KIND_CONNECTION, r.GetOwnerKind())
				require.NotNil(t, r.GetGrantedAt())
				inc := map[string]uint64{"e1": 1, "e2": 3}[r.GetOwnerEdgeId()]
				require.Equal(t, inc, r.GetOwnerIncarnation())
				got = append(got, key(r.GetSession().GetTenant(), r.GetSession().GetClientId(), r.GetOwnerEdgeId()))
			}
			if resp.GetNextPageToken() == "" {
				return got, pages
			}
			require.NotEmpty(t, resp.GetSessions(), "a page with a token holds records here (no scan budget reached)")
			req.PageToken = resp.GetNextPageToken()
		}
	}

	got, pages := all(f, &coordinatorv1.ListSessionsRequest{PageSize: 7})
	require.Equal(t, pick(func(sess) bool { return true }), got)
	require.Equal(t, 4, pages, "25 sessions in pages of 7")
	got, pages = all(f, &coordinatorv1.ListSessionsRequest{})
	require.Len(t, got, 25)
	require.Equal(t, 1, pages, "the default page holds 100")
	got, _ = all(f, &coordinatorv1.ListSessionsRequest{PageSize: 25})
	require.Len(t, got, 25, "exactly one page: no token for an empty one")

	got, _ = all(f, &coordinatorv1.ListSessionsRequest{Tenant: "acme", PageSize: 5})
	require.Equal(t, pick(func(s sess) bool { return s.tenant == "acme" }), got)
	got, _ = all(f, &coordinatorv1.ListSessionsRequest{OwnerEdgeId: "e2", PageSize: 3})
	require.Equal(t, pick(func(s sess) bool { return s.owner == "e2" }), got)
	got, _ = all(f, &coordinatorv1.ListSessionsRequest{Tenant: "globex", OwnerEdgeId: "e1", ClientIdPrefix: "dev-1", PageSize: 1})
	require.Equal(t, pick(func(s sess) bool {
		return s.tenant == "globex" && s.owner == "e1" && strings.HasPrefix(s.client, "dev-1")
	}), got)
	got, _ = all(f, &coordinatorv1.ListSessionsRequest{ClientIdPrefix: "dev-1", PageSize: 2})
	require.Equal(t, pick(func(s sess) bool { return strings.HasPrefix(s.client, "dev-1") }), got)
	got, _ = all(f, &coordinatorv1.ListSessionsRequest{Tenant: "initech"})
	require.Empty(t, got)
	got, _ = all(f, &coordinatorv1.ListSessionsRequest{OwnerEdgeId: "e9"})
	require.Empty(t, got)

	// The follower's own state, which may lag: it catches up.
	testutil.Eventually(t, 5*time.Second, func() error {
		resp, err := list(f, &coordinatorv1.ListSessionsRequest{AllowStale: true, Tenant: "acme"})
		if err != nil {
			return err
		}
		if n := len(resp.GetSessions()); n != 13 {
			return fmt.Errorf("%d acme sessions on the follower, want 13", n)
		}
		return nil
	})

	// A released session leaves the listing.
	rec := getSession(t, l.client(), "acme", "sensor")
	_, err := l.client().ReleaseSession(t.Context(), connect.NewRequest(&coordinatorv1.ReleaseSessionRequest{Session: sk("acme", "sensor"),
		Epoch: rec.GetEpoch(), EdgeId: "e1", Incarnation: 1, Reason: coordinatorv1.ReleaseSessionReason_RELEASE_SESSION_REASON_ADMIN}))
	require.NoError(t, err)
	got, _ = all(f, &coordinatorv1.ListSessionsRequest{Tenant: "acme", ClientIdPrefix: "s"})
	require.Empty(t, got)

	// The page size is capped at 1000.
	bulk := &coordinatorv1.ClaimSessionsRequest{EdgeId: "e1", Incarnation: 1}
	for i := range 1000 {
		bulk.Claims = append(bulk.Claims, &coordinatorv1.SessionClaim{Session: sk("bulk", fmt.Sprintf("c%04d", i))})
	}
	_, err = retry(t.Context(), 10*time.Second, func(ctx context.Context) (*connect.Response[coordinatorv1.ClaimSessionsResponse], error) {
		return l.client().ClaimSessions(ctx, connect.NewRequest(bulk))
	})
	require.NoError(t, err)
	_, err = claimOne(t.Context(), l.client(), "e1", 1, "bulk", "c1000", "")
	require.NoError(t, err)
	resp, err := list(f, &coordinatorv1.ListSessionsRequest{Tenant: "bulk", PageSize: 5000})
	require.NoError(t, err)
	require.Len(t, resp.GetSessions(), 1000)
	require.Equal(t, "c0999", resp.GetSessions()[999].GetSession().GetClientId())
	require.NotEmpty(t, resp.GetNextPageToken())
	resp, err = list(f, &coordinatorv1.ListSessionsRequest{Tenant: "bulk", PageSize: 5000, PageToken: resp.GetNextPageToken()})
	require.NoError(t, err)
	require.Len(t, resp.GetSessions(), 1)
	require.Equal(t, "c1000", resp.GetSessions()[0].GetSession().GetClientId())
	require.Empty(t, resp.GetNextPageToken())

	// Malformed requests, on the leader and on a follower.
	first, err := list(f, &coordinatorv1.ListSessionsRequest{Tenant: "acme", PageSize: 1})
	require.NoError(t, err)
	acmeToken := first.GetNextPageToken()
	require.NotEmpty(t, acmeToken)
	b64 := base64.RawURLEncoding.EncodeToString
	for name, req := range map[string]*coordinatorv1.ListSessionsRequest{
		"token_not_base64":      {PageToken: "not a token!"},
		"token_garbage":         {PageToken: b64([]byte("garbage"))},
		"token_bad_version":     {PageToken: b64(append([]byte{9, 4}, "acmedev-1"...))},
		"token_short":           {PageToken: b64([]byte{1, 40, 'a'})},
		"token_bad_tenant":      {PageToken: b64(append([]byte{1, 3}, "A Bdev"...))},
		"token_too_long":        {PageToken: strings.Repeat("A", 1000)},
		"token_other_tenant":    {Tenant: "globex", PageToken: acmeToken},
		"prefix_too_long":       {Tenant: "acme", ClientIdPrefix: strings.Repeat("x", 257)},
		"prefix_nul":            {ClientIdPrefix: "dev\x00"},
		"tenant_bad":            {Tenant: "Bad Tenant"},
		"owner_too_long":        {OwnerEdgeId: strings.Repeat("e", 200)},
		"allow_stale_bad_token": {AllowStale: true, PageToken: "%%%"},
	} {
		for _, tn := range []*testNode{l, c.followers()[0]} {
			_, err := tn.client().ListSessions(t.Context(), connect.NewRequest(req))
			require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%s on %s: %v", name, tn.id, err)
			t.Logf("%s: %v", name, err)
		}
	}
	// A token continues whatever the filters, as long as the tenant agrees.
	resp, err = list(f, &coordinatorv1.ListSessionsRequest{PageToken: acmeToken, PageSize: 1})
	require.NoError(t, err)
	require.Len(t, resp.GetSessions(), 1)
}
