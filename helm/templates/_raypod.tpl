{{/*
The pieces of a Ray pod (head or worker): environment, volumes, the model init container, the
Ray container itself. Pass (dict "ctx" $ "role" "head|verifier|drafter").
*/}}

{{- define "dflash.rayEnv" -}}
{{- $v := .ctx.Values -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
# Ray starts its workers (the replicas) at this niceness; its default, 15, yields the pod's CPUs to Ray's own processes.
- name: RAY_worker_niceness
  value: {{ $v.workerNiceness | quote }}
{{- if eq $v.ingressProxy "haproxy" }}
# Ray Serve's HAProxy mode: on every node HAProxy takes the Serve ports and relays each call straight to an
# ingress replica's own gRPC/HTTP server (direct ingress); Serve's Python proxy actor serves no request.
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: "1"
# A lost replica marked down within a second (Ray checks every 5 s and after 3 failed calls), so that calls,
# health checks among them, go to the fallback Serve proxy instead of waiting out connection retries.
- name: RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER
  value: "1s"
- name: RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT
  value: "1"
{{- end }}
# The drafter's gRPC server listens on, and advertises, this pod's address.
- name: DFLASH_DRAFTER_NET__HOST
  value: "$(POD_IP)"
{{- if eq $v.redis.mode "internal" }}
# Not REDIS_PASSWORD: KubeRay sets that one on the head for GCS fault tolerance and refuses a head that has it.
- name: SESSIONS_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "dflash.redisSecretName" .ctx }}
      key: {{ $v.redis.auth.key }}
- name: DFLASH_REDIS__URL
  value: "redis://:$(SESSIONS_REDIS_PASSWORD)@{{ include "dflash.redisName" .ctx }}:6379/0"
{{- else }}
- name: DFLASH_REDIS__URL
  valueFrom:
    secretKeyRef:
      name: {{ $v.redis.external.existingSecret }}
      key: {{ $v.redis.external.key }}
{{- end }}
{{- if and (ne .role "head") (eq $v.model.device "auto") (include "dflash.hasGpus" .) }}
# This pod requested GPUs: "auto" means cuda here, so a replica whose CUDA is unusable (a driver too old for
# the image's torch) stops at start, naming both, rather than running on the CPU beside an idle GPU.
- name: DFLASH_MODEL__DEVICE
  value: cuda
{{- end }}
{{- if $v.auth.enabled }}
- name: DFLASH_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $v.auth.existingSecret }}
      key: {{ $v.auth.key }}
{{- end }}
{{- if include "dflash.drafterNetPeer" . }}
# The internal Drafter API: the verifier sends this token, drafter replicas refuse calls without it.
- name: DFLASH_DRAFTER_NET__TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "dflash.drafterAuthSecretName" .ctx }}
      key: {{ $v.drafter.net.auth.key }}
{{- with $v.drafter.net.tls }}
{{- if .existingSecret }}
# Mutual TLS on the Drafter API, with the files of the drafter-tls volume.
- name: DFLASH_DRAFTER_NET__TLS_CERT_FILE
  value: /etc/dflash/drafter-tls/tls.crt
- name: DFLASH_DRAFTER_NET__TLS_KEY_FILE
  value: /etc/dflash/drafter-tls/tls.key
- name: DFLASH_DRAFTER_NET__TLS_CA_FILE
  value: /etc/dflash/drafter-tls/ca.crt
# Replicas advertise pod IPs: their certificates are checked against this fixed name.
- name: DFLASH_DRAFTER_NET__TLS_SERVER_NAME
  value: {{ .serverName | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- if $v.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $v.otel.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $v.otel.protocol | quote }}
- name: OTEL_TRACES_EXPORTER
  value: otlp
- name: OTEL_SERVICE_NAME
  value: {{ $v.otel.serviceName | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $v.otel.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $v.otel.samplerArg | quote }}
{{- $attrs := list (printf "k8s.namespace.name=%s" .ctx.Release.Namespace) "k8s.pod.name=$(POD_NAME)" (printf "dflash.role=%s" .role) -}}
{{- range $k, $val := $v.otel.resourceAttributes }}
{{- $attrs = append $attrs (printf "%s=%s" $k $val) }}
{{- end }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attrs | quote }}
{{- end }}
# Writable caches under /tmp: the root filesystem is read-only.
- name: HOME
  value: /tmp/home
- name: HF_HOME
  value: /tmp/hf
- name: TRITON_CACHE_DIR
  value: /tmp/triton
- name: HF_HUB_OFFLINE
  value: "1"
{{- end }}

