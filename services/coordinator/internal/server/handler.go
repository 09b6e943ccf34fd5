package server

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/services/coordinator/internal/fsm"
	"github.com/keelmq/keel/services/coordinator/internal/lease"
	"github.com/keelmq/keel/services/coordinator/internal/raftpb"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	"github.com/keelmq/keel/proto/gen/keel/coordinator/v1/coordinatorv1connect"
)

type client = coordinatorv1connect.CoordinatorServiceClient

// maxClaimRetries bounds how often a claim that met itself in one entry
// (CONFLICT) is resubmitted before the caller sees Unavailable.
const maxClaimRetries = 5

func checkSession(k *commonv1.SessionKey) error {
	if k == nil {
		return invalid("session is required")
	}
	if err := fsm.CheckSession(k.GetTenant(), k.GetClientId()); err != nil {
		return connect.NewError(connect.CodeInvalidArgument, err)
	}
	return nil
}

func checkMember(id string, inc uint64) error {
	if err := fsm.CheckMemberID(id); err != nil {
		return connect.NewError(connect.CodeInvalidArgument, err)
	}
	if inc == 0 {
		return invalid("incarnation must be positive")
	}
	return nil
}

func checkRequestID(id string) error {
	if err := fsm.CheckRequestID(id); err != nil {
		return connect.NewError(connect.CodeInvalidArgument, err)
	}
	return nil
}

// leaderTermOrNil returns the current term state, ErrNotReady on a leader that
// is not ready, or (nil, nil) on a follower (the caller forwards).
func (s *Server) leaderTermOrNil() (*leaderTerm, error) {
	if t := s.term.Load(); t != nil {
		return t, nil
	}
	if s.node.IsLeader() {
		return nil, s.toConnect(ErrNotReady)
	}
	return nil, nil
}

// ClaimSession implements the RPC.
func (s *Server) ClaimSession(ctx context.Context, req *connect.Request[coordinatorv1.ClaimSessionRequest]) (*connect.Response[coordinatorv1.ClaimSessionResponse], error) {
	m := req.Msg
	for _, err := range []error{checkRequestID(m.GetRequestId()), checkSession(m.GetSession()), checkMember(m.GetEdgeId(), m.GetIncarnation())} {
		if err != nil {
			s.refused(s.metrics.claims, "claim", m.GetEdgeId(), m.GetIncarnation(), 1, err)
			return nil, err
		}
	}
	t, err := s.leaderTermOrNil()
	if err != nil {
		return nil, err
	}
	if t == nil {
		return forward(ctx, s, req, client.ClaimSession)
	}
	claim := &raftpb.Claim{RequestId: m.GetRequestId(), Tenant: m.GetSession().GetTenant(), ClientId: m.GetSession().GetClientId(),
		EdgeId: m.GetEdgeId(), Incarnation: m.GetIncarnation()}
	outs, err := s.claim(ctx, t, m.GetEdgeId(), m.GetIncarnation(), []*raftpb.Claim{claim})
	if err != nil {
		return nil, s.toConnect(err)
	}
	o := outs[0]
	switch o.GetStatus() {
	case raftpb.ClaimStatus_CLAIM_STATUS_GRANTED:
		return connect.NewResponse(&coordinatorv1.ClaimSessionResponse{Grant: s.grant(t, claim, o)}), nil
	case raftpb.ClaimStatus_CLAIM_STATUS_LEASE_INVALID:
		return nil, s.toConnect(fmt.Errorf("%w: %s", ErrLeaseInvalid, o.GetMessage()))
	case raftpb.ClaimStatus_CLAIM_STATUS_INVALID_ARGUMENT:
		return nil, invalid("%s", o.GetMessage())
	case raftpb.ClaimStatus_CLAIM_STATUS_SUPERSEDED:
		return nil, connect.NewError(connect.CodeAborted, fmt.Errorf("claim superseded: %s", o.GetMessage()))
	default:
		return nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("claim not applied: %s", o.GetMessage()))
	}
}

