// Package forward carries messages between edges: one long-lived Connect
// stream per ordered pair of edges, batched frames, cumulative acks once the
// receiving edge has taken every message of a frame, and resends after a
// reconnect that the receiver recognises by frame sequence.
package forward

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/libs/tracing"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"
	"github.com/keelmq/keel/proto/gen/keel/edge/v1/edgev1connect"
	"github.com/keelmq/keel/services/edge/internal/broker"
)

// Deliverer takes forwarded messages into the local edge. It returns once
// every local recipient has taken the message (queued it, or stored it for a
// persistent session), or an error when one could not.
//
// ctx carries the deliver span of a message whose trace is sampled (the
// sender's forward span is its parent); otherwise no span.
type Deliverer interface {
	DeliverForwarded(ctx context.Context, m *commonv1.Message, shared broker.SharedChoice) error
	// DeliverRelayed delivers m to the given sessions of this edge alone.
	DeliverRelayed(ctx context.Context, m *commonv1.Message, to []broker.RelayTarget) error
	// RedispatchShared gives a QoS 1 group message to another member of
	// group, on any edge but notEdge: its member, or the edge it was on,
	// went before acknowledging it.
	RedispatchShared(m *commonv1.Message, group broker.GroupKey, notEdge string)
}

// relayTargets reads the sessions a relayed message is for.
func relayTargets(fm *edgev1.ForwardMessage) []broker.RelayTarget {
	out := make([]broker.RelayTarget, 0, len(fm.GetSessions()))
	for _, st := range fm.GetSessions() {
		t := broker.RelayTarget{Tenant: st.GetSession().GetTenant(), ClientID: st.GetSession().GetClientId(), Epoch: st.GetEpoch(),
			QoS: byte(min(st.GetQos(), 2)), Retain: st.GetRetain()}
		for _, id := range st.GetSubscriptionIdentifiers() {
			t.SubIDs = append(t.SubIDs, int(id))
		}
		out = append(out, t)
	}
	return out
}

// sharedChoice reads which shared groups the sender chose this edge for,
// and whether it keeps the message until it hears the outcome.
func sharedChoice(fm *edgev1.ForwardMessage, from peerKey) broker.SharedChoice {
	c := broker.SharedChoice{Chosen: fm.GetSharedChosen() || fm.GetSharedOnly(), Only: fm.GetSharedOnly(),
		Since: fm.GetSessionsSinceUnixNano()}
	for _, t := range fm.GetShared() {
		c.Groups = append(c.Groups, broker.GroupKey{Name: t.GetGroup(), Filter: t.GetFilter()})
		if t.GetReport() {
			c.Origin = &broker.ShareOrigin{Edge: from.edge, Incarnation: from.incarnation}
		}
	}
	return c
}

// ErrPeerGone means a frame could not be handed to the peer within the
// bound: the publisher must not be acknowledged.
var ErrPeerGone = errors.New("peer edge did not take the message")

// errResend ends a stream whose peer did not take a frame.
var errResend = errors.New("peer did not take a frame; sending again")

// ErrPeerLeft is ErrPeerGone for a peer that left the membership: the
// message can be routed again ([broker.ErrEdgeLeft]).
var ErrPeerLeft = fmt.Errorf("%w: %w", ErrPeerGone, broker.ErrEdgeLeft)

// Server receives forward streams.
type Server struct {
	edgev1connect.UnimplementedEdgeServiceHandler
	Deliver Deliverer
	// Sessions gives sessions up to an edge that claimed them (nil: this
	// edge refuses TakeoverBegin).
	Sessions SessionHandover
	// Custodian adopts sessions of draining edges (nil: refused).
	Custodian Custodian
	// Members, when set, vets callers: a stream or takeover from an edge
	// incarnation that is not live (its lease expired, or it rejoined under
	// a newer one) is refused.
	Members Incarnations
	// Incarnation, when set, is this edge's current incarnation: a stream
	// whose frames were meant for another one (this edge restarted, or
	// rejoined after its lease lapsed) is refused with ErrTargetRestarted.
	Incarnation func() uint64
	Logger      *slog.Logger

	mu  sync.Mutex
	hwm map[peerKey]uint64 // highest frame seq taken per sending incarnation
	// partial holds, per sending incarnation, which messages of each frame
	// at or after a failed one were taken (by index in the frame): those
	// frames come again, and what they had taken is not delivered twice.
	partial  map[peerKey]map[uint64][]bool
	outboxes map[peerKey]*outbox // outcomes of group messages, per sending incarnation
	// flying holds, per sending incarnation, when each frame whose writes
	// are being stored came, oldest first (frames land in the order they
	// came); a new stream from it waits for them (landed) before it takes a
	// frame, so that a frame it resends is known taken or not.
	flying map[peerKey][]time.Time
	landed *sync.Cond // on mu
}

