// Package service holds the process plumbing shared by Keel's services: the
// ops HTTP server ([Ops]: /metrics, /healthz, /readyz, pprof), ordered start
// and reverse-order stop of components ([Group]), and the pieces of a cmd/
// main ([SignalContext], [Main]).
//
// A main stays thin: [Main] builds the signal context and calls the service's
// run function, which parses config, builds the logger and hands both to the
// service's app package. The app adds its components to a [Group] in start
// order and calls [Group.Run].
package service

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

// SignalContext returns a context that is canceled on the first SIGINT or
// SIGTERM; [context.Cause] then names the signal. After that first signal the
// default handling is restored, so a second one kills the process even if
// shutdown hangs. Call the returned function to release the signal handler.
func SignalContext() (context.Context, context.CancelFunc) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	context.AfterFunc(ctx, stop)
	return ctx, stop
}

// Exit codes returned by [Main].
const (
	ExitOK    = 0
	ExitError = 1
	ExitUsage = 2
)

// Main runs a service's main function and exits the process. It builds the
// context from [SignalContext] and calls run with os.Args[1:], os.Stdout and
// os.Stderr. It exits with [ExitOK] when run returns nil and [ExitUsage] when
// it returns an error wrapping [flag.ErrHelp] (the flag package has already
// printed the usage). Otherwise it prints "name: error" to stderr and exits
// with [ExitError].
func Main(name string, run func(ctx context.Context, args []string, stdout, stderr io.Writer) error) {
	os.Exit(runMain(name, run, os.Args[1:], os.Stdout, os.Stderr))
}

// runMain is Main without the process exit, for tests.
func runMain(name string, run func(ctx context.Context, args []string, stdout, stderr io.Writer) error, args []string, stdout, stderr io.Writer) int {
	ctx, cancel := SignalContext()
	defer cancel()
	err := run(ctx, args, stdout, stderr)
	switch {
	case err == nil:
		return ExitOK
	case errors.Is(err, flag.ErrHelp):
		return ExitUsage
	default:
		_, _ = fmt.Fprintf(stderr, "%s: %v\n", name, err)
		return ExitError
	}
}
