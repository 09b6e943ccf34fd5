// Package remotestore keeps the edge's durable MQTT state in the
// persistence service (Redis groups behind its Connect API) instead of on
// the edge's disk, so that edges hold nothing that must survive them and any
// edge can resume a session from the store alone.
//
// Writes travel on one long-lived Write stream, many callers' ops per
// batch, in the order they were submitted (the service applies them in the
// order received). Every session write carries the epoch last given to
// Activate for the session, and the service refuses it under an older
// epoch than the session's current one ([ErrFenced]): an edge that lost a
// session can no longer change it. A write is reported done only when the
// service answered it OK (applied and replicated); anything else, including
// a stream that broke before the answer, is an error, and nothing behind it
// may be acknowledged to a client.
package remotestore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/keelmq/keel/libs/rpc"
	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
	"github.com/keelmq/keel/proto/gen/keel/persistence/v1/persistencev1connect"
	"github.com/keelmq/keel/services/edge/internal/durable"
)

var (
	// ErrFenced means a newer epoch of the session exists: another edge
	// owns it now. The write was not applied; retrying cannot help.
	ErrFenced = durable.ErrFenced
	// ErrNotActive means the session has no epoch on this store: Activate
	// was not called for it, or it was deactivated. Nothing was sent.
	ErrNotActive = errors.New("session not active on this edge")
	// ErrUnavailable means the write is not known to be durable: not
	// replicated in time, the Redis group failed over, the service or its
	// store is unavailable, or the stream ended before the answer. It may
	// have been applied; every write is idempotent, so retrying is safe.
	ErrUnavailable = errors.New("persistence unavailable")
	// ErrInvalid means the write was refused as malformed; nothing of it
	// was stored.
	ErrInvalid = errors.New("invalid persistence write")
	// ErrClosed is returned after Close.
	ErrClosed = errors.New("persistence store closed")
)

// Config configures a Store. Zero fields take the defaults.
type Config struct {
	// URL is the base URL of the persistence service ("http://host:7402").
	URL string
	// HTTPClient speaks to it; default rpc.H2CClient() (h2c, HTTP/2 pings).
	HTTPClient *http.Client
	// MaxBatchOps bounds the ops of one write batch (default 512, at most
	// the service's 4096).
	MaxBatchOps int
	// MaxBatchBytes closes a batch at about this many bytes (default 4 MiB).
	MaxBatchBytes int
	// MaxInflightBatches bounds the batches awaiting their answer (default
	// 16; the service reads no further than 256). Beyond it ops wait and
	// join larger batches.
	MaxInflightBatches int
	// Linger is how long a batch waits for more ops while others are in
	// flight (default 50 µs; negative: never). With nothing in flight a
	// batch goes out at once, so an idle edge pays no latency for it.
	Linger time.Duration
	// MaxQueued bounds the ops waiting to be sent; beyond it writes fail at
	// once with ErrUnavailable (default 65536).
	MaxQueued int
	// MaxQueueWait fails an op not sent within it (no stream, or the
	// service too slow) rather than applying it late (default 5 s).
	MaxQueueWait time.Duration
	// ReconnectMin and ReconnectMax bound the backoff between streams
	// (defaults 50 ms and 2 s).
	ReconnectMin, ReconnectMax time.Duration
	// CloseTimeout bounds how long Close waits for queued writes to be
	// answered (default 5 s).
	CloseTimeout time.Duration
	// MaxPayload is the largest payload the service accepts (its
	// --max-payload; default 1 MiB). Larger messages are refused here, so
	// they do not fail the batch they would join.
	MaxPayload int
	// MaxRetained bounds the messages MatchRetained returns (default 0:
	// the service's cap).
	MaxRetained uint32
	// Registerer receives the metrics (nil: not registered).
	Registerer prometheus.Registerer
	// Logger (nil: discarded).
	Logger *slog.Logger
}

