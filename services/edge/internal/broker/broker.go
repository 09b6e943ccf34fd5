// Package broker is the single-node MQTT core of the edge: it runs mochi for
// the wire protocol and connection handling, and takes over what a clustered,
// multi-tenant broker must own itself: tenancy, authentication and ACLs,
// routing, delivery with backpressure, retained messages and wills.
//
// mochi handles CONNECT/CONNACK, keep-alive, inbound QoS handshakes, inbound
// topic aliases and session takeover. Every PUBLISH from a client is routed by
// the [Broker] through its own subscription index into bounded per-session
// queues; mochi's own fan-out (which discards QoS 1/2 messages when a
// subscriber is slow) is never used. A PUBACK/PUBREC leaves only after every
// recipient has taken the message.
package broker

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/listeners"
	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/libs/topic"
	"github.com/keelmq/keel/services/edge/internal/auth"
	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

// Broker is a single-node MQTT broker with tenancy.
type Broker struct {
	cfg      Config
	logger   *slog.Logger
	server   *mqtt.Server
	auth     auth.Authenticator
	index    *index
	retained *retainedStore
	// retainedWrites: this edge's retained messages the shared store has
	// not taken yet.
	retainedWrites retainedWrites
	ids            *msgIDs
	m              *metrics
	mIn            [3]prometheus.Counter
	bIn            [3]prometheus.Counter // payload bytes in, by QoS
	bOut           [3]prometheus.Counter // PUBLISH bytes out, by QoS
	mOut           [3]prometheus.Counter
	mAlone         [len(aloneOutcomes)]prometheus.Counter
	limits         topic.Limits
	guard          *guard

	listenerMu  sync.Mutex
	listenerIDs []string     // as registered with mochi, until closed
	handlers    atomic.Int64 // connection handlers running

	conns    sync.Map // *mqtt.Client -> *conn
	scopes   sync.Map // tenant -> *tenancy.Scope
	sessMu   sync.Mutex
	sessions map[string]*session // internal client ID -> session
	// unfinished remembers, per internal client ID, the previous owner of a
	// takeover that failed after this edge's claim went through: the next
	// claim names this edge as the previous owner, but the session is still
	// there (guarded by sessMu).
	unfinished map[string]unfinishedTakeover
	// claims follows the claims in flight, for the coordinator.
	claimMarks claimLedger
	// handed remembers the subscriptions of sessions handed over to other
	// edges while messages routed here before may still arrive.
	handed *handedOver
	// picks remembers the members of shared groups that took messages
	// that failed here, and the edges chosen for QoS 2 messages published
	// here and not acknowledged, for their resends.
	picks sharedPicks
	// delivered remembers the members of shared groups that took QoS 2
	// messages forwarded here, which their publishers may send again. Kept
	// apart from picks, with its own bound: it takes every QoS 2 group
	// message, and would push out the picks of messages that failed.
	delivered sharedPicks
	// fencedOwners holds the fenced copies whose owner is looked up in the
	// background (findFencedOwner).
	fencedOwners fencedOwners
	// importLocks serialise the imports of a session (importSession), by
	// a hash of its ID.
	importLocks [importStripes]sync.Mutex
	// claiming serialises this edge's claims of each session.
	claiming sessionLocks
	// establishing orders, per client ID, the CONNECTs' steps from
	// OnSessionEstablish to their session's bind (or their end) as their
	// claims were: mochi writes the CONNACK between the two and binds
	// nothing itself, so a newer CONNECT of the client in between would
	// take the session over from a connection not yet bound, and mochi's
	// own takeover could then pick the newer connection as the one to
	// close; an older one coming after the newer would close it.
	establishing establishOrder
	// establishedClaims is, per client ID, the newest claim whose CONNECT
	// came to take the session on here (OnSessionEstablish) while one of
	// the client's CONNECTs is between that point and its record's write.
	establishedClaims newestClaims
	// records serialises the writes of each session's subscription records
	// (session.storeRecord). Lock order: records before session.mu.
	records sessionLocks
	// recordWrites orders, per session, the writes of its stored record
	// that a connection makes for itself (persistSession, dropStoredWill,
	// storeDisconnectExpiry) together with the check that the record is
	// still that connection's: a newer connection stores its record before
	// its CONNACK and is bound only after it, and an older one's end in
	// between would otherwise write its own record back over the newer
	// one. Lock order: recordWrites before sessMu and session.mu.
	recordWrites sessionLocks

	willMu sync.Mutex
	wills  map[string]*pendingWill // internal client ID -> delayed will
	claims claimGuards             // CONNECTs in flight, by internal client ID

	store   DurableState // nil: memory only
	cluster Cluster
	restore *restored // state for mochi to load in Serve
	// restoredEnds holds, by internal client ID, when the last connection
	// of each session restored with a kept will ended (restoredWills):
	// mochi dates the end of a restored client from its load, and the
	// hook moves it back (OnDisconnect). Written before Serve starts the
	// listeners, read-only after.
	restoredEnds map[string]time.Time

	done chan struct{}
	// stopped ends what waits on other edges when the broker stops.
	stopped  context.Context
	atOnce   context.Context // b.stopped under AtOnce
	stop     context.CancelFunc
	stopping atomic.Bool
	draining atomic.Bool // handing sessions to custodians: admit no one
	// stopGate keeps Close from making wills held back (willsHeldBack)
	// while a session's end has decided its will goes out from here and
	// has not sent it yet: held back then, the will would be neither sent
	// nor kept, its stored record being ended. The ends that send a
	// waiting will (a takeover, an expiry, an operator's discard, a
	// CONNECT that ends the session) hold it read, and may take it read
	// again; Close's first step takes it write, with TryLock only
	// (closeGate): a blocking Lock would hold up those second reads.
	stopGate sync.RWMutex
	// disconnecting counts the connection ends being handled (OnDisconnect):
	// a drain hands a session over only once its connection's end decided
	// the will, which then goes with the session.
	disconnecting atomic.Int64
	// offlineWait bounds a drain's wait for its connections' ends
	// (drainOfflineWait; tests shorten it).
	offlineWait time.Duration
	// drainReference is the server reference of the drain under way.
	drainReference atomic.Pointer[string]

	fenced   atomic.Bool // the edge's cluster lease lapsed: acknowledge nothing
	stopOnce sync.Once
	writers  sync.WaitGroup
	ackers   sync.WaitGroup // sendAcks goroutines
	releases sync.WaitGroup
	load     loadScore
	aclw     aclWatch

	// takeoverFails counts refusals for a failed takeover, and
	// takeoverFailsLogged those up to the last line logged.
	takeoverFails, takeoverFailsLogged atomic.Uint64
	takeoverFailLog                    logging.Every

	// atWill, when set, runs in OnDisconnect as the ended connection comes
	// to its will: a takeover of its session can land between the
	// connection's end and that point, and tests hold it open there.
	atWill atomic.Pointer[func(*mqtt.Client)]
	// atLapse, when set, runs in DropLapsedSessions for each session
	// between its two steps: a connection of the session can end there,
	// and tests bring its end to its will then.
	atLapse atomic.Pointer[func(id string)]
	// atTakeOverWill, when set, runs in TakeOver between the end of a
	// session that does not move and the sending of its waiting will:
	// tests stop the edge there.
	atTakeOverWill atomic.Pointer[func()]
	// aloneAfter is how long a session's writer must have been idle for a
	// delivery to be written alone by the goroutine that queued it
	// (writeAlone); tests set it to 0.
	aloneAfter time.Duration
	// atResend, when set, runs in bind before a resumed session's
	// in-flight messages are sent again: tests publish there.
	atResend atomic.Pointer[func()]
	// atCloseGate, when set, runs each time Close finds stopGate held.
	atCloseGate atomic.Pointer[func()]
	// atSessionEstablish, when set, runs as OnSessionEstablish begins:
	// tests stop the edge there.
	atSessionEstablish atomic.Pointer[func()]
	// atBind, when set, runs in bindEstablished between finding the
	// session's copy and binding the connection to it: the copy can end
	// there, and tests end it then.
	atBind atomic.Pointer[func(id string)]
}

