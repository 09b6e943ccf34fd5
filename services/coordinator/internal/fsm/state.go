package fsm

import (
	"bytes"
	"encoding/binary"
	"slices"
	"strings"

	iradix "github.com/hashicorp/go-immutable-radix/v2"

	"github.com/keelmq/keel/services/coordinator/internal/raftpb"
)

// Key prefixes of the state tree. Each record kind lives under one byte; the
// index kinds (owner, expiry) are derived and rebuilt on restore, so they are
// not written to snapshots.
const (
	prefixSession = 's' // tenant, client ID → *raftpb.SessionRecord
	prefixOwner   = 'o' // edge ID, tenant, client ID → struct{} (index)
	prefixMember  = 'm' // member ID → *raftpb.MemberRecord
	prefixConfig  = 'c' // key → *raftpb.ConfigEntry
	prefixACL     = 'a' // tenant → *raftpb.AclVersion
	prefixRedis   = 'r' // group ID (4 bytes BE) → *raftpb.RedisGroupRecord
	prefixSlots   = 'l' // single key → *raftpb.SlotTable
	prefixMeta    = 'M' // single key → *raftpb.StateMeta
	prefixRequest = 'q' // scope, request ID → *raftpb.RequestRecord
	prefixExpiry  = 'x' // expiry (8 bytes BE), scope, request ID → struct{} (index)
)

// lp appends a one-byte length prefix and s. Every caller has capped len(s) at
// 255 or less before (see validate.go), so keys are unambiguous.
func lp(b []byte, s string) []byte {
	b = append(b, byte(len(s)))
	return append(b, s...)
}

func sessionKey(tenant, clientID string) []byte {
	b := make([]byte, 0, 2+len(tenant)+len(clientID))
	b = append(b, prefixSession)
	b = lp(b, tenant)
	return append(b, clientID...)
}

func ownerPrefix(edge string) []byte {
	b := make([]byte, 0, 2+len(edge))
	b = append(b, prefixOwner)
	return lp(b, edge)
}

func ownerKey(edge, tenant, clientID string) []byte {
	b := ownerPrefix(edge)
	b = lp(b, tenant)
	return append(b, clientID...)
}

func memberKey(id string) []byte   { return append([]byte{prefixMember}, id...) }
func configKey(k string) []byte    { return append([]byte{prefixConfig}, k...) }
func aclKey(tenant string) []byte  { return append([]byte{prefixACL}, tenant...) }
func redisKey(group uint32) []byte { return binary.BigEndian.AppendUint32([]byte{prefixRedis}, group) }

var (
	slotsKey = []byte{prefixSlots}
	metaKey  = []byte{prefixMeta}
)

func requestKey(scope, id string) []byte {
	b := make([]byte, 0, 2+len(scope)+len(id))
	b = append(b, prefixRequest)
	b = lp(b, scope)
	return append(b, id...)
}

func expiryKey(expires int64, scope, id string) []byte {
	b := make([]byte, 0, 10+len(scope)+len(id))
	b = append(b, prefixExpiry)
	b = binary.BigEndian.AppendUint64(b, uint64(expires))
	b = lp(b, scope)
	return append(b, id...)
}

// present is the value of index entries.
type present struct{}

// State is an immutable point-in-time view of the coordinator's replicated
// state. Reads never block Apply, and taking one is O(1). Records returned by
// its methods are shared with the tree and must not be modified.
type State struct {
	root     *iradix.Tree[any]
	index    uint64 // last applied log index
	sessions int    // number of session records
}

func emptyState() *State { return &State{root: iradix.New[any]()} }

// Index returns the Raft index of the last entry applied to this state.
func (s *State) Index() uint64 { return s.index }

// SessionCount returns the number of session ownership records.
func (s *State) SessionCount() int { return s.sessions }

// Session returns the ownership record of a session, or nil.
func (s *State) Session(tenant, clientID string) *raftpb.SessionRecord {
	v, ok := s.root.Get(sessionKey(tenant, clientID))
	if !ok {
		return nil
	}
	return v.(*raftpb.SessionRecord)
}

// Sessions calls fn for every session record in key order until fn returns false.
func (s *State) Sessions(fn func(*raftpb.SessionRecord) bool) {
	walkPrefix(s.root, []byte{prefixSession}, func(_ []byte, v any) bool {
		return fn(v.(*raftpb.SessionRecord))
	})
}

// SessionsOwnedBy calls fn for every session owned by edge until fn returns false.
func (s *State) SessionsOwnedBy(edge string, fn func(*raftpb.SessionRecord) bool) {
	p := ownerPrefix(edge)
	walkPrefix(s.root, p, func(k []byte, _ any) bool {
		rest := k[len(p):]
		n := int(rest[0])
		tenant, client := string(rest[1:1+n]), string(rest[1+n:])
		rec := s.Session(tenant, client)
		if rec == nil {
			return true // cannot happen: the index is kept with the records
		}
		return fn(rec)
	})
}

// SessionScan selects the session records [State.ScanSessions] visits.
type SessionScan struct {
	// Tenant limits the scan to one tenant; empty: every tenant.
	Tenant string
	// Owner limits the scan to the sessions one edge owns; empty: any owner.
	Owner string
	// ClientIDPrefix selects client IDs starting with it. With Tenant set the
	// scan seeks straight to them; without, every record is looked at.
	ClientIDPrefix string
	// AfterTenant and AfterClientID, when AfterTenant is set, start the scan
	// after that session (which need not exist): the continuation of an
	// earlier scan.
	AfterTenant, AfterClientID string
}

