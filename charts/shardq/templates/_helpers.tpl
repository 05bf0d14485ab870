{{/* Names and labels shared by every template. */}}

{{- define "shardq.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "shardq.fullname" -}}
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

{{- define "shardq.operatorName" -}}
{{- printf "%s-operator" (include "shardq.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "shardq.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: shardq
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "shardq.operatorSelectorLabels" -}}
app.kubernetes.io/name: shardq-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "shardq.operatorLabels" -}}
{{ include "shardq.labels" . }}
app.kubernetes.io/name: shardq-operator
app.kubernetes.io/component: operator
{{- end -}}

{{/* The name the operator's metrics certificate is checked for (its PodMonitor scrapes pods
by IP): the user's, or the Deployment's name as a Service's would be. `.svc`, not
`.svc.cluster.local`: the chart does not know the cluster's domain. */}}
{{- define "shardq.operatorMetricsServerName" -}}
{{- default (printf "%s.%s.svc" (include "shardq.operatorName" .) .Release.Namespace) .Values.operator.metricsTls.serverName -}}
{{- end -}}

{{- define "shardq.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "shardq.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "shardq.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "shardq.clusterImage" -}}
{{- default (include "shardq.image" .) .Values.cluster.image -}}
{{- end -}}

{{/* The client Service of the chart's cluster (operator/shardq_operator/naming.py). */}}
{{- define "shardq.clusterEndpoint" -}}
{{- printf "%s-shardq.%s.svc.cluster.local:7600" .Values.cluster.name .Release.Namespace -}}
{{- end -}}

{{- define "shardq.cleanupName" -}}
{{- printf "%s-cleanup" (include "shardq.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The Secret holding the operator's peer key: the user's, or the one the chart makes. */}}
{{- define "shardq.peerKeySecret" -}}
{{- default (printf "%s-peer-key" (include "shardq.operatorName" .)) .Values.operator.peerKeySecret -}}
{{- end }}
