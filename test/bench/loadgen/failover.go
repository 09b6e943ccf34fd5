package loadgen

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/keelmq/keel/test/bench/wire"
)

// The failover scenario:
//
//  1. cfg.Clients subscribers connect with clean session off, spread
//     round-robin over cfg.Addrs, each subscribed at QoS 1 to its own topic
//     <prefix>/<runid>/<i>.
//  2. One publisher, on the first address that will survive, publishes
//     round 0: one QoS 1 message to every topic, and waits for every PUBACK.
//  3. cfg.KillAfter later the generator sends SIGKILL to cfg.KillPID. Every
//     figure is timed from that instant. It then publishes round 1 the same
//     way.
//  4. A subscriber whose connection drops reconnects with the same client ID
//     and clean session off to the next address that is not cfg.KilledAddr,
//     and retries with a short backoff while refused (a Keel edge answers
//     "server unavailable" until the dead edge's lease has expired). The
//     publisher resends what is unacknowledged on the next surviving address
//     when its connection drops or a PUBACK takes longer than cfg.AckTimeout.
//  5. The run waits, at most cfg.RecoverTimeout from the kill, until every
//     subscriber is connected and every publish acknowledged, then at most
//     cfg.Drain until every acknowledged message has arrived. A message
//     acknowledged and never delivered is lost; a resent publish may
//     legitimately arrive twice, and counts as a duplicate.
//
// Message m = round*clients + i goes to subscriber i; its payload carries
// the run id, the round (in the publisher id field) and i (in the sequence
// field).

// foRounds is the number of publish rounds: before and after the kill.
const foRounds = 2

// Subscriber buffers: 10,000 subscribers must stay cheap. The reader grows
// its buffer when a packet needs it.
const (
	foSubReadBuf  = 512
	foSubWriteBuf = 128
)

// Reconnect backoff: doubled from min to max after each failed attempt,
// with jitter.
const (
	reconnectBackoffMin = 50 * time.Millisecond
	reconnectBackoffMax = time.Second
)

// errBrokerDisconnect is a DISCONNECT from the broker. MQTT 3.1.1 has none
// (only clients send DISCONNECT), but mochi, and so the Keel edge, sends
// one before it closes a connection.
var errBrokerDisconnect = errors.New("broker sent DISCONNECT")

// lostSample is how many lost messages the result lists one by one.
const lostSample = 20

// FailoverResult is what the failover scenario measured. Times are seconds
// from the kill (from the start of round 1 when nothing was killed).
type FailoverResult struct {
	Addrs      []string `json:"addrs"`
	KilledAddr string   `json:"killed_addr,omitempty"`
	KilledPID  int      `json:"killed_pid,omitempty"`
	// KilledAt is the wall-clock time of the kill, to compare with logs.
	KilledAt time.Time `json:"killed_at"`
	// OnKilled is how many subscribers were connected to the killed edge.
	OnKilled int `json:"clients_on_killed"`
	// Dropped subscribers lost their connection at least once; Back of them
	// were connected again at the end; NotBack were not.
	Dropped int `json:"clients_dropped"`
	Back    int `json:"clients_back"`
	NotBack int `json:"clients_not_back"`
	// SubDrops counts why subscriber connections ended.
	SubDrops map[string]uint64 `json:"subscriber_drops,omitempty"`
	// Per dropped subscriber, kill → its last successful reconnect.
	FirstBackSec     float64 `json:"first_back_seconds"`
	ReconnectP50Sec  float64 `json:"reconnect_p50_seconds"`
	ReconnectP99Sec  float64 `json:"reconnect_p99_seconds"`
	ReconnectMaxSec  float64 `json:"reconnect_max_seconds"` // = the last one back
	SessionsNotFound int     `json:"sessions_not_present,omitempty"`

	// Round0Sec is how long round 0 took, first publish to last PUBACK,
	// with every edge up: the baseline for round 1.
	Round0Sec float64 `json:"round0_seconds"`
	// DeliveredAtKill is how many round-0 messages had arrived at the kill.
	DeliveredAtKill int `json:"round0_delivered_at_kill"`
	// Round1AckedSec: kill → the last round-1 PUBACK.
	Round1AckedSec float64 `json:"round1_acked_seconds"`
	// AllDeliveredSec: kill → the last first delivery of an acknowledged message.
	AllDeliveredSec float64 `json:"all_delivered_seconds"`
	// Round-1 messages to the subscribers that started on the killed edge:
	// kill → the first and the last of them delivered; and the last to the
	// other subscribers.
	Round1KilledFirstSec float64 `json:"round1_killed_first_delivered_seconds"`
	Round1KilledLastSec  float64 `json:"round1_killed_last_delivered_seconds"`
	Round1OthersLastSec  float64 `json:"round1_others_last_delivered_seconds"`
	// Recovered: every subscriber back, every publish acknowledged and
	// delivered. RecoveredSec is then the later of the last reconnect and
	// the last delivery.
	Recovered    bool    `json:"recovered"`
	RecoveredSec float64 `json:"recovered_seconds,omitempty"`

	LostBefore uint64 `json:"lost_round0"` // published before the kill
	LostAfter  uint64 `json:"lost_round1"` // published after the kill
	// LostByEdge counts lost messages by the address their subscriber first
	// connected to.
	LostByEdge map[string]uint64 `json:"lost_by_first_edge,omitempty"`
	LostMsgs   []LostMsg         `json:"lost_sample,omitempty"`

	// Reconnection attempts by subscribers and why the failed ones failed
	// (refusals by CONNACK return code, dial errors, timeouts, ...).
	Attempts uint64            `json:"reconnect_attempts"`
	Refusals map[string]uint64 `json:"refusals,omitempty"`

	// The publisher: connections it opened, PUBACK waits it gave up on,
	// publishes it sent again, and why its connections ended.
	PubConns       int               `json:"publisher_connections"`
	PubAckTimeouts int               `json:"publisher_ack_timeouts"`
	PubResent      uint64            `json:"publisher_resent"`
	PubDrops       map[string]uint64 `json:"publisher_drops,omitempty"`
}

