package conformance

import (
	"fmt"
	"os"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
	"github.com/eclipse/paho.golang/paho"
	"github.com/stretchr/testify/require"
)

// acl, user and tenant describe a keel-edge password file.
type acl struct{ publish, subscribe []string }

type user struct {
	password string
	acl      *acl // nil: the tenant's ACL applies
}

type tenant struct {
	acl   *acl // nil: everything inside the tenant is allowed
	users map[string]user
}

// authFile writes a password file for tenants and returns its path.
func authFile(t *testing.T, tenants map[string]tenant) string {
	t.Helper()
	quoteAll := func(xs []string) string {
		q := make([]string, len(xs))
		for i, x := range xs {
			q[i] = fmt.Sprintf("%q", x)
		}
		return "[" + strings.Join(q, ", ") + "]"
	}
	aclYAML := func(a *acl) string {
		return fmt.Sprintf("{publish: %s, subscribe: %s}", quoteAll(a.publish), quoteAll(a.subscribe))
	}
	names := make([]string, 0, len(tenants))
	for name := range tenants {
		names = append(names, name)
	}
	sort.Strings(names)
	var b strings.Builder
	b.WriteString("tenants:\n")
	for _, name := range names {
		tn := tenants[name]
		fmt.Fprintf(&b, "  %s:\n", name)
		if tn.acl != nil {
			fmt.Fprintf(&b, "    acl: %s\n", aclYAML(tn.acl))
		}
		b.WriteString("    users:\n")
		for uname, u := range tn.users {
			fmt.Fprintf(&b, "      %s: {password: %q", uname, hashPassword(t, u.password))
			if u.acl != nil {
				fmt.Fprintf(&b, ", acl: %s", aclYAML(u.acl))
			}
			b.WriteString("}\n")
		}
	}
	return writeFile(t, "passwords.yaml", b.String())
}

// connectAs connects an MQTT 5 client as user@tenant.
func connectAs(t *testing.T, e *edge, clientID, username, password string) *v5Client {
	t.Helper()
	return connectV5(t, e.TCP, withAuth(v5Connect(clientID), username, password))
}

// refusedV5 sends a CONNECT over a raw connection and returns the CONNACK
// reason code, requiring the refusal to be followed by a close.
func refusedV5(t *testing.T, e *edge, cp *packets.Connect) (byte, *packets.Connack) {
	t.Helper()
	rc := dialRaw(t, e.TCP)
	rc.send(t, cp)
	ca := rc.expect(t, packets.CONNACK).Content.(*packets.Connack)
	if ca.ReasonCode >= 0x80 {
		require.False(t, ca.SessionPresent, "[MQTT-3.2.2-6] Session Present 0 on a refusal")
		rc.expectClosed(t, waitMsg) // [MQTT-3.2.2-7]
	}
	return ca.ReasonCode, ca
}

func rawConnectAs(clientID, username, password string) *packets.Connect {
	cp := rawConnect(clientID)
	if username != "" {
		cp.Username, cp.UsernameFlag = username, true
	}
	if password != "" {
		cp.Password, cp.PasswordFlag = []byte(password), true
	}
	return cp
}

