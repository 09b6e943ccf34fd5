package jsonmap

import (
	"testing"

	"github.com/stretchr/testify/require"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
)

func msg(payload string) *pluginv1.Record {
	return &pluginv1.Record{Message: &commonv1.Message{
		Id: &commonv1.MsgID{EdgeId: "e", Incarnation: 1, Seq: 9}, Tenant: "acme", Topic: "plant/7/temp", ClientId: "dev-1",
		Qos: 1, Payload: []byte(payload), UserProperties: []*commonv1.UserProperty{{Key: "site", Value: "lyon"}},
	}}
}

func run(t *testing.T, cfg string, recs ...*pluginv1.Record) []*pluginv1.Record {
	t.Helper()
	m := New()
	_, err := m.Configure(t.Context(), &pluginv1.TransformServiceConfigureRequest{ConfigJson: []byte(cfg)})
	require.NoError(t, err)
	resp, err := m.Transform(t.Context(), &pluginv1.TransformServiceTransformRequest{Records: recs})
	require.NoError(t, err)
	return resp.GetRecords()
}

func TestMap_Fields(t *testing.T) {
	t.Parallel()
	out := run(t, `{"fields":{"device.id":"client_id","device.site":"user_properties.site","temp":"payload.r.t","plant":"topic_level.1","id":"msg_id","src":"=mqtt","missing":"payload.nope"},"key":"payload.r.sensor","destination":"=temps"}`,
		msg(`{"r":{"t":21.5,"sensor":"s-4"}}`))
	require.Len(t, out, 1)
	require.JSONEq(t, `{"device":{"id":"dev-1","site":"lyon"},"temp":21.5,"plant":"7","id":"e:1:9","src":"mqtt","missing":null}`, string(out[0].GetMessage().GetPayload()))
	require.Equal(t, "s-4", string(out[0].GetKey()))
	require.Equal(t, "temps", out[0].GetDestination())
	require.Equal(t, "application/json", out[0].GetMessage().GetContentType())
	require.Equal(t, "plant/7/temp", out[0].GetMessage().GetTopic())
}

func TestMap_Template(t *testing.T) {
	t.Parallel()
	out := run(t, `{"template":"{\"t\":{{json .Topic}},\"v\":{{json .Payload.v}},\"site\":{{json (index .UserProperties \"site\")}}}"}`, msg(`{"v":[1,2]}`))
	require.JSONEq(t, `{"t":"plant/7/temp","v":[1,2],"site":"lyon"}`, string(out[0].GetMessage().GetPayload()))
}

func TestMap_DropInvalid(t *testing.T) {
	t.Parallel()
	out := run(t, `{"fields":{"x":"payload"},"drop_invalid":true}`, msg(`nope`), msg(`1`))
	require.Len(t, out, 1)
	require.JSONEq(t, `{"x":1}`, string(out[0].GetMessage().GetPayload()))
}

func TestMap_Configure_Invalid(t *testing.T) {
	t.Parallel()
	for _, cfg := range []string{`{}`, `{"fields":{"a":"bogus"}}`, `{"template":"{{"}`, `{"fields":{"a":"topic"},"template":"x"}`} {
		_, err := New().Configure(t.Context(), &pluginv1.TransformServiceConfigureRequest{ConfigJson: []byte(cfg)})
		require.Error(t, err, cfg)
	}
}
