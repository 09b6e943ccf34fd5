package server

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/slots"
	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/coordinator/internal/discovery"
	"github.com/keelmq/keel/services/coordinator/internal/fsm"
	"github.com/keelmq/keel/services/coordinator/internal/raftnode"
	"github.com/keelmq/keel/services/coordinator/internal/raftpb"

	"google.golang.org/protobuf/types/known/durationpb"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
)

func memberEvent(id string) fsm.Event {
	return fsm.Event{Kind: fsm.EventMember, Member: &raftpb.MemberRecord{MemberId: id}}
}

func indexes(evs []hubEvent) []uint64 {
	var out []uint64
	for _, e := range evs {
		out = append(out, e.index)
	}
	return out
}

func TestHub_ResumeAndGaps(t *testing.T) {
	h := newHub(fsm.New(nil))
	evs, gap, changed := h.since(0)
	require.Empty(t, evs)
	require.False(t, gap)

	h.publish(3, []fsm.Event{memberEvent("a"), memberEvent("b")})
	select {
	case <-changed:
	default:
		t.Fatal("publish did not signal")
	}
	h.publish(5, []fsm.Event{memberEvent("c")})

	evs, gap, _ = h.since(0)
	require.False(t, gap)
	require.Equal(t, []uint64{3, 3, 5}, indexes(evs))
	evs, _, _ = h.since(3)
	require.Equal(t, []uint64{5}, indexes(evs), "resume after index 3 skips both of its events")
	evs, _, _ = h.since(4)
	require.Equal(t, []uint64{5}, indexes(evs))
	evs, gap, _ = h.since(5)
	require.Empty(t, evs)
	require.False(t, gap)

	// A restore (nil events) makes everything up to its index unreplayable.
	h.publish(10, nil)
	_, gap, _ = h.since(5)
	require.True(t, gap, "a watcher from before the restored snapshot needs a snapshot")
	evs, gap, _ = h.since(10)
	require.False(t, gap)
	require.Empty(t, evs)
	h.publish(11, []fsm.Event{memberEvent("d")})
	evs, _, _ = h.since(10)
	require.Equal(t, []uint64{11}, indexes(evs))
}

func TestHub_Overflow(t *testing.T) {
	h := newHub(fsm.New(nil))
	for i := uint64(1); i <= hubCapacity+10; i++ {
		h.publish(i, []fsm.Event{memberEvent("m")})
	}
	_, gap, _ := h.since(5)
	require.True(t, gap, "a watcher behind the ring gets a snapshot")
	evs, gap, _ := h.since(10)
	require.False(t, gap, "the oldest kept event is 11")
	require.Len(t, evs, hubCapacity)
	require.Equal(t, uint64(11), evs[0].index)
	evs, _, _ = h.since(hubCapacity + 9)
	require.Equal(t, []uint64{hubCapacity + 10}, indexes(evs))
}

func TestConfig_Validate(t *testing.T) {
	good := func() Config {
		return Config{LeaseTTL: time.Second, MaxClaimsPerCall: 1, MaxClaimsPerEntry: 1, CustodyBatch: 1,
			WatchHeartbeat: time.Second, PromotionLeaseTTL: time.Second, ReconcileInterval: time.Second}
	}
	c := good()
	require.NoError(t, c.Validate())
	c.RouterURL = "http://keel-router:9300"
	require.NoError(t, c.Validate())
	for name, mut := range map[string]func(*Config){
		"short ttl":          func(c *Config) { c.LeaseTTL = time.Millisecond },
		"zero batch":         func(c *Config) { c.MaxClaimsPerEntry = 0 },
		"zero custody batch": func(c *Config) { c.CustodyBatch = 0 },
		"zero heartbeat":     func(c *Config) { c.WatchHeartbeat = 0 },
		"slow heartbeat":     func(c *Config) { c.WatchHeartbeat = 3 * time.Second },
		"promotion too long": func(c *Config) { c.PromotionLeaseTTL = time.Hour },
		"negative dead":      func(c *Config) { c.DeadServerTimeout = -time.Second },
		"negative grace":     func(c *Config) { c.RouteGrace = -time.Second },
		"router no scheme":   func(c *Config) { c.RouterURL = "keel-router:9300" },
		"router no host":     func(c *Config) { c.RouterURL = "http://" },
		"router bad scheme":  func(c *Config) { c.RouterURL = "ftp://keel-router:9300" },
		"too many groups":    func(c *Config) { c.RedisGroups = 16385 },
	} {
		c := good()
		mut(&c)
		require.Error(t, c.Validate(), name)
	}
}

type fakePeers struct {
	mu      sync.Mutex
	members []discovery.Member
}

func (p *fakePeers) Coordinators() []discovery.Member {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.members)
}

func (p *fakePeers) set(members ...discovery.Member) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.members = members
}

// self is the test server's own gossip entry, applying commands up to newest.
func self(newest fsm.CommandType) discovery.Member {
	return discovery.Member{Name: "n1", Meta: discovery.Meta{Role: discovery.RoleCoordinator, ID: "n1", Commands: int(newest)}}
}

