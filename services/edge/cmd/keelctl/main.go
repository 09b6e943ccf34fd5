// Command keelctl administers Keel. Today: users and ACLs of the password
// file and PostgreSQL credential backends.
//
//	keelctl users add    (--file F | --postgres DSN) TENANT USER [--password-stdin] [--publish P,..] [--subscribe S,..]
//	keelctl users remove (--file F | --postgres DSN) TENANT USER
//	keelctl users list   (--file F | --postgres DSN) [-o json]
//	keelctl acl tenant   (--file F | --postgres DSN) TENANT --publish P,.. --subscribe S,..
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

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keelmq/keel/libs/config"
	"github.com/keelmq/keel/libs/service"
	"github.com/keelmq/keel/services/edge/internal/auth"
)

func main() { service.Main("keelctl", run) }

const usage = `usage:
  keelctl users add    (--file F | --postgres DSN) TENANT USER [--password-stdin] [--publish P,..] [--subscribe S,..]
  keelctl users remove (--file F | --postgres DSN) TENANT USER
  keelctl users list   (--file F | --postgres DSN) [-o json]
  keelctl acl tenant   (--file F | --postgres DSN) TENANT --publish P,.. --subscribe S,..`

var errUsage = errors.New(usage)

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
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
	if err := config.Parse(fs, args[2:]); err != nil {
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
		_, err = fmt.Fprintf(stdout, "user %s@%s saved\n", rest[1], rest[0])
		return err
	case "users remove":
		if len(rest) != 2 {
			return errUsage
		}
		if err := store.DeleteUser(ctx, rest[0], rest[1]); err != nil {
			return err
		}
		_, err = fmt.Fprintf(stdout, "user %s@%s removed\n", rest[1], rest[0])
		return err
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
		_, err = fmt.Fprintf(stdout, "tenant %s acl saved\n", rest[0])
		return err
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
