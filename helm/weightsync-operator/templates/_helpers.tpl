{{/* Names and labels shared by every template. */}}
{{- define "weightsync-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "weightsync-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The standard labels minus app.kubernetes.io/component (added by the two helpers below). */}}
{{- define "weightsync-operator.commonLabels" -}}
app.kubernetes.io/name: {{ include "weightsync-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: weightsync
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "weightsync-operator.labels" -}}
{{ include "weightsync-operator.commonLabels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The CRD upgrade hook's objects. */}}
{{- define "weightsync-operator.crdUpgradeLabels" -}}
{{ include "weightsync-operator.commonLabels" . }}
app.kubernetes.io/component: crd-upgrade
{{- end -}}

{{- define "weightsync-operator.crdUpgradeName" -}}
{{- printf "%s-crd-upgrade" (include "weightsync-operator.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The metrics Service's name: also the `job` label Prometheus gives its targets (ServiceMonitor default). */}}
{{- define "weightsync-operator.metricsServiceName" -}}
{{- printf "%s-metrics" (include "weightsync-operator.fullname" .) -}}
{{- end -}}

{{- define "weightsync-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "weightsync-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "weightsync-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "weightsync-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* "true" when kopf peering is on (auto: more than one replica). */}}
{{- define "weightsync-operator.peering" -}}
{{- $p := .Values.peering.enabled | toString -}}
{{- if or (eq $p "true") (and (eq $p "auto") (gt (int .Values.replicaCount) 1)) -}}true{{- end -}}
{{- end -}}

{{- define "weightsync-operator.clusterwide" -}}
{{- if not .Values.watchNamespaces -}}true{{- end -}}
{{- end -}}

{{/*
The rules the operator needs, in one place for the Role and the ClusterRole. Every verb is used:
- weightsyncjobs: watched (kopf), read by the reconciler; status written through the subresource.
- pods: created, listed/watched (the operator's watch cache), annotations patched, surplus deleted.
  pods/status is not used by the operator itself but is granted to the per-job agent Role, and RBAC
  only lets a subject grant what it holds (escalation check).
- services, configmaps, serviceaccounts, roles, rolebindings, networkpolicies, resourceclaimtemplates:
  listed and watched (label app.kubernetes.io/managed-by=weightsync-operator) into the operator's caches
  instead of a GET per reconcile; read once by name when a create meets a namesake; created and patched
  when they drift.
- secrets: create only (the per-job token; never read back).
- events: create (kopf and the reconciler post them on the job).
*/}}
{{- define "weightsync-operator.rules" -}}
- apiGroups: ["weightsync.io"]
  resources: ["weightsyncjobs"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["weightsync.io"]
  resources: ["weightsyncjobs/status"]
  verbs: ["get", "patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods/status"]
  verbs: ["get", "patch"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["services", "serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaimtemplates"]
  verbs: ["get", "list", "watch", "create", "patch"]
{{- end -}}
