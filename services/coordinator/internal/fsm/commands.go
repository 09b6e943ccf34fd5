package fsm

import (
	"errors"
	"fmt"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/services/coordinator/internal/raftpb"
)

// Request-record scopes, one per idempotent command, so that the same request
// ID used for a claim and a release cannot collide.
const (
	scopeClaim   = "claim/"
	scopeRelease = "release/"
	scopeRedis   = "redis/"
)

// MaxPromotionLeaseTTL caps a Redis group promotion lease.
const MaxPromotionLeaseTTL int64 = 60 * 1e9

func registerBuiltins(f *FSM) {
	RegisterCommand(f, CmdClaimSessions, applyClaimSessions)
	RegisterCommand(f, CmdReleaseSession, applyReleaseSession)
	RegisterCommand(f, CmdReleaseSessions, applyReleaseSessions)
	RegisterCommand(f, CmdReassignSessions, applyReassignSessions)
	RegisterCommand(f, CmdUpsertMember, applyUpsertMember)
	RegisterCommand(f, CmdSetConfig, applySetConfig)
	RegisterCommand(f, CmdBumpAclVersion, applyBumpACLVersion)
	RegisterCommand(f, CmdAcquirePromotionLease, applyAcquirePromotionLeaseV1)
	RegisterCommand(f, CmdAcquirePromotionLeaseV2, applyAcquirePromotionLease)
	RegisterCommand(f, CmdCompareAndSetRedis, applyCompareAndSetRedis)
	RegisterCommand(f, CmdSetSlotTable, applySetSlotTable)
}

// aliveEdge reports whether id is an alive edge at incarnation inc.
func (tx *Tx) aliveEdge(id string, inc uint64) bool {
	m := tx.member(id)
	return m != nil && m.GetRole() == raftpb.MemberRole_MEMBER_ROLE_EDGE &&
		m.GetIncarnation() == inc && m.GetState() == raftpb.MemberState_MEMBER_STATE_ALIVE
}

// applyClaimSessions grants each valid claim the entry's index as epoch. Claims
// apply in order; a session claimed twice in one entry gets CONFLICT the second
// time, since two grants under one epoch could not be told apart. Only grants
// are remembered for request-ID idempotence; a refusal may be retried. A
// remembered grant is answered again only while it is the session's current
// one (SUPERSEDED otherwise).
func applyClaimSessions(tx *Tx, cmd *raftpb.ClaimSessionsCommand) (*raftpb.ClaimSessionsResult, error) {
	now := cmd.GetNowUnixNano()
	tx.pruneRequests(now)
	res := &raftpb.ClaimSessionsResult{Outcomes: make([]*raftpb.ClaimOutcome, len(cmd.GetClaims()))}
	seen := make(map[string]struct{}, len(cmd.GetClaims()))
	takeovers := map[[2]string]int{} // (from edge, to edge) → index in tx.events
	for i, c := range cmd.GetClaims() {
		scope := scopeClaim + c.GetEdgeId()
		out := new(raftpb.ClaimOutcome)
		if err := CheckMemberID(c.GetEdgeId()); err == nil && tx.lookupRequest(scope, c.GetRequestId(), out) {
			if cur := tx.session(c.GetTenant(), c.GetClientId()); cur.GetEpoch() != out.GetEpoch() {
				// The grant stood once, but the session was claimed again
				// since: served now, it would give the session two owners.
				out = &raftpb.ClaimOutcome{Status: raftpb.ClaimStatus_CLAIM_STATUS_SUPERSEDED,
					Message: fmt.Sprintf("granted under epoch %d, since claimed under epoch %d", out.GetEpoch(), cur.GetEpoch())}
			}
			res.Outcomes[i] = out
			continue
		}
		out = claimOne(tx, now, c, seen)
		res.Outcomes[i] = out
		if out.GetStatus() != raftpb.ClaimStatus_CLAIM_STATUS_GRANTED {
			continue
		}
		tx.rememberRequest(now, scope, c.GetRequestId(), out)
		prev := out.GetPrevious()
		if prev == nil || (prev.GetOwnerEdgeId() == c.GetEdgeId() && prev.GetOwnerIncarnation() == c.GetIncarnation()) {
			continue
		}
		k := [2]string{prev.GetOwnerEdgeId(), c.GetEdgeId()}
		j, ok := takeovers[k]
		if !ok {
			tx.emit(Event{Kind: EventTakeover, FromEdge: prev.GetOwnerEdgeId(), FromIncarnation: prev.GetOwnerIncarnation(),
				ToEdge: c.GetEdgeId(), ToIncarnation: c.GetIncarnation()})
			j = len(tx.events) - 1
			takeovers[k] = j
		}
		tx.events[j].Sessions = append(tx.events[j].Sessions, SessionEpoch{Tenant: c.GetTenant(), ClientID: c.GetClientId(), Epoch: tx.index})
	}
	return res, nil
}

