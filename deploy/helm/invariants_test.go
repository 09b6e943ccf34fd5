package helm

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"
)

// workload is a Deployment or StatefulSet reduced to what the checks need.
type workload struct {
	kind, name string
	replicas   *int32
	selector   map[string]string
	pod        corev1.PodTemplateSpec
}

func (r rendering) workloads() []workload {
	var ws []workload
	for _, o := range r.objs {
		switch v := o.obj.(type) {
		case *appsv1.Deployment:
			ws = append(ws, workload{"Deployment", v.Name, v.Spec.Replicas, v.Spec.Selector.MatchLabels, v.Spec.Template})
		case *appsv1.StatefulSet:
			ws = append(ws, workload{"StatefulSet", v.Name, v.Spec.Replicas, v.Spec.Selector.MatchLabels, v.Spec.Template})
		}
	}
	return ws
}

func find[T any](r rendering, name string) (T, bool) {
	for _, o := range r.objs {
		if v, ok := o.obj.(T); ok && o.name == name {
			return v, true
		}
	}
	var zero T
	return zero, false
}

func all[T any](r rendering) []T {
	var out []T
	for _, o := range r.objs {
		if v, ok := o.obj.(T); ok {
			out = append(out, v)
		}
	}
	return out
}

func mustFind[T any](t *testing.T, r rendering, name string) T {
	t.Helper()
	v, ok := find[T](r, name)
	if !ok {
		t.Fatalf("no %T named %q rendered", v, name)
	}
	return v
}

// flagsOf returns a container's --name=value args as a map.
func flagsOf(c corev1.Container) map[string]string {
	m := map[string]string{}
	for _, a := range c.Args {
		if k, v, ok := strings.Cut(strings.TrimPrefix(a, "--"), "="); ok && strings.HasPrefix(a, "--") {
			m[k] = v
		}
	}
	return m
}

