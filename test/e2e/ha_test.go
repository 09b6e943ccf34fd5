package e2e

import (
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/require"
)

// The HA suite runs the product's topology (clusterConfig.HA: 3
// coordinators, 3 routers, a Redis primary and 2 replicas each fronted by a
// persistence instance, 3 edges) and checks DESIGN.md's invariants through
// the Checker while one node of it fails: the Redis primary, every edge in
// turn, an edge's network, the Raft leader. Each scenario has a cluster of
// its own: each breaks something the next would need whole.

// TestE2E_Cluster_RedisPrimaryKilled kills the Redis primary (SIGKILL)
// while QoS 1 streams from publishers on edges 1 and 2, and a QoS 2 one
// from edge 1, flow to persistent sessions subscribed at QoS 2 whose
// subscribers are on edge 3, two connected and two away.
// A persistence instance promotes the replica with the highest offset and
// publishes the new group record; publishing resumes, and every subscriber
// (the two away included, once back) gets every message acknowledged since
// its SUBACK, and no QoS 2 message twice: the sessions' QoS 2 inflight
// records written to the lost primary are what the promoted replica must
// have. Acknowledged messages were replicated (WAIT 1) before the PUBACK,
// so the promoted replica has them. Order is reported, not asserted:
// messages relayed by the previous owner of a session moved during the
// failover may reach it after newer ones.
func TestE2E_Cluster_RedisPrimaryKilled(t *testing.T) {
	needDocker(t)
	k := startCluster(t, haConfig(0))
	requireHAReady(t, k)
	picker := newEdgePicker(k)
	ck := NewChecker()
	const filter = "e2e/redis/#"

	var online []*roamer
	var subs []*Subscriber
	for i := range 2 {
		s := ck.NewSubscriber(fmt.Sprintf("online-%d", i+1), 2, filter)
		// online-1 comes back to edge 3 whenever it is dropped, online-2
		// to the next edge.
		online = append(online, startRoamerOpts(t, picker, fmt.Sprintf("redis-online-%d", i+1), s, 2, i == 0))
		subs = append(subs, s)
	}
	logRoamers(t, online...)
	var offline []*Subscriber
	for i := range 2 {
		s := ck.NewSubscriber(fmt.Sprintf("offline-%d", i+1), 2, filter)
		c := subscribe(t, k.URL(2), fmt.Sprintf("redis-offline-%d", i+1), false, s, nil)
		c.Disconnect(250)
		offline = append(offline, s)
		subs = append(subs, s)
	}

	var pubs []*Publisher
	var stops []func()
	for i, qos := range []byte{1, 1, 2} {
		id := fmt.Sprintf("redis-pub@%s", edgeAlias(i%2))
		interval := 5 * time.Millisecond
		if qos == 2 {
			id, interval = id+"-q2", q2Interval
		}
		p := ck.NewPublisher(id, mustDial(t, mqttOpts(k.URL(i%2), id, true)), fmt.Sprintf("e2e/redis/p%d", i+1), qos)
		p.Dial = picker.dialer(id, i%2)
		stop := p.GoStream(interval)
		t.Cleanup(stop)
		pubs, stops = append(pubs, p), append(stops, stop)
	}
	waitFlowing(t, 20*time.Second, 100, online[0].sub, online[1].sub)

	epoch0 := persistenceEpochs(t, k)
	w := ck.Watermark()
	killed := time.Now()
	k.Kill(k.Redises[0])
	t.Logf("killed the Redis primary %s; group record epochs before: %v", nodeAlias(redisAlias, 0), epoch0)

	// Every persistence instance follows a new record.
	var promoted time.Duration
	require.Eventually(t, func() bool {
		for i, e := range persistenceEpochs(t, k) {
			if e <= epoch0[i] {
				return false
			}
		}
		promoted = time.Since(killed)
		return true
	}, 30*time.Second, 50*time.Millisecond, "a replica is promoted and every persistence instance follows the new record")
	waitFlowing(t, 60*time.Second, 200, online[0].sub, online[1].sub)
	first, firstNew := ck.firstAckAfter(killed, w)
	t.Logf("new group record on every persistence instance %v after the kill; first PUBACK after the kill %v after it, first PUBACK of a publish sent after the kill %v after it",
		promoted.Round(time.Millisecond), first.Sub(killed).Round(time.Millisecond), firstNew.Sub(killed).Round(time.Millisecond))

	// The sessions that were away come back, one on the edge that holds
	// them, one on another edge, and get what was queued for them.
	for i, s := range offline {
		edge := []int{2, 0}[i]
		c, err := dial(mqttOpts(k.URL(edge), fmt.Sprintf("redis-offline-%d", i+1), false).SetDefaultPublishHandler(s.Handler()), 30*time.Second)
		require.NoError(t, err, "%s comes back on %s", s.Name, edgeAlias(edge))
		t.Cleanup(func() { c.Disconnect(50) })
	}
	waitFlowing(t, 30*time.Second, 100, offline...)
	for _, stop := range stops {
		stop()
	}
	r := ck.WaitDelivered(60 * time.Second)
	t.Logf("after the failover:%s\n  %s\n  %s", r, online[0], online[1])
	for _, p := range pubs {
		require.Positive(t, r.Pub(p.ID).Acked)
	}
	require.Positive(t, ck.ackedSince(killed.Add(promoted)), "publishes are acknowledged after the failover")
	requireQoS2Measured(t, r, pubs[2].ID, names(subs)...)
	logLostAround(t, ck, r, killed, "the kill")
	requireNoLoss(t, r, "a message published before a takeover and held up on its way to the previous owner (behind "+
		"its store writes failing over) is relayed to the new owner after newer ones reached the session directly", names(subs)...)
	requireSessionsKept(t, online...)
}