func claimOne(tx *Tx, now int64, c *raftpb.Claim, seen map[string]struct{}) *raftpb.ClaimOutcome {
	for _, err := range []error{CheckSession(c.GetTenant(), c.GetClientId()), CheckMemberID(c.GetEdgeId()), CheckRequestID(c.GetRequestId())} {
		if err != nil {
			return &raftpb.ClaimOutcome{Status: raftpb.ClaimStatus_CLAIM_STATUS_INVALID_ARGUMENT, Message: err.Error()}
		}
	}
	if e := c.GetExpectedOwner(); e != "" {
		if err := CheckMemberID(e); err != nil {
			return &raftpb.ClaimOutcome{Status: raftpb.ClaimStatus_CLAIM_STATUS_INVALID_ARGUMENT, Message: "expected owner: " + err.Error()}
		}
	}
	if !tx.aliveEdge(c.GetEdgeId(), c.GetIncarnation()) {
		return &raftpb.ClaimOutcome{Status: raftpb.ClaimStatus_CLAIM_STATUS_LEASE_INVALID,
			Message: "claimant is not an alive edge incarnation"}
	}
	k := string(sessionKey(c.GetTenant(), c.GetClientId()))
	if _, dup := seen[k]; dup {
		return &raftpb.ClaimOutcome{Status: raftpb.ClaimStatus_CLAIM_STATUS_CONFLICT,
			Message: "session claimed twice in one entry"}
	}
	seen[k] = struct{}{}
	prev := tx.session(c.GetTenant(), c.GetClientId())
	if e := c.GetExpectedOwner(); e != "" && prev.GetOwnerEdgeId() != e {
		return &raftpb.ClaimOutcome{Status: raftpb.ClaimStatus_CLAIM_STATUS_OWNER_CHANGED,
			Message: fmt.Sprintf("session owned by %q, not %q", prev.GetOwnerEdgeId(), e)}
	}
	rec := &raftpb.SessionRecord{
		Tenant:            c.GetTenant(),
		ClientId:          c.GetClientId(),
		Epoch:             tx.index,
		OwnerEdgeId:       c.GetEdgeId(),
		OwnerIncarnation:  c.GetIncarnation(),
		OwnerKind:         raftpb.OwnerKind_OWNER_KIND_CONNECTION,
		GrantedAtUnixNano: now,
	}
	switch {
	case prev == nil:
	case prev.GetOwnerEdgeId() == rec.GetOwnerEdgeId() && prev.GetOwnerIncarnation() == rec.GetOwnerIncarnation():
		rec.TakenFromEdgeId, rec.TakenFromIncarnation = prev.GetTakenFromEdgeId(), prev.GetTakenFromIncarnation()
	default:
		rec.TakenFromEdgeId, rec.TakenFromIncarnation = prev.GetOwnerEdgeId(), prev.GetOwnerIncarnation()
	}
	tx.putSession(prev, rec)
	return &raftpb.ClaimOutcome{Status: raftpb.ClaimStatus_CLAIM_STATUS_GRANTED, Epoch: tx.index, Previous: prev}
}

// applyReleaseSession deletes an ownership record, fenced by epoch.
func applyReleaseSession(tx *Tx, cmd *raftpb.ReleaseSessionCommand) (*raftpb.ReleaseSessionResult, error) {
	now := cmd.GetNowUnixNano()
	tx.pruneRequests(now)
	return releaseOne(tx, now, cmd)
}

