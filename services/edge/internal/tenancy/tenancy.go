// Package tenancy maps client IDs, topic names and topic filters between the
// names a client uses and the internal, tenant-scoped names the broker core
// (mochi) sees.
//
// mochi keys clients by bare client ID and keeps one topic index and one
// retained store per process, so the edge never lets it see an outside name.
// The internal forms are:
//
//	client ID          "<len(tenant)>:<tenant><client ID>"    e.g. "4:acmedev-1"
//	topic / filter     "<tenant>/<topic>"                      e.g. "acme/a/b", "acme/#"
//	$-topic / filter   "$:<tenant>/<topic>"                    e.g. "$:acme/$SYS/x"
//	shared filter      "$share/<group>/<internal filter>"      e.g. "$share/g/acme/a/+"
//
// Every internal topic begins with a literal tenant level, so no filter of one
// tenant can match a topic of another, and a leading wildcard of a tenant
// ("acme/#") never reaches that tenant's $-topics, which live under "$:acme".
// "$:" cannot begin a tenant name ([a-z0-9-]) nor the group prefix "$share",
// so the forms never collide. Mapping back is a substring: outbound PUBLISH
// topics and client IDs cost no allocation.
package tenancy

import (
	"errors"
	"strconv"
	"strings"
	"unsafe"
)

// DefaultTenant is the tenant of clients admitted without credentials.
const DefaultTenant = "default"

// MaxTenantLen is the longest tenant name.
const MaxTenantLen = 63

// dollarMark introduces the internal form of a $-topic.
const dollarMark = "$:"

// SharePrefix and QueuePrefix are the shared-subscription prefixes clients use.
const (
	SharePrefix = "$share/"
	QueuePrefix = "$queue/"
	// QueueGroup is the share group that "$queue/<filter>" subscriptions join.
	// It starts with '$', which no "$share/<group>" a client sends can collide
	// with because the edge rejects '$' in client-chosen group names.
	QueueGroup = "$queue"
)

// ErrInvalidTenant reports a tenant name outside [a-z0-9-]{1,63}.
var ErrInvalidTenant = errors.New("invalid tenant name")

// ValidTenant reports whether name is a valid tenant name.
func ValidTenant(name string) bool {
	if len(name) == 0 || len(name) > MaxTenantLen {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' {
			return false
		}
	}
	return true
}

// Scope holds the precomputed prefixes of one tenant. Build one per tenant and
// share it across that tenant's connections.
type Scope struct {
	tenant       string
	idPrefix     string // "4:acme"
	topicPrefix  string // "acme/"
	dollarPrefix string // "$:acme/"
}

// NewScope returns the scope of tenant, or ErrInvalidTenant.
func NewScope(tenant string) (*Scope, error) {
	if !ValidTenant(tenant) {
		return nil, ErrInvalidTenant
	}
	return &Scope{
		tenant:       tenant,
		idPrefix:     strconv.Itoa(len(tenant)) + ":" + tenant,
		topicPrefix:  tenant + "/",
		dollarPrefix: dollarMark + tenant + "/",
	}, nil
}

// Tenant returns the tenant name.
func (s *Scope) Tenant() string { return s.tenant }

// TopicPrefix returns "<tenant>/", the prefix of the tenant's ordinary topics.
func (s *Scope) TopicPrefix() string { return s.topicPrefix }

// ClientID returns the internal form of an outside client ID.
func (s *Scope) ClientID(id string) string { return s.idPrefix + id }

// ExternalClientID returns the outside form of an internal client ID of this
// tenant. ok is false when internal does not belong to the tenant.
func (s *Scope) ExternalClientID(internal string) (string, bool) {
	if !strings.HasPrefix(internal, s.idPrefix) {
		return "", false
	}
	return internal[len(s.idPrefix):], true
}

// Topic returns the internal form of an outside topic name or non-shared
// filter. The empty string stays empty (a PUBLISH that uses a topic alias).
func (s *Scope) Topic(t string) string {
	if t == "" {
		return ""
	}
	return s.prefixOf(t) + t
}

// prefixOf is the prefix of the internal form of non-empty topic t.
func (s *Scope) prefixOf(t string) string {
	if t[0] == '$' {
		return s.dollarPrefix
	}
	return s.topicPrefix
}

