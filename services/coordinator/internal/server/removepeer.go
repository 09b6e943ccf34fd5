package server

import (
	"context"
	"fmt"

	"connectrpc.com/connect"
	"github.com/hashicorp/raft"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/services/coordinator/internal/fsm"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
)

// RemovePeer implements the RPC: it removes a server from the Raft
// configuration on the leader (a follower forwards the call). Removing
// the leader itself makes it step down once the change is committed.
func (s *Server) RemovePeer(ctx context.Context, req *connect.Request[coordinatorv1.RemovePeerRequest]) (*connect.Response[coordinatorv1.RemovePeerResponse], error) {
	id := req.Msg.GetNodeId()
	if err := fsm.CheckMemberID(id); err != nil {
		return nil, invalid("node id %q", truncateForError(id))
	}
	if !s.node.IsLeader() {
		return forward(ctx, s, req, client.RemovePeer)
	}
	servers, err := s.node.Servers()
	if err != nil {
		return nil, s.toConnect(err)
	}
	found := false
	for _, sv := range servers {
		found = found || string(sv.ID) == id
	}
	if !found {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("node %q is not in the raft configuration", truncateForError(id)))
	}
	if err := s.node.RemoveServer(id); err != nil {
		return nil, s.toConnect(err)
	}
	s.logger.Info("removed raft peer on request", "node_id", id)
	resp := &coordinatorv1.RemovePeerResponse{}
	servers, err = s.node.Servers()
	if err != nil {
		// The removal is committed; only the report of what is left failed.
		s.logger.Warn("cannot read raft configuration", logging.Err(err))
		return connect.NewResponse(resp), nil
	}
	for _, sv := range servers {
		resp.Peers = append(resp.Peers, &coordinatorv1.RaftPeer{NodeId: string(sv.ID), Address: string(sv.Address),
			Voter: sv.Suffrage == raft.Voter})
	}
	return connect.NewResponse(resp), nil
}
