package topic_test

import (
	"fmt"
	"sort"

	"github.com/keelmq/keel/libs/topic"
)

func ExampleTrie() {
	var subs topic.Trie[string]
	subs.Add("sport/tennis/+", "alice")
	subs.Add("sport/#", "bob")
	subs.Add("#", "carol")

	var got []string
	subs.Match("sport/tennis/player1", func(client string) bool {
		got = append(got, client)
		return true
	})
	sort.Strings(got)
	fmt.Println(got)

	got = got[:0]
	subs.Match("$SYS/uptime", func(client string) bool { // "#" does not match '$' topics
		got = append(got, client)
		return true
	})
	fmt.Println(got)
	// Output:
	// [alice bob carol]
	// []
}

func ExampleParseShare() {
	for _, f := range []string{"$share/workers/jobs/+", "$queue/jobs/#", "jobs/#", "$share/workers"} {
		group, inner, ok, err := topic.ParseShare(f)
		fmt.Printf("%q %q %v %v\n", group, inner, ok, err)
	}
	// Output:
	// "workers" "jobs/+" true <nil>
	// "$queue" "jobs/#" true <nil>
	// "" "" false <nil>
	// "" "" true topic: invalid shared subscription
}

func ExampleAnchor() {
	for _, f := range []string{"a/b/c", "a/b/+/c", "a/#", "+/x", "#"} {
		fmt.Printf("%q\n", topic.Anchor(f))
	}
	// Output:
	// "a/b/c"
	// "a/b"
	// "a"
	// ""
	// ""
}

func ExampleValidateFilter() {
	limits := topic.Limits{MaxLength: 1024, MaxLevels: 16}
	for _, f := range []string{"sport/+/player1", "sport/tennis#", "$share//x"} {
		fmt.Println(topic.ValidateFilter(f, limits))
	}
	// Output:
	// <nil>
	// topic: invalid wildcard
	// topic: invalid shared subscription
}
