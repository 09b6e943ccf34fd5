package app

import (
	"context"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	"github.com/keelmq/keel/proto/gen/keel/coordinator/v1/coordinatorv1connect"
)

type client = coordinatorv1connect.CoordinatorServiceClient

// TestAPI_InvalidArgument sends malformed requests to a follower and to the
// leader, over the Connect and the gRPC protocol: each gets InvalidArgument
// and the Raft log does not move.
func TestAPI_InvalidArgument(t *testing.T) {
	t.Parallel()
	c := startCluster(t, 3, clusterOpts{fast: true})
	l := c.waitLeader(5 * time.Second)
	join(t, l.client(), "e1", 1, 2*time.Second)
	long := strings.Repeat("x", 300)
	type call func(context.Context, client) error
	calls := map[string]call{
		"claim_no_session": func(ctx context.Context, cl client) error {
			_, err := cl.ClaimSession(ctx, connect.NewRequest(&coordinatorv1.ClaimSessionRequest{EdgeId: "e1", Incarnation: 1}))
			return err
		},
		"claim_bad_tenant": func(ctx context.Context, cl client) error {
			_, err := cl.ClaimSession(ctx, connect.NewRequest(&coordinatorv1.ClaimSessionRequest{Session: sk("Bad Tenant", "c"), EdgeId: "e1", Incarnation: 1}))
			return err
		},
		"claim_long_client": func(ctx context.Context, cl client) error {
			_, err := cl.ClaimSession(ctx, connect.NewRequest(&coordinatorv1.ClaimSessionRequest{Session: sk("acme", long), EdgeId: "e1", Incarnation: 1}))
			return err
		},
		"claim_bad_utf8": func(ctx context.Context, cl client) error {
			_, err := cl.ClaimSession(ctx, connect.NewRequest(&coordinatorv1.ClaimSessionRequest{Session: sk("acme", "\x00"), EdgeId: "e1", Incarnation: 1}))
			return err
		},
		"claim_no_incarnation": func(ctx context.Context, cl client) error {
			_, err := cl.ClaimSession(ctx, connect.NewRequest(&coordinatorv1.ClaimSessionRequest{Session: sk("acme", "c"), EdgeId: "e1"}))
			return err
		},
		"claims_empty": func(ctx context.Context, cl client) error {
			_, err := cl.ClaimSessions(ctx, connect.NewRequest(&coordinatorv1.ClaimSessionsRequest{EdgeId: "e1", Incarnation: 1}))
			return err
		},
		"claims_too_many": func(ctx context.Context, cl client) error {
			req := &coordinatorv1.ClaimSessionsRequest{EdgeId: "e1", Incarnation: 1}
			for range 1001 {
				req.Claims = append(req.Claims, &coordinatorv1.SessionClaim{Session: sk("acme", "c")})
			}
			_, err := cl.ClaimSessions(ctx, connect.NewRequest(req))
			return err
		},
		"release_no_epoch": func(ctx context.Context, cl client) error {
			_, err := cl.ReleaseSession(ctx, connect.NewRequest(&coordinatorv1.ReleaseSessionRequest{Session: sk("acme", "c"), EdgeId: "e1", Incarnation: 1}))
			return err
		},
		"get_no_session": func(ctx context.Context, cl client) error {
			_, err := cl.GetSession(ctx, connect.NewRequest(&coordinatorv1.GetSessionRequest{}))
			return err
		},
		"renew_no_role": func(ctx context.Context, cl client) error {
			_, err := cl.RenewLease(ctx, connect.NewRequest(&coordinatorv1.RenewLeaseRequest{MemberId: "m", Incarnation: 1, State: coordinatorv1.MemberState_MEMBER_STATE_ALIVE}))
			return err
		},
		"renew_expired_state": func(ctx context.Context, cl client) error {
			_, err := cl.RenewLease(ctx, connect.NewRequest(&coordinatorv1.RenewLeaseRequest{MemberId: "m", Incarnation: 1,
				Role: coordinatorv1.MemberRole_MEMBER_ROLE_EDGE, State: coordinatorv1.MemberState_MEMBER_STATE_EXPIRED}))
			return err
		},
		"renew_long_id": func(ctx context.Context, cl client) error {
			_, err := cl.RenewLease(ctx, connect.NewRequest(&coordinatorv1.RenewLeaseRequest{MemberId: long, Incarnation: 1,
				Role: coordinatorv1.MemberRole_MEMBER_ROLE_EDGE, State: coordinatorv1.MemberState_MEMBER_STATE_ALIVE}))
			return err
		},
		"cas_no_group": func(ctx context.Context, cl client) error {
			_, err := cl.CompareAndSetRedisPrimary(ctx, connect.NewRequest(&coordinatorv1.CompareAndSetRedisPrimaryRequest{MemberId: "p", Incarnation: 1}))
			return err
		},
		"promotion_negative_ttl": func(ctx context.Context, cl client) error {
			_, err := cl.AcquirePromotionLease(ctx, connect.NewRequest(&coordinatorv1.AcquirePromotionLeaseRequest{MemberId: "p", Incarnation: 1,
				Ttl: durationpb.New(-time.Second)}))
			return err
		},
		"bump_acl_bad_tenant": func(ctx context.Context, cl client) error {
			_, err := cl.BumpAclVersion(ctx, connect.NewRequest(&coordinatorv1.BumpAclVersionRequest{Tenant: "Bad Tenant"}))
			return err
		},
		"watch_no_member": func(ctx context.Context, cl client) error {
			s, err := cl.WatchCluster(ctx, connect.NewRequest(&coordinatorv1.WatchClusterRequest{}))
			if err != nil {
				return err
			}
			for s.Receive() {
			}
			return s.Err()
		},
	}
	before := l.a().Node().Raft().LastIndex()
	for name, fn := range calls {
		for _, tn := range []*testNode{l, c.followers()[0]} {
			for proto, opts := range map[string][]connect.ClientOption{"connect": nil, "grpc": {connect.WithGRPC()}} {
				t.Run(name+"/"+tn.id+"/"+proto, func(t *testing.T) {
					err := fn(t.Context(), tn.client(opts...))
					require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%v", err)
				})
			}
		}
	}
	require.Equal(t, before, l.a().Node().Raft().LastIndex(), "garbage changed nothing")
}

