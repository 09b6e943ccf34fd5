package helm

// Tests of the Grafana dashboard in deploy/grafana/keel-dashboard.json: its
// shape (schema, datasource and job/instance variables, rows), and that every
// metric its PromQL names is one the services export.
//
// The metrics the services export are gathered from two sources:
//
//  1. scraped: the five service binaries are built from this workspace,
//     started on loopback with free ports and minimal flags (edge anonymous
//     and streaming to the output service, coordinator as a single Raft
//     node, router with single-node Olric, persistence on its embedded bbolt
//     store, output with an empty rules file), given one MQTT publish, and
//     their /metrics scraped; "# TYPE" lines give each family's type. Skipped
//     under -short, and per service (with the reason logged) if it cannot be
//     built or started here.
//  2. declared: the non-test Go sources under services/ and libs/ that import
//     client_golang are parsed; Name (with Namespace/Subsystem) of every
//     prometheus.*Opts literal gives a typed name, and any other "keel_..."
//     string literal in those files an untyped one (names passed to a helper).
//     This is the fallback for vectors that have no series until first use
//     and for collectors not wired into a binary yet.
//
// A histogram or summary is referenced through its _bucket/_sum/_count
// series; a bare histogram name, or _bucket of a counter, is an error.

import (
	"bufio"
	"encoding/json"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

const dashboardPath = "../grafana/keel-dashboard.json"

// ---------------------------------------------------------------- dashboard

type dashboard struct {
	SchemaVersion int     `json:"schemaVersion"`
	UID           string  `json:"uid"`
	Title         string  `json:"title"`
	Panels        []panel `json:"panels"`
	Templating    struct {
		List []variable `json:"list"`
	} `json:"templating"`
}

type panel struct {
	ID         int      `json:"id"`
	Type       string   `json:"type"`
	Title      string   `json:"title"`
	Datasource *dsRef   `json:"datasource"`
	GridPos    gridPos  `json:"gridPos"`
	Targets    []target `json:"targets"`
	Panels     []panel  `json:"panels"` // a collapsed row's panels
	Collapsed  bool     `json:"collapsed"`
}

type gridPos struct{ H, W, X, Y int }

type dsRef struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type target struct {
	RefID      string `json:"refId"`
	Expr       string `json:"expr"`
	Datasource *dsRef `json:"datasource"`
}

type variable struct {
	Name       string          `json:"name"`
	Type       string          `json:"type"`
	Query      json.RawMessage `json:"query"`
	Datasource *dsRef          `json:"datasource"`
	Multi      bool            `json:"multi"`
	IncludeAll bool            `json:"includeAll"`
}

// queryString is a query variable's query, a string or {"query": "..."}.
func (v variable) queryString() string {
	var s string
	if json.Unmarshal(v.Query, &s) == nil {
		return s
	}
	var o struct {
		Query string `json:"query"`
	}
	_ = json.Unmarshal(v.Query, &o)
	return o.Query
}

func loadDashboard(t *testing.T) dashboard {
	t.Helper()
	b, err := os.ReadFile(dashboardPath)
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	dec := json.NewDecoder(strings.NewReader(string(b)))
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("%s: %v", dashboardPath, err)
	}
	return d
}

// rowsOf groups the dashboard's panels under their rows, in order.
func rowsOf(d dashboard) (titles []string, rows map[string][]panel, orphans []panel) {
	rows = map[string][]panel{}
	cur := ""
	for _, p := range d.Panels {
		if p.Type == "row" {
			cur = p.Title
			titles = append(titles, cur)
			rows[cur] = append(rows[cur], p.Panels...)
			continue
		}
		if cur == "" {
			orphans = append(orphans, p)
			continue
		}
		rows[cur] = append(rows[cur], p)
	}
	return titles, rows, orphans
}

// exprSite is one PromQL expression and where the dashboard has it.
type exprSite struct {
	where    string
	expr     string
	variable bool // a template variable's query (no job/instance filter needed)
}

