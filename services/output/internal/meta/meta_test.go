package meta

import (
	"strings"
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
			UserProperties: []*commonv1.UserProperty{
				{Key: "region", Value: "eu"}, {Key: "region", Value: "eu-2"}, {Key: "keel-tenant", Value: "forged"},
			},
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

// keelHeaders are the names of every header Keel sets itself.
var keelHeaders = []string{
	HeaderTenant, HeaderTopic, HeaderClientID, HeaderMsgID, HeaderQoS, HeaderRetain, HeaderIngress,
	HeaderContentType, HeaderResponseTopic, HeaderCorrelationData, HeaderPayloadFormat,
}

func TestKeelHeaderNames(t *testing.T) {
	for _, k := range keelHeaders {
		require.True(t, strings.HasPrefix(k, HeaderPrefix), k)
		require.False(t, strings.HasPrefix(k, UserPropertyPrefix), k)
	}
	require.True(t, strings.HasPrefix(UserPropertyPrefix, HeaderPrefix))
}

func TestUserPropertyHeader(t *testing.T) {
	for key, want := range map[string]string{
		"region":                   "region",
		"":                         "",
		"keel":                     "keel",
		"keel_tenant":              "keel_tenant",
		"x-keel-tenant":            "x-keel-tenant",
		"keel-":                    "keel-user-property-keel-",
		"keel-tenant":              "keel-user-property-keel-tenant",
		"KEEL-Tenant":              "keel-user-property-KEEL-Tenant",
		"Keel-msg-id":              "keel-user-property-Keel-msg-id",
		"\u212Aeel-tenant":         "keel-user-property-\u212Aeel-tenant", // Kelvin sign folds to k
		"keel-user-property-x":     "keel-user-property-keel-user-property-x",
		"keel-user-property-keel-": "keel-user-property-keel-user-property-keel-",
	} {
		require.Equal(t, want, UserPropertyHeader(key), key)
	}
}

// TestForgedTenant: a publisher's user property named like Keel's tenant
// header must not yield a second keel-tenant header, in any case.
func TestForgedTenant(t *testing.T) {
	r := &pluginv1.Record{Message: &commonv1.Message{
		Tenant: "acme", Topic: "a/b",
		UserProperties: []*commonv1.UserProperty{
			{Key: "keel-tenant", Value: "victim"}, {Key: "Keel-Tenant", Value: "victim2"}, {Key: "region", Value: "eu"},
		},
	}}
	check := func(t *testing.T, keys []string, values []string) {
		t.Helper()
		var tenants []string
		byKey := map[string]string{}
		for i, k := range keys {
			if strings.EqualFold(k, HeaderTenant) {
				tenants = append(tenants, values[i])
			}
			byKey[k] = values[i]
		}
		require.Equal(t, []string{"acme"}, tenants)
		require.Equal(t, "victim", byKey["keel-user-property-keel-tenant"])
		require.Equal(t, "victim2", byKey["keel-user-property-Keel-Tenant"])
		require.Equal(t, "eu", byKey["region"])
	}
	t.Run("Headers", func(t *testing.T) {
		var keys, values []string
		for _, h := range Headers(r, true) {
			keys, values = append(keys, h.Key), append(values, string(h.Value))
		}
		check(t, keys, values)
	})
	t.Run("AppendHeaders", func(t *testing.T) {
		hs, _ := AppendHeaders[Header](nil, nil, r, true)
		var keys, values []string
		for _, h := range hs {
			keys, values = append(keys, h.Key), append(values, string(h.Value))
		}
		check(t, keys, values)
	})
}

// TestAppendHeadersAllocs: with room enough (as HeadersSize says), building
// the headers, prefixed user property keys included, allocates nothing.
func TestAppendHeadersAllocs(t *testing.T) {
	r := &pluginv1.Record{
		Message: &commonv1.Message{
			Id:     &commonv1.MsgID{EdgeId: "edge-1", Incarnation: 7, Seq: 42},
			Tenant: "acme", Topic: "a/b", Qos: 1, IngressUnixNano: 1234567890123456789, ClientId: "c1",
			ContentType: "text/plain", ResponseTopic: "reply/a", CorrelationData: []byte{1}, PayloadFormat: 1,
			UserProperties: []*commonv1.UserProperty{{Key: "region", Value: "eu"}, {Key: "site", Value: "x"}},
		},
		Headers: []*pluginv1.Header{{Key: "x-extra", Value: []byte("v")}},
	}
	nh, nb := HeadersSize(r, true)
	hs := make([]Header, 0, nh)
	arena := make([]byte, 0, nb)
	allocs := testing.AllocsPerRun(100, func() {
		out, a := AppendHeaders(hs[:0], arena[:0], r, true)
		if len(out) > nh || len(a) > nb {
			t.Fatalf("HeadersSize (%d, %d) below what AppendHeaders used (%d, %d)", nh, nb, len(out), len(a))
		}
	})
	require.Zero(t, allocs)
}

func BenchmarkAppendHeaders(b *testing.B) {
	r := &pluginv1.Record{Message: &commonv1.Message{
		Id:     &commonv1.MsgID{EdgeId: "edge-1", Incarnation: 7, Seq: 42},
		Tenant: "acme", Topic: "sensors/01/data", Qos: 1, IngressUnixNano: 1234567890123456789, ClientId: "c1",
		UserProperties: []*commonv1.UserProperty{{Key: "region", Value: "eu"}, {Key: "site", Value: "x"}},
	}}
	nh, nb := HeadersSize(r, true)
	hs := make([]Header, 0, nh)
	arena := make([]byte, 0, nb)
	b.ReportAllocs()
	for b.Loop() {
		hs, arena = AppendHeaders(hs[:0], arena[:0], r, true)
	}
}