// newTestNode is a Raft node with an FSM of its own, not started.
func newTestNode(t *testing.T, id string) *raftnode.Node {
	t.Helper()
	logger := testutil.Logger(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	node, err := raftnode.New(raftnode.Config{NodeID: id, DataDir: t.TempDir(), Listener: ln,
		HeartbeatTimeout: 50 * time.Millisecond, ElectionTimeout: 50 * time.Millisecond, LeaderLeaseTimeout: 50 * time.Millisecond,
		CommitTimeout: 5 * time.Millisecond, ApplyTimeout: 5 * time.Second, SnapshotInterval: time.Minute,
		SnapshotThreshold: 8192, TrailingLogs: 1024}, fsm.New(logger), logger)
	require.NoError(t, err)
	return node
}

// testServer is a single-node coordinator without the HTTP layer: handlers
// are called directly.
type testServer struct {
	s     *Server
	node  *raftnode.Node
	peers *fakePeers
}

func newTestServer(t *testing.T, bootstrap bool, cfgFn func(*Config)) *testServer {
	t.Helper()
	logger := testutil.Logger(t)
	node := newTestNode(t, "n1")
	cfg := Config{LeaseTTL: 2 * time.Second, MaxClaimsPerCall: 100, MaxClaimsPerEntry: 64, CustodyBatch: 100,
		WatchHeartbeat: 100 * time.Millisecond, PromotionLeaseTTL: time.Second, ReconcileInterval: time.Hour}
	if cfgFn != nil {
		cfgFn(&cfg)
	}
	peers := &fakePeers{members: []discovery.Member{self(fsm.NewestCommand)}}
	s, err := New(cfg, node, peers, prometheus.NewRegistry(), logger)
	require.NoError(t, err)
	require.NoError(t, node.Start())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
		_ = node.Kill()
	})
	if bootstrap {
		_, err := node.BootstrapIfEmpty([]raft.Server{{Suffrage: raft.Voter, ID: "n1", Address: raft.ServerAddress(node.Addr())}})
		require.NoError(t, err)
		testutil.Eventually(t, 10*time.Second, func() error { return s.Ready() })
	}
	return &testServer{s: s, node: node, peers: peers}
}

func (ts *testServer) renew(t *testing.T, id string, inc uint64) *coordinatorv1.RenewLeaseResponse {
	t.Helper()
	resp, err := ts.s.RenewLease(t.Context(), connect.NewRequest(&coordinatorv1.RenewLeaseRequest{MemberId: id,
		Role: coordinatorv1.MemberRole_MEMBER_ROLE_EDGE, Incarnation: inc, Address: "http://" + id, State: coordinatorv1.MemberState_MEMBER_STATE_ALIVE}))
	require.NoError(t, err)
	return resp.Msg
}

func (ts *testServer) claim(ctx context.Context, edge, client, req string) (*coordinatorv1.SessionGrant, error) {
	resp, err := ts.s.ClaimSession(ctx, connect.NewRequest(&coordinatorv1.ClaimSessionRequest{RequestId: req,
		Session: &commonv1.SessionKey{Tenant: "acme", ClientId: client}, EdgeId: edge, Incarnation: 1}))
	if err != nil {
		return nil, err
	}
	return resp.Msg.GetGrant(), nil
}

// TestServer_Claims exercises the claim path of one leader without HTTP: a
// lease is required, the epoch is the entry's index and names the previous
// owner, a retried request ID gets the first answer, and concurrent claims of
// one session (which the batcher must split across entries) all succeed with
// distinct, chained epochs.
func TestServer_Claims(t *testing.T) {
	ts := newTestServer(t, true, nil)

	_, err := ts.claim(t.Context(), "e1", "c1", "")
	require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err), "no lease: %v", err)

	ts.renew(t, "e1", 1)
	ts.renew(t, "e2", 1)
	g1, err := ts.claim(t.Context(), "e1", "c1", "r1")
	require.NoError(t, err)
	require.NotZero(t, g1.GetEpoch())
	require.Nil(t, g1.GetPrevious())
	require.Equal(t, g1.GetEpoch(), ts.s.fsm.State().Session("acme", "c1").GetEpoch())

	again, err := ts.claim(t.Context(), "e1", "c1", "r1")
	require.NoError(t, err)
	require.Equal(t, g1.GetEpoch(), again.GetEpoch(), "a retried request ID is not applied twice")

	g2, err := ts.claim(t.Context(), "e2", "c1", "r2")
	require.NoError(t, err)
	require.Greater(t, g2.GetEpoch(), g1.GetEpoch())
	require.Equal(t, "e1", g2.GetPrevious().GetOwnerEdgeId())
	require.Equal(t, g1.GetEpoch(), g2.GetPrevious().GetEpoch())
	require.Equal(t, "http://e1", g2.GetPreviousOwnerAddress())

	const n = 40
	var mu sync.Mutex
	grants := map[uint64]*coordinatorv1.SessionGrant{}
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			g, err := ts.claim(t.Context(), []string{"e1", "e2"}[i%2], "hot", fmt.Sprintf("hot-%d", i))
			if !errors.Is(err, nil) {
				t.Error(err)
				return
			}
			mu.Lock()
			grants[g.GetEpoch()] = g
			mu.Unlock()
		}()
	}
	wg.Wait()
	require.Len(t, grants, n, "every claim got its own epoch")
	for ep, g := range grants {
		if p := g.GetPrevious(); p != nil {
			require.Contains(t, grants, p.GetEpoch(), "grant %d names an unknown previous epoch", ep)
			require.Equal(t, grants[p.GetEpoch()].GetSession().GetClientId(), "hot")
		}
	}
}