// logLostAround logs, for every subscriber that lost messages, when the
// first and last of them were acknowledged relative to at.
func logLostAround(t *testing.T, ck *Checker, r Report, at time.Time, what string) {
	for _, s := range r.Subs {
		if s.Lost == 0 {
			continue
		}
		first, last := ck.AckedAt(s.LostIDs[0]), ck.AckedAt(s.LostIDs[len(s.LostIDs)-1])
		t.Logf("%s lost %d acknowledged messages %s, acknowledged from %v to %v after %s (negative: before)",
			s.Subscriber, s.Lost, idRanges(s.LostIDs), first.Sub(at).Round(time.Millisecond), last.Sub(at).Round(time.Millisecond), what)
	}
}

// logRoamers logs where the roamers went when the test fails.
func logRoamers(t *testing.T, rs ...*roamer) {
	t.Cleanup(func() {
		if t.Failed() {
			for _, r := range rs {
				t.Log(r)
			}
		}
	})
}

func names(subs []*Subscriber) []string {
	var out []string
	for _, s := range subs {
		out = append(out, s.Name)
	}
	return out
}

// persistenceEpochs reads keel_persistence_group_record_epoch from every
// persistence instance (-1 for one that does not answer).
func persistenceEpochs(t *testing.T, k *keelCluster) []float64 {
	out := make([]float64, len(k.Persists))
	for i, p := range k.Persists {
		m, err := metrics(t.Context(), p, persistOps, "keel_persistence_group_record_epoch")
		if err != nil {
			out[i] = -1
			continue
		}
		out[i] = m["keel_persistence_group_record_epoch"]
	}
	return out
}