func container(t *testing.T, p corev1.PodTemplateSpec, name string) corev1.Container {
	t.Helper()
	for _, c := range p.Spec.Containers {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no container %q", name)
	return corev1.Container{}
}

func majority(n int) int { return n/2 + 1 }

func forCases(t *testing.T, f func(t *testing.T, r rendering)) {
	for name, vals := range cases(t) {
		t.Run(name, func(t *testing.T) { f(t, render(t, umbrella, vals)) })
	}
}

// TestEdgeDrain: SIGTERM reaches the edge only after the preStop sleep, and
// the kubelet's SIGKILL only after every shutdown step had its full
// stop-timeout; a rolling update never removes an edge before its
// replacement is ready.
func TestEdgeDrain(t *testing.T) {
	forCases(t, func(t *testing.T, r rendering) {
		d := mustFind[*appsv1.Deployment](t, r, "keel-edge")
		spec := d.Spec.Template.Spec
		c := container(t, d.Spec.Template, "edge")
		if c.Lifecycle == nil || c.Lifecycle.PreStop == nil || c.Lifecycle.PreStop.Sleep == nil {
			t.Fatal("edge has no preStop sleep")
		}
		preStop := time.Duration(c.Lifecycle.PreStop.Sleep.Seconds) * time.Second
		if preStop <= 0 {
			t.Errorf("preStop sleep %v", preStop)
		}
		stop, err := time.ParseDuration(flagsOf(c)["stop-timeout"])
		if err != nil {
			t.Fatalf("edge --stop-timeout: %v", err)
		}
		const edgeStopSteps = 3 // mqtt (drain), sys, ops: each bounded by --stop-timeout
		need := preStop + edgeStopSteps*stop
		grace := time.Duration(*spec.TerminationGracePeriodSeconds) * time.Second
		if grace < need {
			t.Errorf("terminationGracePeriodSeconds %v < preStop %v + %d x stop-timeout %v", grace, preStop, edgeStopSteps, stop)
		}
		ru := d.Spec.Strategy.RollingUpdate
		if d.Spec.Strategy.Type != appsv1.RollingUpdateDeploymentStrategyType || ru == nil || ru.MaxUnavailable.IntValue() != 0 {
			t.Errorf("edge rolling update must keep maxUnavailable 0, got %+v", d.Spec.Strategy)
		}
	})
	// The chart refuses a grace period that cannot cover the drain.
	_, err := renderChart(umbrella, map[string]any{"edge": map[string]any{"terminationGracePeriodSeconds": 20}})
	if err == nil || !strings.Contains(err.Error(), "draining needs at least") {
		t.Errorf("short grace period: got %v", err)
	}
}

// TestCoordinatorQuorum: an odd number of voters, bootstrap-expect equal to
// it, a PDB that never lets voluntary disruptions break the majority, and
// the plumbing a Raft StatefulSet needs (parallel start, not-ready DNS, PVCs).
func TestCoordinatorQuorum(t *testing.T) {
	check := func(t *testing.T, r rendering, want int) {
		s := mustFind[*appsv1.StatefulSet](t, r, "keel-coordinator")
		n := int(*s.Spec.Replicas)
		if n != want || n%2 == 0 || n < 3 {
			t.Errorf("coordinator replicas %d, want %d (odd, >= 3)", n, want)
		}
		f := flagsOf(container(t, s.Spec.Template, "coordinator"))
		if got := f["raft.bootstrap-expect"]; got != strconv.Itoa(n) {
			t.Errorf("--raft.bootstrap-expect=%s, replicas %d", got, n)
		}
		if s.Spec.PodManagementPolicy != appsv1.ParallelPodManagement {
			t.Errorf("podManagementPolicy %q: ordered start never reaches bootstrap-expect", s.Spec.PodManagementPolicy)
		}
		if len(s.Spec.VolumeClaimTemplates) != 1 || !strings.HasPrefix(f["raft.data-dir"], "/data/") {
			t.Errorf("Raft state must live on the PVC mounted at /data: %d claims, data-dir %q", len(s.Spec.VolumeClaimTemplates), f["raft.data-dir"])
		}
		h := mustFind[*corev1.Service](t, r, s.Spec.ServiceName)
		if h.Spec.ClusterIP != corev1.ClusterIPNone || !h.Spec.PublishNotReadyAddresses {
			t.Errorf("%s must be headless and publish not-ready addresses", h.Name)
		}
		if !strings.HasPrefix(f["gossip.join"], h.Name+".") {
			t.Errorf("--gossip.join=%s should name the headless service %s", f["gossip.join"], h.Name)
		}
		pdb := mustFind[*policyv1.PodDisruptionBudget](t, r, "keel-coordinator")
		if pdb.Spec.MinAvailable == nil || pdb.Spec.MinAvailable.IntValue() != majority(n) {
			t.Errorf("coordinator PDB minAvailable %v, want the majority %d of %d", pdb.Spec.MinAvailable, majority(n), n)
		}
		if !selects(pdb.Spec.Selector.MatchLabels, s.Spec.Template.Labels) {
			t.Error("coordinator PDB does not select the coordinator pods")
		}
	}
	forCases(t, func(t *testing.T, r rendering) {
		n := 3
		if _, ok := find[*monitoringv1.ServiceMonitor](r, "keel-coordinator"); ok { // production
			n = 5
		}
		check(t, r, n)
	})
	t.Run("replicas=5", func(t *testing.T) {
		check(t, render(t, umbrella, map[string]any{"coordinator": map[string]any{"replicas": 5}}), 5)
	})
}

// TestRouterQuorum: Olric's member quorum is a majority of router nodes,
// every node is listed as a peer, and the PDB keeps that quorum.
func TestRouterQuorum(t *testing.T) {
	forCases(t, func(t *testing.T, r rendering) {
		s := mustFind[*appsv1.StatefulSet](t, r, "keel-router")
		n := int(*s.Spec.Replicas)
		f := flagsOf(container(t, s.Spec.Template, "router"))
		if f["olric.member-count-quorum"] != strconv.Itoa(majority(n)) {
			t.Errorf("--olric.member-count-quorum=%s for %d nodes", f["olric.member-count-quorum"], n)
		}
		if peers := strings.Split(f["olric.peers"], ","); len(peers) != n {
			t.Errorf("--olric.peers lists %d nodes, replicas %d", len(peers), n)
		}
		if f["olric.write-quorum"] > f["olric.replica-count"] {
			t.Errorf("write quorum %s above replica count %s", f["olric.write-quorum"], f["olric.replica-count"])
		}
		pdb := mustFind[*policyv1.PodDisruptionBudget](t, r, "keel-router")
		if pdb.Spec.MinAvailable == nil || pdb.Spec.MinAvailable.IntValue() != majority(n) {
			t.Errorf("router PDB minAvailable %v, want %d", pdb.Spec.MinAvailable, majority(n))
		}
	})
}

// TestRedisGroups: each group is node 0 (the first primary) and replicas
// that replicate from it, each a one-pod StatefulSet with AOF everysec on a
// PVC, noeviction and min-replicas-to-write, fronted by a persistence
// instance that knows its own node and the others of its group.
func TestRedisGroups(t *testing.T) {
	forCases(t, func(t *testing.T, r rendering) {
		nodes := map[string]int{}
		for _, s := range all[*appsv1.StatefulSet](r) {
			g, ok := s.Spec.Template.Labels["keel.io/redis-group"]
			if !ok {
				continue
			}
			nodes[g]++
			n := s.Spec.Template.Labels["keel.io/redis-node"]
			redis := container(t, s.Spec.Template, "redis")
			args := " " + strings.Join(redis.Args, " ") + " "
			for _, want := range []string{" --appendonly yes ", " --appendfsync everysec ", " --dir /data ", " --maxmemory-policy noeviction ", " --min-replicas-to-write 1 "} {
				if !strings.Contains(args, want) {
					t.Errorf("%s: redis args lack %q", s.Name, strings.TrimSpace(want))
				}
			}
			mounted := false
			for _, m := range redis.VolumeMounts {
				mounted = mounted || (m.Name == "data" && m.MountPath == "/data")
			}
			if !mounted || len(s.Spec.VolumeClaimTemplates) != 1 || s.Spec.VolumeClaimTemplates[0].Name != "data" {
				t.Errorf("%s: the AOF directory must be the PVC", s.Name)
			}
			if *s.Spec.Replicas != 1 {
				t.Errorf("%s: one Redis node per StatefulSet, got %d", s.Name, *s.Spec.Replicas)
			}
			host := func(node string) string {
				return fmt.Sprintf("keel-persistence-%s-%s-0.keel-persistence-%s.keel.svc.cluster.local:6379", g, node, g)
			}
			if n == "0" {
				if strings.Contains(args, "--replicaof") {
					t.Errorf("%s: node 0 starts as the primary", s.Name)
				}
			} else if !strings.Contains(args, " --replicaof "+strings.Replace(host("0"), ":", " ", 1)+" ") {
				t.Errorf("%s: a replica must start replicating from node 0 (%s): %s", s.Name, host("0"), args)
			}
			p := flagsOf(container(t, s.Spec.Template, "persistence"))
			if p["redis.addr"] != host(n) {
				t.Errorf("%s: --redis.addr=%s, want its own node %s", s.Name, p["redis.addr"], host(n))
			}
			if others := strings.Split(p["redis.replicas"], ","); slices.Contains(others, host(n)) || len(others) < 1 {
				t.Errorf("%s: --redis.replicas=%s must list the other nodes only", s.Name, p["redis.replicas"])
			}
			if "g"+p["redis.group-id"] != g || p["redis.min-replicas"] == "0" || !strings.HasPrefix(p["coordinator.addr"], "http://") {
				t.Errorf("%s: persistence flags %v", s.Name, p)
			}
		}
		if len(nodes) == 0 {
			t.Error("no Redis group rendered")
		}
		for g, c := range nodes {
			if c < 3 {
				t.Errorf("group %s has %d nodes, want a primary and 2 replicas", g, c)
			}
		}
	})
}

// TestHPATargetsEdge: the autoscaler drives the edge Deployment on CPU and
// on keel_edge_load_score, and the Deployment leaves replicas to it.
func TestHPATargetsEdge(t *testing.T) {
	forCases(t, func(t *testing.T, r rendering) {
		hpas := all[*autoscalingv2.HorizontalPodAutoscaler](r)
		if len(hpas) != 1 {
			t.Fatalf("%d HPAs rendered, want 1", len(hpas))
		}
		h := hpas[0]
		ref := h.Spec.ScaleTargetRef
		d, ok := find[*appsv1.Deployment](r, ref.Name)
		if !ok || ref.Kind != "Deployment" || ref.APIVersion != "apps/v1" || d.Labels["app.kubernetes.io/name"] != "edge" {
			t.Fatalf("HPA targets %+v, not the edge Deployment", ref)
		}
		if d.Spec.Replicas != nil {
			t.Error("edge Deployment sets replicas while the HPA owns them (every upgrade would reset the scale)")
		}
		var cpu, load bool
		for _, m := range h.Spec.Metrics {
			cpu = cpu || (m.Type == autoscalingv2.ResourceMetricSourceType && m.Resource.Name == corev1.ResourceCPU)
			load = load || (m.Type == autoscalingv2.PodsMetricSourceType && m.Pods.Metric.Name == "keel_edge_load_score")
		}
		if !cpu || !load {
			t.Errorf("HPA metrics cpu=%v keel_edge_load_score=%v", cpu, load)
		}
		if _, ok := container(t, d.Spec.Template, "edge").Resources.Requests[corev1.ResourceCPU]; !ok {
			t.Error("CPU utilisation needs a CPU request on the edge")
		}
		if *h.Spec.MinReplicas > h.Spec.MaxReplicas {
			t.Errorf("minReplicas %d > maxReplicas %d", *h.Spec.MinReplicas, h.Spec.MaxReplicas)
		}
	})
}

// TestPodHardening: every container of every workload has readiness and
// liveness probes, resource requests and a memory limit, runs as 65534
// with a read-only root filesystem and no privilege escalation, and uses a
// pinned image.
func TestPodHardening(t *testing.T) {
	forCases(t, func(t *testing.T, r rendering) {
		for _, w := range r.workloads() {
			ps := w.pod.Spec
			if ps.SecurityContext == nil || ps.SecurityContext.RunAsNonRoot == nil || !*ps.SecurityContext.RunAsNonRoot {
				t.Errorf("%s: pod not runAsNonRoot", w.name)
			}
			if ps.AutomountServiceAccountToken == nil || *ps.AutomountServiceAccountToken {
				t.Errorf("%s: mounts a service account token it does not need", w.name)
			}
			if len(ps.InitContainers) > 0 {
				t.Errorf("%s: unexpected init containers", w.name)
			}
			for _, c := range ps.Containers {
				id := w.name + "/" + c.Name
				if c.ReadinessProbe == nil || c.LivenessProbe == nil {
					t.Errorf("%s: missing readiness or liveness probe", id)
				}
				if hg := c.ReadinessProbe; hg != nil && hg.HTTPGet != nil && hg.HTTPGet.Path != "/readyz" {
					t.Errorf("%s: readiness on %s, want /readyz", id, hg.HTTPGet.Path)
				}
				if hg := c.LivenessProbe; hg != nil && hg.HTTPGet != nil && hg.HTTPGet.Path != "/healthz" {
					t.Errorf("%s: liveness on %s, want /healthz", id, hg.HTTPGet.Path)
				}
				if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Memory().IsZero() {
					t.Errorf("%s: needs cpu and memory requests and a memory limit, has %v", id, c.Resources)
				}
				sc := c.SecurityContext
				if sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser == nil || *sc.RunAsUser != 65534 {
					t.Errorf("%s: must run as non-root user 65534", id)
					continue
				}
				if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
					t.Errorf("%s: root filesystem not read-only", id)
				}
				if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || sc.Capabilities == nil || len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL" {
					t.Errorf("%s: must drop ALL capabilities and forbid privilege escalation", id)
				}
				img := c.Image
				name := img[strings.LastIndex(img, "/")+1:]
				if !strings.Contains(img, "@sha256:") && (!strings.Contains(name, ":") || strings.HasSuffix(name, ":latest")) {
					t.Errorf("%s: image %q is not pinned", id, img)
				}
			}
		}
	})
	_, err := renderChart(umbrella, map[string]any{"global": map[string]any{"image": map[string]any{"tag": "latest"}}})
	if err == nil || !strings.Contains(err.Error(), `the tag "latest" is not allowed`) {
		t.Errorf("tag latest: got %v", err)
	}
}

