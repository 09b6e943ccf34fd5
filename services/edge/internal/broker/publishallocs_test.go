package broker

import (
	"bytes"
	"fmt"
	"log/slog"
	"testing"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/hooks/auth"
	"github.com/mochi-mqtt/server/v2/listeners"
	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// answering is a hook that gives every PUBLISH the answer the edge's
// OnPublish gives most of them.
type answering struct {
	mqtt.HookBase
	answer error
}

func (h *answering) ID() string { return "answering" }
func (h *answering) Provides(b byte) bool {
	return b == mqtt.OnPublish
}
func (h *answering) OnPublish(*mqtt.Client, *packets.Packet) error { return h.answer }

// The edge answers every PUBLISH it handles with one of two codes, and
// mochi compares the answer with both. Neither the answer nor the
// comparison may allocate: at hundreds of thousands of PUBLISHes a second,
// each allocation was a few percent of the edge's CPU. A rejection is
// still logged at debug level.
func TestMochiHooks_EdgeAnswersToAPublishAllocateNothing(t *testing.T) {
	for _, tc := range []struct {
		name   string
		answer error
	}{
		{"handled", errRejectPacket},
		{"ignored", errIgnorePacket},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logged bytes.Buffer
			hooks := &mqtt.Hooks{Log: slog.New(slog.NewTextHandler(&logged, &slog.HandlerOptions{Level: slog.LevelInfo}))}
			if err := hooks.Add(&answering{answer: tc.answer}, nil); err != nil {
				t.Fatal(err)
			}
			cl := &mqtt.Client{}
			pk := &packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1}, TopicName: "acme/a", PacketID: 300}
			allocs := testing.AllocsPerRun(1000, func() {
				if err := hooks.OnPublish(cl, pk); err != tc.answer {
					t.Fatalf("OnPublish = %v, want %v", err, tc.answer)
				}
			})
			if allocs != 0 {
				t.Fatalf("%v allocations for each PUBLISH, want none", allocs)
			}
			if logged.Len() != 0 {
				t.Fatalf("logged at info level: %s", logged.String())
			}

			if tc.answer != errRejectPacket {
				return
			}
			debug := &mqtt.Hooks{Log: slog.New(slog.NewTextHandler(&logged, &slog.HandlerOptions{Level: slog.LevelDebug}))}
			if err := debug.Add(&answering{answer: tc.answer}, nil); err != nil {
				t.Fatal(err)
			}
			_ = debug.OnPublish(cl, pk)
			if line := logged.String(); !bytes.Contains(logged.Bytes(), []byte("publish packet rejected")) ||
				!bytes.Contains(logged.Bytes(), []byte("packet_id=300")) || !bytes.Contains(logged.Bytes(), []byte("topic=acme/a")) {
				t.Fatalf("debug line = %q, want the rejection with its packet ID and topic", line)
			}
		})
	}
}

// A hook may answer an MQTT 5 QoS 1 PUBLISH with a reason code inside an
// error of its own: mochi acknowledges with that code, where it took the
// answer itself for the code and panicked on a wrapped one.
func TestMochiHooks_WrappedReasonCodeAnswersAPublish(t *testing.T) {
	s := mqtt.New(&mqtt.Options{Logger: testutil.Logger(t)})
	require.NoError(t, s.AddHook(new(auth.AllowHook), nil))
	require.NoError(t, s.AddHook(&answering{answer: fmt.Errorf("over the tenant's quota: %w", packets.ErrQuotaExceeded)}, nil))
	ln := listeners.NewTCP(listeners.Config{ID: "wrapped", Address: "127.0.0.1:0"})
	require.NoError(t, s.AddListener(ln))
	require.NoError(t, s.Serve())
	t.Cleanup(func() { _ = s.Close() })

	pub := mqtttest.Dial(t, ln.Address(), 5)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(7, "t", 1, []byte("x"))
	ack := pub.Expect(packets.Puback)
	require.Equal(t, uint16(7), ack.PacketID)
	require.Equal(t, packets.ErrQuotaExceeded.Code, ack.ReasonCode)
}