// LostMsg is one acknowledged message that never arrived.
type LostMsg struct {
	Client    int     `json:"client"`
	Round     int     `json:"round"`
	FirstAddr string  `json:"first_addr"`
	LastAddr  string  `json:"last_addr"`
	Drops     int     `json:"drops"`
	AckedSec  float64 `json:"acked_seconds"` // from the kill; negative: before it
	BackSec   float64 `json:"back_seconds,omitempty"`
}

// foSub is one persistent subscriber. Its reading goroutine owns the
// connection; the atomics are read by the run.
type foSub struct {
	i        int
	clientID string
	topic    []byte
	first    int          // address of the first connection
	addr     atomic.Int32 // address of the current or last connection
	cur      atomic.Pointer[client]
	up       atomic.Bool
	drops    atomic.Uint32
	upAt     atomic.Int64 // since epoch: the last successful reconnect
	notFound atomic.Bool  // a reconnect found no session
	err      error
}

// failover is a running failover scenario.
type failover struct {
	cfg    *Config
	runID  uint32
	n      int
	killed int // index of cfg.KilledAddr in cfg.Addrs, or -1
	epoch  time.Time
	ctx    context.Context // canceled when the run closes its connections
	cancel context.CancelFunc

	subs        []*foSub
	ackedAt     []atomic.Int64 // per message, since epoch; 0: not acknowledged
	deliveredAt []atomic.Int64 // per message, first delivery; 0: never
	dup         atomic.Uint64
	foreign     atomic.Uint64
	closing     atomic.Bool
	sem         chan struct{} // bounds parallel reconnects
	attempts    atomic.Uint64

	refMu    sync.Mutex
	refusals map[string]uint64
	subDrops map[string]uint64
}

// now is the time since the epoch, never 0 (0 means "not yet").
func (f *failover) now() time.Duration { return max(time.Since(f.epoch), 1) }

func (f *failover) refused(reason string) {
	f.refMu.Lock()
	f.refusals[reason]++
	f.refMu.Unlock()
}

