package rules

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/topic"
)

func pluginDir(t *testing.T, ids ...string) string {
	t.Helper()
	dir := t.TempDir()
	for _, id := range ids {
		require.NoError(t, os.WriteFile(filepath.Join(dir, BinaryPrefix+id), []byte("#!/bin/sh\n"), 0o755))
	}
	return dir
}

const validRules = `
tenants:
  acme:
    rules:
      - name: orders
        filters: ["orders/#", "orders/+/eu"]
        transforms:
          - plugin: filter
            config: {user_properties: [{key: region}]}
        sink:
          plugin: kafka
          config: {brokers: ["k:9092"], topic: orders, sasl: {mechanism: plain, username: u, password: "${PW}"}}
        buffer: {records: 100, bytes: 1000000}
        max_batch: 50
        write_timeout: 5s
      - name: all
        filters: ["#"]
        sink: {plugin: http, config: {url: "http://h/x"}}
  beta:
    rules:
      - name: orders
        filters: ["orders/#"]
        sink: {plugin: http}
`

func TestParse_Valid(t *testing.T) {
	t.Parallel()
	set, err := Parse("rules.yaml", []byte(validRules), Options{
		PluginDir: pluginDir(t, "kafka", "http", "filter"),
		LookupEnv: func(k string) (string, bool) { return "pw-" + k, k == "PW" },
	})
	require.NoError(t, err)
	var names []string
	for _, p := range set.Pipelines {
		names = append(names, p.Name)
	}
	require.Equal(t, []string{"acme/all", "acme/orders", "beta/orders"}, names)
	p := set.Pipeline("acme/orders")
	require.Equal(t, 100, p.BufferRecords)
	require.Equal(t, 50, p.MaxBatch)
	require.Equal(t, "filter", p.Transforms[0].Plugin)
	var cfg map[string]any
	require.NoError(t, json.Unmarshal(p.Sink.Config, &cfg))
	require.Equal(t, "pw-PW", cfg["sasl"].(map[string]any)["password"])
	require.Equal(t, DefaultBufferRecords, set.Pipeline("acme/all").BufferRecords)
}

func TestSet_Match(t *testing.T) {
	t.Parallel()
	set, err := Parse("r.yaml", []byte(validRules), Options{SkipBinaryCheck: true, LookupEnv: func(string) (string, bool) { return "", true }})
	require.NoError(t, err)
	for _, tc := range []struct {
		name, tenant, topic string
		want                []string
	}{
		{"two_filters_one_rule", "acme", "orders/1/eu", []string{"acme/orders", "acme/all"}},
		{"hash_only", "acme", "x/y", []string{"acme/all"}},
		{"other_tenant", "beta", "orders/1", []string{"beta/orders"}},
		{"tenant_isolation", "beta", "x", nil},
		{"unknown_tenant", "gamma", "orders/1", nil},
		{"sys_not_matched_by_hash", "acme", "$SYS/x", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []string
			set.Match(tc.tenant, tc.topic, func(p *Pipeline) { got = append(got, p.Name) })
			slices.Sort(got)
			want := slices.Clone(tc.want)
			slices.Sort(want)
			require.Equal(t, want, got)
		})
	}
}

// TestSet_Filters checks that the filters a set publishes match exactly the
// messages Match finds a pipeline for, per tenant, on the topics of
// TestSet_Match and a few more.
func TestSet_Filters(t *testing.T) {
	t.Parallel()
	set, err := Parse("r.yaml", []byte(validRules), Options{SkipBinaryCheck: true, LookupEnv: func(string) (string, bool) { return "", true }})
	require.NoError(t, err)
	fs := set.Filters()
	require.Equal(t, map[string][]string{"acme": {"#", "orders/#", "orders/+/eu"}, "beta": {"orders/#"}}, fs)
	for _, tenant := range []string{"acme", "beta", "gamma"} {
		for _, name := range []string{"orders", "orders/1/eu", "x/y", "x", "$SYS/x", "orders/", "/orders"} {
			matched := false
			set.Match(tenant, name, func(*Pipeline) { matched = true })
			filtered := slices.ContainsFunc(fs[tenant], func(f string) bool { return topic.Match(f, name) })
			require.Equal(t, matched, filtered, "tenant %s topic %q", tenant, name)
		}
	}
	require.Empty(t, (&Set{}).Filters())
}

