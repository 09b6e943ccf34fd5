package remotestore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
	"github.com/keelmq/keel/services/edge/internal/durable"
)

// The write path: callers append ops to one FIFO queue (in call order, so
// the ops of one session keep the order their caller gave them); one
// sender goroutine drains it into batches on the single Write stream, and
// a receiver goroutine answers each op from its batch's response. The
// service applies batches in the order it receives them, so queue order is
// apply order. Batches are pipelined: up to MaxInflightBatches await their
// answers while the next ones are sent, so the batch size follows the load
// (group commit) without a timer on an idle stream.

// call is one caller's request, answered once all its ops are: with the
// first error among them.
type call struct {
	left atomic.Int32
	mu   sync.Mutex
	err  error
	done chan error // nil: nobody waits
	what string     // names the write in errors and logs
	id   string     // of the session written, if any
}

func newCall(what, id string, ops int, wait bool) *call {
	c := &call{what: what, id: id}
	c.left.Store(int32(ops))
	if wait {
		c.done = make(chan error, 1)
	}
	return c
}

// finish records one op's outcome; last reports whether it was the last
// one, with the call's error.
func (c *call) finish(err error) (last bool, callErr error) {
	if err != nil {
		c.mu.Lock()
		if c.err == nil {
			c.err = err
		}
		c.mu.Unlock()
	}
	if c.left.Add(-1) != 0 {
		return false, nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return true, c.err
}

// wrap names the call in its error.
func (c *call) wrap(err error) error {
	if c.id == "" {
		return fmt.Errorf("%s: %w", c.what, err)
	}
	return fmt.Errorf("%s for session %q: %w", c.what, c.id, err)
}

// op is one queued write, or a barrier (w == nil): answered once every op
// queued before it is.
type op struct {
	w    *persistencev1.WriteOp
	call *call
	size int // about its encoded bytes
	at   time.Time
}

// batch is a WriteRequest awaiting its answer.
type batch struct {
	ops  []*op
	at   []int // per op, the index of the WriteOp that carries it
	sent time.Time
}

// barrierWait is a barrier taken off the queue, answered once no batch up
// to after is outstanding.
type barrierWait struct {
	after uint64
	o     *op
}

// link is one Write stream and what awaits an answer on it.
type link struct {
	st       *connect.BidiStreamForClient[persistencev1.WriteRequest, persistencev1.WriteResponse]
	slots    chan struct{} // one per outstanding batch
	progress chan struct{} // a batch was answered
	answered atomic.Bool   // any batch was: the stream works

	mu       sync.Mutex
	out      map[uint64]*batch
	barriers []barrierWait
}

// submit queues a call's ops, in order and together.
func (s *Store) submit(ops ...*op) error {
	now := time.Now()
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		return ErrClosed
	}
	if len(s.queue)+len(ops) > s.cfg.MaxQueued {
		s.mu.Unlock()
		return fmt.Errorf("%w: %d writes already wait for the persistence service", ErrUnavailable, s.cfg.MaxQueued)
	}
	for _, o := range ops {
		o.at = now
		s.fenceAtSubmit(o)
		s.queue = append(s.queue, o)
	}
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
	return nil
}

// fenceAtSubmit gives a session write the epoch current when it joins the
// queue (s.mu held). The queue is the service's apply order, so a write
// queued after an Activate carries at least that epoch: a write that read
// the older epoch before the Activate and was queued after it would
// otherwise be refused by the very edge that owns the session.
func (s *Store) fenceAtSubmit(o *op) {
	if o.w == nil || o.w.GetFence() == nil || o.call == nil || o.call.id == "" || o.w.GetActivate() != nil {
		return
	}
	if e, ok := s.epoch(o.call.id); ok && e > o.w.GetFence().GetEpoch() {
		o.w.Fence = &persistencev1.Fence{Epoch: e, GroupEpoch: o.w.GetFence().GetGroupEpoch()}
	}
}