// ClaimSessions implements the RPC.
func (s *Server) ClaimSessions(ctx context.Context, req *connect.Request[coordinatorv1.ClaimSessionsRequest]) (*connect.Response[coordinatorv1.ClaimSessionsResponse], error) {
	m := req.Msg
	if err := checkMember(m.GetEdgeId(), m.GetIncarnation()); err != nil {
		s.refused(s.metrics.claims, "claim", m.GetEdgeId(), m.GetIncarnation(), refusedCall(len(m.GetClaims())), err)
		return nil, err
	}
	if n := len(m.GetClaims()); n == 0 || n > s.cfg.MaxClaimsPerCall {
		err := invalid("%d claims: want 1 to %d", n, s.cfg.MaxClaimsPerCall)
		s.refused(s.metrics.claims, "claim", m.GetEdgeId(), m.GetIncarnation(), refusedCall(n), err)
		return nil, err
	}
	t, err := s.leaderTermOrNil()
	if err != nil {
		return nil, err
	}
	if t == nil {
		return forward(ctx, s, req, client.ClaimSessions)
	}
	resp := &coordinatorv1.ClaimSessionsResponse{Results: make([]*coordinatorv1.ClaimResult, len(m.GetClaims()))}
	var claims []*raftpb.Claim
	var pos []int
	for i, c := range m.GetClaims() {
		if err := firstErr(checkRequestID(c.GetRequestId()), checkSession(c.GetSession())); err != nil {
			resp.Results[i] = claimError(coordinatorv1.ClaimErrorCode_CLAIM_ERROR_CODE_INVALID_ARGUMENT, err.Error())
			s.refused(s.metrics.claims, "claim", m.GetEdgeId(), m.GetIncarnation(), 1, err)
			continue
		}
		claims = append(claims, &raftpb.Claim{RequestId: c.GetRequestId(), Tenant: c.GetSession().GetTenant(),
			ClientId: c.GetSession().GetClientId(), EdgeId: m.GetEdgeId(), Incarnation: m.GetIncarnation(), ExpectedOwner: c.GetExpectedOwner()})
		pos = append(pos, i)
	}
	if len(claims) > 0 {
		outs, err := s.claim(ctx, t, m.GetEdgeId(), m.GetIncarnation(), claims)
		if err != nil {
			return nil, s.toConnect(err)
		}
		for j, o := range outs {
			var r *coordinatorv1.ClaimResult
			switch o.GetStatus() {
			case raftpb.ClaimStatus_CLAIM_STATUS_GRANTED:
				r = &coordinatorv1.ClaimResult{Outcome: &coordinatorv1.ClaimResult_Grant{Grant: s.grant(t, claims[j], o)}}
			case raftpb.ClaimStatus_CLAIM_STATUS_LEASE_INVALID:
				r = claimError(coordinatorv1.ClaimErrorCode_CLAIM_ERROR_CODE_LEASE_INVALID, o.GetMessage())
			case raftpb.ClaimStatus_CLAIM_STATUS_INVALID_ARGUMENT:
				r = claimError(coordinatorv1.ClaimErrorCode_CLAIM_ERROR_CODE_INVALID_ARGUMENT, o.GetMessage())
			case raftpb.ClaimStatus_CLAIM_STATUS_OWNER_CHANGED:
				r = claimError(coordinatorv1.ClaimErrorCode_CLAIM_ERROR_CODE_OWNER_CHANGED, o.GetMessage())
			case raftpb.ClaimStatus_CLAIM_STATUS_SUPERSEDED:
				r = claimError(coordinatorv1.ClaimErrorCode_CLAIM_ERROR_CODE_SUPERSEDED, o.GetMessage())
			default:
				r = claimError(coordinatorv1.ClaimErrorCode_CLAIM_ERROR_CODE_UNSPECIFIED, o.GetMessage())
			}
			resp.Results[pos[j]] = r
		}
	}
	return connect.NewResponse(resp), nil
}

func firstErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

func claimError(code coordinatorv1.ClaimErrorCode, msg string) *coordinatorv1.ClaimResult {
	return &coordinatorv1.ClaimResult{Outcome: &coordinatorv1.ClaimResult_Error{Error: &coordinatorv1.ClaimError{Code: code, Message: msg}}}
}

// claim checks the claimant's lease on the leader's clock, then submits the
// claims to the batcher, resubmitting those that met the same session in one
// entry.
func (s *Server) claim(ctx context.Context, t *leaderTerm, edge string, inc uint64, claims []*raftpb.Claim) ([]*raftpb.ClaimOutcome, error) {
	outs := make([]*raftpb.ClaimOutcome, len(claims))
	l, ok := t.leases.Get(edge)
	if !ok || l.Incarnation != inc || l.Role != raftpb.MemberRole_MEMBER_ROLE_EDGE ||
		l.State != raftpb.MemberState_MEMBER_STATE_ALIVE || !s.now().Before(l.Expires) {
		for i := range outs {
			outs[i] = &raftpb.ClaimOutcome{Status: raftpb.ClaimStatus_CLAIM_STATUS_LEASE_INVALID,
				Message: "no valid lease for this edge incarnation on the leader"}
		}
		s.metrics.claims.WithLabelValues("lease_invalid").Add(float64(len(claims)))
		return outs, nil
	}
	pending := make([]int, len(claims))
	for i := range pending {
		pending[i] = i
	}
	for attempt := 0; len(pending) > 0; attempt++ {
		batch := make([]*raftpb.Claim, len(pending))
		for j, i := range pending {
			batch[j] = claims[i]
		}
		res, err := t.claims.submit(ctx, batch)
		if err != nil {
			return nil, err
		}
		var again []int
		for j, o := range res {
			outs[pending[j]] = o
			if o.GetStatus() == raftpb.ClaimStatus_CLAIM_STATUS_CONFLICT && attempt < maxClaimRetries {
				again = append(again, pending[j])
			}
		}
		pending = again
	}
	for _, o := range outs {
		if o.GetStatus() == raftpb.ClaimStatus_CLAIM_STATUS_INVALID_ARGUMENT {
			// Refused by the FSM's checks (an expected owner's ID, say).
			s.refused(s.metrics.claims, "claim", edge, inc, 1, errors.New(o.GetMessage()))
			continue
		}
		s.metrics.claims.WithLabelValues(claimResultLabel(o.GetStatus())).Inc()
	}
	return outs, nil
}