{{/* Bytes of a Kubernetes quantity (a number, or a string with a k, M, G, T, Ki, Mi, Gi or Ti suffix). */}}
{{- define "dflash.bytes" -}}
{{- $q := ternary (toString .) (toString (int64 .)) (kindIs "string" .) }}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $q }}
{{- $unit := dict "" 1.0 "k" 1e3 "K" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 }}
{{- $suffix := trimPrefix $num $q }}
{{- if or (not $num) (not (hasKey $unit $suffix)) }}
{{- fail (printf "%q: use a number of bytes or a k, M, G, T, Ki, Mi, Gi or Ti quantity" $q) }}
{{- end }}
{{- mulf (float64 $num) (index $unit $suffix) | floor | int64 }}
{{- end }}

{{/*
Ray's object store for a /dev/shm of this size (pass the quantity): four fifths of it, in bytes, the rest left
to whatever else maps shared memory (torch, NCCL). Unset, Ray sizes the store at 30% of the container's memory
(capped at 10 GB, ray._private.utils.resolve_object_store_memory) and, finding /dev/shm smaller, puts it in /tmp
(services.determine_plasma_store_config): with the chart's own /dev/shm, KubeRay's (sized to the memory) is not added.
*/}}
{{- define "dflash.objectStoreBytes" -}}
{{- mulf (include "dflash.bytes" . | float64) 0.8 | floor | int64 }}
{{- end }}

{{/*
The rayStartParams "resources" value for these custom Ray resources (pass a dict name -> integer units): JSON in
single quotes, the form KubeRay writes itself. KubeRay trims the quotes and parses the JSON
(common/pod.go, getResourcesMap, v1.6.0 to v1.7.0: a failure there skips addWellKnownAcceleratorResources), Ray's
autoscaler drops the outer pair and parses the rest (autoscaling_config._get_custom_resources), and the
bash that runs KubeRay's `ray start ... --resources=VALUE` hands Ray the bare JSON.
*/}}
{{- define "dflash.rayResourcesParam" -}}
{{- printf "'%s'" (toJson .) }}
{{- end }}

{{/*
Topology spread constraints of a set of pods: the value's list or, when it is null, one soft constraint over
nodes; a constraint without labelSelector gets one selecting these pods. Renders nothing for [].
Pass (dict "value" list-or-null "selector" (dict label value ...)).
*/}}
{{- define "dflash.topologySpread" -}}
{{- $list := .value }}
{{- if kindIs "invalid" $list }}
{{- $list = list (dict "maxSkew" 1 "topologyKey" "kubernetes.io/hostname" "whenUnsatisfiable" "ScheduleAnyway") }}
{{- end }}
{{- $out := list }}
{{- range $list }}
{{- $c := deepCopy . }}
{{- if not (hasKey $c "labelSelector") }}
{{- $_ := set $c "labelSelector" (dict "matchLabels" $.selector) }}
{{- end }}
{{- $out = append $out $c }}
{{- end }}
{{- with $out }}{{ toYaml . }}{{ end }}
{{- end }}

{{/* "true" when a worker group's replicas use GPUs (pass (dict "ctx" $ "role" "verifier")), else empty. */}}
{{- define "dflash.hasGpus" -}}
{{- $r := index .ctx.Values .role -}}
{{- if and (gt (int $r.pods.gpus) 0) (gt (float64 $r.gpusPerReplica) 0.0) }}true{{ end }}
{{- end }}

{{/* The claim holding the hub download cache, if any (model.hub.cache). */}}
{{- define "dflash.modelCacheClaim" -}}
{{- $c := .Values.model.hub.cache -}}
{{- if $c.claimName }}{{ $c.claimName }}{{ else if $c.create }}{{ include "dflash.fullname" . }}-models{{ end }}
{{- end }}

