// Package server serves keel.persistence.v1.PersistenceService over Connect
// (gRPC, gRPC-Web and Connect on one port) in front of a [store.Store].
//
// Write is a bidirectional stream of batches. The ops of every batch are
// decoded and validated first (a malformed batch is answered
// INVALID_ARGUMENT and nothing of it is stored), then handed to the store in
// the order received, so two batches touching one session apply in order;
// their answers are collected concurrently, so many batches share one Redis
// pipeline and one WAIT (group commit). A batch is answered OK only when
// every op is durable as promised.
package server

import (
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
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/libs/slots"
	"github.com/keelmq/keel/libs/topic"
	"github.com/keelmq/keel/services/persistence/internal/failover"
	"github.com/keelmq/keel/services/persistence/internal/metrics"
	"github.com/keelmq/keel/services/persistence/internal/store"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
	"github.com/keelmq/keel/proto/gen/keel/persistence/v1/persistencev1connect"
)

// Config configures the server.
type Config struct {
	Limits Limits
	// MaxInflightBatches bounds the batches of one stream awaiting their
	// answer; the stream is not read further until one is answered.
	MaxInflightBatches int
	// MaxLookup caps LookupRetained's limit.
	MaxLookup int
	// Slots maps sessions and tenants to Redis groups (nil: one group) and
	// Group is the group this instance fronts: ops for another group's
	// sessions or tenants are refused as invalid.
	Slots slots.Table `yaml:"-"`
	Group uint32      `yaml:"-"`
	// TenantQueues bound the entries queued for each tenant's sessions
	// (store.QueueLimits.TenantMax of every append).
	TenantQueues store.TenantQuotas `yaml:"-"`
	// Gate, if set, is asked before each batch and again before its
	// answer; an error answers the batch UNAVAILABLE (the instance lost
	// its coordinator lease, or a failover of its group is under way: it
	// must not acknowledge anything).
	Gate func() error `yaml:"-"`
	// Switchover, if set, runs the Switchover RPC (a Redis group followed
	// through the coordinator); unset, the RPC answers FailedPrecondition.
	Switchover func(ctx context.Context, opts failover.SwitchoverOptions) (failover.SwitchoverResult, error) `yaml:"-"`
	// DescribeGroup, if set, reads the nodes of the Redis group (the
	// DescribeGroup RPC); unset (embedded store), the RPC answers
	// FailedPrecondition.
	DescribeGroup func(ctx context.Context) (failover.Record, []failover.NodeStatus) `yaml:"-"`
}

// Server implements persistencev1connect.PersistenceServiceHandler.
type Server struct {
	cfg     Config
	dec     decoder
	store   store.Store
	metrics *metrics.Metrics
	logger  *slog.Logger
	status  func() *persistencev1.StatusResponse
	// refusedLog limits the lines logged for refused requests.
	refusedLog logging.Every

	stopping atomic.Bool
	streams  sync.WaitGroup
	// stopped is closed once Stop has seen the batches in flight answered:
	// open Write streams end then, or an HTTP server shutdown would wait
	// for their clients to close them.
	stopped  chan struct{}
	stopOnce sync.Once
}

var _ persistencev1connect.PersistenceServiceHandler = (*Server)(nil)

