package testutil

import (
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
)

// Metric reads an unlabelled sample from the Prometheus text exposition
// at http://<opsAddr>/metrics, failing the test when it is not there.
func Metric(t testing.TB, opsAddr, name string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + opsAddr + "/metrics")
	if err != nil {
		t.Fatalf("metrics of %s: %v", opsAddr, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("metrics of %s: %v", opsAddr, err)
	}
	// An unlabelled sample is the line "<name> <value>".
	for line := range strings.Lines(string(body)) {
		if s, found := strings.CutPrefix(strings.TrimSpace(line), name+" "); found {
			f, err := strconv.ParseFloat(s, 64)
			if err != nil {
				t.Fatalf("metrics of %s: %s: %v", opsAddr, name, err)
			}
			return f
		}
	}
	t.Fatalf("metrics of %s: no %s", opsAddr, name)
	return 0
}
