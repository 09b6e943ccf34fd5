package helm

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// TestComposeFlagsKnown: every flag deploy/compose/docker-compose.yaml
// passes to a Keel image is one its binary defines, and every edge names
// itself and the services it needs.
func TestComposeFlagsKnown(t *testing.T) {
	known := knownFlags(t)
	b, err := os.ReadFile(filepath.Join("..", "compose", "docker-compose.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var file struct {
		Services map[string]struct {
			Image   string   `json:"image"`
			Command []string `json:"command"`
		} `json:"services"`
	}
	if err := yaml.Unmarshal(b, &file); err != nil {
		t.Fatal(err)
	}
	edges := 0
	for name, svc := range file.Services {
		image := strings.TrimPrefix(strings.Split(svc.Image, ":")[0], "keel/")
		if image == "redis" {
			continue
		}
		flags, ok := known[image]
		if !ok {
			t.Errorf("%s: no Keel binary for image %q", name, svc.Image)
			continue
		}
		set := map[string]bool{}
		for _, a := range svc.Command {
			if !strings.HasPrefix(a, "--") {
				continue // a value
			}
			f, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
			if !flags[f] {
				t.Errorf("%s: keel-%s has no flag %q", name, image, a)
			}
			set[f] = true
		}
		if image == "edge" {
			edges++
			for _, f := range []string{"mqtt.edge-id", "cluster.coordinator", "cluster.router", "cluster.advertise-addr"} {
				if !set[f] {
					t.Errorf("%s: edge without --%s", name, f)
				}
			}
		}
	}
	if edges < 2 {
		t.Errorf("compose file runs %d edges; it is meant to show a cluster", edges)
	}
}
