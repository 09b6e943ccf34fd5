{{- /* persistence.group: the headless Service name of Redis group g (dict "ctx" $ "group" g). */ -}}
{{- define "persistence.groupName" -}}
{{- printf "%s-g%d" (include "keel.fullname" .ctx | trunc 45 | trimSuffix "-") (int .group) -}}
{{- end -}}

{{- /* persistence.nodeHost (dict "ctx" $ "group" g "node" n): the stable DNS name of Redis node n of group g. */ -}}
{{- define "persistence.nodeHost" -}}
{{- $group := include "persistence.groupName" . -}}
{{- printf "%s-%d-0.%s.%s.svc.%s" $group (int .node) $group .ctx.Release.Namespace .ctx.Values.global.clusterDomain -}}
{{- end -}}

{{- /*
persistence.statefulset (dict "ctx" $ "group" g "node" n): Redis node n of
group g and the persistence instance that fronts it, as a StatefulSet of one
pod, so that each node's flags (its own address, the other nodes) are exact
without a shell in the image. Node 0 starts as the primary and the others
replicate from it; after that the group record in the coordinator is the
authority and persistence re-points the nodes on failover.
*/ -}}
{{- define "persistence.statefulset" -}}
{{- $ := .ctx -}}
{{- $g := int .group -}}
{{- $n := int .node -}}
{{- $group := include "persistence.groupName" . -}}
{{- $name := printf "%s-%d" $group $n -}}
{{- $rd := $.Values.redis -}}
{{- $role := ternary "primary" "replica" (eq $n 0) -}}
{{- $self := printf "%s:%d" (include "persistence.nodeHost" .) (int $rd.port) -}}
{{- $others := list -}}
{{- range $i := until (add1 (int $rd.replicas) | int) -}}
{{- if ne $i $n -}}
{{- $others = append $others (printf "%s:%d" (include "persistence.nodeHost" (dict "ctx" $ "group" $g "node" $i)) (int $rd.port)) -}}
{{- end -}}
{{- end -}}
{{- $flags := dict
  "redis.addr" $self
  "redis.replicas" (join "," $others)
  "redis.group-id" $g
  "redis.min-replicas" $.Values.minReplicas
  "coordinator.addr" (printf "http://%s.%s.svc:7401" (include "keel.peer" (list $ "coordinator")) $.Release.Namespace)
  "api.addr" (printf ":%d" (int $.Values.ports.api))
  "api.advertise-addr" (printf "http://$(POD_IP):%d" (int $.Values.ports.api))
  "ops.addr" (printf ":%d" (int $.Values.ports.ops))
  "member-id" "$(POD_NAME)"
  "stop-timeout" $.Values.stopTimeout
  "log.level" $.Values.logLevel
  "log.format" $.Values.global.logFormat
-}}
{{- if eq (int $.Values.minReplicas) 0 }}{{ $_ := set $flags "unreplicated" true }}{{ end -}}
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: {{ $name }}
  labels:
    {{- include "keel.labels" $ | nindent 4 }}
    app.kubernetes.io/component: redis
    keel.io/redis-group: {{ printf "g%d" $g | quote }}
    keel.io/redis-node: {{ $n | quote }}