// claimResults are the values of keel_coordinator_claims_total{result}:
// granted; lease_invalid (the claimant has no live lease); invalid_argument
// (a malformed claim or call, refused whole: each of its claims, one if it
// has none); owner_changed (the session is not owned by the expected owner
// a batch claim named); superseded (a request ID answered again after a
// newer claim of the session: the claimant learns late it lost it);
// conflict (met a claim of the same session in every entry it was retried
// in: answered Unavailable); not_applied (any other outcome).
var claimResults = []string{"granted", "lease_invalid", "invalid_argument", "owner_changed", "superseded", "conflict", "not_applied"}

func claimResultLabel(st raftpb.ClaimStatus) string {
	switch st {
	case raftpb.ClaimStatus_CLAIM_STATUS_GRANTED:
		return "granted"
	case raftpb.ClaimStatus_CLAIM_STATUS_LEASE_INVALID:
		return "lease_invalid"
	case raftpb.ClaimStatus_CLAIM_STATUS_INVALID_ARGUMENT:
		return "invalid_argument"
	case raftpb.ClaimStatus_CLAIM_STATUS_OWNER_CHANGED:
		return "owner_changed"
	case raftpb.ClaimStatus_CLAIM_STATUS_SUPERSEDED:
		return "superseded"
	case raftpb.ClaimStatus_CLAIM_STATUS_CONFLICT:
		return "conflict"
	default:
		return "not_applied"
	}
}

// refusedLogInterval bounds how often refused claims and releases are
// logged: a broken edge can send thousands a second (the counters count
// every one).
const refusedLogInterval = 10 * time.Second

// refused counts n claims or releases (c: claims or releases) refused as
// invalid_argument for edge's call, and logs it unless a refusal was logged
// less than refusedLogInterval ago.
func (s *Server) refused(c *prometheus.CounterVec, what, edge string, inc uint64, n int, err error) {
	c.WithLabelValues("invalid_argument").Add(float64(n))
	if s.refusedLog.Allow(refusedLogInterval) {
		s.logger.Warn(what+" refused", logging.KeyEdgeID, truncateForError(edge), "incarnation", inc, "count", n, logging.Err(err))
	}
}

// refusedCall is how many claims or releases a call of n refused whole
// counts: each of them, and an empty call as one, so that no refusal goes
// uncounted.
func refusedCall(n int) int { return max(n, 1) }

func (s *Server) grant(t *leaderTerm, c *raftpb.Claim, o *raftpb.ClaimOutcome) *coordinatorv1.SessionGrant {
	g := &coordinatorv1.SessionGrant{
		Session:                     &commonv1.SessionKey{Tenant: c.GetTenant(), ClientId: c.GetClientId()},
		Epoch:                       o.GetEpoch(),
		Previous:                    toSessionRecord(o.GetPrevious()),
		PreviousOwnerLeaseRemaining: durationpb.New(0),
	}
	if p := o.GetPrevious(); p != nil {
		// The state read here is at or after the claim's entry: an edge
		// seen gone in it died before the claim, or at least before the
		// claimant hears of it.
		st := s.fsm.State()
		if m := liveMember(st, p.GetOwnerEdgeId(), p.GetOwnerIncarnation()); m != nil {
			g.PreviousOwnerAddress = m.GetAddress()
		}
		g.PreviousOwnerLeaseRemaining = durationpb.New(t.leases.Remaining(p.GetOwnerEdgeId(), p.GetOwnerIncarnation(), s.now()))
		src, srcInc := p.GetOwnerEdgeId(), p.GetOwnerIncarnation()
		if src == c.GetEdgeId() {
			src, srcInc = p.GetTakenFromEdgeId(), p.GetTakenFromIncarnation()
		}
		g.SourceGone = src != "" && liveMember(st, src, srcInc) == nil
	}
	return g
}