// TestE2E_Cluster_RollingRestart restarts every edge in turn, as a rolling
// update does: SIGTERM (the edge turns readiness off, hands its persistent
// sessions to custodians and disconnects its clients with 0x8B), then the
// same container starts again under the same name and edge ID. QoS 1
// publishers, a QoS 2 one, and persistent subscribers at QoS 2, spread
// over the edges, connect again to any live edge whenever they are
// dropped. Every subscriber gets every message acknowledged since its
// first SUBACK, no QoS 2 message twice (each drain hands inflight QoS 2
// deliveries over), and finds its session each time it comes back. Order
// is reported, not asserted (see requireNoLoss). A client with a will and a clean session on each edge
// does not come back: the drain of its edge publishes its will, and a
// watcher (a persistent session at QoS 2, roaming too) gets each, at QoS
// 2, exactly once [MQTT-3.1.2-8].
func TestE2E_Cluster_RollingRestart(t *testing.T) {
	needDocker(t)
	k := startCluster(t, haConfig(0))
	requireHAReady(t, k)
	picker := newEdgePicker(k)
	ck := NewChecker()
	const filter = "e2e/roll/#"
	var roamers []*roamer
	var subs []*Subscriber
	for i := range 3 {
		s := ck.NewSubscriber(fmt.Sprintf("roll-sub-%d", i+1), 2, filter)
		roamers = append(roamers, startRoamer(t, picker, fmt.Sprintf("roll-sub-%d", i+1), s, i))
		subs = append(subs, s)
	}
	var pubs []*Publisher
	var stops []func()
	for i, qos := range []byte{1, 1, 1, 2} {
		id := fmt.Sprintf("roll-pub-%d", i+1)
		interval := 10 * time.Millisecond
		if qos == 2 {
			id, interval = id+"-q2", q2Interval
		}
		p := ck.NewPublisher(id, mustDial(t, mqttOpts(k.URL(i%3), id, true)), fmt.Sprintf("e2e/roll/p%d", i+1), qos)
		p.Dial = picker.dialer(id, i+1)
		stop := p.GoStream(interval)
		t.Cleanup(stop)
		pubs, stops = append(pubs, p), append(stops, stop)
	}
	waitFlowing(t, 20*time.Second, 50, subs...)
	wills := &willWatcher{got: map[string]int{}}
	willSub := ck.NewSubscriber("will-watcher", 2, "e2e/wills/#")
	roamers = append(roamers, startWillRoamer(t, picker, "roll-will-watcher", willSub, 1, wills))
	var willTopics []string
	for i := range k.Edges {
		id := fmt.Sprintf("roll-will-%d", i+1)
		mustDial(t, mqttOpts(k.URL(i), id, true).SetWill("e2e/wills/"+id, id+" gone", 2, false))
		willTopics = append(willTopics, "e2e/wills/"+id)
	}

	began := time.Now()
	for i := range k.Edges {
		picker.setDown(i, true)
		restart := time.Now()
		stopped, code := k.RestartEdge(i, 30*time.Second)
		ready := time.Since(restart)
		picker.setDown(i, false)
		// The stop must be the drain, not Docker's SIGKILL after the grace.
		if code != 0 {
			t.Errorf("%s exited with %d after SIGTERM (stop took %v): not a clean drain", edgeAlias(i), code, stopped.Round(time.Millisecond))
		}
		waitFlowing(t, 60*time.Second, 50, subs...)
		t.Logf("%s drained in %v and was ready again %v after SIGTERM; the stream flows to every subscriber again %v after SIGTERM",
			edgeAlias(i), stopped.Round(time.Millisecond), ready.Round(time.Millisecond), time.Since(restart).Round(time.Millisecond))
	}
	t.Logf("rolling restart of %d edges took %v", len(k.Edges), time.Since(began).Round(time.Millisecond))
	// Everyone comes home: the last edge restarted has clients again.
	time.Sleep(time.Second)
	for _, stop := range stops {
		stop()
	}
	r := ck.WaitDelivered(60 * time.Second)
	reconnects := 0
	for _, p := range pubs {
		reconnects += p.Reconnects()
		require.Positive(t, r.Pub(p.ID).Acked)
	}
	t.Logf("after the rolling restart, publisher reconnects %d:%s", reconnects, r)
	for _, rm := range roamers {
		t.Log(rm)
	}
	requireQoS2Measured(t, r, pubs[3].ID, names(subs)...)
	requireNoLoss(t, r, "a message published just before a session moved reaches its new owner after later ones: "+
		"relayed by the previous owner, or left unacknowledged by a draining edge and delivered late", names(subs)...)
	requireSessionsKept(t, roamers...)
	open := len(roamers) + len(pubs)
	requireOneConnectionPerClient(t, k, open, pubs...)
	wills.requireOnce(t, 30*time.Second, willTopics...)
}