type peerKey struct {
	edge        string
	incarnation uint64
}

// Handler returns the HTTP handler of the edge API.
func (s *Server) Handler() (string, http.Handler) {
	return edgev1connect.NewEdgeServiceHandler(s, HandlerOptions()...)
}

// HandlerOptions are the options of an edge API handler: the product's,
// and decodeForwardRequest for the frames of Forward streams.
func HandlerOptions() []connect.HandlerOption {
	return rpc.HandlerOptions(connect.WithCodec(rpc.ProtoCodec(decodeForwardRequest)))
}

// deliver hands one forwarded message to the local edge, in a deliver span
// that continues the sender's trace when the frame carries one.
func (s *Server) deliver(ctx context.Context, from peerKey, fm *edgev1.ForwardMessage) error {
	if len(fm.GetSessions()) > 0 {
		return s.Deliver.DeliverRelayed(ctx, fm.GetMessage(), relayTargets(fm))
	}
	tp := fm.GetTraceparent()
	if tp == "" || !tracing.Enabled() {
		return s.Deliver.DeliverForwarded(ctx, fm.GetMessage(), sharedChoice(fm, from))
	}
	ctx, span := tracer.Start(tracing.ContextFromTraceparent(ctx, tp), "deliver",
		trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(
			tracing.TenantKey.String(fm.GetMessage().GetTenant()), attrFrom.String(from.edge)))
	err := s.Deliver.DeliverForwarded(ctx, fm.GetMessage(), sharedChoice(fm, from))
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
	return err
}

// framesInFlight bounds the frames of one stream whose writes are stored at
// once. Frames are delivered in order, each message queued as its frame
// arrives; only the waits for the store overlap, so that a persistent
// subscriber's stream is not held to one store round trip per frame.
// Measured with make bench-persistent (50 pairs, 1000 in flight): one at a
// time 5.4k msgs/s, 8 10.4k, 32 12.0-12.2k, 64 12.5k.
const framesInFlight = 32

// landing is a frame delivered and not yet acknowledged.
type landing struct {
	seq    uint64
	wait   func() ([]bool, error) // nil: taken on an earlier stream
	stores bool                   // wait waits for the store
}

// Forward implements edgev1connect.EdgeServiceHandler.
func (s *Server) Forward(ctx context.Context, st *connect.BidiStream[edgev1.ForwardRequest, edgev1.ForwardResponse]) error {
	// Acks go from their own goroutine, in frame order, as each frame's
	// writes are stored; outcomes from another. Both are done before the
	// stream ends.
	ctx, cancel := context.WithCancel(ctx)
	var acks, outcomes sync.WaitGroup
	landings := make(chan landing, framesInFlight)
	var failed atomic.Pointer[error] // set by the acks once a frame was not all taken
	defer func() {
		// The frames delivered land first: their writes go on under ctx.
		close(landings)
		acks.Wait()
		cancel()
		outcomes.Wait()
	}()
	var sendMu sync.Mutex
	send := func(resp *edgev1.ForwardResponse) error {
		sendMu.Lock()
		defer sendMu.Unlock()
		return st.Send(resp)
	}
	var ob *outbox
	var key peerKey
	for {
		req, err := st.Receive()
		if err != nil {
			if errors.Is(err, context.Canceled) || connect.CodeOf(err) == connect.CodeCanceled {
				return nil
			}
			return nil // the sender went away; it resends on its next stream
		}
		if req.GetEdgeId() == "" || req.GetSeq() == 0 {
			return connect.NewError(connect.CodeInvalidArgument, errors.New("frame needs edge_id and seq"))
		}
		if err := s.vetTarget(req); err != nil {
			s.log().Info("forward stream refused", "from", req.GetEdgeId(), "error", err)
			return err
		}
		if ob == nil {
			key = peerKey{req.GetEdgeId(), req.GetIncarnation()}
			if err := s.vet(ctx, req.GetEdgeId(), req.GetIncarnation()); err != nil {
				s.log().Warn("forward stream refused", "from", req.GetEdgeId(), "incarnation", req.GetIncarnation(), "error", err)
				return err
			}
			ob = s.outbox(key)
			gen := ob.takeOutcomes()
			outcomes.Go(func() { s.sendOutcomes(ctx, ob, gen, send) })
			acks.Go(func() { s.ackLandings(key, landings, send, &failed) })
			// What an earlier stream still stores decides which of the
			// frames resent on this one are taken.
			s.waitLanded(key)
		} else if (peerKey{req.GetEdgeId(), req.GetIncarnation()}) != key {
			return connect.NewError(connect.CodeInvalidArgument, errors.New("frames of one stream come from one edge incarnation"))
		}
		if p := failed.Load(); p != nil {
			return connect.NewError(connect.CodeUnavailable, *p)
		}
		if c := req.GetOutcomesConfirmed(); c > 0 {
			ob.confirmed(c)
		}
		s.mu.Lock()
		s.initLocked()
		seen := req.GetSeq() <= s.hwm[key]
		before := s.partial[key][req.GetSeq()]
		if !seen {
			s.flying[key] = append(s.flying[key], time.Now())
		}
		s.mu.Unlock()
		l := landing{seq: req.GetSeq()}
		if !seen {
			wait, stores, err := s.deliverFrame(ctx, key, req, before)
			l.wait, l.stores = wait, stores
			if err != nil {
				// A message was refused before its writes: later ones wait
				// for the resend, in order. The frame lands with what it took.
				landings <- l
				return connect.NewError(connect.CodeUnavailable, err)
			}
		}
		landings <- l
	}
}

