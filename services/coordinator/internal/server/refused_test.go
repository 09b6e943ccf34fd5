package server

import (
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/coordinator/internal/raftpb"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
)

// TestServer_InvalidClaimsCounted: every claim refused for its content, by
// the handler's checks or the FSM's, is counted as
// claims_total{result="invalid_argument"}; a call refused whole counts each
// of its claims (an empty one as one). Releases are counted the same way.
func TestServer_InvalidClaimsCounted(t *testing.T) {
	ts := newTestServer(t, true, nil)
	ts.renew(t, "e1", 1)
	claims := func(result string) float64 { return testutil.ToFloat64(ts.s.metrics.claims.WithLabelValues(result)) }
	releases := func(result string) float64 { return testutil.ToFloat64(ts.s.metrics.releases.WithLabelValues(result)) }
	require.Zero(t, claims("invalid_argument"))

	// ClaimSession: no session; a request ID too long.
	_, err := ts.s.ClaimSession(t.Context(), connect.NewRequest(&coordinatorv1.ClaimSessionRequest{EdgeId: "e1", Incarnation: 1}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	require.Equal(t, 1.0, claims("invalid_argument"))
	_, err = ts.claim(t.Context(), "e1", "c1", strings.Repeat("r", 10000))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	require.Equal(t, 2.0, claims("invalid_argument"))

	// ClaimSessions: one good claim, one without a session (the handler's
	// check), one naming a malformed expected owner (the FSM's).
	call := func(edge string, cs ...*coordinatorv1.SessionClaim) ([]*coordinatorv1.ClaimResult, error) {
		resp, err := ts.s.ClaimSessions(t.Context(), connect.NewRequest(&coordinatorv1.ClaimSessionsRequest{EdgeId: edge, Incarnation: 1, Claims: cs}))
		if err != nil {
			return nil, err
		}
		return resp.Msg.GetResults(), nil
	}
	sess := func(c string) *commonv1.SessionKey { return &commonv1.SessionKey{Tenant: "acme", ClientId: c} }
	res, err := call("e1", &coordinatorv1.SessionClaim{RequestId: "a", Session: sess("a")}, &coordinatorv1.SessionClaim{RequestId: "b"},
		&coordinatorv1.SessionClaim{RequestId: "c", Session: sess("c"), ExpectedOwner: strings.Repeat("x", 10000)})
	require.NoError(t, err)
	require.NotNil(t, res[0].GetGrant())
	require.Equal(t, coordinatorv1.ClaimErrorCode_CLAIM_ERROR_CODE_INVALID_ARGUMENT, res[1].GetError().GetCode())
	require.Equal(t, coordinatorv1.ClaimErrorCode_CLAIM_ERROR_CODE_INVALID_ARGUMENT, res[2].GetError().GetCode(), res[2].GetError().GetMessage())
	require.Equal(t, 4.0, claims("invalid_argument"))
	require.Equal(t, 1.0, claims("granted"))

	// Calls refused whole: no claims; a bad edge ID with two claims.
	_, err = call("e1")
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	require.Equal(t, 5.0, claims("invalid_argument"))
	_, err = call("", &coordinatorv1.SessionClaim{RequestId: "d", Session: sess("d")}, &coordinatorv1.SessionClaim{RequestId: "e", Session: sess("e")})
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	require.Equal(t, 7.0, claims("invalid_argument"))

	// Releases: one without an epoch, and an empty ReleaseSessions call.
	_, err = ts.release(t.Context(), "e1", "a", "ra", 0)
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	require.Equal(t, 1.0, releases("invalid_argument"))
	_, err = ts.s.ReleaseSessions(t.Context(), connect.NewRequest(&coordinatorv1.ReleaseSessionsRequest{EdgeId: "e1", Incarnation: 1}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	require.Equal(t, 2.0, releases("invalid_argument"))
	require.Equal(t, 7.0, claims("invalid_argument"), "releases are not claims")
}

// TestServer_ClaimOutcomesCounted: an expected owner that does not own the
// session and a request ID answered after a newer claim each have their
// own result, not "conflict".
func TestServer_ClaimOutcomesCounted(t *testing.T) {
	ts := newTestServer(t, true, nil)
	ts.renew(t, "e1", 1)
	ts.renew(t, "e2", 1)
	claims := func(result string) float64 { return testutil.ToFloat64(ts.s.metrics.claims.WithLabelValues(result)) }

	_, err := ts.claim(t.Context(), "e1", "c1", "r1")
	require.NoError(t, err)
	_, err = ts.claim(t.Context(), "e2", "c1", "r2")
	require.NoError(t, err)
	_, err = ts.claim(t.Context(), "e1", "c1", "r1")
	require.Equal(t, connect.CodeAborted, connect.CodeOf(err), "%v", err)
	require.Equal(t, 1.0, claims("superseded"))

	resp, err := ts.s.ClaimSessions(t.Context(), connect.NewRequest(&coordinatorv1.ClaimSessionsRequest{EdgeId: "e1", Incarnation: 1,
		Claims: []*coordinatorv1.SessionClaim{{RequestId: "r3", Session: &commonv1.SessionKey{Tenant: "acme", ClientId: "c1"}, ExpectedOwner: "e3"}}}))
	require.NoError(t, err)
	require.Equal(t, coordinatorv1.ClaimErrorCode_CLAIM_ERROR_CODE_OWNER_CHANGED, resp.Msg.GetResults()[0].GetError().GetCode())
	require.Equal(t, 1.0, claims("owner_changed"))
	require.Equal(t, 2.0, claims("granted"))
	require.Zero(t, claims("conflict"))
}

func TestClaimResultLabel(t *testing.T) {
	seen := map[string]bool{}
	for st := range raftpb.ClaimStatus_name {
		l := claimResultLabel(raftpb.ClaimStatus(st))
		require.Contains(t, claimResults, l, "%v", raftpb.ClaimStatus(st))
		seen[l] = true
	}
	require.Len(t, seen, len(claimResults), "every status its own label")
	require.Equal(t, "conflict", claimResultLabel(raftpb.ClaimStatus_CLAIM_STATUS_CONFLICT))
	for st := range raftpb.ReleaseStatus_name {
		require.Contains(t, releaseResults, releaseResultLabel(raftpb.ReleaseStatus(st)))
	}
}