// liveMember returns the member record of incarnation inc of id if that
// incarnation is alive or draining in st, else nil.
func liveMember(st *fsm.State, id string, inc uint64) *raftpb.MemberRecord {
	m := st.Member(id)
	if m == nil || m.GetIncarnation() != inc {
		return nil
	}
	if m.GetState() != raftpb.MemberState_MEMBER_STATE_ALIVE && m.GetState() != raftpb.MemberState_MEMBER_STATE_DRAINING {
		return nil
	}
	return m
}

// ReleaseSession implements the RPC: ReleaseSessions for one session.
func (s *Server) ReleaseSession(ctx context.Context, req *connect.Request[coordinatorv1.ReleaseSessionRequest]) (*connect.Response[coordinatorv1.ReleaseSessionResponse], error) {
	m := req.Msg
	if err := firstErr(checkRequestID(m.GetRequestId()), checkSession(m.GetSession()), checkMember(m.GetEdgeId(), m.GetIncarnation()), checkEpoch(m.GetEpoch())); err != nil {
		s.refused(s.metrics.releases, "release", m.GetEdgeId(), m.GetIncarnation(), 1, err)
		return nil, err
	}
	t, err := s.leaderTermOrNil()
	if err != nil {
		return nil, err
	}
	if t == nil {
		return forward(ctx, s, req, client.ReleaseSession)
	}
	outs, err := s.release(ctx, t, []*raftpb.ReleaseSessionCommand{releaseCommand(m.GetEdgeId(), m.GetIncarnation(),
		m.GetRequestId(), m.GetSession(), m.GetEpoch())})
	if err != nil {
		return nil, s.toConnect(err)
	}
	r := releaseResult(outs[0])
	if e := r.GetError(); e != nil {
		code := connect.CodeUnavailable
		switch e.GetCode() {
		case coordinatorv1.ReleaseErrorCode_RELEASE_ERROR_CODE_STALE_EPOCH, coordinatorv1.ReleaseErrorCode_RELEASE_ERROR_CODE_NOT_OWNER:
			code = connect.CodeFailedPrecondition
		case coordinatorv1.ReleaseErrorCode_RELEASE_ERROR_CODE_INVALID_ARGUMENT:
			code = connect.CodeInvalidArgument
		}
		return nil, connect.NewError(code, errors.New(e.GetMessage()))
	}
	return connect.NewResponse(&coordinatorv1.ReleaseSessionResponse{Released: r.GetReleased()}), nil
}

// ReleaseSessions implements the RPC. The releases of concurrent calls share
// Raft entries (the leader's release batcher), as claims do.
func (s *Server) ReleaseSessions(ctx context.Context, req *connect.Request[coordinatorv1.ReleaseSessionsRequest]) (*connect.Response[coordinatorv1.ReleaseSessionsResponse], error) {
	m := req.Msg
	if err := checkMember(m.GetEdgeId(), m.GetIncarnation()); err != nil {
		s.refused(s.metrics.releases, "release", m.GetEdgeId(), m.GetIncarnation(), refusedCall(len(m.GetReleases())), err)
		return nil, err
	}
	if n := len(m.GetReleases()); n == 0 || n > s.cfg.MaxClaimsPerCall {
		err := invalid("%d releases: want 1 to %d", n, s.cfg.MaxClaimsPerCall)
		s.refused(s.metrics.releases, "release", m.GetEdgeId(), m.GetIncarnation(), refusedCall(n), err)
		return nil, err
	}
	t, err := s.leaderTermOrNil()
	if err != nil {
		return nil, err
	}
	if t == nil {
		return forward(ctx, s, req, client.ReleaseSessions)
	}
	resp := &coordinatorv1.ReleaseSessionsResponse{Results: make([]*coordinatorv1.ReleaseResult, len(m.GetReleases()))}
	var cmds []*raftpb.ReleaseSessionCommand
	var pos []int
	for i, r := range m.GetReleases() {
		if err := firstErr(checkRequestID(r.GetRequestId()), checkSession(r.GetSession()), checkEpoch(r.GetEpoch())); err != nil {
			resp.Results[i] = &coordinatorv1.ReleaseResult{Error: &coordinatorv1.ReleaseError{
				Code: coordinatorv1.ReleaseErrorCode_RELEASE_ERROR_CODE_INVALID_ARGUMENT, Message: err.Error()}}
			s.refused(s.metrics.releases, "release", m.GetEdgeId(), m.GetIncarnation(), 1, err)
			continue
		}
		cmds = append(cmds, releaseCommand(m.GetEdgeId(), m.GetIncarnation(), r.GetRequestId(), r.GetSession(), r.GetEpoch()))
		pos = append(pos, i)
	}
	if len(cmds) > 0 {
		outs, err := s.release(ctx, t, cmds)
		if err != nil {
			return nil, s.toConnect(err)
		}
		for j, o := range outs {
			resp.Results[pos[j]] = releaseResult(o)
		}
	}
	return connect.NewResponse(resp), nil
}

