// Package jsonmap is the "json-map" transform plugin: it rewrites each
// record's payload as a new JSON document, built either from a field mapping
// (output field → source) or from a Go text/template, and can set the record
// key and destination from the message.
package jsonmap

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"text/template"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
	"github.com/keelmq/keel/services/output/internal/meta"
)

// ID is the plugin ID.
const ID = "json-map"

// Config is the plugin's configuration. Sources name what a field takes:
// "payload" (the whole decoded payload), "payload.<path>", "topic",
// "tenant", "client_id", "msg_id", "qos", "retain", "ingress_unix_nano",
// "user_properties.<key>" (first value), "topic_level.<n>" (0-based), or a
// literal written "=text".
type Config struct {
	// Fields maps output fields (dotted for nesting) to sources.
	Fields map[string]string `json:"fields"`
	// Template, instead of Fields, renders the payload with text/template
	// over [TemplateData]; the func json encodes a value.
	Template string `json:"template"`
	// Key, when set, is the source of the record key.
	Key string `json:"key"`
	// Destination, when set, is the source of the record destination.
	Destination string `json:"destination"`
	// DropInvalid drops records whose payload is not JSON when a payload
	// source is used; otherwise such a field is null.
	DropInvalid bool `json:"drop_invalid"`
}

// TemplateData is what a template sees.
type TemplateData struct {
	Tenant, Topic, ClientID, MsgID string
	QoS                            uint32
	Retain                         bool
	IngressUnixNano                int64
	Payload                        any    // decoded JSON, or nil
	Raw                            string // payload as text
	UserProperties                 map[string]string
}

// Map is the transform. Use [New].
type Map struct {
	mu  sync.RWMutex
	cfg Config
	tpl *template.Template
	ok  bool
}

// New returns an unconfigured transform.
func New() *Map { return &Map{} }

// Configure validates and applies the configuration.
func (m *Map) Configure(_ context.Context, req *pluginv1.TransformServiceConfigureRequest) (*pluginv1.TransformServiceConfigureResponse, error) {
	var cfg Config
	if err := meta.DecodeConfig(req.GetConfigJson(), &cfg); err != nil {
		return nil, err
	}
	if (len(cfg.Fields) == 0) == (cfg.Template == "") {
		return nil, errors.New("json-map config: set exactly one of fields and template")
	}
	var errs []error
	check := func(what, src string) {
		if src != "" && !validSource(src) {
			errs = append(errs, fmt.Errorf("%s: unknown source %q", what, src))
		}
	}
	for k, src := range cfg.Fields {
		check("fields."+k, src)
	}
	check("key", cfg.Key)
	check("destination", cfg.Destination)
	var tpl *template.Template
	if cfg.Template != "" {
		t, err := template.New("payload").Option("missingkey=zero").Funcs(template.FuncMap{"json": toJSON}).Parse(cfg.Template)
		if err != nil {
			errs = append(errs, fmt.Errorf("template: %w", err))
		}
		tpl = t
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("json-map config: %w", err)
	}
	m.mu.Lock()
	m.cfg, m.tpl, m.ok = cfg, tpl, true
	m.mu.Unlock()
	return &pluginv1.TransformServiceConfigureResponse{Info: &pluginv1.PluginInfo{Id: ID, Version: "1"}}, nil
}

func toJSON(v any) (string, error) {
	b, err := json.Marshal(v)
	return string(b), err
}

func validSource(src string) bool {
	switch src {
	case "payload", "topic", "tenant", "client_id", "msg_id", "qos", "retain", "ingress_unix_nano":
		return true
	}
	for _, p := range []string{"payload.", "user_properties.", "topic_level.", "="} {
		if strings.HasPrefix(src, p) {
			return true
		}
	}
	return false
}

