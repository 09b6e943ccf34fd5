package fsm

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/coordinator/internal/raftpb"
)

// ScanSessions visits exactly the records a filter selects, in key order,
// through the records or the owner index, and continues after any point,
// whether or not a session exists there.
func TestState_ScanSessions(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.join("e1", 1)
	h.join("e11", 1) // "e1" must not select e11's sessions
	type sess struct{ tenant, client, owner string }
	var all []sess
	for i, tenant := range []string{"acme", "ac", "b", "acme-2"} {
		for j, client := range []string{"dev-1", "dev-10", "dev-2", "d", "sensor", "dev-1/x", ""} {
			if client == "" {
				continue
			}
			owner := "e1"
			if (i+j)%3 == 0 {
				owner = "e11"
			}
			h.claim(claim(owner, 1, tenant, client, ""))
			all = append(all, sess{tenant, client, owner})
		}
	}
	st := h.f.State()
	require.Equal(t, len(all), st.SessionCount())

	scan := func(q SessionScan) (got []string, visited int) {
		st.ScanSessions(q, func(rec *raftpb.SessionRecord, match bool) bool {
			visited++
			if match {
				got = append(got, rec.GetTenant()+"/"+rec.GetClientId()+"@"+rec.GetOwnerEdgeId())
			}
			return true
		})
		return got, visited
	}
	// want is the brute-force answer, in the documented order.
	want := func(q SessionScan) []string {
		var out []sess
		for _, s := range all {
			if (q.Tenant == "" || s.tenant == q.Tenant) && (q.Owner == "" || s.owner == q.Owner) &&
				strings.HasPrefix(s.client, q.ClientIDPrefix) {
				out = append(out, s)
			}
		}
		slices.SortFunc(out, func(a, b sess) int {
			if c := len(a.tenant) - len(b.tenant); c != 0 {
				return c
			}
			return strings.Compare(a.tenant+"\x00"+a.client, b.tenant+"\x00"+b.client)
		})
		var ids []string
		for _, s := range out {
			if q.AfterTenant != "" {
				if len(s.tenant) < len(q.AfterTenant) || (len(s.tenant) == len(q.AfterTenant) &&
					(s.tenant < q.AfterTenant || (s.tenant == q.AfterTenant && s.client <= q.AfterClientID))) {
					continue
				}
			}
			ids = append(ids, s.tenant+"/"+s.client+"@"+s.owner)
		}
		return ids
	}
	for _, q := range []SessionScan{
		{},
		{Tenant: "acme"},
		{Tenant: "ac"},
		{Tenant: "nobody"},
		{Owner: "e1"},
		{Owner: "e11"},
		{Owner: "e2"},
		{Tenant: "acme", ClientIDPrefix: "dev-1"},
		{Tenant: "acme", Owner: "e1", ClientIDPrefix: "dev-"},
		{ClientIDPrefix: "dev-1"},
		{Owner: "e11", ClientIDPrefix: "s"},
		{AfterTenant: "acme", AfterClientID: "dev-1"},
		{AfterTenant: "acme", AfterClientID: "dev-0"}, // no such session
		{AfterTenant: "b", AfterClientID: "zzz"},
		{Tenant: "acme", AfterTenant: "acme", AfterClientID: "dev-10"},
		{Tenant: "acme", ClientIDPrefix: "dev-1", AfterTenant: "acme", AfterClientID: "dev-1"},
		{Tenant: "acme", ClientIDPrefix: "dev", AfterTenant: "ac", AfterClientID: "sensor"}, // before the range
		{Tenant: "ac", AfterTenant: "acme", AfterClientID: "d"},                             // past the range
		{Owner: "e1", AfterTenant: "acme", AfterClientID: "dev-2"},
	} {
		t.Run(fmt.Sprintf("%+v", q), func(t *testing.T) {
			got, visited := scan(q)
			require.Equal(t, want(q), got)
			if q.Tenant != "" {
				require.Len(t, got, visited, "with a tenant, the scan seeks to the prefix and looks at nothing else")
			}
		})
	}

	// Stopping early, then continuing after the last record seen, visits
	// everything once.
	var pages [][]string
	q := SessionScan{Owner: "e1"}
	for {
		var page []string
		var last *raftpb.SessionRecord
		st.ScanSessions(q, func(rec *raftpb.SessionRecord, _ bool) bool {
			page = append(page, rec.GetTenant()+"/"+rec.GetClientId()+"@"+rec.GetOwnerEdgeId())
			last = rec
			return len(page) < 4
		})
		if len(page) == 0 {
			break
		}
		pages = append(pages, page)
		q.AfterTenant, q.AfterClientID = last.GetTenant(), last.GetClientId()
	}
	require.Equal(t, want(SessionScan{Owner: "e1"}), slices.Concat(pages...))
	require.Greater(t, len(pages), 2)
}
