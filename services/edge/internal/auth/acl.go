package auth

import "strings"

// ACL holds the publish and subscribe patterns of a user, written in outside
// (tenant-relative) topic form. Patterns use MQTT wildcards and the
// placeholders %u (user name), %c (client ID) and %t (tenant).
type ACL struct {
	Publish   []string `yaml:"publish"`
	Subscribe []string `yaml:"subscribe"`
}

// Rules is an ACL bound to one connection: placeholders expanded, ready to
// check topics and filters.
type Rules struct {
	publish   []string
	subscribe []string
}

// Bind expands the placeholders of acl for one client. A nil ACL binds to nil
// rules, which allow everything. A pattern whose placeholder would expand to
// a value that is empty or contains '/', '+' or '#' is dropped, so a user
// named "#" cannot widen a "devices/%u/#" rule.
func (acl *ACL) Bind(tenant, username, clientID string) *Rules {
	if acl == nil {
		return nil
	}
	r := &Rules{publish: []string{}, subscribe: []string{}}
	for _, p := range acl.Publish {
		if x, ok := expand(p, tenant, username, clientID); ok {
			r.publish = append(r.publish, x)
		}
	}
	for _, p := range acl.Subscribe {
		if x, ok := expand(p, tenant, username, clientID); ok {
			r.subscribe = append(r.subscribe, x)
		}
	}
	return r
}

func expand(pattern, tenant, username, clientID string) (string, bool) {
	if !strings.Contains(pattern, "%") {
		return pattern, true
	}
	var b strings.Builder
	for i := 0; i < len(pattern); i++ {
		c := pattern[i]
		if c != '%' || i+1 == len(pattern) {
			b.WriteByte(c)
			continue
		}
		var v string
		switch pattern[i+1] {
		case 'u':
			v = username
		case 'c':
			v = clientID
		case 't':
			v = tenant
		default:
			b.WriteByte(c)
			continue
		}
		if v == "" || strings.ContainsAny(v, "/+#") {
			return "", false
		}
		b.WriteString(v)
		i++
	}
	return b.String(), true
}

// CanPublish reports whether the rules allow publishing to topic.
func (r *Rules) CanPublish(topic string) bool {
	if r == nil {
		return true
	}
	for _, p := range r.publish {
		if matchTopic(p, topic) {
			return true
		}
	}
	return false
}

// CanSubscribe reports whether the rules allow subscribing to filter: every
// topic the filter can match must be allowed by one pattern. Shared
// subscriptions are checked on their inner filter by the caller.
func (r *Rules) CanSubscribe(filter string) bool {
	if r == nil {
		return true
	}
	for _, p := range r.subscribe {
		if covers(p, filter) {
			return true
		}
	}
	return false
}

// CanReceive reports whether a message on topic may be delivered to the
// client: the topic must be readable under one subscribe pattern.
func (r *Rules) CanReceive(topic string) bool {
	if r == nil {
		return true
	}
	for _, p := range r.subscribe {
		if matchTopic(p, topic) {
			return true
		}
	}
	return false
}

// matchTopic matches a topic name against a pattern with MQTT wildcard rules,
// including that leading wildcards do not match $-topics.
func matchTopic(pattern, topic string) bool {
	if len(topic) > 0 && topic[0] == '$' && len(pattern) > 0 && (pattern[0] == '+' || pattern[0] == '#') {
		return false
	}
	return covers(pattern, topic)
}

// covers reports whether every topic matched by filter f is matched by
// pattern p. With a wildcard-free f it is ordinary topic matching.
func covers(p, f string) bool {
	if len(f) > 0 && f[0] == '$' && len(p) > 0 && (p[0] == '+' || p[0] == '#') {
		return false
	}
	for {
		pl, prest, pmore := cut(p)
		if pl == "#" {
			return true
		}
		fl, frest, fmore := cut(f)
		switch {
		case fl == "#":
			return false // only a '#' pattern covers '#'
		case pl == "+":
			// '+' covers any one level, literal or '+'
		case pl != fl || fl == "+":
			return false
		}
		if !pmore && !fmore {
			return true
		}
		if !fmore {
			// "a/#" covers "a" as well ([MQTT-4.7.1-2])
			return pmore && prest == "#"
		}
		if !pmore {
			return false
		}
		p, f = prest, frest
	}
}

func cut(s string) (level, rest string, more bool) {
	if i := strings.IndexByte(s, '/'); i >= 0 {
		return s[:i], s[i+1:], true
	}
	return s, "", false
}
