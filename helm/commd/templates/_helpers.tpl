{{/* Names and labels. */}}
{{- define "commd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "commd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "commd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "commd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "commd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "commd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: node-daemon
{{- end -}}

{{- define "commd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "commd.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The image reference; fails with a clear message when no repository is given. */}}
{{- define "commd.image" -}}
{{- $repo := required "image.repository is required: the image that contains the commd binary (no public image exists; build one as docs/deploy.md shows, then --set image.repository=REGISTRY/commd)" .Values.image.repository -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" $repo .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "commd.socketPath" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.socket.hostDir) .Values.socket.name -}}
{{- end -}}

{{/* Checks that the schema cannot express. */}}
{{- define "commd.validate" -}}
{{- if and (eq .Values.updateStrategy.type "RollingUpdate") .Values.updateStrategy.rollingUpdate.maxSurge -}}
{{- fail "updateStrategy.rollingUpdate.maxSurge must be 0: two daemons cannot serve one node's socket (the second exits with code 3)" -}}
{{- end -}}
{{- if and (not .Values.metrics.enabled) (or .Values.metrics.serviceMonitor.enabled .Values.metrics.podMonitor.enabled) -}}
{{- fail "metrics.serviceMonitor/podMonitor need metrics.enabled=true (the daemon only listens for scrapes then)" -}}
{{- end -}}
{{- if and .Values.metrics.enabled (eq (int .Values.metrics.port) (int .Values.peer.port)) -}}
{{- fail (printf "metrics.port and peer.port are both %v: the daemon needs two ports" .Values.metrics.port) -}}
{{- end -}}
{{- end -}}

{{/* `commd health` as a probe command; the timeout leaves a second of margin to the probe's. */}}
{{- define "commd.healthCommand" -}}
exec:
  command:
    - {{ .root.Values.binary }}
    - health
    - --timeout-ms
    - {{ mul (max 1 (sub .probe.timeoutSeconds 1)) 1000 | quote }}
{{- end -}}