// ScanSessions calls fn for the session records in the range q selects, in
// key order (grouped by tenant, shorter tenant names first; client IDs in
// byte order within a tenant), until fn returns false. match is false for a
// record in the range that q's client ID prefix rules out, which happens
// only without a tenant: the caller sees every record looked at, so it can
// bound the work of one call and continue after the last one.
func (s *State) ScanSessions(q SessionScan, fn func(rec *raftpb.SessionRecord, match bool) bool) {
	// Both the records and the owner index end in lp(tenant) + client ID.
	base := []byte{prefixSession}
	if q.Owner != "" {
		base = ownerPrefix(q.Owner)
	}
	scan := base
	if q.Tenant != "" {
		scan = append(lp(slices.Clip(base), q.Tenant), q.ClientIDPrefix...)
	}
	start := scan
	if q.AfterTenant != "" {
		// The smallest key after the continuation point's own key.
		after := append(append(lp(slices.Clip(base), q.AfterTenant), q.AfterClientID...), 0)
		if bytes.Compare(after, start) > 0 {
			start = after
		}
	}
	it := s.root.Root().Iterator()
	it.SeekLowerBound(start)
	for k, v, ok := it.Next(); ok && bytes.HasPrefix(k, scan); k, v, ok = it.Next() {
		rest := k[len(base):]
		n := int(rest[0])
		tenant, client := string(rest[1:1+n]), string(rest[1+n:])
		rec, isRec := v.(*raftpb.SessionRecord)
		if !isRec {
			if rec = s.Session(tenant, client); rec == nil {
				continue // cannot happen: the index is kept with the records
			}
		}
		if !fn(rec, strings.HasPrefix(client, q.ClientIDPrefix)) {
			return
		}
	}
}

// Member returns a member record, or nil.
func (s *State) Member(id string) *raftpb.MemberRecord {
	v, ok := s.root.Get(memberKey(id))
	if !ok {
		return nil
	}
	return v.(*raftpb.MemberRecord)
}

// Members returns every member record in ID order.
func (s *State) Members() []*raftpb.MemberRecord {
	var out []*raftpb.MemberRecord
	walkPrefix(s.root, []byte{prefixMember}, func(_ []byte, v any) bool {
		out = append(out, v.(*raftpb.MemberRecord))
		return true
	})
	return out
}

// Config returns every cluster config entry in key order.
func (s *State) Config() []*raftpb.ConfigEntry {
	var out []*raftpb.ConfigEntry
	walkPrefix(s.root, []byte{prefixConfig}, func(_ []byte, v any) bool {
		out = append(out, v.(*raftpb.ConfigEntry))
		return true
	})
	return out
}

// ConfigValue returns the value of one config key.
func (s *State) ConfigValue(key string) (string, bool) {
	v, ok := s.root.Get(configKey(key))
	if !ok {
		return "", false
	}
	return v.(*raftpb.ConfigEntry).GetValue(), true
}

// ConfigVersion returns the Raft index of the last config change (0: never).
func (s *State) ConfigVersion() uint64 { return s.meta().GetConfigVersion() }

func (s *State) meta() *raftpb.StateMeta {
	v, ok := s.root.Get(metaKey)
	if !ok {
		return &raftpb.StateMeta{}
	}
	return v.(*raftpb.StateMeta)
}

// ACLVersions returns the ACL version of every tenant that has one.
func (s *State) ACLVersions() []*raftpb.AclVersion {
	var out []*raftpb.AclVersion
	walkPrefix(s.root, []byte{prefixACL}, func(_ []byte, v any) bool {
		out = append(out, v.(*raftpb.AclVersion))
		return true
	})
	return out
}

// RedisGroup returns the record of one Redis group, or nil.
func (s *State) RedisGroup(id uint32) *raftpb.RedisGroupRecord {
	v, ok := s.root.Get(redisKey(id))
	if !ok {
		return nil
	}
	return v.(*raftpb.RedisGroupRecord)
}

// RedisGroups returns every Redis group record in ID order.
func (s *State) RedisGroups() []*raftpb.RedisGroupRecord {
	var out []*raftpb.RedisGroupRecord
	walkPrefix(s.root, []byte{prefixRedis}, func(_ []byte, v any) bool {
		out = append(out, v.(*raftpb.RedisGroupRecord))
		return true
	})
	return out
}

// SlotTable returns the slot table, or nil if none was set.
func (s *State) SlotTable() *raftpb.SlotTable {
	v, ok := s.root.Get(slotsKey)
	if !ok {
		return nil
	}
	return v.(*raftpb.SlotTable)
}

// Request returns the remembered answer of an idempotent request, or nil.
func (s *State) Request(scope, id string) *raftpb.RequestRecord {
	v, ok := s.root.Get(requestKey(scope, id))
	if !ok {
		return nil
	}
	return v.(*raftpb.RequestRecord)
}

func walkPrefix(t *iradix.Tree[any], prefix []byte, fn func(k []byte, v any) bool) {
	walkNode(t.Root(), prefix, fn)
}

// walkNode is walkPrefix from a node, such as a transaction's root.
func walkNode(n *iradix.Node[any], prefix []byte, fn func(k []byte, v any) bool) {
	it := n.Iterator()
	it.SeekPrefix(prefix)
	for k, v, ok := it.Next(); ok; k, v, ok = it.Next() {
		if !fn(k, v) {
			return
		}
	}
}
