package helm

// Tests of the umbrella's PrometheusRule (templates/prometheusrule.yaml):
// rendered only when global.prometheusRule.enabled, every alert complete
// (for, severity, summary, description), every metric it names one the
// services declare, and every selector limited to the release's namespace.

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"text/template"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
)

var prometheusRuleOn = map[string]any{"global": map[string]any{"prometheusRule": map[string]any{"enabled": true}}}

// promDurationRE is Prometheus' duration syntax (model.ParseDuration).
var promDurationRE = regexp.MustCompile(`^(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?$`)

func onePrometheusRule(t *testing.T, r rendering) *monitoringv1.PrometheusRule {
	t.Helper()
	prs := all[*monitoringv1.PrometheusRule](r)
	if len(prs) != 1 {
		t.Fatalf("%d PrometheusRules rendered, want 1", len(prs))
	}
	return prs[0]
}

// TestPrometheusRule: none by default (the CRD may be absent); when on,
// exactly one, whose alerts are complete and name only declared metrics.
func TestPrometheusRule(t *testing.T) {
	if prs := all[*monitoringv1.PrometheusRule](render(t, umbrella, nil)); len(prs) != 0 {
		t.Errorf("default render has %d PrometheusRules", len(prs))
	}
	pr := onePrometheusRule(t, render(t, umbrella, prometheusRuleOn))
	if pr.Namespace != "" && pr.Namespace != namespace {
		t.Errorf("PrometheusRule in namespace %q", pr.Namespace)
	}

	_, known := repoDeclaredMetrics(t)

	alerts := map[string]bool{}
	groups := map[string]bool{}
	var sites []exprSite
	for _, g := range pr.Spec.Groups {
		if g.Name == "" || groups[g.Name] {
			t.Errorf("rule group name %q empty or repeated", g.Name)
		}
		groups[g.Name] = true
		if len(g.Rules) == 0 {
			t.Errorf("group %s has no rules", g.Name)
		}
		for _, rule := range g.Rules {
			where := fmt.Sprintf("group %s alert %s", g.Name, rule.Alert)
			if rule.Alert == "" || rule.Record != "" {
				t.Errorf("%s: want an alerting rule (alert %q, record %q)", where, rule.Alert, rule.Record)
			}
			if alerts[rule.Alert] {
				t.Errorf("%s: alert name repeated", where)
			}
			alerts[rule.Alert] = true
			if !strings.HasPrefix(rule.Alert, "Keel") {
				t.Errorf("%s: alert names start with Keel", where)
			}
			if rule.For == nil || *rule.For == "" || !promDurationRE.MatchString(string(*rule.For)) {
				got := "none"
				if rule.For != nil {
					got = fmt.Sprintf("%q", *rule.For)
				}
				t.Errorf("%s: for %s, want a Prometheus duration (e.g. 5m)", where, got)
			}
			if s := rule.Labels["severity"]; s != "warning" && s != "critical" {
				t.Errorf("%s: severity label %q, want warning or critical", where, s)
			}
			for _, a := range []string{"summary", "description"} {
				text := rule.Annotations[a]
				if strings.TrimSpace(text) == "" {
					t.Errorf("%s: no %s annotation", where, a)
					continue
				}
				if err := checkAlertTemplate(text); err != nil {
					t.Errorf("%s: %s annotation: %v\n\t%s", where, a, err, text)
				}
			}
			expr := rule.Expr.String()
			sites = append(sites, exprSite{where: where, expr: expr})
			sels, err := parsePromQL(expr)
			if err != nil {
				continue // checkExprs reports it
			}
			for _, s := range sels {
				if want := `="` + namespace + `"`; s.matchers["namespace"] != want {
					t.Errorf("%s: selector %s is not limited to namespace %q (has %v)", where, s.name, namespace, s.matchers)
				}
			}
		}
	}
	for _, want := range []string{"KeelRouterUnsettled", "KeelRouterNotifyBacklog", "KeelPersistenceRedisAboveHighWater"} {
		if !alerts[want] {
			t.Errorf("no alert %s", want)
		}
	}
	problems, used := checkExprs(sites, known)
	for _, p := range problems {
		t.Error(p)
	}
	for series, fam := range used {
		t.Logf("%-45s %-8s %s", series, known[fam].typ, known[fam].source)
	}
}