// take removes the next batch from the queue: up to MaxBatchOps ops and
// about MaxBatchBytes, stopping before a barrier. A barrier at the head
// comes back alone. Ops that waited longer than MaxQueueWait come back in
// expired, to be failed rather than sent late (see expiredLocked).
func (s *Store) take(now time.Time) (ops, expired []*op, barrier *op) {
	s.mu.Lock()
	defer s.mu.Unlock()
	expired = s.expiredLocked(now)
	n, bytes := 0, 0
	for n < len(s.queue) && len(ops) < s.cfg.MaxBatchOps {
		o := s.queue[n]
		if o.w == nil {
			if len(ops) == 0 && len(expired) == 0 {
				barrier = o
				n++
			}
			break
		}
		if len(ops) > 0 && bytes+o.size > s.cfg.MaxBatchBytes {
			break
		}
		if ops == nil {
			ops = make([]*op, 0, min(len(s.queue)-n, s.cfg.MaxBatchOps))
		}
		ops = append(ops, o)
		bytes += o.size
		n++
	}
	s.dropHead(n)
	return ops, expired, barrier
}

// expiredLocked takes out of the queue the ops that waited longer than
// MaxQueueWait, and with each every later op of its session: one of those
// applied after an earlier write of its session failed would break the
// order the caller relies on (a session's deliveries stored in flight
// ahead of earlier ones left queued). Barriers stay. s.mu must be held.
func (s *Store) expiredLocked(now time.Time) (expired []*op) {
	cutoff := now.Add(-s.cfg.MaxQueueWait)
	if len(s.queue) == 0 || !s.queue[0].at.Before(cutoff) {
		return nil // ops queue in time order: none waited too long
	}
	var gone map[string]bool
	kept := s.queue[:0]
	for _, o := range s.queue {
		id := ""
		if o.call != nil {
			id = o.call.id
		}
		if o.w != nil && (o.at.Before(cutoff) || (id != "" && gone[id])) {
			expired = append(expired, o)
			if id != "" {
				if gone == nil {
					gone = map[string]bool{}
				}
				gone[id] = true
			}
			continue
		}
		kept = append(kept, o)
	}
	clear(s.queue[len(kept):])
	s.queue = kept
	return expired
}

// dropHead removes the first n queued ops. s.mu must be held.
func (s *Store) dropHead(n int) {
	if n == 0 {
		return
	}
	clear(s.queue[:n])
	s.queue = s.queue[n:]
	if len(s.queue) == 0 && cap(s.queue) > 4096 {
		s.queue = nil // let a burst's backing array go
	}
}

func (s *Store) queueLen() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.queue)
}

// expire fails queued ops older than MaxQueueWait (while no stream takes
// them), with the later ops of their sessions, and answers the barriers
// they held up.
func (s *Store) expire(now time.Time) {
	s.mu.Lock()
	old := s.expiredLocked(now)
	n := 0
	for n < len(s.queue) && s.queue[n].w == nil {
		n++
	}
	old = append(old, s.queue[:n]...)
	s.dropHead(n)
	s.mu.Unlock()
	for _, o := range old {
		s.answerExpired(o)
	}
}

func (s *Store) answerExpired(o *op) {
	if o.w == nil {
		s.answer(o, nil, statusOK)
		return
	}
	s.answer(o, fmt.Errorf("%w: no answer from the persistence service within %v", ErrUnavailable, s.cfg.MaxQueueWait), statusExpired)
}

// failQueued fails everything still queued (the store stopped).
func (s *Store) failQueued() {
	s.mu.Lock()
	old := s.queue
	s.queue = nil
	s.mu.Unlock()
	for _, o := range old {
		if o.w == nil {
			s.answer(o, nil, statusOK)
		} else {
			s.answer(o, ErrClosed, statusClosed)
		}
	}
}

// answer reports one op's outcome to its caller. A barrier counts in no
// metric.
func (s *Store) answer(o *op, err error, status int) {
	if o.w != nil {
		s.m.byStatus[status].Inc()
	}
	c := o.call
	last, err := c.finish(err)
	if !last {
		return
	}
	if err != nil && o.w != nil {
		err = c.wrap(err)
	}
	if c.done != nil {
		c.done <- err
	} else if err != nil {
		s.logger.Debug("persistence write failed", "error", err)
	}
}

