package config

import "errors"

// ErrInvalidEnv is wrapped by every error [Parse] returns for an environment
// variable whose value the flag rejects.
var ErrInvalidEnv = errors.New("invalid environment variable")
