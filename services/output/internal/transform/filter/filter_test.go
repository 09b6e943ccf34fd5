package filter

import (
	"testing"

	"github.com/stretchr/testify/require"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
)

func rec(payload string, props ...string) *pluginv1.Record {
	m := &commonv1.Message{Tenant: "a", Topic: "t", Payload: []byte(payload)}
	for i := 0; i+1 < len(props); i += 2 {
		m.UserProperties = append(m.UserProperties, &commonv1.UserProperty{Key: props[i], Value: props[i+1]})
	}
	return &pluginv1.Record{Message: m}
}

func TestFilter_Transform(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		config string
		recs   []*pluginv1.Record
		keep   []int
	}{
		{"property_value", `{"user_properties":[{"key":"region","value":"eu"}]}`,
			[]*pluginv1.Record{rec("{}", "region", "us", "region", "eu"), rec("{}", "region", "us"), rec("{}")}, []int{0}},
		{"property_exists", `{"user_properties":[{"key":"region"}]}`,
			[]*pluginv1.Record{rec("{}", "region", "us"), rec("{}", "x", "y")}, []int{0}},
		{"json_equals_and_gt", `{"json":[{"path":"kind","equals":"temp"},{"path":"v.0","gt":20}]}`,
			[]*pluginv1.Record{rec(`{"kind":"temp","v":[21]}`), rec(`{"kind":"temp","v":[19]}`), rec(`{"kind":"hum","v":[30]}`), rec(`not json`)}, []int{0}},
		{"any", `{"match":"any","json":[{"path":"a","exists":true}],"user_properties":[{"key":"p"}]}`,
			[]*pluginv1.Record{rec(`{"a":1}`), rec(`{}`, "p", ""), rec(`{}`)}, []int{0, 1}},
		{"invert", `{"invert":true,"json":[{"path":"debug","equals":true}]}`,
			[]*pluginv1.Record{rec(`{"debug":true}`), rec(`{"debug":false}`), rec(`x`)}, []int{1, 2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := New()
			_, err := f.Configure(t.Context(), &pluginv1.TransformServiceConfigureRequest{ConfigJson: []byte(tc.config)})
			require.NoError(t, err)
			resp, err := f.Transform(t.Context(), &pluginv1.TransformServiceTransformRequest{Records: tc.recs})
			require.NoError(t, err)
			var want []*pluginv1.Record
			for _, i := range tc.keep {
				want = append(want, tc.recs[i])
			}
			require.Equal(t, len(want), len(resp.GetRecords()))
			for i := range want {
				require.Same(t, want[i], resp.GetRecords()[i])
			}
		})
	}
}

func TestFilter_Configure_Invalid(t *testing.T) {
	t.Parallel()
	for _, cfg := range []string{`{}`, `{"match":"some","json":[{"path":"a","exists":true}]}`, `{"json":[{"path":"a"}]}`, `{"unknown":1}`, `{"user_properties":[{}]}`} {
		_, err := New().Configure(t.Context(), &pluginv1.TransformServiceConfigureRequest{ConfigJson: []byte(cfg)})
		require.Error(t, err, cfg)
	}
}