// runFailover runs the failover scenario end to end.
func runFailover(ctx context.Context, cfg *Config, runID uint32) (*Result, error) {
	n := cfg.Clients
	f := &failover{
		cfg: cfg, runID: runID, n: n, killed: addrIndex(cfg.Addrs, cfg.KilledAddr),
		epoch: time.Now(), subs: make([]*foSub, n),
		ackedAt: make([]atomic.Int64, foRounds*n), deliveredAt: make([]atomic.Int64, foRounds*n),
		sem: make(chan struct{}, cfg.ConnectConcurrency), refusals: map[string]uint64{},
		subDrops: map[string]uint64{},
	}
	f.ctx, f.cancel = context.WithCancel(ctx)
	defer f.cancel()
	for i := range f.subs {
		s := &foSub{
			i: i, clientID: fmt.Sprintf("kb%08x-f%d", runID, i),
			topic: fmt.Appendf(nil, "%s/%08x/%d", cfg.TopicPrefix, runID, i),
			first: i % len(cfg.Addrs),
		}
		s.addr.Store(int32(s.first))
		f.subs[i] = s
	}

	var readers sync.WaitGroup
	defer func() {
		f.close()
		readers.Wait()
	}()
	err := forEach(ctx, n, cfg.ConnectConcurrency, func(ctx context.Context, i int) error {
		s := f.subs[i]
		c, _, err := dialResume(ctx, cfg, cfg.Addrs[s.first], s.clientID, foSubReadBuf, false)
		if err != nil {
			return fmt.Errorf("subscriber %d: %w", i, err)
		}
		c.w = wire.NewWriter(c.conn, foSubWriteBuf)
		if err := c.subscribe(string(s.topic), 1); err != nil {
			c.conn.Close()
			return fmt.Errorf("subscriber %d: %w", i, err)
		}
		s.cur.Store(c)
		s.up.Store(true)
		return nil
	})
	if err != nil {
		f.endSessions()
		return nil, err
	}
	for _, s := range f.subs {
		readers.Go(func() { s.err = f.subscriberLoop(s) })
	}

	pub := newFoPublisher(f)
	defer pub.stop()
	round0, cancel0 := context.WithTimeout(f.ctx, cfg.RecoverTimeout)
	t0 := time.Now()
	err = pub.publish(round0, 0)
	round0Took := time.Since(t0)
	cancel0()
	if err != nil {
		f.close()
		readers.Wait()
		f.endSessions()
		return nil, fmt.Errorf("round 0 (before the kill): %w", err)
	}

	sleepUntil(ctx, time.Now().Add(cfg.KillAfter))
	if err := f.kill(); err != nil {
		f.close()
		readers.Wait()
		f.endSessions()
		return nil, err
	}
	smp := sampler{}
	s0 := smp.take()
	killAt := f.now()
	deliveredAtKill := 0
	for i := range n {
		if f.deliveredAt[i].Load() != 0 {
			deliveredAtKill++
		}
	}

	deadline := f.epoch.Add(killAt + cfg.RecoverTimeout)
	round1, cancel1 := context.WithDeadline(f.ctx, deadline)
	defer cancel1()
	pubDone := make(chan struct{})
	var pubErr error
	go func() {
		defer close(pubDone)
		pubErr = pub.publish(round1, 1)
	}()
	// Everyone back and everything acknowledged, then everything delivered.
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if isClosed(pubDone) && f.allUp() {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	drainEnd := time.Now().Add(cfg.Drain)
	for time.Now().Before(drainEnd) && ctx.Err() == nil && !f.allDelivered() {
		time.Sleep(10 * time.Millisecond)
	}
	s1 := smp.take()
	end := f.now()
	f.close()
	<-pubDone
	readers.Wait()
	if err := ctx.Err(); err != nil {
		f.endSessions()
		return nil, err
	}

	raw := f.raw(killAt, deliveredAtKill)
	fr := raw.figures(cfg)
	fr.PubConns, fr.PubAckTimeouts, fr.PubResent, fr.PubDrops = pub.conns, pub.ackTimeouts, pub.resent, pub.drops
	fr.KilledAt = f.epoch.Add(killAt).UTC()
	fr.Round0Sec = round0Took.Seconds()
	fr.Attempts = f.attempts.Load()
	fr.Refusals, fr.SubDrops = f.refusals, f.subDrops
	r := &Result{
		Broker: cfg.Broker, Label: cfg.Label, Scenario: cfg.Scenario, QoS: cfg.QoS, Size: cfg.Size,
		Clients: n, Pubs: 1, Subs: n, Inflight: cfg.Inflight, Unit: "s to recover",
		Seconds: (end - killAt).Seconds(), Rate: fr.RecoveredSec,
		Sent: pub.sent, Dup: f.dup.Load(), Foreign: f.foreign.Load(),
		GenCores: (s1.self - s0.self).Seconds() / s1.at.Sub(s0.at).Seconds(), OtherCores: otherCores(s0, s1),
		Failover: &fr,
	}
	for m := range f.ackedAt {
		if f.ackedAt[m].Load() != 0 {
			r.Acked++
		}
		if f.deliveredAt[m].Load() != 0 {
			r.Delivered++
		}
	}
	r.Delivered += r.Dup
	r.Lost = fr.LostBefore + fr.LostAfter
	r.Unacked = r.Sent - r.Acked
	var errs []error
	// Round 1 ends at the recover deadline, or when the run closes.
	if pubErr != nil && !errors.Is(pubErr, context.DeadlineExceeded) && !errors.Is(pubErr, context.Canceled) {
		errs = append(errs, fmt.Errorf("publisher: %w", pubErr))
	}
	for _, s := range f.subs {
		if s.err != nil {
			errs = append(errs, fmt.Errorf("subscriber %d: %w", s.i, s.err))
		}
	}
	if len(errs) > 0 {
		r.Errors = len(errs)
		r.FirstError = errs[0].Error()
	}
	f.endSessions()
	return r, nil
}

// kill sends SIGKILL to cfg.KillPID (or runs the test's kill function).
func (f *failover) kill() error {
	switch {
	case f.cfg.kill != nil:
		return f.cfg.kill()
	case f.cfg.KillPID > 0:
		if err := syscall.Kill(f.cfg.KillPID, syscall.SIGKILL); err != nil {
			return fmt.Errorf("kill %d: %w", f.cfg.KillPID, err)
		}
	}
	return nil
}

func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

func (f *failover) allUp() bool {
	for _, s := range f.subs {
		if !s.up.Load() {
			return false
		}
	}
	return true
}

// allDelivered reports whether every acknowledged message has arrived.
func (f *failover) allDelivered() bool {
	for m := range f.ackedAt {
		if f.ackedAt[m].Load() != 0 && f.deliveredAt[m].Load() == 0 {
			return false
		}
	}
	return true
}

// close ends the run: reconnects stop, every connection is closed. It may
// run more than once.
func (f *failover) close() {
	f.closing.Store(true)
	f.cancel()
	_ = forEach(context.Background(), len(f.subs), 16, func(_ context.Context, i int) error {
		if c := f.subs[i].cur.Load(); c != nil {
			c.disconnect()
		}
		return nil
	})
}

// endSessions connects every client ID once with a clean session on a
// surviving address, so that later runs do not queue for this one's
// subscribers.
func (f *failover) endSessions() {
	_ = forEach(context.Background(), len(f.subs), f.cfg.ConnectConcurrency, func(ctx context.Context, i int) error {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		a := nextAddr(len(f.cfg.Addrs), f.killed, i%len(f.cfg.Addrs)-1)
		if c, err := dial(ctx, f.cfg, f.cfg.Addrs[a], f.subs[i].clientID, 64); err == nil {
			c.disconnect()
		}
		return nil
	})
}

// subscriberLoop reads deliveries and reconnects after a drop, until the run
// closes.
func (f *failover) subscriberLoop(s *foSub) error {
	for {
		c := s.cur.Load()
		err := f.read(s, c)
		_ = c.conn.Close()
		if f.closing.Load() {
			return nil
		}
		if !isDrop(err) {
			return err
		}
		f.refMu.Lock()
		f.subDrops[dropReason(err)]++
		f.refMu.Unlock()
		s.up.Store(false)
		s.drops.Add(1)
		if !f.reconnect(s) {
			return nil
		}
	}
}

// isDrop reports whether err is a connection that ended rather than a
// protocol error.
func isDrop(err error) bool {
	var ne net.Error
	return errors.Is(err, errBrokerDisconnect) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, net.ErrClosed) || errors.Is(err, syscall.EPIPE) || errors.As(err, &ne)
}

