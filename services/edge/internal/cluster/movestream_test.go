package cluster

import (
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// TestCluster_SessionMovesUnderStream: a persistent subscriber moves from
// edge to edge again and again while a publisher on a third edge streams
// QoS 1 messages to it; every message acknowledged to the publisher
// reaches the subscriber on one of its connections.
func TestCluster_SessionMovesUnderStream(t *testing.T) {
	if testing.Short() {
		t.Skip("starts several processes; skipped under -short")
	}
	t.Parallel()
	c := startSharedCluster(t, "edge-a", "edge-b", "edge-c")
	a, b, cc := c.edges["edge-a"], c.edges["edge-b"], c.edges["edge-c"]

	var mu sync.Mutex
	got := map[string]bool{}
	read := func(cl *mqtttest.Client, stop <-chan struct{}, done chan<- struct{}) {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			pk, err := cl.Read(200 * time.Millisecond)
			if err != nil {
				if err.Error() == "EOF" {
					return
				}
				continue
			}
			switch pk.FixedHeader.Type {
			case packets.Publish:
				mu.Lock()
				got[string(pk.Payload)] = true
				mu.Unlock()
				if cl.Write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID}) != nil {
					return // taken over: the next connection gets the message again
				}
			case packets.Disconnect:
				return
			}
		}
	}
	first := mqtttest.Dial(t, a.mqtt, 5)
	first.Connect("mover", true, sessionProps)
	require.Equal(t, []byte{1}, first.Subscribe(1, "stream/#", 1).ReasonCodes)
	stop, done := make(chan struct{}), make(chan struct{})
	go read(first, stop, done)

	// The publisher: one message at a time, acknowledged or sent again.
	var acked []string
	var pubStop atomic.Bool
	pubDone := make(chan struct{})
	go func() {
		defer close(pubDone)
		pub := mqtttest.Dial(t, cc.mqtt, 5)
		pub.Connect("streamer", true, packets.Properties{})
		for i := 0; !pubStop.Load(); i++ {
			p := "s" + strconv.Itoa(i)
			pub.Publish(uint16(i%60000+1), "stream/x", 1, []byte(p))
			for {
				pk, err := pub.Read(5 * time.Second)
				if err != nil {
					// Closed unacknowledged: reconnect; the message may come twice.
					pub = mqtttest.Dial(t, cc.mqtt, 5)
					pub.Connect("streamer", true, packets.Properties{})
					break
				}
				if pk.FixedHeader.Type == packets.Puback {
					acked = append(acked, p)
					break
				}
			}
		}
	}()

	edges := []string{b.mqtt, a.mqtt}
	for move := range 8 {
		time.Sleep(300 * time.Millisecond)
		next := connectResumed(t, edges[move%2], "mover", 20*time.Second)
		<-done // the previous connection was taken over
		stop, done = make(chan struct{}), make(chan struct{})
		go read(next, stop, done)
	}
	time.Sleep(300 * time.Millisecond)
	pubStop.Store(true)
	<-pubDone
	deadline := time.Now().Add(15 * time.Second)
	var missing []string
	for {
		missing = missing[:0]
		mu.Lock()
		for _, p := range acked {
			if !got[p] {
				missing = append(missing, p)
			}
		}
		mu.Unlock()
		if len(missing) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	close(stop)
	t.Logf("%d messages acknowledged across 8 moves", len(acked))
	require.Empty(t, missing, fmt.Sprintf("acknowledged but never delivered (of %d)", len(acked)))
}

// TestCluster_CustodyMoveUnderStream: persistent subscribers of an edge that
// is killed go into custody while a publisher keeps streaming to them; their
// clients then come back on another edge, taking the sessions out of
// custody under the stream. Every acknowledged message arrives.
func TestCluster_CustodyMoveUnderStream(t *testing.T) {
	if testing.Short() {
		t.Skip("starts several processes; skipped under -short")
	}
	t.Parallel()
	c := startSharedCluster(t, "edge-a", "edge-b", "edge-c")
	a, b, cc := c.edges["edge-a"], c.edges["edge-b"], c.edges["edge-c"]
	const subs = 8
	var mu sync.Mutex
	got := map[string]bool{}
	read := func(cl *mqtttest.Client, id int) {
		for {
			pk, err := cl.Read(30 * time.Second)
			if err != nil {
				return
			}
			if pk.FixedHeader.Type == packets.Publish {
				mu.Lock()
				got[fmt.Sprintf("%d/%s", id, pk.Payload)] = true
				mu.Unlock()
				cl.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
			}
			if pk.FixedHeader.Type == packets.Disconnect {
				return
			}
		}
	}
	for i := range subs {
		cl := mqtttest.Dial(t, a.mqtt, 5)
		cl.Connect("sub-"+strconv.Itoa(i), true, sessionProps)
		require.Equal(t, []byte{1}, cl.Subscribe(1, "cs/"+strconv.Itoa(i), 1).ReasonCodes)
		go read(cl, i)
	}
	var acked []string
	var pubStop atomic.Bool
	pubDone := make(chan struct{})
	go func() {
		defer close(pubDone)
		dial := func() *mqtttest.Client {
			p := mqtttest.Dial(t, cc.mqtt, 5)
			p.Connect("cs-pub", true, packets.Properties{})
			return p
		}
		pub := dial()
		for n := 0; !pubStop.Load(); n++ {
			id := n % subs
			p := strconv.Itoa(n)
			pub.Publish(uint16(n%60000+1), "cs/"+strconv.Itoa(id), 1, []byte(p))
			for {
				pk, err := pub.Read(5 * time.Second)
				if err != nil {
					pub = dial()
					time.Sleep(50 * time.Millisecond)
					break
				}
				if pk.FixedHeader.Type == packets.Puback {
					acked = append(acked, fmt.Sprintf("%d/%s", id, p))
					break
				}
			}
		}
	}()
	time.Sleep(500 * time.Millisecond)
	a.kill()
	// The clients come back one by one while the stream goes on: some
	// sessions are still in custody, others already moved.
	time.Sleep(3 * time.Second)
	for i := range subs {
		cl := connectResumed(t, b.mqtt, "sub-"+strconv.Itoa(i), 30*time.Second)
		go read(cl, i)
		time.Sleep(250 * time.Millisecond)
	}
	time.Sleep(time.Second)
	pubStop.Store(true)
	<-pubDone
	deadline := time.Now().Add(15 * time.Second)
	var missing []string
	for {
		missing = missing[:0]
		mu.Lock()
		for _, p := range acked {
			if !got[p] {
				missing = append(missing, p)
			}
		}
		mu.Unlock()
		if len(missing) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("%d messages acknowledged", len(acked))
	require.Empty(t, missing, "acknowledged but never delivered")
}