func (s *Server) initLocked() {
	if s.hwm == nil {
		s.hwm = map[peerKey]uint64{}
		s.partial = map[peerKey]map[uint64][]bool{}
		s.flying = map[peerKey][]time.Time{}
		s.landed = sync.NewCond(&s.mu)
	}
}

// framesLanding reports whether a frame has been waiting for the store
// longer than slowLanding: the store is slow or failing over, and messages
// queued behind such frames on other edges' links may come here, and be
// relayed, well after a handover.
func (s *Server) framesLanding() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	cutoff := time.Now().Add(-slowLanding)
	for _, q := range s.flying {
		if len(q) > 0 && q[0].Before(cutoff) {
			return true
		}
	}
	return false
}

// slowLanding is how long a frame waits for the store before the store
// counts as slow: a commit takes milliseconds.
const slowLanding = 250 * time.Millisecond

// waitLanded waits until no frame of key is being stored.
func (s *Server) waitLanded(key peerKey) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.initLocked()
	for len(s.flying[key]) > 0 {
		s.landed.Wait()
	}
}

// ackLandings waits for each frame's writes in turn and acknowledges it.
// Once one was not all taken, no later frame is acknowledged: each is
// recorded with what it took, the sender is told to resend (ForwardResponse
// .resend), and the stream takes no more.
//
// Acknowledgements are cumulative, so frames that land together (queued
// here already, and not waiting for the store) get one: a response costs
// both edges a write and a read. What is taken is acknowledged before a
// wait on the store, and at least every ackEvery frames.
func (s *Server) ackLandings(key peerKey, landings <-chan landing, send func(*edgev1.ForwardResponse) error, failed *atomic.Pointer[error]) {
	var failure error
	var owed uint64 // taken, not acknowledged yet
	owedFrames := 0
	ack := func() {
		if owed > 0 && failure == nil {
			if err := send(&edgev1.ForwardResponse{TakenSeq: owed}); err != nil {
				failure = err
				failed.Store(&failure)
			}
		}
		owed, owedFrames = 0, 0
	}
	defer ack()
	for l := range landings {
		if l.stores {
			ack()
		}
		if l.wait != nil {
			taken, err := l.wait()
			s.mu.Lock()
			if err != nil || failure != nil {
				if s.partial[key] == nil {
					s.partial[key] = map[uint64][]bool{}
				}
				s.partial[key][l.seq] = taken
			} else {
				s.hwm[key] = max(s.hwm[key], l.seq)
				delete(s.partial[key], l.seq)
				if len(s.partial[key]) == 0 {
					delete(s.partial, key)
				}
			}
			if q := s.flying[key]; len(q) > 1 {
				s.flying[key] = q[1:]
			} else {
				delete(s.flying, key)
			}
			s.landed.Broadcast()
			s.mu.Unlock()
			if err != nil && failure == nil {
				ack() // the frames before it were taken
				failure = err
				failed.Store(&failure)
				s.log().Warn("forwarded message not taken", "from", key.edge, "error", err)
				_ = send(&edgev1.ForwardResponse{Resend: true})
			}
		}
		if failure == nil {
			owed = l.seq
			owedFrames++
			if len(landings) == 0 || owedFrames >= ackEvery {
				ack()
			}
		}
	}
}

// ackEvery bounds the frames one acknowledgement covers.
const ackEvery = 8

