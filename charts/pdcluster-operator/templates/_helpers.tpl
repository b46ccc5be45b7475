{{/* Names and labels shared by every template of the chart. */}}

{{- define "pdcluster-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdcluster-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdcluster-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdcluster-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdcluster-operator.labels" -}}
{{ include "pdcluster-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "pdcluster-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdcluster-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pdcluster-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
Rules for the namespaces the operator manages: PDClusters and their children
(a PDClusterRoleScaler per role among them).
Secrets are read and created by name only (never listed). Roles it creates for
the PDCluster pods grant a subset of these rules (pods read, events write), so
the apiserver's escalation check passes.
*/}}
{{- define "pdcluster-operator.namespacedRules" -}}
- apiGroups: ["pdcluster.io"]
  resources: ["pdclusters"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["pdcluster.io"]
  resources: ["pdclusters/status"]
  verbs: ["get", "patch"]
- apiGroups: ["pdcluster.io"]
  resources: ["pdclusterrolescalers"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["pdcluster.io"]
  resources: ["pdclusterrolescalers/status"]
  verbs: ["get", "patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "create", "patch", "delete"]
# scheduler-plugins' PodGroups, one per instance of a role with
# `scheduling.gang: podGroup`; granted even where that CRD is not installed
# (the operator then reports PodGroupUnavailable for such roles).
- apiGroups: ["scheduling.x-k8s.io"]
  resources: ["podgroups"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
{{- end -}}


{{/* A label map as `k=v,k2=v2` (sorted), what the operator's selector variables read. */}}
{{- define "pdcluster-operator.labelPairs" -}}
{{- $pairs := list -}}
{{- range $k, $v := . -}}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}
