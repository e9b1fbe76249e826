#!/usr/bin/env bash
# Build the real control plane the cluster tests run on, from Go modules, at the versions pinned
# in versions.env: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the
# scheduler-plugins scheduler (Coscheduling gang plugin), the KubeRay operator and KWOK.
#
# Binaries and the upstream CRDs land in
#   ${PPOJOB_CONTROL_PLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ppojob/control-plane}/<key>/
# where <key> is a hash of versions.env, so a warm run (everything present) only
# hashes two files. Prints that directory on stdout as its last line.
#
# Needs Go >= 1.26 and the Go module proxy (first run downloads ~1 GiB of modules).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"

key="$(sha256sum <"$here/versions.env" | cut -c1-16)"
root="${PPOJOB_CONTROL_PLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ppojob/control-plane}"
out="$root/$key"
bin="$out/bin"
binaries=(etcd kube-apiserver kube-controller-manager kube-scheduler kube-scheduler-plugins
  kuberay-operator kwok)

complete() {
  local b
  for b in "${binaries[@]}"; do [ -x "$bin/$b" ] || return 1; done
  [ -s "$out/kwok-stages.yaml" ] && [ -s "$out/crds/kuberay/ray.io_rayjobs.yaml" ] &&
    [ -s "$out/crds/scheduler-plugins/scheduling.x-k8s.io_podgroups.yaml" ]
}

log() { echo "[control-plane $(date +%H:%M:%S)] $*" >&2; }

export GOFLAGS="-mod=mod"
export CGO_ENABLED=0
# Two cores: at most two compiles at a time.
buildflags=(-p "${GO_BUILD_PARALLEL:-2}" -trimpath)

# A fresh wrapper module in $out/src/$1; the caller adds requirements and replacements.
wrapper() {
  local dir="$out/src/$1"
  rm -rf "$dir"
  mkdir -p "$dir"
  (cd "$dir" && go mod init "ppojob.local/control-plane/$1" >/dev/null 2>&1 && go mod edit -go=1.26.0)
  echo "$dir"
}

