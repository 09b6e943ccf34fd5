package broker

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"golang.org/x/crypto/bcrypt"

	"github.com/keelmq/keel/services/edge/internal/auth"
)

// benchACL is a realistic ACL of a device user: 20 publish and 20 subscribe
// patterns with %u, %c and %t placeholders and + and # wildcards. The
// benchmark's publishes match the 16th publish pattern, after 15 that do
// not match.
var benchACL = []string{
	"devices/%u/telemetry/#", "devices/%u/state", "devices/%u/events/+", "devices/%c/status",
	"fleet/+/devices/%u/#", "tenants/%t/broadcast/+", "cmd/%u/+/response", "alerts/%u/+",
	"sensors/%u/+/humidity", "logs/%c/#", "metrics/%u/+/+/gauge", "firmware/%u/report",
	"config/%u/ack", "gateways/+/devices/%u/#", "site/+/zone/+/%u/presence",
	"bench/%u/+/temperature",
	"bench/%u/+/pressure", "shadow/%u/update", "jobs/%c/+/status", "audit/%u/#",
}

// BenchmarkBroker_PublishACL is the publish throughput of one edge with
// and without a publish ACL, measured in pairs: one broker, one subscriber
// taking everything at QoS 0, and two groups of publishers authenticated by
// the password file that take turns in rounds of 1024 QoS 1 PUBLISHes
// (over loopback TCP, up to 64 unacknowledged per publisher; the group
// going first alternates). "off" publishers have no ACL (every topic of
// their tenant), "on" publishers the 20 patterns of benchACL. Taking turns
// cancels out the drift of a shared machine's load, which otherwise swamps
// a difference of a few percent. Reported: msgs/s of each group and their
// ratio on/off (the target is >= 0.95).
//
// With topics=8 each publisher cycles through 8 topics, as a device does,
// and the edge's per-connection cache answers after the first check of
// each; with topics=4096 the cache (256 topics) keeps being reset, so
// nearly every PUBLISH evaluates the patterns: the worst case.
//
//	go test -run '^$' -bench BenchmarkBroker_PublishACL -benchtime 200000x -count 3 ./internal/broker/
func BenchmarkBroker_PublishACL(b *testing.B) {
	for _, topics := range []int{8, 4096} {
		for _, pubs := range []int{1, 4} {
			b.Run(fmt.Sprintf("topics=%d/publishers=%d", topics, pubs), func(b *testing.B) { benchPublishACL(b, topics, pubs) })
		}
	}
}

func benchPublishACL(b *testing.B, topics, publishers int) {
	hash, err := bcrypt.GenerateFromPassword([]byte("pw"), bcrypt.MinCost) // only CONNECT checks it, outside the timing
	if err != nil {
		b.Fatal(err)
	}
	quoted := make([]string, len(benchACL))
	for i, p := range benchACL {
		quoted[i] = fmt.Sprintf("%q", p)
	}
	list := "[" + strings.Join(quoted, ", ") + "]"
	path := filepath.Join(b.TempDir(), "users.yaml")
	if err := os.WriteFile(path, fmt.Appendf(nil, `tenants:
  acme:
    users:
      plain: {password: %q}
      ruled: {password: %q, acl: {publish: %s, subscribe: %s}}
`, hash, hash, list, list), 0o600); err != nil {
		b.Fatal(err)
	}
	fa, err := auth.NewFileAuthenticator(path, nil)
	if err != nil {
		b.Fatal(err)
	}
	addr := benchAuthBroker(b, fa, nil)

	sub := benchDialUser(b, addr, "sub", "plain@acme")
	subscribe := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: 1, ProtocolVersion: 4,
		Filters: packets.Subscriptions{{Filter: "bench/#"}}}
	var buf bytes.Buffer
	if err := subscribe.SubscribeEncode(&buf); err != nil {
		b.Fatal(err)
	}
	suback := make([]byte, 5)
	if _, err := sub.Write(buf.Bytes()); err != nil {
		b.Fatal(err)
	}
	if _, err := io.ReadFull(sub, suback); err != nil || suback[4] != 0 {
		b.Fatalf("suback %x: %v", suback, err)
	}
	go func() { _, _ = io.Copy(io.Discard, sub) }()

	type group struct {
		conns   []net.Conn
		topics  [][]string
		elapsed time.Duration
		msgs    int
	}
	groups := [2]*group{{}, {}} // off, on
	for g, user := range []string{"plain", "ruled"} {
		for i := range publishers {
			groups[g].conns = append(groups[g].conns, benchDialUser(b, addr, fmt.Sprintf("%s-%d", user, i), user+"@acme"))
			names := make([]string, topics)
			for t := range names {
				names[t] = fmt.Sprintf("bench/%s/room-%d-%d/temperature", user, i, t)
			}
			groups[g].topics = append(groups[g].topics, names)
		}
	}
	payload := bytes.Repeat([]byte{'x'}, 64)
	run := func(g *group, n int) {
		start := time.Now()
		var wg sync.WaitGroup
		for i, c := range g.conns {
			k := n / publishers
			if i < n%publishers {
				k++
			}
			wg.Go(func() {
				if err := pipelineTopics(c, g.topics[i], payload, k, 64); err != nil {
					b.Error(err)
				}
			})
		}
		wg.Wait()
		g.elapsed += time.Since(start)
		g.msgs += n
	}
	const round = 1024
	b.SetBytes(int64(len(payload)))
	b.ReportAllocs()
	b.ResetTimer()
	for done, r := 0, 0; done < b.N; r++ {
		for k := range 2 {
			n := min(round, b.N-done)
			if n == 0 {
				break
			}
			run(groups[(r+k)%2], n)
			done += n
		}
	}
	b.StopTimer()
	rate := func(g *group) float64 {
		if g.elapsed == 0 {
			return 0
		}
		return float64(g.msgs) / g.elapsed.Seconds()
	}
	b.ReportMetric(rate(groups[0]), "off-msgs/s")
	b.ReportMetric(rate(groups[1]), "on-msgs/s")
	if off := rate(groups[0]); off > 0 {
		b.ReportMetric(rate(groups[1])/off, "on/off")
	}
}

