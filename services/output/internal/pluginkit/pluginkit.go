// Package pluginkit is the contract between the output service (host) and its
// pipeline plugins: the shared [Handshake], the go-plugin plugin types
// [SinkPlugin] and [TransformPlugin] (gRPC only), the interfaces [Sink] and
// [Transform] that both a plugin implementation and the host-side client
// satisfy, and [ServeSink] / [ServeTransform] for a plugin's main.
//
// The wire contract is keel.output.plugin.v1 (proto/keel/output/plugin/v1).
// proto/ generates Connect code only, so the gRPC service descriptors are
// registered by hand in grpc.go from the generated message types; they are
// a few lines per RPC and keep proto/ free of a grpc-go dependency.
package pluginkit

import (
	"context"
	"log/slog"
	"os"
	"strings"

	"github.com/hashicorp/go-plugin"
	"google.golang.org/grpc"

	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
	"github.com/keelmq/keel/services/output/internal/wire"
)

// Handshake is shared by the host and every plugin. A binary that is not a
// Keel output plugin (no cookie) exits with a message instead of serving;
// ProtocolVersion changes only with an incompatible plugin.v1 change.
var Handshake = plugin.HandshakeConfig{
	ProtocolVersion:  1,
	MagicCookieKey:   "KEEL_OUTPUT_PLUGIN",
	MagicCookieValue: "7b1c5e0a-keel-output-plugin",
}

// Plugin names in the go-plugin [plugin.PluginSet].
const (
	KindSink      = "sink"
	KindTransform = "transform"
)

// Sink is implemented by a sink plugin and by the host's gRPC client of one.
type Sink interface {
	Configure(ctx context.Context, req *pluginv1.SinkServiceConfigureRequest) (*pluginv1.SinkServiceConfigureResponse, error)
	Write(ctx context.Context, req *pluginv1.SinkServiceWriteRequest) (*pluginv1.SinkServiceWriteResponse, error)
	Close(ctx context.Context, req *pluginv1.SinkServiceCloseRequest) (*pluginv1.SinkServiceCloseResponse, error)
}

// Transform is implemented by a transform plugin and by the host's gRPC
// client of one.
type Transform interface {
	Configure(ctx context.Context, req *pluginv1.TransformServiceConfigureRequest) (*pluginv1.TransformServiceConfigureResponse, error)
	Transform(ctx context.Context, req *pluginv1.TransformServiceTransformRequest) (*pluginv1.TransformServiceTransformResponse, error)
}

// HostSink is the host's client of a sink plugin.
type HostSink interface {
	Sink
	// WriteRecords is Write with records in wire form; seq and follows
	// are the request's sequence and the one it follows (0: none).
	WriteRecords(ctx context.Context, recs wire.Records, seq, follows uint64) (*pluginv1.SinkServiceWriteResponse, error)
}

// HostTransform is the host's client of a transform plugin.
type HostTransform interface {
	Transform
	// TransformRecords is Transform with records in wire form, both ways;
	// the records returned are checked.
	TransformRecords(ctx context.Context, recs wire.Records) (wire.Records, error)
}

// SinkPlugin is the go-plugin plugin type of a sink. Impl is set on the
// plugin side only. net/rpc is not supported.
type SinkPlugin struct {
	plugin.NetRPCUnsupportedPlugin
	Impl Sink
}

var _ plugin.GRPCPlugin = (*SinkPlugin)(nil)

// GRPCServer registers the sink service on the plugin's gRPC server.
func (p *SinkPlugin) GRPCServer(_ *plugin.GRPCBroker, s *grpc.Server) error {
	s.RegisterService(&sinkServiceDesc, p.Impl)
	return nil
}

// GRPCClient returns the host-side [Sink] client.
func (p *SinkPlugin) GRPCClient(_ context.Context, _ *plugin.GRPCBroker, c *grpc.ClientConn) (any, error) {
	return &sinkClient{cc: c}, nil
}

// TransformPlugin is the go-plugin plugin type of a transform.
type TransformPlugin struct {
	plugin.NetRPCUnsupportedPlugin
	Impl Transform
}

var _ plugin.GRPCPlugin = (*TransformPlugin)(nil)

// GRPCServer registers the transform service on the plugin's gRPC server.
func (p *TransformPlugin) GRPCServer(_ *plugin.GRPCBroker, s *grpc.Server) error {
	s.RegisterService(&transformServiceDesc, p.Impl)
	return nil
}

// GRPCClient returns the host-side [Transform] client.
func (p *TransformPlugin) GRPCClient(_ context.Context, _ *plugin.GRPCBroker, c *grpc.ClientConn) (any, error) {
	return &transformClient{cc: c}, nil
}

// PluginSet is the set the host offers: it dispenses [KindSink] or
// [KindTransform], whichever the binary serves.
func PluginSet() plugin.PluginSet {
	return plugin.PluginSet{KindSink: &SinkPlugin{}, KindTransform: &TransformPlugin{}}
}

// ServeSink serves s as a plugin process; it returns when the host ends it.
// Call it from main. Run outside a host, it prints an explanation and exits 1.
func ServeSink(s Sink) {
	serve(plugin.PluginSet{KindSink: &SinkPlugin{Impl: s}})
}

// ServeTransform serves t as a plugin process; see [ServeSink].
func ServeTransform(t Transform) {
	serve(plugin.PluginSet{KindTransform: &TransformPlugin{Impl: t}})
}

// MaxMessageBytes is the largest gRPC message between host and plugin
// (gRPC's default is 4 MiB). The host keeps batches below
// [MaxBatchBytes], which leaves room for the records' metadata.
const MaxMessageBytes = 64 << 20

// MaxBatchBytes bounds the payload bytes of one batch sent to a plugin.
const MaxBatchBytes = 16 << 20

func serve(ps plugin.PluginSet) {
	plugin.Serve(&plugin.ServeConfig{
		HandshakeConfig: Handshake,
		Plugins:         ps,
		GRPCServer: func(opts []grpc.ServerOption) *grpc.Server {
			return plugin.DefaultGRPCServer(append(opts, grpc.MaxRecvMsgSize(MaxMessageBytes), grpc.MaxSendMsgSize(MaxMessageBytes)))
		},
	})
}

// PluginLogger returns the logger a plugin process should use: JSON on
// stderr in the shape go-plugin's host parses ("@level", "@message"), so that
// each line reaches the host's log at its own level with its attributes.
func PluginLogger(level slog.Level) *slog.Logger {
	return slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{
		Level: level,
		ReplaceAttr: func(groups []string, a slog.Attr) slog.Attr {
			if len(groups) > 0 {
				return a
			}
			switch a.Key {
			case slog.TimeKey:
				return slog.Attr{} // the host stamps lines itself
			case slog.LevelKey:
				return slog.String("@level", strings.ToLower(a.Value.String()))
			case slog.MessageKey:
				return slog.String("@message", a.Value.String())
			}
			return a
		},
	}))
}
