package testutil

import (
	"io"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
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

// MetricSum sums the counter and gauge samples of family name at
// http://<opsAddr>/metrics whose labels include want (nil: every sample);
// 0 when there are none, as for a labelled counter never incremented.
func MetricSum(t testing.TB, opsAddr, name string, want map[string]string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + opsAddr + "/metrics")
	if err != nil {
		t.Fatalf("metrics of %s: %v", opsAddr, err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("metrics of %s: %v", opsAddr, err)
	}
	return sumSamples(slices.Collect(maps.Values(mfs)), name, want)
}

// CounterValue sums the samples of counter family name in g whose labels
// include want (nil: every sample); 0 when there are none.
func CounterValue(t testing.TB, g prometheus.Gatherer, name string, want map[string]string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatalf("gather metrics: %v", err)
	}
	return sumSamples(mfs, name, want)
}

func sumSamples(mfs []*dto.MetricFamily, name string, want map[string]string) float64 {
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	samples:
		for _, m := range mf.GetMetric() {
			for k, v := range want {
				if !slices.ContainsFunc(m.GetLabel(), func(l *dto.LabelPair) bool { return l.GetName() == k && l.GetValue() == v }) {
					continue samples
				}
			}
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue() + m.GetUntyped().GetValue()
		}
	}
	return sum
}
