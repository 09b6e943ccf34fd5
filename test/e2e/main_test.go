// Package e2e runs Keel's services as containers on private Docker networks
// and drives them with real MQTT clients. Images are built locally FROM
// scratch (scripts/images.sh); nothing is pulled from a registry.
//
// Environment: KEEL_E2E=1 runs the suite; KEEL_E2E_IMAGES=keep reuses the
// images already built under the e2e tag; KEEL_E2E_LOGS=1 prints every
// cluster container's logs even when a test passes (to read what the
// product did), KEEL_E2E_LOG_LEVEL sets their --log.level, and
// KEEL_E2E_EDGE_ARGS and KEEL_E2E_PERSISTENCE_ARGS add flags to every edge
// and every HA persistence instance (to try a setting across the suite,
// such as --cluster.forward-retry or --failover.fence-writers=false).
package e2e

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// imageTag is the tag TestMain builds the images under.
const imageTag = "e2e"

var dockerOK bool

func TestMain(m *testing.M) {
	flag.Parse()
	// No registry here: the reaper image cannot be pulled, and the host is
	// reached on localhost (this machine looks like a container to
	// testcontainers).
	setDefault("TESTCONTAINERS_RYUK_DISABLED", "true")
	setDefault("TESTCONTAINERS_HOST_OVERRIDE", "localhost")
	if os.Getenv("KEEL_E2E") != "1" {
		fmt.Fprintln(os.Stderr, "e2e: SKIPPED: set KEEL_E2E=1 (make e2e) to run the container suite")
		os.Exit(m.Run())
	}
	if err := exec.Command("docker", "info").Run(); err != nil {
		if os.Getenv("E2E_REQUIRE_DOCKER") == "1" {
			fmt.Fprintln(os.Stderr, "e2e: a Docker engine is required (E2E_REQUIRE_DOCKER=1) but none answers:", err)
			os.Exit(1)
		}
		fmt.Fprintln(os.Stderr, "e2e: SKIPPED: no Docker engine answers")
	} else if !testing.Short() {
		root, err := repoRoot()
		if os.Getenv("KEEL_E2E_IMAGES") == "keep" {
			// Reuse images built earlier (scripts/images.sh e2e), e.g. from a
			// snapshot of the tree while the working tree does not build.
			err = exec.Command("docker", "image", "inspect", image("edge"), image("router"), image("coordinator")).Run()
			if err != nil {
				err = fmt.Errorf("KEEL_E2E_IMAGES=keep but the %s images are missing: %w", imageTag, err)
			}
		} else if err == nil {
			cmd := exec.Command(filepath.Join(root, "scripts", "images.sh"), imageTag)
			cmd.Dir = root
			cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
			err = cmd.Run()
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "e2e: building images failed:", err)
			os.Exit(1)
		}
		dockerOK = true
	}
	os.Exit(m.Run())
}

func setDefault(k, v string) {
	if os.Getenv(k) == "" {
		_ = os.Setenv(k, v)
	}
}

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
			return "", fmt.Errorf("go.work not found above the test directory")
		}
		dir = parent
	}
}

func needDocker(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("e2e: skipped under -short")
	}
	if !dockerOK {
		t.Skip("e2e: not enabled (KEEL_E2E=1) or no Docker engine")
	}
}
