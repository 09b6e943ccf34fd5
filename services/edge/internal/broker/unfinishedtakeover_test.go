package broker

import (
	"errors"
	"testing"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// Invariant 3: a takeover left unfinished (the edge a claim took the
// session from named another as its holder, HeldElsewhereError, and that
// one did not answer) is finished by the next claim even when this edge
// holds an older copy: that copy is no sign it was settled. Otherwise the
// next claim asks only the edge it was taken from, which forgot the
// unfinished takeover when it named the holder and answers "nothing", and
// the CONNECT is admitted with the holder's client still connected.
func TestBroker_UnfinishedTakeoverFinishedDespiteOlderCopy(t *testing.T) {
	t.Parallel()
	b, addr, stop := openDurable(t, t.TempDir())
	t.Cleanup(stop)
	askedEdge3 := 0
	tk := &scriptedTakeover{}
	tk.begin = func(uint64) ([]byte, error) {
		switch tk.from[len(tk.from)-1] {
		case "edge-3":
			askedEdge3++
			if askedEdge3 == 1 {
				return nil, &HeldElsewhereError{Edge: "edge-4"}
			}
			return nil, nil // its unfinished takeover was passed on (passUnfinished)
		case "edge-4":
			return nil, errors.New("deadline exceeded") // holds the client, slow
		}
		return nil, nil
	}
	b.SetCluster(Cluster{Takeover: tk, Ownership: grantsInOrder([]Grant{
		{Epoch: 5},
		{Epoch: 27, Previous: "edge-3", PreviousEpoch: 25},
		{Epoch: 29, Previous: "test", PreviousEpoch: 27, TakenFrom: "edge-3"},
	})})
	props := packets.Properties{SessionExpiryInterval: 60, SessionExpiryIntervalFlag: true}
	id := b.mustScope(t, "default").ClientID("chain")
	c := mqtttest.Dial(t, addr, 5)
	require.Equal(t, packets.CodeSuccess.Code, c.Connect("chain", false, props).ReasonCode)
	require.Equal(t, uint64(5), waitBound(t, b, id))
	_ = c.Conn.Close()
	waitUnbound(t, b.session(id))

	c27 := mqtttest.Dial(t, addr, 5)
	require.NotEqual(t, packets.CodeSuccess.Code, c27.Connect("chain", false, props).ReasonCode)
	c29 := mqtttest.Dial(t, addr, 5)
	code := c29.Connect("chain", false, props).ReasonCode
	t.Logf("claim 29: reason 0x%x, Begin called on %v", code, tk.from)
	assert.NotEqual(t, packets.CodeSuccess.Code, code, "admitted without asking edge-4, which holds the session")
}
