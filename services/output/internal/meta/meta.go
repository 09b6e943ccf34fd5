// Package meta turns an output record's MQTT metadata into sink headers, in
// one place, so the Kafka and HTTP sinks name them alike, and holds the small
// JSON helpers plugin configurations share ([Duration]).
package meta

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"time"
	"unicode"
	"unicode/utf8"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
)

// Header names carried by every sink record. User properties follow them
// in order, under their own keys except those Keel reserves (see
// [UserPropertyHeader]), and then any headers a transform added.
const (
	HeaderTenant          = "keel-tenant"
	HeaderTopic           = "keel-topic"
	HeaderClientID        = "keel-client-id"
	HeaderMsgID           = "keel-msg-id"
	HeaderQoS             = "keel-qos"
	HeaderRetain          = "keel-retain"
	HeaderIngress         = "keel-ingress-unix-nano"
	HeaderContentType     = "keel-content-type"
	HeaderResponseTopic   = "keel-response-topic"
	HeaderCorrelationData = "keel-correlation-data"
	HeaderPayloadFormat   = "keel-payload-format"
)

// HeaderPrefix begins every header Keel sets, and UserPropertyPrefix the
// headers of user properties whose keys begin with HeaderPrefix. No header
// Keel sets itself begins with UserPropertyPrefix.
const (
	HeaderPrefix       = "keel-"
	UserPropertyPrefix = "keel-user-property-"
)

// UserPropertyHeader returns the header key of an MQTT 5 user property. A
// key that begins with [HeaderPrefix], in any case, is carried under
// [UserPropertyPrefix] + key, so that a publisher cannot forge Keel's own
// headers (a user property "keel-tenant" becomes
// "keel-user-property-keel-tenant") and consumers can tell the two apart:
// the mapping is one to one, and only such keys begin with the prefix.
func UserPropertyHeader(key string) string {
	if ReservedKey(key) {
		return UserPropertyPrefix + key
	}
	return key
}

// ReservedKey reports whether key begins with [HeaderPrefix] under Unicode
// case folding: consumers compare header names case-insensitively as often
// as not (HTTP always does), and some fold the Kelvin sign to "k".
func ReservedKey(key string) bool {
	for _, p := range HeaderPrefix {
		r, n := utf8.DecodeRuneInString(key)
		if n == 0 || !foldEqual(r, p) {
			return false
		}
		key = key[n:]
	}
	return true
}

// foldEqual is strings.EqualFold for one rune, without converting it to a
// string.
func foldEqual(r, p rune) bool {
	if r == p {
		return true
	}
	for f := unicode.SimpleFold(p); f != p; f = unicode.SimpleFold(f) {
		if f == r {
			return true
		}
	}
	return false
}

// MsgID formats a message ID as "edge:incarnation:seq", the string consumers
// de-duplicate on.
func MsgID(id *commonv1.MsgID) string {
	if id == nil {
		return ""
	}
	return id.GetEdgeId() + ":" + strconv.FormatUint(id.GetIncarnation(), 10) + ":" + strconv.FormatUint(id.GetSeq(), 10)
}

// Header is one sink header.
type Header struct {
	Key   string
	Value []byte
}

// Headers returns the headers of r: the keel-* metadata (optional MQTT 5
// properties only when present), the MQTT 5 user properties (keys as
// [UserPropertyHeader] maps them) and then r's own headers. withUserProps
// false leaves the user properties out (the HTTP sink carries them
// differently).
func Headers(r *pluginv1.Record, withUserProps bool) []Header {
	m := r.GetMessage()
	hs := make([]Header, 0, 8+len(m.GetUserProperties())+len(r.GetHeaders()))
	add := func(k string, v []byte) { hs = append(hs, Header{Key: k, Value: v}) }
	add(HeaderTenant, []byte(m.GetTenant()))
	add(HeaderTopic, []byte(m.GetTopic()))
	add(HeaderClientID, []byte(m.GetClientId()))
	add(HeaderMsgID, []byte(MsgID(m.GetId())))
	add(HeaderQoS, []byte(strconv.FormatUint(uint64(m.GetQos()), 10)))
	add(HeaderRetain, []byte(strconv.FormatBool(m.GetRetain())))
	if m.GetIngressUnixNano() != 0 {
		add(HeaderIngress, []byte(strconv.FormatInt(m.GetIngressUnixNano(), 10)))
	}
	if m.GetContentType() != "" {
		add(HeaderContentType, []byte(m.GetContentType()))
	}
	if m.GetResponseTopic() != "" {
		add(HeaderResponseTopic, []byte(m.GetResponseTopic()))
	}
	if len(m.GetCorrelationData()) > 0 {
		add(HeaderCorrelationData, m.GetCorrelationData())
	}
	if m.GetPayloadFormat() != 0 {
		add(HeaderPayloadFormat, []byte(strconv.FormatUint(uint64(m.GetPayloadFormat()), 10)))
	}
	if withUserProps {
		for _, up := range m.GetUserProperties() {
			add(UserPropertyHeader(up.GetKey()), []byte(up.GetValue()))
		}
	}
	for _, h := range r.GetHeaders() {
		add(h.GetKey(), h.GetValue())
	}
	return hs
}