// applyReleaseSessions applies each release as applyReleaseSession would in
// an entry of its own, in order, and answers each with its outcome: one
// refused does not refuse the others. A request ID answered once is
// answered the same, alone or in a batch.
func applyReleaseSessions(tx *Tx, cmd *raftpb.ReleaseSessionsCommand) (*raftpb.ReleaseSessionsResult, error) {
	now := cmd.GetNowUnixNano()
	tx.pruneRequests(now)
	res := &raftpb.ReleaseSessionsResult{Outcomes: make([]*raftpb.ReleaseOutcome, len(cmd.GetReleases()))}
	for i, r := range cmd.GetReleases() {
		out, err := ReleaseOutcome(releaseOne(tx, now, r))
		if err != nil {
			return nil, err // none other is deterministic: the entry fails as a whole
		}
		res.Outcomes[i] = out
	}
	return res, nil
}

// ReleaseOutcome is the outcome in a batch of one release's result or
// refusal (releaseOne, a CmdReleaseSession entry); err is an error that
// is not a refusal.
func ReleaseOutcome(res *raftpb.ReleaseSessionResult, err error) (*raftpb.ReleaseOutcome, error) {
	switch {
	case errors.Is(err, ErrInvalidArgument):
		return &raftpb.ReleaseOutcome{Status: raftpb.ReleaseStatus_RELEASE_STATUS_INVALID_ARGUMENT, Message: err.Error()}, nil
	case errors.Is(err, ErrStaleEpoch):
		return &raftpb.ReleaseOutcome{Status: raftpb.ReleaseStatus_RELEASE_STATUS_STALE_EPOCH, Message: err.Error()}, nil
	case errors.Is(err, ErrNotOwner):
		return &raftpb.ReleaseOutcome{Status: raftpb.ReleaseStatus_RELEASE_STATUS_NOT_OWNER, Message: err.Error()}, nil
	case err != nil:
		return nil, err
	case res.GetReleased():
		return &raftpb.ReleaseOutcome{Status: raftpb.ReleaseStatus_RELEASE_STATUS_RELEASED}, nil
	default:
		return &raftpb.ReleaseOutcome{Status: raftpb.ReleaseStatus_RELEASE_STATUS_ABSENT}, nil
	}
}

// releaseOne deletes one ownership record, fenced by epoch and owner; it
// remembers what it answered under the request ID, except a refusal.
func releaseOne(tx *Tx, now int64, cmd *raftpb.ReleaseSessionCommand) (*raftpb.ReleaseSessionResult, error) {
	for _, err := range []error{CheckSession(cmd.GetTenant(), cmd.GetClientId()), CheckMemberID(cmd.GetEdgeId()), CheckRequestID(cmd.GetRequestId())} {
		if err != nil {
			return nil, err
		}
	}
	scope := scopeRelease + cmd.GetEdgeId()
	res := new(raftpb.ReleaseSessionResult)
	if tx.lookupRequest(scope, cmd.GetRequestId(), res) {
		return res, nil
	}
	rec := tx.session(cmd.GetTenant(), cmd.GetClientId())
	switch {
	case rec == nil:
		res.Released = false
	case rec.GetEpoch() != cmd.GetEpoch():
		return nil, fmt.Errorf("%w: release under epoch %d, session has epoch %d", ErrStaleEpoch, cmd.GetEpoch(), rec.GetEpoch())
	case rec.GetOwnerEdgeId() != cmd.GetEdgeId() || rec.GetOwnerIncarnation() != cmd.GetIncarnation():
		return nil, fmt.Errorf("%w: session is owned by %s", ErrNotOwner, rec.GetOwnerEdgeId())
	default:
		tx.deleteSession(rec)
		res.Released = true
	}
	tx.rememberRequest(now, scope, cmd.GetRequestId(), res)
	return res, nil
}

