package pipeline

import "errors"

// ErrPluginConfig means a plugin refused its configuration.
var ErrPluginConfig = errors.New("plugin configuration refused")

// ErrStopped means the host is stopping or stopped.
var ErrStopped = errors.New("output host stopped")
