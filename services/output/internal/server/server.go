// Package server is the output service's Connect API: edges stream batches
// of messages with Publish and get one acknowledgement per batch; Status
// reports the pipelines.
package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/libs/rpc"
	outputv1 "github.com/keelmq/keel/proto/gen/keel/output/v1"
	"github.com/keelmq/keel/proto/gen/keel/output/v1/outputv1connect"
	"github.com/keelmq/keel/services/output/internal/pipeline"
	"github.com/keelmq/keel/services/output/internal/wire"
)

// DefaultCreditBytes is the in-flight window granted to each edge stream.
const DefaultCreditBytes = 8 << 20

// validTenant reports whether s matches ^[a-z0-9-]{1,63}$ (by hand: this
// runs once per record).
func validTenant(s string) bool {
	if len(s) == 0 || len(s) > 63 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' {
			return false
		}
	}
	return true
}

// invalidLogInterval bounds how often refused records are logged.
const invalidLogInterval = 10 * time.Second

// Handler serves keel.output.v1.OutputService. Its Publish reads each
// batch with [wire.Codec], keeping the messages in wire form, so it is not
// the generated handler interface.
type Handler struct {
	host       *pipeline.Host
	memberID   string
	credit     uint64
	logger     *slog.Logger
	streams    atomic.Int32
	invalidLog logging.Every
}

// New returns the handler. credit is the window (payload bytes) each stream
// may have unacknowledged; 0 means [DefaultCreditBytes].
func New(host *pipeline.Host, memberID string, credit uint64, logger *slog.Logger) *Handler {
	if credit == 0 {
		credit = DefaultCreditBytes
	}
	return &Handler{host: host, memberID: memberID, credit: credit, logger: logger}
}

// Mount returns the path and handler to mount on a mux.
func (h *Handler) Mount() (string, http.Handler) {
	opts := connect.WithHandlerOptions(rpc.HandlerOptions(connect.WithCodec(wire.Codec))...)
	methods := outputv1.File_keel_output_v1_output_proto.Services().ByName("OutputService").Methods()
	publish := connect.NewBidiStreamHandler(outputv1connect.OutputServicePublishProcedure, h.Publish,
		connect.WithSchema(methods.ByName("Publish")), opts)
	status := connect.NewUnaryHandler(outputv1connect.OutputServiceStatusProcedure, h.Status,
		connect.WithSchema(methods.ByName("Status")), opts)
	return "/" + outputv1connect.OutputServiceName + "/", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case outputv1connect.OutputServicePublishProcedure:
			publish.ServeHTTP(w, r)
		case outputv1connect.OutputServiceStatusProcedure:
			status.ServeHTTP(w, r)
		default:
			http.NotFound(w, r)
		}
	})
}

// Streams is the number of open Publish streams.
func (h *Handler) Streams() int { return int(h.streams.Load()) }

// Publish takes batches into the pipelines' buffers and acknowledges each.
// It never waits on a sink: a record that does not fit is counted as dropped
// in the ack. Beside the acks it sends the rules' topic filters when the
// stream opens and after every reload that changes them, so that the edge
// leaves out the messages no rule matches.
func (h *Handler) Publish(ctx context.Context, stream *connect.BidiStream[wire.PublishBatch, outputv1.PublishResponse]) error {
	h.streams.Add(1)
	defer h.streams.Add(-1)
	var sendMu sync.Mutex // acks and filter sets come from two goroutines
	send := func(resp *outputv1.PublishResponse) error {
		sendMu.Lock()
		defer sendMu.Unlock()
		return stream.Send(resp)
	}
	// The filters go first, before anything is read, so that they are the
	// first response the edge sees: an edge takes a first response without
	// them for an instance that sends none.
	f := h.host.Filters()
	if err := stream.Send(h.filtersResponse(f)); err != nil {
		return err
	}
	fctx, stopFilters := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { h.sendFilters(fctx, f, send) })
	// The stream must not be used once Publish has returned.
	defer wg.Wait()
	defer stopFilters()
	var edge string
	for {
		req, err := stream.Receive()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			if ctx.Err() == nil {
				h.logger.Debug("publish stream ended", logging.KeyEdgeID, edge, logging.Err(err))
			}
			return err
		}
		if edge == "" && req.EdgeID != "" {
			edge = req.EdgeID
			h.logger.Info("edge connected", logging.KeyEdgeID, edge, "incarnation", req.Incarnation)
		}
		var accepted, dropped uint32
		for i := range req.Records {
			r := &req.Records[i]
			if reason, err := refusal(r); reason != "" {
				dropped++
				h.refused(edge, reason, err)
				continue
			}
			if _, refused := h.host.Offer(r.Record, r.Message, r.Pipelines); refused > 0 {
				dropped++
			} else {
				accepted++
			}
		}
		if err := send(&outputv1.PublishResponse{
			BatchId: req.BatchID, Accepted: accepted, Dropped: dropped, CreditBytes: h.credit,
		}); err != nil {
			return err
		}
	}
}

// refusal says why r cannot be taken (a metric label and the detail), or
// "" if it can.
func refusal(r *wire.Incoming) (string, error) {
	switch {
	case errors.Is(r.Err, wire.ErrNoMessage):
		return "no_message", r.Err
	case r.Err != nil:
		return "malformed", r.Err
	case !validTenant(r.Message.Tenant):
		return "bad_tenant", fmt.Errorf("invalid tenant %q", r.Message.Tenant)
	case r.Message.Topic == "":
		return "no_topic", errors.New("empty topic")
	}
	return "", nil
}

// refused counts a refused record and logs it, at most once per
// invalidLogInterval: a broken edge can send many.
func (h *Handler) refused(edge, reason string, err error) {
	h.host.Invalid(reason)
	if !h.invalidLog.Allow(invalidLogInterval) {
		return
	}
	h.logger.Warn("record refused", logging.KeyEdgeID, edge, logging.KeyReason, reason, logging.Err(err))
}

// sendFilters sends every filter set that replaces sent, the one the
// stream has, until ctx ends or a send fails (the receive loop then ends the
// stream). A set replaced before it was sent is skipped: each one replaces
// the previous whole.
func (h *Handler) sendFilters(ctx context.Context, sent *pipeline.Filters, send func(*outputv1.PublishResponse) error) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-sent.Changed:
		}
		sent = h.host.Filters()
		if err := send(h.filtersResponse(sent)); err != nil {
			return
		}
	}
}

// filtersResponse carries a filter set and acknowledges no batch.
func (h *Handler) filtersResponse(f *pipeline.Filters) *outputv1.PublishResponse {
	return &outputv1.PublishResponse{Filters: f.Proto, CreditBytes: h.credit}
}

// Status reports the pipelines.
func (h *Handler) Status(context.Context, *connect.Request[outputv1.StatusRequest]) (*connect.Response[outputv1.StatusResponse], error) {
	return connect.NewResponse(&outputv1.StatusResponse{
		MemberId: h.memberID, Pipelines: h.host.Status(), ConnectedEdges: uint32(h.streams.Load()),
	}), nil
}
