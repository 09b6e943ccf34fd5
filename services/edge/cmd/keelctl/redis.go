package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/keelmq/keel/libs/config"

	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
)

// Bounds of "keelctl redis failover".
const (
	// defaultSwitchoverTimeout and maxSwitchoverTimeout bound --timeout,
	// the wait for the target to catch up with the paused primary (the
	// persistence service's own default and cap).
	defaultSwitchoverTimeout = 10 * time.Second
	maxSwitchoverTimeout     = 60 * time.Second
	// switchoverSlack is added to --timeout for the whole call: waiting for
	// the promotion lease (a reconcile or failover elsewhere may hold it for
	// up to its TTL), the promotion and the publication of the record.
	switchoverSlack = 45 * time.Second
)

// redisFailover is "keelctl redis failover": a planned switchover of the
// Redis group of the persistence instance at --persistence, while its
// primary is alive. The instance pauses writes on the primary, waits until
// the target replica holds every byte of it, promotes it and publishes the
// new record, then makes the old primary a replica of the new one; no
// acknowledged write is lost. A dead primary needs no command: the
// persistence instances fail it over by themselves.
//
// It calls once, without retrying on Unavailable as the read commands do:
// a switchover that happened but whose answer was lost must not run again.
func redisFailover(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("keelctl redis failover", flag.ContinueOnError)
	fs.SetOutput(stderr)
	persistence := fs.String("persistence", "", "persistence API URL (env KEEL_PERSISTENCE)")
	to := fs.String("to", "", "replica to promote, host:port as in the group record (default: the replica with the highest offset)")
	timeout := fs.Duration("timeout", defaultSwitchoverTimeout, "how long the target may take to catch up with the paused primary")
	output := fs.String("o", "table", "output: table or json")
	if err := config.Parse(fs, args); err != nil {
		return err
	}
	switch {
	case fs.NArg() != 0:
		return fmt.Errorf("redis failover: takes no arguments\n%w", errUsage)
	case *persistence == "":
		return errors.New("redis failover: give --persistence URL (or KEEL_PERSISTENCE)")
	case *output != "table" && *output != "json":
		return fmt.Errorf("-o %q: give table or json", *output)
	case *timeout <= 0 || *timeout > maxSwitchoverTimeout:
		return fmt.Errorf("redis failover: --timeout %v: give more than 0 and at most %v", *timeout, maxSwitchoverTimeout)
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout+switchoverSlack)
	defer cancel()
	resp, err := persistenceClient(*persistence).Switchover(ctx, connect.NewRequest(&persistencev1.SwitchoverRequest{
		To: *to, Timeout: durationpb.New(*timeout)}))
	if err != nil {
		hint := ""
		switch connect.CodeOf(err) {
		case connect.CodeInvalidArgument, connect.CodeFailedPrecondition, connect.CodeAborted:
			hint = " (the switchover did not happen)"
		case connect.CodeUnknown, connect.CodeDeadlineExceeded, connect.CodeCanceled:
			hint = " (the outcome is not known: check the group record with `keelctl cluster status`)"
		}
		return fmt.Errorf("redis failover at %s%s: %w", *persistence, hint, err)
	}
	sw := resp.Msg
	if *output == "json" {
		return writeJSON(stdout, map[string]proto.Message{"switchover": sw})
	}
	fmt.Fprintf(stdout, "redis primary moved from %s to %s; writes were paused for %v\n",
		sw.GetOldPrimary(), sw.GetNewPrimary(), sw.GetPausedFor().AsDuration().Round(time.Millisecond))
	tw := newTable(stdout)
	old := sw.GetOldPrimary() + " (now a replica of the new primary)"
	if !sw.GetOldPrimaryDemoted() {
		old = sw.GetOldPrimary() + " (NOT demoted: it stays paused until its pause ends, then the failover loop demotes it)"
	}
	fmt.Fprintf(tw, "OLD PRIMARY\t%s\n", old)
	fmt.Fprintf(tw, "NEW PRIMARY\t%s\n", sw.GetNewPrimary())
	fmt.Fprintf(tw, "RECORD EPOCH\t%d (was %d)\n", sw.GetRecordEpoch(), sw.GetOldRecordEpoch())
	fmt.Fprintf(tw, "REPLICAS\t%s\n", joinOrDash(sw.GetReplicaAddresses()))
	fmt.Fprintf(tw, "OFFSET\t%d\n", sw.GetOffset())
	return tw.Flush()
}