// run keeps a Write stream open, reconnecting with backoff, until the store
// is closed and everything queued was sent and answered (or Close's bound
// passed).
func (s *Store) run() {
	defer close(s.stopped)
	defer s.failQueued()
	backoff := s.cfg.ReconnectMin
	for attempt := 0; ; attempt++ {
		if s.ctx.Err() != nil || s.done() {
			return
		}
		if attempt > 0 {
			s.m.reconnects.Inc()
		}
		healthy, err := s.serve()
		if s.ctx.Err() != nil || s.done() {
			return
		}
		if healthy {
			backoff = s.cfg.ReconnectMin
		}
		s.logger.Warn("persistence write stream ended; reconnecting", "error", err, "backoff", backoff)
		closing := s.closingCh
		if s.isClosing() {
			closing = nil // already known: wait out the backoff, then try to flush once more
		}
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-closing:
		case <-s.ctx.Done():
		}
		t.Stop()
		s.expire(time.Now())
		backoff = min(2*backoff, s.cfg.ReconnectMax)
	}
}

func (s *Store) isClosing() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closing
}

// done reports whether the store is closing with nothing left to send.
func (s *Store) done() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closing && len(s.queue) == 0
}

// errStreamEnded stops the sender when the receiver saw the stream end.
var errStreamEnded = errors.New("write stream ended")

// serve runs one stream until it fails or the store is closed and drained.
// healthy reports whether the stream worked (answered a batch, or lived
// long enough), which resets the reconnect backoff. Ops sent on it and not
// answered fail when it ends: whether the service applied them is unknown,
// and retrying is their caller's choice.
func (s *Store) serve() (healthy bool, err error) {
	ctx, cancel := context.WithCancel(s.ctx)
	defer cancel()
	start := time.Now()
	l := &link{st: s.client.Write(ctx), slots: make(chan struct{}, s.cfg.MaxInflightBatches),
		progress: make(chan struct{}, 1), out: map[uint64]*batch{}}
	recv := make(chan error, 1)
	go func() { recv <- s.receive(l) }()
	var recvErr error
	received := false
	defer func() {
		cancel()
		_ = l.st.CloseRequest()
		if !received {
			recvErr = <-recv
		}
		_ = l.st.CloseResponse()
		s.failOutstanding(l, fmt.Errorf("%w: write stream ended before the answer: %v", ErrUnavailable, recvErr))
		healthy = l.answered.Load() || time.Since(start) > time.Second
		// A failed Send reports only EOF: the cause is what Receive saw.
		if errors.Is(err, errStreamEnded) || (errors.Is(err, io.EOF) && recvErr != nil) {
			err = recvErr
		}
	}()
	// Open the stream now, headers only, so that an unreachable service is
	// noticed (and retried with backoff) before writes wait on it.
	if err := l.st.Send(nil); err != nil {
		return false, fmt.Errorf("open write stream: %w", err)
	}
	closing := s.closingCh
	linger := time.NewTimer(time.Hour)
	linger.Stop()
	for {
		select {
		case <-s.wake:
		case <-l.progress:
		case <-closing:
			closing = nil // closed for good: from now on answers (progress) drive the drain
		case recvErr = <-recv:
			received = true
			return false, errStreamEnded
		}
		if s.cfg.Linger > 0 && l.outstanding() > 0 && s.queueLen() < s.cfg.MaxBatchOps {
			// Batches are in flight, so this one would queue behind them
			// anyway: let a few more callers join it.
			linger.Reset(s.cfg.Linger)
			select {
			case <-linger.C:
			case recvErr = <-recv:
				received = true
				return false, errStreamEnded
			}
		}
		for {
			select {
			case l.slots <- struct{}{}:
			case recvErr = <-recv:
				received = true
				return false, errStreamEnded
			}
			ops, expired, barrier := s.take(time.Now())
			for _, o := range expired {
				s.answerExpired(o)
			}
			if len(ops) == 0 {
				<-l.slots
				if barrier != nil {
					l.addBarrier(s.batchID, barrier, s)
				}
				if barrier == nil && len(expired) == 0 {
					break
				}
				continue
			}
			if err := s.send(l, ops); err != nil {
				return false, err
			}
		}
		if s.done() && l.outstanding() == 0 {
			return true, nil
		}
	}
}

