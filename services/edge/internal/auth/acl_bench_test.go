package auth

import "testing"

// BenchmarkRules_CanPublish is one publish ACL evaluation without the
// edge's per-connection cache: 20 patterns with placeholders and wildcards
// (the set BenchmarkBroker_PublishACL uses), the topic matching the 16th,
// or none.
func BenchmarkRules_CanPublish(b *testing.B) {
	patterns := []string{
		"devices/%u/telemetry/#", "devices/%u/state", "devices/%u/events/+", "devices/%c/status",
		"fleet/+/devices/%u/#", "tenants/%t/broadcast/+", "cmd/%u/+/response", "alerts/%u/+",
		"sensors/%u/+/humidity", "logs/%c/#", "metrics/%u/+/+/gauge", "firmware/%u/report",
		"config/%u/ack", "gateways/+/devices/%u/#", "site/+/zone/+/%u/presence",
		"bench/%u/+/temperature",
		"bench/%u/+/pressure", "shadow/%u/update", "jobs/%c/+/status", "audit/%u/#",
	}
	r := (&ACL{Publish: patterns, Subscribe: patterns}).Bind("acme", "ruled", "pub-0")
	for _, tc := range []struct{ name, topic string }{
		{"match=16th", "bench/ruled/room-0-1/temperature"},
		{"match=none", "bench/other/room-0-1/temperature"},
	} {
		b.Run(tc.name, func(b *testing.B) {
			want := tc.name == "match=16th"
			for b.Loop() {
				if r.CanPublish(tc.topic) != want {
					b.Fatalf("CanPublish(%q) != %v", tc.topic, want)
				}
			}
		})
	}
}