// New returns a server over st. status fills Status answers; m may be nil.
func New(cfg Config, st store.Store, m *metrics.Metrics, status func() *persistencev1.StatusResponse, logger *slog.Logger) *Server {
	cfg.Limits = cfg.Limits.withDefaults()
	if cfg.MaxInflightBatches <= 0 {
		cfg.MaxInflightBatches = 256
	}
	if cfg.MaxLookup <= 0 {
		cfg.MaxLookup = 10000
	}
	if status == nil {
		status = func() *persistencev1.StatusResponse { return &persistencev1.StatusResponse{} }
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if m != nil {
		// The refusals exist from the start, so a rate of them is 0, not
		// absent, until a client sends something bad.
		for _, k := range refusedKinds {
			m.Ops.WithLabelValues(k, invalidStatus)
		}
	}
	return &Server{cfg: cfg, dec: decoder{lim: cfg.Limits, slots: cfg.Slots, group: cfg.Group, quotas: cfg.TenantQueues}, store: st, metrics: m, status: status, logger: logger,
		stopped: make(chan struct{})}
}

// Requests refused for their content are counted in
// keel_persistence_ops_total{status="WRITE_STATUS_INVALID_ARGUMENT"} under
// one of these kinds, and logged at most once per refusedLogInterval: a
// broken client can send thousands a second. A refused Switchover request is
// counted in keel_persistence_switchovers_total{result="bad_request"}.
const (
	refusedFrame          = "frame" // an undecodable Write frame: the stream ends
	refusedBatch          = "batch" // a Write batch refused whole
	refusedLoadSession    = "load_session"
	refusedLookupRetained = "lookup_retained"
	refusedTenantUsage    = "tenant_usage"
	refusedSwitchover     = "switchover"

	refusedLogInterval = 10 * time.Second
)

var (
	refusedKinds  = []string{refusedFrame, refusedBatch, refusedLoadSession, refusedLookupRetained, refusedTenantUsage}
	invalidStatus = persistencev1.WriteStatus_WRITE_STATUS_INVALID_ARGUMENT.String()
)

// refused counts a request refused for its content (kind, one of the
// refused* constants) from remote, and logs it unless a refusal was logged
// less than refusedLogInterval ago.
func (s *Server) refused(kind, remote string, err error) {
	if m := s.metrics; m != nil {
		if kind == refusedSwitchover {
			m.Switchovers.WithLabelValues("bad_request").Inc()
		} else {
			m.Ops.WithLabelValues(kind, invalidStatus).Inc()
		}
	}
	if s.refusedLog.Allow(refusedLogInterval) {
		s.logger.Warn("request refused", logging.KeyReason, kind, logging.KeyRemote, remote, logging.Err(err))
	}
}

// unaryError is the answer of a unary RPC that failed with err; one that
// blames the request (InvalidArgument) is counted and logged as refused
// under kind.
func (s *Server) unaryError(kind string, peer connect.Peer, err error) error {
	ce := toConnect(err)
	if connect.CodeOf(ce) == connect.CodeInvalidArgument {
		s.refused(kind, peer.Addr, err)
	}
	return ce
}

// Handler returns the Connect handler and its path prefix. Write batches
// are decoded by hand (decodeWriteRequest).
func (s *Server) Handler(opts ...connect.HandlerOption) (string, http.Handler) {
	opts = append([]connect.HandlerOption{connect.WithCodec(rpc.ProtoCodec(decodeWriteRequest))}, opts...)
	return persistencev1connect.NewPersistenceServiceHandler(s, rpc.HandlerOptions(opts...)...)
}

// Stop makes new batches fail with UNAVAILABLE and waits (until ctx ends)
// for the batches already handed to the store to be answered; then every
// open Write stream ends (UNAVAILABLE), and its client writes elsewhere.
func (s *Server) Stop(ctx context.Context) error {
	s.stopping.Store(true)
	done := make(chan struct{})
	go func() { s.streams.Wait(); close(done) }()
	defer s.stopOnce.Do(func() { close(s.stopped) })
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// errStreamStopped ends the Write streams of a stopping server.
var errStreamStopped = connect.NewError(connect.CodeUnavailable, ErrStopping)

// Write implements the RPC.
func (s *Server) Write(ctx context.Context, stream *connect.BidiStream[persistencev1.WriteRequest, persistencev1.WriteResponse]) error {
	var (
		sendMu  sync.Mutex
		sendErr error
		wg      sync.WaitGroup
		sem     = make(chan struct{}, s.cfg.MaxInflightBatches)
	)
	defer wg.Wait()
	done := make(chan struct{})
	defer close(done)
	reqs := s.receive(stream, done)
	send := func(resp *persistencev1.WriteResponse) {
		sendMu.Lock()
		defer sendMu.Unlock()
		if sendErr == nil {
			sendErr = stream.Send(resp)
		}
	}
	for {
		var r received
		select {
		case r = <-reqs:
		case <-s.stopped:
			return errStreamStopped
		}
		req, err := r.req, r.err
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			// An undecodable frame: connect reports it as InvalidArgument.
			// Its stream cannot go on: the next frames may belong to it.
			// Any other error is the client or its connection going away.
			if connect.CodeOf(err) == connect.CodeInvalidArgument {
				s.refused(refusedFrame, stream.Peer().Addr, err)
			}
			return err
		}
		start := time.Now()
		if err := s.gate(); err != nil {
			s.count(nil, nil, persistencev1.WriteStatus_WRITE_STATUS_UNAVAILABLE)
			send(&persistencev1.WriteResponse{BatchId: req.GetBatchId(), Status: persistencev1.WriteStatus_WRITE_STATUS_UNAVAILABLE, Error: err.Error()})
			continue
		}
		ops, err := s.dec.batch(req)
		if err != nil {
			s.refused(refusedBatch, stream.Peer().Addr, err)
			send(&persistencev1.WriteResponse{BatchId: req.GetBatchId(), Status: persistencev1.WriteStatus_WRITE_STATUS_INVALID_ARGUMENT, Error: err.Error()})
			continue
		}
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return ctx.Err()
		}
		// Submitting here, on the reading goroutine, keeps the store's
		// order the order of arrival.
		s.streams.Add(1)
		wait := store.Submit(ctx, s.store, ops)
		wg.Add(1)
		go func(id uint64) {
			defer func() { <-sem; wg.Done(); s.streams.Done() }()
			resp := s.answer(id, ops, wait())
			if err := s.leaseGate(); err != nil {
				// The lease or the write grant ended, or this instance
				// began a failover, while the batch was written: a
				// replica that lacks it may be promoted without waiting
				// any longer for this instance, so nothing of it is
				// acknowledged. Writes are idempotent; the edge
				// sends them again.
				s.count(nil, nil, persistencev1.WriteStatus_WRITE_STATUS_UNAVAILABLE)
				resp = &persistencev1.WriteResponse{BatchId: id, Status: persistencev1.WriteStatus_WRITE_STATUS_UNAVAILABLE, Error: err.Error()}
			}
			send(resp)
			if s.metrics != nil {
				s.metrics.WriteLatency.Observe(time.Since(start).Seconds())
			}
		}(req.GetBatchId())
		sendMu.Lock()
		err = sendErr
		sendMu.Unlock()
		if err != nil {
			return err
		}
	}
}