// conn is the per-connection state the hooks share.
type conn struct {
	scope    *tenancy.Scope
	identity *auth.Identity
	// rules is the connection's bound ACL (nil: everything in the tenant).
	// An ACL version bump swaps it from another goroutine (aclwatch.go).
	rules    atomic.Pointer[auth.Rules]
	clientID string // as the client knows it (external)
	// will and sessionEnds are written by a taking-over connection's
	// goroutine too.
	will      atomic.Pointer[Message]
	willDelay uint32
	// established: OnSessionEstablished ran (the CONNACK was written).
	established atomic.Bool
	// record is the session record stored for this connection while it
	// holds a will, nil if none.
	record *durable.Session
	// stored is the session record stored at CONNECT, nil if none: a
	// DISCONNECT that changes the expiry interval writes it again.
	stored  *durable.Session
	existed []bool // per filter of the SUBSCRIBE being processed
	refused []byte // per filter of that SUBSCRIBE: the code the edge refuses it with, 0 if none
	// sessionEnds is set when a clean-start takeover ends this connection's
	// session: its will is published without delay.
	sessionEnds atomic.Bool
	// epoch is the ownership epoch of the session this connection holds.
	epoch uint64
	// sess is the copy of the session the connection was bound to (or to
	// be bound to, when its bind failed): its end decides its will by what
	// became of that copy (willAtEnd).
	sess atomic.Pointer[session]
	// guard covers the CONNECT until its session is bound (claims.go);
	// superseded is set when a newer claim elsewhere won meanwhile: the
	// connection then never held the session.
	guard      *claimGuard
	superseded atomic.Bool
	// establishAfter is closed once the client's previous CONNECT here
	// (by claim) was bound or ended (nil: none); establishDone, once
	// called, lets the next go (establishOrder).
	establishAfter <-chan struct{}
	establishDone  func()
	// expiry disconnects the client when its credentials expire.
	expiry   *time.Timer
	pubACL   map[string]bool
	limiter  *rateLimiter
	listener string
	acks     ackQueue
	// pubACLFor is the rules pubACL was filled under; other rules in force
	// make it stale.
	pubACLFor *auth.Rules
	// lookups holds, per topic, the last of the publishes routed off the
	// read loop (routeBehind) while it is routed.
	lookups lookupChains
}

// releaseEstablishing lets the client's next CONNECT be established.
func (c *conn) releaseEstablishing() {
	if c.establishDone != nil {
		c.establishDone()
	}
}

// establishOrder queues the CONNECTs of each client ID in the order of
// their claims: each waits, before it is established, for the one claimed
// before it to be bound or gone.
type establishOrder struct {
	mu   sync.Mutex
	last map[string]chan struct{} // by internal client ID; guarded by mu
}

// enter puts a CONNECT of id at the end of its queue, under the claim
// lock: it returns what to wait on (nil: nothing) and the func that lets
// the next go.
func (o *establishOrder) enter(id string) (after <-chan struct{}, done func()) {
	mine := make(chan struct{})
	o.mu.Lock()
	if o.last == nil {
		o.last = map[string]chan struct{}{}
	}
	if prev := o.last[id]; prev != nil {
		after = prev
	}
	o.last[id] = mine
	o.mu.Unlock()
	return after, o.leave(id, mine)
}

// leave returns the func that lets the next of id's queue go after mine.
func (o *establishOrder) leave(id string, mine chan struct{}) func() {
	return sync.OnceFunc(func() {
		close(mine)
		o.mu.Lock()
		if o.last[id] == mine {
			delete(o.last, id)
		}
		o.mu.Unlock()
	})
}

// enterIdle puts a step of id at the queue's head if the queue is empty,
// and reports whether it did: a CONNECT of id that comes meanwhile waits
// for done, before it raises the session's epoch. The expiry of a session
// (mochi's tick) takes this way, so that it never ends a session a CONNECT
// is resuming, and gives way to a CONNECT already in the queue, whose own
// check decides.
func (o *establishOrder) enterIdle(id string) (done func(), ok bool) {
	mine := make(chan struct{})
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.last[id] != nil {
		return nil, false
	}
	if o.last == nil {
		o.last = map[string]chan struct{}{}
	}
	o.last[id] = mine
	return o.leave(id, mine), true
}

// newestClaims keeps, per client ID, the newest claim epoch seen, as long
// as someone holds it (enter, until the returned func is called).
type newestClaims struct {
	mu   sync.Mutex
	byID map[string]*newestClaim // guarded by mu
}

type newestClaim struct {
	epoch uint64
	refs  int
}

// enter records epoch for id, and holds the record until leave is called.
func (n *newestClaims) enter(id string, epoch uint64) (leave func()) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.byID == nil {
		n.byID = map[string]*newestClaim{}
	}
	e := n.byID[id]
	if e == nil {
		e = &newestClaim{}
		n.byID[id] = e
	}
	e.epoch = max(e.epoch, epoch)
	e.refs++
	return sync.OnceFunc(func() {
		n.mu.Lock()
		defer n.mu.Unlock()
		if e.refs--; e.refs == 0 && n.byID[id] == e {
			delete(n.byID, id)
		}
	})
}

// newest returns the newest epoch recorded for id (0: none held).
func (n *newestClaims) newest(id string) uint64 {
	n.mu.Lock()
	defer n.mu.Unlock()
	if e := n.byID[id]; e != nil {
		return e.epoch
	}
	return 0
}

// New builds a broker; Serve starts it.
func New(cfg Config, authn auth.Authenticator, logger *slog.Logger, reg prometheus.Registerer) (*Broker, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	caps := mqtt.NewDefaultServerCapabilities()
	caps.MaximumClients = cfg.MaxConnections
	caps.MaximumPacketSize = cfg.MaxPacketSize
	caps.ReceiveMaximum = cfg.ReceiveMaximum
	caps.MaximumInflight = cfg.MaxInflight
	caps.TopicAliasMaximum = cfg.TopicAliasMaximum
	caps.MaximumSessionExpiryInterval = cfg.MaxSessionExpiry
	caps.MaximumMessageExpiryInterval = cfg.MaxMessageExpiry
	// mochi neither expires nor orders the edge's in-flight messages: it
	// sorts resends by uint16(Created), which ties within a second. The edge
	// resends them itself, in send order, and enforces message expiry itself.
	caps.MaximumMessageExpiryInterval = 0
	// mochi's own outbound channel is unused: deliveries go through the
	// session queues, so a tiny channel saves ~64 KiB per client.
	caps.MaximumClientWritesPending = 1
	caps.Compatibilities.NoInheritedPropertiesOnAck = true
	b := &Broker{
		cfg:      cfg,
		logger:   logger,
		auth:     authn,
		index:    newIndex(),
		retained: newRetainedStore(),
		ids:      newMsgIDs(cfg.EdgeID),
		limits:   topic.Limits{MaxLength: cfg.MaxTopicLength, MaxLevels: cfg.MaxTopicLevels},
		guard:    newGuard(&cfg),
		sessions: map[string]*session{},
		wills:    map[string]*pendingWill{},
		handed:   newHandedOver(cfg.HandoverMemory),
		done:     make(chan struct{}),
		cluster:  Cluster{Ownership: &localOwnership{}, Routes: localRoutes{}, Output: noOutput{}},

		offlineWait: drainOfflineWait,
		aloneAfter:  writeAloneAfter,
	}
	b.stopped, b.stop = context.WithCancel(context.Background())
	b.atOnce = AtOnce(b.stopped)
	b.server = mqtt.New(&mqtt.Options{
		Capabilities:           caps,
		Logger:                 logger.With("component", "mochi"),
		SysTopicResendInterval: 3600,
		// A connected client's read loop runs on a goroutine of its own,
		// so the stack its CONNECT grew (authentication, session claim)
		// is freed: an idle client holds one small stack.
		DetachClient: b.serveDetached,
	})
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	b.m = newMetrics(reg, b)
	for q := range 3 {
		b.mIn[q] = b.m.messagesIn.WithLabelValues(qosLabel[q])
		b.mOut[q] = b.m.messagesOut.WithLabelValues(qosLabel[q])
		b.bIn[q] = b.m.bytesIn.WithLabelValues(qosLabel[q])
		b.bOut[q] = b.m.bytesOut.WithLabelValues(qosLabel[q])
	}
	for i, outcome := range aloneOutcomes {
		b.mAlone[i] = b.m.writesAlone.WithLabelValues(outcome)
	}
	if err := b.server.AddHook(&hook{b: b}, nil); err != nil {
		return nil, err
	}
	return b, nil
}

