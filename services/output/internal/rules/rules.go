// Package rules parses and validates the output rules file: per tenant,
// rules that send the messages matching topic filters through transforms to
// a sink, each stage a plugin. Every problem is reported with the line it is
// on; a file with any problem is rejected whole, so the host keeps its last
// good rules.
//
// Example:
//
//	plugins:                  # optional: plugin ID → binary (relative to this file)
//	  kafka: /usr/lib/keel/keel-output-kafka
//	tenants:
//	  acme:
//	    rules:
//	      - name: orders
//	        filters: ["orders/#"]
//	        transforms:
//	          - plugin: filter
//	            config: {user_properties: [{key: region, value: eu}]}
//	        sink:
//	          plugin: kafka
//	          config: {brokers: ["kafka:9092"], topic: orders, sasl: {mechanism: plain, username: keel, password: "${KAFKA_PASSWORD}"}}
//	        buffer: {records: 10000, bytes: 16777216}
//	        max_batch: 500
//
// Strings in plugin configs may name environment variables as ${NAME}; an
// unset variable is an error, so secrets stay out of the file.
package rules

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/keelmq/keel/libs/topic"
)

// Defaults and limits of a rule.
const (
	DefaultBufferRecords = 10000
	DefaultBufferBytes   = 64 << 20
	DefaultMaxBatch      = 500
	DefaultWriteTimeout  = 30 * time.Second
	MaxBufferRecords     = 10_000_000
	// BinaryPrefix names a plugin binary in the plugin directory:
	// keel-output-<id>.
	BinaryPrefix = "keel-output-"
)

var (
	tenantRe = regexp.MustCompile(`^[a-z0-9-]{1,63}$`)
	nameRe   = regexp.MustCompile(`^[a-z0-9_-]{1,63}$`)
	pluginRe = regexp.MustCompile(`^[a-z0-9-]{1,63}$`)
	envRe    = regexp.MustCompile(`\$\{([A-Za-z_][A-Za-z0-9_]*)\}`)
)

// file is the YAML document.
type file struct {
	Plugins map[string]string `yaml:"plugins"`
	Tenants map[string]tenant `yaml:"tenants"`
}

type tenant struct {
	Rules []rule `yaml:"rules"`
}

type rule struct {
	Name         string        `yaml:"name"`
	Filters      []string      `yaml:"filters"`
	Transforms   []stage       `yaml:"transforms"`
	Sink         *stage        `yaml:"sink"`
	Buffer       buffer        `yaml:"buffer"`
	MaxBatch     int           `yaml:"max_batch"`
	WriteTimeout time.Duration `yaml:"write_timeout"`
}

type stage struct {
	Plugin string         `yaml:"plugin"`
	Config map[string]any `yaml:"config"`
}

type buffer struct {
	Records int   `yaml:"records"`
	Bytes   int64 `yaml:"bytes"`
}

// Stage is one plugin stage of a pipeline.
type Stage struct {
	Plugin string // plugin ID
	Path   string // binary
	Config []byte // JSON, ${VAR}s expanded
	// ConfigAt is where the stage's config is in the rules file, so that a
	// plugin refusing it can be reported like any other problem of the file.
	ConfigAt Location
}

// Location is a place in a rules file.
type Location struct {
	File string // as given to [Parse]
	Line int    // of the config key, or of the stage's key when it has no config
	Path string // e.g. "tenants.acme.rules[0].sink.config"
}

// Problem returns msg as a problem found at l, in the form of every other
// problem of the file.
func (l Location) Problem(msg string) *Error {
	return &Error{File: l.File, Line: l.Line, Path: l.Path, Msg: msg}
}

// sameRuntime reports whether s and t launch the same binary with the same
// configuration, wherever in the file they are.
func (s *Stage) sameRuntime(t *Stage) bool {
	return s.Plugin == t.Plugin && s.Path == t.Path && bytes.Equal(s.Config, t.Config)
}

// Pipeline is one validated rule. Its Name is "tenant/rule".
type Pipeline struct {
	Name          string
	Tenant        string
	Rule          string
	Filters       []string
	Transforms    []Stage
	Sink          Stage
	BufferRecords int
	BufferBytes   int64
	MaxBatch      int
	WriteTimeout  time.Duration
}

