package server

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
)

func propsOf(m *commonv1.Message) *commonv1.Message {
	return &commonv1.Message{Tenant: m.GetTenant(), ClientId: m.GetClientId(), ContentType: m.GetContentType(),
		ResponseTopic: m.GetResponseTopic(), CorrelationData: m.GetCorrelationData(), UserProperties: m.GetUserProperties(),
		PayloadFormat: m.GetPayloadFormat(), MessageExpiryInterval: m.MessageExpiryInterval}
}

var propsFixtures = []*commonv1.Message{
	{},
	{Tenant: "acme", ClientId: "dev-1", Topic: "ignored", Payload: []byte("ignored")},
	{Tenant: "acme", ClientId: "ü", ContentType: "text/plain", ResponseTopic: "r/t", CorrelationData: []byte{0, 1},
		UserProperties: []*commonv1.UserProperty{{Key: "k", Value: "v"}, {Key: "k"}, {Value: "v"}, {}},
		PayloadFormat:  1, MessageExpiryInterval: proto.Uint32(0)},
	{MessageExpiryInterval: proto.Uint32(4294967295), PayloadFormat: 7},
}

// appendProps writes what proto.Marshal writes, and refuses what it
// refuses.
func TestAppendProps_IsProtoMarshal(t *testing.T) {
	for i, m := range propsFixtures {
		want, err := proto.Marshal(propsOf(m))
		require.NoError(t, err)
		got, ok := appendProps(nil, m)
		require.True(t, ok)
		require.Equal(t, string(want), string(got), "fixture %d", i)
	}
	bad := &commonv1.Message{UserProperties: []*commonv1.UserProperty{{Key: "\xff"}}}
	_, ok := appendProps(nil, bad)
	require.False(t, ok)
	_, err := proto.Marshal(propsOf(bad))
	require.Error(t, err)
}

func FuzzAppendProps(f *testing.F) {
	for _, m := range propsFixtures {
		b, _ := proto.Marshal(m)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var m commonv1.Message
		if proto.Unmarshal(b, &m) != nil {
			return
		}
		want, err := proto.Marshal(propsOf(&m))
		got, ok := appendProps(nil, &m)
		if err != nil {
			require.False(t, ok)
			return
		}
		require.True(t, ok)
		require.Equal(t, string(want), string(got))
	})
}