// ID returns the edge ID and this process's incarnation, which together
// with a sequence make every message ID.
func (b *Broker) ID() (edge string, incarnation uint64) { return b.ids.edge, b.ids.incarnation }

// Fence stops the edge acknowledging anything because its cluster lease
// lapsed (DESIGN: membership, leases and fencing): every client is
// disconnected with 0x8B, new connections are refused with 0x88, and no
// publish is acknowledged, until Unfence.
func (b *Broker) Fence() {
	if !b.fenced.CompareAndSwap(false, true) {
		return
	}
	b.logger.Error("edge fenced: disconnecting every client until the lease is back")
	b.conns.Range(func(k, _ any) bool {
		cl := k.(*mqtt.Client)
		go func() { _ = b.disconnect(cl, packets.ErrServerShuttingDown) }()
		return true
	})
}

// DropLapsedSessions forgets, on an edge that rejoins the cluster under a
// new incarnation, every session it held under the old one: its lease ran
// out, so the coordinator passed each of them on to a custodian or a newer
// claim, which reads it from the shared store. A copy kept here would
// register its routes again under the new incarnation and draw messages it
// can no longer store (fenced), or miss its client's comeback elsewhere.
// Nothing is deleted from the store and no will goes out here: the
// session's new holder does both. It returns how many were dropped. An
// edge-local store has no custodians: its sessions stay.
func (b *Broker) DropLapsedSessions() int {
	if b.store == nil || !b.store.Shared() {
		return 0
	}
	b.sessMu.Lock()
	ids := make([]string, 0, len(b.sessions))
	for id := range b.sessions {
		ids = append(ids, id)
	}
	clear(b.unfinished)
	b.sessMu.Unlock()
	// The route stream of the lapsed incarnation is refused and the new one
	// opens only after this: route removals are not waited for. The routes
	// leave the set the edge registers under its new incarnation at once.
	//
	// Each copy is forgotten before its waiting will is cancelled: from the
	// forgetting on, a connection of the session that ends (the fence
	// closed them all, and one's end can come late) finds the session gone
	// on elsewhere and leaves its will (willAtEnd); one that came to its
	// will before scheduled it, and the cancel takes it back. Cancelled
	// first, a will scheduled in between would stay and go out from here
	// after its delay, besides the new holder's, or after the client came
	// back elsewhere [MQTT-3.1.3-9].
	for _, id := range ids {
		b.forgetSessionRoutes(cancelled, id, endWhich{})
		if at := b.atLapse.Load(); at != nil {
			(*at)(id)
		}
		b.cancelWill(id, false)
	}
	if len(ids) > 0 {
		b.m.lapsedDropped.Add(float64(len(ids)))
		b.logger.Info("sessions of the lapsed incarnation dropped; their new holders serve them", "sessions", len(ids))
	}
	return len(ids)
}

// cancelled is a context that has ended: a route removal (or addition)
// given it is counted at once and not waited for.
var cancelled = func() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}()

// routeRestored registers the routes of the sessions restored from this
// edge's own store before it joined a cluster: without them, what other
// edges publish to their subscriptions would never come here. They are
// counted at once and land when the route stream is up.
func (b *Broker) routeRestored() {
	b.sessMu.Lock()
	sessions := slices.Collect(maps.Values(b.sessions))
	b.sessMu.Unlock()
	n := 0
	for _, s := range sessions {
		s.mu.Lock()
		subs := slices.Collect(maps.Values(s.subs))
		s.mu.Unlock()
		for _, x := range subs {
			err := b.cluster.Routes.Add(cancelled, s.scope.Tenant(), s.outsideFilter(x), groupName(x))
			if errors.Is(err, ErrRouteRefused) {
				b.logger.Warn("route of a restored session refused", "client_id", s.id, "error", err)
				continue
			}
			s.routeCounted(x)
			n++
		}
	}
	if n > 0 {
		b.logger.Info("routes of restored sessions registered", "sessions", len(sessions), "routes", n)
	}
}

// Unfence lets the edge serve again after it rejoined the cluster.
func (b *Broker) Unfence() {
	if b.fenced.CompareAndSwap(true, false) {
		b.logger.Info("edge unfenced: serving again")
	}
}

// SetCluster replaces the single-node defaults with cluster clients; nil
// fields keep their defaults. Call before Serve.
func (b *Broker) SetCluster(c Cluster) {
	if c.Ownership != nil {
		b.cluster.Ownership = c.Ownership
	}
	if c.Takeover != nil {
		b.cluster.Takeover = c.Takeover
	}
	if c.Custody != nil {
		b.cluster.Custody = c.Custody
	}
	if c.Routes != nil {
		b.cluster.Routes = c.Routes
		b.routeRestored()
	}
	if c.Output != nil {
		b.cluster.Output = c.Output
	}
	if c.Peers != nil {
		b.cluster.Peers = c.Peers
	}
	if c.Reports != nil {
		b.cluster.Reports = c.Reports
	}
}

// AddListener adds a listener. Connections that do not complete CONNECT
// within the configured timeout are closed.
func (b *Broker) AddListener(l listeners.Listener) error {
	if err := b.server.AddListener(&guardedListener{Listener: l, timeout: b.cfg.ConnectTimeout, b: b}); err != nil {
		return err
	}
	b.listenerMu.Lock()
	b.listenerIDs = append(b.listenerIDs, l.ID())
	b.listenerMu.Unlock()
	return nil
}

