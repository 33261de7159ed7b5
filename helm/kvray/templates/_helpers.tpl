{{/* Names and labels. */}}
{{- define "kvray.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Resource name prefix. Kept to 40 characters: KubeRay derives the RayCluster, pod and service
names from the RayService name and appends suffixes (-serve-svc, -head-svc, a cluster hash).
*/}}
{{- define "kvray.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvray.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvray.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvray.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvray.labels" -}}
helm.sh/chart: {{ include "kvray.chart" . }}
{{ include "kvray.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Ray pod labels. Not app.kubernetes.io/name: KubeRay sets it to "kuberay" on every Ray pod and
its head Service selects on it (with app.kubernetes.io/created-by and the ray.io/* labels),
so a pod template overriding it would cut the workers off from the head.
*/}}
{{- define "kvray.podSelectorLabels" -}}
app.kubernetes.io/part-of: {{ include "kvray.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvray.podLabels" -}}
helm.sh/chart: {{ include "kvray.chart" . }}
{{ include "kvray.podSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kvray.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Name of the Secret holding the API key; empty when authentication is off. */}}
{{- define "kvray.apiKeySecretName" -}}
{{- if .Values.apiKey.existingSecret }}
{{- .Values.apiKey.existingSecret }}
{{- else if .Values.apiKey.value }}
{{- printf "%s-api-key" (include "kvray.fullname" .) }}
{{- end }}
{{- end }}

{{/*
TLS: where the Secret is mounted in the Ray containers (and the smoke test), and the two files
the Serve config names. The paths are fixed: the application args and http_options carry them,
and the Secret's keys (tls.crt, tls.key) are those of every kubernetes.io/tls Secret.
*/}}
{{- define "kvray.tlsDir" -}}
/etc/kvray/tls
{{- end }}

{{- define "kvray.tlsCertFile" -}}
{{- printf "%s/tls.crt" (include "kvray.tlsDir" .) }}
{{- end }}

{{- define "kvray.tlsKeyFile" -}}
{{- printf "%s/tls.key" (include "kvray.tlsDir" .) }}
{{- end }}

{{/*
The API-keys file (apiKeysFile): where its Secret is mounted in the Ray containers, and the
file the application's api_keys_file names; empty when there is none.
*/}}
{{- define "kvray.apiKeysDir" -}}
/etc/kvray/api-keys
{{- end }}

{{- define "kvray.apiKeysFile" -}}
{{- if .Values.apiKeysFile.existingSecret }}
{{- printf "%s/%s" (include "kvray.apiKeysDir" .) .Values.apiKeysFile.secretKey }}
{{- end }}
{{- end }}

{{/*
Cross-field checks the JSON schema cannot express; they fail the render with a message that
names the values involved.
*/}}
{{- define "kvray.validate" -}}
{{- $as := .Values.serve.autoscaling }}
{{- if and $as.enabled (lt (int $as.maxReplicas) (int $as.minReplicas)) }}
{{- fail (printf "serve.autoscaling.maxReplicas (%d) must be >= serve.autoscaling.minReplicas (%d)" (int $as.maxReplicas) (int $as.minReplicas)) }}
{{- end }}
{{- $e := .Values.engine }}
{{- if and (gt (float64 $e.kvShareGib) 0.0) (not (gt (float64 $e.kvOffloadGib) 0.0)) }}
{{- fail "engine.kvShareGib needs engine.kvOffloadGib > 0: pulled KV blocks land in the host tier first" }}
{{- end }}
{{- if and (gt (int .Values.serve.disaggregation.prefillReplicas) 0) (not (gt (float64 $e.kvShareGib) 0.0)) }}
{{- fail "serve.disaggregation.prefillReplicas needs engine.kvShareGib > 0 (and engine.kvOffloadGib > 0): prefill replicas hand their KV over through the cluster tier" }}
{{- end }}
{{- $pd := .Values.serve.disaggregation }}
{{- if and (not (kindIs "invalid" $pd.prefillMaxReplicas)) (lt (int $pd.prefillMaxReplicas) (int $pd.prefillReplicas)) }}
{{- fail (printf "serve.disaggregation.prefillMaxReplicas (%d) must be >= serve.disaggregation.prefillReplicas (%d)" (int $pd.prefillMaxReplicas) (int $pd.prefillReplicas)) }}
{{- end }}
{{- $tp := int .Values.engine.tensorParallelSize }}
{{- $cpu := toString (dig "limits" "cpu" "" .Values.worker.resources) }}
{{- if regexMatch "^[0-9]+$" $cpu }}
{{- if lt (atoi $cpu) $tp }}
{{- fail (printf "worker.resources.limits.cpu (%s) must be >= engine.tensorParallelSize (%d): an engine replica reserves one CPU per tensor-parallel rank on its pod" $cpu $tp) }}
{{- end }}
{{- end }}
{{- if and .Values.rayAuth.enabled (semverCompare "<2.52.0-0" .Values.ray.version) }}
{{- fail (printf "rayAuth.enabled needs Ray >= 2.52.0 (ray.version is %s): set rayAuth.enabled=false or upgrade Ray" .Values.ray.version) }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.existingSecret) }}
{{- fail "tls.enabled needs tls.existingSecret: the name of a kubernetes.io/tls Secret (keys tls.crt and tls.key) in the release's namespace" }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.probes.enabled) }}
{{- fail "tls.enabled needs probes.enabled: without the chart's HTTPS probes KubeRay adds its own readiness probe to engine pods, which checks the Serve proxy over plain HTTP and would keep them unready" }}
{{- end }}
{{- if and (eq .Values.model.volume.type "none") .Values.model.initContainers }}
{{- fail "model.initContainers need a volume to fill: set model.volume.type (e.g. emptyDir)" }}
{{- end }}
{{- end }}
