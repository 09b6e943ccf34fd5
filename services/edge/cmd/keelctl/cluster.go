package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/keelmq/keel/libs/config"
	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/libs/slots"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	"github.com/keelmq/keel/proto/gen/keel/coordinator/v1/coordinatorv1connect"
	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"
	"github.com/keelmq/keel/proto/gen/keel/edge/v1/edgev1connect"
	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
	"github.com/keelmq/keel/proto/gen/keel/persistence/v1/persistencev1connect"
	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
	"github.com/keelmq/keel/proto/gen/keel/router/v1/routerv1connect"
)

// callTimeout bounds one cluster command, retries included.
const callTimeout = 15 * time.Second

// clusterCommand reports whether args name one of the cluster commands.
func clusterCommand(args []string) bool {
	if len(args) == 0 {
		return false
	}
	switch args[0] {
	case "cluster", "routes", "session", "edge", "raft", "redis", "tenant":
		return true
	}
	return false
}

// clusterFlags are the flags of the cluster commands.
type clusterFlags struct {
	coordinator, router, persistence, edge string
	tenant, output, serverReference        string
	prefix                                 string
	limit                                  int
	deadline                               time.Duration
	wait, discard                          bool
	// given are the flags given on the command line, not taken from the
	// environment or left at their defaults.
	given map[string]bool
}

// listLimit is the default --limit of session list.
const listLimit = 1000

func (f *clusterFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.coordinator, "coordinator", "", "coordinator API URL (env KEEL_COORDINATOR)")
	fs.StringVar(&f.router, "router", "", "router API URL (env KEEL_ROUTER)")
	fs.StringVar(&f.persistence, "persistence", "", "persistence API URL (env KEEL_PERSISTENCE); with K Redis groups one URL per group in group order, comma-separated (session show then needs --coordinator for the slot table)")
	fs.StringVar(&f.edge, "edge", "", "edge cluster API URL (env KEEL_EDGE); session list: the ID of the owner edge to list the sessions of")
	fs.StringVar(&f.tenant, "tenant", "", "tenant of the topic or session")
	fs.StringVar(&f.output, "o", "table", "output: table or json")
	fs.StringVar(&f.prefix, "prefix", "", "session list: only client IDs starting with this")
	fs.IntVar(&f.limit, "limit", 10, fmt.Sprintf("session show: queue and in-flight entries to list; session list: sessions to list (default %d, 0: all)", listLimit))
	fs.DurationVar(&f.deadline, "deadline", 0, "edge drain: how long the drain may take (0: the edge's default)")
	fs.StringVar(&f.serverReference, "server-reference", "", "edge drain: server reference sent to MQTT 5 clients")
	fs.BoolVar(&f.wait, "wait", false, "edge drain: poll until the edge is drained")
	fs.BoolVar(&f.discard, "discard", false, "session kick: end the session too (its subscriptions, queue and stored state go)")
}

