{{- /*
Helpers shared by every Keel chart. This file is copied byte for byte into
every subchart of deploy/helm/keel (TestHelpersInSync checks it), so each
renders on its own and, under the umbrella, whichever copy Helm keeps is
the same. Every helper takes the chart's context (or a
list whose first item is it), never global state.
*/ -}}

{{- define "keel.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- /* keel.peer (list $ "coordinator"): the name of another Keel service of this release. */ -}}
{{- define "keel.peer" -}}
{{- printf "%s-%s" (index . 0).Release.Name (index . 1) | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- define "keel.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "keel.labels" -}}
{{ include "keel.selectorLabels" . }}
app.kubernetes.io/part-of: keel
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- /* keel.image (list $ .Values.image): registry/repository:tag or @digest; never "latest". */ -}}
{{- define "keel.image" -}}
{{- $ := index . 0 -}}
{{- $img := index . 1 -}}
{{- $g := $.Values.global.image | default dict -}}
{{- $tag := toString ($img.tag | default $g.tag | default $.Chart.AppVersion) -}}
{{- if or (eq $tag "latest") (hasSuffix ":latest" $img.repository) -}}
{{- fail (printf "%s: image %s: the tag \"latest\" is not allowed; pin a version or a digest" $.Chart.Name $img.repository) -}}
{{- end -}}
{{- $repo := $img.repository -}}
{{- with $g.registry }}{{ $repo = printf "%s/%s" . $repo }}{{ end -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $repo $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}
{{- end -}}

{{- define "keel.pullPolicy" -}}
{{- $g := (index . 0).Values.global.image | default dict -}}
{{- (index . 1).pullPolicy | default $g.pullPolicy | default "IfNotPresent" -}}
{{- end -}}

{{- /* keel.args (list $ $flags): chart-managed flags merged with .Values.config, sorted, as "--k=v" list items. */ -}}
{{- define "keel.args" -}}
{{- $ := index . 0 -}}
{{- $flags := index . 1 -}}
{{- range $k, $v := $.Values.config -}}
{{- if hasKey $flags $k -}}
{{- fail (printf "%s.config.%s: this flag is set by the chart; use the chart's own value for it" $.Chart.Name $k) -}}
{{- end -}}
{{- $_ := set $flags $k $v -}}
{{- end -}}
{{- $args := list -}}
{{- range $k, $v := $flags -}}
{{- if and (kindIs "float64" $v) (eq $v (floor $v)) }}{{ $v = int64 $v }}{{ end -}}
{{- $args = append $args (printf "--%s=%v" $k $v) -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}

{{- define "keel.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65534
runAsGroup: 65534
fsGroup: 65534
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "keel.securityContext" -}}
runAsNonRoot: true
runAsUser: 65534
runAsGroup: 65534
privileged: false
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{- /* keel.probes: the ops server's /readyz and /healthz on the container port named "ops". */ -}}
{{- define "keel.probes" -}}
{{- $p := .Values.probes -}}
startupProbe:
  httpGet:
    path: /healthz
    port: ops
  periodSeconds: 2
  failureThreshold: {{ $p.startupFailureThreshold }}
readinessProbe:
  httpGet:
    path: /readyz
    port: ops
  periodSeconds: {{ $p.readinessPeriodSeconds }}
  timeoutSeconds: 2
  failureThreshold: 2
livenessProbe:
  httpGet:
    path: /healthz
    port: ops
  periodSeconds: {{ $p.livenessPeriodSeconds }}
  timeoutSeconds: 3
  failureThreshold: {{ $p.livenessFailureThreshold }}
{{- end -}}

{{- define "keel.env" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: GOMEMLIMIT
  valueFrom:
    resourceFieldRef:
      resource: limits.memory
      divisor: "1"
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- /* keel.pod: the pod-level fields every Keel workload shares (scheduling, identity, security). */ -}}
{{- define "keel.pod" -}}
serviceAccountName: {{ include "keel.serviceAccountName" . }}
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  {{- include "keel.podSecurityContext" . | nindent 2 }}
{{- with .Values.global.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
affinity:
{{- if .Values.affinity }}
  {{- toYaml .Values.affinity | nindent 2 }}
{{- else }}
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "keel.selectorLabels" . | nindent 14 }}
{{- end }}
{{- with .Values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "keel.podMetadata" -}}
labels:
  {{- include "keel.selectorLabels" . | nindent 2 }}
  app.kubernetes.io/part-of: keel
  {{- with .Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with .Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "keel.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "keel.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{- define "keel.serviceAccount" -}}
{{- if .Values.serviceAccount.create }}
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {{ include "keel.serviceAccountName" . }}
  labels:
    {{- include "keel.labels" . | nindent 4 }}
  {{- with .Values.serviceAccount.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
automountServiceAccountToken: false
{{- end }}
{{- end -}}

{{- /* keel.serviceMonitor: scrapes /metrics on the "ops" port of the Service labelled keel.io/metrics. A CRD: rendered only when enabled. */ -}}
{{- define "keel.serviceMonitor" -}}
{{- $sm := .Values.global.serviceMonitor -}}
{{- if $sm.enabled }}
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "keel.fullname" . }}
  labels:
    {{- include "keel.labels" . | nindent 4 }}
    {{- with $sm.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "keel.selectorLabels" . | nindent 6 }}
      keel.io/metrics: "true"
  namespaceSelector:
    matchNames:
      - {{ .Release.Namespace }}
  endpoints:
    - port: ops
      path: /metrics
      interval: {{ $sm.interval }}
      scrapeTimeout: {{ $sm.scrapeTimeout }}
{{- end }}
{{- end -}}

{{- /* keel.metricsFrom: NetworkPolicy peers allowed to scrape the ops port. */ -}}
{{- define "keel.metricsFrom" -}}
{{- $np := .Values.global.networkPolicy -}}
- namespaceSelector:
    {{- toYaml ($np.metricsNamespaceSelector | default dict) | nindent 4 }}
  podSelector:
    {{- toYaml ($np.metricsPodSelector | default dict) | nindent 4 }}
{{- end -}}

{{- /* keel.from (list $ "edge" "router"): NetworkPolicy peers for pods of other Keel services of this release. */ -}}
{{- define "keel.from" -}}
{{- $ := index . 0 -}}
{{- range $name := rest . }}
- podSelector:
    matchLabels:
      app.kubernetes.io/name: {{ $name }}
      app.kubernetes.io/instance: {{ $.Release.Name }}
{{- end }}
{{- end -}}

{{- define "keel.quorum" -}}
{{- add (div . 2) 1 -}}
{{- end -}}
