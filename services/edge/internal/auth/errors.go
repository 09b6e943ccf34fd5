package auth

import "errors"

var (
	// ErrBadCredentials means the user is unknown or the password is wrong
	// (MQTT 5 reason 0x86, 3.1.1 return code 4).
	ErrBadCredentials = errors.New("bad user name or password")
	// ErrNotAuthorized means the credentials are valid but the client may not
	// connect (MQTT 5 reason 0x87, 3.1.1 return code 5).
	ErrNotAuthorized = errors.New("not authorized")
	// ErrUnavailable means the credential backend could not answer (MQTT 5
	// reason 0x88, 3.1.1 return code 3).
	ErrUnavailable = errors.New("authentication backend unavailable")
	// ErrInvalidFile reports a password file that cannot be used.
	ErrInvalidFile = errors.New("invalid password file")
)