// TestConformance_Authentication checks password-file authentication:
// correct credentials are admitted over MQTT 5 and 3.1.1; a wrong password,
// an unknown user or tenant, and (with anonymous access off) no credentials
// are refused with CONNACK 0x86 / return code 4 and the connection closed.
// With anonymous access on as well, a wrong password is still refused.
func TestConformance_Authentication(t *testing.T) {
	t.Parallel()
	file := authFile(t, map[string]tenant{
		"acme":   {users: map[string]user{"alice": {password: "alice-pw"}}},
		"globex": {users: map[string]user{"bob": {password: "bob-pw"}}},
	})
	// Many refusals from one address: the ban after repeated failures
	// (tested in TestConformance_AuthenticationBan) is off here.
	e := startEdge(t, "--auth.file", file, "--mqtt.auth-max-failures", "0")
	for _, tc := range []struct {
		name, user, password string
		ok                   bool
		v5, v311             []byte // acceptable refusal codes
	}{
		{name: "valid", user: "alice@acme", password: "alice-pw", ok: true},
		{name: "wrong_password", user: "alice@acme", password: "nope", v5: []byte{0x86}, v311: []byte{4}},
		{name: "unknown_user", user: "mallory@acme", password: "alice-pw", v5: []byte{0x86}, v311: []byte{4}},
		{name: "unknown_tenant", user: "alice@initech", password: "alice-pw", v5: []byte{0x86}, v311: []byte{4}},
		{name: "user_of_another_tenant", user: "bob@acme", password: "bob-pw", v5: []byte{0x86}, v311: []byte{4}},
		// §3.2.2.2: 0x86 Bad User Name or Password or 0x87 Not authorized;
		// 3.1.1 return codes 4 and 5.
		{name: "no_credentials", v5: []byte{0x86, 0x87}, v311: []byte{4, 5}},
	} {
		t.Run("mqtt5_"+tc.name, func(t *testing.T) {
			t.Parallel()
			code, ca := refusedV5(t, e, rawConnectAs("auth-"+uniq(), tc.user, tc.password))
			if tc.ok {
				require.Equal(t, byte(0), code, "CONNACK reason (%s)", reasonString(ca.Properties))
				return
			}
			require.Contains(t, tc.v5, code, "CONNACK reason 0x%02x", code)
		})
		t.Run("mqtt311_"+tc.name, func(t *testing.T) {
			t.Parallel()
			if !tc.ok && tc.name != "no_credentials" {
			}
			old, code := connectV311Raw(t, e.TCP, v311Conn{clientID: "auth3-" + uniq(), keepAlive: 30, user: tc.user, password: tc.password})
			if tc.ok {
				require.Equal(t, byte(0), code, "3.1.1 CONNACK return code")
				old.expectOpen(t)
				return
			}
			require.Contains(t, tc.v311, code, "3.1.1 CONNACK return code %d", code)
			old.expectClosed(t, waitMsg) // 3.1.1 [MQTT-3.2.2-5]
		})
	}
	t.Run("anonymous_alongside_file", func(t *testing.T) {
		t.Parallel()
		e := startEdge(t, "--auth.file", file, "--auth.anonymous=true", "--mqtt.auth-max-failures", "0")
		topic := topicFor(t)
		anon := connectV5(t, e.TCP, v5Connect("anon-"+uniq()))
		anon.sub(t, "#", 1)
		code, _ := refusedV5(t, e, rawConnectAs("auth-"+uniq(), "alice@acme", "nope"))
		require.Equal(t, byte(0x86), code, "a wrong password is refused, not admitted anonymously")
		alice := connectAs(t, e, "alice-"+uniq(), "alice@acme", "alice-pw")
		alice.pub(t, topic, 1, "acme")
		anon.pub(t, topic, 1, "anonymous")
		anon.expectPayloads(t, "anonymous") // anonymous clients live in their own tenant
	})
}