{{- define "dflash.modelVolume" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "hub" }}
- name: models
{{- with include "dflash.modelCacheClaim" . }}
  persistentVolumeClaim:
    claimName: {{ . }}
{{- else }}
  emptyDir:
    sizeLimit: {{ $m.hub.cache.size }}
{{- end }}
{{- else if eq $m.source "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- end }}
{{- end }}

{{- define "dflash.rayVolumes" -}}
{{- $v := .ctx.Values -}}
- name: tmp
  emptyDir: {}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ if eq .role "head" }}{{ $v.head.shmSize }}{{ else }}{{ (index $v .role).pods.shmSize }}{{ end }}
{{- if and (include "dflash.drafterNetPeer" .) $v.drafter.net.tls.existingSecret }}
# The Drafter API's certificate, key and CA; a Secret without one of the three keys stops the pod at mount.
- name: drafter-tls
  secret:
    secretName: {{ $v.drafter.net.tls.existingSecret }}
    defaultMode: 0440
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- if ne .role "head" }}
{{- include "dflash.modelVolume" .ctx }}
{{- else if $v.autoscaler.enabled }}
# The head account's token, CA and namespace at the in-cluster paths, mounted into Ray's autoscaler
# container only (autoscalerOptions.volumeMounts): the pod itself mounts no token.
- name: autoscaler-api-token
  projected:
    defaultMode: 0444
    sources:
      - serviceAccountToken:
          path: token
          expirationSeconds: 3600
      - configMap:
          name: kube-root-ca.crt
          items:
            - {key: ca.crt, path: ca.crt}
      - downwardAPI:
          items:
            - path: namespace
              fieldRef:
                fieldPath: metadata.namespace
{{- end }}
{{- end }}

{{- define "dflash.rayVolumeMounts" -}}
{{- $v := .ctx.Values -}}
- name: tmp
  mountPath: /tmp
- name: dshm
  mountPath: /dev/shm
{{- if and (ne .role "head") (ne $v.model.source "image") }}
- name: models
  mountPath: {{ $v.model.mountPath }}
  readOnly: {{ eq $v.model.source "pvc" }}
{{- end }}
{{- if and (include "dflash.drafterNetPeer" .) $v.drafter.net.tls.existingSecret }}
- name: drafter-tls
  mountPath: /etc/dflash/drafter-tls
  readOnly: true
{{- end }}
{{- end }}