func selects(selector, podLabels map[string]string) bool {
	return len(selector) > 0 && labels.SelectorFromSet(selector).Matches(labels.Set(podLabels))
}

// TestSelectorsAndPorts: every Service, PDB and NetworkPolicy selects pods
// the chart renders, and every named port they use exists on those pods.
func TestSelectorsAndPorts(t *testing.T) {
	forCases(t, func(t *testing.T, r rendering) {
		ws := r.workloads()
		podsOf := func(sel map[string]string) []workload {
			var out []workload
			for _, w := range ws {
				if selects(sel, w.pod.Labels) {
					out = append(out, w)
				}
			}
			return out
		}
		hasPort := func(pods []workload, port intstr.IntOrString) bool {
			for _, w := range pods {
				for _, c := range w.pod.Spec.Containers {
					for _, p := range c.Ports {
						if (port.Type == intstr.String && p.Name == port.StrVal) || (port.Type == intstr.Int && p.ContainerPort == port.IntVal) {
							return true
						}
					}
				}
			}
			return false
		}
		for _, w := range ws {
			if !selects(w.selector, w.pod.Labels) {
				t.Errorf("%s %s: selector does not match its own pods", w.kind, w.name)
			}
		}
		for _, s := range all[*corev1.Service](r) {
			pods := podsOf(s.Spec.Selector)
			if len(pods) == 0 {
				t.Errorf("Service %s selects no pods", s.Name)
			}
			for _, p := range s.Spec.Ports {
				if !hasPort(pods, p.TargetPort) {
					t.Errorf("Service %s port %s: target %s not on its pods", s.Name, p.Name, p.TargetPort.String())
				}
			}
		}
		for _, p := range all[*policyv1.PodDisruptionBudget](r) {
			if len(podsOf(p.Spec.Selector.MatchLabels)) == 0 {
				t.Errorf("PDB %s selects no pods", p.Name)
			}
		}
		for _, np := range all[*networkingv1.NetworkPolicy](r) {
			pods := podsOf(np.Spec.PodSelector.MatchLabels)
			if len(pods) == 0 {
				t.Errorf("NetworkPolicy %s selects no pods", np.Name)
			}
			for _, in := range np.Spec.Ingress {
				for _, p := range in.Ports {
					if p.Port != nil && !hasPort(pods, *p.Port) {
						t.Errorf("NetworkPolicy %s: port %s not on its pods", np.Name, p.Port.String())
					}
				}
				for _, from := range in.From {
					if from.PodSelector != nil && from.NamespaceSelector == nil && len(podsOf(from.PodSelector.MatchLabels)) == 0 {
						t.Errorf("NetworkPolicy %s admits pods no workload has: %v", np.Name, from.PodSelector.MatchLabels)
					}
				}
			}
		}
		// Every workload is behind a NetworkPolicy when they are on.
		for _, w := range ws {
			covered := false
			for _, np := range all[*networkingv1.NetworkPolicy](r) {
				covered = covered || selects(np.Spec.PodSelector.MatchLabels, w.pod.Labels)
			}
			if !covered {
				t.Errorf("%s %s: no NetworkPolicy", w.kind, w.name)
			}
		}
		// The MQTT load balancer exposes 1883 and 8083 (and 8883 with TLS).
		lb := mustFind[*corev1.Service](t, r, "keel-edge-mqtt")
		var ports []int
		for _, p := range lb.Spec.Ports {
			ports = append(ports, int(p.Port))
		}
		sort.Ints(ports)
		if lb.Spec.Type != corev1.ServiceTypeLoadBalancer || !containsAll(ports, 1883, 8083) {
			t.Errorf("MQTT service %s ports %v", lb.Spec.Type, ports)
		}
	})
}