type received struct {
	req *persistencev1.WriteRequest
	err error
}

// receive reads stream on its own goroutine, so that a stopping server
// does not wait for the next frame to end the stream. It stops at the
// first error, or once the handler returned (done).
func (s *Server) receive(stream *connect.BidiStream[persistencev1.WriteRequest, persistencev1.WriteResponse], done <-chan struct{}) <-chan received {
	out := make(chan received)
	go func() {
		for {
			req, err := stream.Receive()
			select {
			case out <- received{req, err}:
			case <-done:
				return
			}
			if err != nil {
				return
			}
		}
	}()
	return out
}

func (s *Server) gate() error {
	if s.stopping.Load() {
		return ErrStopping
	}
	return s.leaseGate()
}

func (s *Server) leaseGate() error {
	if s.cfg.Gate != nil {
		return s.cfg.Gate()
	}
	return nil
}

func (s *Server) answer(id uint64, ops []store.Op, res []store.OpResult) *persistencev1.WriteResponse {
	resp := &persistencev1.WriteResponse{BatchId: id, Status: persistencev1.WriteStatus_WRITE_STATUS_OK, Results: make([]*persistencev1.OpResult, len(res))}
	for i, r := range res {
		_, st := classify(r.Err)
		or := &persistencev1.OpResult{Status: st, Changed: r.Changed, Added: uint32(r.Append.Added), Duplicates: uint32(r.Append.Duplicates),
			DroppedOldest: uint32(r.Append.DroppedOldest), Refused: uint32(r.Append.Refused)}
		if r.Err != nil {
			or.Error = r.Err.Error()
			if resp.Status == persistencev1.WriteStatus_WRITE_STATUS_OK {
				resp.Status, resp.Error = st, r.Err.Error()
			}
		}
		resp.Results[i] = or
		s.count(&ops[i], &r, st)
	}
	if s.metrics != nil {
		n := 0
		for i := range ops {
			n += ops[i].Records()
		}
		s.metrics.BatchOps.Observe(float64(len(ops)))
		s.metrics.BatchRecords.Observe(float64(n))
	}
	return resp
}

