package pluginkit

import "errors"

// ErrLaunch means a plugin binary could not be started or did not complete
// the go-plugin handshake (missing, not executable, not a Keel plugin, wrong
// protocol version, or the wrong kind of plugin).
var ErrLaunch = errors.New("launch plugin")
