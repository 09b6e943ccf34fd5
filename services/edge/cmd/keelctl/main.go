// Command keelctl administers Keel: users and ACLs of the password file and
// PostgreSQL credential backends, and the cluster (status, routes, sessions,
// edge drain, Redis switchover).
//
//	keelctl users add    (--file F | --postgres DSN) [--coordinator URL] TENANT USER [--password-stdin] [--publish P,..] [--subscribe S,..]
//	keelctl users remove (--file F | --postgres DSN) [--coordinator URL] TENANT USER
//	keelctl users list   (--file F | --postgres DSN) [-o json]
//	keelctl acl tenant   (--file F | --postgres DSN) [--coordinator URL] TENANT --publish P,.. --subscribe S,..
//	keelctl acl bump     --coordinator URL (--tenant T | --all)
//	keelctl cluster status --coordinator URL [--router URL] [-o json]
//	keelctl routes       --router URL --tenant T TOPIC [-o json]
//	keelctl session show --tenant T [--coordinator URL] [--persistence URL[,URL…]] [--limit N] CLIENT [-o json]
//	keelctl session list --coordinator URL [--tenant T] [--edge EDGE_ID] [--prefix P] [--limit N] [-o json]
//	keelctl session kick --coordinator URL --tenant T [--discard] [--edge URL] [-o json] CLIENT
//	keelctl edge status  --edge URL [-o json]
//	keelctl edge drain   --edge URL [--deadline D] [--server-reference R] [--wait] [-o json]
//	keelctl raft remove-peer --coordinator URL NODE_ID
//	keelctl redis failover --persistence URL [--to HOST:PORT] [--timeout D] [-o json]
//
// With --coordinator (or KEEL_COORDINATOR), a command that changes users or
// ACLs then bumps the tenant's ACL version at the coordinator, and every
// edge of the cluster reloads the tenant's users and ACLs: cached answers
// are dropped, connected clients are bound to their new ACL, subscriptions
// it no longer allows are removed, and removed users are disconnected.
// Without it, edges notice a changed password file within seconds and a
// changed PostgreSQL user when its cache entry expires, and connected
// clients keep the ACL they connected with. "acl bump" does the bump alone,
// for example after editing the user store by other means.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keelmq/keel/libs/config"
	"github.com/keelmq/keel/libs/service"
	"github.com/keelmq/keel/services/edge/internal/auth"
	"github.com/keelmq/keel/services/edge/internal/cluster"
	"github.com/keelmq/keel/services/edge/internal/tenancy"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
)

func main() { service.Main("keelctl", run) }

const usage = `usage:
  keelctl users add    (--file F | --postgres DSN) [--coordinator URL] TENANT USER [--password-stdin] [--publish P,..] [--subscribe S,..]
  keelctl users remove (--file F | --postgres DSN) [--coordinator URL] TENANT USER
  keelctl users list   (--file F | --postgres DSN) [-o json]
  keelctl acl tenant   (--file F | --postgres DSN) [--coordinator URL] TENANT --publish P,.. --subscribe S,..
  keelctl acl bump     --coordinator URL (--tenant T | --all)
  keelctl cluster status --coordinator URL [--router URL] [-o json]
  keelctl routes       --router URL --tenant T [-o json] TOPIC
  keelctl session show --tenant T [--coordinator URL] [--persistence URL[,URL…]] [--limit N] [-o json] CLIENT
  keelctl session list --coordinator URL [--tenant T] [--edge EDGE_ID] [--prefix P] [--limit N] [-o json]
  keelctl session kick --coordinator URL --tenant T [--discard] [--edge URL] [-o json] CLIENT
  keelctl edge status  --edge URL [-o json]
  keelctl edge drain   --edge URL [--deadline D] [--server-reference R] [--wait] [-o json]
  keelctl raft remove-peer --coordinator URL NODE_ID
  keelctl redis failover --persistence URL [--to HOST:PORT] [--timeout D] [-o json]
  keelctl redis status --persistence URL [-o json]
  keelctl tenant usage --tenant T --persistence URL[,URL…] [-o json]

--coordinator (env KEEL_COORDINATOR) is a coordinator's API URL, e.g. http://keel-coordinator:9200:
after a change the tenant's ACL version is bumped there, and every edge reloads the tenant's users and ACLs.
--router, --persistence and --edge (env KEEL_ROUTER, KEEL_PERSISTENCE, KEEL_EDGE) are the API URLs of a
router node, a persistence instance and an edge's cluster API. Flags come before the arguments.
session list pages through the coordinator's session ownership records (--limit: default 1000, 0 for all);
its --edge is the ID of an owner edge to list the sessions of, never taken from KEEL_EDGE.
session kick asks the session's owner edge (found at the coordinator; --edge URL calls that edge instead) to
disconnect the client: DISCONNECT 0x98 (administrative action) for MQTT 5, the connection closed for MQTT 3,
the will published; --discard ends the session too (subscriptions, queue, stored state, ownership).
redis failover moves the primary of the persistence instance's Redis group to a replica (--to, default the one
with the highest offset) while it is alive, losing no acknowledged write: writes pause on the primary until the
replica caught up (--timeout, default 10s), then it is promoted and the old primary becomes its replica.
redis status reads every node of the instance's Redis group: role, link, replication lag, the write marks a
failover compares (the replica with the highest epoch/seq is promoted), memory against maxmemory, AOF rewrites.
tenant usage sums, over the given persistence instances (one per Redis group), the entries queued for the tenant's
sessions against its offline-queue bound (--queue.tenant-max of the persistence service) and its retained topics.
-o json prints the responses as protojson, for scripts.`

