// Package outputclient is the edge side of the output service: a bounded queue
// that takes messages from the MQTT publish path without ever blocking it,
// and a sender that streams them in batches to the output service's Publish
// RPC.
//
// Delivery is best-effort by design (DESIGN.md, Output): when the queue is
// full, or the output service refuses a record, the record is dropped and
// counted in keel_edge_output_dropped_total{reason}, and a warning is logged
// at most once per [Config].DropLogInterval. A batch sent but not yet
// acknowledged when the stream breaks is sent again on the next stream, so
// the output service may see a record twice (it carries its msgID).
//
// Only messages that match an output rule are queued. The output service
// sends the topic filters of its rules on the Publish stream, when it opens
// and after every reload that changes them; [Client.Offer] checks a message
// against the latest set before anything is built for it, and a message no
// rule matches costs a lookup and a counter
// (keel_edge_output_skipped_total). Until a set has arrived, and with an
// output service that sends none, every message is queued, as the output
// service then matches them itself.
//
// The edge creates one [Client], runs [Client.Run] in a goroutine it owns,
// and calls [Client.Offer] for every application message.
package outputclient

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/libs/topic"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	outputv1 "github.com/keelmq/keel/proto/gen/keel/output/v1"
	"github.com/keelmq/keel/proto/gen/keel/output/v1/outputv1connect"
)

// Defaults of [Config].
const (
	DefaultQueueRecords    = 10000
	DefaultQueueBytes      = 16 << 20
	DefaultMaxBatch        = 512
	DefaultInitialCredit   = 1 << 20
	DefaultDropLogInterval = 10 * time.Second
	DefaultBackoffMin      = 100 * time.Millisecond
	DefaultBackoffMax      = 5 * time.Second
)

// Drop reasons, the values of the reason label.
const (
	ReasonQueueFull = "queue_full" // the edge-side queue was full
	ReasonRefused   = "refused"    // the output service's buffers refused it
)

// Config configures a [Client].
type Config struct {
	// URL of the output service, e.g. "http://keel-output:9310".
	URL string `yaml:"url"`
	// EdgeID and Incarnation identify the sending edge.
	EdgeID      string `yaml:"edge_id"`
	Incarnation uint64 `yaml:"incarnation"`
	// QueueRecords and QueueBytes (payload bytes) bound the queue.
	QueueRecords int   `yaml:"queue_records"`
	QueueBytes   int64 `yaml:"queue_bytes"`
	// MaxBatch is the most records per Publish request.
	MaxBatch int `yaml:"max_batch"`
	// DropLogInterval is the least time between two drop warnings.
	DropLogInterval time.Duration `yaml:"drop_log_interval"`
	// BackoffMin and BackoffMax bound reconnect delays.
	BackoffMin time.Duration `yaml:"backoff_min"`
	BackoffMax time.Duration `yaml:"backoff_max"`
	// HTTPClient overrides the h2c client (test seam, or TLS).
	HTTPClient connect.HTTPClient `yaml:"-"`
}

func (c *Config) defaults() {
	if c.QueueRecords <= 0 {
		c.QueueRecords = DefaultQueueRecords
	}
	if c.QueueBytes <= 0 {
		c.QueueBytes = DefaultQueueBytes
	}
	if c.MaxBatch <= 0 {
		c.MaxBatch = DefaultMaxBatch
	}
	if c.DropLogInterval <= 0 {
		c.DropLogInterval = DefaultDropLogInterval
	}
	if c.BackoffMin <= 0 {
		c.BackoffMin = DefaultBackoffMin
	}
	if c.BackoffMax < c.BackoffMin {
		c.BackoffMax = max(DefaultBackoffMax, c.BackoffMin)
	}
}

// AllTenants is the tenant of a filter entry that applies to the messages of
// every tenant. It cannot be a tenant name.
const AllTenants = "*"

// Stats are counters since the client was created.
type Stats struct {
	Offered uint64 // Offer calls
	Skipped uint64 // matched no output rule, so not queued
	Queued  uint64 // taken into the queue
	Acked   uint64 // acknowledged by the output service as accepted
	Dropped uint64 // dropped, any reason
}

// matcher holds one filter set of the output service. It is immutable once
// built, so that Offer can read it without a lock.
type matcher struct {
	version uint64
	tenants map[string]*topic.Trie[struct{}]
	all     *topic.Trie[struct{}] // entry AllTenants; nil without one
}

func newMatcher(f *outputv1.RuleFilters) *matcher {
	m := &matcher{version: f.GetVersion(), tenants: make(map[string]*topic.Trie[struct{}], len(f.GetTenants()))}
	for _, tf := range f.GetTenants() {
		if len(tf.GetFilters()) == 0 {
			continue
		}
		tr := m.trie(tf.GetTenant())
		for _, fl := range tf.GetFilters() {
			tr.Add(fl, struct{}{})
		}
	}
	return m
}

