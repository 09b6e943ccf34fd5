// Package helm holds the tests of Keel's Helm charts (deploy/helm/keel and
// its subcharts). They need no cluster and no helm binary: the Helm SDK
// lints and renders the charts client-side, and every rendered object is
// decoded strictly against the k8s.io/api types (plus the Prometheus
// Operator's ServiceMonitor), so a misspelt or misplaced field fails here.
//
//	go test ./deploy/helm/...            # from the repository root
//	go test ./deploy/helm/... -update    # rewrite the golden renders in testdata/
package helm

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/releaseutil"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
)

var update = flag.Bool("update", false, "rewrite the golden renders in testdata/golden")

const (
	umbrella    = "keel"
	releaseName = "keel"
	namespace   = "keel"
)

// subcharts are the services, in the order the umbrella lists them.
var subcharts = []string{"edge", "coordinator", "router", "persistence", "output"}

// kubeVersion is the cluster version the charts are rendered for; the charts
// need 1.30+ (the preStop sleep action).
var kubeVersion = &chartutil.KubeVersion{Version: "v1.33.0", Major: "1", Minor: "33"}

// decoder decodes strictly (unknown and duplicate fields are errors) every
// built-in kind and the ServiceMonitor CRD.
var decoder = func() runtime.Decoder {
	s := runtime.NewScheme()
	utilruntime.Must(clientgoscheme.AddToScheme(s))
	utilruntime.Must(monitoringv1.AddToScheme(s))
	return serializer.NewCodecFactory(s, serializer.EnableStrict).UniversalDeserializer()
}()

func chartPath(name string) string {
	if name == umbrella {
		return umbrella
	}
	return filepath.Join(umbrella, "charts", name)
}

// rendering is one render of a chart: the whole manifest and its objects.
type rendering struct {
	manifest string
	objs     []object
}

type object struct {
	source string // "# Source:" path
	kind   string
	name   string
	obj    runtime.Object
}

// renderChart renders a chart client-side as `helm install --dry-run` would.
func renderChart(chart string, vals map[string]any) (string, error) {
	ch, err := loader.Load(chartPath(chart))
	if err != nil {
		return "", err
	}
	inst := action.NewInstall(&action.Configuration{})
	inst.ClientOnly, inst.DryRun, inst.IncludeCRDs = true, true, true
	inst.ReleaseName, inst.Namespace = releaseName, namespace
	inst.KubeVersion = kubeVersion
	if vals == nil {
		vals = map[string]any{}
	}
	rel, err := inst.Run(ch, vals)
	if err != nil {
		return "", err
	}
	return rel.Manifest, nil
}

// render renders and strictly decodes every object; any failure fails t.
func render(t *testing.T, chart string, vals map[string]any) rendering {
	t.Helper()
	manifest, err := renderChart(chart, vals)
	if err != nil {
		t.Fatalf("render %s: %v", chart, err)
	}
	r := rendering{manifest: manifest}
	docs := releaseutil.SplitManifests(manifest)
	for _, k := range sortedManifestKeys(docs) {
		doc := docs[k]
		src := sourceOf(doc)
		obj, gvk, err := decoder.Decode([]byte(doc), nil, nil)
		if err != nil {
			t.Errorf("%s: strict decode: %v", src, err)
			continue
		}
		name := ""
		if m, ok := obj.(interface{ GetName() string }); ok {
			name = m.GetName()
		}
		r.objs = append(r.objs, object{source: src, kind: gvk.Kind, name: name, obj: obj})
	}
	if len(r.objs) == 0 {
		t.Fatalf("render %s: no objects", chart)
	}
	return r
}

func sortedManifestKeys(docs map[string]string) []string {
	keys := make([]string, 0, len(docs))
	for k := range docs {
		keys = append(keys, k)
	}
	// SplitManifests names them manifest-0, manifest-1, ... in document order.
	byIndex := make([]string, len(keys))
	for _, k := range keys {
		var i int
		if _, err := fmt.Sscanf(k, "manifest-%d", &i); err == nil && i < len(byIndex) {
			byIndex[i] = k
		}
	}
	return byIndex
}