// runCluster runs the cluster commands: cluster status, routes, session
// show, list and kick, edge status, edge drain, raft remove-peer, redis
// failover.
func runCluster(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cmd, rest := args[0], args[1:]
	if cmd != "routes" {
		if len(rest) == 0 {
			return errUsage
		}
		cmd, rest = cmd+" "+rest[0], rest[1:]
	}
	if cmd == "redis failover" {
		return redisFailover(ctx, rest, stdout, stderr)
	}
	fs := flag.NewFlagSet("keelctl "+cmd, flag.ContinueOnError)
	fs.SetOutput(stderr)
	var f clusterFlags
	f.register(fs)
	// Which flags the command line gives, before the environment fills in
	// the others: --edge of session list is an edge ID, not KEEL_EDGE's URL.
	probe := flag.NewFlagSet("", flag.ContinueOnError)
	probe.SetOutput(io.Discard)
	new(clusterFlags).register(probe)
	f.given = map[string]bool{}
	if probe.Parse(rest) == nil {
		probe.Visit(func(fl *flag.Flag) { f.given[fl.Name] = true })
	}
	if err := config.Parse(fs, rest); err != nil {
		return err
	}
	if f.output != "table" && f.output != "json" {
		return fmt.Errorf("-o %q: give table or json", f.output)
	}
	need := func(name, val string) error {
		if val == "" {
			return fmt.Errorf("%s: give --%s URL (or KEEL_%s)", cmd, name, strings.ToUpper(name))
		}
		return nil
	}
	pos := fs.Args()
	switch cmd {
	case "cluster status":
		if err := need("coordinator", f.coordinator); err != nil {
			return err
		}
		if len(pos) != 0 {
			return errUsage
		}
		return clusterStatus(ctx, stdout, f)
	case "routes":
		if err := need("router", f.router); err != nil {
			return err
		}
		if len(pos) != 1 || f.tenant == "" {
			return fmt.Errorf("routes: give --tenant T and one TOPIC\n%w", errUsage)
		}
		return showRoutes(ctx, stdout, f, pos[0])
	case "session show":
		if f.coordinator == "" && f.persistence == "" {
			return errors.New("session show: give --coordinator URL, --persistence URL or both")
		}
		if len(pos) != 1 || f.tenant == "" {
			return fmt.Errorf("session show: give --tenant T and one CLIENT\n%w", errUsage)
		}
		return showSession(ctx, stdout, f, pos[0])
	case "edge status", "edge drain":
		if err := need("edge", f.edge); err != nil {
			return err
		}
		if len(pos) != 0 {
			return errUsage
		}
		if cmd == "edge status" {
			return edgeStatus(ctx, stdout, f)
		}
		return edgeDrain(ctx, stdout, f)
	case "raft remove-peer":
		if err := need("coordinator", f.coordinator); err != nil {
			return err
		}
		if len(pos) != 1 {
			return fmt.Errorf("raft remove-peer: give one NODE_ID\n%w", errUsage)
		}
		return removePeer(ctx, stdout, f, pos[0])
	case "session list":
		if err := need("coordinator", f.coordinator); err != nil {
			return err
		}
		if len(pos) != 0 {
			return fmt.Errorf("session list: takes no arguments\n%w", errUsage)
		}
		if !f.given["limit"] {
			f.limit = listLimit
		}
		if f.limit < 0 {
			return fmt.Errorf("session list: --limit %d: give 0 (all) or more", f.limit)
		}
		if !f.given["edge"] {
			f.edge = "" // KEEL_EDGE is an edge's API URL, not an owner to list
		}
		return listSessions(ctx, stdout, f)
	case "redis status":
		if err := need("persistence", f.persistence); err != nil {
			return err
		}
		if len(pos) != 0 || strings.Contains(f.persistence, ",") {
			return fmt.Errorf("redis status: give one --persistence URL (an instance of the group) and no arguments\n%w", errUsage)
		}
		return redisStatus(ctx, stdout, f)
	case "tenant usage":
		if err := need("persistence", f.persistence); err != nil {
			return err
		}
		if len(pos) != 0 || f.tenant == "" {
			return fmt.Errorf("tenant usage: give --tenant T and no arguments\n%w", errUsage)
		}
		return tenantUsage(ctx, stdout, f)
	case "session kick":
		if err := need("coordinator", f.coordinator); err != nil {
			return err
		}
		if len(pos) != 1 || f.tenant == "" {
			return fmt.Errorf("session kick: give --tenant T and one CLIENT\n%w", errUsage)
		}
		if !f.given["edge"] {
			f.edge = "" // the owner's address comes from the coordinator
		}
		return kickSession(ctx, stdout, f, pos[0])
	}
	return errUsage
}

func baseURL(u string) string { return strings.TrimRight(u, "/") }

// groupURL returns the persistence URL of the session's Redis group: the
// one URL given, or of K URLs the one the cluster's slot table (read from
// the coordinator) maps the session to.
func groupURL(ctx context.Context, f clusterFlags, client string) (string, error) {
	urls := strings.Split(f.persistence, ",")
	if len(urls) == 1 {
		return urls[0], nil
	}
	if f.coordinator == "" {
		return "", fmt.Errorf("session show: %d persistence URLs need --coordinator, for the slot table", len(urls))
	}
	table, k, err := slots.Fetch(ctx, coordinatorClient(f.coordinator), "keelctl", coordinatorv1.MemberRole_MEMBER_ROLE_EDGE)
	if err != nil {
		return "", fmt.Errorf("session show: read the slot table: %w", err)
	}
	if k != len(urls) {
		return "", fmt.Errorf("session show: %d persistence URLs, but the cluster has %d Redis groups", len(urls), k)
	}
	return urls[table.Session(f.tenant, client)], nil
}

