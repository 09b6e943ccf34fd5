package pluginkit

import (
	"context"

	"google.golang.org/grpc"

	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
	"github.com/keelmq/keel/services/output/internal/wire"
)

// Full method names of keel.output.plugin.v1, as protoc-gen-go-grpc would
// name them.
const (
	sinkService          = "keel.output.plugin.v1.SinkService"
	transformService     = "keel.output.plugin.v1.TransformService"
	methodSinkConfigure  = "/" + sinkService + "/Configure"
	methodSinkWrite      = "/" + sinkService + "/Write"
	methodSinkClose      = "/" + sinkService + "/Close"
	methodTransConfigure = "/" + transformService + "/Configure"
	methodTransTransform = "/" + transformService + "/Transform"
	protoFile            = "keel/output/plugin/v1/plugin.proto"
)

// unary builds a grpc.MethodDesc for one RPC whose server is an S.
func unary[S any, Req any, Resp any](name, full string, call func(S, context.Context, *Req) (*Resp, error)) grpc.MethodDesc {
	return grpc.MethodDesc{
		MethodName: name,
		Handler: func(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
			in := new(Req)
			if err := dec(in); err != nil {
				return nil, err
			}
			if interceptor == nil {
				return call(srv.(S), ctx, in)
			}
			info := &grpc.UnaryServerInfo{Server: srv, FullMethod: full}
			return interceptor(ctx, in, info, func(ctx context.Context, req any) (any, error) {
				return call(srv.(S), ctx, req.(*Req))
			})
		},
	}
}

var sinkServiceDesc = grpc.ServiceDesc{
	ServiceName: sinkService,
	HandlerType: (*Sink)(nil),
	Methods: []grpc.MethodDesc{
		unary("Configure", methodSinkConfigure, Sink.Configure),
		unary("Write", methodSinkWrite, Sink.Write),
		unary("Close", methodSinkClose, Sink.Close),
	},
	Metadata: protoFile,
}

var transformServiceDesc = grpc.ServiceDesc{
	ServiceName: transformService,
	HandlerType: (*Transform)(nil),
	Methods: []grpc.MethodDesc{
		unary("Configure", methodTransConfigure, Transform.Configure),
		unary("Transform", methodTransTransform, Transform.Transform),
	},
	Metadata: protoFile,
}

// sinkClient is the host side of a sink plugin.
type sinkClient struct{ cc grpc.ClientConnInterface }

func (c *sinkClient) Configure(ctx context.Context, req *pluginv1.SinkServiceConfigureRequest) (*pluginv1.SinkServiceConfigureResponse, error) {
	out := new(pluginv1.SinkServiceConfigureResponse)
	return out, c.cc.Invoke(ctx, methodSinkConfigure, req, out)
}

func (c *sinkClient) Write(ctx context.Context, req *pluginv1.SinkServiceWriteRequest) (*pluginv1.SinkServiceWriteResponse, error) {
	out := new(pluginv1.SinkServiceWriteResponse)
	return out, c.cc.Invoke(ctx, methodSinkWrite, req, out)
}

// WriteRecords is Write with the records in wire form: the host sends them
// as they came.
func (c *sinkClient) WriteRecords(ctx context.Context, recs wire.Records, seq, follows uint64) (*pluginv1.SinkServiceWriteResponse, error) {
	out := new(pluginv1.SinkServiceWriteResponse)
	return out, c.cc.Invoke(ctx, methodSinkWrite, &wire.SinkWrite{Records: recs, Sequence: seq, Follows: follows}, out,
		grpc.ForceCodecV2(wire.GRPCCodec{}))
}

func (c *sinkClient) Close(ctx context.Context, req *pluginv1.SinkServiceCloseRequest) (*pluginv1.SinkServiceCloseResponse, error) {
	out := new(pluginv1.SinkServiceCloseResponse)
	return out, c.cc.Invoke(ctx, methodSinkClose, req, out)
}

// transformClient is the host side of a transform plugin.
type transformClient struct{ cc grpc.ClientConnInterface }

func (c *transformClient) Configure(ctx context.Context, req *pluginv1.TransformServiceConfigureRequest) (*pluginv1.TransformServiceConfigureResponse, error) {
	out := new(pluginv1.TransformServiceConfigureResponse)
	return out, c.cc.Invoke(ctx, methodTransConfigure, req, out)
}

func (c *transformClient) Transform(ctx context.Context, req *pluginv1.TransformServiceTransformRequest) (*pluginv1.TransformServiceTransformResponse, error) {
	out := new(pluginv1.TransformServiceTransformResponse)
	return out, c.cc.Invoke(ctx, methodTransTransform, req, out)
}

// TransformRecords is Transform with the records in wire form, both ways.
func (c *transformClient) TransformRecords(ctx context.Context, recs wire.Records) (wire.Records, error) {
	var out wire.Records
	return out, c.cc.Invoke(ctx, methodTransTransform, &recs, &out, grpc.ForceCodecV2(wire.GRPCCodec{}))
}