func TestParse_Errors(t *testing.T) {
	t.Parallel()
	dir := pluginDir(t, "kafka")
	for _, tc := range []struct {
		name string
		yaml string
		want []string // each "line:path: text" fragment must appear
	}{
		{"syntax", "tenants:\n  acme: [\n", []string{"r.yaml:2: did not find expected node content"}},
		{"unknown_field", "tenants:\n  acme:\n    rulez: []\n", []string{"r.yaml:3: field rulez not found"}},
		{"bad_tenant", "tenants:\n  Acme:\n    rules: []\n", []string{"r.yaml:2: tenants.Acme: tenant \"Acme\""}},
		{"no_filters_no_sink", "tenants:\n  a:\n    rules:\n      - name: r\n", []string{"r.yaml:4: tenants.a.rules[0]: filters", "r.yaml:4: tenants.a.rules[0]: sink"}},
		{"bad_filter_line", "tenants:\n  a:\n    rules:\n      - name: r\n        filters:\n          - ok/+\n          - bad#\n        sink: {plugin: kafka}\n", []string{"r.yaml:7: tenants.a.rules[0].filters[1]: topic filter \"bad#\""}},
		{"shared_filter", "tenants:\n  a:\n    rules:\n      - name: r\n        filters: [\"$share/g/x\"]\n        sink: {plugin: kafka}\n", []string{"shared subscriptions"}},
		{"missing_plugin", "tenants:\n  a:\n    rules:\n      - name: r\n        filters: [x]\n        sink:\n          plugin: redis\n", []string{"r.yaml:7: tenants.a.rules[0].sink.plugin: plugin \"redis\""}},
		{"duplicate_rule", "tenants:\n  a:\n    rules:\n      - {name: r, filters: [x], sink: {plugin: kafka}}\n      - {name: r, filters: [y], sink: {plugin: kafka}}\n", []string{"r.yaml:5: tenants.a.rules[1].name: duplicate rule name"}},
		{"unset_env", "tenants:\n  a:\n    rules:\n      - name: r\n        filters: [x]\n        sink: {plugin: kafka, config: {password: \"${NOPE_NOT_SET}\"}}\n", []string{"r.yaml:6: tenants.a.rules[0].sink.config: environment variable NOPE_NOT_SET is not set"}},
		{"bad_buffer", "tenants:\n  a:\n    rules:\n      - name: r\n        filters: [x]\n        sink: {plugin: kafka}\n        buffer: {records: -1}\n", []string{"r.yaml:7: tenants.a.rules[0].buffer.records"}},
		{"wrong_type", "tenants:\n  a:\n    rules:\n      - name: r\n        filters: x\n", []string{"r.yaml:5: cannot unmarshal"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := Parse("r.yaml", []byte(tc.yaml), Options{PluginDir: dir, LookupEnv: func(string) (string, bool) { return "", false }})
			require.Error(t, err)
			require.True(t, errors.Is(err, ErrInvalid))
			for _, w := range tc.want {
				require.Contains(t, err.Error(), w)
			}
			var e *Error
			require.True(t, errors.As(err, &e))
			require.Positive(t, e.Line)
		})
	}
}

func TestLoad_RelativePluginPath(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "bin"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "bin", "my-sink"), []byte("#!/bin/sh\n"), 0o755))
	path := filepath.Join(dir, "rules.yaml")
	require.NoError(t, os.WriteFile(path, []byte("plugins: {mine: bin/my-sink}\ntenants:\n  a:\n    rules:\n      - {name: r, filters: [x], sink: {plugin: mine}}\n"), 0o600))
	set, err := Load(path, Options{})
	require.NoError(t, err)
	require.Equal(t, filepath.Join(dir, "bin", "my-sink"), set.Pipelines[0].Sink.Path)
}

const locatedRules = `tenants:
  acme:
    rules:
      - name: orders
        filters: ["orders/#"]
        transforms:
          - plugin: filter
            config: {user_properties: [{key: region}]}
          - plugin: json-map
            config:
              fields: {id: msg_id}
        sink:
          plugin: kafka
          config:
            brokers: ["k:9092"]
  beta:
    rules:
      - name: all
        filters: ["#"]
        sink: {plugin: http}
`

// TestParse_ConfigLocations checks where each stage's config is recorded:
// a plugin refusing its config is then reported at the line of the config
// key, or of the stage when it has none.
func TestParse_ConfigLocations(t *testing.T) {
	t.Parallel()
	set, err := Parse("r.yaml", []byte(locatedRules), Options{SkipBinaryCheck: true})
	require.NoError(t, err)
	p := set.Pipeline("acme/orders")
	require.Equal(t, Location{File: "r.yaml", Line: 8, Path: "tenants.acme.rules[0].transforms[0].config"}, p.Transforms[0].ConfigAt)
	require.Equal(t, Location{File: "r.yaml", Line: 10, Path: "tenants.acme.rules[0].transforms[1].config"}, p.Transforms[1].ConfigAt)
	require.Equal(t, Location{File: "r.yaml", Line: 14, Path: "tenants.acme.rules[0].sink.config"}, p.Sink.ConfigAt)
	require.Equal(t, Location{File: "r.yaml", Line: 20, Path: "tenants.beta.rules[0].sink.config"}, set.Pipeline("beta/all").Sink.ConfigAt)

	e := p.Sink.ConfigAt.Problem("kafka sink config: brokers: at least one address is required")
	require.EqualError(t, e, "r.yaml:14: tenants.acme.rules[0].sink.config: kafka sink config: brokers: at least one address is required")
	require.ErrorIs(t, e, ErrInvalid)

	// Lines added above a rule move its configs, not its processes.
	moved, err := Parse("r.yaml", []byte("# owner: data team\n\n"+locatedRules), Options{SkipBinaryCheck: true})
	require.NoError(t, err)
	q := moved.Pipeline("acme/orders")
	require.Equal(t, 16, q.Sink.ConfigAt.Line)
	require.True(t, p.SameRuntime(q))
	q.Sink.Config = []byte(`{"brokers":["k:9093"]}`)
	require.False(t, p.SameRuntime(q))
}
