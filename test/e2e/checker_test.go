package e2e

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
)

// The checker measures Keel against its delivery invariants (DESIGN.md):
// publishers send sequence-numbered payloads, subscribers record what they
// receive, and a report counts, per subscriber, what was lost, duplicated or
// reordered. Only acknowledged messages count as sent: a publish the broker
// never acknowledged may be lost without breaking any promise.

// msgID names one application message: its publisher and sequence number.
type msgID struct {
	pub string
	seq int
}

func (m msgID) String() string { return m.pub + "#" + strconv.Itoa(m.seq) }

// payloadOf and parsePayload are the wire form of a msgID. A space cannot
// occur in a publisher ID (they are chosen by the tests), so the split is
// unambiguous.
func payloadOf(pub string, seq int) []byte { return []byte(pub + " " + strconv.Itoa(seq)) }

func parsePayload(b []byte) (msgID, bool) {
	pub, s, ok := strings.Cut(string(b), " ")
	if !ok || pub == "" {
		return msgID{}, false
	}
	seq, err := strconv.Atoi(s)
	if err != nil || seq < 0 {
		return msgID{}, false
	}
	return msgID{pub, seq}, true
}

// Checker is shared by the publishers and subscribers of one scenario.
type Checker struct {
	// Quiet is how long WaitDelivered waits with nothing arriving before it
	// calls what is missing lost.
	Quiet time.Duration

	mu   sync.Mutex
	pubs map[string]*pubState
	subs []*Subscriber
}

type pubState struct {
	topic   string
	qos     byte
	next    int               // the next sequence number to send
	acked   map[int]bool      // completed without error
	ackedAt map[int]time.Time // when the acknowledgement was seen
	fails   map[int]string    // completed with an error or timed out (unacknowledged)
}

func NewChecker() *Checker { return &Checker{Quiet: 5 * time.Second, pubs: map[string]*pubState{}} }

func (c *Checker) addPublisher(id, topic string, qos byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, dup := c.pubs[id]; dup {
		panic("checker: publisher " + id + " registered twice")
	}
	c.pubs[id] = &pubState{topic: topic, qos: qos, acked: map[int]bool{}, ackedAt: map[int]time.Time{}, fails: map[int]string{}}
}

// nextSeq reserves the next sequence number of a publisher.
func (c *Checker) nextSeq(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	p := c.pubs[id]
	p.next++
	return p.next - 1
}

// settle records the outcome of a publish: err nil means acknowledged
// (PUBACK, PUBCOMP, or for QoS 0 written to the socket).
func (c *Checker) settle(id string, seq int, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	p := c.pubs[id]
	if err == nil {
		p.acked[seq] = true
		p.ackedAt[seq] = time.Now()
	} else {
		p.fails[seq] = err.Error()
	}
}

// Watermark returns, for every publisher, the next sequence number it will
// send: a message with a higher or equal seq was published after this call.
func (c *Checker) Watermark() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	w := make(map[string]int, len(c.pubs))
	for id, p := range c.pubs {
		w[id] = p.next
	}
	return w
}

// AckedAt returns when the acknowledgement of a message was seen (zero if
// it was not acknowledged).
func (c *Checker) AckedAt(id msgID) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	if p := c.pubs[id.pub]; p != nil {
		return p.ackedAt[id.seq]
	}
	return time.Time{}
}

// Subscriber records what one MQTT connection receives. A client that
// reconnects gets a new Subscriber, so each connection's window is exact.
type Subscriber struct {
	Name    string
	QoS     byte
	Filters []string
	c       *Checker

	mu      sync.Mutex
	from    map[string]int // per publisher: first seq this subscriber must get; nil until Subscribed
	until   map[string]int // per publisher: seqs at or above are not expected; nil while subscribed
	counts  map[msgID]int
	total   int               // receptions, copies included
	maxSeq  map[[2]string]int // (publisher, topic) → highest seq received
	order   int               // first receptions below maxSeq
	late    []string          // the first few of them, each with the seq it came after
	foreign int               // payloads not written by a checker publisher
	// held is, per packet ID, the message last received at QoS 2 under it,
	// and resent counts the re-sends discarded by it (see recordMessage).
	held   map[uint16]msgID
	resent int
}

// NewSubscriber registers a subscriber for filters at qos.
func (c *Checker) NewSubscriber(name string, qos byte, filters ...string) *Subscriber {
	s := &Subscriber{Name: name, QoS: qos, Filters: filters, c: c, counts: map[msgID]int{}, maxSeq: map[[2]string]int{},
		held: map[uint16]msgID{}}
	c.mu.Lock()
	c.subs = append(c.subs, s)
	c.mu.Unlock()
	return s
}