// reconnect connects s again, with its session, to the next surviving
// address, and retries there with backoff while refused. It reports false
// when the run closed first.
func (f *failover) reconnect(s *foSub) bool {
	target := nextAddr(len(f.cfg.Addrs), f.killed, int(s.addr.Load()))
	backoff := reconnectBackoffMin
	for {
		select {
		case f.sem <- struct{}{}:
		case <-f.ctx.Done():
			return false
		}
		f.attempts.Add(1)
		c, present, err := dialResume(f.ctx, f.cfg, f.cfg.Addrs[target], s.clientID, foSubReadBuf, false)
		if err == nil {
			c.w = wire.NewWriter(c.conn, foSubWriteBuf)
			if !present {
				// The session is gone: what was queued for it is lost.
				// Subscribe again, so that later messages are still counted.
				s.notFound.Store(true)
				if err = c.subscribe(string(s.topic), 1); err != nil {
					c.conn.Close()
					err = fmt.Errorf("subscribe: %w", err)
				}
			}
		}
		<-f.sem
		if err == nil {
			s.addr.Store(int32(target))
			s.cur.Store(c)
			s.upAt.Store(int64(f.now()))
			s.up.Store(true)
			if f.closing.Load() {
				c.disconnect()
				return false
			}
			return true
		}
		if f.ctx.Err() != nil {
			return false
		}
		f.refused(refusalReason(err))
		if !errors.Is(err, ErrRefused) {
			// Not an MQTT answer: try the next surviving address.
			target = nextAddr(len(f.cfg.Addrs), f.killed, target)
		}
		sleepUntil(f.ctx, time.Now().Add(jitter(backoff)))
		backoff = min(2*backoff, reconnectBackoffMax)
	}
}

