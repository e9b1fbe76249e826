{{/* Chart name, truncated to a DNS label. */}}
{{- define "ppojob-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: the release name, with the chart name unless the release already has it. */}}
{{- define "ppojob-operator.fullname" -}}
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

{{- define "ppojob-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ppojob-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ppojob-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ppojob-operator.labels" -}}
helm.sh/chart: {{ include "ppojob-operator.chart" . }}
{{ include "ppojob-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ppojob
{{- end }}

{{- define "ppojob-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ppojob-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ppojob-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
The operator's RBAC rules: exactly ppojob_operator.rbac.OPERATOR_RULES, same order
(tests/chart/test_chart.py compares them). Cluster-wide mode puts all of them in one ClusterRole.
Namespaced mode puts the namespaced ones in a Role per watched namespace and the cluster-scoped
ones (CustomResourceDefinitions; Namespaces: a job's namespace's Pod Security level) in a
ClusterRole.
*/}}
{{- define "ppojob-operator.rules" -}}
rules:
  - apiGroups: ["ppojob.io"]
    resources: ["ppojobs"]
    verbs: ["get", "list", "watch", "patch"]
  - apiGroups: ["ppojob.io"]
    resources: ["ppojobs/status"]
    verbs: ["get", "patch"]
  - apiGroups: ["ppojob.io"]
    resources: ["ppojobs/finalizers"]
    verbs: ["update"]
  - apiGroups: ["ray.io"]
    resources: ["rayjobs"]
    verbs: ["get", "list", "watch", "create", "patch", "delete"]
  - apiGroups: [""]
    resources: ["configmaps", "serviceaccounts"]
    verbs: ["get", "list", "watch", "create"]
  - apiGroups: ["rbac.authorization.k8s.io"]
    resources: ["roles", "rolebindings"]
    verbs: ["get", "list", "watch", "create"]
  - apiGroups: ["scheduling.x-k8s.io"]
    resources: ["podgroups"]
    verbs: ["get", "list", "watch", "create"]
  - apiGroups: ["policy"]
    resources: ["poddisruptionbudgets"]
    verbs: ["get", "list", "watch", "create"]
  - apiGroups: ["networking.k8s.io"]
    resources: ["networkpolicies"]
    verbs: ["get", "list", "watch", "create"]
  - apiGroups: ["kueue.x-k8s.io"]
    resources: ["workloads"]
    verbs: ["get", "list", "patch"]
  - apiGroups: ["kueue.x-k8s.io"]
    resources: ["localqueues"]
    verbs: ["get"]
  - apiGroups: [""]
    resources: ["pods"]
    verbs: ["list", "watch"]
  - apiGroups: [""]
    resources: ["events"]
    verbs: ["create"]
  - apiGroups: ["apiextensions.k8s.io"]
    resources: ["customresourcedefinitions"]
    verbs: ["get", "list", "watch"]
  - apiGroups: [""]
    resources: ["namespaces"]
    verbs: ["get", "list", "watch"]
  - apiGroups: ["kueue.x-k8s.io"]
    resources: ["clusterqueues", "admissionchecks"]
    verbs: ["get"]
{{- end }}

{{/* Resources that are cluster-scoped (never granted by a namespaced Role). */}}
{{- define "ppojob-operator.clusterScopedResources" -}}
customresourcedefinitions namespaces clusterqueues admissionchecks
{{- end }}

{{/*
KubeRay's batch scheduler as the operator is told it: the value as written; `auto` is passed on,
and the operator reads KubeRay's Deployment in kuberay.namespace at start-up (a Role there);
"unknown": not told, not checked.
*/}}
{{- define "ppojob-operator.kuberayBatchScheduler" -}}
{{- $kr := .Values.kuberay | default dict -}}
{{- if hasKey $kr "batchScheduler" -}}{{- $kr.batchScheduler -}}{{- else -}}auto{{- end -}}
{{- end -}}
