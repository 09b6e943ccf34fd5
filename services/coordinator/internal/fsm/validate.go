package fsm

import (
	"fmt"
	"unicode/utf8"
)

// Length caps. Keys carry one-byte length prefixes, so none may exceed 255.
const (
	// MaxTenantLen is the longest tenant name, as DESIGN.md: [a-z0-9-]{1,63}.
	MaxTenantLen = 63
	// MaxClientIDLen is the longest client ID, in bytes, the coordinator records.
	// MQTT allows 65535; Keel caps it to keep keys and log entries small (VerneMQ
	// caps at 100 by default, EMQX makes it configurable).
	MaxClientIDLen = 256
	// MaxMemberIDLen is the longest member (edge, router, persistence) ID.
	MaxMemberIDLen = 128
	// MaxRequestIDLen is the longest request ID.
	MaxRequestIDLen = 128
	// MaxAddressLen is the longest member or Redis address.
	MaxAddressLen = 256
	// MaxConfigKeyLen is the longest cluster config key.
	MaxConfigKeyLen = 128
	// MaxConfigValueLen is the longest cluster config value.
	MaxConfigValueLen = 16 << 10
	// MaxSlots is the largest slot table.
	MaxSlots = 16384
)

// ValidTenant reports whether s is a tenant name: [a-z0-9-]{1,63}.
func ValidTenant(s string) bool {
	if len(s) == 0 || len(s) > MaxTenantLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' {
			return false
		}
	}
	return true
}

// CheckSession validates a (tenant, client ID) pair.
func CheckSession(tenant, clientID string) error {
	if !ValidTenant(tenant) {
		return fmt.Errorf("%w: tenant %q: want [a-z0-9-]{1,63}", ErrInvalidArgument, truncate(tenant))
	}
	return checkText("client id", clientID, MaxClientIDLen, true)
}

// CheckMemberID validates a member ID.
func CheckMemberID(id string) error { return checkText("member id", id, MaxMemberIDLen, true) }

// CheckRequestID validates a request ID (empty is allowed: no idempotence).
func CheckRequestID(id string) error { return checkText("request id", id, MaxRequestIDLen, false) }

// CheckAddress validates an address (empty is allowed).
func CheckAddress(a string) error { return checkText("address", a, MaxAddressLen, false) }

func checkText(what, s string, maxLen int, required bool) error {
	switch {
	case s == "" && required:
		return fmt.Errorf("%w: empty %s", ErrInvalidArgument, what)
	case len(s) > maxLen:
		return fmt.Errorf("%w: %s longer than %d bytes", ErrInvalidArgument, what, maxLen)
	case !utf8.ValidString(s):
		return fmt.Errorf("%w: %s is not UTF-8", ErrInvalidArgument, what)
	}
	for _, r := range s {
		if r == 0 {
			return fmt.Errorf("%w: %s contains U+0000", ErrInvalidArgument, what)
		}
	}
	return nil
}

func truncate(s string) string {
	if len(s) > 70 {
		return s[:70] + "…"
	}
	return s
}
