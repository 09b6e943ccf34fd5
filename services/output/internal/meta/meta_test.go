package meta

import (
	"testing"

	"github.com/stretchr/testify/require"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
)

func TestAppendHeadersMatchesHeaders(t *testing.T) {
	full := &pluginv1.Record{
		Message: &commonv1.Message{
			Id:     &commonv1.MsgID{EdgeId: "edge-1", Incarnation: 7, Seq: 18446744073709551615},
			Tenant: "acme", Topic: "a/b", Payload: []byte("x"), Qos: 2, Retain: true,
			IngressUnixNano: 1234567890123456789, ClientId: "c1", ContentType: "application/json",
			ResponseTopic: "reply/a", CorrelationData: []byte{0, 1, 2}, PayloadFormat: 1,
			UserProperties: []*commonv1.UserProperty{{Key: "region", Value: "eu"}, {Key: "region", Value: "eu-2"}},
		},
		Headers: []*pluginv1.Header{{Key: "x-extra", Value: []byte("v")}},
	}
	bare := &pluginv1.Record{Message: &commonv1.Message{Tenant: "t", Topic: "x"}}
	for _, withUP := range []bool{true, false} {
		var hs []Header
		var arena []byte
		for _, r := range []*pluginv1.Record{full, bare, full} {
			n := len(hs)
			hs, arena = AppendHeaders(hs, arena, r, withUP)
			want := Headers(r, withUP)
			require.Len(t, hs[n:], len(want))
			for i, h := range want {
				require.Equal(t, h.Key, hs[n+i].Key)
				require.Equal(t, string(h.Value), string(hs[n+i].Value), h.Key)
			}
			nh, _ := HeadersSize(r, withUP)
			require.LessOrEqual(t, len(want), nh)
		}
	}
}
