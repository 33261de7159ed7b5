{{/*
The Ray Serve config (serveConfigV2): the application built by cluster.app:build_app from
`args`, the same document `kvray config` writes. Integers go through int64 so large values
(KV cache bytes) are not printed in float notation; unset optional values are left out so
the application's own defaults apply.
*/}}
{{- define "kvray.serveArgs" -}}
{{- $e := .Values.engine }}
{{- $s := .Values.serve }}
{{- if ge (float64 $s.gracefulShutdownTimeoutSeconds) (float64 .Values.worker.terminationGracePeriodSeconds) }}
{{- fail "serve.gracefulShutdownTimeoutSeconds must be below worker.terminationGracePeriodSeconds: Kubernetes would kill an engine pod before its requests move" }}
{{- end }}
{{- $args := dict
  "tensor_parallel_size" (int64 $e.tensorParallelSize)
  "device" $e.device
  "max_num_seqs" (int64 $e.maxNumSeqs)
  "enable_prefix_caching" $e.enablePrefixCaching
  "max_ongoing_requests" (int64 $s.maxOngoingRequests)
  "max_queued_requests" (int64 $s.maxQueuedRequests)
  "max_queued_tokens" (int64 $s.maxQueuedTokens)
  "ingress_replicas" (int64 $s.ingressReplicas)
  "request_router" $s.requestRouter
  "stream_interval_ms" (int64 $s.streamIntervalMs)
  "max_migrations" (int64 $s.maxMigrations)
  "graceful_shutdown_timeout_s" (float64 $s.gracefulShutdownTimeoutSeconds)
  "grpc_max_message_bytes" (int64 $s.grpcMaxMessageBytes)
  "api_key_env" .Values.apiKey.envName
}}
{{- with .Values.model.path }}{{ $_ := set $args "model" . }}{{ end }}
{{- with .Values.model.servedModelName }}{{ $_ := set $args "served_model_name" . }}{{ end }}
{{- with $s.otlpEndpoint }}
{{- $_ := set $args "otlp_endpoint" . }}
{{- $_ := set $args "otlp_sample_ratio" (float64 $s.otlpSampleRatio) }}
{{- end }}
{{- if not (kindIs "invalid" $e.maxModelLen) }}{{ $_ := set $args "max_model_len" (int64 $e.maxModelLen) }}{{ end }}
{{- if not (kindIs "invalid" $e.kvCacheMemoryBytes) }}{{ $_ := set $args "kv_cache_memory_bytes" (int64 $e.kvCacheMemoryBytes) }}{{ end }}
{{- if not (kindIs "invalid" $e.maxNumBatchedTokens) }}{{ $_ := set $args "max_num_batched_tokens" (int64 $e.maxNumBatchedTokens) }}{{ end }}
{{- if $e.enableExpertParallel }}{{ $_ := set $args "enable_expert_parallel" true }}{{ end }}
{{- if $e.asyncScheduling }}{{ $_ := set $args "async_scheduling" true }}{{ end }}
{{- /* The KV tiers and disaggregation (docs/serving.md, docs/disaggregation.md). */}}
{{- if gt (float64 $e.kvOffloadGib) 0.0 }}{{ $_ := set $args "kv_offload_gib" (float64 $e.kvOffloadGib) }}{{ end }}
{{- if gt (float64 $e.kvShareGib) 0.0 }}{{ $_ := set $args "kv_share_gib" (float64 $e.kvShareGib) }}{{ end }}
{{- if ne $e.kvCacheDtype "auto" }}{{ $_ := set $args "kv_cache_dtype" $e.kvCacheDtype }}{{ end }}
{{- with $e.speculativeConfig }}{{ $_ := set $args "speculative_config" . }}{{ end }}
{{- if ne $e.toolCallParser "auto" }}{{ $_ := set $args "tool_call_parser" $e.toolCallParser }}{{ end }}
{{- with $e.reasoningParser }}{{ $_ := set $args "reasoning_parser" . }}{{ end }}
{{- if .Values.gateway.enabled }}{{ $_ := set $args "engine_metrics_port" (int64 .Values.gateway.engineMetricsPort) }}{{ end }}
{{- $pd := $s.disaggregation }}
{{- if gt (int64 $pd.prefillReplicas) 0 }}
{{- $_ := set $args "prefill_replicas" (int64 $pd.prefillReplicas) }}
{{- $_ := set $args "pd" $pd.mode }}
{{- if not (kindIs "invalid" $pd.prefillMaxReplicas) }}
{{- $_ := set $args "prefill_max_replicas" (int64 $pd.prefillMaxReplicas) }}
{{- $_ := set $args "target_prefill_queued_tokens" (float64 $pd.targetPrefillQueuedTokens) }}
{{- end }}
{{- end }}
{{- /* LoRA adapters (docs/lora.md): their directories are read in the pods. */}}
{{- $l := .Values.lora }}
{{- if or $l.enabled $l.modules $l.runtimeLoading }}
{{- $modules := list }}
{{- range $l.modules }}
{{- $m := dict "name" .name "path" .path }}
{{- with .baseModelName }}{{ $_ := set $m "base_model_name" . }}{{ end }}
{{- $modules = append $modules $m }}
{{- end }}
{{- with $modules }}{{ $_ := set $args "lora_modules" . }}{{ end }}
{{- $_ := set $args "enable_lora" true }}
{{- $_ := set $args "enable_runtime_lora" (eq $l.runtimeLoading true) }}
{{- $_ := set $args "max_loras" (int64 $l.maxLoras) }}
{{- $_ := set $args "max_lora_rank" (int64 $l.maxLoraRank) }}
{{- if not (kindIs "invalid" $l.maxCpuLoras) }}{{ $_ := set $args "max_cpu_loras" (int64 $l.maxCpuLoras) }}{{ end }}
{{- end }}
{{- /* The API-keys file: the ingresses read it where they run (the Secret's mount). */}}
{{- with include "kvray.apiKeysFile" . }}{{ $_ := set $args "api_keys_file" . }}{{ end }}
{{- /* gRPC over TLS: the gRPC ingress reads these files on the head (the Secret's mount). */}}
{{- if .Values.tls.enabled }}
{{- $_ := set $args "tls_cert_file" (include "kvray.tlsCertFile" .) }}
{{- $_ := set $args "tls_key_file" (include "kvray.tlsKeyFile" .) }}
{{- end }}
{{- if $s.autoscaling.enabled }}
{{- $_ := set $args "min_replicas" (int64 $s.autoscaling.minReplicas) }}
{{- $_ := set $args "max_replicas" (int64 $s.autoscaling.maxReplicas) }}
{{- $_ := set $args "target_ongoing_requests" (int64 $s.autoscaling.targetOngoingRequests) }}
{{- with $s.autoscaling.policy }}{{ $_ := set $args "autoscaling_policy" . }}{{ end }}
{{- if not (kindIs "invalid" $s.autoscaling.targetWaitingRequests) }}{{ $_ := set $args "target_waiting_requests" (float64 $s.autoscaling.targetWaitingRequests) }}{{ end }}
{{- if not (kindIs "invalid" $s.autoscaling.targetKvCacheUsage) }}{{ $_ := set $args "target_kv_cache_usage" (float64 $s.autoscaling.targetKvCacheUsage) }}{{ end }}
{{- if not (kindIs "invalid" $s.autoscaling.upscaleDelaySeconds) }}{{ $_ := set $args "upscale_delay_s" (float64 $s.autoscaling.upscaleDelaySeconds) }}{{ end }}
{{- if not (kindIs "invalid" $s.autoscaling.downscaleDelaySeconds) }}{{ $_ := set $args "downscale_delay_s" (float64 $s.autoscaling.downscaleDelaySeconds) }}{{ end }}
{{- else }}
{{- $_ := set $args "num_replicas" (int64 $s.replicas) }}
{{- end }}
{{- toYaml $args }}
{{- end }}

