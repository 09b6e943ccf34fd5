package broker

import "time"

// pendingWill is a will waiting for its delay.
type pendingWill struct {
	timer *time.Timer
	fire  func()
}

// scheduleWill publishes will after delay seconds unless the session
// reconnects first ([MQTT-3.1.3-9]).
func (b *Broker) scheduleWill(id string, will *Message, delay uint32) {
	publish := func() {
		if b.stopping.Load() {
			return
		}
		m := &Message{ID: b.ids.next(), Topic: will.Topic, Payload: will.Payload, QoS: will.QoS, Retain: will.Retain,
			Props: will.Props, Origin: will.Origin, Created: time.Now().UnixNano()}
		if e := m.Props.MessageExpiryInterval; e > 0 {
			m.Expiry = time.Now().Unix() + min(int64(e), b.cfg.MaxMessageExpiry)
		}
		if m.Retain {
			b.retain(m)
		}
		if err := b.route(m); err != nil {
			b.logger.Error("will not stored for every recipient", "client_id", id, "error", err)
		}
		b.m.willsPublished.Inc()
	}
	if delay == 0 {
		publish()
		return
	}
	b.willMu.Lock()
	defer b.willMu.Unlock()
	if old := b.wills[id]; old != nil {
		old.timer.Stop()
	}
	pw := &pendingWill{fire: publish}
	pw.timer = time.AfterFunc(time.Duration(delay)*time.Second, func() {
		b.willMu.Lock()
		if b.wills[id] == pw {
			delete(b.wills, id)
		}
		b.willMu.Unlock()
		publish()
	})
	b.wills[id] = pw
}

// cancelWill drops a delayed will when its client reconnects. When the new
// connection starts clean the old session ends now, and its will's delay with
// it: the will is published at once.
func (b *Broker) cancelWill(id string, clean bool) {
	b.willMu.Lock()
	pw := b.wills[id]
	delete(b.wills, id)
	b.willMu.Unlock()
	if pw == nil || !pw.timer.Stop() {
		return
	}
	if clean {
		pw.fire()
	}
}
