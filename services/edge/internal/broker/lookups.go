package broker

import (
	"sync"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// A publish whose routes the edge cannot answer from its route cache needs
// a Lookup at the router: a round trip. Made on the client's read loop, it
// would hold up every publish after it, so a backend sending commands to
// many devices, each topic a cache miss, would get one message through per
// round trip. Such a publish is routed off the read loop instead, behind
// the earlier publishes of its topic that are still being routed so: MQTT
// orders a client's messages per topic, and those of other topics go on.
// Its acknowledgement takes its place in the client's ack queue, which
// answers in the order of the PUBLISHes.

// lookupChains is, per topic, the last publish routed off the read loop
// and not yet routed.
type lookupChains struct {
	mu   sync.Mutex
	last map[string]*lookupLink // guarded by mu
}

// lookupLink is one publish in a topic's chain.
type lookupLink struct {
	done chan struct{} // closed once it is routed, or failed to be
	// failed is set before done is closed when it could not be routed:
	// the publisher is disconnected without its acknowledgement and sends
	// it again, so the publishes behind it on its topic must not be routed
	// either, or they would reach subscribers before it.
	failed bool
}

// pending reports whether a publish on topic is still being routed off
// the read loop: the next one on the topic must go behind it.
func (l *lookupChains) pending(topic string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.last[topic]
	return ok
}

// push makes link the last of topic's chain and returns the one before
// (nil if none).
func (l *lookupChains) push(topic string, link *lookupLink) (before *lookupLink) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.last == nil {
		l.last = map[string]*lookupLink{}
	}
	before = l.last[topic]
	l.last[topic] = link
	return before
}

// finish ends link, and topic's chain if link is its last.
func (l *lookupChains) finish(topic string, link *lookupLink, failed bool) {
	l.mu.Lock()
	if l.last[topic] == link {
		delete(l.last, topic)
	}
	l.mu.Unlock()
	link.failed = failed
	close(link.done)
}

// routeBehind routes m, published by cl, on a goroutine of its own once
// the publishes before it on its topic are routed, and has it acknowledged
// (QoS 1/2) in its turn; see lookupChains. It is OnPublish's answer.
func (b *Broker) routeBehind(cl *mqtt.Client, c *conn, pk *packets.Packet, m *Message) error {
	b.m.routedBehind.Inc()
	link := &lookupLink{done: make(chan struct{})}
	before := c.lookups.push(m.Topic, link)
	var wait func() error
	var err error
	b.ackers.Add(1)
	go func() {
		defer b.ackers.Done()
		defer func() { c.lookups.finish(m.Topic, link, err != nil) }()
		if before != nil {
			<-before.done
			// Read after the publisher's connection closed, it would not
			// have been routed on the read loop either: its resend is.
			if before.failed || cl.Closed() {
				err = errFailedEarlier
				if m.QoS == 0 {
					finishSpan(m.span, err)
				}
				return
			}
		}
		wait, err = b.routeAsync(m)
		if err != nil {
			wait, err = b.routeAgainNow(cl, m, err)
		}
		wait = b.retrying(cl, m, wait)
		if m.QoS == 0 {
			finishSpan(m.span, err)
			if err != nil {
				b.logger.Warn("publish not routed", "client_id", cl.ID, "error", err)
				_ = b.disconnect(cl, packets.ErrServerBusy)
			}
		}
	}()
	if m.QoS == 0 {
		return errIgnorePacket
	}
	b.queueAck(cl, c, pk, func() error {
		<-link.done
		if err != nil {
			return err
		}
		if wait == nil {
			return nil
		}
		return wait()
	}, false, m.span, m)
	return errRejectPacket // acknowledged by the queue
}