// SameRuntime reports whether p and q run the same plugins with the same
// configuration (filters, buffer sizes and where the rule is in the file may
// differ), so a reload can keep p's plugin processes.
func (p *Pipeline) SameRuntime(q *Pipeline) bool {
	return slices.EqualFunc(p.Transforms, q.Transforms, func(s, t Stage) bool { return s.sameRuntime(&t) }) &&
		p.Sink.sameRuntime(&q.Sink) && p.MaxBatch == q.MaxBatch && p.WriteTimeout == q.WriteTimeout
}

// Set is a validated rules file.
type Set struct {
	Pipelines []*Pipeline // sorted by name
	byName    map[string]*Pipeline
	tries     map[string]*topic.Trie[*Pipeline] // by tenant
}

// Options tell [Parse] how to find plugin binaries.
type Options struct {
	// PluginDir holds keel-output-<id> binaries for IDs that the file's
	// plugins section does not name.
	PluginDir string
	// LookupEnv resolves ${NAME}; nil means os.LookupEnv.
	LookupEnv func(string) (string, bool)
	// SkipBinaryCheck accepts plugin paths that do not exist (for
	// --check-config on a machine without the plugins).
	SkipBinaryCheck bool
}

// Load reads and parses the rules file at path.
func Load(path string, opts Options) (*Set, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("%w: read %s: %w", ErrInvalid, path, err)
	}
	if opts.PluginDir == "" {
		opts.PluginDir = filepath.Dir(path)
	}
	return Parse(path, b, opts)
}

// Parse validates a rules document; name is used in error messages and to
// resolve relative plugin paths. It returns every problem found, each an
// [*Error], joined.
func Parse(name string, data []byte, opts Options) (*Set, error) {
	if opts.LookupEnv == nil {
		opts.LookupEnv = os.LookupEnv
	}
	var root yaml.Node
	if err := yaml.Unmarshal(data, &root); err != nil {
		return nil, yamlError(name, err.Error())
	}
	var f file
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&f); err != nil && !errors.Is(err, io.EOF) {
		var te *yaml.TypeError
		if !errors.As(err, &te) {
			return nil, yamlError(name, err.Error())
		}
		var errs joined
		for _, e := range te.Errors {
			errs = append(errs, yamlError(name, e))
		}
		if len(errs) == 1 {
			return nil, errs[0]
		}
		return nil, errs
	}
	v := &validator{name: name, root: &root, opts: opts}
	set := v.build(&f)
	if len(v.errs) > 0 {
		return nil, v.err()
	}
	return set, nil
}

var lineRe = regexp.MustCompile(`^(?:yaml: )?line (\d+): `)

// yamlError turns a yaml.v3 message ("yaml: line 5: ...") into an *Error
// with the line in its place.
func yamlError(name, msg string) *Error {
	e := &Error{File: name, Msg: strings.TrimPrefix(msg, "yaml: ")}
	if m := lineRe.FindStringSubmatch(msg); m != nil {
		e.Line, _ = strconv.Atoi(m[1])
		e.Msg = msg[len(m[0]):]
	}
	return e
}

type validator struct {
	name string
	root *yaml.Node
	opts Options
	errs []error
}

func (v *validator) err() error {
	if len(v.errs) == 1 {
		return v.errs[0]
	}
	return joined(v.errs)
}

// joined is errors.Join with one problem per line, each still an *Error.
type joined []error

func (j joined) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d problems:", len(j))
	for _, e := range j {
		b.WriteString("\n  ")
		b.WriteString(e.Error())
	}
	return b.String()
}

func (j joined) Unwrap() []error { return j }

// add records a problem at path (elements: string keys and int indexes).
func (v *validator) add(path []any, format string, args ...any) {
	v.errs = append(v.errs, &Error{File: v.name, Line: lineOf(v.root, path), Path: pathString(path), Msg: fmt.Sprintf(format, args...)})
}

