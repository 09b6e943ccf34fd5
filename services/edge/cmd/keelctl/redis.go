package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
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
