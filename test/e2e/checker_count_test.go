package e2e

import (
	"errors"
	"sync"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/require"
)

// These tests need no Docker: they pin the checker's arithmetic, which every
// cluster scenario's verdict rests on.

// sendN reserves n seqs for pub and settles them: acked unless listed in fail.
func sendN(c *Checker, pub string, n int, fail ...int) {
	failed := map[int]bool{}
	for _, f := range fail {
		failed[f] = true
	}
	for range n {
		seq := c.nextSeq(pub)
		var err error
		if failed[seq] {
			err = errors.New("connection lost before Publish completed")
		}
		c.settle(pub, seq, err)
	}
}

func deliver(s *Subscriber, topic, pub string, seqs ...int) {
	for _, seq := range seqs {
		s.record(topic, payloadOf(pub, seq))
	}
}

func TestChecker_LostCountsOnlyAcknowledgedMessagesInTheWindow(t *testing.T) {
	c := NewChecker()
	c.addPublisher("p", "a/b", 1)
	s := c.NewSubscriber("s", 1, "a/#")
	sendN(c, "p", 2) // before SUBACK: not expected
	s.Subscribed()
	sendN(c, "p", 6, 4) // seqs 2..7, 4 unacknowledged
	deliver(s, "a/b", "p", 0, 2, 3, 6)

	r := c.Report().Sub("s")
	require.Equal(t, 5, r.Expected, "seqs 2, 3, 5, 6, 7")
	require.Equal(t, 2, r.Lost)
	require.Equal(t, []msgID{{"p", 5}, {"p", 7}}, r.LostIDs)
	require.False(t, c.AckedAt(msgID{"p", 5}).IsZero())
	require.True(t, c.AckedAt(msgID{"p", 4}).IsZero(), "never acknowledged")
	require.Equal(t, 4, r.Received)
	require.Zero(t, r.Duplicated)
	require.Zero(t, r.OutOfOrder)

	p := c.Report().Pub("p")
	require.Equal(t, 8, p.Sent)
	require.Equal(t, 7, p.Acked)
	require.Equal(t, 1, p.Unacknowledged)
	require.Contains(t, p.FirstFailure, "seq 4")
}

func TestChecker_StopClosesTheWindow(t *testing.T) {
	c := NewChecker()
	c.addPublisher("p", "t", 1)
	s := c.NewSubscriber("s", 1, "t")
	s.Subscribed()
	sendN(c, "p", 3)
	s.Stop()
	sendN(c, "p", 3)
	c.addPublisher("late", "t", 1)
	sendN(c, "late", 2)
	deliver(s, "t", "p", 0, 1, 2)
	r := c.Report().Sub("s")
	require.Equal(t, 3, r.Expected)
	require.Zero(t, r.Lost)
}

func TestChecker_NotSubscribedExpectsNothing(t *testing.T) {
	c := NewChecker()
	c.addPublisher("p", "t", 2)
	c.NewSubscriber("s", 2, "t")
	sendN(c, "p", 5)
	r := c.Report().Sub("s")
	require.Zero(t, r.Expected)
	require.Zero(t, r.Lost)
}

func TestChecker_DuplicatesAndQoS2(t *testing.T) {
	c := NewChecker()
	c.addPublisher("q1", "t/1", 1)
	c.addPublisher("q2", "t/2", 2)
	s2 := c.NewSubscriber("s2", 2, "t/+")
	s1 := c.NewSubscriber("s1", 1, "t/+") // QoS 2 publishes arrive at QoS 1: duplicates allowed
	s2.Subscribed()
	s1.Subscribed()
	sendN(c, "q1", 3)
	sendN(c, "q2", 3)
	for _, s := range []*Subscriber{s1, s2} {
		deliver(s, "t/1", "q1", 0, 1, 1, 2)
		deliver(s, "t/2", "q2", 0, 1, 2, 2, 2)
	}
	r2 := c.Report().Sub("s2")
	require.Equal(t, 3, r2.Duplicated)
	require.Equal(t, 2, r2.DuplicatedQoS2)
	require.Equal(t, []msgID{{"q1", 1}, {"q2", 2}}, r2.DupIDs)
	require.Zero(t, r2.OutOfOrder, "a duplicate is not a reordering")
	require.Equal(t, 6, r2.Received)
	r1 := c.Report().Sub("s1")
	require.Equal(t, 3, r1.Duplicated)
	require.Zero(t, r1.DuplicatedQoS2)
}

func TestChecker_OrderIsPerPublisherAndTopic(t *testing.T) {
	c := NewChecker()
	c.addPublisher("a", "x", 1)
	c.addPublisher("b", "y", 1)
	s := c.NewSubscriber("s", 1, "#")
	s.Subscribed()
	sendN(c, "a", 4)
	sendN(c, "b", 4)
	// Interleaving publishers is fine; a's 1 after its 2 and b's 0 after its
	// 3 are not.
	deliver(s, "x", "a", 0)
	deliver(s, "y", "b", 1)
	deliver(s, "x", "a", 2)
	deliver(s, "y", "b", 3)
	deliver(s, "x", "a", 1, 3)
	deliver(s, "y", "b", 0, 2)
	r := c.Report().Sub("s")
	require.Equal(t, 3, r.OutOfOrder)
	require.Zero(t, r.Lost)
}

