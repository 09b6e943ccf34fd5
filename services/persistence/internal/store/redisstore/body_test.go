package redisstore

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/persistence/internal/store"
)

var bodyFixtures = []*store.Message{
	{ID: "e/1/1", Topic: "t"},
	{ID: "edge-a/7/123456789", Topic: "a/b/c", Payload: []byte("hello"), QoS: 2, Retain: true, Props: []byte{1, 2, 3},
		Created: 1_700_000_000_123_456_789, Expiry: 1_700_000_600},
	{ID: "é/0/1", Topic: "$SYS/ü", Payload: make([]byte, 70000), QoS: 1, Created: -5},
}

func TestBody_RoundTrip(t *testing.T) {
	for _, m := range bodyFixtures {
		b := appendBody(nil, m)
		require.Equal(t, len(b), bodySize(m))
		got, err := parseBody(b)
		require.NoError(t, err)
		require.Equal(t, m, got)
		for i := range b {
			_, err := parseBody(b[:i])
			require.ErrorIs(t, err, errBody, "truncated at %d", i)
		}
		_, err = parseBody(append(b, 0))
		require.ErrorIs(t, err, errBody, "trailing byte")
	}
}

// FuzzParseBody: a body read from Redis decodes to a message that encodes
// back to the same bytes, or is refused; it never panics.
func FuzzParseBody(f *testing.F) {
	for _, m := range bodyFixtures {
		f.Add(appendBody(nil, m))
	}
	f.Add([]byte{bodyVersion})
	f.Add([]byte("{\"id\":\"x\"}"))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := parseBody(b)
		if err != nil {
			return
		}
		b2 := appendBody(nil, m)
		require.Equal(t, len(b2), bodySize(m))
		m2, err := parseBody(b2)
		require.NoError(t, err)
		require.Equal(t, m, m2)
	})
}