# Where the module cache holds MODULE@VERSION (downloading it if needed).
moddir() { go mod download -json "$1@$2" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p'; }

build_etcd() {
  [ -x "$bin/etcd" ] && return 0
  log "etcd $ETCD_VERSION"
  local dir
  dir="$(wrapper etcd)"
  (cd "$dir" && go mod edit -require="$ETCD_MODULE@$ETCD_VERSION" &&
    go build "${buildflags[@]}" -ldflags "-s -w" -o "$bin/etcd" "$ETCD_MODULE")
}

build_kube() {
  if [ -x "$bin/kube-apiserver" ] && [ -x "$bin/kube-controller-manager" ] &&
    [ -x "$bin/kube-scheduler" ] && [ -x "$bin/kube-scheduler-plugins" ]; then
    crds_scheduler_plugins
    return 0
  fi
  log "k8s.io/kubernetes $KUBERNETES_VERSION + scheduler-plugins $SCHEDULER_PLUGINS_VERSION"
  local dir kmod
  dir="$(wrapper kube)"
  kmod="$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" | sed -n 's/^\t"GoMod": "\(.*\)",$/\1/p')"
  # scheduler-plugins requires a later k8s.io/kubernetes patch release than the module proxy
  # serves whole; the replacement pins the one in versions.env (same minor, same APIs).
  local edits=(-require="k8s.io/kubernetes@$KUBERNETES_VERSION"
    -replace="k8s.io/kubernetes=k8s.io/kubernetes@$KUBERNETES_VERSION"
    -require="sigs.k8s.io/scheduler-plugins@$SCHEDULER_PLUGINS_VERSION")
  # Every staging module k8s.io/kubernetes replaces with ./staging/src/k8s.io/<name>.
  local m
  for m in $(sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/src/.*#\1#p' "$kmod"); do
    edits+=(-replace="$m=$m@$KUBERNETES_STAGING_VERSION")
  done
  (cd "$dir" && go mod edit "${edits[@]}")
  local minor="${KUBERNETES_VERSION#v1.}"
  minor="${minor%%.*}"
  local ld="-s -w -X k8s.io/component-base/version.gitVersion=$KUBERNETES_VERSION"
  ld+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
  ld+=" -X k8s.io/component-base/version.gitTreeState=clean"
  ld+=" -X k8s.io/client-go/pkg/version.gitVersion=$KUBERNETES_VERSION"
  local c
  for c in kube-apiserver kube-controller-manager kube-scheduler; do
    [ -x "$bin/$c" ] && continue
    log "  $c"
    (cd "$dir" && go build "${buildflags[@]}" -ldflags "$ld" -o "$bin/$c" "k8s.io/kubernetes/cmd/$c")
  done
  if [ ! -x "$bin/kube-scheduler-plugins" ]; then
    log "  scheduler-plugins scheduler"
    (cd "$dir" && go build "${buildflags[@]}" -ldflags "$ld" -o "$bin/kube-scheduler-plugins" \
      sigs.k8s.io/scheduler-plugins/cmd/scheduler)
  fi
  crds_scheduler_plugins
}

# The PodGroup CRD of the Coscheduling plugin, from the same module.
crds_scheduler_plugins() {
  local f="$out/crds/scheduler-plugins/scheduling.x-k8s.io_podgroups.yaml"
  [ -s "$f" ] && return 0
  mkdir -p "$(dirname "$f")"
  cp "$(moddir sigs.k8s.io/scheduler-plugins "$SCHEDULER_PLUGINS_VERSION")/config/crd/bases/$(basename "$f")" "$f.tmp"
  chmod u+w "$f.tmp"
  mv "$f.tmp" "$f"
}

build_kuberay() {
  if [ -x "$bin/kuberay-operator" ]; then
    crds_kuberay
    return 0
  fi
  log "KubeRay ray-operator $KUBERAY_VERSION"
  local dir mod=github.com/ray-project/kuberay/ray-operator
  dir="$(wrapper kuberay)"
  (cd "$dir" && go mod edit -require="$mod@$KUBERAY_VERSION" &&
    go build "${buildflags[@]}" -ldflags "-s -w" -o "$bin/kuberay-operator" "$mod")
  crds_kuberay
}

# KubeRay's CRDs (RayCluster, RayJob, RayService) from the same module.
crds_kuberay() {
  [ -s "$out/crds/kuberay/ray.io_rayjobs.yaml" ] && return 0
  local src
  src="$(moddir github.com/ray-project/kuberay/ray-operator "$KUBERAY_VERSION")"
  mkdir -p "$out/crds/kuberay.tmp"
  cp "$src"/config/crd/bases/*.yaml "$out/crds/kuberay.tmp/"
  chmod u+w "$out/crds/kuberay.tmp/"*
  rm -rf "$out/crds/kuberay"
  mv "$out/crds/kuberay.tmp" "$out/crds/kuberay"
}

build_kwok() {
  [ -x "$bin/kwok" ] && [ -s "$out/kwok-stages.yaml" ] && return 0
  log "KWOK $KWOK_VERSION"
  local dir src
  if [ ! -x "$bin/kwok" ]; then
    dir="$(wrapper kwok)"
    (cd "$dir" && go mod edit -require="sigs.k8s.io/kwok@$KWOK_VERSION" &&
      go build "${buildflags[@]}" -ldflags "-s -w" -o "$bin/kwok" sigs.k8s.io/kwok/cmd/kwok)
  fi
  # KWOK's own "fast" stages: nodes become Ready and keep a heartbeat; pods bound to a node become
  # Running/Ready at once, complete when owned by a Job, and go away when deleted (no kubelet).
  src="$(moddir sigs.k8s.io/kwok "$KWOK_VERSION")/kustomize/stage"
  local f
  for f in node/fast/node-initialize.yaml node/heartbeat/node-heartbeat.yaml \
    pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    echo "---"
    cat "$src/$f"
  done >"$out/kwok-stages.yaml.tmp"
  mv "$out/kwok-stages.yaml.tmp" "$out/kwok-stages.yaml"
}

main() {
  if complete; then
    echo "$out"
    return 0
  fi
  command -v go >/dev/null || {
    echo "build.sh: Go (>= 1.26) is needed to build the control plane" >&2
    return 1
  }
  mkdir -p "$bin" "$out/src" "$out/crds"
  local components=("$@") c
  [ ${#components[@]} -gt 0 ] || components=(etcd kube kuberay kwok)
  for c in "${components[@]}"; do "build_$c"; done
  if [ $# -eq 0 ] && ! complete; then
    echo "build.sh: something is missing in $out after the build" >&2
    return 1
  fi
  log "done: $out"
  echo "$out"
}

# One line: bash has read all of it before running, so editing this file mid-build is safe.
main "$@"; exit $?