// deliverFrame delivers a frame's messages in order, skipping those taken
// by an earlier attempt. The durable writes of all of them are submitted
// before any is waited for, so a frame costs the store one group commit
// rather than one round trip per message; wait returns which are taken
// (a message counts as taken once its writes are stored). A message
// refused before any write is an error at once; wait then reports the
// messages before it.
func (s *Server) deliverFrame(ctx context.Context, from peerKey, req *edgev1.ForwardRequest, before []bool) (wait func() ([]bool, error), stores bool, _ error) {
	msgs := req.GetMessages()
	taken := make([]bool, len(msgs))
	copy(taken, before)
	deferred := &broker.Deferred{Quiet: len(msgs) == 1}
	dctx := broker.DeferWrites(ctx, deferred)
	delivered := len(msgs)
	var failed error
	for i, fm := range msgs {
		if taken[i] {
			continue
		}
		deferred.Message(i)
		if err := s.deliver(dctx, from, fm); err != nil {
			failed, delivered = err, i
			break
		}
	}
	wait = func() ([]bool, error) {
		errs := deferred.Wait(len(msgs))
		err := failed
		for i := range delivered {
			if taken[i] {
				continue
			}
			if errs[i] != nil {
				err = cmp.Or(err, errs[i])
				continue
			}
			taken[i] = true
		}
		return taken, err
	}
	return wait, deferred.Pending(), failed
}

// Incarnations answers which incarnation of an edge is live (cluster.Peers).
type Incarnations interface {
	Incarnation(edgeID string) (uint64, bool)
	Refresh(ctx context.Context) error
}

// ErrExpiredIncarnation refuses a call from an edge incarnation that is not
// live: a fenced edge, or one that has since rejoined under a newer one.
var ErrExpiredIncarnation = errors.New("caller's incarnation is not live")

// ErrTargetRestarted refuses frames meant for an earlier incarnation of the
// receiving edge. The sessions they were routed to went to other edges
// with that incarnation's end: taken here, they would reach none of them,
// and the publishers would be acknowledged for messages nobody queued. The
// sender fails them as sent to an edge that left (ErrPeerLeft), and they
// are routed again.
var ErrTargetRestarted = errors.New("frames meant for an earlier incarnation of this edge")

// vet checks a caller against the membership, reading it again when the
// copy here may simply predate the caller's (re)join.
func (s *Server) vet(ctx context.Context, edge string, inc uint64) error {
	if s.Members == nil {
		return nil
	}
	live, ok := s.Members.Incarnation(edge)
	if !ok || live < inc {
		if err := s.Members.Refresh(ctx); err != nil {
			return connect.NewError(connect.CodeUnavailable, fmt.Errorf("membership unknown: %w", err))
		}
		live, ok = s.Members.Incarnation(edge)
	}
	if !ok || live != inc {
		return connect.NewError(connect.CodeFailedPrecondition,
			fmt.Errorf("%w: edge %s incarnation %d (live: %d)", ErrExpiredIncarnation, edge, inc, live))
	}
	return nil
}

// vetTarget refuses a frame meant for another incarnation of this edge
// (ErrTargetRestarted). A sender that does not say (0) is not refused.
func (s *Server) vetTarget(req *edgev1.ForwardRequest) error {
	want := req.GetTargetIncarnation()
	if want == 0 || s.Incarnation == nil {
		return nil
	}
	if cur := s.Incarnation(); cur != want {
		return connect.NewError(connect.CodeAborted, fmt.Errorf("%w: meant for incarnation %d, this is %d", ErrTargetRestarted, want, cur))
	}
	return nil
}

func (s *Server) log() *slog.Logger {
	if s.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return s.Logger
}

// Link is the sending side of one peer stream.
type Link struct {
	edgeID      string
	incarnation uint64
	peer        string
	// target is the peer's incarnation the link was made for (0: not
	// known). Every frame names it, and a peer that restarted since
	// refuses them (ErrTargetRestarted): the link then ends as if the peer
	// had left, and its messages are routed again.
	target uint64

	client edgev1connect.EdgeServiceClient
	// warm makes a round trip to the peer on the client's connection
	// (rpc.WarmUp) before a stream opens.
	warm   func(context.Context)
	logger *slog.Logger
	m      *Metrics
	stop   context.CancelFunc // ends Run (set by the Forwarder)

	mu      sync.Mutex
	queue   []*pending // not yet in a frame
	queued  int        // the messages in queue (a run carries several)
	run     *pending   // the run at queue's tail that sendPlain adds to, if any
	unacked []*frame   // sent, awaiting ack, in seq order
	seq     uint64
	wake    chan struct{}
	acks    chan struct{} // the peer acknowledged frames: the send loop may have room again
	closed  atomic.Bool   // set under mu, read without it

	// Group messages kept until the peer reports their outcome (shared.go).
	held        map[heldKey]*heldMsg
	maxHeld     int    // bound on held (0: defaultMaxHeldPerPeer)
	confirm     uint64 // highest outcome seq acted on
	confirmSent uint64 // highest confirmed on the current stream
	// gone is set when the peer left the membership: what it took and held
	// is re-dispatched, through again (nil: given up).
	gone atomic.Bool
	// streamAcked is set when the peer acknowledges a frame; the reconnect
	// after the stream reads and clears it (reconnectWait).
	streamAcked atomic.Bool
	again       func(m *commonv1.Message, group broker.GroupKey, notEdge string)
	againMu     sync.Mutex
	againQueue  []*heldMsg // waiting to be re-dispatched, in order
	againBusy   bool       // a goroutine works through againQueue

	// For Status only: whether a stream is open and has carried a frame,
	// and the credit window the peer last granted.
	connected atomic.Bool
	credit    atomic.Uint64
}

