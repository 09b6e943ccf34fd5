package slots

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Known answers of Redis's CLUSTER KEYSLOT (asked of a redis-server in
// cluster mode); the check value of CRC-16/XMODEM is 0x31C3.
func TestOf_RedisKeySlot(t *testing.T) {
	require.Equal(t, uint16(0x31c3), crc16(0, "123456789"))
	require.Equal(t, uint16(12739), OfTenant("123456789"))
	require.Equal(t, uint16(12182), OfTenant("foo"))   // CLUSTER KEYSLOT foo
	require.Equal(t, uint16(866), OfTenant("hello"))   // CLUSTER KEYSLOT hello
	require.Equal(t, uint16(241), Of("acme", "dev-1")) // CLUSTER KEYSLOT acme:dev-1
	require.Equal(t, uint16(2943), Of("acme", ""))     // CLUSTER KEYSLOT acme:
}

func TestEven(t *testing.T) {
	for _, k := range []int{1, 2, 3, 7, 16} {
		tab := Even(k)
		require.NoError(t, tab.Validate(k))
		counts := make([]int, k)
		for _, g := range tab {
			counts[g]++
		}
		for _, n := range counts {
			require.InDelta(t, Count/k, n, 1)
		}
	}
	require.Equal(t, uint32(0), Table(nil).Session("acme", "x"))
}

func TestValidate(t *testing.T) {
	require.ErrorIs(t, Even(2).Validate(1), ErrInvalid)     // group 1 of 1
	require.ErrorIs(t, Even(1).Validate(2), ErrInvalid)     // group 1 has no slot
	require.ErrorIs(t, Table{0, 1}.Validate(2), ErrInvalid) // too short
	require.ErrorIs(t, Even(1).Validate(0), ErrInvalid)     // no groups
}

// Sessions spread over the groups.
func TestSession_Spreads(t *testing.T) {
	tab := Even(4)
	counts := make([]int, 4)
	for i := range 40000 {
		counts[tab.Session("acme", "device-"+string(rune('a'+i%26))+itoa(i))]++
	}
	for g, n := range counts {
		require.InDelta(t, 10000, n, 600, "group %d", g)
	}
}

func itoa(i int) string {
	var b [12]byte
	n := len(b)
	for {
		n--
		b[n] = byte('0' + i%10)
		i /= 10
		if i == 0 {
			return string(b[n:])
		}
	}
}