// Handler is the paho message handler of this subscriber.
func (s *Subscriber) Handler() mqtt.MessageHandler {
	return func(_ mqtt.Client, m mqtt.Message) { s.recordMessage(m) }
}

// recordMessage records m as the MQTT receiver of a QoS 2 message must see
// it (method B, MQTT 3.1.1 §4.3.3): a PUBLISH with DUP set under the packet
// ID of the QoS 2 message received last under that ID is the sender's
// re-send of it, not a new delivery, and is discarded. paho delivers such a
// re-send again, and each connection of a session here is a new paho
// client with no memory of the IDs its predecessor held, so a session
// resumed after its PUBREC was lost with an edge would otherwise count as a
// duplicate what the protocol allows. A copy under another packet ID, or
// without DUP, is a duplicate.
func (s *Subscriber) recordMessage(m mqtt.Message) {
	if m.Qos() == 2 {
		if id, ok := parsePayload(m.Payload()); ok {
			s.mu.Lock()
			resend := m.Duplicate() && s.held[m.MessageID()] == id && s.counts[id] > 0
			s.held[m.MessageID()] = id
			if resend {
				s.resent++
				s.mu.Unlock()
				return
			}
			s.mu.Unlock()
		}
	}
	s.record(m.Topic(), m.Payload())
}

func (s *Subscriber) record(topic string, payload []byte) {
	id, ok := parsePayload(payload)
	s.mu.Lock()
	defer s.mu.Unlock()
	if !ok {
		s.foreign++
		return
	}
	s.total++
	s.counts[id]++
	if s.counts[id] > 1 {
		return // a duplicate is counted as such, not also as a reordering
	}
	k := [2]string{id.pub, topic}
	if last, seen := s.maxSeq[k]; seen && id.seq < last {
		s.order++
		if len(s.late) < 8 {
			s.late = append(s.late, fmt.Sprintf("%s after #%d", id, last))
		}
	} else {
		s.maxSeq[k] = id.seq
	}
}

// Subscribed marks the SUBACK: from now on every acknowledged QoS 1/2
// message of a matching publisher must reach this subscriber.
func (s *Subscriber) Subscribed() {
	w := s.c.Watermark()
	s.mu.Lock()
	s.from = w
	s.mu.Unlock()
}

// Stop closes the window: messages published from now on are not expected
// (the connection is about to go, or was taken over).
func (s *Subscriber) Stop() {
	w := s.c.Watermark()
	s.mu.Lock()
	s.until = w
	s.mu.Unlock()
}

// Count returns how many messages (copies included) were received.
func (s *Subscriber) Count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.total
}

// SubReport is the verdict for one subscriber.
type SubReport struct {
	Subscriber string
	// Expected counts acknowledged QoS≥1 (effective) messages in the
	// subscriber's window, ExpectedQoS2 those at effective QoS 2; Lost
	// those of them never received.
	Expected, ExpectedQoS2, Lost int
	LostIDs                      []msgID // in publisher, seq order
	// Received counts distinct messages, Duplicated the extra copies;
	// DuplicatedQoS2 the extra copies of effective QoS 2 messages.
	Received, Duplicated, DuplicatedQoS2 int
	DupIDs                               []msgID // each duplicated message once
	// OutOfOrder counts first receptions with a seq below one already
	// received from the same publisher on the same topic.
	OutOfOrder int
	Late       []string // the first few out of order, each with the seq it came after
	// Resent counts the QoS 2 re-sends (DUP, same packet ID) discarded as
	// the receiver's protocol state would (recordMessage): reported only.
	Resent int
	// QoS0Received counts distinct effective QoS 0 messages received of
	// QoS0Sent acknowledged (written) in the window: reported, not asserted.
	QoS0Received, QoS0Sent int
	Foreign                int
}

func (r SubReport) String() string {
	return fmt.Sprintf("%s: expected %d (QoS 2: %d) lost %d %s; received %d, duplicated %d (QoS 2: %d) %s; out of order %d %v; QoS 2 re-sends discarded %d; QoS 0 %d/%d; foreign %d",
		r.Subscriber, r.Expected, r.ExpectedQoS2, r.Lost, idRanges(r.LostIDs), r.Received, r.Duplicated, r.DuplicatedQoS2, idRanges(r.DupIDs),
		r.OutOfOrder, r.Late, r.Resent, r.QoS0Received, r.QoS0Sent, r.Foreign)
}