type pending struct {
	msg *edgev1.ForwardMessage // nil for a plain message, encoded by hand
	// raw is the message encoded (appendForwardMessage, or msg by the
	// runtime once it joins a frame), and size its payload's length.
	raw  []byte
	size int
	// count is set on a run of plain QoS 0 messages (sendPlain): raw holds
	// count of them, each already framed as a field of the request, and
	// size their payloads' lengths. Nobody waits for them, so they need
	// their bytes alone.
	count int
	// The outcome, for a sender that waits (waits set before send): under
	// load the peer most often took a message before its sender asks, so
	// the outcome is kept here and a channel is made only for a sender that
	// must wait for it (wake), where one per message cost a publish two
	// allocations and a channel operation on each side.
	waits bool
	mu    sync.Mutex
	over  bool
	err   error
	wake  chan struct{} // closed once over, if a sender waits for it
	// forwarded is the message of a copy Forward sent, told the outcome
	// first (broker.Message.Forwarding).
	forwarded *broker.Message
	span      trace.Span        // forward span of a traced message: ends when the peer took it
	held      []heldKey         // group targets kept until their outcome is reported
	owes      []broker.GroupKey // see dest.owes
}

// outcome returns the message's outcome once the peer took it or it
// failed (over), or else a channel closed when it is.
func (p *pending) outcome() (err error, over bool, wake <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.over {
		return p.err, true, nil
	}
	if p.wake == nil {
		p.wake = make(chan struct{})
	}
	return nil, false, p.wake
}

// waitOutcome returns the message's outcome once it is over, or an error
// at deadline or when ctx ends. *t is the timer of the deadline, made the
// first time a wait must block and shared by the waits of one sender.
func (p *pending) waitOutcome(ctx context.Context, deadline time.Time, bound time.Duration, t **time.Timer) error {
	err, over, wake := p.outcome()
	if over {
		return err
	}
	if *t == nil {
		*t = time.NewTimer(time.Until(deadline))
	}
	select {
	case <-wake:
		err, _, _ = p.outcome()
		return err
	case <-(*t).C:
		return fmt.Errorf("%w within %v", ErrPeerGone, bound)
	case <-ctx.Done():
		return ctx.Err()
	}
}

// waitOne waits until the peer took p, or deadline (bound only names it in
// the error).
func waitOne(ctx context.Context, deadline time.Time, bound time.Duration, p *pending) error {
	var t *time.Timer
	defer func() {
		if t != nil {
			t.Stop()
		}
	}()
	return p.waitOutcome(ctx, deadline, bound, &t)
}

type frame struct {
	seq   uint64
	msgs  []*pending
	count int // the messages in msgs
}

// messages is how many messages p carries.
func (p *pending) messages() int { return max(p.count, 1) }

// NewLink returns a link from this edge to the peer at baseURL (h2c).
func NewLink(edgeID string, incarnation uint64, peer, baseURL string, logger *slog.Logger, m *Metrics) *Link {
	if m == nil {
		m = NewMetrics(nil)
	}
	hc := rpc.H2CClient()
	// The peer keeps, per sending incarnation, the highest frame seq it
	// took, and acknowledges anything at or below it without delivering
	// it. A link made again for the same incarnation (after the peer left
	// the membership and came back) must therefore number its frames above
	// any earlier link's: the clock in nanoseconds is, since no link sends
	// a frame per nanosecond.
	return &Link{edgeID: edgeID, incarnation: incarnation, peer: peer, logger: logger, m: m, stop: func() {},
		client: edgev1connect.NewEdgeServiceClient(hc, baseURL, rpc.ClientOptions(connect.WithGRPC())...),
		warm:   func(ctx context.Context) { rpc.WarmUp(ctx, hc, baseURL) },
		wake:   make(chan struct{}, 1), acks: make(chan struct{}, 1),
		seq: uint64(time.Now().UnixNano())}
}

