package broker

import (
	"context"
	"errors"
	"sync/atomic"

	"github.com/keelmq/keel/services/edge/internal/durable"
)

// The edge reaches everything beyond its own process through the small
// interfaces below. In single-node mode they are served by local
// implementations; in a cluster by clients of the coordinator, router,
// persistence and output services. The MQTT logic is the same either way.

// DurableState keeps persistent sessions, their queues and in-flight
// messages, inbound QoS 2 state and retained messages. A method that
// returns a [durable.Pending] or takes a wait flag lets the caller decide
// what must be stored before it acknowledges anything to a client.
//
// Every write for a session is made under the epoch last given to Activate
// for it. A store shared by all edges (the persistence service) refuses
// writes under an epoch older than the session's current one, so an edge
// that lost a session can no longer change it; an edge-local store has no
// other writer and ignores epochs.
type DurableState interface {
	// Load returns what the store holds for this edge at start: every
	// session and retained message of a local store; nothing of a shared
	// one, whose sessions are loaded as their clients or custody bring them.
	Load() ([]durable.SessionState, []durable.Message, error)
	// Activate makes epoch the session's current one (replicated before it
	// returns, in a shared store): from then on writes under older epochs
	// are refused, and this edge's writes for the session carry it.
	Activate(ctx context.Context, id string, epoch uint64) error
	// Deactivate forgets the epoch of a session that left this edge, if it
	// is no newer than epoch: a copy that goes after a newer one of the
	// same session was activated here must not leave the newer one unable
	// to write.
	Deactivate(id string, epoch uint64)
	// Shared reports whether every edge reads and writes the same state: a
	// session can then be resumed from the store alone, and an edge that
	// hands a session over must not delete what the new owner reads.
	Shared() bool
	PutSession(ctx context.Context, rec durable.Session) error
	DeleteSession(ctx context.Context, id string, wait bool) error
	PutSubscription(ctx context.Context, id string, sub durable.Subscription) error
	DeleteSubscription(ctx context.Context, id, filter string) error
	Enqueue(id string, e durable.Entry) *durable.Pending
	// Dequeue removes queue entries, named by Seq (edge-local store) or
	// MsgID (shared store).
	Dequeue(ctx context.Context, id string, gone []durable.Entry) error
	Send(id string, entries []durable.Entry) *durable.Pending
	Pubrel(ctx context.Context, id string, packetID uint16) error
	Complete(ctx context.Context, id string, packetID uint16) error
	PutIncoming(ctx context.Context, id string, in durable.Incoming) error
	DeleteIncoming(ctx context.Context, id string, packetID uint16) error
	PutRetained(ctx context.Context, m *durable.Message, wait bool) error
	LoadSession(ctx context.Context, id string) (durable.SessionState, bool, error)
	ImportSession(ctx context.Context, st durable.SessionState) error
}

var _ DurableState = (*durable.Store)(nil)

// RetainedIndex is implemented by a shared [DurableState]: the retained
// messages of every edge, looked up by filter (internal form) through the
// store's index when a subscription is made.
type RetainedIndex interface {
	MatchRetained(ctx context.Context, filter string) ([]durable.Message, error)
}

// Ownership decides which edge owns a session.
type Ownership interface {
	Claim(ctx context.Context, tenant, clientID string) (Grant, error)
	Release(ctx context.Context, tenant, clientID string, epoch uint64) error
}

// Grant is a successful claim.
type Grant struct {
	// Epoch is the claim's epoch: monotonic per session, the fencing token
	// of every write.
	Epoch uint64
	// Previous is the edge that owned the session before ("" if none).
	Previous string
	// PreviousEpoch is the epoch of Previous's claim (0 if none, or not
	// known). When Previous is this edge, a copy held here under an older
	// claim is not that claim's: the answer to it was lost, and the
	// session may have moved on between the two (TakenFrom).
	PreviousEpoch uint64
	// TakenFrom is the edge the owner took the session from before its
	// run of claims. When Previous is this edge but the edge holds no copy
	// under that claim (the answer to its earlier claim was lost, so its
	// takeover never ran), the session is still on TakenFrom.
	TakenFrom string
	// SourceGone says the edge the session would be taken over from
	// (Previous, or TakenFrom when Previous is this edge) was no longer a
	// live member when the claim was made: it fenced itself, and the
	// session is resumed from the store.
	SourceGone bool
}

