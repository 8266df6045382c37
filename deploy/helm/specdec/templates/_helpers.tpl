{{/*
Shared helpers. Tier-scoped helpers take a dict:
  root      the top-level context ($)
  component coordinator | draft-worker | target-worker | redis
  tier      that tier's values block (.Values.coordinator, ...)
*/}}

{{/* Chart name, overridable with nameOverride. */}}
{{- define "specdec.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Release-wide name prefix. Truncated to 45 characters so that "<prefix>-target-worker"
still fits the 63-character DNS label limit.
*/}}
{{- define "specdec.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of one tier's resources: "<fullname>-<component>". */}}
{{- define "specdec.componentName" -}}
{{- printf "%s-%s" (include "specdec.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "chart-version" for the helm.sh/chart label. */}}
{{- define "specdec.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one tier; never change them after the first install. */}}
{{- define "specdec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specdec.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Full label set of one tier's resources. */}}
{{- define "specdec.labels" -}}
helm.sh/chart: {{ include "specdec.chart" .root }}
{{ include "specdec.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: specdec
{{- end }}

{{/* Service account the specdec pods run as. */}}
{{- define "specdec.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specdec.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* True (non-empty) when the coordinator finds the workers through the Kubernetes API. */}}
{{- define "specdec.apiDiscovery" -}}
{{- if eq .Values.coordinator.discovery "kubernetes" }}true{{ end }}
{{- end }}

{{/*
Service account of a tier's pods: the shared one, except the coordinator's own
"<fullname>-coordinator" when it discovers workers through the API and the chart creates
the accounts.
*/}}
{{- define "specdec.tierServiceAccountName" -}}
{{- if and (eq .component "coordinator") (include "specdec.apiDiscovery" .root) .root.Values.serviceAccount.create }}
{{- include "specdec.componentName" (dict "root" .root "component" "coordinator") }}
{{- else }}
{{- include "specdec.serviceAccountName" .root }}
{{- end }}
{{- end }}

{{/* Whether a tier's pods get an API token: only the coordinator, and only for discovery. */}}
{{- define "specdec.automountToken" -}}
{{- if and (eq .component "coordinator") (include "specdec.apiDiscovery" .root) }}true
{{- else }}{{ .root.Values.serviceAccount.automountServiceAccountToken }}
{{- end }}
{{- end }}

{{/* The custom metric (served by prometheus-adapter) a worker tier's HPA scales on. */}}
{{- define "specdec.inFlightMetric" -}}
{{- index (dict "draft-worker" "specdec_draft_in_flight" "target-worker" "specdec_target_in_flight") . }}
{{- end }}

{{/* "repository:tag" of a tier: the tier's image fields override the chart-wide image. */}}
{{- define "specdec.image" -}}
{{- $image := .root.Values.image }}
{{- $override := .tier.image | default dict }}
{{- $repository := $override.repository | default $image.repository }}
{{- $tag := $override.tag | default $image.tag | default .root.Chart.AppVersion }}
{{- printf "%s:%s" $repository (toString $tag) }}
{{- end }}

{{/*
A value as an environment-variable string. Helm hands numbers over as float64, which
would print 16384 as "16384" but 1048576 as "1.048576e+06"; whole numbers print as integers.
*/}}
{{- define "specdec.envValue" -}}
{{- if or (kindIs "float64" .) (kindIs "float32" .) }}
{{- if eq (float64 .) (float64 (int64 .)) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- else }}
{{- toString . }}
{{- end }}
{{- end }}

{{/* True (non-empty output) when a flag value should be passed: not null and not "". */}}
{{- define "specdec.isSet" -}}
{{- if not (or (kindIs "invalid" .) (and (kindIs "string" .) (eq . ""))) }}true{{ end }}
{{- end }}

{{/*
One tier's `config` block as EnvVars: camelCase flag name -> SPECDEC_SNAKE_CASE, read by
the matching --kebab-case flag. Null and "" values are skipped (program default).
*/}}
{{- define "specdec.configEnv" -}}
{{- range $flag, $value := . }}
{{- if include "specdec.isSet" $value }}
- name: SPECDEC_{{ $flag | snakecase | upper }}
  value: {{ include "specdec.envValue" $value | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/*
SPECDEC_REDIS_URL: in-cluster Redis (as the ACL user redis.auth.username when auth is on),
an external Secret, or redis.externalUrl.
*/}}
{{- define "specdec.redisUrlEnv" -}}
{{- $redis := .Values.redis }}
- name: SPECDEC_REDIS_URL
{{- if $redis.enabled }}
  {{- $user := "" }}
  {{- if and $redis.auth.enabled $redis.auth.username }}
  {{- $user = printf "%s@" $redis.auth.username }}
  {{- end }}
  value: {{ printf "redis://%s%s:%d/%d" $user (include "specdec.componentName" (dict "root" . "component" "redis")) (int $redis.port) (int $redis.database) | quote }}
{{- else if $redis.externalUrlSecret.name }}
  valueFrom:
    secretKeyRef:
      name: {{ $redis.externalUrlSecret.name }}
      key: {{ $redis.externalUrlSecret.key }}
{{- else }}
  value: {{ required "redis.externalUrl (or redis.externalUrlSecret.name) is required when redis.enabled is false" $redis.externalUrl | quote }}
{{- end }}
{{- end }}

{{/*
EnvVars every specdec service reads: listen address, ports, log level, Redis. HOME points
at the writable /tmp because the root filesystem is read-only.
*/}}
{{- define "specdec.commonEnv" -}}
- name: HOME
  value: /tmp
- name: SPECDEC_HOST
  value: "0.0.0.0"
- name: SPECDEC_PORT
  value: {{ .tier.port | int | quote }}
- name: SPECDEC_METRICS_PORT
  value: {{ .tier.metricsPort | int | quote }}
- name: SPECDEC_LOG_LEVEL
  value: {{ .tier.logLevel | quote }}
{{ include "specdec.redisUrlEnv" .root | trim }}
{{- with include "specdec.redisPasswordSecret" .root }}
- name: SPECDEC_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.root.Values.redis.auth.key }}
{{- end }}
{{- with .root.Values.redis.caSecret.name }}
- name: SPECDEC_REDIS_CA
  value: {{ printf "%s/%s" (include "specdec.mountDir" "redis-ca") $.root.Values.redis.caSecret.key | quote }}
{{- end }}
- name: SPECDEC_REFLECTION
  value: {{ ternary "true" "false" (.root.Values.reflection | default false) | quote }}
{{- with include "specdec.tlsEnv" . | trim }}
{{ . }}
{{- end }}
{{- with .root.Values.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- with .root.Values.otel.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Worker registration: POD_IP from the downward API, then SPECDEC_ADVERTISE_ADDR, which
Kubernetes expands from it ($(POD_IP) must be declared first).
*/}}
{{- define "specdec.advertiseEnv" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: SPECDEC_ADVERTISE_ADDR
  value: {{ .tier.advertiseAddr | default (printf "$(POD_IP):%d" (int .tier.port)) | quote }}
{{- end }}

{{/*
Container ports: "grpc", "http" when the tier has an httpPort (the coordinator's OpenAI-style
HTTP API) that is not 0, and "metrics" when metricsPort is not 0.
*/}}
{{- define "specdec.containerPorts" -}}
- name: grpc
  containerPort: {{ .port }}
  protocol: TCP
{{- if gt (int .httpPort) 0 }}
- name: http
  containerPort: {{ .httpPort }}
  protocol: TCP
{{- end }}
{{- if gt (int .metricsPort) 0 }}
- name: metrics
  containerPort: {{ .metricsPort }}
  protocol: TCP
{{- end }}
{{- end }}

{{/*
startup/readiness/liveness probes against grpc.health.v1 on the tier's gRPC port. The
services report NOT_SERVING until the model is loaded and warm.
*/}}
{{- define "specdec.grpcProbes" -}}
{{- $port := int .tier.port }}
{{- $paths := include "specdec.tlsPaths" . | fromYaml }}
{{- range $kind := list "startup" "readiness" "liveness" }}
{{- $timing := index $.tier.probes $kind }}
{{ $kind }}Probe:
  {{- if $.root.Values.tls.enabled }}
  exec:
    command:
      - python
      - -c
      - {{ include "specdec.tlsProbeScript" $ | quote }}
      - {{ $port | quote }}
      - {{ $paths.ca | quote }}
      - {{ $paths.cert | quote }}
      - {{ $paths.key | quote }}
      - {{ $paths.probeServerName | quote }}
      - {{ max 1 (sub ($timing.timeoutSeconds | default 1 | int) 1) | quote }}
  {{- else }}
  grpc:
    port: {{ $port }}
  {{- end }}
  {{- toYaml $timing | nindent 2 }}
{{- end }}
{{- end }}

{{/*
The TLS probe: the kubelet's gRPC probe speaks only plaintext, so with tls.enabled each probe
runs grpc.health.v1 Check over (mutual) TLS against 127.0.0.1 inside the container,
presenting the pod's own certificate. Arguments: port, CA, certificate, key, the name the
server certificate must carry, deadline in seconds (one less than the probe's timeout).
Exit 0 only when SERVING.
*/}}
{{- define "specdec.tlsProbeScript" -}}
import sys,grpc;from grpc_health.v1 import health_pb2 as h,health_pb2_grpc as s;a=sys.argv;r=lambda p:open(p,'rb').read();c=grpc.secure_channel('127.0.0.1:'+a[1],grpc.ssl_channel_credentials(r(a[2]),r(a[4]),r(a[3])),[('grpc.ssl_target_name_override',a[5])]);sys.exit(s.HealthStub(c).Check(h.HealthCheckRequest(),timeout=float(a[6])).status!=h.HealthCheckResponse.SERVING)
{{- end }}

{{/* resources of a tier plus `gpu.count` GPUs in requests and limits when count > 0. */}}
{{- define "specdec.resources" -}}
{{- $resources := deepCopy (.tier.resources | default dict) }}
{{- $gpu := .tier.gpu | default dict }}
{{- if gt (int ($gpu.count | default 0)) 0 }}
{{- range $section := list "requests" "limits" }}
{{- $entries := get $resources $section | default dict }}
{{- $_ := set $entries $gpu.resourceName (int $gpu.count) }}
{{- $_ := set $resources $section $entries }}
{{- end }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/* Pod annotations: chart-wide, then the tier's, then Prometheus scrape hints. */}}
{{- define "specdec.podAnnotations" -}}
{{- $annotations := merge (dict) (.tier.podAnnotations | default dict) (.root.Values.podAnnotations | default dict) }}
{{- if and .root.Values.metrics.podAnnotations (gt (int .tier.metricsPort) 0) }}
{{- $_ := set $annotations "prometheus.io/scrape" "true" }}
{{- $_ := set $annotations "prometheus.io/port" (toString (int .tier.metricsPort)) }}
{{- $_ := set $annotations "prometheus.io/path" "/metrics" }}
{{- end }}
{{- with $annotations }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{/*
Labels of a tier's pods. Unlike specdec.labels they leave out helm.sh/chart, so a chart
upgrade that changes nothing in the pods does not restart them (and reload every model).
*/}}
{{- define "specdec.podLabels" -}}
{{ include "specdec.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: specdec
{{- end }}

{{/* Pod metadata (labels and annotations) of a tier's pod template. */}}
{{- define "specdec.podMetadata" -}}
labels:
  {{- include "specdec.podLabels" . | nindent 2 }}
  {{- with .tier.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with include "specdec.podAnnotations" . }}
annotations:
  {{- . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod-level fields shared by the specdec tiers: accounts, security, scheduling. */}}
{{- define "specdec.podSpecCommon" -}}
serviceAccountName: {{ include "specdec.tierServiceAccountName" . }}
automountServiceAccountToken: {{ include "specdec.automountToken" . }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ .tier.terminationGracePeriodSeconds }}
{{- with .tier.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .tier.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- include "specdec.scheduling" . }}
{{- end }}

{{/*
nodeSelector, tolerations, affinity and topology spread of a tier. A spread constraint
without a labelSelector selects this tier's own pods.
*/}}
{{- define "specdec.scheduling" -}}
{{- with .tier.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tier.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tier.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .tier.topologySpreadConstraints }}
topologySpreadConstraints:
{{- range $constraint := .tier.topologySpreadConstraints }}
{{- $constraint = deepCopy $constraint }}
{{- if not (hasKey $constraint "labelSelector") }}
{{- $_ := set $constraint "labelSelector" (dict "matchLabels" (include "specdec.selectorLabels" $ | fromYaml)) }}
{{- end }}
  - {{ toYaml $constraint | nindent 4 | trim }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Volumes of a specdec pod: the model volume (an empty placeholder when model.volume is {}),
a writable /tmp, and the tier's extras.
*/}}
{{- define "specdec.volumes" -}}
- name: models
  {{- with .root.Values.model.volume }}
  {{- toYaml . | nindent 2 }}
  {{- else }}
  emptyDir: {}
  {{- end }}
- name: tmp
  emptyDir: {}
{{- range $volume := include "specdec.secretVolumes" . | fromYamlArray }}
- name: {{ $volume.name }}
  secret:
    secretName: {{ $volume.secretName }}
    defaultMode: 0440
{{- end }}
{{- with .tier.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Mounts matching specdec.volumes; the model volume is read-only. */}}
{{- define "specdec.volumeMounts" -}}
- name: models
  mountPath: {{ .root.Values.model.mountPath }}
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- range $volume := include "specdec.secretVolumes" . | fromYamlArray }}
- name: {{ $volume.name }}
  mountPath: {{ include "specdec.mountDir" $volume.name }}
  readOnly: true
{{- end }}
{{- with .tier.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Deployment strategy of a tier, when set. */}}
{{- define "specdec.strategy" -}}
{{- with .tier.strategy }}
strategy:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Service of a tier: gRPC (h2c), HTTP (when tier.httpPort is set and not 0) and metrics ports;
headless when tier.service.headless.
*/}}
{{- define "specdec.service" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "specdec.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" . | nindent 4 }}
  {{- with .tier.service.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- if .tier.service.headless }}
  clusterIP: None
  {{- else }}
  type: {{ .tier.service.type | default "ClusterIP" }}
  {{- end }}
  selector:
    {{- include "specdec.selectorLabels" . | nindent 4 }}
  ports:
    - name: grpc
      port: {{ .tier.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: kubernetes.io/h2c
    {{- if gt (int .tier.httpPort) 0 }}
    - name: http
      port: {{ .tier.httpPort }}
      targetPort: http
      protocol: TCP
      appProtocol: http
    {{- end }}
    {{- if gt (int .tier.metricsPort) 0 }}
    - name: metrics
      port: {{ .tier.metricsPort }}
      targetPort: metrics
      protocol: TCP
      appProtocol: http
    {{- end }}
{{- end }}

{{/* PodDisruptionBudget of a tier: minAvailable when set, else maxUnavailable. */}}
{{- define "specdec.pdb" -}}
{{- if .tier.pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "specdec.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" . | nindent 4 }}
spec:
  {{- if include "specdec.isSet" .tier.pdb.minAvailable }}
  minAvailable: {{ .tier.pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ .tier.pdb.maxUnavailable | default 1 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "specdec.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end }}

{{/* autoscaling/v2 HorizontalPodAutoscaler of a tier's Deployment. */}}
{{- define "specdec.hpa" -}}
{{- $autoscaling := .tier.autoscaling }}
{{- if $autoscaling.enabled }}
{{- $metrics := list }}
{{- if include "specdec.isSet" $autoscaling.inFlightPerPod }}
{{- $target := dict "type" "AverageValue" "averageValue" (include "specdec.envValue" $autoscaling.inFlightPerPod) }}
{{- $metrics = append $metrics (dict "type" "Pods" "pods" (dict "metric" (dict "name" (include "specdec.inFlightMetric" .component)) "target" $target)) }}
{{- end }}
{{- range $resource := list "cpu" "memory" }}
{{- $target := index $autoscaling (printf "target%sUtilizationPercentage" (ternary "CPU" "Memory" (eq $resource "cpu"))) }}
{{- if include "specdec.isSet" $target }}
{{- $metrics = append $metrics (dict "type" "Resource" "resource" (dict "name" $resource "target" (dict "type" "Utilization" "averageUtilization" (int $target)))) }}
{{- end }}
{{- end }}
{{- $metrics = concat $metrics ($autoscaling.metrics | default list) }}
{{- if not $metrics }}
{{- fail (printf "%s.autoscaling needs at least one metric (inFlightPerPod, a utilization target or metrics)" .valuesKey) }}
{{- end }}
{{- if gt (int $autoscaling.minReplicas) (int $autoscaling.maxReplicas) }}
{{- fail (printf "%s.autoscaling.minReplicas must not exceed maxReplicas" .valuesKey) }}
{{- end }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "specdec.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "specdec.componentName" . }}
  minReplicas: {{ $autoscaling.minReplicas }}
  maxReplicas: {{ $autoscaling.maxReplicas }}
  metrics:
    {{- toYaml $metrics | nindent 4 }}
  {{- with $autoscaling.behavior }}
  behavior:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}

{{/* Prometheus Operator ServiceMonitor scraping a tier's "metrics" Service port. */}}
{{- define "specdec.serviceMonitor" -}}
{{- $monitor := .root.Values.metrics.serviceMonitor }}
{{- if and $monitor.enabled (gt (int .tier.metricsPort) 0) }}
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "specdec.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" . | nindent 4 }}
    {{- with $monitor.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "specdec.selectorLabels" . | nindent 6 }}
  namespaceSelector:
    matchNames:
      - {{ .root.Release.Namespace }}
  endpoints:
    - port: metrics
      path: /metrics
      interval: {{ $monitor.interval }}
      scrapeTimeout: {{ $monitor.scrapeTimeout }}
{{- end }}
{{- end }}

{{/*
Replicas of a tier's Deployment; omitted while an HPA owns the count, so upgrades do not
reset it.
*/}}
{{- define "specdec.replicas" -}}
{{- if not .tier.autoscaling.enabled }}
replicas: {{ .tier.replicas }}
{{- end }}
{{- end }}

{{/*
Release-wide labels of objects that belong to no single tier (default-deny policy, CA
Issuer).
*/}}
{{- define "specdec.releaseLabels" -}}
helm.sh/chart: {{ include "specdec.chart" . }}
app.kubernetes.io/name: {{ include "specdec.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specdec
{{- end }}

{{/* Where a secret volume is mounted: /etc/specdec/<volume name>. */}}
{{- define "specdec.mountDir" -}}
{{- printf "/etc/specdec/%s" . }}
{{- end }}

{{/*
Secret holding the Redis password: redis.auth.existingSecret, else the chart-generated
"<fullname>-redis-auth" for the bundled Redis; empty when there is none (auth off, or an
external Redis whose URL carries its credentials).
*/}}
{{- define "specdec.redisPasswordSecret" -}}
{{- $auth := .Values.redis.auth }}
{{- if $auth.enabled }}
{{- if $auth.existingSecret }}
{{- $auth.existingSecret }}
{{- else if .Values.redis.enabled }}
{{- include "specdec.componentName" (dict "root" . "component" "redis-auth") }}
{{- end }}
{{- end }}
{{- end }}

{{/* values key of a specdec component: coordinator -> coordinator, draft-worker -> draftWorker. */}}
{{- define "specdec.valuesKey" -}}
{{- index (dict "coordinator" "coordinator" "draft-worker" "draftWorker" "target-worker" "targetWorker") . }}
{{- end }}

{{/* TLS Secret of a tier: tls.<tier>.secretName, else the chart's Certificate's "<component name>-tls". */}}
{{- define "specdec.tlsSecretName" -}}
{{- $tls := index .root.Values.tls (include "specdec.valuesKey" .component) }}
{{- $tls.secretName | default (printf "%s-tls" (include "specdec.componentName" .)) }}
{{- end }}

{{/* The DNS name every worker certificate carries: tls.serverName, else "<fullname>-worker". */}}
{{- define "specdec.tlsServerName" -}}
{{- .Values.tls.serverName | default (printf "%s-worker" (include "specdec.fullname" .)) }}
{{- end }}

{{/*
Secret volumes of a specdec pod, as a YAML list of {name, secretName}; the volume name is
also the directory under /etc/specdec. Whole Secrets, never subPath: the kubelet then
updates the files when the Secret changes, and the services re-read them.
*/}}
{{- define "specdec.secretVolumes" -}}
{{- $values := .root.Values }}
{{- $volumes := list }}
{{- if $values.tls.enabled }}
{{- $volumes = append $volumes (dict "name" "tls" "secretName" (include "specdec.tlsSecretName" .)) }}
{{- with $values.tls.caSecret.name }}
{{- $volumes = append $volumes (dict "name" "tls-ca" "secretName" .) }}
{{- end }}
{{- if eq .component "coordinator" }}
{{- with $values.tls.coordinator.workerClientSecretName }}
{{- $volumes = append $volumes (dict "name" "worker-client-tls" "secretName" .) }}
{{- end }}
{{- if and $values.tls.clientCA.enabled $values.tls.clientCA.secretName }}
{{- $volumes = append $volumes (dict "name" "client-ca" "secretName" $values.tls.clientCA.secretName) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (eq .component "coordinator") $values.apiKeys.enabled }}
{{- $volumes = append $volumes (dict "name" "api-keys" "secretName" (required "apiKeys.existingSecret is required when apiKeys.enabled" $values.apiKeys.existingSecret)) }}
{{- end }}
{{- with $values.redis.caSecret.name }}
{{- $volumes = append $volumes (dict "name" "redis-ca" "secretName" .) }}
{{- end }}
{{- toYaml $volumes }}
{{- end }}

{{/*
File paths of a tier's TLS material, as YAML: cert, key, ca (the cluster CA), and for the
coordinator workerCert, workerKey, clientCA; probeServerName is the name the probe expects
on the tier's own certificate.
*/}}
{{- define "specdec.tlsPaths" -}}
{{- $tls := .root.Values.tls }}
{{- $dir := include "specdec.mountDir" "tls" }}
{{- $ca := printf "%s/ca.crt" $dir }}
{{- with $tls.caSecret.name }}
{{- $ca = printf "%s/%s" (include "specdec.mountDir" "tls-ca") $tls.caSecret.key }}
{{- end }}
cert: {{ printf "%s/tls.crt" $dir }}
key: {{ printf "%s/tls.key" $dir }}
ca: {{ $ca }}
{{- if eq .component "coordinator" }}
{{- $client := $dir }}
{{- if $tls.coordinator.workerClientSecretName }}
{{- $client = include "specdec.mountDir" "worker-client-tls" }}
{{- end }}
workerCert: {{ printf "%s/tls.crt" $client }}
workerKey: {{ printf "%s/tls.key" $client }}
clientCA: {{ ternary (printf "%s/%s" (include "specdec.mountDir" "client-ca") $tls.clientCA.key) $ca (not (empty $tls.clientCA.secretName)) }}
probeServerName: {{ include "specdec.componentName" . }}
{{- else }}
probeServerName: {{ include "specdec.tlsServerName" .root }}
{{- end }}
{{- end }}

{{/*
TLS EnvVars of a tier (none unless tls.enabled): its server certificate and the cluster CA;
on the coordinator also the client certificate toward the workers, the workers' certificate
name, the public-API client CA and the API key file.
*/}}
{{- define "specdec.tlsEnv" -}}
{{- $values := .root.Values }}
{{- if $values.tls.enabled }}
{{- $paths := include "specdec.tlsPaths" . | fromYaml }}
- name: SPECDEC_TLS_CERT
  value: {{ $paths.cert | quote }}
- name: SPECDEC_TLS_KEY
  value: {{ $paths.key | quote }}
- name: SPECDEC_TLS_CA
  value: {{ $paths.ca | quote }}
{{- if eq .component "coordinator" }}
- name: SPECDEC_WORKER_TLS_CERT
  value: {{ $paths.workerCert | quote }}
- name: SPECDEC_WORKER_TLS_KEY
  value: {{ $paths.workerKey | quote }}
- name: SPECDEC_TLS_SERVER_NAME
  value: {{ include "specdec.tlsServerName" .root | quote }}
{{- if $values.tls.clientCA.enabled }}
- name: SPECDEC_TLS_CLIENT_CA
  value: {{ $paths.clientCA | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (eq .component "coordinator") $values.apiKeys.enabled }}
- name: SPECDEC_API_KEYS_FILE
  value: {{ printf "%s/%s" (include "specdec.mountDir" "api-keys") $values.apiKeys.key | quote }}
{{- end }}
{{- end }}

{{/* A NetworkPolicyPeer selecting one tier's pods of this release. */}}
{{- define "specdec.podPeer" -}}
- podSelector:
    matchLabels:
      {{- include "specdec.selectorLabels" . | nindent 6 }}
{{- end }}

{{/*
An ingress or egress rule: `peers` under `direction` ("from"/"to"; an empty list leaves the
key out, which allows any peer) and `ports` (a list of {port, protocol}).
*/}}
{{- define "specdec.policyRule" -}}
- ports:
    {{- range .ports }}
    - port: {{ .port }}
      protocol: {{ .protocol | default "TCP" }}
    {{- end }}
  {{- with .peers }}
  {{ $.direction }}:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/*
Egress rules every specdec tier needs: Redis (bundled pod or redisEgress), DNS, and the OTLP
collector (otelEgress) when otel.endpoint is set.
*/}}
{{- define "specdec.commonEgress" -}}
{{- $values := .Values }}
{{- $np := $values.networkPolicy }}
{{- if $values.redis.enabled }}
{{- include "specdec.policyRule" (dict "direction" "to" "peers" (include "specdec.podPeer" (dict "root" . "component" "redis") | fromYamlArray) "ports" (list (dict "port" (int $values.redis.port)))) }}
{{- else }}
{{- $port := $np.redisEgressPort }}
{{- if not (include "specdec.isSet" $port) }}
{{- $port = 6379 }}
{{- $hostPort := regexFind ":[0-9]+(/|$)" (regexReplaceAll "^[a-z]+://([^@/]*@)?" ($values.redis.externalUrl | default "") "") }}
{{- if $hostPort }}
{{- $port = trimPrefix ":" (trimSuffix "/" $hostPort) }}
{{- end }}
{{- end }}
{{- include "specdec.policyRule" (dict "direction" "to" "peers" $np.redisEgress "ports" (list (dict "port" (int $port)))) }}
{{- end }}
{{ include "specdec.policyRule" (dict "direction" "to" "peers" $np.dns "ports" (list (dict "port" 53 "protocol" "UDP") (dict "port" 53 "protocol" "TCP"))) }}
{{- with $values.otel.endpoint }}
{{- $port := $np.otelEgressPort }}
{{- if not (include "specdec.isSet" $port) }}
{{- $port = 4317 }}
{{- $hostPort := regexFind ":[0-9]+$" (regexReplaceAll "/.*$" (regexReplaceAll "^[a-z]+://" . "") "") }}
{{- if $hostPort }}
{{- $port = trimPrefix ":" $hostPort }}
{{- end }}
{{- end }}
{{ include "specdec.policyRule" (dict "direction" "to" "peers" $np.otelEgress "ports" (list (dict "port" (int $port)))) }}
{{- end }}
{{- end }}