// send queues p for the peer; a sender that waits for its outcome sets
// p.waits first (waitOutcome).
func (l *Link) send(p *pending) {
	l.mu.Lock()
	if l.closed.Load() {
		l.mu.Unlock()
		if l.gone.Load() {
			p.finish(ErrPeerLeft)
		} else {
			p.finish(ErrPeerGone)
		}
		return
	}
	l.queue = append(l.queue, p)
	l.queued++
	l.run = nil // what comes next goes after p
	l.keepLocked(p)
	l.mu.Unlock()
	l.wakeUp()
}

// A run of plain QoS 0 messages holds up to a frame's worth, so that a
// frame of them is most often one run, sent as it is (request).
const runMessages = maxFrameMessages

// runCap is the first buffer of a run that starts with a message of n
// bytes: room for that one alone while the link sends at once (a frame
// leaves with every message, and a larger buffer would stay allocated
// until it is acknowledged), for many like it once frames wait for the
// window (up to runGatherBytes; append grows it past that).
func (l *Link) runCap(n int) int {
	n += 6 // its tag and length
	if len(l.unacked) < sendWindow {
		return n
	}
	return max(n, min(runMessages*n, runGatherBytes))
}

const runGatherBytes = 32 << 10

// sendPlain queues a plain QoS 0 message, encoded as raw (its payload size
// bytes long), which the caller may reuse once it returns. Nobody waits
// for it, and it is tied to nothing the peer reports, so it costs the link
// no struct of its own: it joins the run at the queue's tail, which holds
// the messages' bytes as they go in the frame.
func (l *Link) sendPlain(raw []byte, size int) {
	l.mu.Lock()
	if l.closed.Load() {
		l.mu.Unlock()
		return // best effort, as over a link that breaks after the send
	}
	r := l.run
	if r == nil || r.count >= runMessages {
		r = &pending{raw: make([]byte, 0, l.runCap(len(raw)))}
		l.queue = append(l.queue, r)
		l.run = r
	}
	r.raw = protowire.AppendTag(r.raw, fReqMessages, protowire.BytesType)
	r.raw = protowire.AppendBytes(r.raw, raw)
	r.count++
	r.size += size
	l.queued++
	l.mu.Unlock()
	l.wakeUp()
}

func (l *Link) wakeUp() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// Run keeps a stream to the peer open until ctx ends, resending unacked
// frames after every reconnect.
func (l *Link) Run(ctx context.Context) error {
	defer l.fail(ErrPeerGone)
	var wait time.Duration
	for ctx.Err() == nil {
		err := l.stream(ctx)
		if ctx.Err() != nil {
			break
		}
		if connect.CodeOf(err) == connect.CodeAborted {
			// The peer restarted since the link was made for it: what the
			// link holds is not for the edge there now.
			l.logger.Info("peer edge restarted; failing what the link held for its earlier incarnation", "peer", l.peer, "error", err)
			l.gone.Store(true)
			break
		}
		l.logger.Debug("forward stream ended; reconnecting", "peer", l.peer, "error", err)
		wait = reconnectWait(wait, l.streamAcked.Swap(false))
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
	return nil
}

// reconnectWait is the wait before the next stream after one that ended,
// given the wait before it: from 50 ms, doubling up to 2 s while streams
// fail, and from 50 ms again after a stream the peer acknowledged frames
// on. A peer that asks for a resend (a store failing over) ends streams
// that work; each must not cost it more than the first did.
func reconnectWait(last time.Duration, acked bool) time.Duration {
	const first, most = 50 * time.Millisecond, 2 * time.Second
	if acked || last == 0 {
		return first
	}
	return min(2*last, most)
}

func (l *Link) stream(ctx context.Context) error {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	l.warm(sctx)
	st := l.client.Forward(sctx)
	// End the stream explicitly: the peer's handler (and its server's
	// shutdown) must not wait on a stream this side abandoned.
	defer func() {
		l.connected.Store(false)
		_ = st.CloseRequest()
		_ = st.CloseResponse()
	}()
	// Resend what the previous stream left unacknowledged, in order. A
	// first frame goes out even with nothing to resend (an empty one), so
	// that the peer can send outcomes of group messages it owes this edge.
	l.mu.Lock()
	resend := append([]*frame(nil), l.unacked...)
	l.confirmSent = 0
	l.mu.Unlock()
	// A send fails with io.EOF when the peer ended the stream; why it did
	// (it restarted, say) is the stream's error.
	why := func(err error) error {
		if errors.Is(err, io.EOF) {
			if _, rerr := st.Receive(); rerr != nil {
				return rerr
			}
		}
		return err
	}
	for _, f := range resend {
		if err := st.Send(l.request(f)); err != nil {
			return why(err)
		}
		l.connected.Store(true)
		l.m.resent.Inc()
	}
	if len(resend) == 0 {
		if err := st.Send(l.request(l.emptyFrame())); err != nil {
			return why(err)
		}
	}
	errc := make(chan error, 1)
	go func() {
		for {
			resp, err := st.Receive()
			if err != nil {
				errc <- err
				return
			}
			if resp.GetTakenSeq() > 0 {
				l.credit.Store(resp.GetCreditBytes())
				l.acked(resp.GetTakenSeq())
				l.streamAcked.Store(true)
				select {
				case l.acks <- struct{}{}:
				default:
				}
			}
			l.outcomes(resp.GetSharedOutcomes())
			if resp.GetResend() {
				// The peer did not take a frame; it takes none more on this
				// stream, and wants every unacknowledged one again.
				errc <- errResend
				return
			}
		}
	}()
	for {
		select {
		case <-sctx.Done():
			return sctx.Err()
		case err := <-errc:
			return err
		case <-l.wake:
		case <-l.acks:
		}
		for {
			f := l.nextFrame()
			if f == nil {
				break
			}
			if err := st.Send(l.request(f)); err != nil {
				return l.streamError(err, errc)
			}
			l.connected.Store(true)
			l.m.frames.Inc()
			l.m.frameMessages.Observe(float64(f.count))
		}
		if l.unconfirmed() {
			if err := st.Send(l.request(l.emptyFrame())); err != nil {
				return l.streamError(err, errc)
			}
		}
	}
}

// streamError is the error a stream ended with when a send on it failed
// with err: a send fails with io.EOF when the peer ended the stream, and
// the receiving side (errc) hears why.
func (l *Link) streamError(err error, errc <-chan error) error {
	if !errors.Is(err, io.EOF) {
		return err
	}
	select {
	case rerr := <-errc:
		return rerr
	case <-time.After(time.Second):
		return err
	}
}

// emptyFrame is a frame with no message: it carries a confirmation of
// outcomes (every frame does), and is taken and acknowledged like any
// other, by peers of every version.
func (l *Link) emptyFrame() *frame {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.seq++
	f := &frame{seq: l.seq}
	l.unacked = append(l.unacked, f)
	return f
}

// unconfirmed reports whether outcomes were acted on since the last
// confirmation went out.
func (l *Link) unconfirmed() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.confirm > l.confirmSent
}

