// Command keel-output-kafka is the "kafka" plugin of keel-output. The output
// service launches it (hashicorp/go-plugin, gRPC); run by hand it explains
// that and exits.
package main

import "github.com/keelmq/keel/services/output/internal/builtin"

func main() { builtin.Main("kafka") }
