{{- define "spind.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "spind.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "spind.selectorLabels" -}}
app.kubernetes.io/name: {{ include "spind.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "spind.labels" -}}
{{ include "spind.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "spind.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* spind containers per pod: one per GPU, or one on the CPU backend. */}}
{{- define "spind.instances" -}}
{{- if eq .Values.backend "cpu" -}}1{{- else -}}{{ .Values.gpusPerNode }}{{- end -}}
{{- end -}}

{{/* The socket of instance i: (list $ i). */}}
{{- define "spind.socket" -}}
{{- $ := index . 0 -}}
{{- printf "%s/%s-%d.sock" (trimSuffix "/" $.Values.socketDir) $.Values.socketPrefix (index . 1) -}}
{{- end -}}

{{- define "spind.adminSecretName" -}}
{{- if .Values.adminToken.existingSecret -}}
{{- .Values.adminToken.existingSecret -}}
{{- else -}}
{{- printf "%s-admin" (include "spind.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* "true" when spind gets an admin token, else empty. */}}
{{- define "spind.adminToken" -}}
{{- if or .Values.adminToken.existingSecret .Values.adminToken.create -}}true{{- end -}}
{{- end -}}