// OwnerLookup is an Ownership that can say who owns a session now.
type OwnerLookup interface {
	// Owner returns the edge that owns the session and the epoch of its
	// claim; edge is "" when nobody owns it.
	Owner(ctx context.Context, tenant, clientID string) (edge string, epoch uint64, err error)
}

// ConditionalOwnership is an Ownership that can claim a session only while
// a given edge owns it.
type ConditionalOwnership interface {
	Ownership
	// ClaimFrom is Claim granted only while owner owns the session;
	// ErrOwnerChanged otherwise.
	ClaimFrom(ctx context.Context, tenant, clientID, owner string) (Grant, error)
}

// ErrOwnerChanged is returned by a conditional claim when the session is
// not owned by the edge it named.
var ErrOwnerChanged = errors.New("session owner changed")

// ErrClaimSuperseded is returned by a claim that was granted and then
// followed by a newer claim of the session before the claimant heard of its
// grant (the answer was lost and the claim retried): the session is not
// this edge's.
var ErrClaimSuperseded = errors.New("session claim superseded")

// Routes tells the rest of the cluster which filters this edge has
// subscribers for, in the tenant's own (outside) form. Add returns once
// other edges will route matching publishes here (before the SUBACK).
// Routes count subscribers: each Add that returned nil, or an error other
// than ErrRouteRefused (the caller's context ended first, the route still
// on its way), is matched by one Remove.
type Routes interface {
	Add(ctx context.Context, tenant, filter, shareGroup string) error
	Remove(ctx context.Context, tenant, filter, shareGroup string) error
}

// ErrRouteRefused is Routes.Add's error for a route refused outright (by
// the router, or as invalid): it counts no subscriber, and is not removed.
var ErrRouteRefused = errors.New("route refused")

// Output receives messages for the output pipelines. Offer must never
// block: a full queue drops and counts.
type Output interface {
	Offer(m *Message) bool
}

// Peers forwards a message published on this edge to every other edge
// whose routes match it. Forward hands the message over without waiting;
// for QoS 1/2 the returned wait (nil when there is nothing to wait for)
// returns once each of them took the message, or an error after a bound:
// then the publisher must not be acknowledged. Messages handed over in
// turn reach each peer in that order.
type Peers interface {
	// again is nil the first time; set when m is routed again (see [Again]).
	// A wait that fails because edges left the cluster before taking m
	// returns a [*NotTaken].
	// With a context from [AtOnce], Forward returns ErrNeedsLookup, having
	// done nothing, when it would have to ask the router for m's routes.
	Forward(ctx context.Context, m *Message, again *Again) (wait func() error, local SharedChoice, err error)
	// ForwardShared hands m to one other edge with members of group, for
	// that group alone, never to notEdge ("": any); ErrNoMember when no
	// other edge has one, ErrRoutesUnsettled when none is known while the
	// routes settle.
	ForwardShared(ctx context.Context, m *Message, group GroupKey, notEdge string) (wait func() error, err error)
	// Relay hands m to edge for the given sessions alone: sessions this
	// edge handed over to it, which m, published before the handover, may
	// not have reached.
	Relay(ctx context.Context, m *Message, edge string, to []RelayTarget) (wait func() error, err error)
}

// ErrNeedsLookup is Forward's answer, under [AtOnce], for a message whose
// routes it does not hold.
var ErrNeedsLookup = errors.New("routes need a lookup")

type atOnceKey struct{}

// AtOnce makes Forward route with what it holds, or refuse with
// ErrNeedsLookup: the reading goroutine of a publisher routes there only
// what needs no call, and hands the rest to a goroutine of its own
// (routeBehind).
func AtOnce(ctx context.Context) context.Context { return context.WithValue(ctx, atOnceKey{}, true) }

// IsAtOnce reports whether ctx comes from [AtOnce].
func IsAtOnce(ctx context.Context) bool { v, _ := ctx.Value(atOnceKey{}).(bool); return v }

// Again describes a message routed again because edges it was forwarded
// to left the cluster before taking it (DESIGN: PUBLISH, the publishing
// edge re-resolves and retries until a live target takes it).
type Again struct {
	// Since is the first routing's time less the clock skew allowed between
	// edges (unix nano). Every edge with a match may have taken the message
	// then, so now it goes only to the sessions that became routable on
	// their edge at or after Since: the left edges' sessions, adopted or
	// taken over since, wherever they went.
	Since int64
	// Groups are the shared groups the left edges were chosen to serve:
	// each is given a member again. The other groups were served.
	Groups []GroupKey
}