// TestAPI_RedisPrimary runs the promotion flow: only the promotion lease
// holder can swap the record, and only from the expected record epoch.
func TestAPI_RedisPrimary(t *testing.T) {
	t.Parallel()
	c := startCluster(t, 3, clusterOpts{fast: true})
	f := c.followers()[0].client()
	acq := func(member string) *coordinatorv1.AcquirePromotionLeaseResponse {
		r, err := f.AcquirePromotionLease(t.Context(), connect.NewRequest(&coordinatorv1.AcquirePromotionLeaseRequest{MemberId: member, Incarnation: 1, GroupId: 0}))
		require.NoError(t, err)
		return r.Msg
	}
	require.True(t, acq("p1").GetAcquired())
	require.False(t, acq("p2").GetAcquired())
	cas := func(member string, expect uint64, primary string) *coordinatorv1.CompareAndSetRedisPrimaryResponse {
		r, err := f.CompareAndSetRedisPrimary(t.Context(), connect.NewRequest(&coordinatorv1.CompareAndSetRedisPrimaryRequest{MemberId: member, Incarnation: 1,
			ExpectedRecordEpoch: expect, Group: &coordinatorv1.RedisGroupRecord{GroupId: 0, PrimaryAddress: primary}}))
		require.NoError(t, err)
		return r.Msg
	}
	require.False(t, cas("p2", 0, "r2:6379").GetSwapped())
	r := cas("p1", 0, "r1:6379")
	require.True(t, r.GetSwapped())
	require.False(t, cas("p1", 0, "r3:6379").GetSwapped())
	g, err := f.GetRedisPrimary(t.Context(), connect.NewRequest(&coordinatorv1.GetRedisPrimaryRequest{GroupId: 0}))
	require.NoError(t, err)
	require.Equal(t, "r1:6379", g.Msg.GetGroup().GetPrimaryAddress())
	require.Equal(t, r.GetGroup().GetRecordEpoch(), g.Msg.GetGroup().GetRecordEpoch())
}