func containsAll(have []int, want ...int) bool {
	for _, w := range want {
		if !slices.Contains(have, w) {
			return false
		}
	}
	return true
}

// TestServiceMonitors: none by default (the CRD may be absent); when on,
// one per service, each selecting exactly one Service with an ops port.
func TestServiceMonitors(t *testing.T) {
	if sms := all[*monitoringv1.ServiceMonitor](render(t, umbrella, nil)); len(sms) != 0 {
		t.Errorf("default render has %d ServiceMonitors", len(sms))
	}
	r := render(t, umbrella, readValues(t, filepath.Join(umbrella, "ci", "production-values.yaml")))
	sms := all[*monitoringv1.ServiceMonitor](r)
	if len(sms) != len(subcharts) {
		t.Errorf("%d ServiceMonitors, want %d", len(sms), len(subcharts))
	}
	for _, sm := range sms {
		var matched []string
		for _, s := range all[*corev1.Service](r) {
			if selects(sm.Spec.Selector.MatchLabels, s.Labels) {
				for _, p := range s.Spec.Ports {
					if p.Name == sm.Spec.Endpoints[0].Port {
						matched = append(matched, s.Name)
					}
				}
			}
		}
		if len(matched) != 1 {
			t.Errorf("ServiceMonitor %s matches services %v, want exactly one with port %q", sm.Name, matched, sm.Spec.Endpoints[0].Port)
		}
	}
}