// applyReassignSessions moves sessions still owned by (from edge, incarnation)
// to alive custodians, bumping their epochs to this entry's index. A session
// whose owner changed since the leader planned the move (a reconnecting client
// claimed it) is left alone, so every session is reassigned at most once per
// owner change.
func applyReassignSessions(tx *Tx, cmd *raftpb.ReassignSessionsCommand) (*raftpb.ReassignSessionsResult, error) {
	res := &raftpb.ReassignSessionsResult{Applied: make([]bool, len(cmd.GetAssignments())), Epoch: tx.index}
	byTo := map[string]int{}
	for i, a := range cmd.GetAssignments() {
		rec := tx.session(a.GetTenant(), a.GetClientId())
		if rec == nil || rec.GetOwnerEdgeId() != cmd.GetFromEdgeId() || rec.GetOwnerIncarnation() != cmd.GetFromIncarnation() {
			continue
		}
		if a.GetToEdgeId() == cmd.GetFromEdgeId() || !tx.aliveEdge(a.GetToEdgeId(), a.GetToIncarnation()) {
			continue
		}
		origin, originInc := CustodyOrigin(rec)
		if rec.GetOwnerKind() != raftpb.OwnerKind_OWNER_KIND_CUSTODY {
			origin, originInc = rec.GetOwnerEdgeId(), rec.GetOwnerIncarnation()
		}
		tx.putSession(rec, &raftpb.SessionRecord{
			Tenant:                   rec.GetTenant(),
			ClientId:                 rec.GetClientId(),
			Epoch:                    tx.index,
			OwnerEdgeId:              a.GetToEdgeId(),
			OwnerIncarnation:         a.GetToIncarnation(),
			OwnerKind:                raftpb.OwnerKind_OWNER_KIND_CUSTODY,
			GrantedAtUnixNano:        cmd.GetNowUnixNano(),
			TakenFromEdgeId:          rec.GetOwnerEdgeId(),
			TakenFromIncarnation:     rec.GetOwnerIncarnation(),
			CustodyOriginEdgeId:      origin,
			CustodyOriginIncarnation: originInc,
		})
		res.Applied[i] = true
		j, ok := byTo[a.GetToEdgeId()]
		if !ok {
			tx.emit(Event{Kind: EventCustody, FromEdge: cmd.GetFromEdgeId(), FromIncarnation: cmd.GetFromIncarnation(),
				ToEdge: a.GetToEdgeId(), ToIncarnation: a.GetToIncarnation()})
			j = len(tx.events) - 1
			byTo[a.GetToEdgeId()] = j
		}
		tx.events[j].Sessions = append(tx.events[j].Sessions, SessionEpoch{Tenant: rec.GetTenant(), ClientID: rec.GetClientId(), Epoch: tx.index})
	}
	return res, nil
}

// FencesWriter reports whether a member other than (member, incarnation)
// holds g's promotion lease for a failover (fence_writers) at now, taken
// since g's record last changed: a promotion under way, not one already
// published (the lease outlives the record's compare-and-set until it
// expires).
func FencesWriter(g *raftpb.RedisGroupRecord, member string, incarnation uint64, now time.Time) bool {
	l := g.GetPromotionLease()
	if l == nil || !l.GetFenceWriters() || l.GetExpiresAtUnixNano() <= now.UnixNano() || l.GetLeaseEpoch() <= g.GetRecordEpoch() {
		return false
	}
	return l.GetHolderMemberId() != member || l.GetHolderIncarnation() != incarnation
}

// CustodyOrigin returns the edge whose death put a custody session in
// custody (SessionRecord.custody_origin_edge_id), or, for a record written
// before that field existed, the edge custody took it from. Empty for a
// session a connection holds.
func CustodyOrigin(rec *raftpb.SessionRecord) (edge string, incarnation uint64) {
	if rec.GetOwnerKind() != raftpb.OwnerKind_OWNER_KIND_CUSTODY {
		return "", 0
	}
	if rec.GetCustodyOriginEdgeId() != "" {
		return rec.GetCustodyOriginEdgeId(), rec.GetCustodyOriginIncarnation()
	}
	return rec.GetTakenFromEdgeId(), rec.GetTakenFromIncarnation()
}

func dead(s raftpb.MemberState) bool {
	return s == raftpb.MemberState_MEMBER_STATE_LEFT || s == raftpb.MemberState_MEMBER_STATE_EXPIRED
}

