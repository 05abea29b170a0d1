{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "eagle-serve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: the release name, with the chart name unless the release already has it. */}}
{{- define "eagle-serve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "eagle-serve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "eagle-serve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "eagle-serve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "eagle-serve.labels" -}}
helm.sh/chart: {{ include "eagle-serve.chart" . }}
{{ include "eagle-serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "eagle-serve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "eagle-serve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "eagle-serve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The Secret holding the API key, or "" when no key is configured. */}}
{{- define "eagle-serve.apiKeySecret" -}}
{{- if .Values.apiKey.existingSecret }}
{{- .Values.apiKey.existingSecret }}
{{- else if .Values.apiKey.value }}
{{- printf "%s-api-key" (include "eagle-serve.fullname" .) }}
{{- end }}
{{- end }}

{{- define "eagle-serve.apiKeySecretKey" -}}
{{- if .Values.apiKey.existingSecret }}
{{- .Values.apiKey.existingSecretKey }}
{{- else }}
{{- "api-key" }}
{{- end }}
{{- end }}

{{/* Whether more than one replica runs (a PodDisruptionBudget then makes sense). */}}
{{- define "eagle-serve.multiReplica" -}}
{{- if .Values.autoscaling.enabled }}
{{- if gt (int .Values.autoscaling.minReplicas) 1 }}true{{ end }}
{{- else if gt (int .Values.replicaCount) 1 }}true
{{- end }}
{{- end }}
