package redisstore

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/persistence/internal/store"
)

// The hand-written entry JSON is what encoding/json writes for the same
// entry, and reads back to it.
func TestEntryJSON_MatchesEncodingJSON(t *testing.T) {
	for _, e := range []store.Entry{
		{MsgID: "e/1/1"},
		{MsgID: "e/1/2", QoS: 2, Retain: true, SubIDs: []int{1, 268435455}, PacketID: 65535, Pubrel: true, Seq: 42},
		{MsgID: "q\"uote\\back\x01slash\u00e9/9/9", QoS: 1, PacketID: 1, Seq: 1},
	} {
		want, err := json.Marshal(&e)
		require.NoError(t, err)
		require.JSONEq(t, string(want), string(appendEntryJSON(nil, &e, true)))
		var back store.Entry
		require.NoError(t, json.Unmarshal(appendEntryJSON(nil, &e, false), &back))
		e.Seq = 0
		require.Equal(t, e, back)
	}
}
