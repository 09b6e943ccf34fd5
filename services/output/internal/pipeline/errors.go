package pipeline

import (
	"errors"

	"github.com/keelmq/keel/services/output/internal/rules"
)

// ErrPluginConfig means a plugin refused its configuration.
var ErrPluginConfig = errors.New("plugin configuration refused")

// configError is a plugin's refusal of its configuration, reported at the
// config's place in the rules file like any other problem of the file. It
// matches both ErrPluginConfig and rules.ErrInvalid.
type configError struct{ at *rules.Error }

func (e *configError) Error() string   { return e.at.Error() }
func (e *configError) Unwrap() []error { return []error{ErrPluginConfig, e.at} }

// ErrStopped means the host is stopping or stopped.
var ErrStopped = errors.New("output host stopped")
