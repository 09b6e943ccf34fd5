package e2e

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/require"
)

// Clients of the HA scenarios: subscribers with persistent sessions that
// follow the cluster around (a roamer connects again to another edge
// whenever its connection ends), and publishers that connect to any live
// edge.

// edgePicker hands out edge indexes round-robin, skipping the edges marked
// down (being restarted, or cut off).
type edgePicker struct {
	k    *keelCluster
	mu   sync.Mutex
	down map[int]bool
}

func newEdgePicker(k *keelCluster) *edgePicker { return &edgePicker{k: k, down: map[int]bool{}} }

func (p *edgePicker) setDown(i int, down bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down[i] = down
}

// pick returns the first edge at or after n (mod the edge count) not marked
// down, or n's edge if all are.
func (p *edgePicker) pick(n int) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	e := len(p.k.Edges)
	for j := range e {
		if i := (n + j) % e; !p.down[i] {
			return i
		}
	}
	return n % e
}

// dialer returns a Publisher.Dial that connects a clean session to the live
// edges in turn, starting at edge start, for up to a minute.
func (p *edgePicker) dialer(id string, start int) func() (mqtt.Client, error) {
	var n atomic.Int64
	n.Store(int64(start))
	return func() (mqtt.Client, error) {
		deadline := time.Now().Add(time.Minute)
		for {
			i := p.pick(int(n.Add(1) - 1))
			c, err := dial(mqttOpts(p.k.URL(i), id, true).SetConnectTimeout(5*time.Second), 0)
			if err == nil {
				return c, nil
			}
			if time.Now().After(deadline) {
				return nil, fmt.Errorf("no edge admitted %s within a minute: %w", id, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
}

// roamer is a subscriber with a persistent session (clean session off)
// that, whenever its connection ends, connects again with the same client
// ID to the next live edge, where the session resumes with its
// subscriptions: its Subscriber's window stays open from the first SUBACK,
// so every message acknowledged since must arrive whatever the moves.
type roamer struct {
	t      *testing.T
	id     string
	sub    *Subscriber
	picker *edgePicker
	// wrap, if set, wraps the message handler of each connection (its
	// number from 0).
	wrap func(conn int, h mqtt.MessageHandler) mqtt.MessageHandler
	// stay makes it connect again to the edge it was on (while that edge
	// is up) rather than to the next one.
	stay bool

	mu        sync.Mutex
	client    mqtt.Client
	conns     int       // connections made
	edges     []int     // edge of each connection
	noSession []int     // connections after the first whose CONNACK said session present 0
	lostAt    time.Time // when the current connection ended (zero while up)
	events    []string  // connections and losses, for the log
	stop      chan struct{}
	done      chan struct{}
}

// startRoamer connects id to edge start, subscribes its Subscriber and
// keeps it connected until the test ends (or Stop).
func startRoamer(t *testing.T, picker *edgePicker, id string, sub *Subscriber, start int) *roamer {
	t.Helper()
	return startRoamerOpts(t, picker, id, sub, start, false)
}

// startRoamerOpts is startRoamer with the roamer's stay setting.
func startRoamerOpts(t *testing.T, picker *edgePicker, id string, sub *Subscriber, start int, stay bool) *roamer {
	t.Helper()
	return launchRoamer(t, &roamer{t: t, id: id, sub: sub, picker: picker, stay: stay}, start)
}

// startWillRoamer is startRoamer for a roamer whose every connection also
// hands what it receives to wills.
func startWillRoamer(t *testing.T, picker *edgePicker, id string, sub *Subscriber, start int, wills *willWatcher) *roamer {
	t.Helper()
	return launchRoamer(t, &roamer{t: t, id: id, sub: sub, picker: picker, wrap: wills.wrap}, start)
}

// launchRoamer connects r to edge start, subscribes its Subscriber and
// keeps it connected until the test ends (or Stop).
func launchRoamer(t *testing.T, r *roamer, start int) *roamer {
	t.Helper()
	r.stop, r.done = make(chan struct{}), make(chan struct{})
	lost, err := r.connect(start, 20*time.Second)
	require.NoError(t, err, "connect %s", r.id)
	requireSubscribe(t, r.current(), r.sub)
	go r.run(lost)
	t.Cleanup(r.Stop)
	return r
}

func (r *roamer) current() mqtt.Client {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.client
}

// connect makes one connection to edge n's pick, retrying other edges until
// within has passed; it returns the channel closed when that connection
// ends.
func (r *roamer) connect(n int, within time.Duration) (chan struct{}, error) {
	deadline := time.Now().Add(within)
	for {
		i := r.picker.pick(n)
		n++
		lost := make(chan struct{})
		var once sync.Once
		r.mu.Lock()
		conn := r.conns
		r.mu.Unlock()
		h := r.sub.Handler()
		if r.wrap != nil {
			h = r.wrap(conn, h)
		}
		opts := mqttOpts(r.picker.k.URL(i), r.id, false).SetConnectTimeout(5 * time.Second).SetDefaultPublishHandler(h).
			SetConnectionLostHandler(func(_ mqtt.Client, err error) {
				r.mu.Lock()
				r.lostAt = time.Now()
				r.events = append(r.events, fmt.Sprintf("%s lost %s (%v)", r.lostAt.Format("15:04:05.000"), edgeAlias(i), err))
				r.mu.Unlock()
				once.Do(func() { close(lost) })
			})
		c := mqtt.NewClient(opts)
		tok := c.Connect()
		var err error
		if !tok.WaitTimeout(10 * time.Second) {
			err = fmt.Errorf("connect timed out")
		} else {
			err = tok.Error()
		}
		if err == nil {
			r.mu.Lock()
			if r.conns > 0 && !tok.(*mqtt.ConnectToken).SessionPresent() {
				r.noSession = append(r.noSession, r.conns)
			}
			r.client, r.lostAt = c, time.Time{}
			r.events = append(r.events, fmt.Sprintf("%s connected to %s", time.Now().Format("15:04:05.000"), edgeAlias(i)))
			r.conns++
			r.edges = append(r.edges, i)
			r.mu.Unlock()
			return lost, nil
		}
		c.Disconnect(0)
		r.mu.Lock()
		r.events = append(r.events, fmt.Sprintf("%s refused by %s (%v)", time.Now().Format("15:04:05.000"), edgeAlias(i), err))
		r.mu.Unlock()
		if time.Now().After(deadline) {
			return nil, err
		}
		select {
		case <-r.stop:
			return nil, fmt.Errorf("stopped")
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func (r *roamer) run(lost chan struct{}) {
	defer close(r.done)
	for {
		select {
		case <-r.stop:
			return
		case <-lost:
		}
		// The next edge after the one that dropped it (back to the same one
		// if it is the only one up).
		r.mu.Lock()
		n := r.edges[len(r.edges)-1]
		if !r.stay {
			n++
		}
		r.mu.Unlock()
		var err error
		if lost, err = r.connect(n, 2*time.Minute); err != nil {
			select {
			case <-r.stop:
			default:
				r.t.Errorf("%s could not connect again: %v", r.id, err)
			}
			return
		}
	}
}

// Stop ends the roaming and disconnects.
func (r *roamer) Stop() {
	select {
	case <-r.stop:
		return
	default:
	}
	close(r.stop)
	<-r.done
	if c := r.current(); c != nil {
		c.Disconnect(50)
	}
}

func (r *roamer) String() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return fmt.Sprintf("%s: %d connections (edges %v): %s", r.id, r.conns, r.edges, strings.Join(r.events, "; "))
}

// requireSessionsKept fails t if a roamer came back to no session: its
// persistent session (subscriptions, queue) was lost.
func requireSessionsKept(t *testing.T, rs ...*roamer) {
	t.Helper()
	for _, r := range rs {
		r.mu.Lock()
		if len(r.noSession) > 0 {
			t.Errorf("%s: the CONNACK of connections %v said session present 0: the persistent session was lost", r.id, r.noSession)
		}
		r.mu.Unlock()
	}
}

// firstAckAfter returns when the first acknowledgement after at was seen,
// of any publish (first) and of a publish sent after at (firstNew; w is
// the watermark taken at at).
func (c *Checker) firstAckAfter(at time.Time, w map[string]int) (first, firstNew time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for id, p := range c.pubs {
		for seq, ts := range p.ackedAt {
			if !ts.After(at) {
				continue
			}
			if first.IsZero() || ts.Before(first) {
				first = ts
			}
			if seq >= w[id] && (firstNew.IsZero() || ts.Before(firstNew)) {
				firstNew = ts
			}
		}
	}
	return first, firstNew
}

// ackedSince counts the acknowledgements seen after at.
func (c *Checker) ackedSince(at time.Time) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, p := range c.pubs {
		for _, ts := range p.ackedAt {
			if ts.After(at) {
				n++
			}
		}
	}
	return n
}

// waitFlowing waits until every subscriber received n more messages.
func waitFlowing(t *testing.T, within time.Duration, n int, subs ...*Subscriber) {
	t.Helper()
	base := make([]int, len(subs))
	for i, s := range subs {
		base[i] = s.Count()
	}
	deadline := time.Now().Add(within)
	for {
		flowing := true
		for i, s := range subs {
			if s.Count() < base[i]+n {
				flowing = false
			}
		}
		if flowing {
			return
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	// Who stalled, and whether the publishers still get acknowledgements,
	// tells a routing stall from a publishing one.
	var b strings.Builder
	for i, s := range subs {
		fmt.Fprintf(&b, "\n  %s received %d of %d more", s.Name, s.Count()-base[i], n)
	}
	if len(subs) > 0 {
		b.WriteString(subs[0].c.progress())
	}
	t.Fatalf("the stream did not reach every subscriber within %v:%s", within, b.String())
}

// progress describes each publisher's sends and outcomes so far.
func (c *Checker) progress() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var b strings.Builder
	for _, id := range slices.Sorted(maps.Keys(c.pubs)) {
		p := c.pubs[id]
		var last time.Time
		for _, at := range p.ackedAt {
			if at.After(last) {
				last = at
			}
		}
		fmt.Fprintf(&b, "\n  %s sent %d, acknowledged %d, failed %d, unsettled %d, last acknowledgement %s",
			id, p.next, len(p.acked), len(p.fails), p.next-len(p.acked)-len(p.fails), last.Format("15:04:05.000"))
	}
	return b.String()
}

// requireOneConnectionPerClient compares the edges' connection gauges with
// the clients the test holds open (pubs among them, connected again if
// their last connection was dropped): a client ID with two live
// connections anywhere in the cluster shows as one more server-side
// connection than there are open clients (invariant 3).
func requireOneConnectionPerClient(t *testing.T, k *keelCluster, open int, pubs ...*Publisher) {
	t.Helper()
	for _, p := range pubs {
		before := p.Reconnects()
		require.NoError(t, p.Connect(), "publisher %s connects again", p.ID)
		if p.Reconnects() > before {
			t.Logf("publisher %s had lost its last connection; connected again", p.ID)
		}
	}
	var total int
	var per []int
	var err error
	// The gauges lag a closed connection by a moment.
	ok := assertEventually(5*time.Second, func() bool {
		total, per, err = k.EdgeConnections()
		return err == nil && total == open
	})
	require.NoError(t, err)
	if !ok {
		t.Errorf("the edges hold %d MQTT connections %v, the test holds %d open clients, one per client ID", total, per, open)
	}
}

func assertEventually(within time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(within)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(100 * time.Millisecond)
	}
}
