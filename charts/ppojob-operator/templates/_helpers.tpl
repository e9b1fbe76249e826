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
{{- end }}

{{/* Resources that are cluster-scoped (never granted by a namespaced Role). */}}
{{- define "ppojob-operator.clusterScopedResources" -}}
customresourcedefinitions namespaces
{{- end }}

{{/*
KubeRay's batch scheduler as the operator is told it: the value as written, or with
`kuberay.batchScheduler: auto` read from the KubeRay operator's Deployment in the cluster
(`lookup`, so at `helm install`/`upgrade` and `helm template --dry-run=server`; plain
`helm template` sees no cluster). A KubeRay Deployment is one named or labelled
(app.kubernetes.io/name) `kuberay-operator`; its container of that name (else its first) is
read the way KubeRay 1.5's main.go reads its flags: `--config FILE` (then the file, from the
ConfigMap mounted there: `batchScheduler`, `enableBatchScheduler`), `--batch-scheduler[=]NAME`,
`--enable-batch-scheduler[=true]` (volcano). Result: "" (none), a scheduler name, or "unknown"
(no KubeRay found, several that disagree, a config file not readable, or the chart watching
only some namespaces, where listing every Deployment may be forbidden): then the operator does
not check jobs against it.
*/}}
{{- define "ppojob-operator.kuberayBatchScheduler" -}}
{{- $kr := .Values.kuberay | default dict -}}
{{- $bs := $kr.batchScheduler | default "" -}}
{{- if ne $bs "auto" -}}
{{- $bs -}}
{{- else if .Values.watchNamespaces -}}
unknown
{{- else -}}
{{- $found := dict -}}
{{- $deps := lookup "apps/v1" "Deployment" "" "" | default dict -}}
{{- range $d := $deps.items | default list -}}
{{- $labels := $d.metadata.labels | default dict -}}
{{- if or (eq $d.metadata.name "kuberay-operator") (eq (get $labels "app.kubernetes.io/name") "kuberay-operator") -}}
{{- $containers := $d.spec.template.spec.containers | default list -}}
{{- $c := first $containers -}}
{{- range $containers -}}{{- if eq .name "kuberay-operator" -}}{{- $c = . -}}{{- end -}}{{- end -}}
{{- $args := concat ($c.command | default list) ($c.args | default list) -}}
{{- $name := "" -}}{{- $config := "" -}}{{- $next := "" -}}
{{- range $a := $args -}}
{{- $a = toString $a -}}
{{- if eq $next "batch" -}}{{- $name = $a -}}{{- $next = "" -}}
{{- else if eq $next "config" -}}{{- $config = $a -}}{{- $next = "" -}}
{{- else if or (eq $a "--batch-scheduler") (eq $a "-batch-scheduler") -}}{{- $next = "batch" -}}
{{- else if or (eq $a "--config") (eq $a "-config") -}}{{- $next = "config" -}}
{{- else if regexMatch "^--?batch-scheduler=" $a -}}{{- $name = regexReplaceAll "^--?batch-scheduler=" $a "" -}}
{{- else if regexMatch "^--?config=" $a -}}{{- $config = regexReplaceAll "^--?config=" $a "" -}}
{{- else if regexMatch "^--?enable-batch-scheduler(=(true|1|t|T|TRUE|True))?$" $a -}}{{- $name = "volcano" -}}
{{- end -}}
{{- end -}}
{{- if $config -}}
{{- /* KubeRay ignores its other flags when it has a config file */ -}}
{{- $name = "unknown" -}}
{{- range $m := $c.volumeMounts | default list -}}
{{- if eq (dir $config) (trimSuffix "/" $m.mountPath) -}}
{{- range $v := $d.spec.template.spec.volumes | default list -}}
{{- if and (eq $v.name $m.name) $v.configMap -}}
{{- $cm := lookup "v1" "ConfigMap" $d.metadata.namespace $v.configMap.name | default dict -}}
{{- $text := get ($cm.data | default dict) (base $config) -}}
{{- if $text -}}
{{- $cfg := fromYaml $text -}}
{{- $name = $cfg.batchScheduler | default "" -}}
{{- if $cfg.enableBatchScheduler -}}{{- $name = "volcano" -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $_ := set $found (printf "v:%s" $name) true -}}
{{- end -}}
{{- end -}}
{{- if eq (len $found) 1 -}}
{{- trimPrefix "v:" (first (keys $found)) -}}
{{- else -}}
unknown
{{- end -}}
{{- end -}}
{{- end -}}