// closeListeners closes the listeners and the clients on them, and takes
// the listeners out of mochi's registry, so that Server.Close finds none
// left to close itself. Its own closer lists a listener's clients with
// Clients.GetByListener, which takes the clients' read lock twice over
// (mochi v2.7.9): a client registering in between waits for the write lock,
// the second read lock waits behind it, and the stop hangs for good.
//
// A connection accepted just before its listener closed can register after
// the listener's clients were closed; it would hold Server.Close up until
// its keep-alive ran out. So the clients are closed again until no
// connection handler is left.
func (b *Broker) closeListeners() {
	b.listenerMu.Lock()
	ids := b.listenerIDs
	b.listenerIDs = nil
	b.listenerMu.Unlock()
	for _, id := range ids {
		b.server.Listeners.Close(id, func(string) {})
		b.server.Listeners.Delete(id)
	}
	for idle := 0; idle < 2; {
		b.closeClients()
		if b.handlers.Load() == 0 {
			idle++ // twice in a row: a handler started late counts by now
		} else {
			idle = 0
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// closeClients disconnects every client, reading the registry under one
// read lock.
func (b *Broker) closeClients() {
	for _, cl := range b.server.Clients.GetAll() {
		if !cl.Closed() {
			_ = b.server.DisconnectClient(cl, packets.ErrServerShuttingDown)
		}
	}
}

// Serve starts the listeners; it does not block.
func (b *Broker) Serve() error {
	if rs := b.restore; rs != nil {
		b.restoredWills(rs.ended, rs.wills)
		rs.ended, rs.wills = nil, nil
	}
	return b.server.Serve()
}

// stopGateWait bounds Close's wait for the session ends sending a will:
// one whose session's routes wait for a router that does not answer must
// not hold the stop for good.
const stopGateWait = 5 * time.Second

// closeGate takes stopGate for Close, waiting up to stopGateWait for the
// session ends that hold it, and reports whether it did. It only tries the
// lock, so that an end holding it read may take it read again.
func (b *Broker) closeGate() bool {
	deadline := time.Now().Add(stopGateWait)
	for !b.stopGate.TryLock() {
		if at := b.atCloseGate.Load(); at != nil {
			(*at)()
		}
		if time.Now().After(deadline) {
			b.logger.Warn("edge stopping while a session's end sends its will; the will may be held back")
			return false
		}
		time.Sleep(time.Millisecond)
	}
	return true
}

// Close disconnects every client with 0x8B and stops. Safe to call twice.
func (b *Broker) Close() error {
	b.stopOnce.Do(func() {
		gated := b.closeGate()
		b.stopping.Store(true)
		close(b.done)
		if gated {
			b.stopGate.Unlock()
		}
		b.stop()
		b.conns.Range(func(_, v any) bool {
			v.(*conn).acks.fail() // readers held for a window slot
			return true
		})
		b.closeListeners()
		_ = b.server.Close()
		b.writers.Wait()
		// The publishes waiting for their acknowledgement end with the
		// stop (their waits are bound to it): the PUBREC state of a QoS 2
		// one that is not acknowledged goes before the store closes, or
		// the client's resend would be taken for a duplicate.
		b.ackers.Wait()
		b.willMu.Lock()
		var keep []func()
		for _, pw := range b.wills {
			pw.stop()
			if pw.keep != nil {
				keep = append(keep, pw.keep)
			}
		}
		b.willMu.Unlock()
		// A single-node edge's wills still waiting for their delay go
		// out when it starts again; the store closes after this. Written
		// together, they share the store's commits.
		var kept sync.WaitGroup
		sem := make(chan struct{}, 64)
		for _, k := range keep {
			sem <- struct{}{}
			kept.Go(func() {
				defer func() { <-sem }()
				k()
			})
		}
		kept.Wait()
		b.releases.Wait()
	})
	return nil
}

func (b *Broker) scope(tenant string) (*tenancy.Scope, error) {
	if s, ok := b.scopes.Load(tenant); ok {
		return s.(*tenancy.Scope), nil
	}
	s, err := tenancy.NewScope(tenant)
	if err != nil {
		return nil, err
	}
	actual, _ := b.scopes.LoadOrStore(tenant, s)
	return actual.(*tenancy.Scope), nil
}

func (b *Broker) conn(cl *mqtt.Client) *conn {
	if c, ok := b.conns.Load(cl); ok {
		return c.(*conn)
	}
	return nil
}

func (b *Broker) session(id string) *session {
	b.sessMu.Lock()
	defer b.sessMu.Unlock()
	return b.sessions[id]
}

// holdsSince reports whether this edge holds a copy of session id under a
// claim of epoch or a later one.
func (b *Broker) holdsSince(id string, epoch uint64) bool {
	s := b.session(id)
	if s == nil {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.epoch >= epoch
}

func (b *Broker) sessionCount() int {
	b.sessMu.Lock()
	defer b.sessMu.Unlock()
	return len(b.sessions)
}

func (b *Broker) startWriter(s *session) {
	b.writers.Add(1)
	go func() {
		defer b.writers.Done()
		growStackForWrite()
		s.writeLoop()
	}()
}

// Publish injects a message from the broker itself (no client), for example
// for tests and $SYS. topic is in outside form for tenant.
func (b *Broker) Publish(tenant, topicName string, payload []byte, qos byte, retain bool) error {
	sc, err := b.scope(tenant)
	if err != nil {
		return err
	}
	if err := topic.ValidateName(topicName, b.limits); err != nil {
		return err
	}
	m := &Message{ID: b.ids.next(), Topic: sc.Topic(topicName), Payload: payload, QoS: qos, Retain: retain, Created: time.Now().UnixNano()}
	if retain {
		if err := b.retain(m); err != nil && qos > 0 {
			return err
		}
	}
	return b.route(m)
}

var targetPool = sync.Pool{New: func() any { s := make([]target, 0, 16); return &s }}

// route delivers m to every matching session. It returns once every
// recipient has taken the message (queued it, and for a persistent session
// stored it), which for a full queue means after the publisher has been held
// back. An error means some recipient could not take it: the publisher must
// not be acknowledged.
func (b *Broker) route(m *Message) error {
	wait, err := b.routeAsync(m)
	if err != nil {
		wait, err = b.routeAgainNow(nil, m, err)
	}
	if err == nil && wait != nil {
		if err = b.retrying(nil, m, wait)(); err != nil {
			b.m.dropped.WithLabelValues("forward_failed").Inc()
		}
	}
	return err
}

// routeAsync delivers m to this edge's subscribers and hands it to the
// other edges; the returned wait, nil when there is nothing to wait for,
// blocks until the other edges took it.
func (b *Broker) routeAsync(m *Message) (wait func() error, err error) {
	wait, err = b.deliver(b.stopped, m, nil)
	b.offer(m)
	return wait, err
}

// routeAtOnce is routeAsync for a message whose routes are held: with
// ErrNeedsLookup, it did nothing.
func (b *Broker) routeAtOnce(m *Message) (wait func() error, err error) {
	wait, err = b.deliver(b.atOnce, m, nil)
	if !errors.Is(err, ErrNeedsLookup) {
		b.offer(m)
	}
	return wait, err
}

// offer hands m to the output service.
func (b *Broker) offer(m *Message) {
	if m.span != nil {
		b.offerTraced(m)
	} else if !b.cluster.Output.Offer(m) {
		b.m.dropped.WithLabelValues("output_queue_full").Inc()
	}
}

// deliver is routeAsync without the output; again is set when m is routed
// again ([Again]). ctx is b.stopped, or b.atOnce.
func (b *Broker) deliver(ctx context.Context, m *Message, again *Again) (wait func() error, err error) {
	var local SharedChoice
	if b.cluster.Peers != nil {
		// Forwarding first: it decides which edge serves each shared group.
		w, choice, ferr := b.cluster.Peers.Forward(ctx, m, again)
		if ferr != nil {
			if errors.Is(ferr, ErrNeedsLookup) {
				return nil, ferr
			}
			if again == nil {
				b.m.dropped.WithLabelValues("forward_failed").Inc()
			}
			return nil, ferr
		}
		wait, local = w, choice
	}
	_, err = b.deliverLocal(m, local, nil)
	return wait, err
}

// clockSkew is how far apart the clocks of two edges may be: a message
// routed again goes to the sessions that became routable on any edge since
// its first routing less this, so a session that moved just after it is
// not skipped for a clock behind the publishing edge's. It costs a QoS 1
// duplicate to a session that moved in the second before.
const clockSkew = 2 * time.Second

// retrying wraps the wait of a QoS 1/2 message's first routing: when edges
// it was forwarded to left the cluster before taking it, it is routed again
// (DESIGN: PUBLISH, re-resolve and retry until a live target takes it). The
// left edges' routes outlive them until their sessions are adopted, so a
// route that still names one fails again, and the message goes on once the
// routes name the sessions' new edges. Every edge with a match gets it
// again, for the sessions that became routable there since ([Again]): those
// are the ones that can have missed it. cl is the publisher (nil for the
// broker's own messages).
func (b *Broker) retrying(cl *mqtt.Client, m *Message, wait func() error) func() error {
	if wait == nil || m.QoS == 0 || b.cfg.ForwardBound <= 0 {
		return wait
	}
	return func() error {
		err := wait()
		var nt *NotTaken
		if !errors.As(err, &nt) {
			return err
		}
		again := &Again{Since: m.Created - int64(clockSkew), Groups: nt.Groups}
		return b.reroute(cl, m, err, b.cfg.ForwardBound, func() error {
			w, err := b.deliver(b.stopped, m, again)
			if err == nil && w != nil {
				err = w()
			}
			if errors.As(err, &nt) {
				// What the edges that left this time owed is owed still.
				again.Groups = nt.Groups
			}
			return err
		})
	}
}

// routeAgainNow routes a message whose routes named an edge that left the
// cluster (they outlive it until its sessions are adopted) again, until
// it is handed to every edge with a match, within the resolve bound (or
// the forward bound, if longer).
// Nothing was delivered yet: it runs before the publisher's next message
// on its topic is routed, which must not overtake it, and routed later it
// is routed as if published then. So the publisher keeps its connection
// while the routes catch up, instead of being closed and sending its whole
// window again, over and over, until they do. cl is the publisher (nil for
// the broker's own messages).
func (b *Broker) routeAgainNow(cl *mqtt.Client, m *Message, err error) (wait func() error, _ error) {
	bound := max(b.cfg.ResolveBound, b.cfg.ForwardBound)
	if m.QoS == 0 || bound <= 0 || !errors.Is(err, ErrEdgeLeft) {
		return nil, err
	}
	err = b.reroute(cl, m, err, bound, func() error {
		var err error
		wait, err = b.deliver(b.stopped, m, nil)
		return err
	})
	return wait, err
}

// reroute runs attempt, with backoff, until it succeeds, fails otherwise
// than by an edge that left or by routes not settled enough to give an
// owed group a member ([ErrRoutesUnsettled]), or the forward bound since
// m's ingress passes; err is the failure that started it. It gives up
// when the publisher's connection closes: the message is not acknowledged
// then, and routed later it would follow what the publisher sent since,
// out of order.
//
// The first attempt goes at once: a publisher's failed messages are routed
// again one after the other, in its order, and each but the first failed
// long ago, most often while the one before it waited for the routes.
func (b *Broker) reroute(cl *mqtt.Client, m *Message, err error, bound time.Duration, attempt func() error) error {
	deadline := time.Unix(0, m.Created).Add(bound)
	closed := func() bool { return cl != nil && cl.Closed() }
	for backoff := time.Duration(0); ; backoff = min(max(2*backoff, 50*time.Millisecond), time.Second) {
		if b.stopping.Load() || b.fenced.Load() || closed() || !time.Now().Add(backoff).Before(deadline) {
			b.m.forwardRetries.WithLabelValues("gave_up").Inc()
			return err
		}
		if backoff > 0 {
			select {
			case <-b.stopped.Done():
				b.m.forwardRetries.WithLabelValues("gave_up").Inc()
				return err
			case <-time.After(backoff):
			}
			if closed() {
				b.m.forwardRetries.WithLabelValues("gave_up").Inc()
				return err
			}
		}
		b.m.forwardRetries.WithLabelValues("attempt").Inc()
		if err = attempt(); err == nil {
			b.m.forwardRetries.WithLabelValues("taken").Inc()
			return nil
		}
		if !errors.Is(err, ErrEdgeLeft) && !errors.Is(err, ErrRoutesUnsettled) {
			b.m.forwardRetries.WithLabelValues("gave_up").Inc()
			return err
		}
	}
}

// servesGroup turns a choice of shared groups into the index's filter.
func (b *Broker) servesGroup(m *Message, shared SharedChoice) func(*shareGroup) bool {
	if !shared.Chosen {
		return nil
	}
	if len(shared.Groups) == 0 {
		return func(*shareGroup) bool { return false }
	}
	tenant, _, ok := tenancy.TenantOfTopic(m.Topic)
	if !ok {
		return nil
	}
	sc, err := b.scope(tenant)
	if err != nil {
		return nil
	}
	keys := make([]GroupKey, len(shared.Groups))
	for i, g := range shared.Groups {
		inner, _ := sc.Filter(g.Filter)
		keys[i] = GroupKey{Name: g.Name, Filter: inner}
	}
	return func(g *shareGroup) bool {
		for _, k := range keys {
			if k.Name == g.name && k.Filter == g.filter {
				return true
			}
		}
		return false
	}
}

// deliverLocal hands m to this edge's own subscribers. served is the
// shared groups it gave a member as that group's delivery, collected when
// their origin hears of it or when check is set. check, when set, is given
// every group served here (also one whose member got m merged into its
// delivery for another group: it serves both) once the recipients are
// known and before any of them gets m; its error is returned, and then
// nobody here got m (a forwarded message whose relays cannot be made is
// refused before it is delivered: sent again, it reaches each recipient
// once).
//
// A group served through a merged delivery is left out of served: its
// origin, which keeps a QoS 1 message per group, hears of it as for a
// group with no member here (reportUnserved) and re-dispatches it, since
// nothing here follows that group's copy to its member's PUBACK.
//
// A message sent again after it failed here goes to the members of shared
// groups that took it before (sharedPicks): a group whose member took it at
// QoS 2 and is gone since is served, by nobody.
func (b *Broker) deliverLocal(m *Message, shared SharedChoice, check func(served []*shareGroup) error) (served []*shareGroup, failed error) {
	tp := targetPool.Get().(*[]target)
	serve := b.servesGroup(m, shared)
	var again []groupPick
	if m.QoS > 0 {
		again = b.pickedBefore(m.ID)
	}
	targets := b.index.match(m.Topic, (*tp)[:0], serve, shared.Only, again)
	defer func() {
		clear(targets)
		*tp = targets[:0]
		targetPool.Put(tp)
	}()
	committed := b.committedGroups(again, serve, targets)
	if check != nil || shared.Origin != nil {
		merged := 0
		served = append(served, committed...)
		for i := range targets {
			if t := &targets[i]; t.group != nil && !skipLocal(m, shared, t) {
				served = append(served, t.group)
				merged += len(t.more)
			}
		}
		if check != nil {
			all := served
			if merged > 0 {
				all = slices.Clip(served)
				for i := range targets {
					if t := &targets[i]; t.group != nil && !skipLocal(m, shared, t) {
						all = append(all, t.more...)
					}
				}
			}
			if err := check(all); err != nil {
				return nil, err
			}
		}
	}
	for i := range targets {
		t := &targets[i]
		if skipLocal(m, shared, t) {
			continue
		}
		d := delivery{msg: m, qos: min(m.QoS, t.qos), retain: m.Retain && t.rap, ids: t.ids, group: t.group}
		var taken bool
		if t.group != nil && shared.Origin != nil {
			var err error
			if taken, err = b.takeReported(t.sess, d, shared.Origin, true); err != nil {
				failed = err
			}
		} else {
			r := t.sess.enqueue(d)
			if err := b.counted(r); err != nil {
				failed = err
			}
			taken = r == enqueued
			if !taken && t.group != nil && d.qos > 0 && (r == droppedOffline || r == slowConsumer) {
				if err := b.takeElsewhere(m, t); err != nil {
					failed = err
				}
			}
		}
		if taken && t.group != nil && d.qos > 0 {
			m.picks = appendPicks(m.picks, t, d.qos)
		}
	}
	return served, failed
}

// takeElsewhere gives QoS 1/2 message m, which t's session did not take
// for its shared groups (t.group and those merged into its delivery)
// because its connection is closing (a slow consumer being disconnected)
// or its session ended after it was picked, to another member of each of
// those groups here: a connected one, else a persistent one's queue. It
// never reached t's session, so nothing is re-dispatched when that ends:
// dropped, m would be acknowledged to its publisher with no member of the
// group having it. errNoMemberTook when some group's other members did not
// take it either: m is not taken, and its publisher (or sender) sends it
// again.
func (b *Broker) takeElsewhere(m *Message, t *target) error {
	var failed error
	for _, g := range append([]*shareGroup{t.group}, t.more...) {
		took, err := b.giveToOther(m, g, t.sess)
		if err != nil {
			failed = err
		} else if !took && failed == nil {
			failed = errNoMemberTook
		}
	}
	return failed
}

// giveToOther enqueues m for a member of group g here other than except's,
// a connected one first, else a persistent one, and reports whether one
// took it; an error of a member's queue fails m.
func (b *Broker) giveToOther(m *Message, g *shareGroup, except *session) (bool, error) {
	tried := []*session{except}
	for _, online := range []bool{true, false} {
		for {
			sub := b.index.pickNotIn(g.name, g.filter, tried, online)
			if sub == nil {
				break
			}
			tried = append(tried, sub.sess)
			d := delivery{msg: m, qos: min(m.QoS, sub.qos), ids: sub.ids, group: sub.group}
			r := sub.sess.enqueue(d)
			if err := b.counted(r); err != nil {
				return false, err
			}
			if r == enqueued {
				b.m.sharedRedispatch.WithLabelValues("local").Inc()
				if d.qos > 0 {
					m.picks = append(m.picks, groupPick{name: g.name, filter: g.filter, session: sub.sess.id, qos: d.qos})
				}
				return true, nil
			}
		}
	}
	return false, nil
}

// errNoMemberTook fails a group message that the member picked for it did
// not take (its connection was closing) and no other member here took.
var errNoMemberTook = errors.New("shared group message taken by no member: the member picked was going")

// committedGroups returns the groups served here (serve) whose member
// took m at QoS 2 before (again) and is gone since: m is that member's
// alone, and they count as served, by nobody ([MQTT-4.8.2-5]).
func (b *Broker) committedGroups(again []groupPick, serve func(*shareGroup) bool, targets []target) []*shareGroup {
	var out []*shareGroup
	for _, p := range again {
		if p.qos < 2 {
			continue
		}
		g := &shareGroup{name: p.name, filter: p.filter}
		if serve != nil && !serve(g) || slices.ContainsFunc(targets, func(t target) bool { return t.serves(g) }) {
			continue
		}
		b.m.sharedRedispatch.WithLabelValues("qos2_dropped").Inc()
		out = append(out, g)
	}
	return out
}

// serves reports whether t is the delivery of group g (its member picked
// for it, or merged into it).
func (t *target) serves(g *shareGroup) bool {
	same := func(x *shareGroup) bool { return x.name == g.name && x.filter == g.filter }
	return t.group != nil && same(t.group) || slices.ContainsFunc(t.more, same)
}

// appendPicks records, in ps, that t's session took m at qos for its
// shared group and for the ones merged into its delivery.
func appendPicks(ps []groupPick, t *target, qos byte) []groupPick {
	ps = append(ps, groupPick{name: t.group.name, filter: t.group.filter, session: t.sess.id, qos: qos})
	for _, g := range t.more {
		ps = append(ps, groupPick{name: g.name, filter: g.filter, session: t.sess.id, qos: qos})
	}
	return ps
}

// skipLocal reports whether recipient t does not get m after all.
func skipLocal(m *Message, shared SharedChoice, t *target) bool {
	if t.noLocal && !t.shared && t.sess.id == m.Origin {
		return true // [MQTT-3.8.3-3]
	}
	// Routed again: it had the message.
	return shared.Since != 0 && t.group == nil && t.sess.routable.Load() < shared.Since
}

// counted counts a delivery that did not go into a session's queue, by
// why, and returns errStoreFailed when the message is not taken.
func (b *Broker) counted(r enqueueResult) error {
	switch r {
	case storeFailed:
		b.m.dropped.WithLabelValues("store_failed").Inc()
		return errStoreFailed
	case revoked:
		b.m.dropped.WithLabelValues("behind_failed_write").Inc()
		return errStoreFailed
	case droppedQoS0:
		b.m.dropped.WithLabelValues("qos0_queue_full").Inc()
	case droppedOffline:
		b.m.dropped.WithLabelValues("session_gone").Inc()
	case droppedOverflow:
		b.m.dropped.WithLabelValues("offline_queue_full").Inc()
	case droppedQuota:
		b.m.dropped.WithLabelValues("tenant_queue_quota").Inc()
	case slowConsumer:
		b.m.dropped.WithLabelValues("slow_consumer").Inc()
		b.m.slowConsumers.Inc()
	}
	return nil
}

var (
	errStoreFailed = errors.New("durable store failed; message not taken")
	// errRevoked: stored, but taken back because the write of an earlier
	// message of the same publisher failed (settleQueued).
	errRevoked = errors.New("queued behind a message whose write failed; not taken")
	errFenced  = errors.New("edge lease lapsed; acknowledging nothing")
)

func (b *Broker) retain(m *Message) error {
	if b.cfg.RetainDisabled {
		return nil
	}
	b.retained.set(m)
	if b.store == nil {
		return nil
	}
	// Pending until the store answers; a write the store failed is not
	// retained either, but for this edge's subscribers while the store
	// cannot answer their lookups (matchRetained).
	b.retainedWrites.start(m)
	defer b.retainedWrites.done(m)
	ctx, cancel := context.WithTimeout(context.Background(), storeTimeout)
	defer cancel()
	span := childSpan(m, "persist", attrStore.String("retained"))
	if span != nil {
		ctx = trace.ContextWithSpan(ctx, span)
	}
	err := b.store.PutRetained(ctx, m.record(), m.QoS > 0)
	finishSpan(span, err)
	if err != nil {
		b.m.retainedNotStored.Inc()
		b.logger.Error("retained message not stored", "topic", m.Topic, "qos", m.QoS, "error", err)
		return fmt.Errorf("retained message not stored: %w", err)
	}
	return nil
}

// encodeDelivery appends the PUBLISH for d to buf, registering QoS 1/2
// messages in the client's in-flight store first.
// sent is false when the delivery was dropped instead (expired, too large).
func (b *Broker) encodeDelivery(buf []byte, cl *mqtt.Client, s *session, d *delivery, version byte,
	maxPacket uint32, aliases *mqtt.OutboundTopicAliases, now int64) (out []byte, packetID uint16, sent bool) {
	expiry, expired := d.msg.remainingExpiry(now)
	if expired {
		b.m.dropped.WithLabelValues("expired").Inc()
		if d.qos > 0 {
			s.acked()
		}
		return buf, 0, false
	}
	ext, ok := s.scope.ExternalTopic(d.msg.Topic)
	if !ok {
		// Cannot happen: the index only holds the session's own tenant.
		b.m.dropped.WithLabelValues("tenant_mismatch").Inc()
		if d.qos > 0 {
			s.acked()
		}
		return buf, 0, false
	}
	p := outPublish{topic: ext, qos: d.qos, retain: d.retain, expiry: expiry, msg: d.msg}
	if version == 5 {
		p.subIDs = d.ids
	}
	if maxPacket > 0 && uint32(publishSize(&p, version)) > maxPacket {
		// [MQTT-3.1.2-25]: discard as if sent.
		b.m.dropped.WithLabelValues("packet_too_large").Inc()
		if d.qos > 0 {
			s.acked()
		}
		return buf, 0, false
	}
	if version == 5 && aliases != nil && cl.Properties.Props.TopicAliasMaximum > 0 {
		if alias, known := aliases.Set(d.msg.Topic); alias > 0 {
			p.alias = alias
			if known {
				p.topic = ""
			}
		}
	}
	if d.qos > 0 {
		id, ok := nextOutboundID(cl, s)
		if !ok {
			b.m.dropped.WithLabelValues("packet_ids_exhausted").Inc()
			s.acked()
			return buf, 0, false
		}
		p.packetID = id
		s.sent++
		if d.group != nil && d.qos == 1 {
			s.sentShared(id, d)
		}
		if cl.State.Inflight.Set(inflightPacket(d, id, d.retain, s.sent)) {
			atomic.AddInt64(&b.server.Info.Inflight, 1)
		}
	}
	start := len(buf)
	buf = appendPublish(buf, &p, version)
	b.mOut[d.qos].Inc()
	b.bOut[d.qos].Add(float64(len(buf) - start))
	return buf, p.packetID, true
}

// nextOutboundID picks a packet ID free among the edge's deliveries to the
// client, counting down from 65535 (the client's own flows are kept apart
// in mochi's in-flight map, whatever IDs it picks). Only the session's
// writer calls it.
func nextOutboundID(cl *mqtt.Client, s *session) (uint16, bool) {
	for range 65535 {
		s.nextID--
		if s.nextID == 0 {
			s.nextID = 65535
		}
		if _, used := cl.State.Inflight.Type(s.nextID); !used {
			return s.nextID, true
		}
	}
	return 0, false
}

func (b *Broker) writeRaw(s *session, cl *mqtt.Client, buf []byte) error {
	cl.Lock()
	defer cl.Unlock()
	return b.writeRawLocked(s, cl, buf)
}

// writeRawLocked is writeRaw with cl's lock held.
func (b *Broker) writeRawLocked(s *session, cl *mqtt.Client, buf []byte) error {
	if cl.Closed() {
		return mqtt.ErrConnectionClosed
	}
	s.mu.Lock()
	slow := s.slow
	s.mu.Unlock()
	if b.cfg.WriteTimeout > 0 && !slow {
		_ = cl.Net.Conn.SetWriteDeadline(time.Now().Add(b.cfg.WriteTimeout))
	}
	_, err := cl.Net.Conn.Write(buf)
	if err != nil {
		cl.Stop(err)
	}
	return err
}

// disconnectSlow disconnects a non-persistent client whose queue stayed full
// past the grace period, with reason 0x97.
// The DISCONNECT gets a second to go out through a socket the client may not
// be reading; then the connection is closed regardless.
func (b *Broker) disconnectSlow(s *session, cl *mqtt.Client) {
	if cl == nil {
		return
	}
	s.mu.Lock()
	already := s.slow
	s.slow = true
	s.mu.Unlock()
	if already {
		return
	}
	b.logger.Warn("slow consumer disconnected", "client_id", cl.ID, "reason", "queue full past grace")
	_ = cl.Net.Conn.SetWriteDeadline(time.Now().Add(time.Second))
	go func() { _ = b.disconnect(cl, packets.ErrQuotaExceeded) }()
	time.AfterFunc(2*time.Second, func() { cl.Stop(packets.ErrQuotaExceeded) })
}

// endSession removes a session that ended: its subscriptions leave the index
// and its queue is dropped.
func (b *Broker) endSession(id string, cl *mqtt.Client) {
	b.endSessionRoutes(context.Background(), id, endWhich{cl: cl})
}

// endWhich says which copy of a session endSessionRoutes ends, and how.
type endWhich struct {
	// cl, when set, spares a copy that a newer connection took on.
	cl *mqtt.Client
	// only, when set, is the copy to end: a newer one that replaced it
	// meanwhile stays.
	only *session
	// replaced: a newer copy of the same or a later claim is being put in
	// its place, which activated (or activates) its epoch in the store; the
	// ending copy's epoch, which can be the same, is not deactivated.
	replaced bool
	// routesGone, when set, is closed once the router removed the copy's
	// routes (at once if no copy ends): the removals go on in the
	// background (until the edge stops) past the wait for them.
	routesGone chan struct{}
	// upTo, when set, is the epoch of the claim of the connection whose
	// end ends the session: a copy a newer claim took on (takeOver raised
	// its epoch) is that claim's to end, not this connection's.
	upTo uint64
	// forCustody: the copy ends with the edge's stop, but the session's
	// stored record, which holds a will the stop kept from going out, and
	// this edge's claim on it stay, as if the edge had died: the
	// custodian that adopts the session publishes the will and ends it.
	forCustody bool
}

// goneNow closes w.routesGone, if set, for a copy that ends nothing.
func (w endWhich) goneNow() {
	if w.routesGone != nil {
		close(w.routesGone)
	}
}

// endSessionRoutes is endSession that waits for the router to remove the
// session's routes only until routes ends: the route client drops them from
// the set it registers at once, and removes them at the router as soon as
// its stream allows.
func (b *Broker) endSessionRoutes(routes context.Context, id string, which endWhich) {
	b.sessMu.Lock()
	s := b.sessions[id]
	if s == nil || (which.only != nil && s != which.only) {
		b.sessMu.Unlock()
		which.goneNow()
		return
	}
	s.mu.Lock()
	if cl := which.cl; cl != nil && s.client != nil && s.client != cl || which.upTo != 0 && s.epoch > which.upTo {
		s.mu.Unlock()
		b.sessMu.Unlock()
		which.goneNow()
		return // a new connection owns it now
	}
	delete(b.sessions, id)
	wasStored := s.durable || s.record != nil
	s.record = nil
	// A session handed to another edge lives on in a shared store: the new
	// owner reads it there.
	// A copy handed over, or forgotten for another (forgetSession), is not
	// the end of the session: it goes on elsewhere or in a copy that
	// replaces this one, and the claim it was taken under is not this
	// copy's to give back (a copy resumed under the same claim holds it).
	goesOn := s.moving != nil && s.moving.done
	handedOver := goesOn && b.store != nil && b.store.Shared()
	epoch := s.epoch
	s.closed = true
	s.client = nil
	s.online.Store(false)
	subs := s.subs
	s.subs = map[string]*subscription{}
	s.nsubs.Store(0)
	// A session that moves to another edge takes its group messages along.
	var orphans []delivery
	queuedOrphans := 0
	orphans, queuedOrphans = s.orphanedShared(s.moving != nil)
	dropped := s.queue.len() - queuedOrphans
	s.queue = ring{}
	s.queueBytes = 0
	s.wakeLocked()
	s.mu.Unlock()
	b.sessMu.Unlock()
	for _, sub := range subs {
		b.index.remove(sub)
	}
	// The session's routes go with it, or other edges keep forwarding to
	// this one for subscribers that are gone. One whose Add is still out
	// goes when it returns.
	removeRoutes := func(ctx context.Context) {
		for _, sub := range subs {
			if err := s.dropRoute(ctx, sub); err != nil && ctx.Err() == nil {
				b.logger.Warn("route not removed", "client_id", id, "error", err)
			}
		}
	}
	if gone := which.routesGone; gone != nil {
		b.releases.Add(1)
		go func() {
			defer b.releases.Done()
			defer close(gone)
			removeRoutes(b.stopped)
		}()
		select {
		case <-gone:
		case <-routes.Done():
		}
	} else {
		removeRoutes(routes)
	}
	if dropped > 0 {
		b.m.dropped.WithLabelValues("session_end").Add(float64(dropped))
	}
	// After the session's subscriptions left the index, so that none of
	// its group messages comes back to it.
	b.redispatchAll(s, orphans, ShareMemberGone)
	if b.store != nil && wasStored && !handedOver && !which.forCustody {
		_ = b.store.DeleteSession(context.Background(), id, false)
	}
	if b.store != nil && !which.replaced {
		b.store.Deactivate(id, epoch)
	}
	b.logger.Debug("session copy ended", "client_id", id, "epoch", epoch, "goes_on", goesOn, "replaced", which.replaced,
		"for_custody", which.forCustody)
	if _, local := b.cluster.Ownership.(*localOwnership); local {
		return // one edge: nothing holds the claim but this edge
	}
	if external, ok := s.scope.ExternalClientID(id); ok && epoch != 0 && !goesOn && !which.forCustody {
		// The session ended here, so no edge owns it. The release carries
		// the epoch of this edge's claim: if the client has meanwhile
		// connected elsewhere, the newer claim stands and this is refused.
		b.releases.Add(1)
		go func() {
			defer b.releases.Done()
			ctx, cancel := context.WithTimeout(b.stopped, b.cfg.ConnectTimeout)
			defer cancel()
			if err := b.cluster.Ownership.Release(ctx, s.scope.Tenant(), external, epoch); err != nil {
				b.logger.Debug("session release refused", "client_id", id, "error", err)
			} else {
				b.logger.Debug("session released", "client_id", id, "epoch", epoch)
			}
		}()
	}
}

// disconnect closes cl's connection for the server's reason code: an MQTT
// 5 client is told the code in a DISCONNECT first; an MQTT 3.1.1 or 3.1
// connection is only closed, since DISCONNECT goes from client to server
// alone in those versions. Either way its disconnect is handled as one the
// server caused (the will goes out).
func (b *Broker) disconnect(cl *mqtt.Client, code packets.Code) error {
	if cl.Properties.ProtocolVersion == 5 {
		return b.server.DisconnectClient(cl, code) // its write takes the held acknowledgements first
	}
	flushHeldOf(cl)
	cl.Stop(code)
	return code
}

// guardedListener closes connections that do not send CONNECT in time
// (mochi sets no read deadline before CONNECT arrives), and contains a panic
// in one connection's goroutine to that connection: mochi v2.7.9's packet
// decoders indexed past the end of some malformed packets (found by
// FuzzBroker_PacketPath: SUBSCRIBE 82 05 00 01 00 00 00, since fixed in
// third_party/mochi), and an unrecovered panic there, from a decoder or a
// hook, would take every client of the edge down with it.
type guardedListener struct {
	listeners.Listener
	timeout time.Duration
	b       *Broker
}

func (l *guardedListener) Serve(establish listeners.EstablishFn) {
	l.Listener.Serve(func(id string, c net.Conn) (err error) {
		growStackForConnect()
		l.b.handlers.Add(1)
		defer l.b.handlers.Add(-1)
		kc := &keepaliveConn{Conn: c}
		defer func() {
			if r := recover(); r != nil {
				err = l.b.handlerPanicked(kc, nil, r)
			}
		}()
		if l.timeout > 0 {
			_ = c.SetReadDeadline(time.Now().Add(l.timeout))
		}
		err = establish(id, kc)
		var code packets.Code
		if err != nil && !kc.connectRead.Load() && errors.As(err, &code) {
			// A first packet mochi could not decode as a CONNECT (malformed,
			// or not a CONNECT): refused before any hook saw it.
			l.b.m.packetErrors.WithLabelValues("unreadable_connect").Inc()
			l.b.m.connects.WithLabelValues("invalid_connect").Inc()
			l.b.logger.Info("connect refused", "reason", "unreadable CONNECT", "remote", c.RemoteAddr().String(), "error", err)
		}
		return err
	})
}

// serveDetached runs a connected client's read loop (mochi's serve) on a
// goroutine of its own, counted and guarded like the connection's first
// goroutine, which is still counted while this is called.
func (b *Broker) serveDetached(cl *mqtt.Client, serve func() error) {
	b.handlers.Add(1)
	go func() {
		growStackForServe()
		defer b.handlers.Add(-1)
		defer func() {
			if r := recover(); r != nil {
				_ = b.handlerPanicked(cl.Net.Conn, cl, r)
			}
		}()
		if err := serve(); err != nil {
			b.logger.Debug("client connection ended", "client_id", cl.ID, "error", err)
		}
	}()
}

// handlerPanicked contains a panic in the goroutine serving the connection
// c (of client cl, nil if not known yet): it closes the connection, counts
// and logs it, and runs the disconnect path mochi did not get to.
func (b *Broker) handlerPanicked(c net.Conn, cl *mqtt.Client, r any) error {
	_ = c.Close()
	b.m.packetErrors.WithLabelValues("decoder_panic").Inc()
	b.logger.Error("connection handler panicked; connection closed", "remote", c.RemoteAddr().String(), "panic", r)
	err := fmt.Errorf("%w: %v", errHandlerPanic, r)
	if cl == nil {
		b.conns.Range(func(k, _ any) bool {
			if found := k.(*mqtt.Client); found.Net.Conn == c {
				cl = found
				return false
			}
			return true
		})
	}
	if cl != nil {
		b.forgetClient(cl, err)
	}
	return err
}

var errHandlerPanic = errors.New("connection handler panicked")

// keepaliveConn corrects mochi's keep-alive deadline. mochi allows
// keepalive + keepalive/2 whole seconds, so a 1 s keep-alive gets 1 s instead
// of the 1.5 s the spec requires ([MQTT-3.1.2-22]). Once the edge knows the
// keep-alive, every deadline mochi sets is replaced by 1.5 × keep-alive.
//
// mochi sets the deadline again after every packet it reads, which costs a
// clock read and two timer updates per PUBLISH. The deadline is set a little
// long instead (by slack: a twentieth of the keep-alive, at most 250 ms) and
// left alone while it still covers 1.5 × keep-alive from now, so a busy
// connection moves it a few times a second; an idle one is closed at most
// slack late.
type keepaliveConn struct {
	net.Conn
	keepalive atomic.Int64 // whole seconds; 0 until CONNECT is accepted
	deadline  atomic.Int64 // unix nanoseconds of the deadline last set; 0 none
	// connectRead: mochi decoded the connection's CONNECT (OnPacketRead saw
	// it). A connection refused before that sent one mochi could not read.
	connectRead atomic.Bool
	held        heldAcks
}

// Read writes the held acknowledgements first: the reader is about to wait
// for the network, and the client may be waiting for them.
func (c *keepaliveConn) Read(p []byte) (int, error) {
	c.flushHeld()
	return c.Conn.Read(p)
}

// Write writes the held acknowledgements first, with p. Every writer to a
// client holds its lock.
func (c *keepaliveConn) Write(p []byte) (int, error) {
	if c.held.n.Load() == 0 {
		return c.Conn.Write(p)
	}
	return c.writeHeldLocked(p)
}

// setKeepalive records the keep-alive (whole seconds) the client got.
func (c *keepaliveConn) setKeepalive(seconds uint16) { c.keepalive.Store(int64(seconds)) }

func (c *keepaliveConn) SetDeadline(t time.Time) error {
	secs := c.keepalive.Load()
	if secs <= 0 || t.IsZero() {
		c.deadline.Store(0)
		return c.Conn.SetDeadline(t)
	}
	ka := time.Duration(secs) * time.Second
	mochiAllows := time.Duration(secs+secs/2) * time.Second // whole seconds after the time it read
	want := t.Add(ka + ka/2 - mochiAllows)
	if want.UnixNano() <= c.deadline.Load() {
		return nil
	}
	at := want.Add(min(ka/20, 250*time.Millisecond))
	c.deadline.Store(at.UnixNano())
	return c.Conn.SetDeadline(at)
}

// SetWriteDeadline sets the write deadline alone: the next SetDeadline sets
// both again.
func (c *keepaliveConn) SetWriteDeadline(t time.Time) error {
	c.deadline.Store(0)
	return c.Conn.SetWriteDeadline(t)
}

// SetReadDeadline sets the read deadline alone: the next SetDeadline sets
// both again.
func (c *keepaliveConn) SetReadDeadline(t time.Time) error {
	c.deadline.Store(0)
	return c.Conn.SetReadDeadline(t)
}

// NetConn returns the wrapped connection (for TLS state).
func (c *keepaliveConn) NetConn() net.Conn { return c.Conn }

// forgetClient runs the disconnect path for cl after its handler died
// without mochi running it.
func (b *Broker) forgetClient(cl *mqtt.Client, cause error) {
	cl.Stop(cause)
	expire := (cl.Properties.ProtocolVersion == 5 && cl.Properties.Props.SessionExpiryInterval == 0) ||
		(cl.Properties.ProtocolVersion < 5 && cl.Properties.Clean)
	(&hook{b: b}).OnDisconnect(cl, cause, expire)
	if expire {
		if cur, ok := b.server.Clients.Get(cl.ID); ok && cur == cl {
			b.server.UnsubscribeClient(cl)
			b.server.Clients.Delete(cl.ID)
		}
	}
}

func tlsState(c net.Conn) *tls.ConnectionState {
	if kc, ok := c.(*keepaliveConn); ok {
		c = kc.Conn
	}
	if tc, ok := c.(*tls.Conn); ok {
		st := tc.ConnectionState()
		return &st
	}
	return nil
}

func authCode(err error) packets.Code {
	switch {
	case errors.Is(err, auth.ErrNotAuthorized):
		return packets.ErrNotAuthorized
	case errors.Is(err, auth.ErrUnavailable):
		return packets.ErrServerUnavailable
	}
	return packets.ErrBadUsernameOrPassword
}

var parseShare = topic.ParseShare