// TestTLS: with TLS on, the edge serves 8883 from the mounted Secret; with
// inline PEM the chart creates that Secret.
func TestTLS(t *testing.T) {
	r := render(t, umbrella, map[string]any{"edge": map[string]any{"tls": map[string]any{
		"enabled": true, "cert": "-----BEGIN CERTIFICATE-----\n", "key": "-----BEGIN PRIVATE KEY-----\n",
		"clientCA": "-----BEGIN CERTIFICATE-----\n", "clientAuth": true,
	}}})
	s := mustFind[*corev1.Secret](t, r, "keel-edge-tls")
	if s.Type != corev1.SecretTypeTLS || len(s.Data["tls.crt"]) == 0 || len(s.Data["ca.crt"]) == 0 {
		t.Errorf("TLS secret %s: type %s, keys %d", s.Name, s.Type, len(s.Data))
	}
	d := mustFind[*appsv1.Deployment](t, r, "keel-edge")
	f := flagsOf(container(t, d.Spec.Template, "edge"))
	if f["mqtt.tls-addr"] != ":8883" || f["tls.cert"] != "/etc/keel/tls/tls.crt" || f["tls.client-ca"] != "/etc/keel/tls/ca.crt" {
		t.Errorf("edge TLS flags: %v", f)
	}
	_, err := renderChart(umbrella, map[string]any{"edge": map[string]any{"tls": map[string]any{"enabled": true}}})
	if err == nil || !strings.Contains(err.Error(), "edge.tls.enabled needs") {
		t.Errorf("TLS without a certificate: got %v", err)
	}
}