// jitter returns a duration in [d/2, d).
func jitter(d time.Duration) time.Duration {
	return d/2 + rand.N(d/2+1)
}

// read handles one connection's deliveries until it ends. It sends PINGREQ
// when the connection has been quiet for half the keep alive.
func (f *failover) read(s *foSub, c *client) error {
	ka := time.Duration(f.cfg.KeepAlive) * time.Second / 2
	dirty := false
	c.r.BeforeRead = func() error {
		if ka > 0 {
			_ = c.conn.SetReadDeadline(time.Now().Add(ka))
		}
		if !dirty {
			return nil
		}
		dirty = false
		return c.w.Flush()
	}
	for {
		h, body, err := c.r.Next()
		if err != nil {
			if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() && ka > 0 && !f.closing.Load() {
				c.w.Raw(wire.AppendPingreq(nil))
				dirty = true
				continue
			}
			return fmt.Errorf("read: %w", err)
		}
		switch h >> 4 {
		case wire.Publish:
			_, payload, pid, err := wire.DecodePublish(h&0x0f, body)
			if err != nil {
				return err
			}
			if (h>>1)&3 == 1 {
				c.w.Ack(wire.Puback, pid)
				dirty = true
			}
			f.deliver(s, payload)
		case wire.Disconnect:
			return errBrokerDisconnect
		case wire.Pingresp, wire.Suback:
		default:
			return fmt.Errorf("subscriber got packet type %d", h>>4)
		}
	}
}

// deliver records one PUBLISH received by s.
func (f *failover) deliver(s *foSub, payload []byte) {
	if len(payload) < headerSize || binary.BigEndian.Uint32(payload[offRun:]) != f.runID {
		f.foreign.Add(1)
		return
	}
	round := binary.BigEndian.Uint32(payload[offPub:])
	i := binary.BigEndian.Uint64(payload[offSeq:])
	if round >= foRounds || i != uint64(s.i) {
		f.foreign.Add(1)
		return
	}
	if !f.deliveredAt[int(round)*f.n+s.i].CompareAndSwap(0, int64(f.now())) {
		f.dup.Add(1)
	}
}

// foPublisher is the failover scenario's one publisher. Its fields are
// owned by the goroutine calling publish; its connection's acks arrive on
// events.
type foPublisher struct {
	f       *failover
	addr    int
	c       *client
	events  chan foEvent
	done    chan struct{}
	pending map[uint16]foPending
	nextPID uint16
	payload []byte

	published   bitset
	sent        uint64 // distinct messages published
	conns       int
	ackTimeouts int
	resent      uint64
	drops       map[string]uint64
}

type foEvent struct {
	c   *client
	pid uint16
	err error
}

type foPending struct {
	m  int
	at time.Time
}

func newFoPublisher(f *failover) *foPublisher {
	p := &foPublisher{
		f: f, addr: nextAddr(len(f.cfg.Addrs), f.killed, -1),
		events: make(chan foEvent, 1024), done: make(chan struct{}),
		pending: map[uint16]foPending{}, payload: make([]byte, f.cfg.Size), drops: map[string]uint64{},
	}
	for i := headerSize; i < len(p.payload); i++ {
		p.payload[i] = byte(i)
	}
	binary.BigEndian.PutUint32(p.payload[offRun:], f.runID)
	return p
}

// stop closes the publisher's connection and ends its ack reader.
func (p *foPublisher) stop() {
	close(p.done)
	if p.c != nil {
		p.c.disconnect()
		p.c = nil
	}
}