// checkAlertTemplate parses and runs an annotation as Prometheus does (Go
// text/template with $labels and $value defined), so a Helm escape gone
// wrong, e.g. an unrendered {{`...`}}, fails here.
func checkAlertTemplate(text string) error {
	defs := "{{$labels := .Labels}}{{$externalLabels := .ExternalLabels}}{{$value := .Value}}"
	tmpl, err := template.New("annotation").Option("missingkey=error").
		Funcs(template.FuncMap{"humanize": func(v float64) string { return fmt.Sprint(v) }}).
		Parse(defs + text)
	if err != nil {
		return err
	}
	var out strings.Builder
	data := map[string]any{
		"Labels":         map[string]string{"namespace": namespace, "pod": "keel-x-0", "reason": "queue_full"},
		"ExternalLabels": map[string]string{},
		"Value":          1.0,
	}
	if err := tmpl.Execute(&out, data); err != nil {
		return err
	}
	if s := out.String(); strings.Contains(s, "{{") || strings.Contains(s, "}}") || strings.Contains(s, "`") {
		return fmt.Errorf("template markers left after expansion: %s", s)
	}
	return nil
}

// TestPrometheusRuleValues: labels are added, a disabled service's group is
// left out, and the production example enables the rule.
func TestPrometheusRuleValues(t *testing.T) {
	pr := onePrometheusRule(t, render(t, umbrella, map[string]any{
		"global": map[string]any{"prometheusRule": map[string]any{"enabled": true, "labels": map[string]any{"release": "prometheus"}}},
		"router": map[string]any{"enabled": false},
	}))
	if pr.Labels["release"] != "prometheus" || pr.Labels["app.kubernetes.io/instance"] != releaseName {
		t.Errorf("PrometheusRule labels %v", pr.Labels)
	}
	for _, g := range pr.Spec.Groups {
		if g.Name == "keel-router" {
			t.Error("router disabled, but its alerts are rendered")
		}
	}
	if len(pr.Spec.Groups) != 3 {
		t.Errorf("%d rule groups with the router disabled, want 3", len(pr.Spec.Groups))
	}

	prod := onePrometheusRule(t, render(t, umbrella, readValues(t, filepath.Join(umbrella, "ci", "production-values.yaml"))))
	if prod.Labels["release"] != "prometheus" {
		t.Errorf("production PrometheusRule labels %v: want the label the ServiceMonitors carry", prod.Labels)
	}
}

// TestGlobalSchemaInSync: the umbrella passes global to every subchart,
// whose schema refuses unknown keys, so each subchart's schema of global
// must be the umbrella's.
func TestGlobalSchemaInSync(t *testing.T) {
	globalOf := func(c string) any {
		raw, err := os.ReadFile(filepath.Join(chartPath(c), "values.schema.json"))
		if err != nil {
			t.Fatal(err)
		}
		var s struct {
			Properties map[string]any `json:"properties"`
		}
		if err := json.Unmarshal(raw, &s); err != nil {
			t.Fatalf("%s/values.schema.json: %v", c, err)
		}
		g, ok := s.Properties["global"]
		if !ok {
			t.Fatalf("%s/values.schema.json has no global", c)
		}
		return g
	}
	ref := globalOf(umbrella)
	for _, c := range subcharts {
		if !reflect.DeepEqual(globalOf(c), ref) {
			t.Errorf("%s/values.schema.json: global differs from the umbrella's; copy it over", c)
		}
	}
}