// TestE2E_Cluster_NetworkCut disconnects edge 2 from the cluster network
// for three times its lease TTL, then connects it again. Its clients stay
// connected to it (they reach it through another network) until the edge,
// unable to renew its lease, fences itself and closes them. Meanwhile the
// persistent subscriber of edge 2 connects with the same client ID to
// edge 1, and is admitted only after edge 2 closed the first connection
// (invariant 3): no message published after the second CONNACK reaches
// the first connection. Its session resumes there, and nothing
// acknowledged to any publisher is lost by any subscriber. Once back,
// edge 2 rejoins under a new incarnation and serves again: the subscriber
// moves back to it (edge 1 closes its connection) and a new client
// subscribes there. Every subscription is at QoS 2 and a QoS 2 publisher
// on edge 2 runs beside the QoS 1 ones: the session that moves twice gets
// no QoS 2 message twice, whichever edge held it in flight. Order is
// reported, not asserted (see requireNoLoss).
func TestE2E_Cluster_NetworkCut(t *testing.T) {
	needDocker(t)
	const ttl = 4 * time.Second
	k := startCluster(t, haConfig(ttl))
	requireHAReady(t, k)
	picker := newEdgePicker(k)
	ck := NewChecker()
	const filter = "e2e/cut/#"

	w1 := ck.NewSubscriber("witness@edge-1", 2, filter)
	startRoamer(t, picker, "cut-witness-1", w1, 0)
	w3 := ck.NewSubscriber("witness@edge-3", 2, filter)
	startRoamer(t, picker, "cut-witness-3", w3, 2)

	// The subscriber of edge 2: one Subscriber for its session (what must
	// arrive), one per connection (to see which connection got what).
	const victimID = "cut-victim"
	victim := ck.NewSubscriber("victim", 2, filter)
	conn := []*Subscriber{ck.NewSubscriber("victim#1@edge-2", 2, filter), ck.NewSubscriber("victim#2@edge-1", 2, filter),
		ck.NewSubscriber("victim#3@edge-2", 2, filter)}
	tagged := func(i int) mqtt.MessageHandler {
		return func(_ mqtt.Client, m mqtt.Message) {
			victim.recordMessage(m)
			conn[i].recordMessage(m)
		}
	}
	firstLost := newLostSignal()
	first := mustDial(t, mqttOpts(k.URL(1), victimID, false).SetDefaultPublishHandler(tagged(0)).SetConnectionLostHandler(firstLost.handler))
	requireSubscribe(t, first, victim)

	var pubs []*Publisher
	var stops []func()
	for i, qos := range []byte{1, 1, 1, 2} {
		edge, interval := i, 10*time.Millisecond
		id := fmt.Sprintf("cut-pub@%s", edgeAlias(edge))
		if qos == 2 {
			edge, interval = 1, q2Interval
			id = fmt.Sprintf("cut-pub@%s-q2", edgeAlias(edge))
		}
		p := ck.NewPublisher(id, mustDial(t, mqttOpts(k.URL(edge), id, true)), fmt.Sprintf("e2e/cut/p%d", i+1), qos)
		p.Dial = picker.dialer(id, edge)
		stop := p.GoStream(interval)
		t.Cleanup(stop)
		pubs, stops = append(pubs, p), append(stops, stop)
	}
	waitFlowing(t, 20*time.Second, 50, w1, w3, victim)

	cut := time.Now()
	picker.setDown(1, true)
	k.CutEdge(1)
	// The subscriber tries edge 1 at once (its client may have noticed
	// nothing yet): edge 1 claims the session, and the coordinator may
	// grant it only once edge 2's lease has expired, by when edge 2 has
	// fenced itself and closed the first connection.
	var second mqtt.Client
	var secondAt time.Time
	secondLost := newLostSignal()
	connected := make(chan error, 1)
	go func() {
		c, err := dial(mqttOpts(k.URL(0), victimID, false).SetDefaultPublishHandler(tagged(1)).
			SetConnectionLostHandler(secondLost.handler), 60*time.Second)
		secondAt, second = time.Now(), c
		connected <- err
	}()
	require.True(t, firstLost.wait(ttl+10*time.Second), "edge 2 closes its client once its lease lapsed")
	lostAt := *firstLost.at.Load()
	require.NoError(t, <-connected, "the subscriber is admitted on edge 1")
	t.Cleanup(func() { second.Disconnect(50) })
	t.Logf("edge 2 closed its client %v after the cut (%v); edge 1 admitted the same client ID %v after the cut",
		lostAt.Sub(cut).Round(time.Millisecond), *firstLost.err.Load(), secondAt.Sub(cut).Round(time.Millisecond))
	if !secondAt.After(lostAt) {
		t.Errorf("invariant 3: edge 1 admitted %s %v before edge 2 closed its first connection", victimID, lostAt.Sub(secondAt))
	}
	w := ck.Watermark()
	waitFlowing(t, 30*time.Second, 50, w1, w3, conn[1])
	if both := Overlap(conn[0], conn[1], w); len(both) > 0 {
		t.Errorf("invariant 3: %d messages published after the second CONNACK reached both connections: %s", len(both), idRanges(both))
	}

	// The cut lasts three lease TTLs, then edge 2 comes back.
	time.Sleep(time.Until(cut.Add(3 * ttl)))
	healed := time.Now()
	k.HealEdge(1)
	back := ck.NewSubscriber("new@edge-2", 2, filter)
	bc, err := dial(mqttOpts(k.URL(1), "cut-newcomer", false).SetDefaultPublishHandler(back.Handler()), 45*time.Second)
	require.NoError(t, err, "edge 2 admits clients again once it rejoined")
	t.Cleanup(func() { bc.Disconnect(50) })
	t.Logf("edge 2 admitted a client %v after it was connected again", time.Since(healed).Round(time.Millisecond))
	picker.setDown(1, false)
	requireSubscribe(t, bc, back)
	t.Logf("new@edge-2 subscribed %v after edge 2 was connected again", time.Since(healed).Round(time.Millisecond))

	// The subscriber moves back to edge 2: edge 1 closes its connection.
	third, err := dial(mqttOpts(k.URL(1), victimID, false).SetDefaultPublishHandler(tagged(2)), 30*time.Second)
	require.NoError(t, err)
	t.Cleanup(func() { third.Disconnect(50) })
	thirdAt := time.Now()
	if !secondLost.wait(5 * time.Second) {
		t.Errorf("invariant 3: edge 1 kept the connection of %s after edge 2 took the session back", victimID)
	}
	w = ck.Watermark()
	waitFlowing(t, 30*time.Second, 50, w1, w3, back, conn[2])
	if both := Overlap(conn[1], conn[2], w); len(both) > 0 {
		t.Errorf("invariant 3: %d messages published after the takeover by edge 2 (%v) reached both connections: %s",
			len(both), time.Since(thirdAt).Round(time.Millisecond), idRanges(both))
	}
	for _, stop := range stops {
		stop()
	}
	r := ck.WaitDelivered(60 * time.Second)
	reconnects := 0
	for _, p := range pubs {
		reconnects += p.Reconnects()
		require.Positive(t, r.Pub(p.ID).Acked, "%s acknowledged nothing:%s", p.ID, r)
	}
	t.Logf("after the cut, publisher reconnects %d:%s", reconnects, r)
	logLostAround(t, ck, r, healed, "edge 2 was connected again")
	requireQoS2Measured(t, r, pubs[3].ID, w1.Name, w3.Name, victim.Name, back.Name)
	requireNoLoss(t, r, "a publish that one edge did not take (its peer went away, or a store write failed) is sent "+
		"again by its publisher after later ones were taken elsewhere", w1.Name, w3.Name, victim.Name, back.Name)
	// The witnesses, the subscriber, the newcomer and the publishers.
	requireOneConnectionPerClient(t, k, 2+1+1+len(pubs), pubs...)
}