// TestConformance_ACL checks publish and subscribe ACLs: a forbidden QoS 1/2
// publish is refused with PUBACK/PUBREC 0x87 and not delivered, a forbidden
// subscription is refused with SUBACK 0x87 (0x80 for 3.1.1), %c expands to
// the client ID (and a client ID with wildcards widens nothing), and a
// tenant-level ACL applies to users without their own.
func TestConformance_ACL(t *testing.T) {
	t.Parallel()
	devACL := &acl{publish: []string{"devices/%c/#"}, subscribe: []string{"devices/%c/#", "broadcast/#"}}
	file := authFile(t, map[string]tenant{
		"acme": {users: map[string]user{
			"dev":   {password: "dev-pw", acl: devACL},
			"admin": {password: "admin-pw"},
		}},
		"beta": {acl: &acl{publish: []string{"beta/#"}, subscribe: []string{"beta/#"}}, users: map[string]user{
			"plain": {password: "plain-pw"},
			"super": {password: "super-pw", acl: &acl{publish: []string{"#"}, subscribe: []string{"#"}}},
		}},
	})
	e := startEdge(t, "--auth.file", file)
	admin := func(t *testing.T, filter string) *v5Client {
		t.Helper()
		c := connectAs(t, e, "admin-"+uniq(), "admin@acme", "admin-pw")
		c.sub(t, filter, 1)
		return c
	}

	t.Run("publish", func(t *testing.T) {
		t.Parallel()
		id := "d-" + uniq()
		// Only topics ending in /t: the parallel subtests publish elsewhere
		// under devices/ (a forbidden message here would still show).
		watch := admin(t, "devices/+/t")
		dev := connectAs(t, e, id, "dev@acme", "dev-pw")
		dev.pub(t, "devices/"+id+"/t", 1, "own") // %c: its own subtree
		for _, qos := range []byte{1, 2} {
			pr, err := dev.tryPublish(&paho.Publish{Topic: "devices/other/t", QoS: qos, Payload: []byte("denied")})
			require.NotNil(t, pr, "no acknowledgement: %v", err)
			// §3.4.2.1 / §3.5.2.1: 0x87 Not authorized.
			require.Equal(t, byte(0x87), pr.ReasonCode, "QoS %d publish to a forbidden topic", qos)
		}
		dev.pub(t, "devices/other/t", 0, "denied") // QoS 0: dropped silently
		dev.pub(t, "devices/"+id+"/t", 1, "end")
		watch.expectPayloads(t, "own", "end")
	})
	t.Run("subscribe", func(t *testing.T) {
		t.Parallel()
		id := "d-" + uniq()
		dev := connectAs(t, e, id, "dev@acme", "dev-pw")
		sa, err := dev.trySubscribe(&paho.Subscribe{Subscriptions: []paho.SubscribeOptions{
			{Topic: "devices/" + id + "/#", QoS: 1},
			{Topic: "devices/other/#", QoS: 1},
			{Topic: "#", QoS: 1}, // wider than allowed
			{Topic: "broadcast/+", QoS: 1},
		}})
		require.NoError(t, err)
		require.Equal(t, []byte{0x01, 0x87, 0x87, 0x01}, sa.Reasons, "§3.9.3 SUBACK 0x87 Not authorized")
		pub := connectAs(t, e, "admin-"+uniq(), "admin@acme", "admin-pw")
		pub.pub(t, "devices/other/x", 1, "other")
		pub.pub(t, "devices/"+id+"/x", 1, "own")
		pub.pub(t, "broadcast/all", 1, "broadcast")
		dev.expectPayloads(t, "own", "broadcast")
	})
	t.Run("wildcard_client_id_widens_nothing", func(t *testing.T) {
		t.Parallel()
		// A client ID of "+" must not turn devices/%c/# into devices/+/#.
		dev, err := dialV5(t, e.TCP, withAuth(v5Connect("+"), "dev@acme", "dev-pw"))
		if err != nil && dev != nil && dev.Connack != nil && dev.Connack.ReasonCode == 0x85 {
			return // refusing such a client ID (0x85) is as safe
		}
		require.NoError(t, err)
		pr, _ := dev.tryPublish(&paho.Publish{Topic: "devices/victim/t", QoS: 1, Payload: []byte("x")})
		require.NotNil(t, pr)
		require.Equal(t, byte(0x87), pr.ReasonCode)
		sa, _ := dev.trySubscribe(&paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: "devices/victim/#", QoS: 1}}})
		require.NotNil(t, sa)
		require.Equal(t, []byte{0x87}, sa.Reasons)
	})
	t.Run("will_cannot_bypass_acl", func(t *testing.T) {
		t.Parallel()
		watch := admin(t, "devices/#")
		cp := withAuth(v5Connect("d-"+uniq()), "dev@acme", "dev-pw")
		cp.WillMessage = &paho.WillMessage{Topic: "devices/other/will", QoS: 1, Payload: []byte("will")}
		c, err := dialV5(t, e.TCP, cp)
		if err == nil {
			c.drop() // the will, if accepted, must not be published
			watch.expectNothing(t, noWill)
			return
		}
		require.NotNil(t, c.Connack, "refused without CONNACK: %v", err)
		require.Equal(t, byte(0x87), c.Connack.ReasonCode, "a will to a forbidden topic: CONNACK 0x87")
	})
	t.Run("mqtt311", func(t *testing.T) {
		t.Parallel()
		id := "d-" + uniq()
		watch := admin(t, "devices/#")
		rc, code := connectV311Raw(t, e.TCP, v311Conn{clientID: id, keepAlive: 30, user: "dev@acme", password: "dev-pw"})
		require.Equal(t, byte(0), code)
		rc.sendBytes(t, v311Subscribe(1, 1, "devices/other/#", "devices/"+id+"/#"))
		require.Equal(t, []byte{0x80, 0x01}, rc.v311Suback(t), "3.1.1 SUBACK return codes")
		// 3.1.1 has no negative PUBACK: the server drops the message (and
		// may close the connection).
		rc.sendBytes(t, v311Publish("devices/other/t", 1, 2, "denied"))
		pub := connectAs(t, e, "admin-"+uniq(), "admin@acme", "admin-pw")
		pub.pub(t, "devices/"+id+"/t", 1, "marker")
		watch.expectPayloads(t, "marker")
	})
	t.Run("tenant_acl", func(t *testing.T) {
		t.Parallel()
		plain := connectAs(t, e, "p-"+uniq(), "plain@beta", "plain-pw")
		plain.pub(t, "beta/x", 1, "ok")
		pr, _ := plain.tryPublish(&paho.Publish{Topic: "other/x", QoS: 1, Payload: []byte("x")})
		require.NotNil(t, pr)
		require.Equal(t, byte(0x87), pr.ReasonCode, "the tenant ACL applies to a user without one")
		super := connectAs(t, e, "s-"+uniq(), "super@beta", "super-pw")
		super.pub(t, "other/x", 1, "ok") // the user's own ACL replaces the tenant's
	})
}

