// Package store defines the durable MQTT state the persistence service
// keeps, and the contract every implementation honours: fenced writes,
// idempotent appends keyed by msgID, payloads stored once per msgID,
// bounded queues, retained messages replaced only by newer ones and looked
// up through an index.
package store

import (
	"context"
	"errors"
	"strings"
)

var (
	// ErrFenced means the write carried an older session epoch than the
	// current one: another edge owns the session now.
	ErrFenced = errors.New("session epoch fenced")
	// ErrGroupFenced means the write carried an older group record epoch:
	// the Redis group failed over and this writer follows an old primary.
	ErrGroupFenced = errors.New("group epoch fenced")
	// ErrNotReplicated means the write was applied on the primary but no
	// replica confirmed it in time: it must not be acknowledged to clients.
	ErrNotReplicated = errors.New("write not replicated")
	// ErrInvalid reports bad input: nothing was stored.
	ErrInvalid = errors.New("invalid request")
)

// SessionKey names a session.
type SessionKey struct {
	Tenant   string
	ClientID string
}

// Tag is the hash tag of the session's keys: "{tenant:clientID}". Tenant
// names cannot contain ':' so the tag is unambiguous.
func (k SessionKey) Tag() string { return "{" + k.Tenant + ":" + k.ClientID + "}" }

// Validate checks the key's lengths and characters.
func (k SessionKey) Validate() error {
	if k.Tenant == "" || len(k.Tenant) > 63 || strings.ContainsAny(k.Tenant, ":{}/") {
		return errors.Join(ErrInvalid, errors.New("tenant must be 1-63 characters of [a-z0-9-]"))
	}
	if len(k.ClientID) > 65535 {
		return errors.Join(ErrInvalid, errors.New("client ID longer than 65535 bytes"))
	}
	return nil
}

// Fence is what a write proves about its writer.
type Fence struct {
	Epoch      uint64 // session epoch from the coordinator (Raft index of the claim)
	GroupEpoch uint64 // record epoch of the Redis group the writer follows
}

// Message is a stored application message, kept once per msgID.
type Message struct {
	ID      string `json:"id"`
	Topic   string `json:"t"`
	Payload []byte `json:"p,omitempty"`
	QoS     byte   `json:"q,omitempty"`
	Retain  bool   `json:"r,omitempty"`
	Props   []byte `json:"props,omitempty"` // opaque to the store
	Created int64  `json:"c"`               // ingress time, unix nanoseconds
	Expiry  int64  `json:"e,omitempty"`     // unix seconds; 0 never
}

// Entry is a message queued for, or in flight to, a session.
type Entry struct {
	MsgID    string `json:"m"`
	QoS      byte   `json:"q"`
	Retain   bool   `json:"r,omitempty"`
	SubIDs   []int  `json:"ids,omitempty"`
	PacketID uint16 `json:"pk,omitempty"`  // in flight only
	Pubrel   bool   `json:"rel,omitempty"` // QoS 2: PUBREC received, PUBREL owed
	Seq      uint64 `json:"s,omitempty"`   // queue position, assigned by the store
	// TookQoS2 marks, in an append, a QoS 2 delivery the session takes only
	// once: the store remembers its msgID in [State.TookQoS2], so that a
	// resend under the same msgID is not delivered again after the session
	// resumed elsewhere from the store. It is not part of the stored entry.
	TookQoS2 bool `json:"-"`
}

// TookQoS2Len bounds the msgIDs a session's [State.TookQoS2] remembers. A
// resend comes within seconds of its edge's failure, after far fewer QoS 2
// deliveries than this; the edges remember as many in memory.
const TookQoS2Len = 1024

// Subscription is a stored subscription.
type Subscription struct {
	Filter            string `json:"f"` // as subscribed, "$share/g/..." included
	QoS               byte   `json:"q"`
	NoLocal           bool   `json:"nl,omitempty"`
	RetainAsPublished bool   `json:"rap,omitempty"`
	RetainHandling    byte   `json:"rh,omitempty"`
	Identifier        int    `json:"id,omitempty"`
}

// Incoming is an inbound QoS 2 message awaiting its PUBREL.
type Incoming struct {
	PacketID uint16 `json:"pk"`
	MsgID    string `json:"m"`
}

// Session is the connection-independent record of a session.
type Session struct {
	ProtocolVersion byte   `json:"v"`
	ExpiryInterval  uint32 `json:"sei,omitempty"`
	Disconnected    int64  `json:"dis,omitempty"` // unix nanoseconds; 0 while connected
	Props           []byte `json:"props,omitempty"`
	Will            []byte `json:"will,omitempty"`
}

