package topic

import "strings"

const (
	// SharePrefix starts a shared subscription filter,
	// "$share/<group>/<filter>" (MQTT 5.0 section 4.8.2).
	SharePrefix = "$share/"
	// QueuePrefix starts a queue subscription filter, "$queue/<filter>", a
	// shared subscription with the fixed group [QueueGroup] (as in EMQX).
	QueuePrefix = "$queue/"
	// QueueGroup is the share group of every "$queue/<filter>" subscription.
	// "$queue/<filter>" and "$share/$queue/<filter>" therefore name the same
	// group, as in EMQX; a '$' group cannot clash with the groups clients
	// usually choose.
	QueueGroup = "$queue"
)

// ParseShare splits a shared subscription filter into its share group and
// inner topic filter, without allocating. ok reports whether filter has a
// share prefix ([SharePrefix] or [QueuePrefix]); when it does not, filter is
// an ordinary topic filter and group and inner are empty.
//
// err is [ErrInvalidShare] when filter has a share prefix but a malformed share
// form: an empty group [MQTT-4.8.2-1], a group containing '+' or '#', or no
// '/' and topic filter after the group [MQTT-4.8.2-2]; for "$queue/", an empty
// inner filter. Then ok is true and group and inner are empty.
//
// ParseShare does not validate the group's characters or the inner filter;
// [ValidateFilter] does both. "$share" and "$queue" without a trailing '/' are
// ordinary filters, as in mosquitto.
func ParseShare(filter string) (group, inner string, ok bool, err error) {
	switch {
	case strings.HasPrefix(filter, SharePrefix):
		rest := filter[len(SharePrefix):]
		i := strings.IndexByte(rest, '/')
		if i <= 0 || i == len(rest)-1 {
			// No group, or no '/' after it, or nothing after that '/'.
			return "", "", true, ErrInvalidShare
		}
		group, inner = rest[:i], rest[i+1:]
		if strings.ContainsAny(group, "+#") {
			return "", "", true, ErrInvalidShare
		}
		return group, inner, true, nil
	case strings.HasPrefix(filter, QueuePrefix):
		inner = filter[len(QueuePrefix):]
		if inner == "" {
			return "", "", true, ErrInvalidShare
		}
		return QueueGroup, inner, true, nil
	}
	return "", "", false, nil
}