// TestConformance_TenantIsolation connects clients of two tenants with the
// same user name, client IDs and topics, and checks that nothing crosses:
// messages, retained messages, wills, shared subscriptions, sessions and
// takeovers stay inside their tenant.
func TestConformance_TenantIsolation(t *testing.T) {
	t.Parallel()
	file := authFile(t, map[string]tenant{
		"acme":   {users: map[string]user{"alice": {password: "acme-pw"}}},
		"globex": {users: map[string]user{"alice": {password: "globex-pw"}}},
	})
	e := startEdge(t, "--auth.file", file)
	acme := func(t *testing.T, id string) *v5Client {
		t.Helper()
		return connectAs(t, e, id, "alice@acme", "acme-pw")
	}
	globex := func(t *testing.T, id string) *v5Client {
		t.Helper()
		return connectAs(t, e, id, "alice@globex", "globex-pw")
	}

	t.Run("messages", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		aSub, gSub, gAll := acme(t, "sub-"+uniq()), globex(t, "sub-"+uniq()), globex(t, "all-"+uniq())
		aSub.sub(t, topic, 1)
		gSub.sub(t, topic, 1)
		// A wildcard over this subtest's topic only: the parallel
		// subtests publish in globex too.
		gAll.sub(t, topic+"/#", 1)
		acme(t, "pub-"+uniq()).pub(t, topic, 1, "acme")
		aSub.expectPayloads(t, "acme")
		globex(t, "pub-"+uniq()).pub(t, topic, 1, "globex")
		gSub.expectPayloads(t, "globex")
		gAll.expectPayloads(t, "globex")
		aSub.expectNothing(t, quiet)
	})
	t.Run("retained", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		acme(t, "pub-"+uniq()).publish(t, &paho.Publish{Topic: topic, QoS: 1, Retain: true, Payload: []byte("acme")})
		gSub := globex(t, "sub-"+uniq())
		gSub.sub(t, topic, 1)
		gSub.sub(t, "#", 1)
		globex(t, "pub-"+uniq()).pub(t, topic, 1, "marker")
		gSub.expectPayloads(t, "marker")
		aSub := acme(t, "sub-"+uniq())
		aSub.sub(t, topic, 1)
		aSub.expectPayloads(t, "acme")
	})
	t.Run("wills", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		aWatch, gWatch := acme(t, "w-"+uniq()), globex(t, "w-"+uniq())
		aWatch.sub(t, topic, 1)
		gWatch.sub(t, topic, 1)
		cp := withAuth(v5Connect("will-"+uniq()), "alice@acme", "acme-pw")
		cp.WillMessage = &paho.WillMessage{Topic: topic, QoS: 1, Payload: []byte("acme-will")}
		connectV5(t, e.TCP, cp).drop()
		aWatch.expectPayloads(t, "acme-will")
		globex(t, "pub-"+uniq()).pub(t, topic, 1, "marker")
		gWatch.expectPayloads(t, "marker")
	})
	t.Run("shared_subscriptions", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		var aMembers, gMembers []*v5Client
		for range 2 {
			a, g := acme(t, "m-"+uniq()), globex(t, "m-"+uniq())
			a.sub(t, "$share/g/"+topic, 1)
			g.sub(t, "$share/g/"+topic, 1)
			aMembers, gMembers = append(aMembers, a), append(gMembers, g)
		}
		pub := acme(t, "pub-"+uniq())
		for _, p := range payloads("acme", 10) {
			pub.pub(t, topic, 1, p)
		}
		n := 0
		for n < 10 {
			select {
			case <-aMembers[0].msgs:
			case <-aMembers[1].msgs:
			case <-time.After(waitMsg):
				t.Fatalf("acme's group got %d of 10 messages", n)
			}
			n++
		}
		globex(t, "pub-"+uniq()).pub(t, topic, 1, "marker")
		select {
		case m := <-gMembers[0].msgs:
			require.Equal(t, "marker", string(m.Payload))
		case m := <-gMembers[1].msgs:
			require.Equal(t, "marker", string(m.Payload))
		case <-time.After(waitMsg):
			t.Fatal("globex's group got no marker")
		}
		gMembers[0].expectNothing(t, quiet)
		gMembers[1].expectNothing(t, 0)
	})
	t.Run("client_ids_sessions_and_takeover", func(t *testing.T) {
		t.Parallel()
		id := "same-" + uniq()
		cp := withAuth(v5Connect(id), "alice@acme", "acme-pw")
		cp.Properties.SessionExpiryInterval = u32(60)
		a := connectV5(t, e.TCP, cp)
		topic := topicFor(t)
		a.sub(t, topic, 1)

		cp = withAuth(v5Connect(id), "alice@globex", "globex-pw")
		cp.CleanStart = false
		cp.Properties.SessionExpiryInterval = u32(60)
		g := connectV5(t, e.TCP, cp)
		require.False(t, g.Connack.SessionPresent, "globex resumed acme's session")
		acme(t, "pub-"+uniq()).pub(t, topic, 1, "still-here")
		a.expectPayloads(t, "still-here") // not taken over
		select {
		case d := <-a.discs:
			t.Fatalf("acme's client was disconnected (0x%02x) by globex's same client ID", d.ReasonCode)
		default:
		}
	})
}

