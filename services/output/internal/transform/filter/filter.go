// Package filter is the "filter" transform plugin: it passes on the records
// that match conditions on MQTT 5 user properties and JSON payload fields and
// drops the rest.
package filter

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"sync"

	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
	"github.com/keelmq/keel/services/output/internal/meta"
)

// ID is the plugin ID.
const ID = "filter"

// Config is the plugin's configuration.
type Config struct {
	// Match is "all" (default: every condition must hold) or "any".
	Match string `json:"match"`
	// Invert drops the matching records instead and keeps the rest.
	Invert bool `json:"invert"`
	// UserProperties are conditions on MQTT 5 user properties.
	UserProperties []PropertyCond `json:"user_properties"`
	// JSON are conditions on fields of a JSON payload; a payload that is not
	// JSON matches none of them.
	JSON []FieldCond `json:"json"`
}

// PropertyCond holds when a user property named Key exists and, if Value is
// set, one such property has that value.
type PropertyCond struct {
	Key   string  `json:"key"`
	Value *string `json:"value"`
}

// FieldCond is a condition on the JSON field at Path (dotted). Exactly one
// of Exists, Equals, GT, LT is set.
type FieldCond struct {
	Path   string   `json:"path"`
	Exists *bool    `json:"exists"`
	Equals any      `json:"equals"`
	GT     *float64 `json:"gt"`
	LT     *float64 `json:"lt"`
}

func (c *Config) validate() error {
	var errs []error
	switch c.Match {
	case "", "all", "any":
	default:
		errs = append(errs, fmt.Errorf("match %q: want all or any", c.Match))
	}
	if len(c.UserProperties) == 0 && len(c.JSON) == 0 {
		errs = append(errs, errors.New("no condition: set user_properties or json"))
	}
	for i, p := range c.UserProperties {
		if p.Key == "" {
			errs = append(errs, fmt.Errorf("user_properties[%d].key is required", i))
		}
	}
	for i, f := range c.JSON {
		n := 0
		for _, set := range []bool{f.Exists != nil, f.Equals != nil, f.GT != nil, f.LT != nil} {
			if set {
				n++
			}
		}
		if f.Path == "" || n != 1 {
			errs = append(errs, fmt.Errorf("json[%d]: want a path and exactly one of exists, equals, gt, lt", i))
		}
	}
	return errors.Join(errs...)
}

// Filter is the transform. Use [New].
type Filter struct {
	mu  sync.RWMutex
	cfg Config
	ok  bool
}

// New returns an unconfigured filter.
func New() *Filter { return &Filter{} }

// Configure validates and applies the configuration.
func (f *Filter) Configure(_ context.Context, req *pluginv1.TransformServiceConfigureRequest) (*pluginv1.TransformServiceConfigureResponse, error) {
	var cfg Config
	if err := meta.DecodeConfig(req.GetConfigJson(), &cfg); err != nil {
		return nil, err
	}
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("filter config: %w", err)
	}
	f.mu.Lock()
	f.cfg, f.ok = cfg, true
	f.mu.Unlock()
	return &pluginv1.TransformServiceConfigureResponse{Info: &pluginv1.PluginInfo{Id: ID, Version: "1"}}, nil
}

// Transform keeps the records that match.
func (f *Filter) Transform(_ context.Context, req *pluginv1.TransformServiceTransformRequest) (*pluginv1.TransformServiceTransformResponse, error) {
	f.mu.RLock()
	cfg, ok := f.cfg, f.ok
	f.mu.RUnlock()
	if !ok {
		return nil, errors.New("filter: not configured")
	}
	out := make([]*pluginv1.Record, 0, len(req.GetRecords()))
	for _, r := range req.GetRecords() {
		if Match(&cfg, r) != cfg.Invert {
			out = append(out, r)
		}
	}
	return &pluginv1.TransformServiceTransformResponse{Records: out}, nil
}

// Match reports whether r meets cfg's conditions (before Invert).
func Match(cfg *Config, r *pluginv1.Record) bool {
	anyOf := cfg.Match == "any"
	var doc any
	var parsed, isJSON bool
	field := func(fc *FieldCond) bool {
		if !parsed {
			parsed = true
			isJSON = json.Unmarshal(r.GetMessage().GetPayload(), &doc) == nil
		}
		if !isJSON {
			return false
		}
		v, found := meta.Lookup(doc, fc.Path)
		switch {
		case fc.Exists != nil:
			return found == *fc.Exists
		case !found:
			return false
		case fc.Equals != nil:
			return equal(v, fc.Equals)
		case fc.GT != nil:
			n, ok := v.(float64)
			return ok && n > *fc.GT
		case fc.LT != nil:
			n, ok := v.(float64)
			return ok && n < *fc.LT
		}
		return false
	}
	for i := range cfg.UserProperties {
		if prop(r, &cfg.UserProperties[i]) == anyOf {
			return anyOf
		}
	}
	for i := range cfg.JSON {
		if field(&cfg.JSON[i]) == anyOf {
			return anyOf
		}
	}
	return !anyOf
}

func prop(r *pluginv1.Record, c *PropertyCond) bool {
	for _, up := range r.GetMessage().GetUserProperties() {
		if up.GetKey() == c.Key && (c.Value == nil || up.GetValue() == *c.Value) {
			return true
		}
	}
	return false
}

// equal compares a decoded JSON value with a configured one (both from
// encoding/json, so numbers are float64).
func equal(a, b any) bool { return reflect.DeepEqual(a, b) }