// idRanges writes sorted IDs as runs, e.g. [p#3-7 p#9 q#1-2], the first
// few runs only.
func idRanges(ids []msgID) string {
	const maxRuns = 6
	var runs []string
	for i := 0; i < len(ids); {
		j := i
		for j+1 < len(ids) && ids[j+1].pub == ids[i].pub && ids[j+1].seq == ids[j].seq+1 {
			j++
		}
		if len(runs) == maxRuns {
			runs = append(runs, "...")
			break
		}
		if j == i {
			runs = append(runs, ids[i].String())
		} else {
			runs = append(runs, fmt.Sprintf("%s-%d", ids[i], ids[j].seq))
		}
		i = j + 1
	}
	return "[" + strings.Join(runs, " ") + "]"
}

// PubReport summarises one publisher.
type PubReport struct {
	Publisher      string
	QoS            byte
	Sent, Acked    int
	Unacknowledged int
	Unsettled      int // sent, neither acknowledged nor failed yet
	FirstFailure   string
}

func (r PubReport) String() string {
	s := fmt.Sprintf("%s (QoS %d): sent %d, acknowledged %d, unacknowledged %d, unsettled %d",
		r.Publisher, r.QoS, r.Sent, r.Acked, r.Unacknowledged, r.Unsettled)
	if r.FirstFailure != "" {
		s += " (first failure: " + r.FirstFailure + ")"
	}
	return s
}

// Report is the verdict of a whole scenario.
type Report struct {
	Subs []SubReport
	Pubs []PubReport
}

func (r Report) Sub(name string) SubReport {
	for _, s := range r.Subs {
		if s.Subscriber == name {
			return s
		}
	}
	panic("checker: no subscriber " + name)
}

func (r Report) Pub(name string) PubReport {
	for _, p := range r.Pubs {
		if p.Publisher == name {
			return p
		}
	}
	panic("checker: no publisher " + name)
}

// Lost is the total of lost messages over every subscriber.
func (r Report) Lost() int {
	n := 0
	for _, s := range r.Subs {
		n += s.Lost
	}
	return n
}

func (r Report) String() string {
	var b strings.Builder
	for _, p := range r.Pubs {
		b.WriteString("\n  pub " + p.String())
	}
	for _, s := range r.Subs {
		b.WriteString("\n  sub " + s.String())
	}
	return b.String()
}

// Report computes the verdict now.
func (c *Checker) Report() Report {
	c.mu.Lock()
	defer c.mu.Unlock()
	var r Report
	ids := make([]string, 0, len(c.pubs))
	for id := range c.pubs {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		p := c.pubs[id]
		pr := PubReport{Publisher: id, QoS: p.qos, Sent: p.next, Acked: len(p.acked), Unacknowledged: len(p.fails)}
		pr.Unsettled = pr.Sent - pr.Acked - pr.Unacknowledged
		first := -1
		for seq, why := range p.fails {
			if first < 0 || seq < first {
				first, pr.FirstFailure = seq, fmt.Sprintf("seq %d: %s", seq, why)
			}
		}
		r.Pubs = append(r.Pubs, pr)
	}
	for _, s := range c.subs {
		r.Subs = append(r.Subs, s.report(c.pubs, ids))
	}
	return r
}

// report needs c.mu held (for pubs).
func (s *Subscriber) report(pubs map[string]*pubState, ids []string) SubReport {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := SubReport{Subscriber: s.Name, OutOfOrder: s.order, Late: slices.Clone(s.late), Resent: s.resent, Foreign: s.foreign}
	for id, n := range s.counts {
		r.Received++
		if n < 2 {
			continue
		}
		r.Duplicated += n - 1
		if p := pubs[id.pub]; p != nil && min(p.qos, s.QoS) == 2 {
			r.DuplicatedQoS2 += n - 1
		}
		r.DupIDs = append(r.DupIDs, id)
	}
	sortIDs(r.DupIDs)
	if s.from == nil {
		return r // never subscribed: nothing is expected
	}
	for _, id := range ids {
		p := pubs[id]
		if !s.matches(p.topic) {
			continue
		}
		lo, hi := s.from[id], p.next
		if s.until != nil {
			if u, ok := s.until[id]; ok {
				hi = u
			} else {
				hi = 0 // the publisher started after the window closed
			}
		}
		qos := min(p.qos, s.QoS)
		for seq := lo; seq < hi; seq++ {
			if !p.acked[seq] {
				continue
			}
			got := s.counts[msgID{id, seq}] > 0
			if qos == 0 {
				r.QoS0Sent++
				if got {
					r.QoS0Received++
				}
				continue
			}
			r.Expected++
			if qos == 2 {
				r.ExpectedQoS2++
			}
			if !got {
				r.Lost++
				r.LostIDs = append(r.LostIDs, msgID{id, seq})
			}
		}
	}
	return r
}