// TestBadValues: each file in testdata/bad must be refused, with an error
// that names the problem (its "# want:" lines).
func TestBadValues(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("testdata", "bad", "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no testdata/bad/*.yaml: %v", err)
	}
	for _, f := range files {
		t.Run(strings.TrimSuffix(filepath.Base(f), ".yaml"), func(t *testing.T) {
			raw, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			var wants []string
			for _, line := range strings.Split(string(raw), "\n") {
				if w, ok := strings.CutPrefix(line, "# want: "); ok {
					wants = append(wants, w)
				}
			}
			if len(wants) == 0 {
				t.Fatal("no # want: line")
			}
			var vals map[string]any
			if err := yaml.Unmarshal(raw, &vals); err != nil {
				t.Fatal(err)
			}
			_, err = renderChart(umbrella, vals)
			if err == nil {
				t.Fatal("rendered; want an error")
			}
			for _, w := range wants {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error lacks %q:\n%v", w, err)
				}
			}
			t.Logf("%v", err)
		})
	}
}

// assumedPersistenceFlags are the flags of keel-persistence the chart uses
// while its binary is being written; once services/persistence/cmd/
// keel-persistence builds, its --help is checked instead.
var assumedPersistenceFlags = []string{"redis.addr", "redis.min-replicas", "coordinator.addr", "ops.addr"}

