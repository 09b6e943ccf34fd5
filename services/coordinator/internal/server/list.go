package server

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"

	"connectrpc.com/connect"

	"github.com/keelmq/keel/services/coordinator/internal/fsm"
	"github.com/keelmq/keel/services/coordinator/internal/raftpb"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
)

const (
	// defaultListPageSize is the page size of a ListSessions call that asks
	// for none.
	defaultListPageSize = 100
	// maxListPageSize caps the page size a ListSessions call may ask for.
	maxListPageSize = 1000
	// listScanBudget bounds the records one ListSessions call looks at when
	// the filters cannot seek (a client ID prefix without a tenant): the page
	// may then end short, with a token to continue.
	listScanBudget = 100_000
	// pageTokenVersion is the first byte of every page token.
	pageTokenVersion = 1
)

// ListSessions implements the RPC: one page of ownership records, read from
// one state of the FSM (linearizable on the leader unless allow_stale).
func (s *Server) ListSessions(ctx context.Context, req *connect.Request[coordinatorv1.ListSessionsRequest]) (*connect.Response[coordinatorv1.ListSessionsResponse], error) {
	m := req.Msg
	q := fsm.SessionScan{Tenant: m.GetTenant(), Owner: m.GetOwnerEdgeId(), ClientIDPrefix: m.GetClientIdPrefix()}
	if q.Tenant != "" && !fsm.ValidTenant(q.Tenant) {
		return nil, invalid("tenant %q: want [a-z0-9-]{1,63}, or empty for every tenant", truncateForError(q.Tenant))
	}
	if q.Owner != "" {
		if err := fsm.CheckMemberID(q.Owner); err != nil {
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("owner_edge_id: %w", err))
		}
	}
	if len(q.ClientIDPrefix) > fsm.MaxClientIDLen {
		return nil, invalid("client_id_prefix is %d bytes, longer than the longest client ID (%d)", len(q.ClientIDPrefix), fsm.MaxClientIDLen)
	}
	if q.ClientIDPrefix != "" {
		if err := fsm.CheckSession("default", q.ClientIDPrefix); err != nil {
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("client_id_prefix: %w", err))
		}
	}
	if tok := m.GetPageToken(); tok != "" {
		tenant, client, err := decodePageToken(tok)
		if err != nil {
			return nil, invalid("page_token: %v; pass the next_page_token of the previous page unchanged", err)
		}
		if q.Tenant != "" && tenant != q.Tenant {
			return nil, invalid("page_token continues a listing of tenant %q, not of %q; keep the filters of the first page", tenant, q.Tenant)
		}
		q.AfterTenant, q.AfterClientID = tenant, client
	}
	size := int(m.GetPageSize())
	if size == 0 {
		size = defaultListPageSize
	}
	size = min(size, maxListPageSize)
	if !m.GetAllowStale() {
		if !s.node.IsLeader() {
			return forward(ctx, s, req, client.ListSessions)
		}
		if err := s.linearizable(ctx); err != nil {
			return nil, err
		}
	}
	st := s.fsm.State()
	resp := &coordinatorv1.ListSessionsResponse{Index: st.Index()}
	var last *raftpb.SessionRecord // the last record looked at
	looked, more := 0, false
	st.ScanSessions(q, func(rec *raftpb.SessionRecord, match bool) bool {
		if match && len(resp.Sessions) == size {
			more = true // one more record matches: the listing goes on
			return false
		}
		if looked == listScanBudget {
			more = true // the budget ran out first: continue after the last one looked at
			return false
		}
		looked++
		last = rec
		if match {
			resp.Sessions = append(resp.Sessions, toSessionRecord(rec))
		}
		return true
	})
	if more {
		resp.NextPageToken = encodePageToken(last.GetTenant(), last.GetClientId())
	}
	return connect.NewResponse(resp), nil
}

// encodePageToken makes the token that continues a listing after the
// session (tenant, client ID): a version byte, the tenant with a one-byte
// length, the client ID, in unpadded URL-safe base64.
func encodePageToken(tenant, clientID string) string {
	b := make([]byte, 0, 2+len(tenant)+len(clientID))
	b = append(b, pageTokenVersion, byte(len(tenant)))
	b = append(b, tenant...)
	b = append(b, clientID...)
	return base64.RawURLEncoding.EncodeToString(b)
}

// decodePageToken reads a token made by encodePageToken, checking the
// session it names as a request naming it would be checked.
func decodePageToken(tok string) (tenant, clientID string, err error) {
	const maxLen = 2 + fsm.MaxTenantLen + fsm.MaxClientIDLen
	if base64.RawURLEncoding.DecodedLen(len(tok)) > maxLen {
		return "", "", errors.New("too long")
	}
	b, err := base64.RawURLEncoding.DecodeString(tok)
	if err != nil {
		return "", "", errors.New("not a page token (bad encoding)")
	}
	if len(b) < 2 || b[0] != pageTokenVersion || 2+int(b[1]) > len(b) {
		return "", "", errors.New("not a page token")
	}
	n := int(b[1])
	tenant, clientID = string(b[2:2+n]), string(b[2+n:])
	if err := fsm.CheckSession(tenant, clientID); err != nil {
		return "", "", errors.New("not a page token (names no valid session)")
	}
	return tenant, clientID, nil
}
