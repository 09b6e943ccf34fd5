package loadgen

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/keelmq/keel/test/bench/wire"
)

// Payload header: run id, publisher id, sequence number, send time in
// nanoseconds since the run's epoch (monotonic clock). The rest is filler.
const (
	offRun     = 0
	offPub     = 4
	offSeq     = 8
	offSent    = 16
	headerSize = 24
)

// paddedU64 keeps hot per-subscriber counters on separate cache lines.
type paddedU64 struct {
	atomic.Uint64
	_ [56]byte
}

// publisher is one publishing connection and its closed-loop window.
//
// Window: the subscriber of slot s stores in high[s] one past the highest
// sequence number it has received from this publisher. The publisher keeps
// sent - max(min(high), floor) <= window. Delivery per publisher is ordered,
// so this counts exactly the messages in flight; a gap (lost QoS 0 message)
// is released by any later message, and a lost tail by the stall timeout,
// which moves floor up to sent.
type publisher struct {
	id     uint32
	topic  []byte
	c      *client
	qos    byte
	window uint64

	high    []paddedU64   // per subscriber slot
	waitFor atomic.Uint64 // nonzero: wake the publisher when a high reaches it
	wake    chan struct{}

	sent  atomic.Uint64 // messages published; written only by the publish loop
	floor uint64        // owned by the publish loop
	// Counters owned by the publish loop.
	stalls, pidWaits uint64

	// QoS 1/2: packet id slot -> seq+1 while unacknowledged.
	pidMask uint64
	pending []atomic.Uint64
	acked   bitset // written only by the ack reader
	ackedN  atomic.Uint64
	err     error // first error of the ack reader
}

func (p *publisher) minHigh() uint64 {
	m := p.high[0].Load()
	for i := 1; i < len(p.high); i++ {
		m = min(m, p.high[i].Load())
	}
	return m
}

// track is what one subscriber knows about one publisher.
type track struct {
	pub      *publisher
	seen     bitset
	next     uint64 // one past the highest sequence received
	dup, ooo uint64
}

// subscriber is one subscribing connection. Its fields other than total are
// owned by its reading goroutine until that goroutine has returned.
type subscriber struct {
	c      *client
	slot   int
	tracks []*track // by publisher id; nil for publishers it does not hear
	total  atomic.Uint64

	inWindow uint64
	hist     Histogram
	foreign  uint64
	err      error
}

// flow is a running fan-in, fan-out or pairs scenario.
type flow struct {
	cfg   *Config
	runID uint32
	pubs  []*publisher
	subs  []*subscriber

	epoch              time.Time
	winStart, winEnd   time.Duration // since epoch
	stop               atomic.Bool   // publishers stop
	closing            atomic.Bool   // connections are being closed on purpose
	closeOnce          sync.Once
	done               chan struct{}
	perMessageDeliverN uint64 // subscribers per message
}

func (f *flow) now() time.Duration { return time.Since(f.epoch) }