func (ts *testServer) release(ctx context.Context, edge, client, req string, epoch uint64) (bool, error) {
	resp, err := ts.s.ReleaseSession(ctx, connect.NewRequest(&coordinatorv1.ReleaseSessionRequest{RequestId: req,
		Session: &commonv1.SessionKey{Tenant: "acme", ClientId: client}, Epoch: epoch, EdgeId: edge, Incarnation: 1}))
	if err != nil {
		return false, err
	}
	return resp.Msg.GetReleased(), nil
}

// TestServer_ConcurrentReleasesShareEntries: the releases of a storm's clean
// disconnects go into few Raft entries, as its claims do, each answered as
// it would be alone: released, refused for a stale epoch or another owner,
// absent, and a retried request ID answered the same. Until every voter
// says it applies ReleaseSessions entries (a rolling update from a version
// before them), each release is an entry of its own, answered the same.
func TestServer_ConcurrentReleasesShareEntries(t *testing.T) {
	for _, c := range []struct {
		name    string
		newest  fsm.CommandType
		batched bool
	}{{"every voter applies them", fsm.NewestCommand, true}, {"a voter of an earlier version", fsm.CmdReleaseSessions - 1, false}} {
		t.Run(c.name, func(t *testing.T) {
			ts := newTestServer(t, true, nil)
			ts.peers.set(self(c.newest))
			ts.s.batchReleasesIfAgreed(ts.s.term.Load())
			testConcurrentReleases(t, ts, c.batched)
		})
	}
}

func testConcurrentReleases(t *testing.T, ts *testServer, batched bool) {
	ts.renew(t, "e1", 1)
	ts.renew(t, "e2", 1)
	const n = 400
	epochs := make([]uint64, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			g, err := ts.claim(t.Context(), "e1", fmt.Sprintf("c%d", i), "")
			if err != nil {
				t.Error(err)
				return
			}
			epochs[i] = g.GetEpoch()
		})
	}
	wg.Wait()
	require.False(t, t.Failed())
	other, err := ts.claim(t.Context(), "e2", "other", "")
	require.NoError(t, err)

	before := ts.s.fsm.State().Index()
	released := make([]bool, n)
	for i := range n {
		wg.Go(func() {
			ok, err := ts.release(t.Context(), "e1", fmt.Sprintf("c%d", i), fmt.Sprintf("rel-%d", i), epochs[i])
			if err != nil {
				t.Error(err)
			}
			released[i] = ok
		})
	}
	var stale, notOwner error
	wg.Go(func() { _, stale = ts.release(t.Context(), "e2", "other", "rel-stale", other.GetEpoch()-1) })
	wg.Go(func() { _, notOwner = ts.release(t.Context(), "e1", "other", "rel-owner", other.GetEpoch()) })
	wg.Wait()
	entries := ts.s.fsm.State().Index() - before
	t.Logf("%d releases in %d entries", n+2, entries)
	if batched {
		require.Less(t, entries, uint64(n/4), "releases share entries")
	} else {
		require.Equal(t, uint64(n+2), entries, "an entry per release")
	}
	require.NotContains(t, released, false)
	require.Equal(t, 1, ts.s.fsm.State().SessionCount(), "only the session refused a release is left")
	require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(stale), "stale epoch: %v", stale)
	require.Contains(t, stale.Error(), "stale epoch")
	require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(notOwner), "not the owner: %v", notOwner)

	again, err := ts.release(t.Context(), "e1", "c0", "rel-0", epochs[0])
	require.NoError(t, err)
	require.True(t, again, "a retried request ID is answered as the first time")
	absent, err := ts.release(t.Context(), "e1", "c0", "rel-0-later", epochs[0])
	require.NoError(t, err)
	require.False(t, absent, "no record left to release")
}

// TestServer_ReleaseSessions: one call's releases are answered each on its
// own, in request order.
func TestServer_ReleaseSessions(t *testing.T) {
	for _, newest := range []fsm.CommandType{fsm.NewestCommand, fsm.CmdReleaseSessions - 1} {
		t.Run(fmt.Sprintf("voters apply commands up to %d", newest), func(t *testing.T) {
			ts := newTestServer(t, true, nil)
			ts.peers.set(self(newest))
			ts.s.batchReleasesIfAgreed(ts.s.term.Load())
			testReleaseSessions(t, ts)
		})
	}
}