// applyUpsertMember writes a membership record. Incarnations never go back, and
// a dead incarnation (left or expired) never comes back to life: the member must
// rejoin with a higher one.
func applyUpsertMember(tx *Tx, cmd *raftpb.UpsertMemberCommand) (*raftpb.UpsertMemberResult, error) {
	m := cmd.GetMember()
	if err := CheckMemberID(m.GetMemberId()); err != nil {
		return nil, err
	}
	if err := CheckAddress(m.GetAddress()); err != nil {
		return nil, err
	}
	if m.GetRole() == raftpb.MemberRole_MEMBER_ROLE_UNSPECIFIED || m.GetState() == raftpb.MemberState_MEMBER_STATE_UNSPECIFIED {
		return nil, fmt.Errorf("%w: member role and state are required", ErrInvalidArgument)
	}
	pruned := tx.pruneMembers(cmd.GetPruneDeadBeforeUnixNano(), m.GetMemberId())
	prev := tx.member(m.GetMemberId())
	if prev != nil {
		if m.GetIncarnation() < prev.GetIncarnation() {
			return nil, fmt.Errorf("%w: %d < %d", ErrStaleIncarnation, m.GetIncarnation(), prev.GetIncarnation())
		}
		if m.GetIncarnation() == prev.GetIncarnation() && dead(prev.GetState()) && !dead(m.GetState()) {
			return nil, fmt.Errorf("%w: incarnation %d is dead, rejoin with a higher one", ErrStaleIncarnation, m.GetIncarnation())
		}
		if prev.GetRole() == m.GetRole() && prev.GetIncarnation() == m.GetIncarnation() &&
			prev.GetAddress() == m.GetAddress() && prev.GetState() == m.GetState() {
			return &raftpb.UpsertMemberResult{Member: prev, Pruned: pruned}, nil
		}
	}
	rec := &raftpb.MemberRecord{
		MemberId:          m.GetMemberId(),
		Role:              m.GetRole(),
		Incarnation:       m.GetIncarnation(),
		Address:           m.GetAddress(),
		State:             m.GetState(),
		UpdatedIndex:      tx.index,
		UpdatedAtUnixNano: cmd.GetNowUnixNano(),
	}
	tx.txn.Insert(memberKey(rec.GetMemberId()), rec)
	tx.emit(Event{Kind: EventMember, Member: rec})
	return &raftpb.UpsertMemberResult{Member: rec, Changed: true, Pruned: pruned}, nil
}

// maxMembersPrunedPerApply bounds the work of one command.
const maxMembersPrunedPerApply = 64

// pruneMembers deletes the records of members (other than keep) that left
// or expired before deadBefore and that nothing refers to: no session is
// owned by them, and they hold no Redis group's promotion lease. It
// returns their IDs; nothing when deadBefore is 0.
func (tx *Tx) pruneMembers(deadBefore int64, keep string) []string {
	if deadBefore <= 0 {
		return nil
	}
	holders := map[string]bool{}
	walkNode(tx.txn.Root(), []byte{prefixRedis}, func(_ []byte, v any) bool {
		if id := v.(*raftpb.RedisGroupRecord).GetPromotionLease().GetHolderMemberId(); id != "" {
			holders[id] = true
		}
		return true
	})
	var gone []string
	walkNode(tx.txn.Root(), []byte{prefixMember}, func(_ []byte, v any) bool {
		m := v.(*raftpb.MemberRecord)
		id := m.GetMemberId()
		if id == keep || !dead(m.GetState()) || m.GetUpdatedAtUnixNano() >= deadBefore || holders[id] {
			return true
		}
		owns := false
		walkNode(tx.txn.Root(), ownerPrefix(id), func([]byte, any) bool {
			owns = true
			return false
		})
		if !owns {
			gone = append(gone, id)
		}
		return len(gone) < maxMembersPrunedPerApply
	})
	for _, id := range gone {
		tx.txn.Delete(memberKey(id))
	}
	return gone
}

func applySetConfig(tx *Tx, cmd *raftpb.SetConfigCommand) (*raftpb.SetConfigResult, error) {
	for _, e := range cmd.GetSet() {
		if err := checkText("config key", e.GetKey(), MaxConfigKeyLen, true); err != nil {
			return nil, err
		}
		if err := checkText("config value", e.GetValue(), MaxConfigValueLen, false); err != nil {
			return nil, err
		}
	}
	for _, k := range cmd.GetDelete() {
		if err := checkText("config key", k, MaxConfigKeyLen, true); err != nil {
			return nil, err
		}
	}
	for _, e := range cmd.GetSet() {
		tx.txn.Insert(configKey(e.GetKey()), &raftpb.ConfigEntry{Key: e.GetKey(), Value: e.GetValue()})
	}
	for _, k := range cmd.GetDelete() {
		tx.txn.Delete(configKey(k))
	}
	meta := proto.CloneOf(tx.meta())
	meta.ConfigVersion = tx.index
	tx.txn.Insert(metaKey, meta)
	tx.emit(Event{Kind: EventConfig})
	return &raftpb.SetConfigResult{Version: tx.index}, nil
}

