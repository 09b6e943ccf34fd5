// Package config parses command-line flags with environment fallbacks.
//
// Every package owns a Config struct with a RegisterFlags(fs, prefix) method;
// a service composes them on one [flag.FlagSet] and calls [Parse]. A flag
// that was not given on the command line takes its value from the
// environment variable named by [EnvName], so the precedence is: flag, then
// environment, then the default registered with the flag.
package config

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
)

// EnvPrefix is the prefix of every environment variable read by [Parse].
const EnvPrefix = "KEEL_"

var envReplacer = strings.NewReplacer(".", "_", "-", "_")

// EnvName returns the environment variable that [Parse] reads for the flag
// named flagName: [EnvPrefix] followed by the name in upper case, with dots
// and dashes turned into underscores ("mqtt.tcp-addr" → "KEEL_MQTT_TCP_ADDR").
func EnvName(flagName string) string {
	return EnvPrefix + strings.ToUpper(envReplacer.Replace(flagName))
}

// Parse parses args into fs and then, for every flag of fs not set on the
// command line, applies the environment variable named by [EnvName] when it
// is set. A variable set to the empty string counts as set: for a string flag
// it yields "", which lets an operator clear a default (an address, say).
//
// Errors from fs.Parse are returned unchanged, so a caller can test for
// [flag.ErrHelp]. Environment values that fail to parse are all reported,
// each wrapping [ErrInvalidEnv] and naming the variable; the values are not
// included since they may be secrets.
//
// A [StringList] given on the command line replaces its default rather than
// appending to it; see [StringList].
func Parse(fs *flag.FlagSet, args []string) error {
	return parse(fs, args, os.LookupEnv)
}

// parse is Parse with the environment lookup as a test seam.
func parse(fs *flag.FlagSet, args []string, lookupEnv func(string) (string, bool)) error {
	// Remember how many default elements each StringList holds, so that the
	// ones given on the command line can replace them (Set only appends).
	defaults := map[string]int{}
	fs.VisitAll(func(f *flag.Flag) {
		if l, ok := f.Value.(*StringList); ok {
			defaults[f.Name] = len(*l)
		}
	})

	if err := fs.Parse(args); err != nil {
		return err
	}

	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) {
		set[f.Name] = true
		if l, ok := f.Value.(*StringList); ok {
			*l = (*l)[defaults[f.Name]:]
		}
	})

	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		if set[f.Name] {
			return
		}
		name := EnvName(f.Name)
		v, ok := lookupEnv(name)
		if !ok {
			return
		}
		if l, ok := f.Value.(*StringList); ok {
			*l = nil
		}
		if err := fs.Set(f.Name, v); err != nil {
			errs = append(errs, fmt.Errorf("%w %s (flag -%s): %w", ErrInvalidEnv, name, f.Name, err))
		}
	})
	return errors.Join(errs...)
}
