package conformance

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

const (
	envAddr   = "KEEL_CONFORMANCE_ADDR"
	envWSAddr = "KEEL_CONFORMANCE_WS_ADDR"
	envBin    = "KEEL_CONFORMANCE_EDGE_BIN"
	envRace   = "KEEL_CONFORMANCE_RACE"
)

// suite is set once by TestMain and read by every test.
var suite struct {
	bin      string // keel-edge binary; empty when external is set
	external string // host:port of an external broker
	wsAddr   string // its WebSocket listener, if any
	skip     string // non-empty: every test skips with this reason
}

func TestMain(m *testing.M) { os.Exit(runMain(m)) }

func runMain(m *testing.M) int {
	flag.Parse()
	switch {
	case testing.Short():
		suite.skip = "conformance suite skipped under -short: it builds and runs keel-edge"
		return m.Run()
	case os.Getenv(envAddr) != "":
		suite.external = os.Getenv(envAddr)
		suite.wsAddr = os.Getenv(envWSAddr)
		return m.Run()
	case os.Getenv(envBin) != "":
		suite.bin = os.Getenv(envBin)
		return m.Run()
	}
	dir, err := os.MkdirTemp("", "keel-conformance-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "conformance:", err)
		return 1
	}
	defer func() { _ = os.RemoveAll(dir) }()
	bin, err := buildEdge(dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, "conformance: build keel-edge:", err)
		return 1
	}
	suite.bin = bin
	return m.Run()
}

// buildEdge builds keel-edge from the repository that holds this package into
// dir and returns the binary's path.
func buildEdge(dir string) (string, error) {
	root, err := repoRoot()
	if err != nil {
		return "", err
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "keel-edge")
	args := []string{"build", "-o", bin}
	if race := os.Getenv(envRace); race != "" && race != "0" || race == "" && raceEnabled {
		args = append(args, "-race")
	}
	args = append(args, "./services/edge/cmd/keel-edge")
	cmd := exec.Command(goBin, args...)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("%w\n%s", err, out)
	}
	return bin, nil
}

// repoRoot walks up from the working directory to the directory holding
// go.work.
func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.work")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.work above the working directory")
		}
		dir = parent
	}
}