// knownFlags builds the service binaries from this workspace and reads
// their flags from --help, by service name.
func knownFlags(t *testing.T) map[string]map[string]bool {
	t.Helper()
	if testing.Short() {
		t.Skip("builds the service binaries")
	}
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	bin := t.TempDir()
	pkgs := map[string]string{
		"edge":        "./services/edge/cmd/keel-edge",
		"coordinator": "./services/coordinator/cmd/keel-coordinator",
		"router":      "./services/router/cmd/keel-router",
		"output":      "./services/output/cmd/keel-output",
		"persistence": "./services/persistence/cmd/keel-persistence",
	}
	known := map[string]map[string]bool{}
	for svc, pkg := range pkgs {
		if m, _ := filepath.Glob(filepath.Join(root, pkg, "*.go")); len(m) == 0 && svc == "persistence" {
			known[svc] = map[string]bool{}
			for _, f := range assumedPersistenceFlags {
				known[svc][f] = true
			}
			t.Logf("persistence: no binary yet, checking against the assumed flags %v", assumedPersistenceFlags)
			continue
		}
		out := filepath.Join(bin, "keel-"+svc)
		build := exec.Command("go", "build", "-o", out, pkg)
		build.Dir = root
		if b, err := build.CombinedOutput(); err != nil {
			t.Skipf("cannot build %s (not this chart's failure): %v\n%s", pkg, err, b)
		}
		help, _ := exec.Command(out, "--help").CombinedOutput() // exits 2 after printing usage
		known[svc] = map[string]bool{}
		for _, line := range strings.Split(string(help), "\n") {
			if f, ok := strings.CutPrefix(line, "  -"); ok {
				known[svc][strings.Fields(f)[0]] = true
			}
		}
		if len(known[svc]) < 3 {
			t.Fatalf("%s --help listed no flags:\n%s", svc, help)
		}
	}
	return known
}

// TestFlagsKnown: every --flag the chart passes is one the service binary
// defines (a typo or a renamed flag would stop the pod at start), and every
// KEEL_* variable names one of them (an unknown one is silently ignored).
// The binaries are built from this workspace and asked for --help.
func TestFlagsKnown(t *testing.T) {
	known := knownFlags(t)
	renders := []rendering{render(t, umbrella, nil), render(t, umbrella, readValues(t, filepath.Join(umbrella, "ci", "production-values.yaml")))}
	renders = append(renders, render(t, umbrella, map[string]any{"edge": map[string]any{"tls": map[string]any{"enabled": true, "wss": true, "existingSecret": "x", "clientAuth": true}}}))
	for _, r := range renders {
		for _, w := range r.workloads() {
			for _, c := range w.pod.Spec.Containers {
				if c.Name == "redis" {
					continue
				}
				flags, ok := known[c.Name]
				if !ok {
					t.Errorf("%s/%s: no binary known for container %q", w.name, c.Name, c.Name)
					continue
				}
				for _, a := range c.Args {
					name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
					if !strings.HasPrefix(a, "--") || !flags[name] {
						t.Errorf("%s/%s: keel-%s has no flag %q", w.name, c.Name, c.Name, a)
					}
				}
				// A KEEL_* variable is read only if it names a flag (libs/config).
				env := map[string]bool{}
				for f := range flags {
					env["KEEL_"+strings.ToUpper(strings.NewReplacer(".", "_", "-", "_").Replace(f))] = true
				}
				for _, e := range c.Env {
					if strings.HasPrefix(e.Name, "KEEL_") && !env[e.Name] {
						t.Errorf("%s/%s: keel-%s reads no variable %s", w.name, c.Name, c.Name, e.Name)
					}
				}
			}
		}
	}
}

// TestReadmeDocumentsValues: every value of every chart is in the README's
// tables (keys in backticks, prefixed by the subchart's name).
func TestReadmeDocumentsValues(t *testing.T) {
	readme, err := os.ReadFile(filepath.Join(umbrella, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range append([]string{umbrella}, subcharts...) {
		raw, err := os.ReadFile(filepath.Join(chartPath(c), "values.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		var vals map[string]any
		if err := yaml.Unmarshal(raw, &vals); err != nil {
			t.Fatal(err)
		}
		prefix := c + "."
		if c == umbrella {
			prefix = ""
		}
		var walk func(path string, v any)
		walk = func(path string, v any) {
			if m, ok := v.(map[string]any); ok && len(m) > 0 {
				for k, sub := range m {
					walk(path+"."+k, sub)
				}
				return
			}
			key := strings.TrimPrefix(path, ".")
			if c != umbrella && strings.HasPrefix(key, "global.") {
				return // documented once, from the umbrella
			}
			if c == umbrella && !strings.HasPrefix(key, "global.") {
				return // the subchart sections
			}
			if !strings.Contains(string(readme), "`"+prefix+key+"`") {
				t.Errorf("README.md does not document `%s%s`", prefix, key)
			}
		}
		walk("", vals)
	}
}