// trie returns the trie of tenant's entry, adding it when missing.
func (m *matcher) trie(tenant string) *topic.Trie[struct{}] {
	if tenant == AllTenants {
		if m.all == nil {
			m.all = &topic.Trie[struct{}]{}
		}
		return m.all
	}
	tr := m.tenants[tenant]
	if tr == nil {
		tr = &topic.Trie[struct{}]{}
		m.tenants[tenant] = tr
	}
	return tr
}

// match reports whether a filter of tenant, or of every tenant, matches the
// topic name. An empty name matches nothing: the output service refuses it.
func (m *matcher) match(tenant, name string) bool {
	if name == "" {
		return false
	}
	return hit(m.tenants[tenant], name) || hit(m.all, name)
}

func hit(tr *topic.Trie[struct{}], name string) bool {
	if tr == nil {
		return false
	}
	found := false
	tr.Match(name, func(struct{}) bool {
		found = true
		return false
	})
	return found
}

// Client streams messages to the output service. Use [New].
type Client struct {
	cfg    Config
	logger *slog.Logger
	rpc    outputv1connect.OutputServiceClient

	// filters is the latest filter set of the output service; nil means
	// none, and every message is queued. Every Offer reads it and a skipped
	// one adds to skipped only (Offered is the sum of skipped and matched),
	// so the padding keeps both off the cache lines that queuing writes.
	filters atomic.Pointer[matcher]
	_       [56]byte
	skipped atomic.Uint64
	_       [56]byte

	mu     sync.Mutex
	q      []*commonv1.Message // q[head:] queued, oldest first; guarded by mu
	head   int
	qbytes int64
	notify chan struct{}

	matched, queued, acked, dropped atomic.Uint64
	dropsSinceLog                   atomic.Uint64
	dropLog                         logging.Every

	mDropFull, mDropRefused prometheus.Counter
	mSkipped                prometheus.CounterFunc
	mFiltersVersion         prometheus.Gauge
	mSent                   prometheus.Counter
	mQueue                  prometheus.Gauge
	mConnected              prometheus.Gauge
}

// New returns a client; nothing runs until [Client.Run]. reg may be nil.
func New(cfg Config, logger *slog.Logger, reg prometheus.Registerer) (*Client, error) {
	cfg.defaults()
	if !strings.HasPrefix(cfg.URL, "http://") && !strings.HasPrefix(cfg.URL, "https://") {
		return nil, fmt.Errorf("output client: url %q: want http://host:port", cfg.URL)
	}
	hc := cfg.HTTPClient
	if hc == nil {
		hc = rpc.H2CClient()
	}
	dropped := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "keel_edge_output_dropped_total",
		Help: "Messages for the output service dropped by the edge, by reason (queue_full, refused).",
	}, []string{"reason"})
	c := &Client{
		cfg: cfg, logger: logger,
		rpc:       outputv1connect.NewOutputServiceClient(hc, cfg.URL, rpc.ClientOptions()...),
		notify:    make(chan struct{}, 1),
		mDropFull: dropped.WithLabelValues(ReasonQueueFull), mDropRefused: dropped.WithLabelValues(ReasonRefused),
		mSent: prometheus.NewCounter(prometheus.CounterOpts{Name: "keel_edge_output_sent_total",
			Help: "Messages sent to the output service."}),
		mQueue: prometheus.NewGauge(prometheus.GaugeOpts{Name: "keel_edge_output_queue_records",
			Help: "Messages waiting in the edge's output queue."}),
		mConnected: prometheus.NewGauge(prometheus.GaugeOpts{Name: "keel_edge_output_connected",
			Help: "1 while the Publish stream to the output service is open."}),
	}
	// A function of the Stats counter, so that a skipped message costs one
	// atomic add.
	c.mSkipped = prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "keel_edge_output_skipped_total",
		Help: "Messages not sent to the output service because none of its rules matches them."},
		func() float64 { return float64(c.skipped.Load()) })
	c.mFiltersVersion = prometheus.NewGauge(prometheus.GaugeOpts{Name: "keel_edge_output_filters_version",
		Help: "Version of the output service's rule filters in use; 0 while every message is sent."})
	if reg != nil {
		for _, col := range []prometheus.Collector{dropped, c.mSent, c.mQueue, c.mConnected, c.mSkipped, c.mFiltersVersion} {
			if err := reg.Register(col); err != nil {
				return nil, fmt.Errorf("register output client metrics: %w", err)
			}
		}
	}
	return c, nil
}

