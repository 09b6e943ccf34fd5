package server

import (
	"context"

	"connectrpc.com/connect"

	"github.com/keelmq/keel/services/coordinator/internal/fsm"
	"github.com/keelmq/keel/services/coordinator/internal/raftpb"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
)

// BumpAclVersion implements the RPC: one Raft entry whose index becomes the
// tenant's ACL version. Every node's watch hub streams it to its watchers
// as an acl_version event once applied. A retried call bumps again, which
// only makes the edges reload once more.
func (s *Server) BumpAclVersion(ctx context.Context, req *connect.Request[coordinatorv1.BumpAclVersionRequest]) (*connect.Response[coordinatorv1.BumpAclVersionResponse], error) {
	tenant := req.Msg.GetTenant()
	if tenant != "" && !fsm.ValidTenant(tenant) {
		return nil, invalid("tenant %q: want [a-z0-9-]{1,63}, or empty for the cluster-wide rules", truncateForError(tenant))
	}
	if !s.node.IsLeader() {
		return forward(ctx, s, req, client.BumpAclVersion)
	}
	msg, _, err := s.apply(ctx, fsm.CmdBumpAclVersion, &raftpb.BumpAclVersionCommand{NowUnixNano: s.now().UnixNano(), Tenant: tenant})
	if err != nil {
		return nil, s.toConnect(err)
	}
	v := msg.(*raftpb.BumpAclVersionResult).GetAclVersion()
	s.logger.Info("acl version bumped", "tenant", v.GetTenant(), "version", v.GetVersion())
	return connect.NewResponse(&coordinatorv1.BumpAclVersionResponse{Version: v.GetVersion()}), nil
}

// truncateForError bounds a client-supplied string quoted in an error or
// a log line.
func truncateForError(s string) string {
	const maxLen = 64
	if len(s) > maxLen {
		return s[:maxLen] + "..."
	}
	return s
}