const maxFrameMessages = 256

// sendWindow is how many frames a link keeps unacknowledged before it waits
// for an acknowledgement to send one that is not full. A frame costs both
// edges a write, a read and an acknowledgement whatever it carries; sent as
// soon as a message is queued, frames under load carried a few messages
// each, and those costs made up a fifth of a forwarded message's CPU. Two
// keep the peer busy (one frame is delivered while the next is on its
// way), and meanwhile what is published gathers into the next frame. An
// idle link sends at once, so a message waits for a frame only when others
// are ahead of it.
const sendWindow = 2

// nextFrame moves queued messages into a new frame, encoding those not
// encoded yet (shared targets, a trace: after keepLocked decided what the
// peer reports). One the runtime cannot encode fails alone, unacknowledged,
// before it joins a frame whose acknowledgement would count it as taken.
func (l *Link) nextFrame() *frame {
	l.mu.Lock()
	if len(l.queue) == 0 || len(l.unacked) >= sendWindow && l.queued < maxFrameMessages {
		// A full frame goes at once: the window saves frames, it does not
		// bound what is in flight.
		l.mu.Unlock()
		return nil
	}
	// Up to maxFrameMessages, or a run further.
	n, count := 0, 0
	for n < len(l.queue) && count < maxFrameMessages {
		count += l.queue[n].messages()
		n++
	}
	l.queued -= count
	l.seq++
	f := &frame{seq: l.seq, msgs: make([]*pending, 0, n)}
	var failed []*pending
	var errs []error
	for _, p := range l.queue[:n] {
		if p == l.run {
			l.run = nil // in a frame now: it takes no more
		}
		if p.raw == nil {
			raw, err := proto.Marshal(p.msg)
			if err != nil {
				for _, k := range p.held {
					delete(l.held, k)
				}
				failed, errs = append(failed, p), append(errs, err)
				continue
			}
			p.raw, p.size = raw, len(p.msg.GetMessage().GetPayload())
		}
		f.msgs = append(f.msgs, p)
		f.count += p.messages()
	}
	clear(l.queue[:n]) // taken: the queue's array does not keep them
	l.queue = l.queue[n:]
	l.unacked = append(l.unacked, f)
	l.mu.Unlock()
	for i, p := range failed {
		l.logger.Error("forwarded message not encodable; not taken", "peer", l.peer, "error", errs[i])
		p.finish(fmt.Errorf("forwarded message not encodable: %w", errs[i]))
	}
	return f
}

