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

// parseEntryJSON reads what the store writes (the scripts add "s" and "x"
// in front, and "rel" at the end) as encoding/json does.
func TestParseEntryJSON(t *testing.T) {
	for _, raw := range []string{
		`{"s":7,"m":"e/1/1","q":1}`,
		`{"s":7,"x":1,"m":"e/1/2","q":2,"r":true,"ids":[1,268435455],"pk":65535,"rel":true}`,
		`{"x":1,"m":"e/1/3","q":1,"pk":3,"rel":true}`,
		`{"m":"q\"uote\u0001/9/9","q":1}`,
		`{"m":"é:,{}/1/1","q":0,"ids":[]}`,
		`{"q":1}`,
	} {
		var want, got store.Entry
		werr := json.Unmarshal([]byte(raw), &want)
		gerr := parseEntryJSON([]byte(raw), &got)
		require.Equal(t, werr == nil, gerr == nil, raw)
		require.Equal(t, want, got, raw)
	}
}

func FuzzParseEntryJSON(f *testing.F) {
	f.Add([]byte(`{"s":7,"x":1,"m":"e/1/2","q":2,"r":true,"ids":[1,2],"pk":65535,"rel":true}`))
	f.Add([]byte(`{"m":"a\"b","q":1}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var want, got store.Entry
		werr := json.Unmarshal(b, &want)
		gerr := parseEntryJSON(b, &got)
		if werr != nil {
			return // the fast path may read what encoding/json refuses; the store never writes it
		}
		require.NoError(t, gerr)
		require.Equal(t, want, got)
	})
}
