// Package cluster connects the edge to the cluster services: its lease and
// session ownership at the coordinator.
package cluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	"github.com/keelmq/keel/libs/rpc"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	"github.com/keelmq/keel/proto/gen/keel/coordinator/v1/coordinatorv1connect"
	"github.com/keelmq/keel/services/edge/internal/broker"
)

// ErrFenced means the edge's lease lapsed: it must not acknowledge anything
// until it has rejoined.
var ErrFenced = errors.New("edge lease lapsed")

// Member holds the edge's lease at the coordinator, renewing it every TTL/3.
// The lease is valid until the remaining time the leader last reported,
// minus a safety margin, counted from when the renewal was sent; when it
// runs out without a renewal the edge fences itself (OnFence), and rejoins
// with a new incarnation once the coordinator answers again (OnJoin).
type Member struct {
	Client  coordinatorv1connect.CoordinatorServiceClient
	ID      string
	Address string
	Logger  *slog.Logger
	// Margin is subtracted from the granted time (clock rates differ).
	Margin time.Duration
	// OnFence and OnJoin are called from Run's goroutine.
	OnFence func()
	OnJoin  func(incarnation uint64)

	// incarnation is read for every forwarded message: an atomic, not a
	// field under mu, which the publishers' goroutines contended for.
	incarnation atomic.Uint64
	mu          sync.Mutex
	validUntil  time.Time
	interval    time.Duration
	custody     func() uint64 // nil: custody progress is not reported
	claims      ClaimReporter // nil: claims are not reported
}

// ClaimReporter is what the lease renewals say of the edge's own claims
// (the broker): the coordinator keeps a dead edge's routes until every
// session claimed from it is held by its claimant, and tells the reporter
// the Raft index it has applied, which every later claim's epoch exceeds.
type ClaimReporter interface {
	ClaimsSettled() (through uint64, unfinishedFrom []string)
	ObserveIndex(index uint64)
}

// ReportCustody makes every lease renewal carry the edge's custody progress
// (through: [Watch.AdoptedThrough]), so that the coordinator removes a dead
// edge's routes only once this edge registered the routes of the sessions
// it adopted from it.
func (m *Member) ReportCustody(through func() uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.custody = through
}

// ReportClaims makes every lease renewal carry the state of the edge's own
// claims, and hands the coordinator's applied index back to r.
func (m *Member) ReportClaims(r ClaimReporter) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.claims = r
}

// NewClient returns a coordinator client for baseURL (the Connect
// protocol, HTTP/2: a coordinator serves h2c). Its calls share an HTTP/2
// connection ([rpc.LeaseClient]; up to [rpc.MaxConcurrentStreams] at
// once), so that a connect storm's claims and releases cost no connection
// each; one silent for [rpc.LeaseSilence] is replaced before the lease is
// at risk, and so is one idle after a renewal failed (RenewLease).
// WatchCluster alone goes over HTTP/1.1, a connection per stream: a watch
// that went silent (Watch) opens its next stream on a new connection, as
// cancelling an HTTP/1.1 request closes its connection, where on the
// shared one it would wait for the pings to give that up.
func NewClient(baseURL string) coordinatorv1connect.CoordinatorServiceClient {
	hc := rpc.LeaseClient()
	return coordinatorClient{
		CoordinatorServiceClient: coordinatorv1connect.NewCoordinatorServiceClient(hc, baseURL, rpc.ClientOptions()...),
		http:                     hc,
		watch:                    coordinatorv1connect.NewCoordinatorServiceClient(watchHTTP, baseURL, rpc.ClientOptions()...),
	}
}

type coordinatorClient struct {
	coordinatorv1connect.CoordinatorServiceClient
	http  *http.Client
	watch coordinatorv1connect.CoordinatorServiceClient
}

// RenewLease gives the connection up, once no call is on it, after a
// renewal that timed out or found the coordinator unavailable: a
// coordinator that still answers pings but cannot serve (a follower cut
// off from the leader) would otherwise get every renewal until the lease
// lapsed, where a new connection may reach another coordinator behind the
// same address.
func (c coordinatorClient) RenewLease(ctx context.Context, req *connect.Request[coordinatorv1.RenewLeaseRequest]) (*connect.Response[coordinatorv1.RenewLeaseResponse], error) {
	resp, err := c.CoordinatorServiceClient.RenewLease(ctx, req)
	rpc.RedialAfter(c.http, err)
	return resp, err
}

func (c coordinatorClient) WatchCluster(ctx context.Context, req *connect.Request[coordinatorv1.WatchClusterRequest]) (*connect.ServerStreamForClient[coordinatorv1.WatchClusterResponse], error) {
	return c.watch.WatchCluster(ctx, req)
}

