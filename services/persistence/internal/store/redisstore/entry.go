package redisstore

import (
	"fmt"
	"strconv"

	"github.com/keelmq/keel/services/persistence/internal/store"
)

// appendEntryJSON appends e as the JSON the scripts and Load read: the
// fields of [store.Entry] under their JSON names, empty ones left out
// (but "q"), and "s" only when withSeq (an append's script splices its own
// in front). encoding/json reads it back into a [store.Entry]; writing it
// by hand costs no reflection on the write path.
func appendEntryJSON(b []byte, e *store.Entry, withSeq bool) []byte {
	b = append(b, `{"m":`...)
	b = appendJSONString(b, e.MsgID)
	b = append(b, `,"q":`...)
	b = strconv.AppendUint(b, uint64(e.QoS), 10)
	if e.Retain {
		b = append(b, `,"r":true`...)
	}
	if len(e.SubIDs) > 0 {
		b = append(b, `,"ids":[`...)
		for i, id := range e.SubIDs {
			if i > 0 {
				b = append(b, ',')
			}
			b = strconv.AppendInt(b, int64(id), 10)
		}
		b = append(b, ']')
	}
	if e.PacketID != 0 {
		b = append(b, `,"pk":`...)
		b = strconv.AppendUint(b, uint64(e.PacketID), 10)
	}
	if e.Pubrel {
		b = append(b, `,"rel":true`...)
	}
	if withSeq && e.Seq != 0 {
		b = append(b, `,"s":`...)
		b = strconv.AppendUint(b, e.Seq, 10)
	}
	return append(b, '}')
}

// entrySize is about the length of e's JSON with a mark (more when its
// msgID needs escaping).
func entrySize(e *store.Entry) int {
	return 48 + len(e.MsgID) + 11*len(e.SubIDs)
}

// appendJSONString appends s as a JSON string: quotes, backslashes and
// control characters escaped, everything else (UTF-8 included) as is.
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c < 0x20:
			b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&15])
		default:
			b = append(b, c)
		}
	}
	return append(b, '"')
}

// validMsgID checks a msgID the store files a body under: the body's
// bucket and field are its bytes up to its last two and those two (see the
// scripts' body), so it needs two at least, and then no body field (two
// bytes) can be taken for a reference count (three).
func validMsgID(id string) error {
	if len(id) < 2 {
		return fmt.Errorf("%w: msgID %q: at least 2 bytes", store.ErrInvalid, id)
	}
	return nil
}
