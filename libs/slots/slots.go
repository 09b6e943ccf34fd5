// Package slots maps sessions to Redis groups. Persistence is K independent
// Redis groups (K fixed at install). A session's keys carry the hash tag
// {tenant:clientID}; the tag's slot is Redis's own key-slot function
// (CRC16/XMODEM of the tag's contents, modulo 16384), and the slot table the
// coordinator keeps in Raft maps each slot to a group. A tenant's retained
// messages live in the group of the slot of the tenant's name.
//
// Edges pick the persistence instance of a session's group with it, and a
// persistence instance refuses a session that is not its group's, so a
// misrouted write is an error instead of state kept where no resume looks.
package slots

import (
	"errors"
	"fmt"
)

// Count is the number of slots.
const Count = 16384

// Of returns the slot of a session: of its hash tag's contents,
// "tenant:clientID".
func Of(tenant, clientID string) uint16 {
	c := crc16(0, tenant)
	c = crc16Byte(c, ':')
	return crc16(c, clientID) % Count
}

// OfTenant returns the slot of a tenant's retained messages.
func OfTenant(tenant string) uint16 { return crc16(0, tenant) % Count }

// Table maps each slot (the index) to its group.
type Table []uint32

// Even returns the table that gives k groups equal runs of consecutive
// slots: the table a cluster of k groups is installed with.
func Even(k int) Table {
	t := make(Table, Count)
	for s := range t {
		t[s] = uint32(s * k / Count)
	}
	return t
}

// ErrInvalid reports a table that cannot be used.
var ErrInvalid = errors.New("invalid slot table")

// Validate checks that t maps every slot to one of k groups and that every
// group has a slot.
func (t Table) Validate(k int) error {
	if k < 1 {
		return fmt.Errorf("%w: %d groups", ErrInvalid, k)
	}
	if len(t) != Count {
		return fmt.Errorf("%w: %d slots, want %d", ErrInvalid, len(t), Count)
	}
	used := make([]bool, k)
	for s, g := range t {
		if int(g) >= k {
			return fmt.Errorf("%w: slot %d maps to group %d of %d", ErrInvalid, s, g, k)
		}
		used[g] = true
	}
	for g, ok := range used {
		if !ok {
			return fmt.Errorf("%w: group %d has no slot", ErrInvalid, g)
		}
	}
	return nil
}

// Group returns the group of a slot. A nil table has one group, 0.
func (t Table) Group(slot uint16) uint32 {
	if t == nil {
		return 0
	}
	return t[slot%Count]
}

// Session returns the group of a session.
func (t Table) Session(tenant, clientID string) uint32 { return t.Group(Of(tenant, clientID)) }

// Tenant returns the group of a tenant's retained messages.
func (t Table) Tenant(tenant string) uint32 { return t.Group(OfTenant(tenant)) }

// crc16 is CRC-16/XMODEM (polynomial 0x1021, initial 0), Redis's
// key-slot CRC, continued from c over s.
func crc16(c uint16, s string) uint16 {
	for i := 0; i < len(s); i++ {
		c = crc16Byte(c, s[i])
	}
	return c
}

func crc16Byte(c uint16, b byte) uint16 { return c<<8 ^ crcTable[byte(c>>8)^b] }

var crcTable = func() (t [256]uint16) {
	for i := range t {
		c := uint16(i) << 8
		for range 8 {
			if c&0x8000 != 0 {
				c = c<<1 ^ 0x1021
			} else {
				c <<= 1
			}
		}
		t[i] = c
	}
	return t
}()