// request is the ForwardRequest of frame f. Its messages go as they are
// encoded (nextFrame): each is field 5 (messages) of the request, written
// after the other fields as the request's unknown fields, which the
// runtime's marshal copies verbatim. On the wire that is the repeated
// field, in frame order.
func (l *Link) request(f *frame) *edgev1.ForwardRequest {
	l.mu.Lock()
	l.confirmSent = l.confirm
	req := &edgev1.ForwardRequest{EdgeId: l.edgeID, Incarnation: l.incarnation, TargetIncarnation: l.target, Seq: f.seq, OutcomesConfirmed: l.confirm}
	l.mu.Unlock()
	if len(f.msgs) == 0 {
		return req
	}
	if len(f.msgs) == 1 && f.msgs[0].count > 0 {
		// One run: framed already, and never written again.
		req.ProtoReflect().SetUnknown(f.msgs[0].raw)
		return req
	}
	n := 0
	for _, p := range f.msgs {
		n += len(p.raw) + 6
	}
	msgs := make([]byte, 0, n)
	for _, p := range f.msgs {
		if p.count > 0 {
			msgs = append(msgs, p.raw...) // a run: framed already
			continue
		}
		msgs = protowire.AppendTag(msgs, fReqMessages, protowire.BytesType)
		msgs = protowire.AppendBytes(msgs, p.raw)
	}
	req.ProtoReflect().SetUnknown(msgs)
	return req
}

func (l *Link) acked(seq uint64) {
	l.mu.Lock()
	var done []*frame
	for len(l.unacked) > 0 && l.unacked[0].seq <= seq {
		f := l.unacked[0]
		done = append(done, f)
		l.unacked = l.unacked[1:]
		for _, p := range f.msgs {
			for _, k := range p.held {
				if h := l.held[k]; h != nil {
					h.taken = true
				}
			}
		}
	}
	l.mu.Unlock()
	for _, f := range done {
		for _, p := range f.msgs {
			p.finish(nil)
		}
	}
}

// fail answers every waiting message with err (the link is closing).
func (l *Link) fail(err error) {
	if l.gone.Load() {
		err = ErrPeerLeft
	}
	l.mu.Lock()
	l.closed.Store(true)
	var all []*pending
	for _, f := range l.unacked {
		all = append(all, f.msgs...)
	}
	all = append(all, l.queue...)
	l.unacked, l.queue, l.queued, l.run = nil, nil, 0, nil
	again := l.releaseHeldLocked()
	l.mu.Unlock()
	for _, p := range all {
		p.finish(err)
	}
	l.redispatch(again)
}

// finish ends the message's span and answers a waiting sender, in that
// order: answered first, the sender could acknowledge the publish and end
// its span before the forward span under it ended.
func (p *pending) finish(err error) {
	if p.span != nil {
		if err != nil {
			p.span.RecordError(err)
			p.span.SetStatus(codes.Error, err.Error())
		}
		p.span.End()
	}
	if !p.waits {
		return
	}
	p.mu.Lock()
	if p.over {
		p.mu.Unlock()
		return // the first outcome stands
	}
	if m := p.forwarded; m != nil {
		// Before the outcome: a sender that finds every copy over finds
		// the message told of each.
		if err == nil {
			m.ForwardTaken()
		} else {
			m.ForwardFailed()
		}
	}
	p.over, p.err = true, err
	wake := p.wake
	p.mu.Unlock()
	if wake != nil {
		close(wake)
	}
}

// LinkStatus describes the link to one peer, for operators.
type LinkStatus struct {
	Peer string
	// Incarnation is this edge's incarnation the link was made under.
	Incarnation uint64
	// Connected is true while a stream to the peer is open and has carried
	// a frame since it opened (a stream opens when there is one to send).
	Connected bool
	// Closed is true once the link has stopped (replaced on next use).
	Closed bool
	// InflightBytes is the payload bytes in frames sent and not yet taken.
	InflightBytes uint64
	// CreditBytes is the window the peer last granted (0: it grants none).
	CreditBytes uint64
}

// Status reports the link's state. It only reads.
func (l *Link) Status() LinkStatus {
	st := LinkStatus{Peer: l.peer, Incarnation: l.incarnation, Connected: l.connected.Load(), CreditBytes: l.credit.Load()}
	l.mu.Lock()
	defer l.mu.Unlock()
	st.Closed = l.closed.Load()
	for _, f := range l.unacked {
		for _, p := range f.msgs {
			st.InflightBytes += uint64(p.size)
		}
	}
	return st
}

func (l *Link) isClosed() bool { return l.closed.Load() }