// Transform rewrites the batch.
func (m *Map) Transform(_ context.Context, req *pluginv1.TransformServiceTransformRequest) (*pluginv1.TransformServiceTransformResponse, error) {
	m.mu.RLock()
	cfg, tpl, ok := m.cfg, m.tpl, m.ok
	m.mu.RUnlock()
	if !ok {
		return nil, errors.New("json-map: not configured")
	}
	out := make([]*pluginv1.Record, 0, len(req.GetRecords()))
	var buf bytes.Buffer
	for _, r := range req.GetRecords() {
		msg := r.GetMessage()
		var doc any
		isJSON := json.Unmarshal(msg.GetPayload(), &doc) == nil
		if !isJSON && cfg.DropInvalid {
			continue
		}
		var payload []byte
		if tpl != nil {
			buf.Reset()
			if err := tpl.Execute(&buf, templateData(msg, doc)); err != nil {
				return nil, fmt.Errorf("json-map template: %w", err)
			}
			payload = bytes.Clone(buf.Bytes())
		} else {
			obj := map[string]any{}
			for field, src := range cfg.Fields {
				v, _ := source(msg, doc, src)
				set(obj, field, v)
			}
			b, err := json.Marshal(obj)
			if err != nil {
				return nil, fmt.Errorf("json-map encode: %w", err)
			}
			payload = b
		}
		nm := cloneMessage(msg)
		nm.Payload = payload
		nm.ContentType = "application/json"
		nr := &pluginv1.Record{Message: nm, Destination: r.GetDestination(), Key: r.GetKey(), Headers: r.GetHeaders()}
		if cfg.Key != "" {
			if v, ok := source(msg, doc, cfg.Key); ok {
				nr.Key = []byte(text(v))
			}
		}
		if cfg.Destination != "" {
			if v, ok := source(msg, doc, cfg.Destination); ok {
				nr.Destination = text(v)
			}
		}
		out = append(out, nr)
	}
	return &pluginv1.TransformServiceTransformResponse{Records: out}, nil
}

func cloneMessage(m *commonv1.Message) *commonv1.Message {
	c := &commonv1.Message{
		Id: m.GetId(), Tenant: m.GetTenant(), Topic: m.GetTopic(), Qos: m.GetQos(), Retain: m.GetRetain(),
		IngressUnixNano: m.GetIngressUnixNano(), ClientId: m.GetClientId(), ResponseTopic: m.GetResponseTopic(),
		CorrelationData: m.GetCorrelationData(), UserProperties: m.GetUserProperties(), PayloadFormat: 1,
		MessageExpiryInterval: m.MessageExpiryInterval,
	}
	return c
}

func text(v any) string {
	if s, ok := v.(string); ok {
		return s
	}
	b, _ := json.Marshal(v)
	return string(b)
}

func templateData(m *commonv1.Message, doc any) *TemplateData {
	d := &TemplateData{
		Tenant: m.GetTenant(), Topic: m.GetTopic(), ClientID: m.GetClientId(), MsgID: meta.MsgID(m.GetId()),
		QoS: m.GetQos(), Retain: m.GetRetain(), IngressUnixNano: m.GetIngressUnixNano(), Payload: doc,
		Raw: string(m.GetPayload()), UserProperties: map[string]string{},
	}
	for _, up := range m.GetUserProperties() {
		if _, dup := d.UserProperties[up.GetKey()]; !dup {
			d.UserProperties[up.GetKey()] = up.GetValue()
		}
	}
	return d
}

// source resolves one source against a message and its decoded payload.
func source(m *commonv1.Message, doc any, src string) (any, bool) {
	switch src {
	case "payload":
		return doc, doc != nil
	case "topic":
		return m.GetTopic(), true
	case "tenant":
		return m.GetTenant(), true
	case "client_id":
		return m.GetClientId(), true
	case "msg_id":
		return meta.MsgID(m.GetId()), true
	case "qos":
		return m.GetQos(), true
	case "retain":
		return m.GetRetain(), true
	case "ingress_unix_nano":
		return m.GetIngressUnixNano(), true
	}
	switch {
	case strings.HasPrefix(src, "="):
		return src[1:], true
	case strings.HasPrefix(src, "payload."):
		return meta.Lookup(doc, strings.TrimPrefix(src, "payload."))
	case strings.HasPrefix(src, "user_properties."):
		key := strings.TrimPrefix(src, "user_properties.")
		for _, up := range m.GetUserProperties() {
			if up.GetKey() == key {
				return up.GetValue(), true
			}
		}
	case strings.HasPrefix(src, "topic_level."):
		levels := strings.Split(m.GetTopic(), "/")
		var n int
		if _, err := fmt.Sscan(strings.TrimPrefix(src, "topic_level."), &n); err == nil && n >= 0 && n < len(levels) {
			return levels[n], true
		}
	}
	return nil, false
}

// set stores v at a dotted path in obj, creating nested objects.
func set(obj map[string]any, path string, v any) {
	parts := strings.Split(path, ".")
	for _, p := range parts[:len(parts)-1] {
		next, ok := obj[p].(map[string]any)
		if !ok {
			next = map[string]any{}
			obj[p] = next
		}
		obj = next
	}
	obj[parts[len(parts)-1]] = v
}