func coordinatorClient(u string) coordinatorv1connect.CoordinatorServiceClient {
	return coordinatorv1connect.NewCoordinatorServiceClient(rpc.H2CClient(), baseURL(u), rpc.ClientOptions()...)
}

func routerClient(u string) routerv1connect.RouterServiceClient {
	return routerv1connect.NewRouterServiceClient(rpc.H2CClient(), baseURL(u), rpc.ClientOptions()...)
}

func persistenceClient(u string) persistencev1connect.PersistenceServiceClient {
	return persistencev1connect.NewPersistenceServiceClient(rpc.H2CClient(), baseURL(u), rpc.ClientOptions()...)
}

func edgeClient(u string) edgev1connect.EdgeServiceClient {
	return edgev1connect.NewEdgeServiceClient(rpc.H2CClient(), baseURL(u), rpc.ClientOptions()...)
}

// call makes a unary call, retrying while the service answers Unavailable
// (no Raft leader yet, router rebuilding) until ctx ends.
func call[Req, Resp any](ctx context.Context, what, url string, fn func(context.Context, *connect.Request[Req]) (*connect.Response[Resp], error), req *Req) (*Resp, error) {
	backoff := 100 * time.Millisecond
	for {
		resp, err := fn(ctx, connect.NewRequest(req))
		if err == nil {
			return resp.Msg, nil
		}
		if connect.CodeOf(err) != connect.CodeUnavailable || ctx.Err() != nil {
			return nil, fmt.Errorf("%s at %s: %w", what, url, err)
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%s at %s: %w", what, url, err)
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 2*time.Second)
	}
}