// watchHTTP carries watches: the services' transport (dialing, TLS), but
// HTTP/1.1 whatever the URL's scheme (an https one would otherwise agree
// on HTTP/2), one connection per stream, kept idle for the next one.
var watchHTTP = func() *http.Client {
	t := rpc.H2CTransport()
	t.Protocols = new(http.Protocols)
	t.Protocols.SetHTTP1(true)
	t.IdleConnTimeout = 90 * time.Second
	t.TLSHandshakeTimeout = 10 * time.Second
	return &http.Client{Transport: t}
}()

// Incarnation returns the current incarnation (0 before the first join).
func (m *Member) Incarnation() uint64 { return m.incarnation.Load() }

// Valid reports whether the lease is valid now.
func (m *Member) Valid() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return time.Now().Before(m.validUntil)
}

// Join takes a lease under a new incarnation (higher than any before: the
// wall clock in nanoseconds) and returns once the coordinator granted it.
func (m *Member) Join(ctx context.Context) error {
	inc := max(uint64(time.Now().UnixNano()), m.incarnation.Load()+1)
	if err := m.renew(ctx, inc); err != nil {
		return err
	}
	m.incarnation.Store(inc)
	if m.OnJoin != nil {
		m.OnJoin(inc)
	}
	return nil
}

func (m *Member) renew(ctx context.Context, inc uint64) error {
	sent := time.Now()
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req := &coordinatorv1.RenewLeaseRequest{
		MemberId: m.ID, Role: coordinatorv1.MemberRole_MEMBER_ROLE_EDGE, Incarnation: inc,
		Address: m.Address, State: coordinatorv1.MemberState_MEMBER_STATE_ALIVE,
	}
	m.mu.Lock()
	custody, claims := m.custody, m.claims
	m.mu.Unlock()
	if custody != nil || claims != nil {
		req.Custody = &coordinatorv1.CustodyProgress{}
	}
	if custody != nil {
		req.Custody.AdoptedThrough = custody()
	}
	if claims != nil {
		req.Custody.ClaimsSettledThrough, req.Custody.UnfinishedFrom = claims.ClaimsSettled()
	}
	resp, err := m.Client.RenewLease(cctx, connect.NewRequest(req))
	if err != nil {
		return err
	}
	if claims != nil {
		claims.ObserveIndex(resp.Msg.GetAppliedIndex())
	}
	ttl := resp.Msg.GetRemainingTtl().AsDuration()
	if ttl <= 0 {
		return fmt.Errorf("coordinator granted no time (state %v)", resp.Msg.GetState())
	}
	m.mu.Lock()
	m.validUntil = sent.Add(ttl - m.Margin)
	m.interval = max(ttl/3, 10*time.Millisecond)
	m.mu.Unlock()
	return nil
}

// Run renews the lease until ctx ends; Join must have succeeded first.
func (m *Member) Run(ctx context.Context) error {
	fenced, failed := false, false
	for {
		m.mu.Lock()
		wait := m.interval
		if fenced {
			wait = 200 * time.Millisecond
		} else if failed {
			// Again soon: a renewal lost to a dead connection or a leader
			// change must not cost the lease a whole interval.
			wait = min(wait, retryRenewal)
		}
		m.mu.Unlock()
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
		if fenced {
			if err := m.Join(ctx); err == nil {
				fenced, failed = false, false
				m.log().Info("rejoined the cluster", "incarnation", m.Incarnation())
			}
			continue
		}
		err := m.renew(ctx, m.Incarnation())
		failed = err != nil
		if err == nil {
			continue
		}
		if connect.CodeOf(err) == connect.CodeFailedPrecondition || !m.Valid() {
			// The coordinator declared this incarnation dead, or the lease ran
			// out while it could not be renewed: stop acknowledging.
			m.log().Error("lease lapsed; fencing this edge", "error", err)
			fenced = true
			m.mu.Lock()
			m.validUntil = time.Time{}
			m.mu.Unlock()
			if m.OnFence != nil {
				m.OnFence()
			}
			continue
		}
		m.log().Warn("lease renewal failed; retrying", "error", err)
	}
}

// retryRenewal is the wait after a failed lease renewal.
const retryRenewal = 500 * time.Millisecond

func (m *Member) log() *slog.Logger {
	if m.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return m.Logger
}

// Ownership claims and releases sessions at the coordinator. Concurrent
// claims are sent together in ClaimSessions calls, concurrent releases in
// ReleaseSessions calls: a connect storm, and the disconnects that end it,
// cost few calls and few Raft entries.
type Ownership struct {
	Client coordinatorv1connect.CoordinatorServiceClient
	Member *Member
	// MaxBatch bounds the claims, and the releases, per call; Linger is how
	// long one waits for others to join its call.
	MaxBatch int
	Linger   time.Duration

	claims   gather[*claim]
	releases gather[*release]
	// unbatchedUntil (unix nanoseconds) is set when the coordinator
	// answered that it has no ReleaseSessions (a version before it, during
	// a rolling update): until then releases go one per call.
	unbatchedUntil atomic.Int64
}