func applyBumpACLVersion(tx *Tx, cmd *raftpb.BumpAclVersionCommand) (*raftpb.BumpAclVersionResult, error) {
	if cmd.GetTenant() != "" && !ValidTenant(cmd.GetTenant()) {
		return nil, fmt.Errorf("%w: tenant %q", ErrInvalidArgument, truncate(cmd.GetTenant()))
	}
	v := &raftpb.AclVersion{Tenant: cmd.GetTenant(), Version: tx.index}
	tx.txn.Insert(aclKey(v.GetTenant()), v)
	tx.emit(Event{Kind: EventACL, ACL: v})
	return &raftpb.BumpAclVersionResult{AclVersion: v}, nil
}

// applyAcquirePromotionLeaseV1 is the rule CmdAcquirePromotionLease entries
// were first applied by: the holder of a live lease keeps its epoch, and
// renew_epoch (a later field) is not read. Kept for their replay.
func applyAcquirePromotionLeaseV1(tx *Tx, cmd *raftpb.AcquirePromotionLeaseCommand) (*raftpb.AcquirePromotionLeaseResult, error) {
	v1 := proto.CloneOf(cmd)
	v1.RenewEpoch = 0
	return acquirePromotionLease(tx, v1, func(mine bool) bool { return mine })
}

// applyAcquirePromotionLease is CmdAcquirePromotionLeaseV2's rule.
func applyAcquirePromotionLease(tx *Tx, cmd *raftpb.AcquirePromotionLeaseCommand) (*raftpb.AcquirePromotionLeaseResult, error) {
	// A failover's lease taken by a member that holds one already, from a
	// reconcile or the group's bootstrap, is a new lease: its epoch must be
	// newer than the record for the group's writers to be fenced
	// (FencesWriter). Renewals keep the epoch.
	return acquirePromotionLease(tx, cmd, func(mine bool) bool {
		return mine && (cmd.GetRenewEpoch() != 0 || !cmd.GetFenceWriters())
	})
}

// acquirePromotionLease is a compare-and-set on a group's promotion lease:
// it succeeds only if the lease is free, expired at the command's time, or
// held by the same member incarnation (and, when the command renews, under
// that epoch); keepEpoch says, given whether the caller held it, whether the
// lease keeps its epoch or takes this entry's index.
func acquirePromotionLease(tx *Tx, cmd *raftpb.AcquirePromotionLeaseCommand, keepEpoch func(mine bool) bool) (*raftpb.AcquirePromotionLeaseResult, error) {
	if err := CheckMemberID(cmd.GetMemberId()); err != nil {
		return nil, err
	}
	if cmd.GetTtlNanos() <= 0 || cmd.GetTtlNanos() > MaxPromotionLeaseTTL {
		return nil, fmt.Errorf("%w: promotion lease ttl out of range", ErrInvalidArgument)
	}
	now := cmd.GetNowUnixNano()
	g := tx.redisGroup(cmd.GetGroupId())
	if g == nil {
		g = &raftpb.RedisGroupRecord{GroupId: cmd.GetGroupId()}
	}
	l := g.GetPromotionLease()
	live := l != nil && l.GetExpiresAtUnixNano() > now
	mine := live && l.GetHolderMemberId() == cmd.GetMemberId() && l.GetHolderIncarnation() == cmd.GetIncarnation()
	if live && !mine || cmd.GetRenewEpoch() != 0 && (!mine || l.GetLeaseEpoch() != cmd.GetRenewEpoch()) {
		return &raftpb.AcquirePromotionLeaseResult{Acquired: false, Lease: l}, nil
	}
	epoch := tx.index
	if keepEpoch(mine) {
		epoch = l.GetLeaseEpoch()
	}
	next := proto.CloneOf(g)
	next.PromotionLease = &raftpb.PromotionLease{
		HolderMemberId:    cmd.GetMemberId(),
		HolderIncarnation: cmd.GetIncarnation(),
		ExpiresAtUnixNano: now + cmd.GetTtlNanos(),
		LeaseEpoch:        epoch,
		FenceWriters:      cmd.GetFenceWriters(),
	}
	tx.txn.Insert(redisKey(next.GetGroupId()), next)
	return &raftpb.AcquirePromotionLeaseResult{Acquired: true, Lease: next.GetPromotionLease()}, nil
}