{{/*
source: hub. Downloads target and drafter into the models volume before Ray starts; a second
start (cache claim) finds the files and only checks them.
*/}}
{{- define "dflash.modelInitContainer" -}}
{{- $v := .ctx.Values -}}
{{- $m := $v.model -}}
- name: fetch-models
  image: {{ include "dflash.image" .ctx }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: ["python", "-c"]
  args:
    - |
      import os
      from huggingface_hub import snapshot_download
      root = os.environ["MODEL_ROOT"]
      for name in ("target", "drafter"):
          repo = os.environ["MODEL_" + name.upper()]
          revision = os.environ.get("MODEL_" + name.upper() + "_REVISION") or None
          print(f"fetching {repo} ({revision or 'default branch'}) into {root}/{name}", flush=True)
          snapshot_download(repo, revision=revision, local_dir=f"{root}/{name}")
  env:
    - name: MODEL_ROOT
      value: {{ $m.mountPath | quote }}
    - name: MODEL_TARGET
      value: {{ $m.hub.target | quote }}
    - name: MODEL_TARGET_REVISION
      value: {{ $m.hub.targetRevision | quote }}
    - name: MODEL_DRAFTER
      value: {{ $m.hub.drafter | quote }}
    - name: MODEL_DRAFTER_REVISION
      value: {{ $m.hub.drafterRevision | quote }}
    - name: HOME
      value: /tmp/home
    - name: HF_HOME
      value: /tmp/hf
    {{- if $m.hub.endpoint }}
    - name: HF_ENDPOINT
      value: {{ $m.hub.endpoint | quote }}
    {{- end }}
    {{- if $m.hub.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ $m.hub.tokenSecret.name }}
          key: {{ $m.hub.tokenSecret.key }}
    {{- end }}
  securityContext:
    {{- include "dflash.containerSecurityContext" (dict "ctx" .ctx "readOnly" true) | nindent 4 }}
  # Requests equal to limits, as in the Ray container: a GPU pod stays in the Guaranteed QoS class.
  resources:
    requests: {cpu: "2", memory: 4Gi}
    limits: {cpu: "2", memory: 4Gi}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: models
      mountPath: {{ $m.mountPath }}
{{- end }}

{{/* The Ray container; Ray's own `ray start` command is added by KubeRay. */}}
{{- define "dflash.rayContainer" -}}
{{- $v := .ctx.Values -}}
- name: {{ if eq .role "head" }}ray-head{{ else }}ray-worker{{ end }}
  image: {{ include "dflash.image" .ctx }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  ports:
    {{- if eq .role "head" }}
    - {name: gcs-server, containerPort: 6379}
    - {name: dashboard, containerPort: 8265}
    - {name: client, containerPort: 10001}
    {{- end }}
    # Serve's HTTP proxy (the OpenAI API; service-http.yaml), which KubeRay health-checks on 8000. Not named
    # "serve": KubeRay's serve Service carries every head port named serve or serve-*, and that one is gRPC only.
    - {name: http-proxy, containerPort: 8000}
    - {name: serve-grpc, containerPort: {{ $v.grpc.port }}}
    - {name: metrics, containerPort: 8080}
  env:
    {{- include "dflash.rayEnv" . | nindent 4 }}
  resources:
    {{- if eq .role "head" }}
    {{- toYaml $v.head.resources | nindent 4 }}
    {{- else }}
    {{- $pods := (index $v .role).pods }}
    {{- $res := deepCopy $pods.resources }}
    {{- if gt (int $pods.gpus) 0 }}
    {{- $_ := set $res "limits" (merge (dict "nvidia.com/gpu" (int $pods.gpus)) ($res.limits | default dict)) }}
    {{- $_ := set $res "requests" (merge (dict "nvidia.com/gpu" (int $pods.gpus)) ($res.requests | default dict)) }}
    {{- end }}
    {{- if and (eq $v.model.source "hub") (not (include "dflash.modelCacheClaim" .ctx)) }}
    {{- /* The per-pod download lands on node disk: ask the scheduler for it. */}}
    {{- $_ := set $res "requests" (merge ($res.requests | default dict) (dict "ephemeral-storage" $v.model.hub.cache.size)) }}
    {{- end }}
    {{- toYaml $res | nindent 4 }}
    {{- end }}
  securityContext:
    {{- include "dflash.containerSecurityContext" (dict "ctx" .ctx "readOnly" $v.security.readOnlyRootFilesystem) | nindent 4 }}
  volumeMounts:
    {{- include "dflash.rayVolumeMounts" . | nindent 4 }}
{{- end }}

{{/* A group's values that KubeRay's cluster hash mutes: min/max replicas (workers) and tolerations (all groups). */}}
{{- define "dflash.unhashedSpec" -}}
{{- if eq .role "head" }}
{{- dict "tolerations" .ctx.Values.head.tolerations | toJson }}
{{- else }}
{{- $pods := (index .ctx.Values .role).pods }}
{{- dict "minReplicas" (int $pods.minReplicas) "maxReplicas" (int $pods.maxReplicas) "tolerations" $pods.tolerations | toJson }}
{{- end }}
{{- end }}

{{/* The pod template of a Ray group. */}}
{{- define "dflash.rayPodTemplate" -}}
{{- $v := .ctx.Values -}}
{{- $sched := ternary $v.head (index $v .role).pods (eq .role "head") -}}
metadata:
  labels:
    {{- include "dflash.podLabels" (dict "ctx" .ctx "component" "ray") | nindent 4 }}
    dflash.dev/role: {{ .role }}
  annotations:
    {{- if eq .role "head" }}
    # Serve's gRPC proxy options (port, servicers, timeout), which Serve applies only when it starts: their
    # hash here makes KubeRay start a new cluster when they change (upgradeStrategy) instead of ignoring them.
    dflash.dev/grpc-options: {{ include "dflash.grpcOptions" .ctx | sha256sum | trunc 16 | quote }}
    {{- end }}
    # What KubeRay leaves out of its cluster hash (utils/util.go, GenerateHashWithoutReplicasAndWorkersToDelete):
    # a worker group's min/max replicas and every group's tolerations. Their hash here makes a change of them
    # go through upgradeStrategy like any cluster change, instead of never reaching the running RayCluster.
    dflash.dev/unhashed-spec: {{ include "dflash.unhashedSpec" . | sha256sum | trunc 16 | quote }}
    {{- with $v.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ if eq .role "head" }}{{ include "dflash.headServiceAccountName" .ctx }}{{ else }}{{ include "dflash.serviceAccountName" .ctx }}{{ end }}
  automountServiceAccountToken: false
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- include "dflash.podSecurityContext" .ctx | nindent 4 }}
  {{- if and (ne .role "head") (eq $v.model.source "hub") }}
  initContainers:
    {{- include "dflash.modelInitContainer" . | nindent 4 }}
  {{- end }}
  containers:
    {{- include "dflash.rayContainer" . | nindent 4 }}
  volumes:
    {{- include "dflash.rayVolumes" . | nindent 4 }}
  {{- with $sched.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $sched.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $sched.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if ne .role "head" }}
  {{- $selector := include "dflash.componentSelector" (dict "ctx" .ctx "component" "ray") | fromYaml }}
  {{- $_ := set $selector "dflash.dev/role" .role }}
  {{- with include "dflash.topologySpread" (dict "value" $sched.topologySpreadConstraints "selector" $selector) }}
  # The group's pods spread over nodes (softly by default): a lost node takes fewer of them.
  topologySpreadConstraints:
    {{- . | nindent 4 }}
  {{- end }}
  {{- end }}
{{- end }}