// TopicAndClientID returns Topic(t) and ClientID(id) made in one
// allocation, which they share: a forwarded message needs both, and one
// allocation fewer per message counts on the receiving edge.
func (s *Scope) TopicAndClientID(t, id string) (topic, clientID string) {
	if id == "" {
		return s.Topic(t), ""
	}
	if t == "" {
		return "", s.ClientID(id)
	}
	prefix := s.prefixOf(t)
	buf := make([]byte, 0, len(prefix)+len(t)+len(s.idPrefix)+len(id))
	buf = append(append(buf, prefix...), t...)
	n := len(buf)
	buf = append(append(buf, s.idPrefix...), id...)
	// Nothing writes to buf once it is a string.
	both := unsafe.String(&buf[0], len(buf))
	return both[:n], both[n:]
}

// ExternalTopic returns the outside form of an internal topic name or
// non-shared filter of this tenant, without allocating. ok is false when the
// topic is not the tenant's.
func (s *Scope) ExternalTopic(internal string) (string, bool) {
	if strings.HasPrefix(internal, s.topicPrefix) {
		return internal[len(s.topicPrefix):], true
	}
	if strings.HasPrefix(internal, s.dollarPrefix) {
		return internal[len(s.dollarPrefix):], true
	}
	return "", false
}

// Filter returns the internal form of an outside filter, shared or not.
// "$queue/f" becomes the share group QueueGroup. shared reports whether the
// filter is a shared subscription. Validation of the outside filter is the
// caller's job; Filter only rewrites.
func (s *Scope) Filter(f string) (internal string, shared bool) {
	switch {
	case strings.HasPrefix(f, SharePrefix):
		rest := f[len(SharePrefix):]
		i := strings.IndexByte(rest, '/')
		if i < 0 {
			return SharePrefix + rest, true // invalid; left for validation to refuse
		}
		return SharePrefix + rest[:i+1] + s.Topic(rest[i+1:]), true
	case strings.HasPrefix(f, QueuePrefix):
		return SharePrefix + QueueGroup + "/" + s.Topic(f[len(QueuePrefix):]), true
	}
	return s.Topic(f), false
}

// ExternalFilter returns the outside form of an internal filter of this
// tenant. Shared filters come back in "$share/<group>/<filter>" form, and the
// queue group as "$queue/<filter>".
func (s *Scope) ExternalFilter(internal string) (string, bool) {
	if !strings.HasPrefix(internal, SharePrefix) {
		return s.ExternalTopic(internal)
	}
	rest := internal[len(SharePrefix):]
	i := strings.IndexByte(rest, '/')
	if i < 0 {
		return "", false
	}
	inner, ok := s.ExternalTopic(rest[i+1:])
	if !ok {
		return "", false
	}
	if rest[:i] == QueueGroup {
		return QueuePrefix + inner, true
	}
	return SharePrefix + rest[:i+1] + inner, true
}

// TenantOfClientID returns the tenant encoded in an internal client ID.
func TenantOfClientID(internal string) (tenant, id string, ok bool) {
	i := strings.IndexByte(internal, ':')
	if i <= 0 || i > 2 {
		return "", "", false
	}
	n, err := strconv.Atoi(internal[:i])
	if err != nil || n <= 0 || i+1+n > len(internal) {
		return "", "", false
	}
	return internal[i+1 : i+1+n], internal[i+1+n:], true
}

// TenantOfTopic returns the tenant of an internal topic or filter (shared
// filters included) and the outside form of it.
func TenantOfTopic(internal string) (tenant, topic string, ok bool) {
	if strings.HasPrefix(internal, SharePrefix) {
		rest := internal[len(SharePrefix):]
		i := strings.IndexByte(rest, '/')
		if i < 0 {
			return "", "", false
		}
		return TenantOfTopic(rest[i+1:])
	}
	rest := internal
	if strings.HasPrefix(rest, dollarMark) {
		rest = rest[len(dollarMark):]
	}
	i := strings.IndexByte(rest, '/')
	if i <= 0 {
		return "", "", false
	}
	return rest[:i], rest[i+1:], true
}