func (c *Config) setDefaults() {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	defDur := func(v *time.Duration, d time.Duration) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&c.MaxBatchOps, 512)
	c.MaxBatchOps = min(c.MaxBatchOps, maxBatchOps)
	def(&c.MaxBatchBytes, 4<<20)
	def(&c.MaxInflightBatches, 16)
	def(&c.MaxQueued, 1<<16)
	def(&c.MaxPayload, 1<<20)
	if c.Linger == 0 {
		c.Linger = 50 * time.Microsecond
	}
	defDur(&c.MaxQueueWait, 5*time.Second)
	defDur(&c.ReconnectMin, 50*time.Millisecond)
	defDur(&c.ReconnectMax, 2*time.Second)
	defDur(&c.CloseTimeout, 5*time.Second)
	if c.HTTPClient == nil {
		c.HTTPClient = rpc.H2CClient()
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
}

// Store is the edge's durable state in the persistence service. It
// implements broker.DurableState and broker.RetainedIndex.
type Store struct {
	cfg    Config
	client persistencev1connect.PersistenceServiceClient
	codec  codec
	logger *slog.Logger
	m      *metrics

	epochMu sync.RWMutex
	epochs  map[string]uint64 // internal client ID → epoch of this edge's writes

	mu      sync.Mutex
	queue   []*op // submitted, not yet sent, in submission order
	closing bool

	wake      chan struct{}
	closingCh chan struct{}
	stopped   chan struct{}
	ctx       context.Context // ends every stream when Close gives up waiting
	cancel    context.CancelFunc
	closeOnce sync.Once
	batchID   uint64 // last batch sent; only the sender goroutine touches it
}

// New returns a store writing to the service at cfg.URL. It connects in the
// background and keeps reconnecting; writes wait for a stream up to
// MaxQueueWait.
func New(cfg Config) (*Store, error) {
	if cfg.URL == "" {
		return nil, errors.New("remotestore: the persistence service URL is required")
	}
	cfg.setDefaults()
	ctx, cancel := context.WithCancel(context.Background())
	s := &Store{cfg: cfg, logger: cfg.Logger, m: newMetrics(cfg.Registerer), epochs: map[string]uint64{},
		client: persistencev1connect.NewPersistenceServiceClient(cfg.HTTPClient, cfg.URL, rpc.ClientOptions(connect.WithGRPC())...),
		codec:  codec{maxPayload: cfg.MaxPayload},
		wake:   make(chan struct{}, 1), closingCh: make(chan struct{}), stopped: make(chan struct{}), ctx: ctx, cancel: cancel}
	go s.run()
	return s, nil
}

// Close sends what is queued, waits (up to CloseTimeout) for the answers,
// and stops. Writes after Close fail with ErrClosed.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		s.closing = true
		s.mu.Unlock()
		close(s.closingCh)
		t := time.NewTimer(s.cfg.CloseTimeout)
		defer t.Stop()
		select {
		case <-s.stopped:
		case <-t.C:
			s.logger.Warn("persistence writes unanswered at close", "timeout", s.cfg.CloseTimeout)
		}
		s.cancel()
		<-s.stopped
	})
	return nil
}

// Load returns nothing: sessions of a shared store are loaded when their
// clients or custody bring them (LoadSession), and retained messages are
// looked up when subscriptions are made (MatchRetained).
func (s *Store) Load() ([]durable.SessionState, []durable.Message, error) { return nil, nil, nil }

// Shared is true: every edge reads and writes the same state.
func (s *Store) Shared() bool { return true }

// Activate makes epoch the session's current one in the service, and the
// epoch of this edge's writes for it. It fails with ErrFenced when a newer
// epoch is current already.
func (s *Store) Activate(ctx context.Context, id string, epoch uint64) error {
	if epoch == 0 {
		return fmt.Errorf("%w: activate %q: epoch 0", ErrInvalid, id)
	}
	key, err := sessionKey(id)
	if err != nil {
		return err
	}
	w := &persistencev1.WriteOp{Session: key, Fence: &persistencev1.Fence{Epoch: epoch},
		Op: &persistencev1.WriteOp_Activate{Activate: &persistencev1.ActivateOp{}}}
	// The epoch is this edge's from now on, before the Activate is even
	// queued: writes queued after it must not carry an older one (see
	// fenceAtSubmit). If the Activate fails, so do writes under the epoch
	// that a newer owner fenced.
	s.epochMu.Lock()
	if cur, ok := s.epochs[id]; !ok || epoch > cur {
		s.epochs[id] = epoch
	}
	s.epochMu.Unlock()
	return s.do(ctx, true, "activate", id, w)
}