func (s *Server) count(o *store.Op, r *store.OpResult, st persistencev1.WriteStatus) {
	m := s.metrics
	if m == nil {
		return
	}
	if o == nil {
		m.Ops.WithLabelValues("batch", st.String()).Inc()
		return
	}
	m.Ops.WithLabelValues(o.Kind.String(), st.String()).Inc()
	if r.Err == nil {
		m.Records.WithLabelValues(o.Kind.String()).Add(float64(o.Records()))
	}
	if r.Append.DroppedOldest > 0 {
		m.QueueDrops.WithLabelValues("dropped_oldest").Add(float64(r.Append.DroppedOldest))
	}
	if r.Append.Refused > 0 {
		reason := "refused_newest"
		if o.Limits.TenantMax > 0 && o.Limits.MaxLen == 0 {
			reason = "tenant_quota" // the only bound the append had
		}
		m.QueueDrops.WithLabelValues(reason).Add(float64(r.Append.Refused))
	}
}

// LoadSession implements the RPC.
func (s *Server) LoadSession(ctx context.Context, req *connect.Request[persistencev1.LoadSessionRequest]) (*connect.Response[persistencev1.LoadSessionResponse], error) {
	k, err := s.dec.sessionKey(req.Msg.GetSession())
	if err != nil {
		return nil, s.unaryError(refusedLoadSession, req.Peer(), err)
	}
	st, err := s.store.Load(ctx, k)
	if err != nil {
		return nil, s.unaryError(refusedLoadSession, req.Peer(), err)
	}
	out := &persistencev1.LoadSessionResponse{Epoch: st.Epoch, Session: SessionOut(st.Session)}
	for _, sub := range st.Subs {
		out.Subscriptions = append(out.Subscriptions, &persistencev1.Subscription{Filter: sub.Filter, Qos: uint32(sub.QoS),
			NoLocal: sub.NoLocal, RetainAsPublished: sub.RetainAsPublished, RetainHandling: uint32(sub.RetainHandling),
			SubscriptionIdentifier: uint32(sub.Identifier)})
	}
	for _, e := range st.Queue {
		out.Queue = append(out.Queue, EntryOut(e))
	}
	for _, e := range st.Inflight {
		out.Inflight = append(out.Inflight, EntryOut(e))
	}
	for _, in := range st.Incoming {
		out.Incoming = append(out.Incoming, IncomingOut(in))
	}
	for _, id := range st.TookQoS2 {
		if m, err := ParseMsgID(id); err == nil {
			out.TookQos2 = append(out.TookQos2, m)
		}
	}
	// In queue order, then in-flight, so a caller can deliver as it reads.
	seen := make(map[string]bool, len(st.Messages))
	add := func(id string) {
		if m, ok := st.Messages[id]; ok && !seen[id] {
			seen[id] = true
			out.Messages = append(out.Messages, MessageOut(m))
		}
	}
	for _, e := range st.Queue {
		add(e.MsgID)
	}
	for _, e := range st.Inflight {
		add(e.MsgID)
	}
	s.dropGone(ctx, k, st)
	return connect.NewResponse(out), nil
}