// unbatchedFor is how long releases go one per call after a coordinator
// without ReleaseSessions; the next batch then finds out again.
const unbatchedFor = time.Minute

// gather collects the items of concurrent callers into batches of up to
// max, each sent once full or linger after its first item.
type gather[T any] struct {
	mu      sync.Mutex
	pending []T
	timer   *time.Timer
}

func (g *gather[T]) add(item T, maxBatch int, linger time.Duration, send func([]T)) {
	g.mu.Lock()
	g.pending = append(g.pending, item)
	if len(g.pending) >= max(maxBatch, 1) {
		batch := g.pending
		g.pending = nil
		if g.timer != nil {
			g.timer.Stop()
			g.timer = nil
		}
		g.mu.Unlock()
		go send(batch)
		return
	}
	if g.timer == nil {
		g.timer = time.AfterFunc(linger, func() {
			g.mu.Lock()
			batch := g.pending
			g.pending = nil
			g.timer = nil
			g.mu.Unlock()
			if len(batch) > 0 {
				send(batch)
			}
		})
	}
	g.mu.Unlock()
}

type claim struct {
	req  *coordinatorv1.SessionClaim
	done chan claimResult
}

type claimResult struct {
	grant broker.Grant
	err   error
}

// Claim implements the edge's Ownership interface.
func (o *Ownership) Claim(ctx context.Context, tenant, clientID string) (broker.Grant, error) {
	return o.ClaimFrom(ctx, tenant, clientID, "")
}

// ClaimFrom implements broker.ConditionalOwnership: with a non-empty owner
// the claim is granted only while the session's owner is that edge
// (broker.ErrOwnerChanged otherwise).
func (o *Ownership) ClaimFrom(ctx context.Context, tenant, clientID, owner string) (broker.Grant, error) {
	if !o.Member.Valid() {
		return broker.Grant{}, ErrFenced
	}
	c := &claim{req: &coordinatorv1.SessionClaim{RequestId: requestID(), ExpectedOwner: owner,
		Session: &commonv1.SessionKey{Tenant: tenant, ClientId: clientID}}, done: make(chan claimResult, 1)}
	o.claims.add(c, o.MaxBatch, o.Linger, o.sendClaims)
	select {
	case r := <-c.done:
		return r.grant, r.err
	case <-ctx.Done():
		return broker.Grant{}, ctx.Err()
	}
}

// sendClaims makes one ClaimSessions call, retried (same request IDs, so
// the coordinator applies each claim once) while the coordinator is
// unavailable.
func (o *Ownership) sendClaims(batch []*claim) {
	req := &coordinatorv1.ClaimSessionsRequest{EdgeId: o.Member.ID, Incarnation: o.Member.Incarnation()}
	for _, c := range batch {
		req.Claims = append(req.Claims, c.req)
	}
	var resp *connect.Response[coordinatorv1.ClaimSessionsResponse]
	err := retryBatch(func(ctx context.Context) (err error) {
		resp, err = o.Client.ClaimSessions(ctx, connect.NewRequest(req))
		return err
	})
	for i, c := range batch {
		switch {
		case err != nil:
			c.done <- claimResult{err: fmt.Errorf("claim session: %w", err)}
		case i >= len(resp.Msg.GetResults()):
			c.done <- claimResult{err: errors.New("claim session: short answer")}
		default:
			r := resp.Msg.GetResults()[i]
			if g := r.GetGrant(); g != nil {
				c.done <- claimResult{grant: broker.Grant{Epoch: g.GetEpoch(), Previous: g.GetPrevious().GetOwnerEdgeId(),
					PreviousEpoch: g.GetPrevious().GetEpoch(), TakenFrom: g.GetPrevious().GetTakenFromEdgeId(),
					SourceGone: g.GetSourceGone()}}
			} else if code := r.GetError().GetCode(); code == coordinatorv1.ClaimErrorCode_CLAIM_ERROR_CODE_OWNER_CHANGED {
				c.done <- claimResult{err: fmt.Errorf("claim session: %w: %s", broker.ErrOwnerChanged, r.GetError().GetMessage())}
			} else if code == coordinatorv1.ClaimErrorCode_CLAIM_ERROR_CODE_SUPERSEDED {
				c.done <- claimResult{err: fmt.Errorf("claim session: %w: %s", broker.ErrClaimSuperseded, r.GetError().GetMessage())}
			} else {
				c.done <- claimResult{err: fmt.Errorf("claim session: %v: %s", r.GetError().GetCode(), r.GetError().GetMessage())}
			}
		}
	}
}

