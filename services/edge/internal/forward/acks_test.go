package forward

import (
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"
)

// acksFor runs ackLandings over frames queued together and returns the
// responses it sent: "taken N" or "resend".
func acksFor(t *testing.T, frames []landing) []string {
	t.Helper()
	s := &Server{Logger: testutil.Logger(t)}
	s.mu.Lock()
	s.initLocked()
	s.flying[peerKey{"a", 1}] = make([]time.Time, len(frames))
	s.mu.Unlock()
	landings := make(chan landing, len(frames))
	for _, l := range frames {
		landings <- l
	}
	close(landings)
	var got []string
	var failed atomic.Pointer[error]
	s.ackLandings(peerKey{"a", 1}, landings, func(r *edgev1.ForwardResponse) error {
		if r.GetResend() {
			got = append(got, "resend")
		} else {
			got = append(got, fmt.Sprintf("taken %d", r.GetTakenSeq()))
		}
		return nil
	}, &failed)
	return got
}

func frames(n int, mod func(i int, l *landing)) []landing {
	out := make([]landing, n)
	for i := range out {
		out[i] = landing{seq: uint64(i + 1), wait: func() ([]bool, error) { return []bool{true}, nil }}
		if mod != nil {
			mod(i, &out[i])
		}
	}
	return out
}

// Frames that land together get one cumulative acknowledgement, at most
// ackEvery frames apart; what is taken is acknowledged before a wait on
// the store and before a resend is asked for.
func TestAckLandings_OneAcknowledgementForFramesThatLandTogether(t *testing.T) {
	require.Equal(t, []string{"taken 5"}, acksFor(t, frames(5, nil)))
	require.Equal(t, []string{"taken 8", "taken 16", "taken 20"}, acksFor(t, frames(20, nil)))
	require.Equal(t, []string{"taken 2", "taken 4"}, acksFor(t, frames(4, func(i int, l *landing) {
		l.stores = i == 2
	})))
	require.Equal(t, []string{"taken 2", "resend"}, acksFor(t, frames(4, func(i int, l *landing) {
		if i == 2 {
			l.wait = func() ([]bool, error) { return []bool{false}, errors.New("not stored") }
		}
	})))
}

// A handover reports frames landing only when one has waited for the store
// longer than slowLanding: under load frames always wait a commit or two.
func TestServer_FramesLandingMeansASlowStore(t *testing.T) {
	s := &Server{}
	s.mu.Lock()
	s.initLocked()
	s.flying[peerKey{"a", 1}] = []time.Time{time.Now().Add(-10 * time.Millisecond)}
	s.mu.Unlock()
	require.False(t, s.framesLanding(), "a frame in its first commit")
	s.mu.Lock()
	s.flying[peerKey{"b", 1}] = []time.Time{time.Now().Add(-2 * slowLanding), time.Now()}
	s.mu.Unlock()
	require.True(t, s.framesLanding(), "a frame waiting past slowLanding")
}