// send writes one batch, registered first so that its answer finds it.
func (s *Store) send(l *link, ops []*op) error {
	s.batchID++
	id := s.batchID
	ws, at := mergeOps(ops)
	req := &persistencev1.WriteRequest{BatchId: id, Ops: ws}
	l.mu.Lock()
	l.out[id] = &batch{ops: ops, at: at, sent: time.Now()}
	l.mu.Unlock()
	s.m.batches.Inc()
	s.m.batchOps.Observe(float64(len(ops)))
	if err := l.st.Send(req); err != nil {
		return fmt.Errorf("send write batch: %w", err)
	}
	return nil
}

func (l *link) outstanding() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.out)
}

// addBarrier answers b once every batch up to after is answered.
func (l *link) addBarrier(after uint64, b *op, s *Store) {
	l.mu.Lock()
	l.barriers = append(l.barriers, barrierWait{after: after, o: b})
	ready := l.readyBarriersLocked()
	l.mu.Unlock()
	for _, o := range ready {
		s.answer(o, nil, statusOK)
	}
}

// readyBarriersLocked removes and returns the barriers with no batch up to
// theirs outstanding. l.mu must be held.
func (l *link) readyBarriersLocked() []*op {
	if len(l.barriers) == 0 {
		return nil
	}
	oldest := ^uint64(0)
	for id := range l.out {
		oldest = min(oldest, id)
	}
	var ready []*op
	kept := l.barriers[:0]
	for _, b := range l.barriers {
		if b.after < oldest {
			ready = append(ready, b.o)
		} else {
			kept = append(kept, b)
		}
	}
	l.barriers = kept
	return ready
}

// receive answers batches until the stream ends.
func (s *Store) receive(l *link) error {
	for {
		resp, err := l.st.Receive()
		if err != nil {
			return err
		}
		l.answered.Store(true)
		l.mu.Lock()
		b := l.out[resp.GetBatchId()]
		delete(l.out, resp.GetBatchId())
		ready := l.readyBarriersLocked()
		l.mu.Unlock()
		if b == nil {
			s.logger.Warn("persistence answered an unknown write batch", "batch_id", resp.GetBatchId())
			continue
		}
		s.m.write.Observe(time.Since(b.sent).Seconds())
		results := resp.GetResults()
		for i, o := range b.ops {
			st, msg := resp.GetStatus(), resp.GetError()
			var refused uint32
			if j := b.at[i]; j < len(results) {
				st, msg, refused = results[j].GetStatus(), results[j].GetError(), results[j].GetRefused()
			}
			status, err := statusError(st, msg)
			if err == nil && refused > 0 && o.w.GetAppend().GetLimits().GetTenantQuota() {
				// Such an append is never merged: it is one entry.
				status, err = statusQuota, durable.ErrQueueQuota
			}
			if status == statusInvalid {
				// The store checks every op before it is sent: this is a
				// disagreement about limits, worth seeing.
				s.logger.Error("persistence refused a write as invalid", "write", o.call.what, "error", msg)
			}
			s.answer(o, err, status)
		}
		for _, o := range ready {
			s.answer(o, nil, statusOK)
		}
		<-l.slots
		select {
		case l.progress <- struct{}{}:
		default:
		}
	}
}

// failOutstanding fails every batch still awaiting its answer on a stream
// that ended, and answers the barriers behind them.
func (s *Store) failOutstanding(l *link, err error) {
	l.mu.Lock()
	out := l.out
	l.out = map[uint64]*batch{}
	barriers := l.barriers
	l.barriers = nil
	l.mu.Unlock()
	for _, b := range out {
		for _, o := range b.ops {
			s.answer(o, err, statusBroken)
		}
	}
	for _, b := range barriers {
		s.answer(b.o, nil, statusOK)
	}
}

// statusError maps an op's status to the caller's error.
func statusError(st persistencev1.WriteStatus, msg string) (status int, err error) {
	switch st {
	case persistencev1.WriteStatus_WRITE_STATUS_OK:
		return statusOK, nil
	case persistencev1.WriteStatus_WRITE_STATUS_FENCED:
		return statusFenced, fmt.Errorf("%w: %s", ErrFenced, msg)
	case persistencev1.WriteStatus_WRITE_STATUS_NOT_REPLICATED:
		return statusNotReplicated, fmt.Errorf("%w: not replicated: %s", ErrUnavailable, msg)
	case persistencev1.WriteStatus_WRITE_STATUS_GROUP_FENCED:
		return statusGroupFenced, fmt.Errorf("%w: Redis group failed over: %s", ErrUnavailable, msg)
	case persistencev1.WriteStatus_WRITE_STATUS_INVALID_ARGUMENT:
		return statusInvalid, fmt.Errorf("%w: refused by the persistence service: %s", ErrInvalid, msg)
	}
	return statusUnavailable, fmt.Errorf("%w: %s: %s", ErrUnavailable, st, msg)
}

