{{/*
Names, labels and the small pieces every template shares.
*/}}

{{- define "dflash.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name is also the RayService's name: KubeRay refuses names over 47 characters (it appends
6 for the RayCluster and "-serve-svc" must still fit in 63).
*/}}
{{- define "dflash.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "dflash.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "dflash.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dflash.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "dflash.labels" -}}
helm.sh/chart: {{ include "dflash.chart" . }}
{{ include "dflash.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dflash
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels of one component: pass (dict "ctx" $ "component" "ray") */}}
{{- define "dflash.componentLabels" -}}
{{ include "dflash.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "dflash.componentSelector" -}}
{{ include "dflash.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Labels of the pods a component makes: no chart or app version. KubeRay hashes the Ray pod templates and
replaces the whole (GPU) cluster when the hash changes; a StatefulSet or Deployment rolls its pods.
Pass (dict "ctx" $ "component" "ray").
*/}}
{{- define "dflash.podLabels" -}}
{{ include "dflash.componentSelector" . }}
app.kubernetes.io/part-of: dflash
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "dflash.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dflash.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The head pod's account: KubeRay binds its autoscaler Role to it. */}}
{{- define "dflash.headServiceAccountName" -}}
{{- if .Values.serviceAccount.headName }}
{{- .Values.serviceAccount.headName }}
{{- else if .Values.serviceAccount.create }}
{{- printf "%s-head" (include "dflash.fullname" .) }}
{{- else }}
{{- include "dflash.serviceAccountName" . }}
{{- end }}
{{- end }}

{{- define "dflash.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.flavor) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{- define "dflash.redisName" -}}
{{- printf "%s-redis" (include "dflash.fullname" .) }}
{{- end }}

{{- define "dflash.redisSecretName" -}}
{{- .Values.redis.auth.existingSecret | default (include "dflash.redisName" .) }}
{{- end }}

{{/* The Secret holding the internal Drafter API's token: drafter.net.auth.existingSecret or the chart's own. */}}
{{- define "dflash.drafterAuthSecretName" -}}
{{- .Values.drafter.net.auth.existingSecret | default (printf "%s-drafter-auth" (include "dflash.fullname" .)) }}
{{- end }}

{{/* "true" when a pod of this role talks to the Drafter API (the verifier calls, drafters answer); the head
never does. Pass (dict "ctx" $ "role" r). */}}
{{- define "dflash.drafterNetPeer" -}}
{{- if ne .role "head" }}true{{ end }}
{{- end }}

{{/*
KubeRay's serve Service (spec.serveService): "<full name>-grpc" with tls.enabled on or off. KubeRay creates
it, and Helm refuses to adopt an object its release did not create, so no Service of the chart may ever
take this name, and this name never changes with TLS (which would leave KubeRay's old one behind).
*/}}
{{- define "dflash.serveServiceName" -}}
{{- printf "%s-grpc" (include "dflash.fullname" .) }}
{{- end }}

{{/* The Service clients call: KubeRay's serve Service, or with tls.enabled the TLS front's own (service-grpc.yaml). */}}
{{- define "dflash.grpcServiceName" -}}
{{- if .Values.tls.enabled }}
{{- printf "%s-grpc-tls" (include "dflash.fullname" .) }}
{{- else }}
{{- include "dflash.serveServiceName" . }}
{{- end }}
{{- end }}

{{- define "dflash.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.security.runAsUser }}
runAsGroup: {{ .Values.security.runAsGroup }}
fsGroup: {{ .Values.security.runAsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Container security; pass (dict "ctx" $ "readOnly" bool) */}}
{{- define "dflash.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: {{ .readOnly }}
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{/*
Checks that values.schema.json cannot express (JSON Schema does not compare two values): secrets that
must be named together with a switch, min not above max, replicas that fit their pods, GPU arithmetic
across a group and its deployment.
*/}}
{{- define "dflash.validate" -}}
{{- if and .Values.auth.enabled (not .Values.auth.existingSecret) }}
{{- fail "auth.enabled needs auth.existingSecret (a Secret holding the bearer token)" }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.existingSecret) }}
{{- fail "tls.enabled needs tls.existingSecret (a kubernetes.io/tls Secret: tls.crt, tls.key, optional ca.crt)" }}
{{- end }}
{{- if and .Values.tls.enabled (has (int .Values.tls.port) (list (int .Values.grpc.port) 6379 8000 8080 8265 10001 52365)) }}
{{- fail (printf "tls.port %v is taken in the head pod (grpc.port or a Ray port); pick another, e.g. 9443" .Values.tls.port) }}
{{- end }}
{{- if and (eq .Values.redis.mode "external") (not .Values.redis.external.existingSecret) }}
{{- fail "redis.mode=external needs redis.external.existingSecret (a Secret holding the Redis URL)" }}
{{- end }}
{{- if and (eq .Values.model.source "pvc") (not .Values.model.pvc.claimName) }}
{{- fail "model.source=pvc needs model.pvc.claimName" }}
{{- end }}
{{- if and (eq .Values.model.source "image") (ne (empty .Values.model.image.target) (empty .Values.model.image.drafter)) }}
{{- fail "model.source=image: set both model.image.target and model.image.drafter, or neither (the demo pair)" }}
{{- end }}
{{- range $role := list "verifier" "drafter" }}
{{- $v := index $.Values $role }}
{{- if gt (mulf $v.gpusPerReplica $v.replicasPerPod) (float64 $v.pods.gpus) }}
{{- fail (printf "%s: gpusPerReplica * replicasPerPod (%v) exceeds pods.gpus (%v)" $role (mulf $v.gpusPerReplica $v.replicasPerPod) $v.pods.gpus) }}
{{- end }}
{{- include "dflash.validateAtMost" (dict "low" $v.pods.minReplicas "lowName" (printf "%s.pods.minReplicas" $role) "high" $v.pods.maxReplicas "highName" (printf "%s.pods.maxReplicas" $role)) }}
{{- if gt (int $v.autoscaling.maxReplicas) (mul (int $v.pods.maxReplicas) (int $v.replicasPerPod)) }}
{{- fail (printf "%s.autoscaling.maxReplicas (%v) replicas need more than %s.pods.maxReplicas (%v) pods of %s.replicasPerPod (%v)" $role $v.autoscaling.maxReplicas $role $v.pods.maxReplicas $role $v.replicasPerPod) }}
{{- end }}
{{- end }}
{{- range $role := list "head" "verifier" "drafter" }}
{{- $g := ternary $.Values.head (index $.Values $role).pods (eq $role "head") }}
{{- $limit := dig "limits" "memory" "" $g.resources }}
{{- if and $limit (gt (include "dflash.bytes" $g.shmSize | int64) (include "dflash.bytes" $limit | int64)) }}
{{- fail (printf "%sshmSize (%v) is above the container's memory limit (%v): /dev/shm is memory counted against that limit, and Ray refuses an object store (four fifths of it) larger than the memory" (ternary "head." (printf "%s.pods." $role) (eq $role "head")) $g.shmSize $limit) }}
{{- end }}
{{- end }}
{{- range $role := list "ingress" "verifier" "drafter" }}
{{- $a := (index $.Values $role).autoscaling }}
{{- include "dflash.validateAtMost" (dict "low" $a.minReplicas "lowName" (printf "%s.autoscaling.minReplicas" $role) "high" $a.maxReplicas "highName" (printf "%s.autoscaling.maxReplicas" $role)) }}
{{- end }}
{{- include "dflash.validateAtMost" (dict "low" .Values.ingress.autoscaling.maxReplicas "lowName" "ingress.autoscaling.maxReplicas" "high" .Values.head.maxIngressReplicas "highName" "head.maxIngressReplicas") }}
{{- $gcs := .Values.gcsFaultTolerance }}
{{- if and $gcs.enabled (eq .Values.redis.mode "external") (not $gcs.external.address) }}
{{- fail "gcsFaultTolerance with redis.mode=external needs gcsFaultTolerance.external.address (host:port of a Redis for the Ray head), or gcsFaultTolerance.enabled=false" }}
{{- end }}
{{- $dtls := .Values.drafter.net.tls }}
{{- if and $dtls.existingSecret (not $dtls.serverName) }}
{{- fail "drafter.net.tls.existingSecret needs drafter.net.tls.serverName: replicas advertise pod IPs, so the verifier checks every replica's certificate against this one fixed name (a SAN of the certificate)" }}
{{- end }}
{{- if and $dtls.serverName (not $dtls.existingSecret) }}
{{- fail "drafter.net.tls.serverName is only used with drafter.net.tls.existingSecret (the Secret with tls.crt, tls.key and ca.crt)" }}
{{- end }}
{{- if and .Values.model.hub.cache.create .Values.model.hub.cache.claimName }}
{{- fail "model.hub.cache: claimName or create, not both (create makes a claim of its own)" }}
{{- end }}
{{- end }}

{{/* Fails unless low <= high; pass (dict "low" n "lowName" "a.b" "high" m "highName" "a.c"). */}}
{{- define "dflash.validateAtMost" -}}
{{- if gt (int .low) (int .high) }}
{{- fail (printf "%s (%v) is above %s (%v)" .lowName .low .highName .high) }}
{{- end }}
{{- end }}