// State is everything stored for a session.
type State struct {
	Epoch    uint64
	Session  *Session // nil when no record exists
	Subs     []Subscription
	Queue    []Entry // in order
	Inflight []Entry
	Incoming []Incoming
	Messages map[string]*Message // every message the queue and in-flight entries refer to
	// TookQoS2 holds the msgIDs of the last [TookQoS2Len] entries appended
	// with [Entry.TookQoS2], oldest first. An append records an entry it
	// queued or sent at once, and one it found queued already (a retry);
	// not one its queue limit refused. Sending, completing or dropping the
	// entry later leaves the record: the session took the message.
	TookQoS2 []string
}

// QueueLimits bound one session's queue.
type QueueLimits struct {
	MaxLen     int  // entries; 0 unlimited
	DropOldest bool // when full: drop the oldest (true) or refuse the newest (false)
	// TenantMax bounds the entries queued for all the tenant's sessions
	// (in this store, one Redis group); 0 unlimited. At the bound an
	// append's entries are refused (the session's own bound, checked
	// first, may make room by its own policy). Set by the persistence
	// service from its configuration for the appends an edge marks as
	// offline queueing, never taken from a request.
	TenantMax int
}

// TenantUsage is what a tenant holds in a store.
type TenantUsage struct {
	Queued   int // entries queued for its sessions (as counted for TenantMax)
	Retained int // retained topics
}

// TenantQuotas are the tenants' queue bounds ([QueueLimits.TenantMax]).
type TenantQuotas struct {
	Default int            // entries per tenant; 0 unlimited
	For     map[string]int // tenants with a bound of their own (0: unlimited)
}

// Max returns tenant's bound.
func (q TenantQuotas) Max(tenant string) int {
	if n, ok := q.For[tenant]; ok {
		return n
	}
	return q.Default
}

// AppendResult counts what an append did.
type AppendResult struct {
	Added, Duplicates, DroppedOldest, Refused int
}

// Store is durable MQTT state. Writes carrying a [Fence] are refused with
// [ErrFenced] or [ErrGroupFenced] when a newer owner or group record exists.
// A nil error from a write means it is durable as promised: replicated when
// the implementation replicates (else [ErrNotReplicated]).
type Store interface {
	// Activate makes f.Epoch the session's current epoch.
	Activate(ctx context.Context, k SessionKey, f Fence) error
	PutSession(ctx context.Context, k SessionKey, f Fence, s Session) error
	// DeleteSession removes everything of the session but its epoch, the
	// remembered QoS 2 msgIDs included.
	DeleteSession(ctx context.Context, k SessionKey, f Fence) error
	PutSubscription(ctx context.Context, k SessionKey, f Fence, sub Subscription) error
	DeleteSubscription(ctx context.Context, k SessionKey, f Fence, filter string) error
	// Append queues messages, set-if-absent by msgID, in order, and
	// remembers the msgIDs of entries marked [Entry.TookQoS2].
	Append(ctx context.Context, k SessionKey, f Fence, lim QueueLimits, entries []Entry, msgs []*Message) (AppendResult, error)
	// Send moves queued entries (by msgID) to the in-flight set under their
	// packet IDs; entries with QoS 0 just leave the queue.
	Send(ctx context.Context, k SessionKey, f Fence, entries []Entry) error
	// Pubrel records PUBREC received for an in-flight QoS 2 delivery.
	Pubrel(ctx context.Context, k SessionKey, f Fence, packetID uint16) error
	// Complete removes acknowledged in-flight deliveries.
	Complete(ctx context.Context, k SessionKey, f Fence, packetIDs []uint16) error
	// Dequeue removes queue entries without sending them.
	Dequeue(ctx context.Context, k SessionKey, f Fence, msgIDs []string) error
	PutIncoming(ctx context.Context, k SessionKey, f Fence, in Incoming) error
	DeleteIncoming(ctx context.Context, k SessionKey, f Fence, packetID uint16) error
	Load(ctx context.Context, k SessionKey) (*State, error)
	// PutRetained stores m as the retained message of its topic unless a
	// newer one (by Created) is stored; an empty payload deletes. It reports
	// whether it changed anything.
	PutRetained(ctx context.Context, tenant string, m *Message) (bool, error)
	// LookupRetained returns the retained messages of tenant matching filter
	// (at most limit), through the topic index.
	LookupRetained(ctx context.Context, tenant, filter string, limit int) ([]*Message, error)
	// TenantUsage counts what tenant holds here.
	TenantUsage(ctx context.Context, tenant string) (TenantUsage, error)
	Close() error
}
