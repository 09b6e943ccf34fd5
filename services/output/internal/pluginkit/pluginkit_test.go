package pluginkit

import (
	"context"
	"errors"
	"testing"

	"github.com/hashicorp/go-plugin"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
)

// fakeSink is a Sink with function fields.
type fakeSink struct {
	configure func(context.Context, *pluginv1.SinkServiceConfigureRequest) (*pluginv1.SinkServiceConfigureResponse, error)
	write     func(context.Context, *pluginv1.SinkServiceWriteRequest) (*pluginv1.SinkServiceWriteResponse, error)
}

func (f *fakeSink) Configure(ctx context.Context, r *pluginv1.SinkServiceConfigureRequest) (*pluginv1.SinkServiceConfigureResponse, error) {
	return f.configure(ctx, r)
}
func (f *fakeSink) Write(ctx context.Context, r *pluginv1.SinkServiceWriteRequest) (*pluginv1.SinkServiceWriteResponse, error) {
	return f.write(ctx, r)
}
func (f *fakeSink) Close(context.Context, *pluginv1.SinkServiceCloseRequest) (*pluginv1.SinkServiceCloseResponse, error) {
	return &pluginv1.SinkServiceCloseResponse{}, nil
}

type fakeTransform struct{}

func (fakeTransform) Configure(context.Context, *pluginv1.TransformServiceConfigureRequest) (*pluginv1.TransformServiceConfigureResponse, error) {
	return &pluginv1.TransformServiceConfigureResponse{Info: &pluginv1.PluginInfo{Id: "upper"}}, nil
}
func (fakeTransform) Transform(_ context.Context, r *pluginv1.TransformServiceTransformRequest) (*pluginv1.TransformServiceTransformResponse, error) {
	return &pluginv1.TransformServiceTransformResponse{Records: append(r.GetRecords(), r.GetRecords()...)}, nil
}

// TestSinkPlugin_GRPC drives the hand-registered gRPC services through
// go-plugin's in-memory gRPC connection.
func TestSinkPlugin_GRPC(t *testing.T) {
	t.Parallel()
	var gotPipeline string
	sink := &fakeSink{
		configure: func(_ context.Context, r *pluginv1.SinkServiceConfigureRequest) (*pluginv1.SinkServiceConfigureResponse, error) {
			gotPipeline = r.GetPipeline()
			if string(r.GetConfigJson()) == "bad" {
				return nil, errors.New("bad config")
			}
			return &pluginv1.SinkServiceConfigureResponse{Info: &pluginv1.PluginInfo{Id: "fake"}, MaxBatchRecords: 7}, nil
		},
		write: func(_ context.Context, r *pluginv1.SinkServiceWriteRequest) (*pluginv1.SinkServiceWriteResponse, error) {
			return &pluginv1.SinkServiceWriteResponse{Failures: []*pluginv1.RecordFailure{{Index: uint32(len(r.GetRecords()) - 1), Retryable: true}}}, nil
		},
	}
	client, _ := plugin.TestPluginGRPCConn(t, false, map[string]plugin.Plugin{
		KindSink: &SinkPlugin{Impl: sink}, KindTransform: &TransformPlugin{Impl: fakeTransform{}},
	})
	// client.Close asks the server to stop through the plugin controller;
	// stopping it here as well races inside go-plugin (GRPCServer.Stop).
	t.Cleanup(func() { _ = client.Close() })

	raw, err := client.Dispense(KindSink)
	require.NoError(t, err)
	s := raw.(Sink)
	resp, err := s.Configure(t.Context(), &pluginv1.SinkServiceConfigureRequest{Pipeline: "acme/r", ConfigJson: []byte("{}")})
	require.NoError(t, err)
	require.Equal(t, uint32(7), resp.GetMaxBatchRecords())
	require.Equal(t, "acme/r", gotPipeline)
	_, err = s.Configure(t.Context(), &pluginv1.SinkServiceConfigureRequest{ConfigJson: []byte("bad")})
	require.Equal(t, codes.Unknown, status.Code(err))
	require.Contains(t, status.Convert(err).Message(), "bad config")
	wr, err := s.Write(t.Context(), &pluginv1.SinkServiceWriteRequest{Records: []*pluginv1.Record{{Message: &commonv1.Message{Topic: "a"}}, {}}})
	require.NoError(t, err)
	require.Equal(t, uint32(1), wr.GetFailures()[0].GetIndex())
	_, err = s.Close(t.Context(), &pluginv1.SinkServiceCloseRequest{})
	require.NoError(t, err)

	raw, err = client.Dispense(KindTransform)
	require.NoError(t, err)
	tr := raw.(Transform)
	tresp, err := tr.Transform(t.Context(), &pluginv1.TransformServiceTransformRequest{Records: []*pluginv1.Record{{Key: []byte("k")}}})
	require.NoError(t, err)
	require.Len(t, tresp.GetRecords(), 2)
	require.Equal(t, []byte("k"), tresp.GetRecords()[1].GetKey())
}

func TestLaunch_NotExecutable(t *testing.T) {
	t.Parallel()
	_, err := Launch(t.TempDir(), KindSink, 0, nil)
	require.ErrorIs(t, err, ErrLaunch)
	_, err = Launch("/nonexistent/keel-output-x", KindSink, 0, nil)
	require.ErrorIs(t, err, ErrLaunch)
}
