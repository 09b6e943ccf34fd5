package routes

import (
	"fmt"
	"strings"

	"github.com/keelmq/keel/libs/topic"
)

// Key identifies one aggregated route of an edge: the edge registers it once
// however many local sessions use it.
type Key struct {
	// Tenant of the subscribers.
	Tenant string
	// Filter is the topic filter without any share prefix.
	Filter string
	// Group is the share group, empty for a non-shared subscription.
	Group string
}

// Anchor returns the literal levels of k's filter before its first wildcard
// (see [topic.Anchor]). An empty anchor means the filter is wildcard-first and
// lives in the replicated wildcard table.
func (k Key) Anchor() string { return topic.Anchor(k.Filter) }

// WildcardFirst reports whether k belongs to the wildcard table that every
// edge holds in full rather than to the partitioned anchored table.
func (k Key) WildcardFirst() bool { return k.Anchor() == "" }

// String formats k for logs.
func (k Key) String() string {
	if k.Group == "" {
		return k.Tenant + ":" + k.Filter
	}
	return k.Tenant + ":$share/" + k.Group + "/" + k.Filter
}

// DefaultLimits bounds the filters the router accepts.
var DefaultLimits = topic.Limits{MaxLength: 1024, MaxLevels: 32}

// ValidTenant reports whether name is a tenant name: [a-z0-9-]{1,63}.
func ValidTenant(name string) bool {
	if name == "" || len(name) > 63 {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}

// Validate checks a route received from outside: a valid tenant, a valid
// filter within limits that is not itself a share form, and a share group
// that could have come from "$share/<group>/".
func Validate(k Key, limits topic.Limits) error {
	if !ValidTenant(k.Tenant) {
		return fmt.Errorf("%w: %q", ErrInvalidTenant, k.Tenant)
	}
	if err := topic.ValidateFilter(k.Filter, limits); err != nil {
		return fmt.Errorf("filter %q: %w", k.Filter, err)
	}
	if _, _, ok, _ := topic.ParseShare(k.Filter); ok {
		return fmt.Errorf("filter %q: %w: share prefix must be stripped", k.Filter, topic.ErrInvalidShare)
	}
	if k.Group != "" {
		if strings.ContainsAny(k.Group, "/+#") || len(k.Group) > 256 {
			return fmt.Errorf("%w: %q", ErrInvalidGroup, k.Group)
		}
		if err := topic.ValidateName(k.Group, topic.Limits{}); err != nil {
			return fmt.Errorf("%w: %q: %w", ErrInvalidGroup, k.Group, err)
		}
	}
	return nil
}

// ValidateTopic checks a topic name received from outside.
func ValidateTopic(tenant, name string, limits topic.Limits) error {
	if !ValidTenant(tenant) {
		return fmt.Errorf("%w: %q", ErrInvalidTenant, tenant)
	}
	if err := topic.ValidateName(name, limits); err != nil {
		return fmt.Errorf("topic %q: %w", name, err)
	}
	return nil
}

// ProbeAnchors calls fn with every anchor a filter matching name could be
// stored under: each prefix of name that ends before a '/', and name itself,
// shortest first ("a/b/c" → "a", "a/b", "a/b/c"). It does not allocate.
func ProbeAnchors(name string, fn func(anchor string) bool) {
	for i := 0; i < len(name); i++ {
		if name[i] == '/' && i > 0 {
			if !fn(name[:i]) {
				return
			}
		}
	}
	if name != "" {
		fn(name)
	}
}