// Deactivate forgets the session's epoch unless it is newer than epoch:
// later writes for it fail with ErrNotActive until it is activated again.
// Writes made before keep theirs. A newer epoch stays: it belongs to a copy
// of the session activated here after the one that goes (importing a
// session ends the copy it replaces only after activating the new one).
func (s *Store) Deactivate(id string, epoch uint64) {
	s.epochMu.Lock()
	if cur, ok := s.epochs[id]; ok && cur <= epoch {
		delete(s.epochs, id)
	}
	s.epochMu.Unlock()
}

// epoch returns the epoch this store writes the session under (false: not
// active).
func (s *Store) epoch(id string) (uint64, bool) {
	s.epochMu.RLock()
	defer s.epochMu.RUnlock()
	e, ok := s.epochs[id]
	return e, ok
}

// fenced returns the key and fence of a session's writes.
func (s *Store) fenced(id string) (*target, error) {
	key, err := sessionKey(id)
	if err != nil {
		return nil, err
	}
	epoch, ok := s.epoch(id)
	if !ok {
		return nil, fmt.Errorf("%w: %q", ErrNotActive, id)
	}
	return &target{id: id, key: key, fence: &persistencev1.Fence{Epoch: epoch}}, nil
}

// start submits one call's ops and returns what its caller may wait on:
// nothing to wait for when !wait (its outcome is only counted and logged).
func (s *Store) start(wait bool, what, id string, ws ...*persistencev1.WriteOp) *durable.Pending {
	if len(ws) == 0 {
		return durable.DonePending(nil)
	}
	c := newCall(what, id, len(ws), wait)
	ops := make([]op, len(ws))
	ptrs := make([]*op, len(ws))
	for i, w := range ws {
		ops[i] = op{w: w, call: c, size: opSize(w)}
		ptrs[i] = &ops[i]
	}
	if err := s.submit(ptrs...); err != nil {
		return durable.DonePending(c.wrap(err))
	}
	if !wait {
		return durable.DonePending(nil)
	}
	return durable.NewPending(c.done)
}

// do submits ops and, with wait, returns once they are answered (or ctx
// ends).
func (s *Store) do(ctx context.Context, wait bool, what, id string, ws ...*persistencev1.WriteOp) error {
	return s.start(wait, what, id, ws...).Wait(ctx)
}

// barrier returns once every write submitted before it is answered.
func (s *Store) barrier(ctx context.Context) error {
	c := newCall("barrier", "", 1, true)
	if err := s.submit(&op{call: c}); err != nil {
		return err
	}
	select {
	case err := <-c.done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// opSize estimates an op's encoded size, to bound a batch's bytes.
func opSize(w *persistencev1.WriteOp) int {
	n := 64
	switch x := w.GetOp().(type) {
	case *persistencev1.WriteOp_Append:
		for _, m := range x.Append.GetMessages() {
			n += 128 + len(m.GetPayload()) + len(m.GetTopic())
		}
	case *persistencev1.WriteOp_Send:
		n += 48 * len(x.Send.GetEntries())
	case *persistencev1.WriteOp_Dequeue:
		n += 48 * len(x.Dequeue.GetMsgIds())
	case *persistencev1.WriteOp_Complete:
		n += 4 * len(x.Complete.GetPacketIds())
	case *persistencev1.WriteOp_PutRetained:
		n += 128 + len(x.PutRetained.GetMessage().GetPayload())
	}
	return n
}
