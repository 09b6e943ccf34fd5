// Package lease keeps membership leases in the Raft leader's memory.
//
// Leases are never replicated: only the leader's clock decides when one
// expires, and a new leader grants every known member a full TTL ([Table.Reset])
// before it expires anyone, so a leader change never expires a member early.
// The membership records that leases protect are replicated (package fsm).
package lease

import (
	"sort"
	"sync"
	"time"

	"github.com/keelmq/keel/services/coordinator/internal/raftpb"
)

// DefaultTTL is the default lease TTL; members renew every TTL/3.
const DefaultTTL = 10 * time.Second

// Lease is one member's lease as the leader sees it.
type Lease struct {
	MemberID    string
	Role        raftpb.MemberRole
	Incarnation uint64
	Address     string
	State       raftpb.MemberState
	Expires     time.Time
}

// Table is the leader's lease table. It is safe for concurrent use.
type Table struct {
	ttl time.Duration

	mu     sync.Mutex
	leases map[string]Lease // by member ID; guarded by mu
}

// NewTable returns an empty table granting leases of ttl.
func NewTable(ttl time.Duration) *Table {
	return &Table{ttl: ttl, leases: map[string]Lease{}}
}

// TTL returns the lease TTL.
func (t *Table) TTL() time.Duration { return t.ttl }

// Reset replaces the table with a full-TTL lease, from now, for every member
// record that is alive or draining. A new leader calls it when it takes over.
func (t *Table) Reset(members []*raftpb.MemberRecord, now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	clear(t.leases)
	for _, m := range members {
		if m.GetState() != raftpb.MemberState_MEMBER_STATE_ALIVE && m.GetState() != raftpb.MemberState_MEMBER_STATE_DRAINING {
			continue
		}
		t.leases[m.GetMemberId()] = Lease{MemberID: m.GetMemberId(), Role: m.GetRole(), Incarnation: m.GetIncarnation(),
			Address: m.GetAddress(), State: m.GetState(), Expires: now.Add(t.ttl)}
	}
}

// Get returns the lease of a member.
func (t *Table) Get(id string) (Lease, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	l, ok := t.leases[id]
	return l, ok
}

// Renew extends the lease of (id, incarnation) to now+TTL if it exists and has
// not expired at now. It returns the lease after renewal.
func (t *Table) Renew(id string, inc uint64, now time.Time) (Lease, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	l, ok := t.leases[id]
	if !ok || l.Incarnation != inc || !now.Before(l.Expires) {
		return Lease{}, false
	}
	l.Expires = now.Add(t.ttl)
	t.leases[id] = l
	return l, true
}

// Grant stores a full-TTL lease from now for l (a join, rejoin or state change
// already recorded in Raft) and returns it.
func (t *Table) Grant(l Lease, now time.Time) Lease {
	t.mu.Lock()
	defer t.mu.Unlock()
	l.Expires = now.Add(t.ttl)
	t.leases[l.MemberID] = l
	return l
}

// Remove drops the lease of (id, incarnation), if it is still that one.
func (t *Table) Remove(id string, inc uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if l, ok := t.leases[id]; ok && l.Incarnation == inc {
		delete(t.leases, id)
	}
}

// Expired returns the leases that expired at now, in member ID order.
func (t *Table) Expired(now time.Time) []Lease {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []Lease
	for _, l := range t.leases {
		if !now.Before(l.Expires) {
			out = append(out, l)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].MemberID < out[j].MemberID })
	return out
}

// Valid returns the unexpired leases of role in state at now, in member ID order.
func (t *Table) Valid(role raftpb.MemberRole, state raftpb.MemberState, now time.Time) []Lease {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []Lease
	for _, l := range t.leases {
		if l.Role == role && l.State == state && now.Before(l.Expires) {
			out = append(out, l)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].MemberID < out[j].MemberID })
	return out
}

// Remaining returns how long the lease of (id, incarnation) still runs at now,
// zero if it has expired or is unknown.
func (t *Table) Remaining(id string, inc uint64, now time.Time) time.Duration {
	t.mu.Lock()
	defer t.mu.Unlock()
	l, ok := t.leases[id]
	if !ok || l.Incarnation != inc {
		return 0
	}
	return max(0, l.Expires.Sub(now))
}
