package testutil

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// RepoRoot returns the workspace root: the nearest directory holding go.work
// at or above the working directory (a test's package directory).
func RepoRoot() (string, error) {
	dir, err := filepath.Abs(".")
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.work")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("go.work not found above the test's directory")
		}
		dir = parent
	}
}

// Build builds the workspace command pkg (for example
// "./services/router/cmd/keel-router") into dir and returns the binary's
// path, for tests that run a real service as a process. It skips the test
// outside a workspace.
func Build(t testing.TB, dir, pkg string) string {
	t.Helper()
	root, err := RepoRoot()
	if err != nil {
		t.Skip(err)
	}
	bin := filepath.Join(dir, filepath.Base(pkg))
	cmd := exec.Command("go", "build", "-o", bin, pkg)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build %s: %v\n%s", pkg, err, out)
	}
	return bin
}