// HeaderLike is any header type shaped like [Header] (e.g. kafka.Header),
// so that [AppendHeaders] can build a sink's own header type directly.
type HeaderLike interface {
	~struct {
		Key   string
		Value []byte
	}
}

// AppendHeaders appends the headers [Headers] returns to dst, the same
// ones in the same order, with every value that must be formatted or copied
// from a string appended to arena instead of allocated on its own. It
// returns both grown. The values alias arena (and r's bytes fields), so
// arena must not be reused while they are in use.
func AppendHeaders[H HeaderLike](dst []H, arena []byte, r *pluginv1.Record, withUserProps bool) ([]H, []byte) {
	m := r.GetMessage()
	add := func(k string, v []byte) {
		dst = append(dst, H(struct {
			Key   string
			Value []byte
		}{k, v}))
	}
	addStr := func(k, v string) {
		n := len(arena)
		arena = append(arena, v...)
		add(k, arena[n:len(arena):len(arena)])
	}
	addStr(HeaderTenant, m.GetTenant())
	addStr(HeaderTopic, m.GetTopic())
	addStr(HeaderClientID, m.GetClientId())
	n := len(arena)
	if id := m.GetId(); id != nil {
		arena = append(arena, id.GetEdgeId()...)
		arena = append(arena, ':')
		arena = strconv.AppendUint(arena, id.GetIncarnation(), 10)
		arena = append(arena, ':')
		arena = strconv.AppendUint(arena, id.GetSeq(), 10)
	}
	add(HeaderMsgID, arena[n:len(arena):len(arena)])
	n = len(arena)
	arena = strconv.AppendUint(arena, uint64(m.GetQos()), 10)
	add(HeaderQoS, arena[n:len(arena):len(arena)])
	addStr(HeaderRetain, strconv.FormatBool(m.GetRetain()))
	if m.GetIngressUnixNano() != 0 {
		n = len(arena)
		arena = strconv.AppendInt(arena, m.GetIngressUnixNano(), 10)
		add(HeaderIngress, arena[n:len(arena):len(arena)])
	}
	if m.GetContentType() != "" {
		addStr(HeaderContentType, m.GetContentType())
	}
	if m.GetResponseTopic() != "" {
		addStr(HeaderResponseTopic, m.GetResponseTopic())
	}
	if len(m.GetCorrelationData()) > 0 {
		add(HeaderCorrelationData, m.GetCorrelationData())
	}
	if m.GetPayloadFormat() != 0 {
		n = len(arena)
		arena = strconv.AppendUint(arena, uint64(m.GetPayloadFormat()), 10)
		add(HeaderPayloadFormat, arena[n:len(arena):len(arena)])
	}
	if withUserProps {
		for _, up := range m.GetUserProperties() {
			// A reserved key costs an allocation; publishers rarely send one.
			addStr(UserPropertyHeader(up.GetKey()), up.GetValue())
		}
	}
	for _, h := range r.GetHeaders() {
		add(h.GetKey(), h.GetValue())
	}
	return dst, arena
}

// HeadersSize returns an upper bound of the headers AppendHeaders appends
// for r and of the arena bytes it uses.
func HeadersSize(r *pluginv1.Record, withUserProps bool) (headers, arenaBytes int) {
	m := r.GetMessage()
	headers = 11 + len(r.GetHeaders())
	arenaBytes = len(m.GetTenant()) + len(m.GetTopic()) + len(m.GetClientId()) + len(m.GetId().GetEdgeId()) +
		len(m.GetContentType()) + len(m.GetResponseTopic()) + 2*20 + 20 + 3*3 + 5
	if withUserProps {
		headers += len(m.GetUserProperties())
		for _, up := range m.GetUserProperties() {
			arenaBytes += len(up.GetValue())
		}
	}
	return headers, arenaBytes
}

// Duration is a time.Duration written in JSON as a Go duration string
// ("250ms") or a number of nanoseconds.
type Duration time.Duration

// UnmarshalJSON implements json.Unmarshaler.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		v, err := time.ParseDuration(s)
		if err != nil {
			return fmt.Errorf("duration %q: %w", s, err)
		}
		*d = Duration(v)
		return nil
	}
	var n int64
	if err := json.Unmarshal(b, &n); err != nil {
		return fmt.Errorf("duration: want a string like \"5s\": %w", err)
	}
	*d = Duration(n)
	return nil
}

// MarshalJSON implements json.Marshaler.
func (d Duration) MarshalJSON() ([]byte, error) {
	return json.Marshal(time.Duration(d).String())
}

// Or returns d, or def when d is zero.
func (d Duration) Or(def time.Duration) time.Duration {
	if d == 0 {
		return def
	}
	return time.Duration(d)
}

// DecodeConfig decodes a plugin's JSON configuration strictly: unknown
// fields are errors, so a typo in the rules file is reported, not ignored.
func DecodeConfig(b []byte, v any) error {
	if len(b) == 0 {
		b = []byte("{}")
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("decode config: %w", err)
	}
	return nil
}
