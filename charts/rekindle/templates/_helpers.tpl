{{/*
Chart name, truncated to the 63 characters a label value may hold.
*/}}
{{- define "rekindle.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Fully qualified name of the release's objects.
*/}}
{{- define "rekindle.fullname" -}}
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

{{/*
Selector labels (stable across upgrades).
*/}}
{{- define "rekindle.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rekindle.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/*
Common labels.
*/}}
{{- define "rekindle.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "rekindle.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: nri-plugin
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/*
Plugin image; the tag defaults to the chart's appVersion.
*/}}
{{- define "rekindle.image" -}}
{{- printf "%s:%s" .Values.image.name (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
NRI plugin index, zero-padded to two digits.
*/}}
{{- define "rekindle.index" -}}
{{- printf "%02d" (int .Values.nri.plugin.index) -}}
{{- end -}}

{{- define "rekindle.hmacSecretName" -}}
{{- default (printf "%s-hmac" (include "rekindle.fullname" .)) .Values.hmac.existingSecret -}}
{{- end -}}

{{- define "rekindle.storeClaimName" -}}
{{- default (printf "%s-store" (include "rekindle.fullname" .)) .Values.store.pvc.name -}}
{{- end -}}

{{- define "rekindle.storePath" -}}
{{- printf "%s/store" (trimSuffix "/" .Values.stateDir) -}}
{{- end -}}

{{/*
The plugin container's own mounts (not hostBindSources), as JSON: mount path -> what it is.
validate.yaml refuses a hostBindSources entry that repeats one (a duplicate mountPath). Every
mount added to the plugin container belongs here too: tests/unit/test_chart.py checks it.
*/}}
{{- define "rekindle.chartMounts" -}}
{{- $m := dict -}}
{{- $_ := set $m "/var/run/nri" "the NRI socket dir (nri.socketDir)" -}}
{{- $_ = set $m (trimSuffix "/" .Values.containerd.stateDir) "containerd.stateDir" -}}
{{- $_ = set $m (trimSuffix "/" .Values.containerd.rootDir) "containerd.rootDir" -}}
{{- $_ = set $m "/host/proc" "the host's /proc" -}}
{{- $_ = set $m "/sys/fs/cgroup" "the cgroup filesystem" -}}
{{- $_ = set $m (trimSuffix "/" .Values.stateDir) "stateDir" -}}
{{- $_ = set $m (include "rekindle.storePath" .) "the artifact store (<stateDir>/store)" -}}
{{- $_ = set $m "/etc/rekindle" "the HMAC key Secret" -}}
{{- toJson $m -}}
{{- end -}}

{{- define "rekindle.serviceAccountName" -}}
{{- include "rekindle.fullname" . -}}
{{- end -}}

{{/*
Bytes of a Kubernetes quantity ("4Gi", "8G", "9.5Gi", "1e12", a number) or of a size setting (a
subset), as a float; validate.yaml compares the node cache with the memory limit with it.
*/}}
{{- define "rekindle.bytes" -}}
{{- $q := trimPrefix "+" (toString .) -}}
{{- $unit := regexFind "(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)$" $q -}}
{{- $scale := dict "" 1 "m" 0.001 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 "Ei" 1152921504606846976 -}}
{{- mulf (float64 (trimSuffix $unit $q)) (get $scale $unit) -}}
{{- end -}}