func (s *Subscriber) matches(topic string) bool {
	for _, f := range s.Filters {
		if rest, ok := strings.CutPrefix(f, "$share/"); ok {
			// A shared subscription's Subscriber stands for its whole
			// group: every member records into it.
			if _, inner, ok := strings.Cut(rest, "/"); ok {
				f = inner
			}
		}
		if matchTopic(f, topic) {
			return true
		}
	}
	return false
}

func sortIDs(ids []msgID) {
	sort.Slice(ids, func(i, j int) bool {
		if ids[i].pub != ids[j].pub {
			return ids[i].pub < ids[j].pub
		}
		return ids[i].seq < ids[j].seq
	})
}

// matchTopic is MQTT filter matching (no shared-subscription prefixes): a
// wildcard in the first level never matches a topic starting with '$'.
func matchTopic(filter, topic string) bool {
	if strings.HasPrefix(topic, "$") && (strings.HasPrefix(filter, "+") || strings.HasPrefix(filter, "#")) {
		return false
	}
	fs, ts := strings.Split(filter, "/"), strings.Split(topic, "/")
	for i, f := range fs {
		if f == "#" {
			return i == len(fs)-1
		}
		if i >= len(ts) {
			return false
		}
		if f != "+" && f != ts[i] {
			return false
		}
	}
	return len(fs) == len(ts)
}

// Overlap returns the messages with seq at or above the watermark w that
// both subscribers received: after a takeover completed, one client ID must
// never have two connections getting the same message.
func Overlap(a, b *Subscriber, w map[string]int) []msgID {
	a.mu.Lock()
	inA := make(map[msgID]bool, len(a.counts))
	for id := range a.counts {
		if id.seq >= w[id.pub] {
			inA[id] = true
		}
	}
	a.mu.Unlock()
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []msgID
	for id := range b.counts {
		if inA[id] {
			out = append(out, id)
		}
	}
	sortIDs(out)
	return out
}

