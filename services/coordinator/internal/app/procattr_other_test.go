//go:build !linux

package app

import "os/exec"

// dieWithParent has no portable equivalent outside Linux; the test's
// cleanup stops the process.
func dieWithParent(*exec.Cmd) {}