// benchDialUser connects an MQTT 3.1.1 client with user name and password
// "pw".
func benchDialUser(b *testing.B, addr, id, user string) net.Conn {
	b.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = c.Close() })
	pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, ProtocolVersion: 4,
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: true, Keepalive: 60, ClientIdentifier: id,
			UsernameFlag: true, Username: []byte(user), PasswordFlag: true, Password: []byte("pw")}}
	var buf bytes.Buffer
	if err := pk.ConnectEncode(&buf); err != nil {
		b.Fatal(err)
	}
	connack := make([]byte, 4)
	if _, err := c.Write(buf.Bytes()); err != nil {
		b.Fatal(err)
	}
	if _, err := io.ReadFull(c, connack); err != nil || connack[3] != 0 {
		b.Fatalf("connack %x: %v", connack, err)
	}
	return c
}

// pipelineTopics sends n QoS 1 PUBLISHes cycling through topics, with up
// to window of them unacknowledged, and returns once every PUBACK arrived
// (a refused one fails).
func pipelineTopics(c net.Conn, topics []string, payload []byte, n, window int) error {
	frames := make([][]byte, len(topics))
	idAt := make([]int, len(topics))
	for i, t := range topics {
		pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1}, TopicName: t,
			Payload: payload, PacketID: 0xffff, ProtocolVersion: 4}
		var buf bytes.Buffer
		if err := pk.PublishEncode(&buf); err != nil {
			return err
		}
		frames[i] = buf.Bytes()
		idAt[i] = bytes.Index(frames[i], []byte{0xff, 0xff}) // the packet ID follows the topic
	}
	slots := make(chan struct{}, window)
	acks := make(chan error, 1)
	go func() {
		r := bufio.NewReader(c)
		ack := make([]byte, 4)
		for range n {
			if _, err := io.ReadFull(r, ack); err != nil {
				acks <- fmt.Errorf("puback: %w (a refused publish closes a 3.1.1 connection)", err)
				return
			}
			<-slots
		}
		acks <- nil
	}()
	w := bufio.NewWriterSize(c, 32<<10)
	for i := range n {
		select {
		case slots <- struct{}{}:
		default:
			if err := w.Flush(); err != nil {
				return err
			}
			slots <- struct{}{}
		}
		f, at := frames[i%len(frames)], idAt[i%len(frames)]
		id := uint16(i%60000 + 1)
		f[at], f[at+1] = byte(id>>8), byte(id)
		if _, err := w.Write(f); err != nil {
			return err
		}
	}
	if err := w.Flush(); err != nil {
		return err
	}
	return <-acks
}