// Offer queues the message of tenant published on topicName (as the
// tenant's clients see it) if an output rule matches it, and returns at
// once. build is called, before Offer returns, only then: a message no rule
// matches is counted as skipped and nothing is built for it. Offer returns
// false when the queue is full; the message is then dropped and counted.
// The message build returns must not be modified afterwards.
func (c *Client) Offer(tenant, topicName string, build func() *commonv1.Message) bool {
	if f := c.filters.Load(); f != nil && !f.match(tenant, topicName) {
		c.skipped.Add(1)
		return true
	}
	return c.enqueue(build())
}

// OfferMessage is [Client.Offer] for a message already built: it is queued
// if an output rule matches its tenant and topic.
func (c *Client) OfferMessage(m *commonv1.Message) bool {
	if f := c.filters.Load(); f != nil && !f.match(m.GetTenant(), m.GetTopic()) {
		c.skipped.Add(1)
		return true
	}
	return c.enqueue(m)
}

// Filters returns the version of the output service's filter set in use,
// and false while there is none (every message is queued).
func (c *Client) Filters() (version uint64, ok bool) {
	if f := c.filters.Load(); f != nil {
		return f.version, true
	}
	return 0, false
}

// setFilters switches to the filter set f, or with nil to queuing every
// message.
func (c *Client) setFilters(f *outputv1.RuleFilters) {
	if f == nil {
		c.mFiltersVersion.Set(0)
		if c.filters.Swap(nil) != nil {
			c.logger.Info("output service sends no rule filters: offering every message")
		}
		return
	}
	m := newMatcher(f)
	c.filters.Store(m)
	c.mFiltersVersion.Set(float64(m.version))
	c.logger.Info("output rule filters applied", "version", m.version, "tenants", len(f.GetTenants()))
}

func (c *Client) enqueue(m *commonv1.Message) bool {
	c.matched.Add(1)
	size := int64(len(m.GetPayload()))
	c.mu.Lock()
	if len(c.q)-c.head >= c.cfg.QueueRecords || c.qbytes+size > c.cfg.QueueBytes {
		c.mu.Unlock()
		c.drop(c.mDropFull, ReasonQueueFull, 1)
		return false
	}
	c.q = append(c.q, m)
	c.qbytes += size
	c.mu.Unlock()
	c.queued.Add(1)
	c.mQueue.Inc()
	select {
	case c.notify <- struct{}{}:
	default:
	}
	return true
}

// drop counts n drops and logs at most once per DropLogInterval.
func (c *Client) drop(ctr prometheus.Counter, reason string, n uint64) {
	ctr.Add(float64(n))
	c.dropped.Add(n)
	c.dropsSinceLog.Add(n)
	if !c.dropLog.Allow(c.cfg.DropLogInterval) {
		return
	}
	c.logger.Warn("output messages dropped", "dropped", c.dropsSinceLog.Swap(0), "reason", reason,
		"queue_records", c.cfg.QueueRecords)
}

// Stats returns the counters.
func (c *Client) Stats() Stats {
	skipped := c.skipped.Load()
	return Stats{Offered: c.matched.Load() + skipped, Skipped: skipped, Queued: c.queued.Load(), Acked: c.acked.Load(),
		Dropped: c.dropped.Load()}
}

// QueueLen returns the number of queued messages.
func (c *Client) QueueLen() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.q) - c.head
}

// take removes up to max messages (and at most maxBytes payload bytes, but
// at least one) from the queue.
func (c *Client) take(max int, maxBytes int64) ([]*commonv1.Message, int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	var bytes int64
	for c.head+n < len(c.q) && n < max {
		s := int64(len(c.q[c.head+n].GetPayload()))
		if n > 0 && bytes+s > maxBytes {
			break
		}
		bytes += s
		n++
	}
	if n == 0 {
		return nil, 0
	}
	out := make([]*commonv1.Message, n)
	copy(out, c.q[c.head:c.head+n])
	clear(c.q[c.head : c.head+n])
	c.head += n
	c.qbytes -= bytes
	if c.head == len(c.q) {
		c.q, c.head = c.q[:0], 0
	} else if c.head > 4096 && c.head > len(c.q)/2 {
		c.q = append(c.q[:0], c.q[c.head:]...)
		c.head = 0
	}
	c.mQueue.Sub(float64(n))
	return out, bytes
}

// batch is one sent, unacknowledged request.
type batch struct {
	req   *outputv1.PublishRequest
	bytes int64
}