// redisStatus is "keelctl redis status": every node of the Redis group of
// the persistence instance at --persistence, as it answered.
func redisStatus(ctx context.Context, stdout io.Writer, f clusterFlags) error {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	c := persistenceClient(f.persistence)
	g, err := call(ctx, "describe group", f.persistence, c.DescribeGroup, &persistencev1.DescribeGroupRequest{})
	if err != nil {
		return err
	}
	if f.output == "json" {
		return writeJSON(stdout, map[string]proto.Message{"group": g})
	}
	fmt.Fprintf(stdout, "primary %s, record epoch %d\n", g.GetPrimary(), g.GetRecordEpoch())
	tw := newTable(stdout)
	fmt.Fprintln(tw, "NODE\tROLE\tFOLLOWS\tLINK\tLAG\tWRITE EPOCH/SEQ\tMEMORY\tAOF")
	for _, n := range g.GetNodes() {
		if n.GetError() != "" {
			fmt.Fprintf(tw, "%s\tunreachable: %s\t\t\t\t\t\t\n", n.GetAddress(), n.GetError())
			continue
		}
		follows, link, lag := "-", "-", "-"
		if n.GetRole() == "slave" {
			follows, link = n.GetFollowing(), "down"
			if n.GetLinkUp() {
				link = "up"
			}
		}
		if l := n.GetLagBytes(); l >= 0 && n.GetAddress() != g.GetPrimary() {
			lag = fmt.Sprintf("%d B", l)
		}
		memory := formatBytes(n.GetUsedMemory())
		if m := n.GetMaxMemory(); m > 0 {
			memory += fmt.Sprintf(" / %s (%.0f%%)", formatBytes(m), 100*float64(n.GetUsedMemory())/float64(m))
		}
		aof := "-"
		if n.GetAofRewriting() {
			aof = "rewriting"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d/%d\t%s\t%s\n", n.GetAddress(), n.GetRole(), follows, link, lag,
			n.GetWriteEpoch(), n.GetWriteSeq(), memory, aof)
	}
	return tw.Flush()
}

// tenantUsage is "keelctl tenant usage": what the tenant holds, summed over
// the persistence instances given (one per Redis group).
func tenantUsage(ctx context.Context, stdout io.Writer, f clusterFlags) error {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	var sum persistencev1.TenantUsageResponse
	per := map[string]proto.Message{}
	urls := strings.Split(f.persistence, ",")
	for i, u := range urls {
		r, err := call(ctx, "tenant usage", u, persistenceClient(u).TenantUsage, &persistencev1.TenantUsageRequest{Tenant: f.tenant})
		if err != nil {
			return err
		}
		sum.Queued += r.GetQueued()
		sum.Retained += r.GetRetained()
		sum.QueueMax += r.GetQueueMax() // the bound holds in each group
		per[fmt.Sprintf("group_%d", i)] = r
	}
	if f.output == "json" {
		per["total"] = &sum
		return writeJSON(stdout, per)
	}
	bound := "none"
	if sum.GetQueueMax() > 0 {
		bound = fmt.Sprintf("%d (%.0f%% used)", sum.GetQueueMax(), 100*float64(sum.GetQueued())/float64(sum.GetQueueMax()))
	}
	fmt.Fprintf(stdout, "tenant %s over %d Redis group(s)\nqueued   %d\nbound    %s\nretained %d\n", f.tenant, len(urls), sum.GetQueued(), bound, sum.GetRetained())
	return nil
}

// formatBytes prints n in binary units.
func formatBytes(n uint64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}