func TestChecker_QoS0IsReportedNotLost(t *testing.T) {
	c := NewChecker()
	c.addPublisher("p0", "t", 0)
	c.addPublisher("p1", "t", 1)
	s := c.NewSubscriber("s", 0, "t") // a QoS 0 subscription downgrades p1 too
	s.Subscribed()
	sendN(c, "p0", 4)
	sendN(c, "p1", 4)
	deliver(s, "t", "p0", 0, 3)
	deliver(s, "t", "p1", 1)
	r := c.Report().Sub("s")
	require.Zero(t, r.Expected)
	require.Zero(t, r.Lost)
	require.Equal(t, 8, r.QoS0Sent)
	require.Equal(t, 3, r.QoS0Received)
}

func TestChecker_ForeignPayloadsAndFilters(t *testing.T) {
	c := NewChecker()
	c.addPublisher("p", "other/t", 1)
	s := c.NewSubscriber("s", 1, "mine/#")
	s.Subscribed()
	sendN(c, "p", 3)
	s.record("mine/x", []byte("hello"))
	s.record("mine/x", []byte("p -1"))
	r := c.Report().Sub("s")
	require.Zero(t, r.Expected, "a publisher the filters do not match is not expected")
	require.Equal(t, 2, r.Foreign)
}

func TestChecker_Overlap(t *testing.T) {
	c := NewChecker()
	c.addPublisher("p", "t", 1)
	a := c.NewSubscriber("a", 1, "t")
	b := c.NewSubscriber("b", 1, "t")
	deliver(a, "t", "p", 1, 2, 5)
	deliver(b, "t", "p", 2, 5, 6)
	require.Equal(t, []msgID{{"p", 2}, {"p", 5}}, Overlap(a, b, nil))
	require.Equal(t, []msgID{{"p", 5}}, Overlap(a, b, map[string]int{"p": 3}))
}

func TestChecker_WaitDeliveredReturnsOnceNothingIsMissing(t *testing.T) {
	c := NewChecker()
	c.addPublisher("p", "t", 1)
	s := c.NewSubscriber("s", 1, "t")
	s.Subscribed()
	sendN(c, "p", 2)
	deliver(s, "t", "p", 0)
	go deliver(s, "t", "p", 1)
	r := c.WaitDelivered(5 * time.Second)
	require.Zero(t, r.Lost(), "%v", r)

	sendN(c, "p", 1)
	start := time.Now()
	r = c.WaitDelivered(300 * time.Millisecond)
	require.Equal(t, 1, r.Lost(), "a message that never comes is reported once the wait is over")
	require.GreaterOrEqual(t, time.Since(start), 300*time.Millisecond)
	require.Less(t, time.Since(start), 3*time.Second)
}

func TestChecker_WaitDeliveredStopsOnceNothingArrives(t *testing.T) {
	c := NewChecker()
	c.Quiet = time.Second
	c.addPublisher("p0", "t", 0)
	c.addPublisher("p1", "t", 1)
	s := c.NewSubscriber("s", 1, "t")
	s.Subscribed()
	sendN(c, "p0", 3)
	sendN(c, "p1", 3)
	deliver(s, "t", "p0", 0)
	deliver(s, "t", "p1", 0)
	go func() {
		time.Sleep(300 * time.Millisecond)
		deliver(s, "t", "p0", 1)
		deliver(s, "t", "p1", 1)
	}()
	start := time.Now()
	r := c.WaitDelivered(time.Minute)
	waited := time.Since(start)
	require.Equal(t, 2, r.Sub("s").QoS0Received, "waited for the late ones")
	require.Equal(t, 1, r.Sub("s").Lost)
	require.Less(t, waited, 10*time.Second, "what never comes does not hold the wait to its timeout")
	require.Greater(t, waited, time.Second, "but it waits a quiet period")
}

// fakeClient acknowledges publishes asynchronously, failing every seq
// listed in fail, and records the most publishes ever outstanding.
type fakeClient struct {
	mqtt.Client
	mu          sync.Mutex
	outstanding int
	peak        int
	topics      map[string]int
	fail        map[int]bool
}

type fakeToken struct {
	done chan struct{}
	err  error
}

func (f *fakeToken) Wait() bool { <-f.done; return true }
func (f *fakeToken) WaitTimeout(d time.Duration) bool {
	select {
	case <-f.done:
		return true
	case <-time.After(d):
		return false
	}
}
func (f *fakeToken) Done() <-chan struct{} { return f.done }
func (f *fakeToken) Error() error          { return f.err }

func (f *fakeClient) IsConnectionOpen() bool { return true }