// dropGone removes the entries of a loaded session whose message is gone.
// The Redis store lets a body go a minute after its MQTT expiry while the
// entries that refer to it stay: no one can deliver them and the edge skips
// them, so without this a long-lived session kept them until it was
// deleted. They go under the epoch just read (a new owner's writes fence
// the removal off), after the answer, and only while this instance may
// write.
func (s *Server) dropGone(ctx context.Context, k store.SessionKey, st *store.State) {
	var queued []string
	var inflight []uint16
	for _, e := range st.Queue {
		if st.Messages[e.MsgID] == nil {
			queued = append(queued, e.MsgID)
		}
	}
	for _, e := range st.Inflight {
		if st.Messages[e.MsgID] == nil {
			inflight = append(inflight, e.PacketID)
		}
	}
	if len(queued)+len(inflight) == 0 || st.Epoch == 0 || s.cfg.Gate != nil && s.cfg.Gate() != nil {
		return
	}
	f := store.Fence{Epoch: st.Epoch}
	var ops []store.Op
	if len(queued) > 0 {
		ops = append(ops, store.Op{Kind: store.OpDequeue, Key: k, Fence: f, MsgIDs: queued})
	}
	if len(inflight) > 0 {
		ops = append(ops, store.Op{Kind: store.OpComplete, Key: k, Fence: f, PacketIDs: inflight})
	}
	wait := store.Submit(context.WithoutCancel(ctx), s.store, ops)
	go func() {
		for _, r := range wait() {
			if r.Err != nil {
				s.logger.Debug("dropping entries whose message is gone", "session", k.Tag(), "error", r.Err)
				return
			}
		}
		if s.metrics != nil {
			s.metrics.QueueDrops.WithLabelValues("message_gone").Add(float64(len(queued) + len(inflight)))
		}
		s.logger.Debug("dropped entries whose message is gone", "session", k.Tag(), "queued", len(queued), "in_flight", len(inflight))
	}()
}

// LookupRetained implements the RPC.
func (s *Server) LookupRetained(ctx context.Context, req *connect.Request[persistencev1.LookupRetainedRequest]) (*connect.Response[persistencev1.LookupRetainedResponse], error) {
	m := req.Msg
	if err := s.dec.retainedTenant(m.GetTenant()); err != nil {
		return nil, s.unaryError(refusedLookupRetained, req.Peer(), err)
	}
	if err := topic.ValidateFilter(m.GetFilter(), topic.Limits{}); err != nil {
		return nil, s.unaryError(refusedLookupRetained, req.Peer(), invalid("filter: %v", err))
	}
	if _, _, shared, _ := topic.ParseShare(m.GetFilter()); shared {
		return nil, s.unaryError(refusedLookupRetained, req.Peer(), invalid("shared subscriptions get no retained messages; pass the inner filter"))
	}
	limit := int(m.GetLimit())
	if limit <= 0 || limit > s.cfg.MaxLookup {
		limit = s.cfg.MaxLookup
	}
	msgs, err := s.store.LookupRetained(ctx, m.GetTenant(), m.GetFilter(), limit)
	if err != nil {
		return nil, s.unaryError(refusedLookupRetained, req.Peer(), err)
	}
	out := &persistencev1.LookupRetainedResponse{Messages: make([]*commonv1.Message, 0, len(msgs))}
	for _, sm := range msgs {
		out.Messages = append(out.Messages, MessageOut(sm))
	}
	return connect.NewResponse(out), nil
}

// Status implements the RPC.
func (s *Server) Status(context.Context, *connect.Request[persistencev1.StatusRequest]) (*connect.Response[persistencev1.StatusResponse], error) {
	return connect.NewResponse(s.status()), nil
}

