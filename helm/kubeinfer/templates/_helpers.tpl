{{/*
Names and labels shared by every template. Kubernetes names are cut to 63 characters.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "kubeinfer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* RELEASE-NAME, or just RELEASE when it already contains the name; fullnameOverride wins. */}}
{{- define "kubeinfer.fullname" -}}
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

{{/* A name derived from the fullname with a suffix, still at most 63 characters. */}}
{{- define "kubeinfer.suffixed" -}}
{{- $suffix := printf "-%s" .suffix }}
{{- printf "%s%s" (include "kubeinfer.fullname" .ctx | trunc (int (sub 63 (len $suffix))) | trimSuffix "-") $suffix }}
{{- end }}

{{- define "kubeinfer.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object the chart makes. */}}
{{- define "kubeinfer.labels" -}}
helm.sh/chart: {{ include "kubeinfer.chart" . }}
{{ include "kubeinfer.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kubeinfer
{{- end }}

{{/* The labels that tell this release's objects apart. */}}
{{- define "kubeinfer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kubeinfer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The operator pods' selector: the selector labels and the component, so that other pods of
the release (the helm test pod) never match. */}}
{{- define "kubeinfer.operatorSelectorLabels" -}}
{{ include "kubeinfer.selectorLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "kubeinfer.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kubeinfer.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kubeinfer.operatorImage" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "kubeinfer.runtimeImage" -}}
{{- printf "%s:%s" .Values.runtime.image.repository (default .Chart.AppVersion .Values.runtime.image.tag) }}
{{- end }}

{{- define "kubeinfer.isClusterwide" -}}
{{- if not .Values.watchNamespaces }}true{{- end }}
{{- end }}

{{/*
What the operator does in a namespace it serves (and nothing more): its own InferenceModels
(kopf patches annotations and finalizers; status and scale are written through their
subresources; owner references with blockOwnerDeletion need update on finalizers), the
children it applies server-side (delete: a PDB no longer wanted), the pods it reads status
from, the Deployment scale it sets when autoscaling, and events. No wildcards.
*/}}
{{- define "kubeinfer.workloadRules" -}}
- apiGroups: [kubeinfer.dev]
  resources: [inferencemodels]
  verbs: [get, list, watch, patch]
- apiGroups: [kubeinfer.dev]
  resources: [inferencemodels/status, inferencemodels/scale]
  verbs: [get, patch]
- apiGroups: [kubeinfer.dev]
  resources: [inferencemodels/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments/scale]
  verbs: [get, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
# each model's router (routing mode router): its ServiceAccount, and a Role that lets it read
# pods, bound to it (the operator holds pods get/list/watch itself, so it may grant them)
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch, delete]
# routing mode inferencePool: the model's InferencePool (Gateway API Inference Extension)
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [apps]
  resources: [replicasets]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}