func dashboardExprs(d dashboard) []exprSite {
	var out []exprSite
	var walk func(ps []panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			for _, tg := range p.Targets {
				out = append(out, exprSite{where: fmt.Sprintf("panel %q target %s", p.Title, tg.RefID), expr: tg.Expr})
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	for _, v := range d.Templating.List {
		if v.Type == "query" {
			out = append(out, exprSite{where: fmt.Sprintf("variable $%s", v.Name), expr: variableExpr(v.queryString()), variable: true})
		}
	}
	return out
}

var labelValuesRE = regexp.MustCompile(`^\s*(?:label_values|query_result)\(\s*(.*?)\s*(?:,\s*[a-zA-Z_][a-zA-Z0-9_]*\s*)?\)\s*$`)

// variableExpr is the PromQL inside a Grafana variable query:
// label_values(<selector>, label) or query_result(<expr>).
func variableExpr(q string) string {
	if m := labelValuesRE.FindStringSubmatch(q); m != nil {
		return m[1]
	}
	return q
}

// TestDashboardShape: the dashboard is a schema 39+ dashboard on a
// Prometheus datasource variable, with job/instance filters applied to every
// selector, and the rows and metrics the operators need.
func TestDashboardShape(t *testing.T) {
	d := loadDashboard(t)
	if d.SchemaVersion < 39 {
		t.Errorf("schemaVersion %d, want 39+", d.SchemaVersion)
	}
	if d.UID == "" || d.Title == "" {
		t.Errorf("uid %q and title %q must be set", d.UID, d.Title)
	}
	vars := map[string]variable{}
	for _, v := range d.Templating.List {
		vars[v.Name] = v
	}
	if v, ok := vars["datasource"]; !ok || v.Type != "datasource" || v.queryString() != "prometheus" {
		t.Errorf("want a datasource variable $datasource of type prometheus, got %+v", v)
	}
	for _, name := range []string{"job", "instance"} {
		v, ok := vars[name]
		if !ok || v.Type != "query" || !v.Multi || !v.IncludeAll {
			t.Errorf("want a multi-value query variable $%s with All, got %+v", name, v)
			continue
		}
		if v.Datasource == nil || v.Datasource.UID != "${datasource}" {
			t.Errorf("variable $%s: datasource %+v, want uid ${datasource}", name, v.Datasource)
		}
	}

	titles, rows, orphans := rowsOf(d)
	for _, p := range orphans {
		t.Errorf("panel %q is not in a row", p.Title)
	}
	for _, want := range []string{"Edge", "Router", "Coordinator / Raft", "Persistence / Redis", "Output"} {
		if len(rows[want]) == 0 {
			t.Errorf("no row %q with panels (rows: %q)", want, titles)
		}
	}

	// Panels: unique ids, on the datasource variable, no overlaps.
	ids := map[int]string{}
	type cell struct{ x, y int }
	used := map[cell]string{}
	var all []panel
	var flatten func(ps []panel)
	flatten = func(ps []panel) {
		for _, p := range ps {
			all = append(all, p)
			flatten(p.Panels)
		}
	}
	flatten(d.Panels)
	for _, p := range all {
		if prev, dup := ids[p.ID]; dup {
			t.Errorf("panels %q and %q share id %d", prev, p.Title, p.ID)
		}
		ids[p.ID] = p.Title
		if p.GridPos.W <= 0 || p.GridPos.H <= 0 || p.GridPos.X+p.GridPos.W > 24 {
			t.Errorf("panel %q: bad gridPos %+v", p.Title, p.GridPos)
		}
		for x := p.GridPos.X; x < p.GridPos.X+p.GridPos.W; x++ {
			for y := p.GridPos.Y; y < p.GridPos.Y+p.GridPos.H; y++ {
				if other, ok := used[cell{x, y}]; ok {
					t.Errorf("panels %q and %q overlap at (%d,%d)", other, p.Title, x, y)
					goto next
				}
				used[cell{x, y}] = p.Title
			}
		}
	next:
		if p.Type == "row" {
			continue
		}
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" {
			t.Errorf("panel %q: datasource %+v, want uid ${datasource}", p.Title, p.Datasource)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no queries", p.Title)
		}
		for _, tg := range p.Targets {
			if tg.Datasource != nil && tg.Datasource.UID != "${datasource}" {
				t.Errorf("panel %q target %s: datasource %+v", p.Title, tg.RefID, tg.Datasource)
			}
		}
	}

	// Every selector of a panel query is filtered by $job and $instance.
	referenced := map[string]bool{}
	for _, site := range dashboardExprs(d) {
		sels, err := parsePromQL(site.expr)
		if err != nil {
			t.Errorf("%s: %v\n\t%s", site.where, err, site.expr)
			continue
		}
		for _, s := range sels {
			referenced[s.name] = true
			if site.variable {
				continue
			}
			if s.matchers["job"] != `=~"$job"` || s.matchers["instance"] != `=~"$instance"` {
				t.Errorf("%s: selector %s lacks job=~\"$job\", instance=~\"$instance\" (has %v)", site.where, s.name, s.matchers)
			}
		}
	}

	// The metrics that matter are on it.
	for _, m := range []string{
		"keel_edge_connections", "keel_edge_connects_total", "keel_edge_disconnects_total",
		"keel_edge_messages_in_total", "keel_edge_messages_out_total", "keel_edge_messages_dropped_total",
		"keel_edge_publish_backpressure_seconds_bucket", "keel_edge_auth_failures_total", "keel_edge_auth_bans_total",
		"keel_edge_inflight_messages", "keel_edge_sessions", "keel_edge_subscriptions", "keel_edge_retained_messages",
		"keel_edge_route_lookups_total", "keel_edge_route_local_answers_total", "keel_edge_route_requests_total",
		"keel_coordinator_raft_leader_changes_total", "keel_coordinator_raft_commit_index",
		"keel_coordinator_raft_applied_index", "keel_coordinator_raft_apply_duration_seconds_bucket",
		"keel_coordinator_claims_total",
		"keel_persistence_ops_total", "keel_persistence_write_duration_seconds_bucket",
		"keel_persistence_wait_timeouts_total", "keel_persistence_failovers_total", "keel_persistence_unreplicated",
		"keel_output_records_in_total", "keel_output_records_out_total", "keel_output_errors_total",
		"keel_output_dropped_total", "keel_output_latency_seconds_bucket", "keel_output_plugin_restarts_total",
	} {
		if !referenced[m] {
			t.Errorf("the dashboard does not show %s", m)
		}
	}
}

// TestDashboardMetricsExported: every metric name in the dashboard's PromQL
// (panels and variables) is exported by a service, scraped from the running
// binary where possible and otherwise declared in the code.
func TestDashboardMetricsExported(t *testing.T) {
	d := loadDashboard(t)
	root, known := repoDeclaredMetrics(t)
	if testing.Short() {
		t.Log("-short: not building and scraping the services; checking against declared metrics only")
	} else {
		for name, m := range scrapeServices(t, root) {
			if prev, ok := known[name]; ok && prev.typ != "" && prev.typ != m.typ {
				t.Errorf("%s: declared as %s at %s but scraped as %s from %s", name, prev.typ, prev.source, m.typ, m.source)
			}
			known[name] = m // a scrape is the better source
		}
	}

	problems, used := checkExprs(dashboardExprs(d), known)
	for _, p := range problems {
		t.Error(p)
	}
	var lines []string
	for series, fam := range used {
		lines = append(lines, fmt.Sprintf("%-55s %-10s %s", series, known[fam].typ, known[fam].source))
	}
	sort.Strings(lines)
	t.Logf("%d metric series on the dashboard, with where each was found:\n\t%s", len(lines), strings.Join(lines, "\n\t"))
}

// TestDashboardCheckerCatchesTypos: the checker itself refuses a misspelled
// metric, a bare histogram, a suffix on a non-histogram, an unknown function
// and a __name__ regex that matches nothing.
func TestDashboardCheckerCatchesTypos(t *testing.T) {
	known := map[string]metricInfo{
		"keel_edge_messages_in_total":            {typ: "counter", source: "test"},
		"keel_edge_publish_backpressure_seconds": {typ: "histogram", source: "test"},
		"keel_coordinator_raft_term":             {typ: "", source: "test"},
	}
	good := []string{
		`sum by (qos) (rate(keel_edge_messages_in_total{job=~"$job"}[$__rate_interval]))`,
		`histogram_quantile(0.99, sum by (le) (rate(keel_edge_publish_backpressure_seconds_bucket[5m])))`,
		`rate(keel_edge_publish_backpressure_seconds_count[5m]) / rate(keel_edge_publish_backpressure_seconds_sum[5m])`,
		`max(keel_coordinator_raft_term) - max(keel_coordinator_raft_term offset 1h) > bool 0`,
		`sum without (instance) (keel_edge_messages_in_total) / on (job) group_left () sum by (job) (keel_edge_messages_in_total)`,
		`count({__name__=~"keel_edge_.+"})`,
		`{__name__="keel_coordinator_raft_term"}`,
		`label_replace(keel_coordinator_raft_term, "x", "$1", "instance", "(.*):.*")`,
	}
	for _, e := range good {
		if problems, _ := checkExprs([]exprSite{{where: "good", expr: e}}, known); len(problems) > 0 {
			t.Errorf("%s: unexpected problems %q", e, problems)
		}
	}
	bad := map[string]string{
		`sum(rate(keel_edge_mesages_in_total[5m]))`:                                                     "keel_edge_mesages_in_total",
		`rate(keel_edge_messages_in[5m])`:                                                               "keel_edge_messages_in",
		`histogram_quantile(0.9, rate(keel_edge_publish_backpressure_seconds[5m]))`:                     "histogram",
		`rate(keel_edge_messages_in_total_bucket[5m])`:                                                  "keel_edge_messages_in_total_bucket",
		`histogram_quantil(0.9, sum by (le) (rate(keel_edge_publish_backpressure_seconds_bucket[5m])))`: "histogram_quantil",
		`count({__name__=~"keel_edeg_.+"})`:                                                             "matches no",
		`{__name__="keel_coordinator_raft_trem"}`:                                                       "keel_coordinator_raft_trem",
		`sum(rate(keel_edge_messages_in_total[5m])`:                                                     "unbalanced",
	}
	for e, want := range bad {
		problems, _ := checkExprs([]exprSite{{where: "bad", expr: e}}, known)
		if len(problems) == 0 || !strings.Contains(strings.Join(problems, "\n"), want) {
			t.Errorf("%s: want a problem mentioning %q, got %q", e, want, problems)
		}
	}
	if variableExpr(`label_values({__name__=~"keel_.+", job=~"$job"}, instance)`) != `{__name__=~"keel_.+", job=~"$job"}` {
		t.Error("variableExpr does not unwrap label_values")
	}
}

// repoDeclaredMetrics returns the repository root and the metrics its code
// declares (declaredMetrics), failing if the scan found too few to be right.
func repoDeclaredMetrics(t *testing.T) (string, map[string]metricInfo) {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	known := declaredMetrics(t, root)
	if len(known) < 20 {
		t.Fatalf("found only %d declared metrics under services/ and libs/; the scan is broken", len(known))
	}
	return root, known
}

// ---------------------------------------------------------------- checking

type metricInfo struct {
	typ    string // counter, gauge, histogram, summary, untyped; "" when declared without a type
	source string // "scraped from keel-edge", "declared at services/…/metrics.go:12"
}

// checkExprs reports each expression's problems and returns the series
// names used, mapped to their metric family.
func checkExprs(sites []exprSite, known map[string]metricInfo) (problems []string, used map[string]string) {
	used = map[string]string{}
	for _, site := range sites {
		sels, err := parsePromQL(site.expr)
		if err != nil {
			problems = append(problems, fmt.Sprintf("%s: %v: %s", site.where, err, site.expr))
			continue
		}
		if len(sels) == 0 {
			problems = append(problems, fmt.Sprintf("%s: no metric selector in %s", site.where, site.expr))
		}
		for _, s := range sels {
			if s.nameRegex != "" {
				re, err := regexp.Compile("^(?:" + s.nameRegex + ")$")
				if err != nil {
					problems = append(problems, fmt.Sprintf("%s: __name__ regex %q: %v", site.where, s.nameRegex, err))
					continue
				}
				n := 0
				for name := range known {
					if re.MatchString(name) {
						n++
					}
				}
				if n == 0 {
					problems = append(problems, fmt.Sprintf("%s: __name__=~%q matches no exported metric", site.where, s.nameRegex))
				}
				continue
			}
			fam, err := resolveSeries(s.name, known)
			if err != nil {
				problems = append(problems, fmt.Sprintf("%s: %v", site.where, err))
				continue
			}
			used[s.name] = fam
		}
	}
	return problems, used
}

// resolveSeries maps a series name to the metric family that exports it.
func resolveSeries(series string, known map[string]metricInfo) (string, error) {
	if m, ok := known[series]; ok {
		if m.typ == "histogram" {
			return "", fmt.Errorf("%s is a histogram (%s): query %s_bucket, _sum or _count", series, m.source, series)
		}
		return series, nil
	}
	for _, suf := range []string{"_bucket", "_sum", "_count"} {
		base, ok := strings.CutSuffix(series, suf)
		if !ok {
			continue
		}
		m, ok := known[base]
		if !ok {
			break
		}
		if m.typ == "histogram" || (m.typ == "summary" && suf != "_bucket") {
			return base, nil
		}
		return "", fmt.Errorf("%s: %s is a %s (%s), it has no %s series", series, base, orUntyped(m.typ), m.source, suf)
	}
	return "", fmt.Errorf("metric %s is not exported by any service (not scraped, not declared in services/ or libs/)%s", series, suggest(series, known))
}

func orUntyped(typ string) string {
	if typ == "" {
		return "metric of unknown type"
	}
	return typ
}

// suggest names the closest known metric, for a typo's error message.
func suggest(name string, known map[string]metricInfo) string {
	best, bestD := "", 1<<30
	for k := range known {
		if d := editDistance(name, k); d < bestD || (d == bestD && k < best) {
			best, bestD = k, d
		}
	}
	if best != "" && bestD <= 4 {
		return fmt.Sprintf("; did you mean %s?", best)
	}
	return ""
}

func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			c := prev[j-1]
			if a[i-1] != b[j-1] {
				c++
			}
			cur[j] = min(c, prev[j]+1, cur[j-1]+1)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// ---------------------------------------------------------------- PromQL

// selector is one vector selector of an expression.
type selector struct {
	name      string            // metric name, from the identifier or __name__="..."
	nameRegex string            // __name__=~"..." when the selector has no name
	matchers  map[string]string // label -> op+quoted value, e.g. job -> =~"$job"
}

type tokKind int

const (
	tIdent tokKind = iota
	tString
	tNumber
	tVar // a Grafana variable: $name, ${name}, [[name]] is not supported
	tPunct
)

type tok struct {
	kind tokKind
	s    string
}

// promFuncs are PromQL's functions and aggregation operators.
var promFuncs = setOf(
	// aggregations
	"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
	"quantile", "limitk", "limit_ratio",
	// functions
	"abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "day_of_month",
	"day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp", "floor", "histogram_avg",
	"histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev", "histogram_stdvar",
	"histogram_sum", "holt_winters", "double_exponential_smoothing", "hour", "idelta", "increase", "irate",
	"label_join", "label_replace", "ln", "log2", "log10", "minute", "month", "predict_linear", "rate", "resets",
	"round", "scalar", "sgn", "sort", "sort_desc", "sort_by_label", "sort_by_label_desc", "sqrt", "time",
	"timestamp", "vector", "year", "avg_over_time", "min_over_time", "max_over_time", "sum_over_time",
	"count_over_time", "quantile_over_time", "stddev_over_time", "stdvar_over_time", "last_over_time",
	"present_over_time", "mad_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh",
	"sin", "sinh", "tan", "tanh", "deg", "rad", "pi",
)

var (
	aggregations = setOf("sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
		"bottomk", "topk", "quantile", "limitk", "limit_ratio")
	groupingKeywords = setOf("by", "without", "on", "ignoring", "group_left", "group_right")
	binaryKeywords   = setOf("and", "or", "unless", "atan2", "bool")
	literalKeywords  = setOf("inf", "nan", "Inf", "NaN")
)

func setOf(xs ...string) map[string]bool {
	m := make(map[string]bool, len(xs))
	for _, x := range xs {
		m[x] = true
	}
	return m
}

// lexPromQL splits a PromQL expression (with Grafana $variables) into tokens.
func lexPromQL(s string) ([]tok, error) {
	var toks []tok
	isIdentStart := func(c byte) bool { return c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }
	isIdent := func(c byte) bool { return isIdentStart(c) || c >= '0' && c <= '9' }
	for i := 0; i < len(s); {
		c := s[i]
		switch {
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
			i++
		case c == '#':
			for i < len(s) && s[i] != '\n' {
				i++
			}
		case isIdentStart(c):
			j := i
			for j < len(s) && isIdent(s[j]) {
				j++
			}
			toks = append(toks, tok{tIdent, s[i:j]})
			i = j
		case c >= '0' && c <= '9' || c == '.' && i+1 < len(s) && s[i+1] >= '0' && s[i+1] <= '9':
			j := i
			for j < len(s) && (isIdent(s[j]) || s[j] == '.') {
				j++
			}
			toks = append(toks, tok{tNumber, s[i:j]})
			i = j
		case c == '"' || c == '\'' || c == '`':
			j := i + 1
			for j < len(s) && s[j] != c {
				if s[j] == '\\' && c != '`' {
					j++
				}
				j++
			}
			if j >= len(s) {
				return nil, fmt.Errorf("unterminated string at %d", i)
			}
			toks = append(toks, tok{tString, s[i : j+1]})
			i = j + 1
		case c == '$':
			j := i + 1
			if j < len(s) && s[j] == '{' {
				k := strings.IndexByte(s[j:], '}')
				if k < 0 {
					return nil, fmt.Errorf("unterminated ${ at %d", i)
				}
				j += k + 1
			} else {
				for j < len(s) && isIdent(s[j]) {
					j++
				}
			}
			toks = append(toks, tok{tVar, s[i:j]})
			i = j
		default:
			two := ""
			if i+1 < len(s) {
				two = s[i : i+2]
			}
			switch two {
			case "=~", "!~", "!=", "==", ">=", "<=":
				toks = append(toks, tok{tPunct, two})
				i += 2
				continue
			}
			if !strings.ContainsRune("{}()[],=<>+-*/%^@:", rune(c)) {
				return nil, fmt.Errorf("unexpected %q at %d", c, i)
			}
			toks = append(toks, tok{tPunct, string(c)})
			i++
		}
	}
	return toks, nil
}

// parsePromQL returns the vector selectors of a PromQL expression. It is not
// a full parser, but it knows what is not a metric name: functions and
// aggregations (checked against PromQL's list), grouping labels of by,
// without, on, ignoring, group_left and group_right, keywords, label
// matchers, ranges, durations after offset, strings and Grafana variables.
func parsePromQL(expr string) ([]selector, error) {
	toks, err := lexPromQL(expr)
	if err != nil {
		return nil, err
	}
	depth := map[string]int{}
	for _, tk := range toks {
		if tk.kind != tPunct {
			continue
		}
		switch tk.s {
		case "(", "{", "[":
			depth[tk.s]++
		case ")":
			depth["("]--
		case "}":
			depth["{"]--
		case "]":
			depth["["]--
		}
		for _, d := range depth {
			if d < 0 {
				return nil, fmt.Errorf("unbalanced brackets")
			}
		}
	}
	for _, d := range depth {
		if d != 0 {
			return nil, fmt.Errorf("unbalanced brackets")
		}
	}
	// skipGroup skips a balanced (...) or [...] starting at toks[i].
	skipGroup := func(i int) int {
		open := toks[i].s
		closer := map[string]string{"(": ")", "[": "]", "{": "}"}[open]
		n := 0
		for ; i < len(toks); i++ {
			if toks[i].kind != tPunct {
				continue
			}
			switch toks[i].s {
			case open:
				n++
			case closer:
				n--
				if n == 0 {
					return i + 1
				}
			}
		}
		return i
	}
	isPunct := func(i int, s string) bool { return i < len(toks) && toks[i].kind == tPunct && toks[i].s == s }

	var sels []selector
	for i := 0; i < len(toks); {
		tk := toks[i]
		switch {
		case tk.kind == tIdent && groupingKeywords[tk.s]:
			i++
			if isPunct(i, "(") {
				i = skipGroup(i)
			} else if tk.s != "group_left" && tk.s != "group_right" {
				return nil, fmt.Errorf("%s without a label list", tk.s)
			}
		case tk.kind == tIdent && tk.s == "offset":
			i++
			if isPunct(i, "-") {
				i++
			}
			if i >= len(toks) || (toks[i].kind != tNumber && toks[i].kind != tVar) {
				return nil, fmt.Errorf("offset without a duration")
			}
			i++
		case tk.kind == tIdent && (binaryKeywords[tk.s] || literalKeywords[tk.s]):
			i++
		case tk.kind == tIdent && aggregations[tk.s] && i+1 < len(toks) && toks[i+1].kind == tIdent &&
			(toks[i+1].s == "by" || toks[i+1].s == "without"):
			i++ // sum by (...) (...): the grouping is skipped next
		case tk.kind == tIdent && isPunct(i+1, "("):
			if !promFuncs[tk.s] {
				return nil, fmt.Errorf("unknown function %s", tk.s)
			}
			i++
		case tk.kind == tIdent:
			sel := selector{name: tk.s, matchers: map[string]string{}}
			i++
			if isPunct(i, "{") {
				end := skipGroup(i)
				if err := parseMatchers(toks[i+1:end-1], &sel); err != nil {
					return nil, fmt.Errorf("%s: %v", tk.s, err)
				}
				i = end
			}
			sels = append(sels, sel)
		case isPunct(i, "{"):
			sel := selector{matchers: map[string]string{}}
			end := skipGroup(i)
			if err := parseMatchers(toks[i+1:end-1], &sel); err != nil {
				return nil, err
			}
			if sel.name == "" && sel.nameRegex == "" {
				return nil, fmt.Errorf("selector without a metric name")
			}
			sels = append(sels, sel)
			i = end
		case isPunct(i, "["):
			i = skipGroup(i)
		case tk.kind == tIdent:
			i++
		default:
			i++
		}
	}
	return sels, nil
}

// parseMatchers reads label matchers: label op "value" {, label op "value"}.
func parseMatchers(toks []tok, sel *selector) error {
	for i := 0; i < len(toks); {
		if i+2 >= len(toks) || toks[i].kind != tIdent || toks[i+1].kind != tPunct || toks[i+2].kind != tString {
			return fmt.Errorf("bad label matcher near %q", toks[i].s)
		}
		label, op, val := toks[i].s, toks[i+1].s, toks[i+2].s
		switch op {
		case "=", "!=", "=~", "!~":
		default:
			return fmt.Errorf("bad matcher operator %q", op)
		}
		if label == "__name__" {
			v, err := strconv.Unquote(val)
			if err != nil && val[0] == '\'' {
				v, err = strconv.Unquote(`"` + strings.ReplaceAll(val[1:len(val)-1], `"`, `\"`) + `"`)
			}
			if err != nil {
				return fmt.Errorf("__name__ value %s: %v", val, err)
			}
			switch {
			case op == "=" && sel.name == "":
				sel.name = v
			case op == "=~" && sel.name == "":
				sel.nameRegex = v
			default:
				return fmt.Errorf("unsupported __name__%s%s", op, val)
			}
		}
		sel.matchers[label] = op + val
		i += 3
		if i < len(toks) {
			if toks[i].kind != tPunct || toks[i].s != "," {
				return fmt.Errorf("expected , after %s", label)
			}
			i++
		}
	}
	return nil
}

// ---------------------------------------------------------------- declared

var keelNameRE = regexp.MustCompile(`^keel_[a-z0-9_]+$`)

// declaredMetrics parses the non-test Go files under services/ and libs/
// that import client_golang and returns the metric names they declare.
func declaredMetrics(t *testing.T, root string) map[string]metricInfo {
	t.Helper()
	out := map[string]metricInfo{}
	fset := token.NewFileSet()
	for _, dir := range []string{"services", "libs"} {
		err := filepath.WalkDir(filepath.Join(root, dir), func(path string, de fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if de.IsDir() {
				if n := de.Name(); n == "testdata" || n == "vendor" || n == "node_modules" || strings.HasPrefix(n, ".") {
					return filepath.SkipDir
				}
				return nil
			}
			if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return nil
			}
			src, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			if !strings.Contains(string(src), `"github.com/prometheus/client_golang/prometheus"`) {
				return nil
			}
			f, err := parser.ParseFile(fset, path, src, parser.SkipObjectResolution)
			if err != nil {
				t.Logf("declared metrics: skipping %s: %v", path, err)
				return nil
			}
			rel, _ := filepath.Rel(root, path)
			where := func(p token.Pos) string {
				return fmt.Sprintf("declared at %s:%d", filepath.ToSlash(rel), fset.Position(p).Line)
			}
			var untyped []*ast.BasicLit
			ast.Inspect(f, func(n ast.Node) bool {
				switch n := n.(type) {
				case *ast.CompositeLit:
					typ := optsType(n.Type)
					if typ == "" {
						return true
					}
					parts := map[string]string{}
					for _, el := range n.Elts {
						kv, ok := el.(*ast.KeyValueExpr)
						if !ok {
							continue
						}
						key, ok := kv.Key.(*ast.Ident)
						lit, isLit := kv.Value.(*ast.BasicLit)
						if ok && isLit && lit.Kind == token.STRING {
							if v, err := strconv.Unquote(lit.Value); err == nil {
								parts[key.Name] = v
							}
						}
					}
					if parts["Name"] != "" {
						name := buildFQName(parts["Namespace"], parts["Subsystem"], parts["Name"])
						out[name] = metricInfo{typ: typ, source: where(n.Pos())}
					}
				case *ast.BasicLit:
					if n.Kind == token.STRING {
						untyped = append(untyped, n)
					}
				}
				return true
			})
			for _, lit := range untyped {
				v, err := strconv.Unquote(lit.Value)
				if err != nil || !keelNameRE.MatchString(v) {
					continue
				}
				if _, ok := out[v]; !ok {
					out[v] = metricInfo{source: where(lit.Pos()) + " (untyped string)"}
				}
			}
			return nil
		})
		if err != nil {
			t.Fatalf("scanning %s: %v", dir, err)
		}
	}
	return out
}