// runFlow runs a message scenario end to end.
func runFlow(ctx context.Context, cfg *Config, runID uint32) (*Result, error) {
	f := &flow{cfg: cfg, runID: runID, done: make(chan struct{})}
	nPubs, nSubs := cfg.Clients, cfg.Clients
	switch cfg.Scenario {
	case ScenarioFanIn:
		nSubs = 1
	case ScenarioFanOut:
		nPubs = 1
	}
	f.perMessageDeliverN = 1
	if cfg.Scenario == ScenarioFanOut {
		f.perMessageDeliverN = uint64(nSubs)
	}
	window := uint64(max(1, cfg.Inflight/nPubs))
	pidSpace := uint64(1024)
	for pidSpace < 4*window && pidSpace < 32768 {
		pidSpace <<= 1
	}

	prefix := cfg.TopicPrefix
	f.pubs = make([]*publisher, nPubs)
	for i := range f.pubs {
		var topic string
		switch cfg.Scenario {
		case ScenarioFanIn:
			topic = prefix + "/in/" + strconv.Itoa(i)
		case ScenarioFanOut:
			topic = prefix + "/out"
		default:
			topic = prefix + "/pair/" + strconv.Itoa(i)
		}
		p := &publisher{
			id: uint32(i), topic: []byte(topic), qos: byte(cfg.QoS), window: window,
			wake: make(chan struct{}, 1),
		}
		if cfg.Scenario == ScenarioFanOut {
			p.high = make([]paddedU64, nSubs)
		} else {
			p.high = make([]paddedU64, 1)
		}
		if p.qos > 0 {
			p.pidMask = pidSpace - 1
			p.pending = make([]atomic.Uint64, pidSpace)
		}
		f.pubs[i] = p
	}
	f.subs = make([]*subscriber, nSubs)
	for i := range f.subs {
		s := &subscriber{tracks: make([]*track, nPubs)}
		switch cfg.Scenario {
		case ScenarioFanIn:
			for j, p := range f.pubs {
				s.tracks[j] = &track{pub: p}
			}
		case ScenarioFanOut:
			s.slot = i
			s.tracks[0] = &track{pub: f.pubs[0]}
		default:
			s.tracks[i] = &track{pub: f.pubs[i]}
		}
		f.subs[i] = s
	}

	// Connect subscribers first, so nothing published is missed.
	defer f.closeAll()
	err := forEach(ctx, nSubs, cfg.ConnectConcurrency, func(ctx context.Context, i int) error {
		c, err := dialSession(ctx, cfg, cfg.SubAddr, fmt.Sprintf("kb%08x-s%d", runID, i), bigReadBuf, !cfg.Persistent)
		if err != nil {
			return fmt.Errorf("subscriber %d: %w", i, err)
		}
		c.w = wire.NewWriter(c.conn, 4096)
		f.subs[i].c = c
		var filter string
		switch cfg.Scenario {
		case ScenarioFanIn:
			filter = prefix + "/in/#"
		case ScenarioFanOut:
			filter = prefix + "/out"
		default:
			filter = prefix + "/pair/" + strconv.Itoa(i)
		}
		if err := c.subscribe(filter, byte(cfg.QoS)); err != nil {
			return fmt.Errorf("subscriber %d: %w", i, err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	err = forEach(ctx, nPubs, cfg.ConnectConcurrency, func(ctx context.Context, i int) error {
		c, err := dial(ctx, cfg, cfg.PubAddr, fmt.Sprintf("kb%08x-p%d", runID, i), 4096)
		if err != nil {
			return fmt.Errorf("publisher %d: %w", i, err)
		}
		c.w = wire.NewWriter(c.conn, bigWriteBuf)
		f.pubs[i].c = c
		return nil
	})
	if err != nil {
		return nil, err
	}

	smp := newSampler(cfg)
	f.epoch = time.Now()
	f.winStart = cfg.Warmup
	f.winEnd = cfg.Warmup + cfg.Duration

	var readers, writers sync.WaitGroup
	for _, s := range f.subs {
		readers.Go(func() { s.err = f.subscriberLoop(s) })
	}
	for _, p := range f.pubs {
		readers.Go(func() { p.err = f.ackLoop(p) })
	}
	pubErrs := make([]error, len(f.pubs))
	for i, p := range f.pubs {
		writers.Go(func() { pubErrs[i] = f.publishLoop(p) })
	}

	// Measured window.
	sleepUntil(ctx, f.epoch.Add(f.winStart))
	s0 := smp.take()
	sent0 := f.totalSent()
	sleepUntil(ctx, f.epoch.Add(f.winEnd))
	s1 := smp.take()
	sent1 := f.totalSent()
	f.stop.Store(true)
	close(f.done)
	// A publisher blocked in Write on a broker that stopped reading must not
	// hang the run.
	for _, p := range f.pubs {
		_ = p.c.conn.SetWriteDeadline(time.Now().Add(f.cfg.Drain + time.Second))
	}
	writers.Wait()
	if err := errors.Join(pubErrs...); err != nil && ctx.Err() == nil {
		return nil, fmt.Errorf("publish: %w", err)
	}

	f.drain(ctx)
	s2 := smp.take()
	f.closing.Store(true)
	f.closeAll()
	readers.Wait()
	if err := ctx.Err(); err != nil {
		return nil, err
	}

	r := f.result(s0, s1, s2, sent1-sent0)
	if smp.err != nil {
		r.BrokerSampleErr = smp.err.Error()
	}
	var errs []error
	for i, s := range f.subs {
		if s.err != nil {
			errs = append(errs, fmt.Errorf("subscriber %d: %w", i, s.err))
		}
	}
	for i, p := range f.pubs {
		if p.err != nil {
			errs = append(errs, fmt.Errorf("publisher %d: %w", i, p.err))
		}
	}
	if len(errs) > 0 {
		r.Errors = len(errs)
		r.FirstError = errs[0].Error()
	}
	return r, nil
}

func (f *flow) totalSent() uint64 {
	var n uint64
	for _, p := range f.pubs {
		n += p.sent.Load()
	}
	return n
}

func (f *flow) totalDelivered() uint64 {
	var n uint64
	for _, s := range f.subs {
		n += s.total.Load()
	}
	return n
}

func (f *flow) totalAcked() uint64 {
	var n uint64
	for _, p := range f.pubs {
		n += p.ackedN.Load()
	}
	return n
}

// drain waits until every message sent is delivered (and, for QoS 1/2,
// acknowledged), or until nothing has moved for a while, or cfg.Drain.
func (f *flow) drain(ctx context.Context) {
	const idle = 500 * time.Millisecond
	deadline := time.Now().Add(f.cfg.Drain)
	want := f.totalSent()
	last, lastChange := uint64(0), time.Now()
	for time.Now().Before(deadline) && ctx.Err() == nil {
		d, a := f.totalDelivered(), f.totalAcked()
		if d >= want*f.perMessageDeliverN && (f.cfg.QoS == 0 || a >= want) {
			return
		}
		if d+a != last {
			last, lastChange = d+a, time.Now()
		} else if time.Since(lastChange) > idle {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// closeAll sends DISCONNECT on every open connection and closes it. It runs
// once; the deferred call covers the error paths.
func (f *flow) closeAll() {
	f.closeOnce.Do(f.disconnectAll)
}

func (f *flow) disconnectAll() {
	for _, s := range f.subs {
		if s.c != nil {
			s.c.disconnect()
		}
	}
	if f.cfg.Persistent {
		// A clean connection ends each stored session, so that later runs
		// do not queue for this one's subscribers.
		_ = forEach(context.Background(), len(f.subs), f.cfg.ConnectConcurrency, func(ctx context.Context, i int) error {
			ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			if c, err := dial(ctx, f.cfg, f.cfg.SubAddr, fmt.Sprintf("kb%08x-s%d", f.runID, i), 4096); err == nil {
				c.disconnect()
			}
			return nil
		})
	}
	for _, p := range f.pubs {
		if p.c != nil {
			p.c.disconnect()
		}
	}
}

// publishLoop publishes as fast as the window allows until stop, or at
// its share of cfg.Rate (pacedLoop).
func (f *flow) publishLoop(p *publisher) error {
	if f.cfg.Rate > 0 {
		return f.pacedLoop(p)
	}
	payload := f.payload(p)
	w := p.c.w
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	sent := uint64(0)
	for !f.stop.Load() {
		inflight := sent - max(p.minHigh(), p.floor)
		if inflight >= p.window {
			if err := w.Flush(); err != nil {
				return fmt.Errorf("flush: %w", err)
			}
			if !f.waitWindow(p, sent, timer) {
				break
			}
			continue
		}
		for n := p.window - inflight; n > 0 && !f.stop.Load(); n-- {
			var pid uint16
			if p.qos > 0 {
				slot := sent & p.pidMask
				if p.pending[slot].Load() != 0 {
					// The broker has not acknowledged the packet id this
					// message would reuse: wait for it.
					p.pidWaits++
					if err := w.Flush(); err != nil {
						return fmt.Errorf("flush: %w", err)
					}
					time.Sleep(100 * time.Microsecond)
					break
				}
				p.pending[slot].Store(sent + 1)
				pid = uint16(slot + 1)
			}
			binary.BigEndian.PutUint64(payload[offSeq:], sent)
			binary.BigEndian.PutUint64(payload[offSent:], uint64(f.now()))
			pendingBytes := w.Publish(p.topic, payload, p.qos, pid)
			sent++
			p.sent.Store(sent)
			if pendingBytes >= flushAtBytes {
				if err := w.Flush(); err != nil {
					return fmt.Errorf("flush: %w", err)
				}
			}
		}
		if err := w.Flush(); err != nil {
			return fmt.Errorf("flush: %w", err)
		}
	}
	return w.Flush()
}

// pacedLoop publishes p's share of cfg.Rate, one message at a time at even
// intervals, until stop. The publishers' phases are spread over one
// interval, so that their messages do not arrive in bursts. A publisher
// that falls behind (its window full, a slow write) does not catch up in
// a burst: it goes on from where it is.
func (f *flow) pacedLoop(p *publisher) error {
	payload := f.payload(p)
	w := p.c.w
	interval := time.Duration(float64(len(f.pubs)) / f.cfg.Rate * float64(time.Second))
	next := f.now() + interval*time.Duration(p.id)/time.Duration(len(f.pubs))
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	sent := uint64(0)
	for !f.stop.Load() {
		if d := next - f.now(); d > 0 {
			timer.Reset(d)
			select {
			case <-timer.C:
			case <-f.done:
				return w.Flush()
			}
		}
		next += interval
		if now := f.now(); next < now {
			next = now
		}
		if sent-max(p.minHigh(), p.floor) >= p.window {
			if !f.waitWindow(p, sent, timer) {
				break
			}
		}
		var pid uint16
		if p.qos > 0 {
			slot := sent & p.pidMask
			if p.pending[slot].Load() != 0 {
				p.pidWaits++
				continue // the packet id is still in flight: skip this turn
			}
			p.pending[slot].Store(sent + 1)
			pid = uint16(slot + 1)
		}
		binary.BigEndian.PutUint64(payload[offSeq:], sent)
		binary.BigEndian.PutUint64(payload[offSent:], uint64(f.now()))
		w.Publish(p.topic, payload, p.qos, pid)
		sent++
		p.sent.Store(sent)
		if err := w.Flush(); err != nil {
			return fmt.Errorf("flush: %w", err)
		}
	}
	return w.Flush()
}

// payload is a publisher's payload buffer with its run and publisher ids
// set; each message sets its sequence number and send time.
func (f *flow) payload(p *publisher) []byte {
	payload := make([]byte, f.cfg.Size)
	for i := headerSize; i < len(payload); i++ {
		payload[i] = byte(i)
	}
	binary.BigEndian.PutUint32(payload[offRun:], f.runID)
	binary.BigEndian.PutUint32(payload[offPub:], p.id)
	return payload
}

// waitWindow blocks until at most half the window is in flight, the stall
// timeout passes without progress (then it reopens the window), or stop. It
// reports false on stop.
func (f *flow) waitWindow(p *publisher, sent uint64, timer *time.Timer) bool {
	target := sent - p.window/2
	progress := p.minHigh()
	timer.Reset(f.cfg.StallTimeout)
	for {
		p.waitFor.Store(target)
		// Re-check after publishing waitFor, so a subscriber that moved
		// high just before cannot be missed.
		if h := p.minHigh(); h >= target || p.floor >= target {
			p.waitFor.Store(0)
			return true
		}
		select {
		case <-p.wake:
		case <-f.done:
			return false
		case <-timer.C:
			h := p.minHigh()
			if h == progress {
				// No message arrived for a whole stall timeout: count the
				// window as lost and reopen it.
				p.stalls++
				p.floor = sent
				p.waitFor.Store(0)
				return true
			}
			progress = h
			timer.Reset(f.cfg.StallTimeout)
		}
	}
}

// ackLoop reads a publisher's connection: PUBACK, PUBREC (answered with
// PUBREL) and PUBCOMP.
func (f *flow) ackLoop(p *publisher) error {
	c := p.c
	dirty := false
	c.r.BeforeRead = func() error {
		if !dirty {
			return nil
		}
		dirty = false
		return c.w.Flush()
	}
	for {
		h, body, err := c.r.Next()
		if err != nil {
			return f.readErr(err)
		}
		t := h >> 4
		switch t {
		case wire.Puback, wire.Pubrec, wire.Pubcomp:
			if len(body) != 2 {
				return fmt.Errorf("ack: %w", wire.ErrMalformed)
			}
			pid := binary.BigEndian.Uint16(body)
			if p.qos == 0 || pid == 0 || uint64(pid) > uint64(len(p.pending)) {
				return fmt.Errorf("unexpected ack type %d id %d", t, pid)
			}
			if t == wire.Pubrec {
				c.w.Ack(wire.Pubrel, pid)
				dirty = true
				continue
			}
			if seq := p.pending[pid-1].Swap(0); seq != 0 {
				p.acked.set(seq - 1)
				p.ackedN.Add(1)
			}
		case wire.Pingresp:
		default:
			return fmt.Errorf("publisher got packet type %d", t)
		}
	}
}

// subscriberLoop reads deliveries until the connection closes.
func (f *flow) subscriberLoop(s *subscriber) error {
	c := s.c
	dirty := false
	c.r.BeforeRead = func() error {
		if !dirty {
			return nil
		}
		dirty = false
		return c.w.Flush()
	}
	winStart, winEnd := f.winStart, f.winEnd
	for {
		h, body, err := c.r.Next()
		if err != nil {
			return f.readErr(err)
		}
		switch h >> 4 {
		case wire.Publish:
			_, payload, pid, err := wire.DecodePublish(h&0x0f, body)
			if err != nil {
				return err
			}
			switch (h >> 1) & 3 {
			case 1:
				c.w.Ack(wire.Puback, pid)
				dirty = true
			case 2:
				c.w.Ack(wire.Pubrec, pid)
				dirty = true
			}
			now := f.now()
			if len(payload) < headerSize || binary.BigEndian.Uint32(payload[offRun:]) != f.runID {
				s.foreign++
				continue
			}
			pubID := binary.BigEndian.Uint32(payload[offPub:])
			if int(pubID) >= len(s.tracks) || s.tracks[pubID] == nil {
				s.foreign++
				continue
			}
			tr := s.tracks[pubID]
			seq := binary.BigEndian.Uint64(payload[offSeq:])
			s.total.Add(1)
			if tr.seen.set(seq) {
				tr.dup++
			} else if seq+1 < tr.next {
				tr.ooo++
			}
			if seq+1 > tr.next {
				tr.next = seq + 1
				p := tr.pub
				p.high[s.slot].Store(seq + 1)
				if wf := p.waitFor.Load(); wf != 0 && seq+1 >= wf && p.waitFor.CompareAndSwap(wf, 0) {
					select {
					case p.wake <- struct{}{}:
					default:
					}
				}
			}
			if now >= winStart && now < winEnd {
				s.inWindow++
				s.hist.Record(now - time.Duration(binary.BigEndian.Uint64(payload[offSent:])))
			}
		case wire.Pubrel:
			if len(body) != 2 {
				return fmt.Errorf("pubrel: %w", wire.ErrMalformed)
			}
			c.w.Ack(wire.Pubcomp, binary.BigEndian.Uint16(body))
			dirty = true
		case wire.Pingresp, wire.Suback:
		default:
			return fmt.Errorf("subscriber got packet type %d", h>>4)
		}
	}
}

// readErr turns the error that ends a reading goroutine into nil when the
// run closed the connection on purpose.
func (f *flow) readErr(err error) error {
	if f.closing.Load() {
		return nil
	}
	return fmt.Errorf("read: %w", err)
}

// result computes the figures once every goroutine has returned.
func (f *flow) result(s0, s1, s2 sample, sentInWindow uint64) *Result {
	cfg := f.cfg
	r := &Result{
		Broker: cfg.Broker, Label: cfg.Label, Scenario: cfg.Scenario, QoS: cfg.QoS,
		Size: cfg.Size, Clients: cfg.Clients, Pubs: len(f.pubs), Subs: len(f.subs),
		Inflight: cfg.Inflight, PacedRate: cfg.Rate, Unit: "msgs/s",
	}
	if cfg.Scenario == ScenarioFanOut {
		r.Unit = "deliveries/s"
	}
	win := s1.at.Sub(s0.at)
	r.Seconds = win.Seconds()
	var h Histogram
	var inWindow uint64
	for _, s := range f.subs {
		h.Merge(&s.hist)
		inWindow += s.inWindow
		r.Delivered += s.total.Load()
		r.Foreign += s.foreign
		for _, tr := range s.tracks {
			if tr == nil {
				continue
			}
			r.Dup += tr.dup
			r.OOO += tr.ooo
			p := tr.pub
			for seq := range p.sent.Load() {
				if (p.qos == 0 || p.acked.has(seq)) && !tr.seen.has(seq) {
					r.Lost++
				}
			}
		}
	}
	for _, p := range f.pubs {
		r.Sent += p.sent.Load()
		r.Acked += p.ackedN.Load()
		r.Stalls += p.stalls
		r.PIDWaits += p.pidWaits
	}
	if cfg.QoS > 0 {
		r.Unacked = r.Sent - r.Acked
	}
	if sec := (time.Duration(cfg.Duration)).Seconds(); sec > 0 {
		r.Rate = float64(inWindow) / sec
		r.PublishedRate = float64(sentInWindow) / win.Seconds()
	}
	r.P50us, r.P90us, r.P99us = us(h.Quantile(0.50)), us(h.Quantile(0.90)), us(h.Quantile(0.99))
	r.MaxUs = us(h.Max())
	r.GenCores = (s1.self - s0.self).Seconds() / win.Seconds()
	r.OtherCores = otherCores(s0, s1)
	if cfg.BrokerPID > 0 {
		cpu := s1.broker.cpu - s0.broker.cpu
		r.BrokerCPUSec = cpu.Seconds()
		r.BrokerCores = cpu.Seconds() / win.Seconds()
		if inWindow > 0 {
			r.BrokerCPUusPer = us(cpu) / float64(inWindow)
		}
		r.BrokerRSS = s1.broker.rss
		r.BrokerPeakRSS = s2.broker.hwm
		if inWindow > 0 && len(s1.each) == len(s0.each) {
			for i := range s1.each {
				r.BrokerCPUusPerProc = append(r.BrokerCPUusPerProc, us(s1.each[i]-s0.each[i])/float64(inWindow))
			}
		}
	}
	return r
}

// sleepUntil sleeps until t or until ctx is done.
func sleepUntil(ctx context.Context, t time.Time) {
	d := time.Until(t)
	if d <= 0 {
		return
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-tm.C:
	case <-ctx.Done():
	}
}