// applyCompareAndSetRedis replaces a group record if the caller holds the
// group's promotion lease at the command's time and the record epoch is still
// the expected one. The new record epoch is this entry's index.
func applyCompareAndSetRedis(tx *Tx, cmd *raftpb.CompareAndSetRedisPrimaryCommand) (*raftpb.CompareAndSetRedisPrimaryResult, error) {
	for _, err := range []error{CheckMemberID(cmd.GetMemberId()), CheckRequestID(cmd.GetRequestId()), CheckAddress(cmd.GetPrimaryAddress())} {
		if err != nil {
			return nil, err
		}
	}
	if cmd.GetPrimaryAddress() == "" {
		return nil, fmt.Errorf("%w: empty primary address", ErrInvalidArgument)
	}
	for _, a := range cmd.GetReplicaAddresses() {
		if err := CheckAddress(a); err != nil {
			return nil, err
		}
	}
	now := cmd.GetNowUnixNano()
	tx.pruneRequests(now)
	scope := scopeRedis + cmd.GetMemberId()
	res := new(raftpb.CompareAndSetRedisPrimaryResult)
	if tx.lookupRequest(scope, cmd.GetRequestId(), res) {
		return res, nil
	}
	g := tx.redisGroup(cmd.GetGroupId())
	l := g.GetPromotionLease()
	switch {
	case l == nil || l.GetExpiresAtUnixNano() <= now || l.GetHolderMemberId() != cmd.GetMemberId() ||
		l.GetHolderIncarnation() != cmd.GetIncarnation():
		return &raftpb.CompareAndSetRedisPrimaryResult{Group: g, Reason: "promotion lease not held"}, nil
	case g.GetRecordEpoch() != cmd.GetExpectedRecordEpoch():
		return &raftpb.CompareAndSetRedisPrimaryResult{Group: g, Reason: "record epoch changed"}, nil
	}
	next := &raftpb.RedisGroupRecord{
		GroupId:           cmd.GetGroupId(),
		RecordEpoch:       tx.index,
		PrimaryAddress:    cmd.GetPrimaryAddress(),
		ReplicaAddresses:  append([]string(nil), cmd.GetReplicaAddresses()...),
		UpdatedAtUnixNano: now,
		PromotionLease:    l,
	}
	tx.txn.Insert(redisKey(next.GetGroupId()), next)
	tx.emit(Event{Kind: EventRedisGroup, RedisGroup: next})
	res = &raftpb.CompareAndSetRedisPrimaryResult{Swapped: true, Group: next}
	tx.rememberRequest(now, scope, cmd.GetRequestId(), res)
	return res, nil
}

func applySetSlotTable(tx *Tx, cmd *raftpb.SetSlotTableCommand) (*raftpb.SetSlotTableResult, error) {
	if n := len(cmd.GetSlotGroups()); n == 0 || n > MaxSlots {
		return nil, fmt.Errorf("%w: slot table of %d slots", ErrInvalidArgument, n)
	}
	var cur *raftpb.SlotTable
	if v, ok := tx.get(slotsKey); ok {
		cur = v.(*raftpb.SlotTable)
	}
	if cur.GetVersion() != cmd.GetExpectedVersion() {
		return &raftpb.SetSlotTableResult{Table: cur}, nil
	}
	t := &raftpb.SlotTable{SlotGroups: append([]uint32(nil), cmd.GetSlotGroups()...), Version: tx.index}
	tx.txn.Insert(slotsKey, t)
	tx.emit(Event{Kind: EventSlotTable, Slots: t})
	return &raftpb.SetSlotTableResult{Swapped: true, Table: t}, nil
}