func optsType(e ast.Expr) string {
	sel, ok := e.(*ast.SelectorExpr)
	if !ok {
		return ""
	}
	switch sel.Sel.Name {
	case "CounterOpts":
		return "counter"
	case "GaugeOpts":
		return "gauge"
	case "HistogramOpts":
		return "histogram"
	case "SummaryOpts":
		return "summary"
	case "UntypedOpts":
		return "untyped"
	}
	return ""
}

// buildFQName joins like prometheus.BuildFQName.
func buildFQName(ns, sub, name string) string {
	var parts []string
	for _, p := range []string{ns, sub, name} {
		if p != "" {
			parts = append(parts, p)
		}
	}
	return strings.Join(parts, "_")
}

// ---------------------------------------------------------------- scraped

// service is one binary to build, start and scrape.
type service struct {
	name string
	pkg  string
	args func(dir string, port func() string, outputURL string) []string
}

var scrapedServices = []service{
	{"keel-output", "./services/output/cmd/keel-output", func(dir string, port func() string, _ string) []string {
		rules := filepath.Join(dir, "rules.yaml")
		_ = os.WriteFile(rules, nil, 0o644)
		return []string{"--rules.file", rules, "--listen-addr", port()}
	}},
	{"keel-edge", "./services/edge/cmd/keel-edge", func(dir string, port func() string, outputURL string) []string {
		a := []string{"--auth.anonymous", "--mqtt.tcp-addr", port(), "--data-dir", filepath.Join(dir, "data"), "--mqtt.edge-id", "dash"}
		if outputURL != "" {
			a = append(a, "--output.url", outputURL)
		}
		return a
	}},
	{"keel-coordinator", "./services/coordinator/cmd/keel-coordinator", func(dir string, port func() string, _ string) []string {
		return []string{"--raft.bootstrap-expect", "1", "--raft.data-dir", filepath.Join(dir, "raft"),
			"--raft.bind-addr", port(), "--gossip.bind-addr", port(), "--api.addr", port()}
	}},
	{"keel-router", "./services/router/cmd/keel-router", func(dir string, port func() string, _ string) []string {
		_, op, _ := net.SplitHostPort(port())
		_, mp, _ := net.SplitHostPort(port())
		return []string{"--olric.single-node", "--olric.bind-addr", "127.0.0.1", "--olric.port", op,
			"--olric.memberlist-port", mp, "--api.addr", port()}
	}},
	{"keel-persistence", "./services/persistence/cmd/keel-persistence", func(dir string, port func() string, _ string) []string {
		return []string{"--data-dir", filepath.Join(dir, "data"), "--api.addr", port()}
	}},
}

