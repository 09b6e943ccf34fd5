package redisstore

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"unicode/utf8"

	"github.com/keelmq/keel/services/persistence/internal/store"
)

// appendEntryJSON appends e as the JSON the scripts and Load read: the
// fields of [store.Entry] under their JSON names, empty ones left out
// (but "q"), and "s" only when withSeq (an append's script splices its own
// in front). encoding/json reads it back into a [store.Entry]; writing it
// by hand costs no reflection on the write path.
func appendEntryJSON(b []byte, e *store.Entry, withSeq bool) []byte {
	return appendEntryTail(append(b, '{'), e, withSeq)
}

// appendEntryTail appends e's JSON but its opening '{': an append's
// script splices the entry's queue position in front of it.
func appendEntryTail(b []byte, e *store.Entry, withSeq bool) []byte {
	b = append(b, `"m":`...)
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

// parseEntryJSON reads an entry as appendEntryJSON and the scripts write
// it (keys s, x, m, q, r, ids, pk, rel; numbers, true, a string without
// escapes, a list of numbers), into e: a session resumed with a long queue
// decodes one per entry, and encoding/json spent a quarter of Load's CPU
// on them. Anything else it leaves to encoding/json.
func parseEntryJSON(b []byte, e *store.Entry) error {
	*e = store.Entry{}
	if ok := parseEntryFast(b, e); ok {
		return nil
	}
	*e = store.Entry{}
	return json.Unmarshal(b, e)
}

func parseEntryFast(b []byte, e *store.Entry) bool {
	if len(b) < 2 || b[0] != '{' || b[len(b)-1] != '}' {
		return false
	}
	b = b[1 : len(b)-1]
	for len(b) > 0 {
		// "key":
		if b[0] != '"' {
			return false
		}
		end := bytes.IndexByte(b[1:], '"')
		if end < 0 || len(b) < end+3 || b[end+2] != ':' {
			return false
		}
		key := string(b[1 : end+1])
		b = b[end+3:]
		// value, up to the next comma at this level
		var v []byte
		switch {
		case len(b) > 0 && b[0] == '"':
			end := bytes.IndexByte(b[1:], '"')
			if end < 0 || bytes.IndexByte(b[1:end+1], '\\') >= 0 || !utf8.Valid(b[1:end+1]) {
				return false
			}
			v, b = b[:end+2], b[end+2:]
		case len(b) > 0 && b[0] == '[':
			end := bytes.IndexByte(b, ']')
			if end < 0 {
				return false
			}
			v, b = b[:end+1], b[end+1:]
		default:
			end := bytes.IndexByte(b, ',')
			if end < 0 {
				end = len(b)
			}
			v, b = b[:end], b[end:]
		}
		if len(b) > 0 {
			if b[0] != ',' || len(b) == 1 {
				return false
			}
			b = b[1:]
		}
		if !entryField(key, v, e) {
			return false
		}
	}
	return e.MsgID != ""
}

// entryField sets e's field key from its JSON value v (unknown keys are
// skipped when their value is a plain number, true or a string).
func entryField(key string, v []byte, e *store.Entry) bool {
	num := func(bits int) (uint64, bool) {
		n, err := strconv.ParseUint(string(v), 10, bits)
		return n, err == nil
	}
	switch key {
	case "m":
		if len(v) < 2 || v[0] != '"' {
			return false
		}
		e.MsgID = string(v[1 : len(v)-1])
	case "q":
		n, ok := num(8)
		if !ok {
			return false
		}
		e.QoS = byte(n)
	case "s":
		n, ok := num(64)
		if !ok {
			return false
		}
		e.Seq = n
	case "pk":
		n, ok := num(16)
		if !ok {
			return false
		}
		e.PacketID = uint16(n)
	case "r", "rel":
		if string(v) != "true" {
			return false
		}
		if key == "r" {
			e.Retain = true
		} else {
			e.Pubrel = true
		}
	case "ids":
		if len(v) < 2 || v[0] != '[' {
			return false
		}
		for _, f := range bytes.Split(v[1:len(v)-1], []byte{','}) {
			n, err := strconv.ParseInt(string(f), 10, 64)
			if err != nil {
				return false
			}
			e.SubIDs = append(e.SubIDs, int(n))
		}
	default:
		if len(v) == 0 || v[0] == '[' || v[0] == '{' {
			return false
		}
	}
	return true
}
