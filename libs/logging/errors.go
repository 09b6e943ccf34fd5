package logging

import "errors"

// ErrInvalidLevel is returned by [New] and [ParseLevel] for an unknown level.
var ErrInvalidLevel = errors.New("invalid log level")

// ErrInvalidFormat is returned by [New] for an unknown format.
var ErrInvalidFormat = errors.New("invalid log format")