// freePort returns a loopback address nothing listens on right now.
func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// scrapeServices builds, starts and scrapes the services; a service that
// cannot be built or started is skipped with the reason logged.
func scrapeServices(t *testing.T, root string) map[string]metricInfo {
	t.Helper()
	out := map[string]metricInfo{}
	bin := t.TempDir()
	build := exec.Command("go", append([]string{"build", "-o", bin + string(os.PathSeparator)}, pkgsOf(scrapedServices)...)...)
	build.Dir = root
	if b, err := build.CombinedOutput(); err != nil {
		// One broken service must not hide the others: build one by one.
		t.Logf("building all services failed, building each alone: %v\n%s", err, b)
		for _, s := range scrapedServices {
			one := exec.Command("go", "build", "-o", filepath.Join(bin, s.name), s.pkg)
			one.Dir = root
			if b, err := one.CombinedOutput(); err != nil {
				t.Logf("SKIP %s: cannot build %s: %v\n%s", s.name, s.pkg, err, b)
			}
		}
	}
	outputURL := ""
	for _, s := range scrapedServices {
		exe := filepath.Join(bin, s.name)
		if _, err := os.Stat(exe); err != nil {
			continue
		}
		dir := t.TempDir()
		ops := freePort(t)
		args := append(s.args(dir, func() string { return freePort(t) }, outputURL), "--ops.addr", ops, "--log.level", "warn")
		fams, err := runAndScrape(t, s.name, exe, dir, args, ops)
		if err != nil {
			t.Logf("SKIP %s: cannot start it here: %v", s.name, err)
			continue
		}
		for name, typ := range fams {
			if _, ok := out[name]; !ok {
				out[name] = metricInfo{typ: typ, source: "scraped from " + s.name}
			}
		}
		if s.name == "keel-output" {
			outputURL = "http://" + argAfter(args, "--listen-addr")
		}
		t.Logf("%s: scraped %d keel_* families", s.name, countKeel(fams))
	}
	return out
}