// writeJSON prints v as one indented JSON object, each value rendered with
// protojson (proto field names); nil values are left out.
func writeJSON(w io.Writer, v map[string]proto.Message) error {
	out := map[string]json.RawMessage{}
	for k, m := range v {
		if m == nil || !m.ProtoReflect().IsValid() {
			continue
		}
		b, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(m)
		if err != nil {
			return err
		}
		out[k] = b
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(out)
}

// enumName turns MEMBER_ROLE_EDGE into "edge".
func enumName(s, prefix string) string {
	return strings.ReplaceAll(strings.ToLower(strings.TrimPrefix(s, prefix)), "_", "-")
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func joinOrDash(ss []string) string { return orDash(strings.Join(ss, ",")) }

// clusterStatus is "keelctl cluster status".
func clusterStatus(ctx context.Context, w io.Writer, f clusterFlags) error {
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	c := coordinatorClient(f.coordinator)
	st, err := call(ctx, "coordinator status", f.coordinator, c.Status, &coordinatorv1.StatusRequest{})
	if err != nil {
		return err
	}
	snap, err := clusterSnapshot(ctx, c, f.coordinator)
	if err != nil {
		return err
	}
	var rs *routerv1.StatusResponse
	if f.router != "" {
		if rs, err = call(ctx, "router status", f.router, routerClient(f.router).Status, &routerv1.StatusRequest{}); err != nil {
			return err
		}
	}
	if f.output == "json" {
		return writeJSON(w, map[string]proto.Message{"coordinator": st, "snapshot": snap, "router": rs})
	}
	tw := newTable(w)
	fmt.Fprintln(tw, "NODE\tRAFT STATE\tLEADER\tLEADER ADDRESS\tTERM\tCOMMIT\tAPPLIED\tSESSIONS\tCONFIG")
	fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%d\t%d\t%d\n", st.GetNodeId(), enumName(st.GetRaftState().String(), "RAFT_STATE_"),
		orDash(st.GetLeaderId()), orDash(st.GetLeaderAddress()), st.GetTerm(), st.GetCommitIndex(), st.GetAppliedIndex(),
		st.GetSessionCount(), st.GetConfigVersion())
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	tw = newTable(w)
	fmt.Fprintln(tw, "MEMBER\tROLE\tSTATE\tINCARNATION\tADDRESS")
	if len(st.GetMembers()) == 0 {
		fmt.Fprintln(tw, "(none)")
	}
	for _, m := range st.GetMembers() {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\n", m.GetMemberId(), enumName(m.GetRole().String(), "MEMBER_ROLE_"),
			enumName(m.GetState().String(), "MEMBER_STATE_"), m.GetIncarnation(), orDash(m.GetAddress()))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	tw = newTable(w)
	fmt.Fprintln(tw, "REDIS GROUP\tPRIMARY\tEPOCH\tREPLICAS\tUPDATED")
	if len(snap.GetRedisGroups()) == 0 {
		fmt.Fprintln(tw, "(none)")
	}
	for _, g := range snap.GetRedisGroups() {
		updated := "-"
		if g.GetUpdatedAt() != nil {
			updated = g.GetUpdatedAt().AsTime().UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(tw, "%d\t%s\t%d\t%s\t%s\n", g.GetGroupId(), orDash(g.GetPrimaryAddress()), g.GetRecordEpoch(),
			joinOrDash(g.GetReplicaAddresses()), updated)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if rs != nil {
		fmt.Fprintln(w)
		tw = newTable(w)
		fmt.Fprintln(tw, "ROUTER NODE\tROUTER MEMBERS\tROUTE KEYS\tWILDCARD ROUTES\tCONNECTED EDGES\tANSWERS")
		answers := "settled"
		if !rs.GetSettled() {
			answers = "settling (publishes go to every edge)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%s\n", rs.GetNodeId(), joinOrDash(rs.GetRouterMembers()), rs.GetRouteCount(),
			rs.GetWildcardRouteCount(), rs.GetConnectedEdges(), answers)
		return tw.Flush()
	}
	return nil
}

func newTable(w io.Writer) *tabwriter.Writer { return tabwriter.NewWriter(w, 2, 4, 2, ' ', 0) }

// clusterSnapshot reads the first event of a WatchCluster stream: the full
// cluster state (members, config, Redis group records).
func clusterSnapshot(ctx context.Context, c coordinatorv1connect.CoordinatorServiceClient, url string) (*coordinatorv1.ClusterSnapshot, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.WatchCluster(ctx, connect.NewRequest(&coordinatorv1.WatchClusterRequest{
		MemberId: "keelctl", Role: coordinatorv1.MemberRole_MEMBER_ROLE_OUTPUT}))
	if err != nil {
		return nil, fmt.Errorf("cluster watch at %s: %w", url, err)
	}
	defer stream.Close()
	for stream.Receive() {
		if s := stream.Msg().GetSnapshot(); s != nil {
			return s, nil
		}
	}
	err = stream.Err()
	if err == nil {
		err = errors.New("stream ended without a snapshot")
	}
	return nil, fmt.Errorf("cluster watch at %s: %w", url, err)
}

// showRoutes is "keelctl routes".
func showRoutes(ctx context.Context, w io.Writer, f clusterFlags, topic string) error {
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	resp, err := call(ctx, "route lookup", f.router, routerClient(f.router).Lookup,
		&routerv1.LookupRequest{Tenant: f.tenant, Topic: topic})
	if err != nil {
		return err
	}
	if f.output == "json" {
		return writeJSON(w, map[string]proto.Message{"lookup": resp})
	}
	if len(resp.GetEdgeIds()) == 0 && len(resp.GetSharedGroups()) == 0 {
		_, err := fmt.Fprintf(w, "no routes match topic %q of tenant %s\n", topic, f.tenant)
		return err
	}
	tw := newTable(w)
	fmt.Fprintln(tw, "KIND\tSHARE GROUP\tFILTER\tEDGES")
	if len(resp.GetEdgeIds()) > 0 {
		fmt.Fprintf(tw, "direct\t-\t-\t%s\n", strings.Join(resp.GetEdgeIds(), ","))
	}
	for _, g := range resp.GetSharedGroups() {
		fmt.Fprintf(tw, "shared\t%s\t%s\t%s\n", g.GetGroup(), g.GetFilter(), joinOrDash(g.GetEdgeIds()))
	}
	return tw.Flush()
}

// showSession is "keelctl session show".
func showSession(ctx context.Context, w io.Writer, f clusterFlags, client string) error {
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	key := &commonv1.SessionKey{Tenant: f.tenant, ClientId: client}
	var (
		own    *coordinatorv1.GetSessionResponse
		stored *persistencev1.LoadSessionResponse
		err    error
	)
	if f.coordinator != "" {
		if own, err = call(ctx, "session ownership", f.coordinator, coordinatorClient(f.coordinator).GetSession,
			&coordinatorv1.GetSessionRequest{Session: key}); err != nil {
			return err
		}
	}
	if f.persistence != "" {
		u, err := groupURL(ctx, f, client)
		if err != nil {
			return err
		}
		if stored, err = call(ctx, "session load", u, persistenceClient(u).LoadSession,
			&persistencev1.LoadSessionRequest{Session: key}); err != nil {
			return err
		}
	}
	if f.output == "json" {
		return writeJSON(w, map[string]proto.Message{"ownership": own, "stored": stored})
	}
	tw := newTable(w)
	fmt.Fprintf(tw, "SESSION\t%s/%s\n", f.tenant, client)
	if own != nil {
		if r := own.GetSession(); r != nil {
			granted := "-"
			if r.GetGrantedAt() != nil {
				granted = r.GetGrantedAt().AsTime().UTC().Format(time.RFC3339)
			}
			fmt.Fprintf(tw, "OWNER\t%s (incarnation %d, %s)\n", r.GetOwnerEdgeId(), r.GetOwnerIncarnation(),
				enumName(r.GetOwnerKind().String(), "SESSION_OWNER_KIND_"))
			fmt.Fprintf(tw, "EPOCH\t%d (granted %s)\n", r.GetEpoch(), granted)
		} else {
			fmt.Fprintln(tw, "OWNER\t(none)")
		}
	}
	if stored != nil {
		fmt.Fprintf(tw, "STORED EPOCH\t%d\n", stored.GetEpoch())
		if s := stored.GetSession(); s != nil {
			disc := "connected (or never disconnected)"
			if n := s.GetDisconnectedUnixNano(); n != 0 {
				disc = time.Unix(0, n).UTC().Format(time.RFC3339)
			}
			fmt.Fprintf(tw, "PROTOCOL\t%d\n", s.GetProtocolVersion())
			fmt.Fprintf(tw, "EXPIRY\t%ds\n", s.GetSessionExpiryInterval())
			fmt.Fprintf(tw, "DISCONNECTED\t%s\n", disc)
			fmt.Fprintf(tw, "WILL\t%v\n", s.GetWill() != nil)
		} else {
			fmt.Fprintln(tw, "STORED\t(no session stored)")
		}
		fmt.Fprintf(tw, "SUBSCRIPTIONS\t%d\n", len(stored.GetSubscriptions()))
		fmt.Fprintf(tw, "QUEUE\t%d\n", len(stored.GetQueue()))
		fmt.Fprintf(tw, "IN-FLIGHT\t%d\n", len(stored.GetInflight()))
		fmt.Fprintf(tw, "INCOMING QOS 2\t%d\n", len(stored.GetIncoming()))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if stored == nil {
		return nil
	}
	msgs := map[string]*commonv1.Message{}
	for _, m := range stored.GetMessages() {
		msgs[msgIDString(m.GetId())] = m
	}
	if len(stored.GetSubscriptions()) > 0 {
		fmt.Fprintln(w)
		tw = newTable(w)
		fmt.Fprintln(tw, "FILTER\tQOS\tNO LOCAL\tRETAIN AS PUBLISHED\tRETAIN HANDLING\tSUBSCRIPTION ID")
		for _, s := range stored.GetSubscriptions() {
			fmt.Fprintf(tw, "%s\t%d\t%v\t%v\t%d\t%d\n", s.GetFilter(), s.GetQos(), s.GetNoLocal(), s.GetRetainAsPublished(),
				s.GetRetainHandling(), s.GetSubscriptionIdentifier())
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	for _, list := range []struct {
		name    string
		entries []*persistencev1.Entry
	}{{"QUEUE", stored.GetQueue()}, {"IN-FLIGHT", stored.GetInflight()}} {
		if len(list.entries) == 0 {
			continue
		}
		shown := list.entries
		if f.limit >= 0 && len(shown) > f.limit {
			shown = shown[:f.limit]
		}
		fmt.Fprintf(w, "\n%s (%d of %d)\n", list.name, len(shown), len(list.entries))
		tw = newTable(w)
		fmt.Fprintln(tw, "SEQ\tMSG ID\tQOS\tPACKET ID\tPUBREL\tTOPIC\tBYTES")
		for _, e := range shown {
			id := msgIDString(e.GetMsgId())
			topic, size := "-", "-"
			if m := msgs[id]; m != nil {
				topic, size = m.GetTopic(), strconv.Itoa(len(m.GetPayload()))
			}
			fmt.Fprintf(tw, "%d\t%s\t%d\t%d\t%v\t%s\t%s\n", e.GetSeq(), id, e.GetQos(), e.GetPacketId(), e.GetPubrel(), topic, size)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	return nil
}

func msgIDString(id *commonv1.MsgID) string {
	return fmt.Sprintf("%s/%d/%d", id.GetEdgeId(), id.GetIncarnation(), id.GetSeq())
}

// edgeStatus is "keelctl edge status".
func edgeStatus(ctx context.Context, w io.Writer, f clusterFlags) error {
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	st, err := call(ctx, "edge status", f.edge, edgeClient(f.edge).Status, &edgev1.StatusRequest{})
	if err != nil {
		return err
	}
	if f.output == "json" {
		return writeJSON(w, map[string]proto.Message{"edge": st})
	}
	tw := newTable(w)
	fmt.Fprintln(tw, "EDGE\tINCARNATION\tSTATE\tLEASE LEFT\tCONNECTIONS\tSESSIONS\tIN CUSTODY\tROUTES")
	fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%d\t%d\t%d\t%d\n", st.GetEdgeId(), st.GetIncarnation(), enumName(st.GetState().String(), "EDGE_STATE_"),
		st.GetLeaseRemaining().AsDuration().Round(time.Millisecond), st.GetConnections(), st.GetSessionsOwned(),
		st.GetSessionsInCustody(), st.GetRoutes())
	if err := tw.Flush(); err != nil || len(st.GetPeers()) == 0 {
		return err
	}
	fmt.Fprintln(w)
	tw = newTable(w)
	fmt.Fprintln(tw, "PEER\tINCARNATION\tCONNECTED\tIN FLIGHT BYTES\tCREDIT BYTES")
	for _, p := range st.GetPeers() {
		fmt.Fprintf(tw, "%s\t%d\t%v\t%d\t%d\n", p.GetEdgeId(), p.GetIncarnation(), p.GetConnected(), p.GetInflightBytes(), p.GetCreditBytes())
	}
	return tw.Flush()
}

// edgeDrain is "keelctl edge drain": it starts the drain (or, called again,
// reports its progress) and with --wait polls until the edge is drained.
func edgeDrain(ctx context.Context, w io.Writer, f clusterFlags) error {
	req := &edgev1.DrainRequest{ServerReference: f.serverReference}
	if f.deadline > 0 {
		req.Deadline = durationpb.New(f.deadline)
	}
	c := edgeClient(f.edge)
	// Fixed widths, not a tabwriter: with --wait, rows come one by one.
	const row = "%-10s  %-16s  %s\n"
	if f.output != "json" {
		fmt.Fprintf(w, row, "STATE", "CONNECTIONS LEFT", "SESSIONS LEFT")
	}
	for {
		cctx, cancel := context.WithTimeout(ctx, callTimeout)
		resp, err := call(cctx, "edge drain", f.edge, c.Drain, req)
		cancel()
		if err != nil {
			return err
		}
		if f.output == "json" {
			if err := writeJSON(w, map[string]proto.Message{"drain": resp}); err != nil {
				return err
			}
		} else {
			if _, err := fmt.Fprintf(w, row, enumName(resp.GetState().String(), "EDGE_STATE_"),
				strconv.FormatUint(uint64(resp.GetConnectionsRemaining()), 10), strconv.FormatUint(uint64(resp.GetSessionsRemaining()), 10)); err != nil {
				return err
			}
		}
		if !f.wait || resp.GetState() == edgev1.EdgeState_EDGE_STATE_DRAINED {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("edge drain: stopped waiting: %w", ctx.Err())
		case <-time.After(time.Second):
		}
	}
}

// removePeer is "keelctl raft remove-peer".
func removePeer(ctx context.Context, w io.Writer, f clusterFlags, id string) error {
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	resp, err := call(ctx, "raft peer removal", f.coordinator, coordinatorClient(f.coordinator).RemovePeer,
		&coordinatorv1.RemovePeerRequest{NodeId: id})
	if err != nil {
		return err
	}
	if f.output == "json" {
		return writeJSON(w, map[string]proto.Message{"remove_peer": resp})
	}
	fmt.Fprintf(w, "removed %s from the raft configuration; it is now:\n", id)
	tw := newTable(w)
	fmt.Fprintln(tw, "NODE\tRAFT ADDRESS\tVOTER")
	for _, p := range resp.GetPeers() {
		fmt.Fprintf(tw, "%s\t%s\t%v\n", p.GetNodeId(), p.GetAddress(), p.GetVoter())
	}
	return tw.Flush()
}

// listSessions is "keelctl session list": it pages through the ownership
// records at the coordinator until --limit.
func listSessions(ctx context.Context, w io.Writer, f clusterFlags) error {
	c := coordinatorClient(f.coordinator)
	req := &coordinatorv1.ListSessionsRequest{Tenant: f.tenant, OwnerEdgeId: f.edge, ClientIdPrefix: f.prefix}
	all := &coordinatorv1.ListSessionsResponse{}
	for {
		req.PageSize = maxListPage
		if f.limit > 0 {
			req.PageSize = uint32(min(f.limit-len(all.Sessions), maxListPage))
		}
		cctx, cancel := context.WithTimeout(ctx, callTimeout) // per page: a long listing takes many
		page, err := call(cctx, "session list", f.coordinator, c.ListSessions, req)
		cancel()
		if err != nil {
			return err
		}
		all.Sessions = append(all.Sessions, page.GetSessions()...)
		all.Index, all.NextPageToken = page.GetIndex(), page.GetNextPageToken()
		if all.NextPageToken == "" || (f.limit > 0 && len(all.Sessions) >= f.limit) {
			break
		}
		req.PageToken = all.NextPageToken
	}
	if f.limit > 0 && len(all.Sessions) > f.limit {
		all.Sessions = all.Sessions[:f.limit]
	}
	// With sessions left out, next_page_token still names where they
	// continue.
	if f.output == "json" {
		return writeJSON(w, map[string]proto.Message{"list": all})
	}
	if len(all.Sessions) == 0 {
		_, err := fmt.Fprintln(w, "no sessions")
		return err
	}
	tw := newTable(w)
	fmt.Fprintln(tw, "TENANT\tCLIENT ID\tOWNER\tINCARNATION\tKIND\tEPOCH\tGRANTED")
	for _, r := range all.Sessions {
		granted := "-"
		if r.GetGrantedAt() != nil {
			granted = r.GetGrantedAt().AsTime().UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%d\t%s\n", r.GetSession().GetTenant(), r.GetSession().GetClientId(), r.GetOwnerEdgeId(),
			r.GetOwnerIncarnation(), enumName(r.GetOwnerKind().String(), "SESSION_OWNER_KIND_"), r.GetEpoch(), granted)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if all.NextPageToken != "" {
		_, err := fmt.Fprintf(w, "(first %d sessions; the listing goes on: raise --limit, or 0 for all)\n", len(all.Sessions))
		return err
	}
	return nil
}

// maxListPage is the page size session list asks for: the coordinator's cap.
const maxListPage = 1000

// kickAttempts bounds how often session kick looks the owner up again when
// the session moved between the lookup and the kick.
const kickAttempts = 3

// kickSession is "keelctl session kick": it finds the session's owner edge
// at the coordinator and asks that edge to disconnect the client (and with
// --discard to end the session).
func kickSession(ctx context.Context, w io.Writer, f clusterFlags, client string) error {
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	c := coordinatorClient(f.coordinator)
	key := &commonv1.SessionKey{Tenant: f.tenant, ClientId: client}
	var prev *coordinatorv1.SessionRecord
	for attempt := 1; ; attempt++ {
		own, err := call(ctx, "session ownership", f.coordinator, c.GetSession, &coordinatorv1.GetSessionRequest{Session: key})
		if err != nil {
			return err
		}
		rec := own.GetSession()
		if rec == nil {
			return connect.NewError(connect.CodeNotFound, fmt.Errorf("session kick: session %s/%s has no owner at the coordinator: no such session", f.tenant, client))
		}
		if prev != nil && rec.GetEpoch() == prev.GetEpoch() {
			// The owner answered that it holds no such session, and the
			// coordinator still names it: nothing moved.
			return connect.NewError(connect.CodeNotFound, fmt.Errorf("session kick: edge %s owns session %s/%s at the coordinator (epoch %d) but holds no such session",
				rec.GetOwnerEdgeId(), f.tenant, client, rec.GetEpoch()))
		}
		url := f.edge
		if url == "" {
			if url, err = ownerURL(ctx, c, f.coordinator, rec); err != nil {
				return err
			}
		}
		resp, err := call(ctx, "session kick", url, edgeClient(url).KickSession,
			&edgev1.KickSessionRequest{Session: key, Discard: f.discard})
		if connect.CodeOf(err) == connect.CodeNotFound && f.edge == "" && attempt < kickAttempts {
			prev = rec // the session may have moved since the lookup: look again
			continue
		}
		if err != nil {
			return err
		}
		if f.output == "json" {
			return writeJSON(w, map[string]proto.Message{"ownership": own, "kick": resp})
		}
		what := "offline, nothing to disconnect"
		switch {
		case resp.GetWasConnected() && resp.GetProtocolVersion() == 5:
			what = "client disconnected (DISCONNECT 0x98, administrative action)"
		case resp.GetWasConnected():
			what = fmt.Sprintf("client disconnected (MQTT %s: connection closed)", protocolName(resp.GetProtocolVersion()))
		}
		session := "session kept"
		if resp.GetDiscarded() {
			session = "session ended"
		}
		_, err = fmt.Fprintf(w, "session %s/%s on edge %s (epoch %d): %s; %s\n", f.tenant, client, rec.GetOwnerEdgeId(), rec.GetEpoch(), what, session)
		return err
	}
}

// ownerURL returns the edge API URL of the session's owner from the
// coordinator's membership.
func ownerURL(ctx context.Context, c coordinatorv1connect.CoordinatorServiceClient, url string, rec *coordinatorv1.SessionRecord) (string, error) {
	st, err := call(ctx, "coordinator status", url, c.Status, &coordinatorv1.StatusRequest{})
	if err != nil {
		return "", err
	}
	for _, m := range st.GetMembers() {
		if m.GetMemberId() != rec.GetOwnerEdgeId() || m.GetRole() != coordinatorv1.MemberRole_MEMBER_ROLE_EDGE {
			continue
		}
		switch {
		case m.GetIncarnation() != rec.GetOwnerIncarnation():
			return "", connect.NewError(connect.CodeUnavailable, fmt.Errorf("session kick: owner edge %s rejoined (incarnation %d, the session's is %d); "+
				"the session goes to a custodian: try again shortly", m.GetMemberId(), m.GetIncarnation(), rec.GetOwnerIncarnation()))
		case m.GetState() != coordinatorv1.MemberState_MEMBER_STATE_ALIVE && m.GetState() != coordinatorv1.MemberState_MEMBER_STATE_DRAINING:
			return "", connect.NewError(connect.CodeUnavailable, fmt.Errorf("session kick: owner edge %s is %s; its sessions go to custodians: try again shortly",
				m.GetMemberId(), enumName(m.GetState().String(), "MEMBER_STATE_")))
		case m.GetAddress() == "":
			return "", fmt.Errorf("session kick: owner edge %s has no API address; give --edge URL", m.GetMemberId())
		}
		if addr := m.GetAddress(); strings.Contains(addr, "://") {
			return addr, nil
		}
		// Edges advertise host:port, and call each other there over h2c.
		return "http://" + m.GetAddress(), nil
	}
	return "", connect.NewError(connect.CodeUnavailable, fmt.Errorf("session kick: owner edge %s is not a member any more; its sessions go to custodians: try again shortly",
		rec.GetOwnerEdgeId()))
}

func protocolName(v uint32) string {
	switch v {
	case 3:
		return "3.1"
	case 4:
		return "3.1.1"
	}
	return strconv.FormatUint(uint64(v), 10)
}
