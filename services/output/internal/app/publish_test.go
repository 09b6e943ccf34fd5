package app

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/libs/testutil"
	outputv1 "github.com/keelmq/keel/proto/gen/keel/output/v1"
	"github.com/keelmq/keel/proto/gen/keel/output/v1/outputv1connect"
	"github.com/keelmq/keel/services/output/internal/meta"
	"github.com/keelmq/keel/services/output/internal/outputtest"
)

// encodedRequest is a PublishRequest already encoded, so that a test can
// send what no protobuf encoder would.
type encodedRequest []byte

// encodedCodec sends encodedRequest as it is and reads responses with the
// runtime.
type encodedCodec struct{}

func (encodedCodec) Name() string { return "proto" }
func (encodedCodec) Marshal(v any) ([]byte, error) {
	if r, ok := v.(*encodedRequest); ok {
		return *r, nil
	}
	return proto.Marshal(v.(proto.Message))
}
func (encodedCodec) Unmarshal(b []byte, v any) error { return proto.Unmarshal(b, v.(proto.Message)) }

// TestOutput_Publish_MalformedRecordsRefusedAlone sends one batch that mixes
// good records with malformed ones: a topic that is not UTF-8, a message
// cut short, a record without a message, an invalid tenant, an empty topic.
// Each bad record is refused and counted by reason; the good ones reach the
// sink whole, and the stream goes on.
func TestOutput_Publish_MalformedRecordsRefusedAlone(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	sink := newHTTPCollector(t)
	h := startOutput(t, fmt.Sprintf(`
tenants:
  acme:
    rules:
      - name: to-http
        filters: ["sensors/#"]
        sink:
          plugin: http
          config: {url: %q, batch: true, max_batch_records: 20, timeout: 2s}
`, sink.url))

	good := func(seq uint64) []byte {
		b, err := proto.Marshal(outputtest.Message("acme", fmt.Sprintf("sensors/%d", seq), seq, []byte("ok")))
		require.NoError(t, err)
		return b
	}
	field := func(b []byte, num protowire.Number, v []byte) []byte {
		b = protowire.AppendTag(append([]byte(nil), b...), num, protowire.BytesType)
		return protowire.AppendBytes(b, v)
	}
	record := func(msg []byte) []byte { return field(nil, 1, msg) }
	batch := func(id uint64, records ...[]byte) *encodedRequest {
		req := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), id)
		req = field(req, 2, []byte("edge-raw"))
		for _, r := range records {
			req = field(req, 4, r)
		}
		e := encodedRequest(req)
		return &e
	}
	g3 := good(3)
	sent := batch(1,
		record(good(1)),
		record(field(good(2), 3, []byte{'s', '/', 0xff})), // topic not UTF-8
		record(g3[:len(g3)-1]),                            // cut short
		field(nil, 2, []byte("acme/to-http")),             // pipelines, no message
		record(field(good(4), 2, []byte("ACME"))),         // tenant not [a-z0-9-]
		record(field(good(5), 3, nil)),                    // empty topic
		record(good(6)),
	)

	api := connect.NewClient[encodedRequest, outputv1.PublishResponse](h2cClient(),
		h.url+outputv1connect.OutputServicePublishProcedure, connect.WithCodec(encodedCodec{}))
	st := api.CallBidiStream(t.Context())
	ack := func(req *encodedRequest, id uint64) *outputv1.PublishResponse {
		t.Helper()
		require.NoError(t, st.Send(req))
		for {
			resp, err := st.Receive()
			require.NoError(t, err)
			if resp.GetFilters() == nil {
				require.Equal(t, id, resp.GetBatchId())
				return resp
			}
		}
	}
	resp := ack(sent, 1)
	require.EqualValues(t, 2, resp.GetAccepted())
	require.EqualValues(t, 5, resp.GetDropped())

	// The stream is still good.
	resp = ack(batch(2, record(good(7))), 2)
	require.EqualValues(t, 1, resp.GetAccepted())

	reg := h.out.Registry()
	for reason, n := range map[string]float64{"malformed": 2, "no_message": 1, "bad_tenant": 1, "no_topic": 1} {
		require.Equal(t, n, metric(t, reg, "keel_output_invalid_records_total", map[string]string{"reason": reason}), reason)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := sink.total(); n < 3 {
			return fmt.Errorf("%d records at the sink", n)
		}
		return nil
	})
	time.Sleep(200 * time.Millisecond) // nothing more arrives
	var ids []string
	for _, r := range sink.received() {
		ids = append(ids, r.MsgID)
		require.Equal(t, "acme", r.Tenant)
		require.Equal(t, []byte("ok"), r.Payload)
	}
	want := []string{}
	for _, seq := range []uint64{1, 6, 7} {
		want = append(want, meta.MsgID(outputtest.Message("acme", "", seq, nil).GetId()))
	}
	slices.Sort(ids)
	require.Equal(t, want, ids)
}