var errUsage = errors.New(usage)

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if clusterCommand(args) {
		return runCluster(ctx, args, stdout, stderr)
	}
	if len(args) < 2 {
		return errUsage
	}
	cmd := args[0] + " " + args[1]
	fs := flag.NewFlagSet("keelctl "+cmd, flag.ContinueOnError)
	fs.SetOutput(stderr)
	file := fs.String("file", "", "password file to edit")
	dsn := fs.String("postgres", "", "PostgreSQL DSN of the user store")
	output := fs.String("o", "table", "output: table or json")
	pwStdin := fs.Bool("password-stdin", false, "read the password from standard input (default: prompt-free, from KEEL_PASSWORD)")
	var publish, subscribe config.StringList
	fs.Var(&publish, "publish", "publish patterns (comma-separated, repeatable)")
	fs.Var(&subscribe, "subscribe", "subscribe patterns (comma-separated, repeatable)")
	coord := fs.String("coordinator", "", "coordinator API URL: bump the tenant's ACL version after a change, so every edge reloads")
	bumpTenant := fs.String("tenant", "", "acl bump: the tenant whose users or ACLs changed")
	bumpAll := fs.Bool("all", false, "acl bump: every tenant (the cluster-wide ACL version)")
	if err := config.Parse(fs, args[2:]); err != nil {
		return err
	}
	if cmd == "acl bump" {
		return runBump(ctx, stdout, *coord, *bumpTenant, *bumpAll, fs.NArg())
	}
	// changed tells the edges about a change to tenant's users or ACLs.
	changed := func(what, tenant string) error {
		if *coord == "" {
			_, err := fmt.Fprintf(stdout, "%s saved\n", what)
			return err
		}
		v, err := bumpACL(ctx, *coord, tenant)
		if err != nil {
			return fmt.Errorf("%s saved, but the edges were not told (run `keelctl acl bump --tenant %s` again): %w", what, tenant, err)
		}
		_, err = fmt.Fprintf(stdout, "%s saved; acl version of tenant %s is now %d, edges reload\n", what, tenant, v)
		return err
	}
	store, closeStore, err := openStore(ctx, *file, *dsn)
	if err != nil {
		return err
	}
	defer closeStore()
	var acl *auth.ACL
	if len(publish) > 0 || len(subscribe) > 0 {
		acl = &auth.ACL{Publish: []string(publish), Subscribe: []string(subscribe)}
	}
	rest := fs.Args()
	switch cmd {
	case "users add":
		if len(rest) != 2 {
			return errUsage
		}
		pw := os.Getenv("KEEL_PASSWORD")
		if *pwStdin {
			line, err := bufio.NewReader(os.Stdin).ReadString('\n')
			if err != nil && !errors.Is(err, io.EOF) {
				return err
			}
			pw = strings.TrimRight(line, "\r\n")
		}
		if pw == "" {
			return errors.New("no password: use --password-stdin or KEEL_PASSWORD")
		}
		if err := store.PutUser(ctx, rest[0], rest[1], pw, acl); err != nil {
			return err
		}
		return changed(fmt.Sprintf("user %s@%s", rest[1], rest[0]), rest[0])
	case "users remove":
		if len(rest) != 2 {
			return errUsage
		}
		if err := store.DeleteUser(ctx, rest[0], rest[1]); err != nil {
			return err
		}
		return changed(fmt.Sprintf("removal of user %s@%s", rest[1], rest[0]), rest[0])
	case "users list":
		users, err := store.ListUsers(ctx)
		if err != nil {
			return err
		}
		if *output == "json" {
			enc := json.NewEncoder(stdout)
			enc.SetIndent("", "  ")
			if users == nil {
				users = []auth.UserInfo{}
			}
			return enc.Encode(users)
		}
		tw := tabwriter.NewWriter(stdout, 2, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "TENANT\tUSER\tPUBLISH\tSUBSCRIBE\tDISABLED")
		for _, u := range users {
			pub, sub := "(tenant default)", "(tenant default)"
			if u.ACL != nil {
				pub, sub = strings.Join(u.ACL.Publish, ","), strings.Join(u.ACL.Subscribe, ",")
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%v\n", u.Tenant, u.Username, pub, sub, u.Disabled)
		}
		return tw.Flush()
	case "acl tenant":
		if len(rest) != 1 || acl == nil {
			return errUsage
		}
		if err := store.SetTenantACL(ctx, rest[0], acl); err != nil {
			return err
		}
		return changed(fmt.Sprintf("tenant %s acl", rest[0]), rest[0])
	}
	return errUsage
}

