{{/*
The chart's names and labels, the config the pods run, and the checks that refuse a release
that would not work (each fails the render with the value to change).
*/}}

{{- define "tidegate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's objects' name: the release name, with the chart's added unless it has it. */}}
{{- define "tidegate.fullname" -}}
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

{{- define "tidegate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tidegate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tidegate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tidegate.labels" -}}
helm.sh/chart: {{ include "tidegate.chart" . }}
{{ include "tidegate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "tidegate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tidegate.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tidegate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The port /metrics answers on: the admin listener's, or the public one without it. */}}
{{- define "tidegate.metricsPort" -}}
{{- if .Values.admin.enabled }}{{ .Values.admin.port }}{{ else }}{{ .Values.service.containerPort }}{{ end -}}
{{- end -}}

{{/* Longer than the preStop pause plus the drain: the kubelet's SIGKILL comes only after both. */}}
{{- define "tidegate.terminationGracePeriodSeconds" -}}
{{- $floor := add .Values.preStopSeconds .Values.drainSeconds -}}
{{- $grace := get .Values "terminationGracePeriodSeconds" -}}
{{- if $grace -}}
{{- if le (int64 $grace) $floor -}}
{{- fail (printf "terminationGracePeriodSeconds (%d) must be longer than preStopSeconds + drainSeconds (%d), or Kubernetes kills the pod mid-drain" (int64 $grace) $floor) -}}
{{- end -}}
{{- int64 $grace -}}
{{- else -}}
{{- add $floor 10 -}}
{{- end -}}
{{- end -}}

{{/*
The files mounted from existing Secrets, as a list of {secret, key}: the API keys, the admin keys
(with the admin listener), each provider's key and the password file. The file is named by its
key, so two files with the same key are refused.
*/}}
{{- define "tidegate.secretFiles" -}}
{{- $files := list -}}
{{- $ref := .Values.secrets.apiKeys -}}
{{- $files = append $files (dict "secret" (required "secrets.apiKeys.existingSecret: name the existing Secret that holds the API keys file (auth.keys_file; the production profile needs one)" $ref.existingSecret) "key" $ref.key) -}}
{{- if .Values.admin.enabled -}}
{{- $ref = .Values.secrets.adminKeys -}}
{{- $files = append $files (dict "secret" (required "secrets.adminKeys.existingSecret: name the existing Secret that holds the admin keys file (auth.admin_keys_file), or set admin.enabled: false" $ref.existingSecret) "key" $ref.key) -}}
{{- end -}}
{{- range $provider, $ref := .Values.secrets.providerKeys -}}
{{- $files = append $files (dict "secret" (required (printf "secrets.providerKeys.%s.existingSecret: name the existing Secret that holds its API key" $provider) $ref.existingSecret) "key" $ref.key) -}}
{{- end -}}
{{- if .Values.state.pgpass.existingSecret -}}
{{- $files = append $files (dict "secret" .Values.state.pgpass.existingSecret "key" .Values.state.pgpass.key) -}}
{{- end -}}
{{- $seen := list -}}
{{- range $files -}}
{{- if has .key $seen -}}
{{- fail (printf "two secret files are both named %q under secrets.mountPath: give their keys different names" .key) -}}
{{- end -}}
{{- $seen = append $seen .key -}}
{{- end -}}
{{- toYaml (dict "files" $files) -}}
{{- end -}}

{{/*
The tidegate config: .Values.config with the keys that must agree with the pod set from the
other values. Setting one of those in .Values.config fails the render, naming the value to set.
*/}}
{{- define "tidegate.config" -}}
{{- $config := deepCopy .Values.config -}}
{{- $managed := dict
  "server.host" "nothing (the chart binds every interface, for the probes)"
  "server.port" "service.containerPort"
  "server.drain_seconds" "drainSeconds"
  "server.admin_host" "admin.enabled"
  "server.admin_port" "admin.port"
  "auth.keys_file" "secrets.apiKeys"
  "auth.admin_keys_file" "secrets.adminKeys"
  "state.url" "state.url or state.urlSecret"
  "state.fast_url" "state.fastUrl or state.fastUrlSecret" -}}
{{- range $path, $instead := $managed -}}
{{- $parts := splitList "." $path -}}
{{- if hasKey (get $config (first $parts) | default (dict)) (last $parts) -}}
{{- fail (printf "config.%s is set by the chart: set %s instead" $path $instead) -}}
{{- end -}}
{{- end -}}
{{- range $section := list "server" "auth" "state" "providers" -}}
{{- if not (get $config $section) -}}
{{- $_ := set $config $section (dict) -}}
{{- end -}}
{{- end -}}
{{- $mount := trimSuffix "/" .Values.secrets.mountPath -}}
{{- $server := $config.server -}}
{{- $_ := set $server "host" "0.0.0.0" -}}
{{- $_ = set $server "port" .Values.service.containerPort -}}
{{- $_ = set $server "drain_seconds" .Values.drainSeconds -}}
{{- if .Values.admin.enabled -}}
{{- if eq (int64 .Values.admin.port) (int64 .Values.service.containerPort) -}}
{{- fail (printf "admin.port (%d) must differ from service.containerPort" (int64 .Values.admin.port)) -}}
{{- end -}}
{{- $_ = set $server "admin_host" "0.0.0.0" -}}
{{- $_ = set $server "admin_port" .Values.admin.port -}}
{{- $_ = set $config.auth "admin_keys_file" (printf "%s/%s" $mount .Values.secrets.adminKeys.key) -}}
{{- end -}}
{{- $_ = set $config.auth "keys_file" (printf "%s/%s" $mount .Values.secrets.apiKeys.key) -}}
{{- range $name, $ref := .Values.secrets.providerKeys -}}
{{- $provider := get $config.providers $name -}}
{{- if not $provider -}}
{{- fail (printf "secrets.providerKeys.%s: config.providers has no provider %s" $name $name) -}}
{{- end -}}
{{- if hasKey $provider "api_key_file" -}}
{{- fail (printf "config.providers.%s.api_key_file is set by the chart: set secrets.providerKeys.%s instead" $name $name) -}}
{{- end -}}
{{- $_ = set $provider "api_key_file" (printf "%s/%s" $mount $ref.key) -}}
{{- end -}}
{{- if not (or .Values.state.url .Values.state.urlSecret.name) -}}
{{- fail "state: set state.url or state.urlSecret (the durable store several replicas share)" -}}
{{- end -}}
{{- if and .Values.state.url (not .Values.state.urlSecret.name) -}}
{{- $_ = set $config.state "url" .Values.state.url -}}
{{- end -}}
{{- if and .Values.state.fastUrl (not .Values.state.fastUrlSecret.name) -}}
{{- $_ = set $config.state "fast_url" .Values.state.fastUrl -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}