func pkgsOf(ss []service) []string {
	var p []string
	for _, s := range ss {
		p = append(p, s.pkg)
	}
	return p
}

func argAfter(args []string, flag string) string {
	for i, a := range args {
		if a == flag && i+1 < len(args) {
			return args[i+1]
		}
	}
	return ""
}

func countKeel(f map[string]string) int {
	n := 0
	for k := range f {
		if strings.HasPrefix(k, "keel_") {
			n++
		}
	}
	return n
}

// runAndScrape starts exe, waits for its /metrics to answer with keel_*
// metrics, exercises it (an MQTT publish on the edge), scrapes it, and leaves
// it running until the test ends.
func runAndScrape(t *testing.T, name, exe, dir string, args []string, ops string) (map[string]string, error) {
	t.Helper()
	logPath := filepath.Join(dir, name+".log")
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe, args...)
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait(); logf.Close() }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	})
	logTail := func() string {
		b, _ := os.ReadFile(logPath)
		if len(b) > 2000 {
			b = b[len(b)-2000:]
		}
		return string(b)
	}
	url := "http://" + ops + "/metrics"
	deadline := time.Now().Add(30 * time.Second)
	var fams map[string]string
	for {
		select {
		case err := <-exited:
			return nil, fmt.Errorf("%s %s exited: %v\n%s", name, strings.Join(args, " "), err, logTail())
		default:
		}
		if f, err := scrape(url); err == nil && countKeel(f) > 0 {
			fams = f
			break
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%s served no keel_* metrics on %s within 30s\n%s", name, url, logTail())
		}
		time.Sleep(100 * time.Millisecond)
	}
	if name == "keel-edge" {
		if err := mqttPublish(argAfter(args, "--mqtt.tcp-addr")); err != nil {
			t.Logf("keel-edge: MQTT publish to populate its metrics failed (scraping anyway): %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if name == "keel-coordinator" {
		time.Sleep(time.Second) // let the single node win its election
	}
	if f, err := scrape(url); err == nil {
		for k, v := range f {
			fams[k] = v
		}
	}
	return fams, nil
}

// scrape reads /metrics in the text format and returns family -> type.
func scrape(url string) (map[string]string, error) {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: %s", url, resp.Status)
	}
	fams := map[string]string{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if rest, ok := strings.CutPrefix(line, "# TYPE "); ok {
			if f := strings.Fields(rest); len(f) == 2 {
				fams[f[0]] = f[1]
			}
			continue
		}
		if line == "" || line[0] == '#' {
			continue
		}
		name := line
		if i := strings.IndexAny(line, "{ "); i >= 0 {
			name = line[:i]
		}
		if _, ok := fams[name]; !ok && !hasFamily(fams, name) {
			fams[name] = "untyped"
		}
	}
	return fams, sc.Err()
}