func (v *validator) build(f *file) *Set {
	set := &Set{byName: map[string]*Pipeline{}, tries: map[string]*topic.Trie[*Pipeline]{}}
	for id, p := range f.Plugins {
		if !pluginRe.MatchString(id) {
			v.add([]any{"plugins", id}, "plugin ID %q: want [a-z0-9-]{1,63}", id)
		}
		if p == "" {
			v.add([]any{"plugins", id}, "empty binary path")
		}
	}
	tenants := make([]string, 0, len(f.Tenants))
	for t := range f.Tenants {
		tenants = append(tenants, t)
	}
	sort.Strings(tenants)
	for _, t := range tenants {
		tpath := []any{"tenants", t}
		if !tenantRe.MatchString(t) {
			v.add(tpath, "tenant %q: want [a-z0-9-]{1,63}", t)
			continue
		}
		seen := map[string]bool{}
		for i, r := range f.Tenants[t].Rules {
			rpath := append(tpath[:len(tpath):len(tpath)], "rules", i)
			p := v.rule(t, &r, rpath, f.Plugins)
			if p == nil {
				continue
			}
			if seen[r.Name] {
				v.add(append(rpath, "name"), "duplicate rule name %q in tenant %q", r.Name, t)
				continue
			}
			seen[r.Name] = true
			set.Pipelines = append(set.Pipelines, p)
			set.byName[p.Name] = p
			tr := set.tries[t]
			if tr == nil {
				tr = &topic.Trie[*Pipeline]{}
				set.tries[t] = tr
			}
			for _, fl := range p.Filters {
				tr.Add(fl, p)
			}
		}
	}
	sort.Slice(set.Pipelines, func(i, j int) bool { return set.Pipelines[i].Name < set.Pipelines[j].Name })
	return set
}

func (v *validator) rule(tenant string, r *rule, path []any, plugins map[string]string) *Pipeline {
	n := len(v.errs)
	sub := func(els ...any) []any { return append(path[:len(path):len(path)], els...) }
	if !nameRe.MatchString(r.Name) {
		v.add(sub("name"), "rule name %q: want [a-z0-9_-]{1,63}", r.Name)
	}
	if len(r.Filters) == 0 {
		v.add(path, "filters: at least one topic filter is required")
	}
	for i, fl := range r.Filters {
		if err := topic.ValidateFilter(fl, topic.Limits{}); err != nil {
			v.add(sub("filters", i), "topic filter %q: %v", fl, err)
		} else if _, _, shared, _ := topic.ParseShare(fl); shared {
			v.add(sub("filters", i), "topic filter %q: shared subscriptions are not output filters", fl)
		}
	}
	p := &Pipeline{
		Name: tenant + "/" + r.Name, Tenant: tenant, Rule: r.Name, Filters: r.Filters,
		BufferRecords: r.Buffer.Records, BufferBytes: r.Buffer.Bytes, MaxBatch: r.MaxBatch, WriteTimeout: r.WriteTimeout,
	}
	if p.BufferRecords == 0 {
		p.BufferRecords = DefaultBufferRecords
	}
	if p.BufferBytes == 0 {
		p.BufferBytes = DefaultBufferBytes
	}
	if p.MaxBatch == 0 {
		p.MaxBatch = DefaultMaxBatch
	}
	if p.WriteTimeout == 0 {
		p.WriteTimeout = DefaultWriteTimeout
	}
	if p.BufferRecords < 0 || p.BufferRecords > MaxBufferRecords {
		v.add(sub("buffer", "records"), "buffer.records %d: want 1..%d", p.BufferRecords, MaxBufferRecords)
	}
	if p.BufferBytes < 0 {
		v.add(sub("buffer", "bytes"), "buffer.bytes must be positive")
	}
	if p.MaxBatch < 0 || p.MaxBatch > p.BufferRecords {
		v.add(sub("max_batch"), "max_batch %d: want 1..buffer.records", p.MaxBatch)
	}
	if p.WriteTimeout < 0 {
		v.add(sub("write_timeout"), "write_timeout must be positive")
	}
	for i := range r.Transforms {
		p.Transforms = append(p.Transforms, v.stage(&r.Transforms[i], sub("transforms", i), plugins))
	}
	if r.Sink == nil {
		v.add(path, "sink: a sink plugin is required")
	} else {
		p.Sink = v.stage(r.Sink, sub("sink"), plugins)
	}
	if len(v.errs) > n {
		return nil
	}
	return p
}

func (v *validator) stage(s *stage, path []any, plugins map[string]string) Stage {
	cfgPath := append(path[:len(path):len(path)], "config")
	out := Stage{Plugin: s.Plugin, ConfigAt: Location{File: v.name, Line: lineOf(v.root, cfgPath), Path: pathString(cfgPath)}}
	if !pluginRe.MatchString(s.Plugin) {
		v.add(append(path, "plugin"), "plugin ID %q: want [a-z0-9-]{1,63}", s.Plugin)
		return out
	}
	bin, named := plugins[s.Plugin]
	switch {
	case !named:
		bin = filepath.Join(v.opts.PluginDir, BinaryPrefix+s.Plugin)
	case !filepath.IsAbs(bin):
		bin = filepath.Join(filepath.Dir(v.name), bin)
	}
	out.Path = bin
	if !v.opts.SkipBinaryCheck {
		st, err := os.Stat(bin)
		switch {
		case err != nil:
			v.add(append(path, "plugin"), "plugin %q: binary %s: %v", s.Plugin, bin, errorsText(err))
		case st.IsDir() || st.Mode()&0o111 == 0:
			v.add(append(path, "plugin"), "plugin %q: %s is not an executable file", s.Plugin, bin)
		}
	}
	cfg, missing := expand(s.Config, v.opts.LookupEnv)
	for _, name := range missing {
		v.add(cfgPath, "environment variable %s is not set", name)
	}
	if cfg == nil {
		cfg = map[string]any{}
	}
	b, err := json.Marshal(cfg)
	if err != nil {
		v.add(cfgPath, "config cannot be encoded as JSON: %v", err)
	}
	out.Config = b
	return out
}