// publish sends one QoS 1 message to every subscriber and returns once all
// are acknowledged, resending on another address when the connection drops
// or an ack is late.
func (p *foPublisher) publish(ctx context.Context, round int) error {
	f := p.f
	queue := make([]int, f.n)
	for i := range queue {
		queue[i] = round*f.n + i
	}
	window := max(1, f.cfg.Inflight)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for len(queue) > 0 || len(p.pending) > 0 {
		if p.c == nil {
			if err := p.connect(ctx); err != nil {
				return err
			}
		}
		for len(p.pending) < window && len(queue) > 0 {
			m := queue[0]
			queue = queue[1:]
			pid := p.allocPID()
			binary.BigEndian.PutUint32(p.payload[offPub:], uint32(m/f.n))
			binary.BigEndian.PutUint64(p.payload[offSeq:], uint64(m%f.n))
			binary.BigEndian.PutUint64(p.payload[offSent:], uint64(f.now()))
			p.c.w.Publish(f.subs[m%f.n].topic, p.payload, 1, pid)
			p.pending[pid] = foPending{m: m, at: time.Now()}
			if !p.published.set(uint64(m)) {
				p.sent++
			}
		}
		if err := p.c.w.Flush(); err != nil {
			queue = p.drop("write: "+dropReason(err), queue)
			continue
		}
		oldest := time.Now()
		for _, pd := range p.pending {
			if pd.at.Before(oldest) {
				oldest = pd.at
			}
		}
		timer.Reset(time.Until(oldest.Add(f.cfg.AckTimeout)))
		select {
		case ev := <-p.events:
			queue = p.handle(ev, queue)
			for more := true; more && p.c != nil; {
				select {
				case ev := <-p.events:
					queue = p.handle(ev, queue)
				default:
					more = false
				}
			}
		case <-timer.C:
			p.ackTimeouts++
			queue = p.drop("no PUBACK within the ack timeout", queue)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// handle applies one event of the ack reader.
func (p *foPublisher) handle(ev foEvent, queue []int) []int {
	if ev.c != p.c {
		return queue // from a connection already given up
	}
	if ev.err != nil {
		return p.drop(dropReason(ev.err), queue)
	}
	if pd, ok := p.pending[ev.pid]; ok {
		delete(p.pending, ev.pid)
		p.f.ackedAt[pd.m].CompareAndSwap(0, int64(p.f.now()))
	}
	return queue
}

// allocPID returns a packet id that no pending publish uses.
func (p *foPublisher) allocPID() uint16 {
	for {
		p.nextPID++
		if p.nextPID == 0 {
			p.nextPID = 1
		}
		if _, used := p.pending[p.nextPID]; !used {
			return p.nextPID
		}
	}
}

// connect opens a connection on p.addr, moving on to the next surviving
// address after each failure.
func (p *foPublisher) connect(ctx context.Context) error {
	f := p.f
	backoff := reconnectBackoffMin
	for {
		c, err := dial(ctx, f.cfg, f.cfg.Addrs[p.addr], fmt.Sprintf("kb%08x-fp%d", f.runID, p.conns), 4096)
		if err == nil {
			c.w = wire.NewWriter(c.conn, bigWriteBuf)
			p.c = c
			p.conns++
			go p.ackLoop(c)
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		p.drops["connect: "+dropReason(err)]++
		p.addr = nextAddr(len(f.cfg.Addrs), f.killed, p.addr)
		sleepUntil(ctx, time.Now().Add(jitter(backoff)))
		backoff = min(2*backoff, reconnectBackoffMax)
	}
}

// drop gives the connection up and moves to the next surviving address.
// Every unacknowledged publish goes back to the front of the queue.
func (p *foPublisher) drop(why string, queue []int) []int {
	p.drops[why]++
	_ = p.c.conn.Close()
	p.c = nil
	p.addr = nextAddr(len(p.f.cfg.Addrs), p.f.killed, p.addr)
	again := make([]int, 0, len(p.pending)+len(queue))
	for _, pd := range p.pending {
		again = append(again, pd.m)
	}
	slices.Sort(again)
	p.resent += uint64(len(again))
	clear(p.pending)
	return append(again, queue...)
}

// ackLoop reads one publisher connection and forwards its PUBACKs.
func (p *foPublisher) ackLoop(c *client) {
	send := func(ev foEvent) bool {
		select {
		case p.events <- ev:
			return true
		case <-p.done:
			return false
		}
	}
	for {
		h, body, err := c.r.Next()
		if err != nil {
			send(foEvent{c: c, err: err})
			return
		}
		switch h >> 4 {
		case wire.Puback:
			if len(body) != 2 {
				send(foEvent{c: c, err: fmt.Errorf("puback: %w", wire.ErrMalformed)})
				return
			}
			if !send(foEvent{c: c, pid: binary.BigEndian.Uint16(body)}) {
				return
			}
		case wire.Pingresp:
		case wire.Disconnect:
			send(foEvent{c: c, err: errBrokerDisconnect})
			return
		default:
			send(foEvent{c: c, err: fmt.Errorf("publisher got packet type %d", h>>4)})
			return
		}
	}
}

// nextAddr returns the index of the first address after from, cyclically
// among n, that is not killed (-1: none is). With from = -1 it is the first
// surviving address.
func nextAddr(n, killed, from int) int {
	for k := 1; k <= n; k++ {
		if j := ((from+k)%n + n) % n; j != killed {
			return j
		}
	}
	return max(from, 0)
}

// refusalReason classifies a failed connection attempt.
func refusalReason(err error) string {
	if re, ok := errors.AsType[*RefusedError](err); ok {
		switch re.Code {
		case 1:
			return "rc1_unacceptable_protocol"
		case 2:
			return "rc2_identifier_rejected"
		case 3:
			return "rc3_server_unavailable"
		case 4:
			return "rc4_bad_credentials"
		case 5:
			return "rc5_not_authorized"
		}
		return fmt.Sprintf("rc%d", re.Code)
	}
	if errors.Is(err, ErrRefused) {
		return "subscribe_refused"
	}
	return errClass(err)
}

// dropReason is refusalReason, with the error's text when it is of no
// known kind.
func dropReason(err error) string {
	r := refusalReason(err)
	if r == "other" {
		r += ": " + err.Error()
		if len(r) > 100 {
			r = r[:100]
		}
	}
	return r
}

// errClass names a network error by kind.
func errClass(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, errBrokerDisconnect):
		return "broker_disconnect"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "connection_refused"
	case errors.Is(err, syscall.ECONNRESET):
		return "connection_reset"
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "closed_by_broker"
	case errors.Is(err, os.ErrDeadlineExceeded), errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	case errors.Is(err, net.ErrClosed), errors.Is(err, syscall.EPIPE):
		return "closed"
	}
	return "other"
}

// foRaw is what the run recorded, in the form the figures are computed
// from. Times are since the epoch; 0 means never.
type foRaw struct {
	addrs           []string
	killed          int
	killAt          time.Duration
	n               int
	first, last     []int // address indexes
	drops           []int
	upAt            []time.Duration // last reconnect
	up              []bool          // connected at the end
	notFound        []bool
	ackedAt         []time.Duration // per message: round*n + i
	deliveredAt     []time.Duration
	deliveredAtKill int
}

func (f *failover) raw(killAt time.Duration, deliveredAtKill int) *foRaw {
	r := &foRaw{
		addrs: f.cfg.Addrs, killed: f.killed, killAt: killAt, n: f.n,
		first: make([]int, f.n), last: make([]int, f.n), drops: make([]int, f.n),
		upAt: make([]time.Duration, f.n), up: make([]bool, f.n), notFound: make([]bool, f.n),
		ackedAt:     make([]time.Duration, len(f.ackedAt)),
		deliveredAt: make([]time.Duration, len(f.deliveredAt)), deliveredAtKill: deliveredAtKill,
	}
	for i, s := range f.subs {
		r.first[i], r.last[i], r.drops[i] = s.first, int(s.addr.Load()), int(s.drops.Load())
		r.upAt[i], r.up[i], r.notFound[i] = time.Duration(s.upAt.Load()), s.up.Load(), s.notFound.Load()
	}
	for m := range f.ackedAt {
		r.ackedAt[m] = time.Duration(f.ackedAt[m].Load())
		r.deliveredAt[m] = time.Duration(f.deliveredAt[m].Load())
	}
	return r
}

func sec(d time.Duration) float64 { return d.Seconds() }

// figures computes the failover result from what the run recorded.
func (r *foRaw) figures(cfg *Config) FailoverResult {
	fr := FailoverResult{Addrs: r.addrs, KilledAddr: cfg.KilledAddr, KilledPID: cfg.KillPID, DeliveredAtKill: r.deliveredAtKill}
	var h Histogram
	first := time.Duration(-1)
	for i := range r.n {
		if r.first[i] == r.killed {
			fr.OnKilled++
		}
		if r.notFound[i] {
			fr.SessionsNotFound++
		}
		if r.drops[i] == 0 {
			continue
		}
		fr.Dropped++
		if !r.up[i] {
			fr.NotBack++
			continue
		}
		fr.Back++
		d := max(r.upAt[i]-r.killAt, 0)
		h.Record(d)
		if first < 0 || d < first {
			first = d
		}
	}
	if h.Count() > 0 {
		fr.FirstBackSec = sec(first)
		fr.ReconnectP50Sec, fr.ReconnectP99Sec = sec(h.Quantile(0.5)), sec(h.Quantile(0.99))
		fr.ReconnectMaxSec = sec(h.Max())
	}
	unacked := 0
	for m, acked := range r.ackedAt {
		round, i := m/r.n, m%r.n
		if acked == 0 {
			unacked++
			continue
		}
		if round == 1 {
			fr.Round1AckedSec = max(fr.Round1AckedSec, sec(acked-r.killAt))
		}
		if d := r.deliveredAt[m]; d != 0 {
			ds := sec(d - r.killAt)
			fr.AllDeliveredSec = max(fr.AllDeliveredSec, ds)
			switch {
			case round != 1:
			case r.first[i] != r.killed:
				fr.Round1OthersLastSec = max(fr.Round1OthersLastSec, ds)
			default:
				if fr.Round1KilledLastSec == 0 || ds < fr.Round1KilledFirstSec {
					fr.Round1KilledFirstSec = ds
				}
				fr.Round1KilledLastSec = max(fr.Round1KilledLastSec, ds)
			}
			continue
		}
		if round == 0 {
			fr.LostBefore++
		} else {
			fr.LostAfter++
		}
		if fr.LostByEdge == nil {
			fr.LostByEdge = map[string]uint64{}
		}
		fr.LostByEdge[r.addrs[r.first[i]]]++
		if len(fr.LostMsgs) < lostSample {
			lm := LostMsg{
				Client: i, Round: round, FirstAddr: r.addrs[r.first[i]], LastAddr: r.addrs[r.last[i]],
				Drops: r.drops[i], AckedSec: sec(acked - r.killAt),
			}
			if r.drops[i] > 0 && r.up[i] {
				lm.BackSec = sec(r.upAt[i] - r.killAt)
			}
			fr.LostMsgs = append(fr.LostMsgs, lm)
		}
	}
	fr.Recovered = fr.NotBack == 0 && unacked == 0 && fr.LostBefore+fr.LostAfter == 0
	if fr.Recovered {
		fr.RecoveredSec = max(fr.ReconnectMaxSec, fr.AllDeliveredSec)
	}
	return fr
}

// String renders the failover figures for a terminal.
func (fr *FailoverResult) String() string {
	var b []byte
	killed := "nothing killed"
	if fr.KilledAddr != "" {
		killed = fmt.Sprintf("killed %s with %d clients on it", fr.KilledAddr, fr.OnKilled)
		if fr.KilledPID > 0 {
			killed = fmt.Sprintf("killed %s (pid %d) with %d clients on it", fr.KilledAddr, fr.KilledPID, fr.OnKilled)
		}
	}
	b = fmt.Appendf(b, "  %d edges; %s; times from the kill (%s)\n", len(fr.Addrs), killed, fr.KilledAt.Format("15:04:05.000Z"))
	b = fmt.Appendf(b, "  back: %d dropped, %d back, %d not back; first %.2fs  p50 %.2fs  p99 %.2fs  last %.2fs\n",
		fr.Dropped, fr.Back, fr.NotBack, fr.FirstBackSec, fr.ReconnectP50Sec, fr.ReconnectP99Sec, fr.ReconnectMaxSec)
	b = fmt.Appendf(b, "  subscriber connections ended:%s\n", mapString(fr.SubDrops))
	if fr.SessionsNotFound > 0 {
		b = fmt.Appendf(b, "  SESSIONS NOT PRESENT on reconnect: %d\n", fr.SessionsNotFound)
	}
	b = fmt.Appendf(b, "  round 0 (before the kill) took %.2fs, %d delivered at the kill; round 1 acknowledged at %.2fs; last acknowledged message delivered at %.2fs\n",
		fr.Round0Sec, fr.DeliveredAtKill, fr.Round1AckedSec, fr.AllDeliveredSec)
	b = fmt.Appendf(b, "  round 1 delivered: to the killed edge's subscribers from %.2fs to %.2fs; to the others by %.2fs\n",
		fr.Round1KilledFirstSec, fr.Round1KilledLastSec, fr.Round1OthersLastSec)
	b = fmt.Appendf(b, "  lost: %d published before the kill, %d after", fr.LostBefore, fr.LostAfter)
	if len(fr.LostByEdge) > 0 {
		b = fmt.Appendf(b, "; by first edge:%s", mapString(fr.LostByEdge))
	}
	b = append(b, '\n')
	b = fmt.Appendf(b, "  reconnect attempts %d; failed:%s\n", fr.Attempts, mapString(fr.Refusals))
	b = fmt.Appendf(b, "  publisher: %d connections, %d ack timeouts, %d resent; connections ended:%s\n",
		fr.PubConns, fr.PubAckTimeouts, fr.PubResent, mapString(fr.PubDrops))
	if fr.Recovered {
		b = fmt.Appendf(b, "  RECOVERED: everyone back and every acknowledged message delivered %.2fs after the kill\n", fr.RecoveredSec)
	} else {
		b = fmt.Appendf(b, "  NOT RECOVERED\n")
	}
	return string(b)
}

// mapString renders counts sorted by key, or " none".
func mapString(m map[string]uint64) string {
	if len(m) == 0 {
		return " none"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b []byte
	for _, k := range keys {
		b = fmt.Appendf(b, " %s=%d", k, m[k])
	}
	return string(b)
}