func openStore(ctx context.Context, file, dsn string) (auth.UserStore, func(), error) {
	switch {
	case file != "" && dsn != "":
		return nil, nil, errors.New("give --file or --postgres, not both")
	case file != "":
		return auth.FileUserStore{Path: file}, func() {}, nil
	case dsn != "":
		pool, err := pgxpool.New(ctx, dsn)
		if err != nil {
			return nil, nil, err
		}
		if err := auth.ApplyMigrations(ctx, pool); err != nil {
			pool.Close()
			return nil, nil, err
		}
		return auth.PostgresUserStore{Pool: pool}, pool.Close, nil
	}
	return nil, nil, errors.New("give --file or --postgres")
}

// runBump is "keelctl acl bump".
func runBump(ctx context.Context, stdout io.Writer, coord, tenant string, all bool, nargs int) error {
	switch {
	case nargs != 0 || (tenant == "") == !all:
		return fmt.Errorf("acl bump: give --tenant T or --all\n%w", errUsage)
	case coord == "":
		return errors.New("acl bump: give --coordinator URL (or KEEL_COORDINATOR)")
	case tenant != "" && !tenancy.ValidTenant(tenant):
		return fmt.Errorf("%w: %q", tenancy.ErrInvalidTenant, tenant)
	}
	v, err := bumpACL(ctx, coord, tenant)
	if err != nil {
		return err
	}
	name := "tenant " + tenant
	if all {
		name = "every tenant"
	}
	_, err = fmt.Fprintf(stdout, "acl version of %s is now %d, edges reload\n", name, v)
	return err
}

// bumpTimeout bounds a bump, retries included.
const bumpTimeout = 15 * time.Second

// bumpACL bumps tenant's ACL version ("" for every tenant) at the
// coordinator, retrying while it has no leader.
func bumpACL(ctx context.Context, url, tenant string) (uint64, error) {
	c := cluster.NewClient(strings.TrimRight(url, "/"))
	ctx, cancel := context.WithTimeout(ctx, bumpTimeout)
	defer cancel()
	backoff := 100 * time.Millisecond
	for {
		resp, err := c.BumpAclVersion(ctx, connect.NewRequest(&coordinatorv1.BumpAclVersionRequest{Tenant: tenant}))
		if err == nil {
			return resp.Msg.GetVersion(), nil
		}
		if connect.CodeOf(err) != connect.CodeUnavailable {
			return 0, fmt.Errorf("acl version bump at %s: %w", url, err)
		}
		select {
		case <-ctx.Done():
			return 0, fmt.Errorf("acl version bump at %s: %w", url, err)
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 2*time.Second)
	}
}