func errorsText(err error) string {
	if pe, ok := err.(*os.PathError); ok { //nolint:errorlint // only for the message
		return pe.Err.Error()
	}
	return err.Error()
}

// expand replaces ${NAME} in every string of a config value.
func expand(v any, lookup func(string) (string, bool)) (any, []string) {
	var missing []string
	var walk func(any) any
	walk = func(v any) any {
		switch x := v.(type) {
		case string:
			return envRe.ReplaceAllStringFunc(x, func(m string) string {
				name := m[2 : len(m)-1]
				val, ok := lookup(name)
				if !ok {
					missing = append(missing, name)
				}
				return val
			})
		case map[string]any:
			out := make(map[string]any, len(x))
			for k, e := range x {
				out[k] = walk(e)
			}
			return out
		case []any:
			out := make([]any, len(x))
			for i, e := range x {
				out[i] = walk(e)
			}
			return out
		}
		return v
	}
	if m, ok := v.(map[string]any); ok && m == nil {
		return nil, nil
	}
	return walk(v), missing
}

// Pipeline returns the pipeline named "tenant/rule", or nil.
func (s *Set) Pipeline(name string) *Pipeline { return s.byName[name] }

// Filters returns, by tenant, the topic filters of the tenant's rules, sorted
// and without duplicates. A message matches one of its tenant's filters
// exactly when [Set.Match] finds a pipeline for it, so edges can leave out
// every other message. Tenants without rules have no entry.
func (s *Set) Filters() map[string][]string {
	out := make(map[string][]string)
	for _, p := range s.Pipelines {
		out[p.Tenant] = append(out[p.Tenant], p.Filters...)
	}
	for t, fs := range out {
		slices.Sort(fs)
		out[t] = slices.Compact(fs)
	}
	return out
}

// Match calls fn once for every pipeline of tenant with a filter matching
// topicName. It allocates nothing when no filter of the tenant matches.
func (s *Set) Match(tenant, topicName string, fn func(*Pipeline)) {
	tr := s.tries[tenant]
	if tr == nil {
		return
	}
	var first *Pipeline // the common case: one pipeline matches, maybe through several filters
	var more []*Pipeline
	tr.Match(topicName, func(p *Pipeline) bool {
		if p == first || slices.Contains(more, p) {
			return true
		}
		if first == nil {
			first = p
		} else {
			more = append(more, p)
		}
		fn(p)
		return true
	})
}

// lineOf finds the line of the node at path in a YAML document, or of the
// deepest ancestor that exists. A mapping entry is located by its key's
// line, a sequence element by its own.
func lineOf(root *yaml.Node, path []any) int {
	n := root
	if n.Kind == yaml.DocumentNode && len(n.Content) > 0 {
		n = n.Content[0]
	}
	line := n.Line
	for _, el := range path {
		var next *yaml.Node
		switch k := el.(type) {
		case string:
			if n.Kind == yaml.MappingNode {
				for i := 0; i+1 < len(n.Content); i += 2 {
					if n.Content[i].Value == k {
						next = n.Content[i+1]
						line = n.Content[i].Line
						break
					}
				}
			}
		case int:
			if n.Kind == yaml.SequenceNode && k < len(n.Content) {
				next = n.Content[k]
			}
		}
		if next == nil {
			return line
		}
		n = next
		if _, idx := el.(int); idx {
			line = n.Line
		}
	}
	return line
}

func pathString(path []any) string {
	var b strings.Builder
	for _, el := range path {
		switch k := el.(type) {
		case string:
			if b.Len() > 0 {
				b.WriteByte('.')
			}
			b.WriteString(k)
		case int:
			fmt.Fprintf(&b, "[%d]", k)
		}
	}
	return b.String()
}
