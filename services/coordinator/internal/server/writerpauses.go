package server

import (
	"sync"
	"time"

	"github.com/keelmq/keel/services/coordinator/internal/lease"
	"github.com/keelmq/keel/services/coordinator/internal/raftpb"
)

// writerPauses is the leader's memory of which persistence members stopped
// acknowledging writes for a failover of their Redis group, so that the
// promoter waits for them to say so rather than one whole member lease TTL
// (AcquirePromotionLeaseResponse.writers_paused). A member counts as paused
// under a promotion lease once a renewal answered with a zero write grant
// under that lease is followed by one reporting writes_paused: the report
// alone could be about an earlier failover. Kept in memory only: a new
// leader has seen nobody pause, and the promoter waits the lease TTL.
type writerPauses struct {
	mu      sync.Mutex
	members map[string]writerPause // by member ID; guarded by mu
}

type writerPause struct {
	incarnation uint64
	group       uint32
	zeroUnder   uint64 // lease epoch of the last zero grant answered
	pausedUnder uint64 // lease epoch the member reported paused under
}

func newWriterPauses() *writerPauses {
	return &writerPauses{members: map[string]writerPause{}}
}

// renewed records a persistence member's renewal: its group, whether it
// reported its writes paused, and the epoch of the fencing lease it was
// answered a zero grant under (0 for a grant).
func (w *writerPauses) renewed(member string, incarnation uint64, group uint32, paused bool, zeroUnder uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	p := w.members[member]
	if p.incarnation != incarnation {
		p = writerPause{incarnation: incarnation}
	}
	p.group = group
	if paused && p.zeroUnder != 0 && p.zeroUnder == zeroUnder {
		p.pausedUnder = p.zeroUnder
	}
	p.zeroUnder = zeroUnder
	w.members[member] = p
}

// allPaused reports whether every persistence member with a live lease at
// now, other than the lease holder, either writes to another group or
// reported its writes paused under the lease of epoch leaseEpoch for group.
// A member whose lease expired acknowledges nothing already: its own lease
// ends before the leader's does.
func (w *writerPauses) allPaused(leases *lease.Table, group uint32, holder string, holderInc, leaseEpoch uint64, now time.Time) bool {
	var live []lease.Lease
	for _, s := range []raftpb.MemberState{raftpb.MemberState_MEMBER_STATE_ALIVE, raftpb.MemberState_MEMBER_STATE_DRAINING} {
		live = append(live, leases.Valid(raftpb.MemberRole_MEMBER_ROLE_PERSISTENCE, s, now)...)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, l := range live {
		if l.MemberID == holder && l.Incarnation == holderInc {
			continue
		}
		p, ok := w.members[l.MemberID]
		if !ok || p.incarnation != l.Incarnation {
			return false // not heard from in this term: its group is unknown
		}
		if p.group == group && p.pausedUnder != leaseEpoch {
			return false
		}
	}
	return true
}