// mergeOps builds a batch's WriteOps: a session's appends join into one
// op, and so do its completes, as long as their fence (and queue limits)
// are the same and no other write of the session comes between. A busy
// session's messages then cost the service one op per kind and batch
// instead of two per message. at maps each op to the WriteOp carrying it.
//
// An op merged into an earlier one moves ahead of other sessions' ops;
// the service's store allows exactly that (see the persistence Redis
// store's merge): appends only take references to shared message records,
// completes only release them and never move past a send, and within the
// session appends and completes touch the queue and the in-flight set
// apart.
func mergeOps(ops []*op) (ws []*persistencev1.WriteOp, at []int) {
	type open struct {
		append, complete int // index in ws; -1: none
		sends            int // sends in the batch when complete was made
	}
	ws = make([]*persistencev1.WriteOp, 0, len(ops))
	at = make([]int, len(ops))
	sessions := make(map[string]*open, len(ops))
	owned := make(map[int]bool) // WriteOps built here, which may be extended
	sends := 0
	for i, o := range ops {
		w := o.w
		if w.GetSend() != nil {
			sends++
		}
		k := w.GetSession()
		key := k.GetTenant() + "\x00" + k.GetClientId()
		st := sessions[key]
		if st == nil {
			st = &open{append: -1, complete: -1}
			sessions[key] = st
		}
		switch {
		case w.GetAppend() != nil && w.GetAppend().GetLimits().GetTenantQuota():
			// Its own op, so that a refusal (a count) names its entry.
			st.append = -1
		case w.GetAppend() != nil:
			if j := st.append; j >= 0 && sameFence(ws[j], w) && proto.Equal(ws[j].GetAppend().GetLimits(), w.GetAppend().GetLimits()) &&
				len(ws[j].GetAppend().GetEntries())+len(w.GetAppend().GetEntries()) <= maxOpEntries {
				if !owned[j] {
					a := ws[j].GetAppend()
					ws[j] = &persistencev1.WriteOp{Session: ws[j].Session, Fence: ws[j].Fence, Op: &persistencev1.WriteOp_Append{
						Append: &persistencev1.AppendOp{Limits: a.Limits, Entries: slices.Clone(a.Entries), Messages: slices.Clone(a.Messages)}}}
					owned[j] = true
				}
				a := ws[j].GetAppend()
				a.Entries = append(a.Entries, w.GetAppend().GetEntries()...)
				a.Messages = append(a.Messages, w.GetAppend().GetMessages()...)
				at[i] = j
				continue
			}
			st.append = len(ws)
		case w.GetComplete() != nil:
			if j := st.complete; j >= 0 && st.sends == sends && sameFence(ws[j], w) &&
				len(ws[j].GetComplete().GetPacketIds())+len(w.GetComplete().GetPacketIds()) <= maxOpEntries {
				if !owned[j] {
					ws[j] = &persistencev1.WriteOp{Session: ws[j].Session, Fence: ws[j].Fence, Op: &persistencev1.WriteOp_Complete{
						Complete: &persistencev1.CompleteOp{PacketIds: slices.Clone(ws[j].GetComplete().GetPacketIds())}}}
					owned[j] = true
				}
				c := ws[j].GetComplete()
				c.PacketIds = append(c.PacketIds, w.GetComplete().GetPacketIds()...)
				at[i] = j
				continue
			}
			st.complete, st.sends = len(ws), sends
		default:
			st.append, st.complete = -1, -1
		}
		at[i] = len(ws)
		ws = append(ws, w)
	}
	return ws, at
}

func sameFence(a, b *persistencev1.WriteOp) bool {
	return a.GetFence().GetEpoch() == b.GetFence().GetEpoch() && a.GetFence().GetGroupEpoch() == b.GetFence().GetGroupEpoch()
}