// WaitDelivered polls the report until no subscriber misses an
// acknowledged QoS 1/2 message and QoS 0 deliveries are complete, or
// nothing has arrived for c.Quiet (what is missing then is lost: every
// acknowledged message has been taken by its subscribers' edges, so only
// their outbound queues stand between it and the client), or timeout. It
// returns the last report. Publishers must have been flushed first, or late
// acknowledgements widen the expectation while this waits.
func (c *Checker) WaitDelivered(timeout time.Duration) Report {
	deadline := time.Now().Add(timeout)
	seen, since := -1, time.Now()
	for {
		r := c.Report()
		got, q0, q0Sent := 0, 0, 0
		for _, s := range r.Subs {
			got += s.Received + s.Duplicated
			q0, q0Sent = q0+s.QoS0Received, q0Sent+s.QoS0Sent
		}
		if got != seen {
			seen, since = got, time.Now()
		}
		if (r.Lost() == 0 && q0 == q0Sent) || time.Since(since) > c.Quiet || time.Now().After(deadline) {
			return r
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// settledBelow reports whether every publish below w has settled.
func (c *Checker) settledBelow(w map[string]int) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for id, hi := range w {
		p := c.pubs[id]
		for seq := 0; seq < hi; seq++ {
			if !p.acked[seq] {
				if _, failed := p.fails[seq]; !failed {
					return false
				}
			}
		}
	}
	return true
}

// WaitSub waits, while publishers keep running, until every publish in the
// closed window of s (Stop) has settled and s lost none of the
// acknowledged ones, or timeout; it returns s's report at that moment.
func (c *Checker) WaitSub(s *Subscriber, timeout time.Duration) SubReport {
	s.mu.Lock()
	until := s.until
	s.mu.Unlock()
	if until == nil {
		panic("checker: WaitSub needs a closed window (Stop)")
	}
	deadline := time.Now().Add(timeout)
	for {
		settled := c.settledBelow(until)
		r := c.Report().Sub(s.Name)
		if (settled && r.Lost == 0) || time.Now().After(deadline) {
			return r
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Publisher sends sequence-numbered messages on one topic at one QoS,
// pipelined: up to Window publishes wait for their acknowledgement at once.
type Publisher struct {
	ID    string
	Topic string
	QoS   byte
	// Window bounds the publishes in flight; AckTimeout how long one may
	// stay unsettled before it counts as unacknowledged.
	Window     int
	AckTimeout time.Duration
	// Dial makes a new connection when the current one is gone (nil: the
	// publisher stops at the first lost connection).
	Dial func() (mqtt.Client, error)

	c      *Checker
	mu     sync.Mutex
	client mqtt.Client
	slots  chan struct{}
	wg     sync.WaitGroup
	// Reconnects counts connections made after the first.
	reconnects int
}

// NewPublisher registers a publisher on an already connected client.
func (c *Checker) NewPublisher(id string, client mqtt.Client, topic string, qos byte) *Publisher {
	c.addPublisher(id, topic, qos)
	return &Publisher{ID: id, Topic: topic, QoS: qos, Window: 100, AckTimeout: 90 * time.Second, c: c, client: client}
}

func (p *Publisher) conn() (mqtt.Client, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.client != nil && p.client.IsConnectionOpen() {
		return p.client, nil
	}
	if p.Dial == nil {
		return nil, fmt.Errorf("publisher %s: connection lost", p.ID)
	}
	if p.client != nil {
		p.client.Disconnect(0)
	}
	cl, err := p.Dial()
	if err != nil {
		return nil, err
	}
	p.client = cl
	p.reconnects++
	return cl, nil
}

// Connect connects the publisher again if its connection was dropped: a
// stream stopped just after a drop leaves it closed, and a test counting
// the cluster's connections counts it as one.
func (p *Publisher) Connect() error {
	_, err := p.conn()
	return err
}

// Reconnects returns how many times the publisher had to connect again.
func (p *Publisher) Reconnects() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.reconnects
}

// publishOne sends the next message, or returns an error when no
// connection can be had (no seq is used then).
func (p *Publisher) publishOne() error {
	if p.slots == nil {
		p.slots = make(chan struct{}, max(p.Window, 1))
	}
	cl, err := p.conn()
	if err != nil {
		return err
	}
	p.slots <- struct{}{}
	seq := p.c.nextSeq(p.ID)
	tok := cl.Publish(p.Topic, p.QoS, false, payloadOf(p.ID, seq))
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		defer func() { <-p.slots }()
		var err error
		if !tok.WaitTimeout(p.AckTimeout) {
			err = fmt.Errorf("not settled within %v", p.AckTimeout)
		} else {
			err = tok.Error()
		}
		p.c.settle(p.ID, seq, err)
	}()
	return nil
}

// Publish sends n messages back to back (pipelined) and returns without
// waiting for their acknowledgements.
func (p *Publisher) Publish(n int) error {
	for range n {
		if err := p.publishOne(); err != nil {
			return err
		}
	}
	return nil
}

// Stream publishes one message every interval until ctx ends. A lost
// connection is dialled again (Dial); failures to connect are retried.
func (p *Publisher) Stream(ctx context.Context, interval time.Duration) {
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if err := p.publishOne(); err != nil {
			if p.Dial == nil {
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(200 * time.Millisecond):
			}
		}
	}
}

// Flush waits until every publish is settled (acknowledged, failed or
// timed out).
func (p *Publisher) Flush() { p.wg.Wait() }

// GoStream runs Stream in the background; the returned function stops it
// and flushes.
func (p *Publisher) GoStream(interval time.Duration) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.Stream(ctx, interval)
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			cancel()
			<-done
			p.Flush()
		})
	}
}

// requireDelivery fails t when a subscriber lost an acknowledged message,
// got a QoS 2 message twice or got a publisher's messages out of order.
// requireNoLoss is requireDelivery for a scenario whose known
// shortcoming is order alone: no acknowledged message may be lost nor a
// QoS 2 one duplicated, and messages out of order are logged with why.
func requireNoLoss(t *testing.T, r Report, whyOutOfOrder string, subs ...string) {
	t.Helper()
	for _, name := range subs {
		s := r.Sub(name)
		if s.Lost > 0 || s.DuplicatedQoS2 > 0 {
			t.Errorf("delivery invariant broken for %s", s)
		}
		if s.OutOfOrder > 0 {
			t.Logf("known: %s got %d messages out of order: %s", s.Subscriber, s.OutOfOrder, whyOutOfOrder)
		}
	}
}

func requireDelivery(t *testing.T, r Report, subs ...string) {
	t.Helper()
	for _, name := range subs {
		s := r.Sub(name)
		if s.Lost > 0 || s.DuplicatedQoS2 > 0 || s.OutOfOrder > 0 {
			t.Errorf("delivery invariant broken for %s", s)
		}
	}
}