{{/*
http_options: with TLS, Serve's proxy on every pod terminates HTTPS with the Secret's files (the
same ones the gRPC ingress reads), as `kvray serve --tls-cert/--tls-key` does.
grpc_options: kvray's gRPC ingress (cluster/grpc_api/ingress.py) binds grpc_options.port on the head
itself; no servicer functions keeps Ray Serve's own gRPC proxy off that port.
*/}}
{{- define "kvray.serveConfig" -}}
{{- $s := .Values.serve }}
{{- $app := dict
  "name" $s.appName
  "route_prefix" "/"
  "import_path" "cluster.app:build_app"
  "args" (include "kvray.serveArgs" . | fromYaml)
}}
{{- /* GET /health from a replica of its own, off the ingress's event loop
(cluster/deploy/liveness.py): the pods' liveness probes must answer under any load. */}}
{{- $liveness := dict
  "name" (printf "%s-liveness" $s.appName)
  "route_prefix" "/health"
  "import_path" "cluster.app:build_liveness_app"
}}
{{- $http := dict "host" "0.0.0.0" "port" (int64 $s.httpPort) }}
{{- if .Values.tls.enabled }}
{{- $_ := set $http "ssl_certfile" (include "kvray.tlsCertFile" .) }}
{{- $_ := set $http "ssl_keyfile" (include "kvray.tlsKeyFile" .) }}
{{- end }}
{{- $cfg := dict
  "proxy_location" "EveryNode"
  "http_options" $http
  "grpc_options" (dict "port" (int64 $s.grpcPort) "grpc_servicer_functions" list)
  "applications" (list $app $liveness)
}}
{{- toYaml $cfg }}
{{- end }}