// Run streams queued messages until ctx ends, reconnecting with backoff.
func (c *Client) Run(ctx context.Context) error {
	var unacked []*batch // carried over from a broken stream, resent first
	var nextID uint64
	delay := c.cfg.BackoffMin
	for ctx.Err() == nil {
		start := time.Now()
		var err error
		unacked, err = c.stream(ctx, unacked, &nextID)
		if ctx.Err() != nil {
			break
		}
		if time.Since(start) > 10*time.Second {
			delay = c.cfg.BackoffMin
		}
		c.logger.Warn("output stream ended, reconnecting", "error", err, "unacked_batches", len(unacked), "backoff", delay)
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
		case <-t.C:
		}
		delay = min(2*delay, c.cfg.BackoffMax)
	}
	return nil
}

// stream runs one Publish stream. It returns the batches still unacknowledged.
func (c *Client) stream(ctx context.Context, resend []*batch, nextID *uint64) ([]*batch, error) {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st := c.rpc.Publish(sctx)
	defer func() { _ = st.CloseRequest(); _ = st.CloseResponse() }()

	var (
		mu       sync.Mutex
		inflight = map[uint64]*batch{}
		order    []uint64 // batch IDs in send order
		inBytes  int64
		credit   = int64(DefaultInitialCredit)
		acked    = make(chan struct{}, 1)
	)
	unackedList := func() []*batch {
		mu.Lock()
		defer mu.Unlock()
		var out []*batch
		for _, id := range order {
			if b := inflight[id]; b != nil {
				out = append(out, b)
			}
		}
		return out
	}
	recvErr := make(chan error, 1)
	go func() {
		// The filter set of the previous stream stays in use until this
		// one's first response: while the output service is unreachable the
		// queue then keeps what its rules want, and an instance that sends
		// filters sends them first.
		first := true
		for {
			resp, err := st.Receive()
			if err != nil {
				recvErr <- err
				cancel()
				return
			}
			if f := resp.GetFilters(); f != nil || first {
				c.setFilters(f)
			}
			first = false
			mu.Lock()
			b := inflight[resp.GetBatchId()]
			delete(inflight, resp.GetBatchId())
			if b != nil {
				inBytes -= b.bytes
			}
			if cb := resp.GetCreditBytes(); cb > 0 {
				credit = int64(cb)
			}
			for len(order) > 0 && inflight[order[0]] == nil {
				order = order[1:]
			}
			mu.Unlock()
			c.acked.Add(uint64(resp.GetAccepted()))
			if d := resp.GetDropped(); d > 0 {
				c.drop(c.mDropRefused, ReasonRefused, uint64(d))
			}
			select {
			case acked <- struct{}{}:
			default:
			}
		}
	}()
	fail := func(err error) ([]*batch, error) {
		cancel()
		select {
		case e := <-recvErr:
			if err == nil {
				err = e
			}
		case <-time.After(time.Second):
		}
		c.mConnected.Set(0)
		return unackedList(), err
	}
	track := func(b *batch) {
		mu.Lock()
		inflight[b.req.GetBatchId()] = b
		order = append(order, b.req.GetBatchId())
		inBytes += b.bytes
		mu.Unlock()
	}
	transmit := func(b *batch) error {
		if err := st.Send(b.req); err != nil {
			return err
		}
		c.mSent.Add(float64(len(b.req.GetRecords())))
		return nil
	}
	// The batches of the broken stream are unacknowledged on this one from
	// its start: however early it breaks too, they are handed to the next.
	for _, b := range resend {
		track(b)
	}
	// An empty batch opens the stream, so that the output service sends its
	// filters, and is acknowledged at once, so that the first response comes
	// even from an instance that sends no filters. It is not tracked: there
	// is nothing in it to send again.
	*nextID++
	if err := st.Send(&outputv1.PublishRequest{BatchId: *nextID, EdgeId: c.cfg.EdgeID, Incarnation: c.cfg.Incarnation}); err != nil {
		return fail(err)
	}
	c.mConnected.Set(1)
	for _, b := range resend {
		if err := transmit(b); err != nil {
			return fail(err)
		}
	}
	for {
		mu.Lock()
		room := credit - inBytes
		mu.Unlock()
		if room <= 0 {
			select {
			case <-sctx.Done():
				return fail(context.Cause(sctx))
			case <-acked:
				continue
			}
		}
		msgs, bytes := c.take(c.cfg.MaxBatch, room)
		if msgs == nil {
			select {
			case <-sctx.Done():
				return fail(context.Cause(sctx))
			case <-c.notify:
				continue
			}
		}
		*nextID++
		req := &outputv1.PublishRequest{BatchId: *nextID, EdgeId: c.cfg.EdgeID, Incarnation: c.cfg.Incarnation,
			Records: make([]*outputv1.OutputRecord, len(msgs))}
		for i, m := range msgs {
			req.Records[i] = &outputv1.OutputRecord{Message: m}
		}
		b := &batch{req: req, bytes: bytes}
		track(b)
		if err := transmit(b); err != nil {
			return fail(err)
		}
	}
}