func testReleaseSessions(t *testing.T, ts *testServer) {
	ts.renew(t, "e1", 1)
	a, err := ts.claim(t.Context(), "e1", "a", "")
	require.NoError(t, err)
	b, err := ts.claim(t.Context(), "e1", "b", "")
	require.NoError(t, err)
	rel := func(client, req string, epoch uint64) *coordinatorv1.SessionRelease {
		return &coordinatorv1.SessionRelease{RequestId: req, Session: &commonv1.SessionKey{Tenant: "acme", ClientId: client}, Epoch: epoch}
	}
	call := func(rs ...*coordinatorv1.SessionRelease) ([]*coordinatorv1.ReleaseResult, error) {
		resp, err := ts.s.ReleaseSessions(t.Context(), connect.NewRequest(&coordinatorv1.ReleaseSessionsRequest{
			EdgeId: "e1", Incarnation: 1, Releases: rs}))
		if err != nil {
			return nil, err
		}
		return resp.Msg.GetResults(), nil
	}
	res, err := call(rel("a", "ra", a.GetEpoch()), rel("b", "rb", b.GetEpoch()-1), rel("b", "rb0", 0),
		rel("never", "rn", 5), rel("a", "ra", a.GetEpoch()))
	require.NoError(t, err)
	require.Len(t, res, 5)
	require.True(t, res[0].GetReleased())
	require.Equal(t, coordinatorv1.ReleaseErrorCode_RELEASE_ERROR_CODE_STALE_EPOCH, res[1].GetError().GetCode(), res[1].GetError().GetMessage())
	require.Equal(t, coordinatorv1.ReleaseErrorCode_RELEASE_ERROR_CODE_INVALID_ARGUMENT, res[2].GetError().GetCode())
	require.False(t, res[3].GetReleased())
	require.Nil(t, res[3].GetError(), "no record: not an error")
	require.True(t, res[4].GetReleased(), "the same request again: the same answer")
	require.NotNil(t, ts.s.fsm.State().Session("acme", "b"), "the refused releases left b")

	_, err = call()
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	_, err = ts.s.ReleaseSessions(t.Context(), connect.NewRequest(&coordinatorv1.ReleaseSessionsRequest{
		EdgeId: "", Incarnation: 1, Releases: []*coordinatorv1.SessionRelease{rel("b", "x", b.GetEpoch())}}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
}

// TestServer_ClaimSourceGone: a grant says when the edge the session
// would be taken over from is no longer a live member, so the claimant
// resumes it from the store instead of calling an edge that fenced itself:
// the previous owner, or, when the claimant owned the session already (its
// takeover failed), the edge it took the session from. A renewal tells
// the member the applied index, which every later claim's epoch exceeds.
func TestServer_ClaimSourceGone(t *testing.T) {
	ts := newTestServer(t, true, nil)
	ts.renew(t, "e1", 1)
	ts.renew(t, "e2", 1)
	r := ts.renew(t, "e3", 1)
	require.NotZero(t, r.GetAppliedIndex())

	_, err := ts.claim(t.Context(), "e1", "c1", "r1")
	require.NoError(t, err)
	g, err := ts.claim(t.Context(), "e2", "c1", "r2")
	require.NoError(t, err)
	require.Greater(t, g.GetEpoch(), r.GetAppliedIndex())
	require.False(t, g.GetSourceGone(), "e1 is alive")

	_, err = ts.s.RenewLease(t.Context(), connect.NewRequest(&coordinatorv1.RenewLeaseRequest{MemberId: "e1",
		Role: coordinatorv1.MemberRole_MEMBER_ROLE_EDGE, Incarnation: 1, Address: "http://e1", State: coordinatorv1.MemberState_MEMBER_STATE_LEFT}))
	require.NoError(t, err)
	g, err = ts.claim(t.Context(), "e2", "c1", "r3")
	require.NoError(t, err)
	require.Equal(t, "e2", g.GetPrevious().GetOwnerEdgeId())
	require.Equal(t, "e1", g.GetPrevious().GetTakenFromEdgeId())
	require.True(t, g.GetSourceGone(), "e2 owned it already; it was taken from e1, which left")

	g, err = ts.claim(t.Context(), "e3", "c1", "r4")
	require.NoError(t, err)
	require.False(t, g.GetSourceGone(), "e2 is alive")
	require.Equal(t, "http://e2", g.GetPreviousOwnerAddress())

	g, err = ts.claim(t.Context(), "e3", "new", "r5")
	require.NoError(t, err)
	require.False(t, g.GetSourceGone(), "nothing to take over")
}

// TestServer_NoLeader: a node that knows no leader refuses writes with
// Unavailable and a NotLeaderDetail, and is not ready.
func TestServer_NoLeader(t *testing.T) {
	ts := newTestServer(t, false, nil)
	require.Error(t, ts.s.Ready())
	_, err := ts.claim(t.Context(), "e1", "c1", "")
	require.Equal(t, connect.CodeUnavailable, connect.CodeOf(err), "%v", err)
	var ce *connect.Error
	require.True(t, errors.As(err, &ce))
	require.Len(t, ce.Details(), 1)
	v, derr := ce.Details()[0].Value()
	require.NoError(t, derr)
	_, ok := v.(*coordinatorv1.NotLeaderDetail)
	require.True(t, ok, "detail is %T", v)
}

// TestServer_LeaseExpiry: a member that stops renewing is marked EXPIRED only
// after its TTL on the leader's clock (a fake one here).
func TestServer_LeaseExpiry(t *testing.T) {
	var mu sync.Mutex
	now := time.Unix(1_000_000, 0)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	ts := newTestServer(t, true, func(c *Config) { c.Now = clock })
	resp := ts.renew(t, "e1", 1)
	require.NotNil(t, resp)
	advance(1900 * time.Millisecond)
	time.Sleep(300 * time.Millisecond) // several leader ticks
	require.Equal(t, raftpb.MemberState_MEMBER_STATE_ALIVE, ts.s.fsm.State().Member("e1").GetState())
	advance(200 * time.Millisecond)
	testutil.Eventually(t, 5*time.Second, func() error {
		if st := ts.s.fsm.State().Member("e1").GetState(); st != raftpb.MemberState_MEMBER_STATE_EXPIRED {
			return fmt.Errorf("e1 is %v", st)
		}
		return nil
	})
}

// TestServer_CustodyAfterRejoin: the sessions of an edge's old incarnation
// go to another edge, never to the rejoined edge itself (the FSM refuses
// that move), and while no other edge lives the leader writes no entry for
// them at all. A later leader finds their custodian in the state.
func TestServer_CustodyAfterRejoin(t *testing.T) {
	ts := newTestServer(t, true, func(c *Config) { c.LeaseTTL = 3 * time.Second }) // ticks every 300ms
	ts.renew(t, "e1", 1)
	const n = 20 // rendezvous hashing over e1 and e2 would give e1 some of them
	for i := range n {
		_, err := ts.claim(t.Context(), "e1", fmt.Sprintf("c%d", i), fmt.Sprintf("r%d", i))
		require.NoError(t, err)
	}
	ts.renew(t, "e1", 2)
	time.Sleep(time.Second)
	idx := ts.s.fsm.State().Index()
	time.Sleep(time.Second)
	require.Equal(t, idx, ts.s.fsm.State().Index(), "custody wrote entries with no edge to move the sessions to")
	require.Equal(t, uint64(1), ts.s.fsm.State().Session("acme", "c0").GetOwnerIncarnation())

	ts.renew(t, "e2", 1)
	// Both edges stay alive from here on: a lease that expired in the
	// window below would be an entry too.
	renewing, stopRenewing := context.WithCancel(t.Context())
	renewed := make(chan struct{})
	go func() {
		defer close(renewed)
		for renewing.Err() == nil {
			for _, m := range []struct {
				id  string
				inc uint64
			}{{"e1", 2}, {"e2", 1}} {
				_, _ = ts.s.RenewLease(renewing, connect.NewRequest(&coordinatorv1.RenewLeaseRequest{MemberId: m.id,
					Role: coordinatorv1.MemberRole_MEMBER_ROLE_EDGE, Incarnation: m.inc, Address: "http://" + m.id,
					State: coordinatorv1.MemberState_MEMBER_STATE_ALIVE}))
			}
			time.Sleep(200 * time.Millisecond)
		}
	}()
	defer func() { stopRenewing(); <-renewed }()
	testutil.Eventually(t, 5*time.Second, func() error {
		for i := range n {
			rec := ts.s.fsm.State().Session("acme", fmt.Sprintf("c%d", i))
			if rec.GetOwnerEdgeId() != "e2" || rec.GetOwnerKind() != raftpb.OwnerKind_OWNER_KIND_CUSTODY {
				return fmt.Errorf("c%d is owned by %s/%d", i, rec.GetOwnerEdgeId(), rec.GetOwnerIncarnation())
			}
		}
		return nil
	})
	idx = ts.s.fsm.State().Index()
	time.Sleep(time.Second)
	require.Equal(t, idx, ts.s.fsm.State().Index(), "custody kept writing entries after every session moved")

	// A later leader knows the custodian from the state alone: the removal
	// of e1/1's routes waits for e2 to report the sessions adopted.
	st := ts.s.fsm.State()
	var highest uint64
	for i := range n {
		highest = max(highest, st.Session("acme", fmt.Sprintf("c%d", i)).GetEpoch())
	}
	_, err := ts.claim(t.Context(), "e2", "c0", "back") // c0's client came back: no longer in custody
	require.NoError(t, err)
	d := newDeadRoutes(time.Second, time.Minute, time.Hour)
	d.add("e1", 1)
	d.add("e3", 1) // dead, with nothing in custody
	d.recallCustody(ts.s.fsm.State())
	e2 := ts.s.fsm.State().Member("e2").GetIncarnation()
	require.Equal(t, map[memberInc]uint64{{"e2", e2}: highest}, d.pending["e1"].custodians)
	require.Empty(t, d.pending["e3"].custodians)
	now := time.Unix(1000, 0)
	d.adopted(edgeRec("e1", 1, expired), now, st.Index())
	d.reported("e2", e2, &coordinatorv1.CustodyProgress{AdoptedThrough: highest - 1})
	require.Empty(t, d.takeDue(now.Add(2*time.Second), anyLive), "e2 has not reported every session adopted")
	d.reported("e2", e2, &coordinatorv1.CustodyProgress{AdoptedThrough: highest})
	require.Equal(t, []deadRoute{{edge: "e1", inc: 1}}, d.takeDue(now.Add(3*time.Second), anyLive))
}

// A session passed on from a custodian that died keeps its custody
// origin: a later leader finds its new custodian for the first dead edge
// too, whose routes may still be the only ones that reach it.
func TestServer_RecallCustodyPassedOn(t *testing.T) {
	ts := newTestServer(t, true, func(c *Config) { c.LeaseTTL = 3 * time.Second })
	ts.renew(t, "e1", 1)
	const n = 5
	for i := range n {
		_, err := ts.claim(t.Context(), "e1", fmt.Sprintf("c%d", i), fmt.Sprintf("r%d", i))
		require.NoError(t, err)
	}
	inCustodyOf := func(edge string, inc uint64) {
		t.Helper()
		testutil.Eventually(t, 5*time.Second, func() error {
			for i := range n {
				rec := ts.s.fsm.State().Session("acme", fmt.Sprintf("c%d", i))
				if rec.GetOwnerKind() != raftpb.OwnerKind_OWNER_KIND_CUSTODY || rec.GetTakenFromEdgeId() != edge || rec.GetTakenFromIncarnation() != inc {
					return fmt.Errorf("c%d: %v", i, rec)
				}
			}
			return nil
		})
	}
	// e1/1 dies (it rejoins as e1/2); e2 takes custody.
	ts.renew(t, "e2", 1)
	ts.renew(t, "e1", 2)
	inCustodyOf("e1", 1)
	// e2/1 dies in turn before adopting them; they pass on.
	ts.renew(t, "e2", 2)
	inCustodyOf("e2", 1)

	st := ts.s.fsm.State()
	want := map[memberInc]uint64{}
	for i := range n {
		rec := st.Session("acme", fmt.Sprintf("c%d", i))
		k := memberInc{rec.GetOwnerEdgeId(), rec.GetOwnerIncarnation()}
		want[k] = max(want[k], rec.GetEpoch())
	}
	d := newDeadRoutes(time.Second, time.Minute, time.Hour)
	d.add("e1", 1)
	d.add("e2", 1)
	d.recallCustody(st)
	require.Equal(t, want, d.pending["e2"].custodians)
	require.Equal(t, want, d.pending["e1"].custodians, "the custodians of the sessions e1/1's death put in custody")
}

// A persistence writer is granted writes for its lease, except while
// another member fails its group over (holds the promotion lease with
// fence_writers, taken since the record last changed): then none, so that
// the promoter, waiting one lease TTL, knows no other writer acknowledges
// through the old primary. A switchover's lease, the promoter itself,
// another group and other roles are not affected, and the grant comes
// back once the new record is in.
func TestServer_WriteGrantDuringFailover(t *testing.T) {
	ts := newTestServer(t, true, nil)
	ctx := t.Context()
	renew := func(id string, group uint32, role coordinatorv1.MemberRole) *durationpb.Duration {
		t.Helper()
		resp, err := ts.s.RenewLease(ctx, connect.NewRequest(&coordinatorv1.RenewLeaseRequest{MemberId: id, Role: role,
			Incarnation: 1, Address: "http://" + id, State: coordinatorv1.MemberState_MEMBER_STATE_ALIVE, RedisGroupId: group}))
		require.NoError(t, err)
		return resp.Msg.GetWriteGrant()
	}
	persistence := coordinatorv1.MemberRole_MEMBER_ROLE_PERSISTENCE
	acquire := func(id string, fence bool) {
		t.Helper()
		resp, err := ts.s.AcquirePromotionLease(ctx, connect.NewRequest(&coordinatorv1.AcquirePromotionLeaseRequest{MemberId: id,
			Incarnation: 1, GroupId: 0, Ttl: durationpb.New(time.Minute), FenceWriters: fence}))
		require.NoError(t, err)
		require.True(t, resp.Msg.GetAcquired())
	}
	for _, id := range []string{"p1", "p2", "p3"} {
		require.Positive(t, renew(id, 0, persistence).AsDuration(), "%s: no promotion yet", id)
	}
	require.Nil(t, renew("e1", 0, coordinatorv1.MemberRole_MEMBER_ROLE_EDGE), "not a writer")

	acquire("p1", false) // a switchover's lease: writers go on
	require.Positive(t, renew("p2", 0, persistence).AsDuration())
	acquire("p1", true) // p1 fails the group over
	require.Zero(t, renew("p2", 0, persistence).AsDuration(), "another writer of the group is granted nothing")
	require.Positive(t, renew("p1", 0, persistence).AsDuration(), "the promoter is")
	require.Positive(t, renew("p3", 1, persistence).AsDuration(), "a writer of another group is")

	// The new record is in: writers are granted again, though p1 still
	// holds the lease.
	_, err := ts.s.CompareAndSetRedisPrimary(ctx, connect.NewRequest(&coordinatorv1.CompareAndSetRedisPrimaryRequest{RequestId: "r1",
		MemberId: "p1", Incarnation: 1, Group: &coordinatorv1.RedisGroupRecord{GroupId: 0, PrimaryAddress: "10.0.0.2:6379"}}))
	require.NoError(t, err)
	require.Positive(t, renew("p2", 0, persistence).AsDuration())
}

// TestServer_WritersPausedForFailover: a failover's lease reports the
// group's other writers paused once each, answered a zero grant under that
// lease, renewed again saying it applied it. A report from before the lease
// does not count; a writer of another group does not hold it up.
func TestServer_WritersPausedForFailover(t *testing.T) {
	ts := newTestServer(t, true, nil)
	ctx := t.Context()
	persistence := coordinatorv1.MemberRole_MEMBER_ROLE_PERSISTENCE
	renew := func(id string, group uint32, paused bool) *durationpb.Duration {
		t.Helper()
		resp, err := ts.s.RenewLease(ctx, connect.NewRequest(&coordinatorv1.RenewLeaseRequest{MemberId: id, Role: persistence,
			Incarnation: 1, Address: "http://" + id, State: coordinatorv1.MemberState_MEMBER_STATE_ALIVE, RedisGroupId: group,
			WritesPaused: paused}))
		require.NoError(t, err)
		return resp.Msg.GetWriteGrant()
	}
	var epoch uint64
	lease := func(fence bool, renewEpoch uint64) *coordinatorv1.AcquirePromotionLeaseResponse {
		t.Helper()
		resp, err := ts.s.AcquirePromotionLease(ctx, connect.NewRequest(&coordinatorv1.AcquirePromotionLeaseRequest{MemberId: "p1",
			Incarnation: 1, GroupId: 0, Ttl: durationpb.New(time.Minute), FenceWriters: fence, RenewEpoch: renewEpoch}))
		require.NoError(t, err)
		return resp.Msg
	}
	acquire := func() bool {
		t.Helper()
		l := lease(true, epoch)
		require.True(t, l.GetAcquired())
		return l.GetWritersPaused()
	}
	renew("p1", 0, false)
	renew("p2", 0, true) // paused for an earlier failover, say
	renew("p3", 0, false)
	renew("p4", 1, false)
	// p1 holds the lease for a reconcile, taken before the group's record:
	// its failover's lease is a new one, newer than the record, or nobody
	// would be fenced.
	reconcile := lease(false, 0).GetLeaseEpoch()
	_, err := ts.s.CompareAndSetRedisPrimary(ctx, connect.NewRequest(&coordinatorv1.CompareAndSetRedisPrimaryRequest{RequestId: "r1",
		MemberId: "p1", Incarnation: 1, Group: &coordinatorv1.RedisGroupRecord{GroupId: 0, PrimaryAddress: "10.0.0.1:6379"}}))
	require.NoError(t, err)
	first := lease(true, 0)
	require.True(t, first.GetAcquired())
	epoch = first.GetLeaseEpoch()
	require.Greater(t, epoch, reconcile, "a failover's lease is a new one")
	require.False(t, lease(true, epoch+1).GetAcquired(), "a renewal of another lease epoch is refused")
	require.False(t, acquire(), "nobody paused under this lease yet")
	require.Zero(t, renew("p2", 0, true).AsDuration())
	require.False(t, acquire(), "p2's report came with the grant, before it applied it")
	require.Zero(t, renew("p2", 0, true).AsDuration())
	require.Zero(t, renew("p3", 0, false).AsDuration())
	require.False(t, acquire(), "p3 has not applied its zero grant")
	require.Zero(t, renew("p3", 0, true).AsDuration())
	require.True(t, acquire(), "both other writers of group 0 paused; p4 writes to group 1")
}

// TestServer_BumpAclVersion: a bump is one Raft entry whose index is the
// tenant's new version, kept in the FSM (for watch snapshots) and published to
// the watch hub; versions only grow, the empty tenant (cluster-wide rules) is
// accepted, and a malformed tenant is refused without touching the log.
func TestServer_BumpAclVersion(t *testing.T) {
	ts := newTestServer(t, true, nil)
	bump := func(tenant string) (uint64, error) {
		resp, err := ts.s.BumpAclVersion(t.Context(), connect.NewRequest(&coordinatorv1.BumpAclVersionRequest{Tenant: tenant}))
		if err != nil {
			return 0, err
		}
		return resp.Msg.GetVersion(), nil
	}
	from := ts.s.fsm.State().Index()
	v1, err := bump("acme")
	require.NoError(t, err)
	require.Equal(t, ts.s.fsm.State().Index(), v1, "the version is the index of the bump")
	v2, err := bump("acme")
	require.NoError(t, err)
	require.Greater(t, v2, v1)
	vAll, err := bump("")
	require.NoError(t, err)
	require.Greater(t, vAll, v2)

	versions := map[string]uint64{}
	for _, a := range ts.s.fsm.State().ACLVersions() {
		versions[a.GetTenant()] = a.GetVersion()
	}
	require.Equal(t, map[string]uint64{"acme": v2, "": vAll}, versions)

	evs, gap, _ := ts.s.hub.since(from)
	require.False(t, gap)
	var got []uint64
	for _, e := range evs {
		if e.ev.Kind == fsm.EventACL {
			msg := ts.s.watchEvent(e, "e1")
			require.NotNil(t, msg.GetAclVersion(), "an ACL event reaches every watcher")
			require.Equal(t, e.index, msg.GetAclVersion().GetVersion())
			got = append(got, msg.GetAclVersion().GetVersion())
		}
	}
	require.Equal(t, []uint64{v1, v2, vAll}, got)

	before := ts.s.fsm.State().Index()
	for _, bad := range []string{"Acme", "a b", strings.Repeat("x", 64)} {
		_, err := bump(bad)
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%q: %v", bad, err)
	}
	require.Equal(t, before, ts.s.fsm.State().Index(), "refused bumps write nothing")
}

// TestServer_BumpAclVersionNoLeader: a node without a leader refuses the
// bump with Unavailable, so keelctl retries elsewhere.
func TestServer_BumpAclVersionNoLeader(t *testing.T) {
	ts := newTestServer(t, false, nil)
	_, err := ts.s.BumpAclVersion(t.Context(), connect.NewRequest(&coordinatorv1.BumpAclVersionRequest{Tenant: "acme"}))
	require.Equal(t, connect.CodeUnavailable, connect.CodeOf(err), "%v", err)
}

// The first leader installs the slot table for K groups; K is fixed then:
// a leader configured with another K keeps the table.
func TestServer_SlotTableInstalledOnce(t *testing.T) {
	ts := newTestServer(t, true, func(c *Config) { c.RedisGroups = 3 })
	var cfg *coordinatorv1.ClusterConfig
	testutil.Eventually(t, 5*time.Second, func() error {
		cfg = ts.s.clusterConfig(ts.s.fsm.State())
		if len(cfg.GetSlotGroups()) == 0 {
			return errors.New("no slot table yet")
		}
		return nil
	})
	require.Equal(t, uint32(3), cfg.GetRedisGroupCount())
	require.NoError(t, slots.Table(cfg.GetSlotGroups()).Validate(3))
	version := ts.s.fsm.State().SlotTable().GetVersion()

	ts.s.cfg.RedisGroups = 2
	ts.s.installSlotTable(t.Context(), ts.s.fsm.State())
	require.Equal(t, version, ts.s.fsm.State().SlotTable().GetVersion())
	require.Equal(t, uint32(3), ts.s.clusterConfig(ts.s.fsm.State()).GetRedisGroupCount())

	// One group gets a table too, every slot in group 0, so that members
	// can tell one group from a table not installed yet.
	one := newTestServer(t, true, nil)
	testutil.Eventually(t, 5*time.Second, func() error {
		if one.s.fsm.State().SlotTable() == nil {
			return errors.New("no slot table yet")
		}
		return nil
	})
	require.NoError(t, slots.Table(one.s.fsm.State().SlotTable().GetSlotGroups()).Validate(1))
	require.Equal(t, uint32(1), one.s.clusterConfig(one.s.fsm.State()).GetRedisGroupCount())
}

// A call that finds a term's batcher as the term ends is told the node is
// not the leader (the edge retries at the new one), not left waiting until
// its deadline.
func TestBatcher_ACallAfterTheTermEndedIsToldNotLeader(t *testing.T) {
	b := newBatcher(&Server{cfg: Config{MaxClaimsPerEntry: 8}}, releaseBatches,
		prometheus.NewHistogram(prometheus.HistogramOpts{Name: "x"}))
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	b.run(ctx) // the term is over: run answers what it took and returns
	call, stop := context.WithTimeout(t.Context(), 5*time.Second)
	defer stop()
	start := time.Now()
	_, err := b.submit(call, []*raftpb.ReleaseSessionCommand{{Tenant: "acme", ClientId: "c"}})
	require.ErrorIs(t, err, raftnode.ErrNotLeader)
	require.Less(t, time.Since(start), time.Second)
}
