package failover

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	"github.com/keelmq/keel/proto/gen/keel/coordinator/v1/coordinatorv1connect"
)

// CoordinatorRecords is [Records] on the coordinator's Connect API: the
// group record lives in Raft, and a compare-and-set needs the group's
// promotion lease, which [CoordinatorRecords.AcquirePromotionLease] takes.
type CoordinatorRecords struct {
	Client      coordinatorv1connect.CoordinatorServiceClient
	GroupID     uint32
	MemberID    string
	Incarnation uint64
}

var _ Records = (*CoordinatorRecords)(nil)

// Get implements [Records]; a group without a record gives [ErrNoRecord].
func (c *CoordinatorRecords) Get(ctx context.Context) (Record, error) {
	resp, err := c.Client.GetRedisPrimary(ctx, connect.NewRequest(&coordinatorv1.GetRedisPrimaryRequest{GroupId: c.GroupID}))
	if connect.CodeOf(err) == connect.CodeNotFound {
		return Record{}, ErrNoRecord
	}
	if err != nil {
		return Record{}, fmt.Errorf("get redis primary: %w", err)
	}
	return fromProto(resp.Msg.GetGroup()), nil
}

func fromProto(g *coordinatorv1.RedisGroupRecord) Record {
	return Record{Primary: g.GetPrimaryAddress(), Replicas: g.GetReplicaAddresses(), Epoch: g.GetRecordEpoch()}
}

// CompareAndSet implements [Records]. The caller must hold the promotion
// lease; the coordinator assigns the new epoch (its Raft index).
func (c *CoordinatorRecords) CompareAndSet(ctx context.Context, oldEpoch uint64, next Record) (Record, error) {
	var b [12]byte
	_, _ = rand.Read(b[:])
	req := &coordinatorv1.CompareAndSetRedisPrimaryRequest{RequestId: hex.EncodeToString(b[:]), MemberId: c.MemberID,
		Incarnation: c.Incarnation, ExpectedRecordEpoch: oldEpoch,
		Group: &coordinatorv1.RedisGroupRecord{GroupId: c.GroupID, PrimaryAddress: next.Primary, ReplicaAddresses: next.Replicas}}
	// Retried with the same request ID across leader changes: idempotent.
	var lastErr error
	for attempt := 0; attempt < 20; attempt++ {
		resp, err := c.Client.CompareAndSetRedisPrimary(ctx, connect.NewRequest(req))
		if err == nil {
			if !resp.Msg.GetSwapped() {
				return fromProto(resp.Msg.GetGroup()), ErrRecordChanged
			}
			return fromProto(resp.Msg.GetGroup()), nil
		}
		lastErr = err
		if c := connect.CodeOf(err); c == connect.CodeInvalidArgument || c == connect.CodeFailedPrecondition {
			break
		}
		select {
		case <-ctx.Done():
			return Record{}, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return Record{}, fmt.Errorf("compare-and-set redis primary: %w", lastErr)
}

// AcquirePromotionLease takes (or renews) the group's promotion lease for
// ttl, not fencing the group's writers (a reconcile, a switchover or the
// bootstrap; a failover's is FailoverLease), and reports whether this
// member holds it.
func (c *CoordinatorRecords) AcquirePromotionLease(ctx context.Context, ttl time.Duration) (bool, error) {
	resp, err := c.Client.AcquirePromotionLease(ctx, connect.NewRequest(&coordinatorv1.AcquirePromotionLeaseRequest{
		MemberId: c.MemberID, Incarnation: c.Incarnation, GroupId: c.GroupID, Ttl: durationpb.New(ttl)}))
	if err != nil {
		return false, fmt.Errorf("acquire promotion lease: %w", err)
	}
	return resp.Msg.GetAcquired(), nil
}

// FailoverLease is a failover's promotion lease, as the coordinator
// answered for it.
type FailoverLease struct {
	Acquired bool
	// Epoch identifies the lease: renewals name it.
	Epoch uint64
	// WritersPaused: every other writer of the group has paused under it
	// (AcquirePromotionLeaseResponse.writers_paused).
	WritersPaused bool
}

// FailoverLease takes the group's promotion lease for a failover
// (fence_writers) for ttl, a new one even if this member holds the lease
// already, or with renew set renews the failover lease of that epoch.
func (c *CoordinatorRecords) FailoverLease(ctx context.Context, ttl time.Duration, renew uint64) (FailoverLease, error) {
	resp, err := c.Client.AcquirePromotionLease(ctx, connect.NewRequest(&coordinatorv1.AcquirePromotionLeaseRequest{
		MemberId: c.MemberID, Incarnation: c.Incarnation, GroupId: c.GroupID, Ttl: durationpb.New(ttl), FenceWriters: true,
		RenewEpoch: renew}))
	if err != nil {
		return FailoverLease{}, fmt.Errorf("failover lease: %w", err)
	}
	return FailoverLease{Acquired: resp.Msg.GetAcquired(), Epoch: resp.Msg.GetLeaseEpoch(), WritersPaused: resp.Msg.GetWritersPaused()}, nil
}

// Bootstrap publishes the first record of a group that has none, naming
// primary; it needs the promotion lease. A group that has a record keeps it.
func (c *CoordinatorRecords) Bootstrap(ctx context.Context, primary string, replicas []string, leaseTTL time.Duration) (Record, error) {
	rec, err := c.Get(ctx)
	if !errors.Is(err, ErrNoRecord) {
		return rec, err
	}
	ok, err := c.AcquirePromotionLease(ctx, leaseTTL)
	if err != nil {
		return Record{}, err
	}
	if !ok {
		return Record{}, fmt.Errorf("%w: another member is bootstrapping the group", ErrRecordChanged)
	}
	rec, err = c.CompareAndSet(ctx, 0, Record{Primary: primary, Replicas: replicas})
	if errors.Is(err, ErrRecordChanged) {
		return rec, nil
	}
	return rec, err
}
