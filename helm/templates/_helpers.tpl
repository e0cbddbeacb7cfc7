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

{{- define "dflash.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dflash.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
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

{{/* The public gRPC Service (service-grpc.yaml). */}}
{{- define "dflash.grpcServiceName" -}}
{{- printf "%s-grpc" (include "dflash.fullname" .) }}
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
Checks that templates cannot express in values.schema.json: secrets that must be named together
with a switch, and GPU arithmetic across a group and its deployment.
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
{{- end }}
{{- end }}
