package fsm

import "github.com/keelmq/keel/services/coordinator/internal/raftpb"

// EventKind says what an [Event] reports.
type EventKind uint8

// Event kinds.
const (
	EventMember     EventKind = iota + 1 // a member record changed
	EventConfig                          // the cluster config changed
	EventACL                             // a tenant's ACL version changed
	EventRedisGroup                      // a Redis group record changed
	EventSlotTable                       // the slot table changed
	EventCustody                         // sessions were reassigned to a custodian
	EventTakeover                        // sessions were claimed away from an edge
)

// SessionEpoch names a session and the epoch it was just granted under.
type SessionEpoch struct {
	Tenant   string
	ClientID string
	Epoch    uint64
}

// Event is a change made by one applied entry, for watchers. Events are derived
// from applies and are not part of the replicated state: a node that restores
// a snapshot has no events for the entries before it.
type Event struct {
	Kind  EventKind
	Index uint64

	Member     *raftpb.MemberRecord     // EventMember
	ACL        *raftpb.AclVersion       // EventACL
	RedisGroup *raftpb.RedisGroupRecord // EventRedisGroup
	Slots      *raftpb.SlotTable        // EventSlotTable

	// EventCustody and EventTakeover: sessions moved from one edge to another.
	FromEdge        string
	FromIncarnation uint64
	ToEdge          string
	ToIncarnation   uint64
	Sessions        []SessionEpoch
}