// DescribeGroup implements the RPC.
func (s *Server) DescribeGroup(ctx context.Context, _ *connect.Request[persistencev1.DescribeGroupRequest]) (*connect.Response[persistencev1.DescribeGroupResponse], error) {
	if s.cfg.DescribeGroup == nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("this instance keeps its data in the embedded store: it has no Redis group"))
	}
	rec, nodes := s.cfg.DescribeGroup(ctx)
	out := &persistencev1.DescribeGroupResponse{RecordEpoch: rec.Epoch, Primary: rec.Primary}
	for _, n := range nodes {
		pn := &persistencev1.RedisNode{Address: n.Addr}
		if n.Err != nil {
			pn.Error = n.Err.Error()
		} else {
			pn.Role, pn.Following, pn.LinkUp, pn.ReplicationOffset, pn.ReplicationId, pn.LagBytes = n.Role, n.Following, n.LinkUp, n.Offset, n.ReplID, n.Lag
			pn.WriteEpoch, pn.WriteSeq, pn.UsedMemory, pn.MaxMemory, pn.AofRewriting = n.WriteEpoch, n.WriteSeq, n.UsedMemory, n.MaxMemory, n.AOFRewriting
		}
		out.Nodes = append(out.Nodes, pn)
	}
	return connect.NewResponse(out), nil
}

// TenantUsage implements the RPC.
func (s *Server) TenantUsage(ctx context.Context, req *connect.Request[persistencev1.TenantUsageRequest]) (*connect.Response[persistencev1.TenantUsageResponse], error) {
	tenant := req.Msg.GetTenant()
	if !ValidTenant(tenant) {
		return nil, s.unaryError(refusedTenantUsage, req.Peer(), invalid("tenant %.70q: want 1-63 of a-z, 0-9 and -", tenant))
	}
	u, err := s.store.TenantUsage(ctx, tenant)
	if err != nil {
		return nil, s.unaryError(refusedTenantUsage, req.Peer(), err)
	}
	return connect.NewResponse(&persistencev1.TenantUsageResponse{Queued: uint64(u.Queued), QueueMax: uint64(s.cfg.TenantQueues.Max(tenant)),
		Retained: uint64(u.Retained)}), nil
}

// Switchover implements the RPC: an operator's planned move of the Redis
// group's primary (see [failover.Promoter.Switchover]). It runs to its end
// even if the caller goes away: every step is bounded, and stopping midway
// would only leave work to undo.
func (s *Server) Switchover(ctx context.Context, req *connect.Request[persistencev1.SwitchoverRequest]) (*connect.Response[persistencev1.SwitchoverResponse], error) {
	m := req.Msg
	opts := failover.SwitchoverOptions{To: m.GetTo(), SyncTimeout: failover.DefaultSwitchoverSyncTimeout}
	if m.GetTimeout() != nil {
		if err := m.GetTimeout().CheckValid(); err != nil {
			return nil, s.badSwitchover(req.Peer(), fmt.Errorf("timeout: %w", err))
		}
		d := m.GetTimeout().AsDuration()
		if d <= 0 || d > failover.MaxSwitchoverSyncTimeout {
			return nil, s.badSwitchover(req.Peer(), fmt.Errorf("timeout %v: give more than 0 and at most %v", d, failover.MaxSwitchoverSyncTimeout))
		}
		opts.SyncTimeout = d
	}
	if opts.To != "" {
		if err := failover.ValidateAddr(opts.To); err != nil {
			return nil, s.badSwitchover(req.Peer(), err)
		}
	}
	if s.cfg.Switchover == nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition,
			errors.New("switchover needs a Redis group followed through the coordinator (--redis.addr and --coordinator.addr); this instance has none"))
	}
	res, err := s.cfg.Switchover(context.WithoutCancel(ctx), opts)
	if err != nil {
		return nil, switchoverError(err)
	}
	return connect.NewResponse(&persistencev1.SwitchoverResponse{OldPrimary: res.Old.Primary, NewPrimary: res.New.Primary,
		RecordEpoch: res.New.Epoch, OldRecordEpoch: res.Old.Epoch, ReplicaAddresses: res.New.Replicas,
		PausedFor: durationpb.New(res.PausedFor), Offset: res.Offset, OldPrimaryDemoted: res.Demoted}), nil
}

// badSwitchover refuses a Switchover request for its content: counted and
// logged as the failover loop counts a bad target.
func (s *Server) badSwitchover(peer connect.Peer, err error) error {
	s.refused(refusedSwitchover, peer.Addr, err)
	return connect.NewError(connect.CodeInvalidArgument, err)
}