// TestConformance_ReasonString checks that refusals carry a Reason String
// (a keel-edge requirement; MQTT 5 makes them optional), and that with
// Request Problem Information 0 the server sends none on SUBACK and PUBACK
// ([MQTT-3.1.2-29]).
func TestConformance_ReasonString(t *testing.T) {
	t.Parallel()
	file := authFile(t, map[string]tenant{
		"acme": {users: map[string]user{
			"dev": {password: "dev-pw", acl: &acl{publish: []string{"allowed/#"}, subscribe: []string{"allowed/#"}}},
		}},
	})
	e := startEdge(t, "--auth.file", file)
	connect := func(t *testing.T, problemInfo bool) *rawClient {
		t.Helper()
		cp := rawConnectAs("rs-"+uniq(), "dev@acme", "dev-pw")
		if !problemInfo {
			cp.Properties.RequestProblemInfo = bytep(0)
		}
		rc, _ := connectRaw(t, e.TCP, cp)
		return rc
	}
	refusals := func(t *testing.T, rc *rawClient) (*packets.Suback, *packets.Puback) {
		t.Helper()
		rc.send(t, &packets.Subscribe{PacketID: 1, Properties: &packets.Properties{},
			Subscriptions: []packets.SubOptions{{Topic: "a/#/b", QoS: 1}}})
		sa := rc.expect(t, packets.SUBACK).Content.(*packets.Suback)
		require.Equal(t, []byte{0x8f}, sa.Reasons)
		rc.send(t, &packets.Publish{Topic: "forbidden", QoS: 1, PacketID: 2, Payload: []byte("x"), Properties: &packets.Properties{}})
		pa := rc.expect(t, packets.PUBACK).Content.(*packets.Puback)
		require.Equal(t, byte(0x87), pa.ReasonCode)
		return sa, pa
	}

	t.Run("connack", func(t *testing.T) {
		t.Parallel()
		_, ca := refusedV5(t, e, rawConnectAs("rs-"+uniq(), "dev@acme", "nope"))
		require.NotEmpty(t, reasonString(ca.Properties), "CONNACK 0x%02x without Reason String", ca.ReasonCode)
	})
	t.Run("suback", func(t *testing.T) {
		t.Parallel()
		sa, _ := refusals(t, connect(t, true))
		require.NotEmpty(t, reasonString(sa.Properties), "SUBACK 0x8F without Reason String")
	})
	t.Run("puback", func(t *testing.T) {
		t.Parallel()
		_, pa := refusals(t, connect(t, true))
		require.NotEmpty(t, reasonString(pa.Properties), "PUBACK 0x87 without Reason String")
	})
	t.Run("disconnect", func(t *testing.T) {
		t.Parallel()
		rc := connect(t, true)
		rc.send(t, &packets.Publish{Topic: "allowed/+", QoS: 0, Payload: []byte("x"), Properties: &packets.Properties{}})
		d, _ := rc.expectClosed(t, waitMsg)
		require.NotNil(t, d)
		require.NotEmpty(t, reasonString(d.Properties), "DISCONNECT 0x%02x without Reason String", d.ReasonCode)
	})
	t.Run("request_problem_information_0", func(t *testing.T) {
		t.Parallel()
		sa, pa := refusals(t, connect(t, false))
		// [MQTT-3.1.2-29]: no Reason String on packets other than PUBLISH,
		// CONNACK and DISCONNECT.
		require.Empty(t, reasonString(sa.Properties), "SUBACK Reason String despite Request Problem Information 0")
		require.Empty(t, reasonString(pa.Properties), "PUBACK Reason String despite Request Problem Information 0")
	})
}

