// SPDX-License-Identifier: MIT
// SPDX-FileCopyrightText: 2023 mochi-mqtt, mochi-co
// SPDX-FileContributor: mochi-co

package mqtt

import (
	"sort"
	"sync"
	"sync/atomic"

	"github.com/mochi-mqtt/server/v2/packets"
)

// Inflight is a map of InflightMessage keyed on packet id.
//
// keel patch: keyed on the packet ID and the flow's direction. The client
// and the server assign packet identifiers independently (MQTT 5 §2.2.1):
// the same ID may be in flight both ways at once. Kept in one key space, a
// client's PUBLISH under an ID the server used for a delivery dropped that
// delivery's state (its PUBACK was then ignored), and its SUBSCRIBE was
// refused as "packet identifier in use". The inbound flows (the server's
// PUBACK, PUBREC or PUBCOMP to the client's PUBLISH) are looked up with
// TypeInbound and DeleteInbound; Get, Type and Delete are the outbound ones
// (the server's PUBLISH or PUBREL). Set and Remove go by the packet's type.
type Inflight struct {
	sync.RWMutex
	internal            map[inflightKey]packets.Packet // internal contains the inflight packets
	receiveQuota        int32                          // remaining inbound qos quota for flow control
	sendQuota           int32                          // remaining outbound qos quota for flow control
	maximumReceiveQuota int32                          // maximum allowed receive quota
	maximumSendQuota    int32                          // maximum allowed send quota
}

// inflightKey is a packet ID, with inboundFlow set for an inbound flow.
type inflightKey uint32

const inboundFlow inflightKey = 1 << 16

// keyOf is the key of an in-flight packet: the acknowledgements the
// server sends are of the client's flows.
func keyOf(m *packets.Packet) inflightKey {
	switch m.FixedHeader.Type {
	case packets.Puback, packets.Pubrec, packets.Pubcomp:
		return inboundFlow | inflightKey(m.PacketID)
	}
	return inflightKey(m.PacketID)
}

// NewInflights returns a new instance of an Inflight packets map.
func NewInflights() *Inflight {
	return &Inflight{
		internal: map[inflightKey]packets.Packet{},
	}
}

// Set adds or updates an inflight packet by packet id, in its direction.
func (i *Inflight) Set(m packets.Packet) bool {
	i.Lock()
	defer i.Unlock()

	k := keyOf(&m)
	_, ok := i.internal[k]
	i.internal[k] = m
	return !ok
}

// Get returns an outbound inflight packet by packet id.
func (i *Inflight) Get(id uint16) (packets.Packet, bool) {
	i.RLock()
	defer i.RUnlock()

	if m, ok := i.internal[inflightKey(id)]; ok {
		return m, true
	}

	return packets.Packet{}, false
}

// Type returns the type of the outbound packet in flight under id, if there
// is one. keel patch: for the checks that need no more than that, which
// took a copy of the whole packet (808 bytes) from Get.
func (i *Inflight) Type(id uint16) (byte, bool) {
	return i.typeOf(inflightKey(id))
}

// TypeInbound is Type for the client's flow under id. keel patch.
func (i *Inflight) TypeInbound(id uint16) (byte, bool) {
	return i.typeOf(inboundFlow | inflightKey(id))
}

func (i *Inflight) typeOf(k inflightKey) (byte, bool) {
	i.RLock()
	defer i.RUnlock()
	if _, ok := i.internal[k]; !ok { // no copy of the packet, unlike m, ok := ...
		return 0, false
	}
	return i.internal[k].FixedHeader.Type, true
}

// Len returns the size of the inflight messages map.
func (i *Inflight) Len() int {
	i.RLock()
	defer i.RUnlock()
	return len(i.internal)
}

// Clone returns a new instance of Inflight with the same message data.
// This is used when transferring inflights from a taken-over session.
func (i *Inflight) Clone() *Inflight {
	c := NewInflights()
	i.RLock()
	defer i.RUnlock()
	for k, v := range i.internal {
		c.internal[k] = v
	}
	return c
}

// GetAll returns all the inflight messages.
func (i *Inflight) GetAll(immediate bool) []packets.Packet {
	i.RLock()
	defer i.RUnlock()

	m := []packets.Packet{}
	for _, v := range i.internal {
		if !immediate || (immediate && v.Expiry < 0) {
			m = append(m, v)
		}
	}

	sort.Slice(m, func(i, j int) bool {
		return uint16(m[i].Created) < uint16(m[j].Created)
	})

	return m
}

// NextImmediate returns the next inflight packet which is indicated to be sent immediately.
// This typically occurs when the quota has been exhausted, and we need to wait until new quota
// is free to continue sending.
func (i *Inflight) NextImmediate() (packets.Packet, bool) {
	i.RLock()
	defer i.RUnlock()

	m := i.GetAll(true)
	if len(m) > 0 {
		return m[0], true
	}

	return packets.Packet{}, false
}

// Delete removes an outbound in-flight message from the map. Returns true if the message existed.
func (i *Inflight) Delete(id uint16) bool {
	return i.remove(inflightKey(id))
}

// DeleteInbound is Delete for the client's flow under id. keel patch.
func (i *Inflight) DeleteInbound(id uint16) bool {
	return i.remove(inboundFlow | inflightKey(id))
}

// Remove deletes m's flow, in m's direction (a packet of GetAll). keel patch.
func (i *Inflight) Remove(m packets.Packet) bool {
	return i.remove(keyOf(&m))
}

func (i *Inflight) remove(k inflightKey) bool {
	i.Lock()
	defer i.Unlock()

	_, ok := i.internal[k]
	delete(i.internal, k)

	return ok
}

// TakeRecieveQuota reduces the receive quota by 1.
func (i *Inflight) DecreaseReceiveQuota() {
	if atomic.LoadInt32(&i.receiveQuota) > 0 {
		atomic.AddInt32(&i.receiveQuota, -1)
	}
}

// TakeRecieveQuota increases the receive quota by 1.
func (i *Inflight) IncreaseReceiveQuota() {
	if atomic.LoadInt32(&i.receiveQuota) < atomic.LoadInt32(&i.maximumReceiveQuota) {
		atomic.AddInt32(&i.receiveQuota, 1)
	}
}

// ResetReceiveQuota resets the receive quota to the maximum allowed value.
func (i *Inflight) ResetReceiveQuota(n int32) {
	atomic.StoreInt32(&i.receiveQuota, n)
	atomic.StoreInt32(&i.maximumReceiveQuota, n)
}

// DecreaseSendQuota reduces the send quota by 1.
func (i *Inflight) DecreaseSendQuota() {
	if atomic.LoadInt32(&i.sendQuota) > 0 {
		atomic.AddInt32(&i.sendQuota, -1)
	}
}

// IncreaseSendQuota increases the send quota by 1.
func (i *Inflight) IncreaseSendQuota() {
	if atomic.LoadInt32(&i.sendQuota) < atomic.LoadInt32(&i.maximumSendQuota) {
		atomic.AddInt32(&i.sendQuota, 1)
	}
}

// ResetSendQuota resets the send quota to the maximum allowed value.
func (i *Inflight) ResetSendQuota(n int32) {
	atomic.StoreInt32(&i.sendQuota, n)
	atomic.StoreInt32(&i.maximumSendQuota, n)
}