func hasFamily(fams map[string]string, series string) bool {
	for _, suf := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(series, suf); ok {
			if _, ok := fams[base]; ok {
				return true
			}
		}
	}
	return false
}

// mqttPublish connects to an MQTT 3.1.1 listener, subscribes to a topic,
// publishes one QoS 1 message to it and disconnects: enough to give the
// edge's connect, message and subscription metrics their first series.
func mqttPublish(addr string) error {
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	str := func(s string) []byte { return append([]byte{byte(len(s) >> 8), byte(len(s))}, s...) }
	packet := func(typ byte, body []byte) []byte { return append([]byte{typ, byte(len(body))}, body...) }
	connect := append(append(str("MQTT"), 4, 0x02, 0, 30), str("keel-dashboard-test")...)
	if _, err := conn.Write(packet(0x10, connect)); err != nil {
		return err
	}
	ack := make([]byte, 4)
	if _, err := io.ReadFull(conn, ack); err != nil {
		return fmt.Errorf("CONNACK: %w", err)
	}
	if ack[0] != 0x20 || ack[3] != 0 {
		return fmt.Errorf("CONNACK % x", ack)
	}
	sub := append(append([]byte{0, 1}, str("keel/dashboard")...), 1)
	pub := append(append(str("keel/dashboard"), 0, 2), "hello"...)
	for _, p := range [][]byte{packet(0x82, sub), packet(0x32, pub)} {
		if _, err := conn.Write(p); err != nil {
			return err
		}
	}
	// SUBACK, PUBACK and the delivered PUBLISH, in whatever order.
	_ = conn.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
	_, _ = io.Copy(io.Discard, conn)
	_ = conn.SetDeadline(time.Now().Add(time.Second))
	_, err = conn.Write([]byte{0xe0, 0})
	return err
}