func sourceOf(doc string) string {
	for _, line := range strings.Split(doc, "\n") {
		if s, ok := strings.CutPrefix(line, "# Source: "); ok {
			return s
		}
	}
	return "?"
}

func readValues(t *testing.T, path string) map[string]any {
	t.Helper()
	v, err := chartutil.ReadValuesFile(path)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	return v.AsMap()
}

// cases are the value sets every invariant is checked on.
func cases(t *testing.T) map[string]map[string]any {
	return map[string]map[string]any{
		"default":    nil,
		"production": readValues(t, filepath.Join(umbrella, "ci", "production-values.yaml")),
	}
}

func TestLint(t *testing.T) {
	charts := append([]string{umbrella}, subcharts...)
	for _, c := range charts {
		t.Run(c, func(t *testing.T) {
			lint := action.NewLint()
			lint.Strict = true
			lint.Namespace = namespace
			lint.KubeVersion = kubeVersion
			res := lint.Run([]string{chartPath(c)}, map[string]any{})
			for _, m := range res.Messages {
				t.Logf("%s", m)
			}
			for _, err := range res.Errors {
				t.Errorf("helm lint --strict %s: %v", c, err)
			}
		})
	}
}

func TestLintProductionValues(t *testing.T) {
	lint := action.NewLint()
	lint.Strict = true
	lint.Namespace = namespace
	lint.KubeVersion = kubeVersion
	res := lint.Run([]string{chartPath(umbrella)}, readValues(t, filepath.Join(umbrella, "ci", "production-values.yaml")))
	for _, err := range res.Errors {
		t.Errorf("helm lint --strict -f ci/production-values.yaml: %v", err)
	}
}

// TestGolden compares the umbrella's renders with testdata/golden; -update
// rewrites them. A diff here is a change of what gets deployed: review it.
func TestGolden(t *testing.T) {
	for name, vals := range cases(t) {
		t.Run(name, func(t *testing.T) {
			r := render(t, umbrella, vals)
			path := filepath.Join("testdata", "golden", name+".yaml")
			if *update {
				if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(path, []byte(r.manifest), 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%v (run go test -update to create it)", err)
			}
			if string(want) != r.manifest {
				t.Errorf("render differs from %s (go test ./deploy/helm/... -update to accept):\n%s", path, firstDiff(string(want), r.manifest))
			}
		})
	}
}

func firstDiff(want, got string) string {
	w, g := strings.Split(want, "\n"), strings.Split(got, "\n")
	for i := 0; i < len(w) || i < len(g); i++ {
		var wl, gl string
		if i < len(w) {
			wl = w[i]
		}
		if i < len(g) {
			gl = g[i]
		}
		if wl != gl {
			return fmt.Sprintf("line %d:\n  golden:   %q\n  rendered: %q", i+1, wl, gl)
		}
	}
	return "(identical lines; length differs)"
}

// TestSubchartsAlone renders each service's chart on its own: each is
// installable and its schema and defaults stand without the umbrella.
func TestSubchartsAlone(t *testing.T) {
	for _, c := range subcharts {
		t.Run(c, func(t *testing.T) {
			r := render(t, c, nil)
			for _, o := range r.objs {
				if !strings.HasPrefix(o.source, c+"/") {
					t.Errorf("%s rendered from outside the chart: %s", o.name, o.source)
				}
			}
		})
	}
}

// TestHelpersInSync: templates/_keel.tpl is one file copied into every
// subchart (each must render alone); the copies must not drift, since under
// the umbrella only one definition of each helper survives.
func TestHelpersInSync(t *testing.T) {
	ref, err := os.ReadFile(filepath.Join(chartPath(subcharts[0]), "templates", "_keel.tpl"))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range subcharts[1:] {
		got, err := os.ReadFile(filepath.Join(chartPath(c), "templates", "_keel.tpl"))
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != string(ref) {
			t.Errorf("%s/templates/_keel.tpl differs from %s's: copy it over", c, subcharts[0])
		}
	}
}