// TestConformance_AuthenticationBan: an address that fails to authenticate
// too often is banned for a while (CONNACK 0x8A, Banned), even with the right
// password, and admitted again when the ban ends.
func TestConformance_AuthenticationBan(t *testing.T) {
	t.Parallel()
	file := authFile(t, map[string]tenant{"acme": {users: map[string]user{"alice": {password: "alice-pw"}}}})
	e := startEdge(t, "--auth.file", file, "--mqtt.auth-max-failures", "3", "--mqtt.auth-ban-duration", "1s")
	attempt := func(password string) byte {
		c := dialRaw(t, e.TCP)
		cp := rawConnect("ban-probe")
		cp.UsernameFlag, cp.Username = true, "alice@acme"
		cp.PasswordFlag, cp.Password = true, []byte(password)
		c.send(t, cp)
		return c.expect(t, packets.CONNACK).Content.(*packets.Connack).ReasonCode
	}
	for range 3 {
		require.Equal(t, byte(0x86), attempt("wrong"))
	}
	require.Equal(t, byte(0x8A), attempt("alice-pw"), "banned")
	require.Eventually(t, func() bool { return attempt("alice-pw") == 0 }, 5*time.Second, 200*time.Millisecond, "ban ends")
}

// TestConformance_PasswordFileReloadOnSIGHUP changes the password file so
// that its size and modification time stay what they were (the edge's
// poll of the file sees no change), sends the edge SIGHUP, and checks that
// the new password works and the old one no longer does, while a client
// connected before the reload stays connected.
func TestConformance_PasswordFileReloadOnSIGHUP(t *testing.T) {
	t.Parallel()
	skipIfExternal(t, "signals to the edge process")
	file := authFile(t, map[string]tenant{"acme": {users: map[string]user{"alice": {password: "first-pw"}}}})
	e := startEdge(t, "--auth.file", file, "--mqtt.auth-max-failures", "0")
	before := connectAs(t, e, "before-"+uniq(), "alice@acme", "first-pw")
	st, err := os.Stat(file)
	require.NoError(t, err)

	// Same length, new password: the hash of "other-pw" has the length of
	// the first one's (bcrypt hashes are 60 bytes).
	next := authFile(t, map[string]tenant{"acme": {users: map[string]user{"alice": {password: "other-pw"}}}})
	data, err := os.ReadFile(next)
	require.NoError(t, err)
	require.Len(t, data, int(st.Size()))
	require.NoError(t, os.WriteFile(file, data, 0o600))
	require.NoError(t, os.Chtimes(file, st.ModTime(), st.ModTime()))
	time.Sleep(2500 * time.Millisecond) // past a poll of the file, which must see nothing
	code, _ := refusedV5(t, e, rawConnectAs("probe-"+uniq(), "alice@acme", "other-pw"))
	require.Equal(t, byte(0x86), code, "not reloaded yet: the poll saw no change")

	require.NoError(t, e.cmd.Process.Signal(syscall.SIGHUP))
	eventually(t, 5*time.Second, func() error {
		if code, _ := refusedV5(t, e, rawConnectAs("probe-"+uniq(), "alice@acme", "other-pw")); code != 0 {
			return fmt.Errorf("new password refused with 0x%02x", code)
		}
		return nil
	})
	code, _ = refusedV5(t, e, rawConnectAs("probe-"+uniq(), "alice@acme", "first-pw"))
	require.Equal(t, byte(0x86), code, "the old password no longer works")
	topic := topicFor(t)
	before.sub(t, topic, 1)
	before.pub(t, topic, 1, "still connected")
	before.expectPayloads(t, "still connected")
}
