{{/*
serveConfigV2: Ray Serve's config file. The application's `args` are the service's own configuration
tree (dflash.service.config.ServiceConfig.from_dict) without its deployment sections; secrets and per-pod
values are not here either: they reach each replica as DFLASH_* environment variables (_raypod.tpl).
Replicas, autoscaling, admission limits and actor options are `deployments:` overrides, which Serve
applies over what the code sets: Serve hashes `args` (and autoscaling policies) into the application's
code version and restarts every replica when it changes, but scales or re-limits a deployment in place
when only its overrides do (changed actor options restart that deployment alone).
*/}}

{{- define "dflash.modelPaths" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "hub" }}
{{- dict "target" (printf "%s/target" $m.mountPath) "drafter" (printf "%s/drafter" $m.mountPath) | toJson }}
{{- else if eq $m.source "pvc" }}
{{- dict "target" (printf "%s/%s" $m.mountPath $m.pvc.target) "drafter" (printf "%s/%s" $m.mountPath $m.pvc.drafter) | toJson }}
{{- else if $m.image.target }}
{{- dict "target" $m.image.target "drafter" $m.image.drafter | toJson }}
{{- else }}
{{- dict "target" nil "drafter" nil | toJson }}
{{- end }}
{{- end }}

{{/* The model's name in the APIs, as ServiceConfig.model_name makes it: model.name, else the target directory's last part. */}}
{{- define "dflash.modelName" -}}
{{- $target := (include "dflash.modelPaths" . | fromJson).target }}
{{- .Values.model.name | default (ternary (base (toString $target)) "dflash-demo" (not (empty $target))) }}
{{- end }}

{{/* One deployment's override; pass (dict "name" n "v" .Values.<role> "gpus" bool "resource" name "drafter" bool).
The drafter scales on the load its replicas report (dflash.service.autoscaling), the others on Serve's
own request counts. The ingress asks for no CPU: the head offers none (only its ingress resource). */}}
{{- define "dflash.deploymentOverride" -}}
{{- $v := .v }}
{{- $actor := dict "num_cpus" (float64 ($v.cpusPerReplica | default 0)) }}
{{- if .gpus }}
{{- $_ := set $actor "num_gpus" (float64 $v.gpusPerReplica) }}
{{- end }}
{{- if .resource }}
{{- $_ := set $actor "resources" (dict .resource 1.0) }}
{{- end }}
{{- $auto := dict "min_replicas" (int $v.autoscaling.minReplicas) "max_replicas" (int $v.autoscaling.maxReplicas) }}
{{- if .drafter }}
{{- $kwargs := dict "target_inflight_drafts" (float64 $v.autoscaling.targetInflightDrafts) }}
{{- $_ := set $auto "policy" (dict "policy_function" "dflash.service.autoscaling:DraftLoadPolicy" "policy_kwargs" $kwargs) }}
{{- $_ := set $auto "upscale_delay_s" (float64 $v.autoscaling.upscaleDelaySeconds) }}
{{- $_ := set $auto "downscale_delay_s" (float64 $v.autoscaling.downscaleDelaySeconds) }}
{{- else }}
{{- $_ := set $auto "target_ongoing_requests" (float64 $v.autoscaling.targetOngoingRequests) }}
{{- end }}
{{- dict "name" .name "autoscaling_config" $auto "ray_actor_options" $actor "max_ongoing_requests" (int $v.maxOngoingRequests) "max_queued_requests" (int $v.maxQueuedRequests) | toJson }}
{{- end }}