// ErrEdgeLeft is the cause of a forward that failed because the edge it
// went to left the cluster (its lease expired) before taking the message,
// or because a route named an edge that is no longer a member: the message
// can be routed again once the routes no longer name it.
var ErrEdgeLeft = errors.New("edge left the cluster before taking the message")

// NotTaken is the error of a forward's wait when only edges that left the
// cluster failed to take the message: it can be routed again, to Groups
// and to the sessions the edges held.
type NotTaken struct {
	// Groups are the shared groups the left edges were to serve (in the
	// tenant's outside form). An edge that did not take a message committed
	// it to no member, and nothing kept of it is re-dispatched.
	Groups []GroupKey
	Err    error
}

func (e *NotTaken) Error() string { return e.Err.Error() }
func (e *NotTaken) Unwrap() error { return e.Err }

// ErrNoMember is returned when a shared group has no member to take a
// message.
var ErrNoMember = errors.New("shared group has no other member")

// ErrRoutesUnsettled is returned when a message owed to a shared group
// cannot be given a member yet: the router is settling a membership change
// (or a new table), and its answer names no member of the group where one
// may be. An answer that settled may name none; this one may just not know
// them. The message is tried again, never dropped for it.
var ErrRoutesUnsettled = errors.New("routes unsettled: the group's members are not all known")

// SharedChoice says which shared-subscription groups an edge serves for one
// message: each group's message goes to one member in the whole cluster,
// so the publishing edge picks one edge per group.
type SharedChoice struct {
	// Chosen is false when no choice was made: every matching local group
	// is served.
	Chosen bool
	// Groups are the groups served here when Chosen.
	Groups []GroupKey
	// Only leaves out every recipient here but the members of Groups: the
	// message is a re-dispatch, which everyone else has already.
	Only bool
	// Origin, when set, is the edge that keeps the message until it hears
	// what became of it here ([SharedReports]).
	Origin *ShareOrigin
	// Since, when set, leaves out the plain subscriptions of the sessions
	// that became routable here before it (unix nano): the message is
	// routed again ([Again]), and they had it.
	Since int64
}

// ShareOrigin is the edge incarnation that forwarded a QoS 1 group message
// and keeps it until it hears the outcome (DESIGN: shared subscriptions:
// the publishing edge owns it until the member's PUBACK is reported back).
type ShareOrigin struct {
	Edge        string
	Incarnation uint64
}

// ShareOutcome is what became of a group message an origin keeps.
type ShareOutcome int

const (
	// ShareAcked: the member acknowledged it, or its copy no longer depends
	// on this edge (stored durably, or delivered at QoS 0).
	ShareAcked ShareOutcome = iota + 1
	// ShareRefused: the member refused it (PUBACK reason code ≥ 0x80).
	ShareRefused
	// ShareMemberGone: the member's session ended before it acknowledged.
	ShareMemberGone
)

// SharedReports tells origins what became of the group messages they keep.
// Report returns false when it cannot: the origin is not live, so the
// message is this edge's to re-dispatch.
type SharedReports interface {
	ReportShared(to ShareOrigin, m *Message, group GroupKey, outcome ShareOutcome) bool
}

// GroupKey names a shared group: its name and its filter in the tenant's
// outside form.
type GroupKey struct{ Name, Filter string }

// Cluster bundles the interfaces; nil fields take the single-node defaults
// (a nil Peers: no other edges).
type Cluster struct {
	Ownership Ownership
	Routes    Routes
	Output    Output
	Peers     Peers
	Takeover  Takeover
	Custody   Custody
	// Reports, nil on a single edge, carries outcomes of group messages to
	// the edges that forwarded them.
	Reports SharedReports
}

// localOwnership serves one edge: every claim succeeds, with epochs
// counting up per process. There is no other edge to hand a session over
// from, so no previous owner is reported and nothing is kept per session.
type localOwnership struct {
	epoch atomic.Uint64
}

func (o *localOwnership) Claim(context.Context, string, string) (Grant, error) {
	return Grant{Epoch: o.epoch.Add(1)}, nil
}

func (o *localOwnership) Release(context.Context, string, string, uint64) error { return nil }

// localRoutes: on one edge the subscription index is the whole routing
// table, so there is nothing to tell anyone.
type localRoutes struct{}

func (localRoutes) Add(context.Context, string, string, string) error    { return nil }
func (localRoutes) Remove(context.Context, string, string, string) error { return nil }

// noOutput drops nothing because it is offered nothing: single-node mode
// has no output pipelines unless one is configured.
type noOutput struct{}

func (noOutput) Offer(*Message) bool { return true }