spec:
  replicas: 1
  serviceName: {{ $group }}
  podManagementPolicy: Parallel
  updateStrategy:
    type: RollingUpdate
  revisionHistoryLimit: 5
  persistentVolumeClaimRetentionPolicy:
    whenDeleted: {{ $rd.persistence.whenDeleted }}
    whenScaled: {{ $rd.persistence.whenScaled }}
  selector:
    matchLabels:
      {{- include "keel.selectorLabels" $ | nindent 6 }}
      keel.io/redis-group: {{ printf "g%d" $g | quote }}
      keel.io/redis-node: {{ $n | quote }}
  template:
    metadata:
      labels:
        {{- include "keel.selectorLabels" $ | nindent 8 }}
        app.kubernetes.io/part-of: keel
        keel.io/redis-group: {{ printf "g%d" $g | quote }}
        keel.io/redis-node: {{ $n | quote }}
        keel.io/redis-role: {{ $role }}
        {{- with $.Values.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $.Values.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- include "keel.pod" $ | nindent 6 }}
      terminationGracePeriodSeconds: {{ $.Values.terminationGracePeriodSeconds }}
      containers:
        - name: redis
          image: {{ include "keel.image" (list $ $rd.image) | quote }}
          imagePullPolicy: {{ include "keel.pullPolicy" (list $ $rd.image) }}
          args:
            - --port
            - {{ $rd.port | quote }}
            - --bind
            - "0.0.0.0"
            - --protected-mode
            - "no"
            - --dir
            - /data
            - --appendonly
            - "yes"
            - --appendfsync
            - {{ $rd.appendfsync }}
            - --save
            - ""
            - --maxmemory
            - {{ $rd.maxmemory | quote }}
            - --maxmemory-policy
            - noeviction
            - --min-replicas-to-write
            - {{ $rd.minReplicasToWrite | quote }}
            - --min-replicas-max-lag
            - {{ $rd.minReplicasMaxLag | quote }}
            - --replica-announce-ip
            - $(POD_IP)
            {{- if ne $n 0 }}
            # Initial topology only: after a failover the persistence
            # reconciler re-points every node at the primary recorded in Raft.
            - --replicaof
            - {{ include "persistence.nodeHost" (dict "ctx" $ "group" $g "node" 0) }}
            - {{ $rd.port | quote }}
            {{- end }}
            {{- range $rd.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          env:
            - name: POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
          ports:
            - name: redis
              containerPort: {{ $rd.port }}
              protocol: TCP
          # The image is FROM scratch (no redis-cli, no shell): TCP probes.
          readinessProbe:
            tcpSocket:
              port: redis
            periodSeconds: {{ $rd.probes.readinessPeriodSeconds }}
            failureThreshold: 2
          livenessProbe:
            tcpSocket:
              port: redis
            periodSeconds: {{ $rd.probes.livenessPeriodSeconds }}
            failureThreshold: {{ $rd.probes.livenessFailureThreshold }}
          resources:
            {{- toYaml $rd.resources | nindent 12 }}
          securityContext:
            {{- include "keel.securityContext" $ | nindent 12 }}
          volumeMounts:
            - name: data
              mountPath: /data
            - name: tmp
              mountPath: /tmp
        - name: persistence
          image: {{ include "keel.image" (list $ $.Values.image) | quote }}
          imagePullPolicy: {{ include "keel.pullPolicy" (list $ $.Values.image) }}
          args:
            {{- include "keel.args" (list $ $flags) | nindent 12 }}
          env:
            {{- include "keel.env" $ | nindent 12 }}
          ports:
            - name: api
              containerPort: {{ $.Values.ports.api }}
              protocol: TCP
            - name: ops
              containerPort: {{ $.Values.ports.ops }}
              protocol: TCP
          {{- include "keel.probes" $ | nindent 10 }}
          resources:
            {{- toYaml $.Values.resources | nindent 12 }}
          securityContext:
            {{- include "keel.securityContext" $ | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
      volumes:
        - name: tmp
          emptyDir:
            sizeLimit: 64Mi
  volumeClaimTemplates:
    - apiVersion: v1
      kind: PersistentVolumeClaim
      metadata:
        name: data
        labels:
          {{- include "keel.selectorLabels" $ | nindent 10 }}
          keel.io/redis-group: {{ printf "g%d" $g | quote }}
      spec:
        accessModes:
          {{- toYaml $rd.persistence.accessModes | nindent 10 }}
        {{- with $rd.persistence.storageClass }}
        storageClassName: {{ . }}
        {{- end }}
        resources:
          requests:
            storage: {{ $rd.persistence.size }}
{{- end -}}