{{- define "dflash.serviceArgs" -}}
{{- $v := .Values }}
{{- $paths := include "dflash.modelPaths" . | fromJson }}
{{- $model := dict "target" $paths.target "drafter" $paths.drafter "device" $v.model.device "dtype" $v.model.dtype "drafter_dtype" $v.model.drafterDtype "name" $v.model.name }}
{{- $redis := dict "ttl_s" (int $v.sessions.ttlSeconds) "key_prefix" $v.sessions.keyPrefix "socket_timeout_s" (float64 $v.sessions.socketTimeoutSeconds) }}
{{- $net := dict "port" (int $v.drafter.net.port) "timeout_s" (float64 $v.drafter.net.timeoutSeconds) "retry_after_s" (float64 $v.drafter.net.retryAfterSeconds) "chunk_bytes" (int $v.drafter.net.chunkBytes) "max_sessions" (int $v.drafter.net.maxSessions) "workers" (int $v.drafter.net.workers) "context_window" (int $v.drafter.net.contextWindow) }}
{{- $sched := $v.verifier.scheduler }}
{{- $scheduler := dict "max_running" (int $sched.maxRunningSessions) "max_step_tokens" (int $sched.maxStepTokens) "max_queued" (int $sched.maxQueuedSessions) "cache_tokens" (int $sched.cacheTokens) "verify_policy" $sched.verifyPolicy "stream_interval_ms" $sched.streamIntervalMs }}
{{- $limits := dict "max_new_tokens" (int $v.limits.maxNewTokens) "max_request_bytes" (int $v.limits.maxRequestBytes) "max_stop_strings" (int $v.limits.maxStopStrings) "max_prompt_chars" (int $v.limits.maxPromptChars) }}
{{- $args := dict "mode" $v.mode "ingress_placement" $v.ingress.placement "app_name" $v.appName "grpc_host" "0.0.0.0" "grpc_port" (int $v.grpc.port) "model" $model "redis" $redis }}
{{- $_ := set $args "drafter_net" $net }}
{{- $_ := set $args "limits" $limits }}
{{- $_ := set $args "scheduler" $scheduler }}
{{- $_ := set $args "torch_threads" (int $v.torchThreads) }}
{{- $_ := set $args "engine_process" $v.engineProcess }}
{{- $_ := set $args "metrics" $v.metrics }}
{{- $_ := set $args "reflection" $v.grpc.reflection }}
{{- /* Only `enabled`: on a cluster http_options (dflash.serveConfig) place the HTTP proxy, not openai.host/port. */}}
{{- $_ := set $args "openai" (dict "enabled" $v.openai.enabled) }}
{{- toJson $args }}
{{- end }}

{{/*
Serve's gRPC proxy options, as dflash.service.app.grpc_options builds them for `dflash serve`: the
services of servicers.py (lenient request decoding: undecodable bytes reach the ingress and get
INVALID_ARGUMENT), reflection among them when grpc.reflection is on, so that the ingress answers it
behind the token. Ray's own reflection (enable_reflection) answers anyone and stays off. Serve applies
these options only when it starts: a running cluster keeps its proxy's (rayservice.yaml hashes them
into the head pod, so a change makes a new cluster).
*/}}
{{- define "dflash.grpcOptions" -}}
{{- $v := .Values }}
{{- $servicers := list "dflash.service.servicers.add_GenerationServicer_to_server" "dflash.service.servicers.add_HealthServicer_to_server" }}
{{- if $v.grpc.reflection }}
{{- $servicers = append $servicers "dflash.service.servicers.add_ServerReflectionServicer_to_server" }}
{{- end }}
{{- $grpc := dict "port" (int $v.grpc.port) "enable_reflection" false "grpc_servicer_functions" $servicers }}
{{- if $v.grpc.requestTimeoutSeconds }}
{{- $_ := set $grpc "request_timeout_s" (float64 $v.grpc.requestTimeoutSeconds) }}
{{- end }}
{{- toJson $grpc }}
{{- end }}

{{/*
http_options: Serve's HTTP proxy (the OpenAI API, and the /-/healthz KubeRay checks) on 8000 in every pod that
runs a proxy (EveryNode: the head and each node with a replica). Fixed: KubeRay checks the proxy's health on
the container port named "serve", else 8000 (utils.FindContainerPort), and the port is not named "serve" (the
gRPC serve Service would carry it); Serve applies http_options only when it starts.
*/}}
{{- define "dflash.serveConfig" -}}
{{- $v := .Values }}
{{- $grpc := include "dflash.grpcOptions" . | fromJson }}
{{- $deployments := list }}
{{- if eq $v.ingress.placement "separate" }}
{{- $deployments = append $deployments (include "dflash.deploymentOverride" (dict "name" "ingress" "v" $v.ingress "gpus" false "resource" $v.ingress.rayResource "drafter" false) | fromJson) }}
{{- end }}
{{- $deployments = append $deployments (include "dflash.deploymentOverride" (dict "name" "verifier" "v" $v.verifier "gpus" true "resource" $v.verifier.rayResource "drafter" false) | fromJson) }}
{{- if eq $v.mode "disaggregated" }}
{{- $deployments = append $deployments (include "dflash.deploymentOverride" (dict "name" "drafter" "v" $v.drafter "gpus" true "resource" $v.drafter.rayResource "drafter" true) | fromJson) }}
{{- end }}
{{- $app := dict "name" $v.appName "route_prefix" "/" "import_path" "dflash.service.app:build" "args" (include "dflash.serviceArgs" . | fromJson) "deployments" $deployments }}
{{- $config := dict "proxy_location" "EveryNode" "http_options" (dict "host" "0.0.0.0" "port" 8000) "grpc_options" $grpc "applications" (list $app) }}
{{- toYaml $config }}
{{- end }}