func (f *fakeClient) Publish(topic string, _ byte, _ bool, payload any) mqtt.Token {
	id, _ := parsePayload(payload.([]byte))
	f.mu.Lock()
	f.outstanding++
	f.peak = max(f.peak, f.outstanding)
	f.topics[topic]++
	f.mu.Unlock()
	tok := &fakeToken{done: make(chan struct{})}
	if f.fail[id.seq] {
		tok.err = errors.New("refused")
	}
	go func() {
		time.Sleep(time.Millisecond)
		f.mu.Lock()
		f.outstanding--
		f.mu.Unlock()
		close(tok.done)
	}()
	return tok
}

func TestPublisher_PipelinesWithinItsWindowAndSettlesEverySeq(t *testing.T) {
	c := NewChecker()
	fc := &fakeClient{topics: map[string]int{}, fail: map[int]bool{3: true, 77: true}}
	p := c.NewPublisher("p", fc, "t", 1)
	p.Window = 8
	require.NoError(t, p.Publish(200))
	p.Flush()
	r := c.Report().Pub("p")
	require.Equal(t, 200, r.Sent)
	require.Equal(t, 198, r.Acked)
	require.Equal(t, 2, r.Unacknowledged)
	require.Zero(t, r.Unsettled)
	require.Equal(t, 200, fc.topics["t"])
	require.LessOrEqual(t, fc.peak, 8, "never more than Window in flight")
	require.Greater(t, fc.peak, 1, "pipelined, not one at a time")
}

func TestIDRanges(t *testing.T) {
	ids := []msgID{{"p", 3}, {"p", 4}, {"p", 5}, {"p", 9}, {"q", 1}, {"q", 2}}
	require.Equal(t, "[p#3-5 p#9 q#1-2]", idRanges(ids))
	require.Equal(t, "[]", idRanges(nil))
	var many []msgID
	for i := range 20 {
		many = append(many, msgID{"p", 2 * i})
	}
	require.Equal(t, "[p#0 p#2 p#4 p#6 p#8 p#10 ...]", idRanges(many))
}

func TestMatchTopic(t *testing.T) {
	for _, tc := range []struct {
		filter, topic string
		want          bool
	}{
		{"a/b", "a/b", true},
		{"a/b", "a/c", false},
		{"a/+", "a/b", true},
		{"a/+", "a/b/c", false},
		{"a/#", "a", true},
		{"a/#", "a/b/c", true},
		{"#", "a/b", true},
		{"#", "$SYS/x", false},
		{"+/x", "$SYS/x", false},
		{"$SYS/#", "$SYS/x", true},
		{"a/+/c", "a//c", true},
		{"a/b/c", "a/b", false},
	} {
		require.Equal(t, tc.want, matchTopic(tc.filter, tc.topic), "%s ~ %s", tc.filter, tc.topic)
	}
	// A Subscriber of a shared subscription stands for its group.
	s := NewChecker().NewSubscriber("group", 1, "$share/g/a/#")
	require.True(t, s.matches("a/b"))
	require.False(t, s.matches("b/a"))
}

func TestPayloadRoundTrip(t *testing.T) {
	id, ok := parsePayload(payloadOf("q1-p2", 417))
	require.True(t, ok)
	require.Equal(t, msgID{"q1-p2", 417}, id)
	for _, bad := range []string{"", "x", " 1", "p x", "p -3"} {
		_, ok := parsePayload([]byte(bad))
		require.False(t, ok, "%q", bad)
	}
}

// fakeMessage is the part of a received PUBLISH the checker reads.
type fakeMessage struct {
	mqtt.Message
	topic   string
	payload []byte
	qos     byte
	dup     bool
	id      uint16
}

func (m fakeMessage) Topic() string     { return m.topic }
func (m fakeMessage) Payload() []byte   { return m.payload }
func (m fakeMessage) Qos() byte         { return m.qos }
func (m fakeMessage) Duplicate() bool   { return m.dup }
func (m fakeMessage) MessageID() uint16 { return m.id }

func TestChecker_QoS2ResendUnderItsPacketIDIsNoDuplicate(t *testing.T) {
	c := NewChecker()
	c.addPublisher("q2", "t", 2)
	s := c.NewSubscriber("s", 2, "t")
	s.Subscribed()
	sendN(c, "q2", 3)
	msg := func(seq int, id uint16, dup bool) fakeMessage {
		return fakeMessage{topic: "t", payload: payloadOf("q2", seq), qos: 2, dup: dup, id: id}
	}
	s.recordMessage(msg(0, 1, false))
	s.recordMessage(msg(0, 1, true)) // the PUBREC was lost: re-sent, discarded
	s.recordMessage(msg(1, 2, true)) // a first reception may carry DUP
	s.recordMessage(msg(1, 3, true)) // another packet ID: delivered twice
	s.recordMessage(msg(2, 1, false))
	s.recordMessage(msg(2, 1, false)) // no DUP: a new PUBLISH, delivered twice
	r := c.Report().Sub("s")
	require.Equal(t, 1, r.Resent)
	require.Equal(t, 2, r.DuplicatedQoS2)
	require.Equal(t, 3, r.ExpectedQoS2)
	require.Zero(t, r.Lost)
}