// TestE2E_Cluster_RaftLeaderKilledDuringConnectStorm opens a few hundred
// connections across the edges, half of them with persistent sessions, and
// kills the coordinator leader (SIGKILL) once a third have connected.
// Every connection needs a session claim, which only the leader grants:
// connects stall until a new leader is elected, then every client gets
// in. Some client IDs connect twice at once on two edges: each ends with
// one live connection, and the edges hold exactly one connection per
// client (invariant 3). A QoS 1 stream to persistent sessions on edges 2
// and 3 runs throughout and loses nothing (invariant 1).
func TestE2E_Cluster_RaftLeaderKilledDuringConnectStorm(t *testing.T) {
	needDocker(t)
	k := startCluster(t, haConfig(0))
	leader := k.WaitLeader(30 * time.Second)
	picker := newEdgePicker(k)
	ck := NewChecker()
	const filter = "e2e/storm/#"
	s2 := ck.NewSubscriber("stream@edge-2", 1, filter)
	r2 := startRoamer(t, picker, "storm-stream-2", s2, 1)
	s3 := ck.NewSubscriber("stream@edge-3", 1, filter)
	r3 := startRoamer(t, picker, "storm-stream-3", s3, 2)
	pub := ck.NewPublisher("storm-pub", mustDial(t, mqttOpts(k.URL(0), "storm-pub", true)), "e2e/storm/t", 1)
	pub.Dial = picker.dialer("storm-pub", 0)
	stopPub := pub.GoStream(10 * time.Millisecond)
	t.Cleanup(stopPub)
	waitFlowing(t, 20*time.Second, 50, s2, s3)

	const clients, twins, workers = 300, 30, 48
	type attempt struct {
		id    string
		edge  int
		clean bool
	}
	var jobs []attempt
	for i := range clients {
		jobs = append(jobs, attempt{id: fmt.Sprintf("storm-%03d", i), edge: i % 3, clean: i%2 == 0})
	}
	// The twins: the same client IDs again, on the next edge, interleaved
	// so that both connections of an ID race.
	for i := range twins {
		j := jobs[i*clients/twins+i%2] // clean and persistent sessions alike
		jobs = append(jobs, attempt{id: j.id, edge: (j.edge + 1) % 3, clean: j.clean})
	}
	sort.SliceStable(jobs, func(a, b int) bool { return jobs[a].id < jobs[b].id })

	var (
		mu        sync.Mutex
		successes []time.Time
		conns     = map[string][]mqtt.Client{}
		connAt    = map[string][]string{} // per client ID: edge and CONNACK time of each connection, relative to the kill
		lost      = map[string]int{}
		failures  atomic.Int64
		done      atomic.Int64
	)
	var killedAt atomic.Pointer[time.Time]
	work := make(chan attempt)
	var wg sync.WaitGroup
	began := time.Now()
	for range workers {
		wg.Go(func() {
			for a := range work {
				deadline := time.Now().Add(90 * time.Second)
				for {
					opts := mqttOpts(k.URL(a.edge), a.id, a.clean).SetConnectTimeout(10 * time.Second).
						SetConnectionLostHandler(func(mqtt.Client, error) {
							mu.Lock()
							lost[a.id]++
							mu.Unlock()
						})
					c := mqtt.NewClient(opts)
					tok := c.Connect()
					if tok.WaitTimeout(15*time.Second) && tok.Error() == nil {
						mu.Lock()
						now := time.Now()
						successes = append(successes, now)
						conns[a.id] = append(conns[a.id], c)
						rel := "before the kill"
						if at := killedAt.Load(); at != nil {
							rel = fmt.Sprintf("%v after the kill", now.Sub(*at).Round(time.Millisecond))
						}
						connAt[a.id] = append(connAt[a.id], fmt.Sprintf("%s (clean %v) %s", edgeAlias(a.edge), a.clean, rel))
						mu.Unlock()
						done.Add(1)
						break
					}
					c.Disconnect(0)
					failures.Add(1)
					if time.Now().After(deadline) {
						t.Errorf("%s never connected to %s: %v", a.id, edgeAlias(a.edge), tok.Error())
						done.Add(1)
						break
					}
					time.Sleep(200 * time.Millisecond)
				}
			}
		})
	}
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, cs := range conns {
			for _, c := range cs {
				c.Disconnect(0)
			}
		}
	})
	go func() {
		defer close(work)
		for _, j := range jobs {
			work <- j
		}
	}()
	require.Eventually(t, func() bool { return done.Load() >= int64(len(jobs)/3) }, 60*time.Second, 5*time.Millisecond,
		"a third of the clients connect before the kill")
	killed := time.Now()
	killedAt.Store(&killed)
	doneAtKill := done.Load()
	k.Kill(k.Coords[leader])
	newLeader := k.WaitLeader(30*time.Second, leader)
	elected := time.Since(killed)
	wg.Wait()
	stormTook := time.Since(began)

	mu.Lock()
	sort.Slice(successes, func(a, b int) bool { return successes[a].Before(successes[b]) })
	var firstAfter time.Time
	var gap time.Duration
	prev := killed
	for _, s := range successes {
		if s.Before(killed) {
			continue
		}
		if firstAfter.IsZero() {
			firstAfter = s
		}
		if d := s.Sub(prev); d > gap {
			gap = d
		}
		prev = s
	}
	mu.Unlock()
	t.Logf("%d connects (%d client IDs, %d of them twice) in %v, %d refused or timed out attempts retried; leader %s killed after %d connects, %s elected %v later; first CONNACK after the kill %v after it, longest time without a CONNACK from the kill on %v",
		len(jobs), clients, twins, stormTook.Round(time.Millisecond), failures.Load(), nodeAlias(coordAlias, leader), doneAtKill,
		nodeAlias(coordAlias, newLeader), elected.Round(time.Millisecond), firstAfter.Sub(killed).Round(time.Millisecond), gap.Round(time.Millisecond))

	// Invariant 3: one live connection per client ID, client side and
	// server side.
	time.Sleep(time.Second)
	open := 0
	mu.Lock()
	for id, cs := range conns {
		live := 0
		for _, c := range cs {
			if c.IsConnectionOpen() {
				live++
			}
		}
		if live > 1 {
			t.Errorf("invariant 3: %s has %d live connections (%d connects, %d lost): %v", id, live, len(cs), lost[id], connAt[id])
		}
		if live == 0 {
			t.Errorf("%s has no live connection left (%d connects, %d lost)", id, len(cs), lost[id])
		}
		open += live
	}
	mu.Unlock()
	requireOneConnectionPerClient(t, k, open+3, pub)
	require.Equal(t, clients, open, "every client connected, once")

	stopPub()
	r := ck.WaitDelivered(60 * time.Second)
	t.Logf("stream during the storm:%s\n  %s\n  %s", r, r2, r3)
	require.Positive(t, r.Pub("storm-pub").Acked)
	requireDelivery(t, r, s2.Name, s3.Name)
	requireSessionsKept(t, r2, r3)
}