func checkEpoch(epoch uint64) error {
	if epoch == 0 {
		return invalid("epoch is required")
	}
	return nil
}

func releaseCommand(edge string, inc uint64, requestID string, k *commonv1.SessionKey, epoch uint64) *raftpb.ReleaseSessionCommand {
	return &raftpb.ReleaseSessionCommand{RequestId: requestID, Tenant: k.GetTenant(), ClientId: k.GetClientId(),
		Epoch: epoch, EdgeId: edge, Incarnation: inc}
}

// release submits releases to the leader's batcher, or, until every voter
// applies ReleaseSessions entries, each in an entry of its own; it counts
// their outcomes.
func (s *Server) release(ctx context.Context, t *leaderTerm, cmds []*raftpb.ReleaseSessionCommand) ([]*raftpb.ReleaseOutcome, error) {
	submit := t.releases.submit
	if !t.releaseBatches.Load() {
		submit = s.releaseEach
	}
	outs, err := submit(ctx, cmds)
	if err != nil {
		return nil, err
	}
	for _, o := range outs {
		s.metrics.releases.WithLabelValues(releaseResultLabel(o.GetStatus())).Inc()
	}
	return outs, nil
}

// releaseEach applies each release as a CmdReleaseSession entry, all at
// once, and answers as a ReleaseSessions entry would. An error that is not
// a refusal fails the call: its releases are sent again, under the same
// request IDs.
func (s *Server) releaseEach(ctx context.Context, cmds []*raftpb.ReleaseSessionCommand) ([]*raftpb.ReleaseOutcome, error) {
	outs := make([]*raftpb.ReleaseOutcome, len(cmds))
	errs := make([]error, len(cmds))
	now := s.now().UnixNano()
	var wg sync.WaitGroup
	for i, c := range cmds {
		wg.Go(func() {
			c.NowUnixNano = now
			msg, _, err := s.apply(ctx, fsm.CmdReleaseSession, c)
			res, _ := msg.(*raftpb.ReleaseSessionResult)
			outs[i], errs[i] = fsm.ReleaseOutcome(res, err)
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return outs, nil
}

// releaseResults are the values of keel_coordinator_releases_total{result}.
var releaseResults = []string{"released", "absent", "stale_epoch", "not_owner", "invalid_argument", "not_applied"}

func releaseResultLabel(st raftpb.ReleaseStatus) string {
	switch st {
	case raftpb.ReleaseStatus_RELEASE_STATUS_RELEASED:
		return "released"
	case raftpb.ReleaseStatus_RELEASE_STATUS_ABSENT:
		return "absent"
	case raftpb.ReleaseStatus_RELEASE_STATUS_STALE_EPOCH:
		return "stale_epoch"
	case raftpb.ReleaseStatus_RELEASE_STATUS_NOT_OWNER:
		return "not_owner"
	case raftpb.ReleaseStatus_RELEASE_STATUS_INVALID_ARGUMENT:
		return "invalid_argument"
	default:
		return "not_applied"
	}
}

// releaseResult is the API's answer for one release outcome.
func releaseResult(o *raftpb.ReleaseOutcome) *coordinatorv1.ReleaseResult {
	code := coordinatorv1.ReleaseErrorCode_RELEASE_ERROR_CODE_UNSPECIFIED
	switch o.GetStatus() {
	case raftpb.ReleaseStatus_RELEASE_STATUS_RELEASED:
		return &coordinatorv1.ReleaseResult{Released: true}
	case raftpb.ReleaseStatus_RELEASE_STATUS_ABSENT:
		return &coordinatorv1.ReleaseResult{}
	case raftpb.ReleaseStatus_RELEASE_STATUS_STALE_EPOCH:
		code = coordinatorv1.ReleaseErrorCode_RELEASE_ERROR_CODE_STALE_EPOCH
	case raftpb.ReleaseStatus_RELEASE_STATUS_NOT_OWNER:
		code = coordinatorv1.ReleaseErrorCode_RELEASE_ERROR_CODE_NOT_OWNER
	case raftpb.ReleaseStatus_RELEASE_STATUS_INVALID_ARGUMENT:
		code = coordinatorv1.ReleaseErrorCode_RELEASE_ERROR_CODE_INVALID_ARGUMENT
	}
	msg := o.GetMessage()
	if code == coordinatorv1.ReleaseErrorCode_RELEASE_ERROR_CODE_UNSPECIFIED {
		msg = "release not applied: " + msg
	}
	return &coordinatorv1.ReleaseResult{Error: &coordinatorv1.ReleaseError{Code: code, Message: msg}}
}

// linearizable confirms leadership with a quorum before a local read. Since
// the leader acknowledges writes only after applying them, every write
// acknowledged before this call is then visible in the FSM.
func (s *Server) linearizable(ctx context.Context) error {
	if _, err := s.leaderTermOrNil(); err != nil {
		return err
	}
	return s.toConnect(s.node.VerifyLeader(ctx))
}

// GetSession implements the RPC.
func (s *Server) GetSession(ctx context.Context, req *connect.Request[coordinatorv1.GetSessionRequest]) (*connect.Response[coordinatorv1.GetSessionResponse], error) {
	m := req.Msg
	if err := checkSession(m.GetSession()); err != nil {
		return nil, err
	}
	if !m.GetAllowStale() {
		if !s.node.IsLeader() {
			return forward(ctx, s, req, client.GetSession)
		}
		if err := s.linearizable(ctx); err != nil {
			return nil, err
		}
	}
	st := s.fsm.State()
	return connect.NewResponse(&coordinatorv1.GetSessionResponse{
		Session: toSessionRecord(st.Session(m.GetSession().GetTenant(), m.GetSession().GetClientId())),
		Index:   st.Index(),
	}), nil
}

// RenewLease implements the RPC. A renewal of an unchanged, valid lease costs
// no Raft entry; joins, rejoins (higher incarnation), drains and leaves are
// recorded in Raft before the lease is granted.
func (s *Server) RenewLease(ctx context.Context, req *connect.Request[coordinatorv1.RenewLeaseRequest]) (*connect.Response[coordinatorv1.RenewLeaseResponse], error) {
	m := req.Msg
	if err := checkMember(m.GetMemberId(), m.GetIncarnation()); err != nil {
		return nil, err
	}
	if err := fsm.CheckAddress(m.GetAddress()); err != nil {
		return nil, s.toConnect(err)
	}
	if _, ok := coordinatorv1.MemberRole_name[int32(m.GetRole())]; !ok || m.GetRole() == coordinatorv1.MemberRole_MEMBER_ROLE_UNSPECIFIED {
		return nil, invalid("role %d", m.GetRole())
	}
	switch m.GetState() {
	case coordinatorv1.MemberState_MEMBER_STATE_ALIVE, coordinatorv1.MemberState_MEMBER_STATE_DRAINING, coordinatorv1.MemberState_MEMBER_STATE_LEFT:
	default:
		return nil, invalid("state %d: want ALIVE, DRAINING or LEFT", m.GetState())
	}
	t, err := s.leaderTermOrNil()
	if err != nil {
		return nil, err
	}
	if t == nil {
		return forward(ctx, s, req, client.RenewLease)
	}
	role, state := raftpb.MemberRole(m.GetRole()), raftpb.MemberState(m.GetState())
	now := s.now()
	leaderID := s.node.ID()
	rec := s.fsm.State().Member(m.GetMemberId())
	if rec != nil {
		if m.GetIncarnation() < rec.GetIncarnation() {
			return nil, s.toConnect(fmt.Errorf("%w: incarnation %d < %d", fsm.ErrStaleIncarnation, m.GetIncarnation(), rec.GetIncarnation()))
		}
		if m.GetIncarnation() == rec.GetIncarnation() && (rec.GetState() == raftpb.MemberState_MEMBER_STATE_EXPIRED || rec.GetState() == raftpb.MemberState_MEMBER_STATE_LEFT) {
			return nil, s.toConnect(fmt.Errorf("%w: incarnation %d is %s; rejoin with a higher one", ErrLeaseInvalid, m.GetIncarnation(), rec.GetState()))
		}
	}
	sameInc := rec != nil && rec.GetIncarnation() == m.GetIncarnation()
	if sameInc {
		// The incarnation is known: its lease must still be valid on this
		// leader's clock, whatever the member asks for.
		if _, ok := t.leases.Renew(m.GetMemberId(), m.GetIncarnation(), now); !ok {
			return nil, s.toConnect(fmt.Errorf("%w: lease expired on the leader", ErrLeaseInvalid))
		}
		if c := m.GetCustody(); c != nil && t.routes != nil && role == raftpb.MemberRole_MEMBER_ROLE_EDGE {
			// Only a live incarnation can have been given sessions; a new
			// one reports on its next renewal.
			t.routes.reported(m.GetMemberId(), m.GetIncarnation(), c)
		}
		if rec.GetRole() == role && rec.GetAddress() == m.GetAddress() && rec.GetState() == state {
			return connect.NewResponse(&coordinatorv1.RenewLeaseResponse{RemainingTtl: durationpb.New(t.leases.TTL()),
				State: m.GetState(), LeaderId: leaderID, AppliedIndex: s.fsm.State().Index(),
				WriteGrant: s.writeGrant(t, m, t.leases.TTL(), now)}), nil
		}
	}
	err = s.upsertMember(ctx, now, &raftpb.MemberRecord{
		MemberId: m.GetMemberId(), Role: role, Incarnation: m.GetIncarnation(), Address: m.GetAddress(), State: state})
	if err != nil {
		return nil, s.toConnect(err)
	}
	if state == raftpb.MemberState_MEMBER_STATE_LEFT {
		t.leases.Remove(m.GetMemberId(), m.GetIncarnation())
		if t.routes != nil {
			t.routes.forget(m.GetMemberId(), m.GetIncarnation())
		}
		return connect.NewResponse(&coordinatorv1.RenewLeaseResponse{RemainingTtl: durationpb.New(0), State: m.GetState(), LeaderId: leaderID}), nil
	}
	l := t.leases.Grant(lease.Lease{MemberID: m.GetMemberId(), Role: role, Incarnation: m.GetIncarnation(), Address: m.GetAddress(), State: state}, now)
	return connect.NewResponse(&coordinatorv1.RenewLeaseResponse{RemainingTtl: durationpb.New(l.Expires.Sub(now)),
		State: m.GetState(), LeaderId: leaderID, AppliedIndex: s.fsm.State().Index(),
		WriteGrant: s.writeGrant(t, m, l.Expires.Sub(now), now)}), nil
}

// writeGrant is how long a persistence member may acknowledge writes
// (RenewLeaseResponse.write_grant): its lease, except while another member
// promotes a replica of its group. The promoter waits one lease TTL after
// taking the promotion lease; a writer cut off from the coordinator has
// let its lease lapse by then, and one that renewed meanwhile was granted
// nothing, so none still acknowledges through the old primary, which may
// keep a replica the promoter cannot reach; it stops waiting once every
// such writer reported its writes paused (writerPauses). nil for other
// roles.
func (s *Server) writeGrant(t *leaderTerm, m *coordinatorv1.RenewLeaseRequest, remaining time.Duration, now time.Time) *durationpb.Duration {
	if m.GetRole() != coordinatorv1.MemberRole_MEMBER_ROLE_PERSISTENCE {
		return nil
	}
	g := s.fsm.State().RedisGroup(m.GetRedisGroupId())
	var zeroUnder uint64
	if fsm.FencesWriter(g, m.GetMemberId(), m.GetIncarnation(), now) {
		zeroUnder = g.GetPromotionLease().GetLeaseEpoch()
	}
	t.writers.renewed(m.GetMemberId(), m.GetIncarnation(), m.GetRedisGroupId(), m.GetWritesPaused(), zeroUnder)
	if zeroUnder != 0 {
		return durationpb.New(0)
	}
	return durationpb.New(remaining)
}

// GetRedisPrimary implements the RPC (linearizable).
func (s *Server) GetRedisPrimary(ctx context.Context, req *connect.Request[coordinatorv1.GetRedisPrimaryRequest]) (*connect.Response[coordinatorv1.GetRedisPrimaryResponse], error) {
	if !s.node.IsLeader() {
		return forward(ctx, s, req, client.GetRedisPrimary)
	}
	if err := s.linearizable(ctx); err != nil {
		return nil, err
	}
	g := s.fsm.State().RedisGroup(req.Msg.GetGroupId())
	if g.GetRecordEpoch() == 0 {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("redis group %d has no record", req.Msg.GetGroupId()))
	}
	return connect.NewResponse(&coordinatorv1.GetRedisPrimaryResponse{Group: toRedisGroup(g)}), nil
}

// CompareAndSetRedisPrimary implements the RPC.
func (s *Server) CompareAndSetRedisPrimary(ctx context.Context, req *connect.Request[coordinatorv1.CompareAndSetRedisPrimaryRequest]) (*connect.Response[coordinatorv1.CompareAndSetRedisPrimaryResponse], error) {
	m := req.Msg
	if err := firstErr(checkRequestID(m.GetRequestId()), checkMember(m.GetMemberId(), m.GetIncarnation())); err != nil {
		return nil, err
	}
	if m.GetGroup() == nil || m.GetGroup().GetPrimaryAddress() == "" {
		return nil, invalid("group with a primary address is required")
	}
	if !s.node.IsLeader() {
		return forward(ctx, s, req, client.CompareAndSetRedisPrimary)
	}
	msg, _, err := s.apply(ctx, fsm.CmdCompareAndSetRedis, &raftpb.CompareAndSetRedisPrimaryCommand{
		NowUnixNano: s.now().UnixNano(), RequestId: m.GetRequestId(), MemberId: m.GetMemberId(), Incarnation: m.GetIncarnation(),
		ExpectedRecordEpoch: m.GetExpectedRecordEpoch(), GroupId: m.GetGroup().GetGroupId(),
		PrimaryAddress: m.GetGroup().GetPrimaryAddress(), ReplicaAddresses: m.GetGroup().GetReplicaAddresses()})
	if err != nil {
		return nil, s.toConnect(err)
	}
	res := msg.(*raftpb.CompareAndSetRedisPrimaryResult)
	return connect.NewResponse(&coordinatorv1.CompareAndSetRedisPrimaryResponse{Swapped: res.GetSwapped(), Group: toRedisGroup(res.GetGroup())}), nil
}

// AcquirePromotionLease implements the RPC.
func (s *Server) AcquirePromotionLease(ctx context.Context, req *connect.Request[coordinatorv1.AcquirePromotionLeaseRequest]) (*connect.Response[coordinatorv1.AcquirePromotionLeaseResponse], error) {
	m := req.Msg
	if err := checkMember(m.GetMemberId(), m.GetIncarnation()); err != nil {
		return nil, err
	}
	ttl := s.cfg.PromotionLeaseTTL
	if m.GetTtl() != nil {
		if err := m.GetTtl().CheckValid(); err != nil || m.GetTtl().AsDuration() < 0 {
			return nil, invalid("ttl")
		}
		if d := m.GetTtl().AsDuration(); d > 0 {
			ttl = min(d, time.Duration(fsm.MaxPromotionLeaseTTL))
		}
	}
	if !s.node.IsLeader() {
		return forward(ctx, s, req, client.AcquirePromotionLease)
	}
	now := s.now()
	msg, _, err := s.apply(ctx, fsm.CmdAcquirePromotionLeaseV2, &raftpb.AcquirePromotionLeaseCommand{NowUnixNano: now.UnixNano(),
		GroupId: m.GetGroupId(), MemberId: m.GetMemberId(), Incarnation: m.GetIncarnation(), TtlNanos: ttl.Nanoseconds(),
		FenceWriters: m.GetFenceWriters(), RenewEpoch: m.GetRenewEpoch()})
	if err != nil {
		return nil, s.toConnect(err)
	}
	res := msg.(*raftpb.AcquirePromotionLeaseResult)
	l := res.GetLease()
	// A new leader's term may not have started: it has seen nobody pause.
	t := s.term.Load()
	paused := t != nil && res.GetAcquired() && l.GetFenceWriters() &&
		t.writers.allPaused(t.leases, m.GetGroupId(), m.GetMemberId(), m.GetIncarnation(), l.GetLeaseEpoch(), s.now())
	return connect.NewResponse(&coordinatorv1.AcquirePromotionLeaseResponse{Acquired: res.GetAcquired(),
		HolderMemberId: l.GetHolderMemberId(), HolderIncarnation: l.GetHolderIncarnation(),
		Remaining: durationpb.New(max(0, time.Unix(0, l.GetExpiresAtUnixNano()).Sub(now))), LeaseEpoch: l.GetLeaseEpoch(),
		WritersPaused: paused}), nil
}

// Status implements the RPC from this node's own view.
func (s *Server) Status(_ context.Context, _ *connect.Request[coordinatorv1.StatusRequest]) (*connect.Response[coordinatorv1.StatusResponse], error) {
	r := s.node.Raft()
	if r == nil {
		return nil, s.toConnect(ErrNotReady)
	}
	stats := r.Stats()
	u := func(k string) uint64 { v, _ := strconv.ParseUint(stats[k], 10, 64); return v }
	id, _ := s.node.Leader()
	st := s.fsm.State()
	resp := &coordinatorv1.StatusResponse{
		NodeId:            s.node.ID(),
		RaftState:         raftState(r.State()),
		LeaderId:          id,
		LeaderAddress:     s.apiURL(id),
		Term:              u("term"),
		CommitIndex:       r.CommitIndex(),
		AppliedIndex:      r.AppliedIndex(),
		LastSnapshotIndex: u("last_snapshot_index"),
		SessionCount:      uint64(st.SessionCount()),
		ConfigVersion:     st.ConfigVersion(),
	}
	for _, m := range st.Members() {
		resp.Members = append(resp.Members, toMember(m))
	}
	return connect.NewResponse(resp), nil
}

func raftState(st raft.RaftState) coordinatorv1.RaftState {
	switch st {
	case raft.Follower:
		return coordinatorv1.RaftState_RAFT_STATE_FOLLOWER
	case raft.Candidate:
		return coordinatorv1.RaftState_RAFT_STATE_CANDIDATE
	case raft.Leader:
		return coordinatorv1.RaftState_RAFT_STATE_LEADER
	case raft.Shutdown:
		return coordinatorv1.RaftState_RAFT_STATE_SHUTDOWN
	default:
		return coordinatorv1.RaftState_RAFT_STATE_UNSPECIFIED
	}
}