// retryBatch makes a batch's call, each try bounded to 5 s, again while
// the coordinator is unavailable, for up to 10 s.
func retryBatch(call func(ctx context.Context) error) error {
	retrying, stop := context.WithTimeout(context.Background(), 10*time.Second)
	defer stop()
	return whileUnavailable(retrying, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return call(ctx)
	})
}

// Owner implements broker.OwnerLookup from the leader's record.
func (o *Ownership) Owner(ctx context.Context, tenant, clientID string) (string, uint64, error) {
	resp, err := o.Client.GetSession(ctx, connect.NewRequest(&coordinatorv1.GetSessionRequest{
		Session: &commonv1.SessionKey{Tenant: tenant, ClientId: clientID}}))
	if err != nil {
		return "", 0, err
	}
	rec := resp.Msg.GetSession()
	return rec.GetOwnerEdgeId(), rec.GetEpoch(), nil
}

type release struct {
	req  *coordinatorv1.SessionRelease
	done chan error
}

// Release gives a session up (a clean session ended). Concurrent releases
// go together in ReleaseSessions calls, retried (same request IDs, so the
// coordinator applies each once) while the coordinator is unavailable: the
// calls in flight on a connection that was given up all fail at once, and
// a release lost leaves the session's record at the coordinator naming
// this edge. A release refused (the session was claimed again since) is
// an error.
func (o *Ownership) Release(ctx context.Context, tenant, clientID string, epoch uint64) error {
	r := &release{req: &coordinatorv1.SessionRelease{RequestId: requestID(),
		Session: &commonv1.SessionKey{Tenant: tenant, ClientId: clientID}, Epoch: epoch}, done: make(chan error, 1)}
	if time.Now().UnixNano() < o.unbatchedUntil.Load() {
		return o.releaseAlone(ctx, r.req)
	}
	o.releases.add(r, o.MaxBatch, o.Linger, o.sendReleases)
	select {
	case err := <-r.done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (o *Ownership) sendReleases(batch []*release) {
	req := &coordinatorv1.ReleaseSessionsRequest{EdgeId: o.Member.ID, Incarnation: o.Member.Incarnation()}
	for _, r := range batch {
		req.Releases = append(req.Releases, r.req)
	}
	var resp *connect.Response[coordinatorv1.ReleaseSessionsResponse]
	err := retryBatch(func(ctx context.Context) (err error) {
		resp, err = o.Client.ReleaseSessions(ctx, connect.NewRequest(req))
		return err
	})
	if connect.CodeOf(err) == connect.CodeUnimplemented {
		// A coordinator older than ReleaseSessions, during a rolling upgrade.
		o.unbatchedUntil.Store(time.Now().Add(unbatchedFor).UnixNano())
		for _, r := range batch {
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				r.done <- o.releaseAlone(ctx, r.req)
			}()
		}
		return
	}
	var res []*coordinatorv1.ReleaseResult
	if err == nil {
		res = resp.Msg.GetResults()
	}
	for i, r := range batch {
		switch {
		case err != nil:
			r.done <- fmt.Errorf("release session: %w", err)
		case i >= len(res):
			r.done <- errors.New("release session: short answer")
		case res[i].GetError() != nil:
			r.done <- fmt.Errorf("release session: %v: %s", res[i].GetError().GetCode(), res[i].GetError().GetMessage())
		default:
			r.done <- nil
		}
	}
}

// releaseAlone is a release in a call of its own, retried while the
// coordinator is unavailable and ctx lasts.
func (o *Ownership) releaseAlone(ctx context.Context, r *coordinatorv1.SessionRelease) error {
	req := &coordinatorv1.ReleaseSessionRequest{Session: r.GetSession(), Epoch: r.GetEpoch(),
		EdgeId: o.Member.ID, Incarnation: o.Member.Incarnation(), RequestId: r.GetRequestId()}
	return whileUnavailable(ctx, func() error {
		_, err := o.Client.ReleaseSession(ctx, connect.NewRequest(req))
		return err
	})
}

// whileUnavailable calls try until it returns anything but an Unavailable
// error (a coordinator without a leader, or a connection given up), or ctx
// ends, waiting 20 ms, doubling to 1 s, between tries. It returns try's
// last error.
func whileUnavailable(ctx context.Context, try func() error) error {
	for backoff := 20 * time.Millisecond; ; backoff = min(2*backoff, time.Second) {
		err := try()
		if err == nil || connect.CodeOf(err) != connect.CodeUnavailable {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(backoff):
		}
	}
}

func requestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
