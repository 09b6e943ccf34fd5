package service_test

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/libs/service"
)

// ExampleGroup wires a service the way an app package does: the ops server
// first, then the components, then a stop-only step that fails /readyz and
// drains before anything else stops.
func ExampleGroup() {
	logger := logging.Discard()
	ops := service.NewOps("127.0.0.1:0", service.NewRegistry(), logger)

	ctx, cancel := context.WithCancel(context.Background())
	var g service.Group
	g.Add("ops", func(context.Context) error { return ops.Start() }, ops.Stop)
	g.AddRun("listener", func(ctx context.Context) error {
		<-ctx.Done() // a real listener would accept connections here
		return ctx.Err()
	})
	g.Add("ready",
		func(context.Context) error {
			ops.SetReady(true)
			resp, err := http.Get("http://" + ops.Addr() + "/readyz") //nolint:noctx // example
			if err != nil {
				return err
			}
			resp.Body.Close()
			fmt.Println("readyz:", resp.StatusCode)
			cancel() // stand-in for SIGTERM
			return nil
		},
		func(context.Context) error {
			ops.SetReady(false) // then wait out the drain period
			return nil
		},
	)
	err := g.Run(ctx, 5*time.Second, logger)
	fmt.Println("run:", err)
	// Output:
	// readyz: 200
	// run: <nil>
}
