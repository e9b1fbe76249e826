#!/usr/bin/env bash
# Build the real control plane the cluster tests run on, from Go modules, at the versions pinned
# in versions.env: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the
# scheduler-plugins scheduler (Coscheduling gang plugin), the KubeRay operator, KWOK and Kueue.
#
# Each component is cached on its own, under
#   $root/components/<component>-<key>/
# where $root is ${PPOJOB_CONTROL_PLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ppojob/control-plane}
# and <key> hashes only the versions that component is built from and the text of its build
# function: adding or bumping one component rebuilds that one alone. The tests read one directory,
#   $root/<key of all component keys>/   (bin/, crds/, kwok-stages.yaml, kueue/)
# made of symbolic links into the component directories. A warm run (everything present) only
# hashes a few strings. Prints that directory on stdout as its last line.
#
# Usage: build.sh [component...]   (components: etcd kubernetes scheduler-plugins kuberay kwok
# kueue; none = all, then the combined directory is assembled too)
#
# Needs Go >= 1.26 and the Go module proxy (the first run downloads over 1 GiB of modules).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"

root="${PPOJOB_CONTROL_PLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ppojob/control-plane}"
all=(etcd kubernetes scheduler-plugins kuberay kwok kueue node)

# The versions.env variables each component is built from.
versions_of() {
  case "$1" in
  etcd) echo "$ETCD_MODULE $ETCD_VERSION" ;;
  kubernetes) echo "$KUBERNETES_VERSION $KUBERNETES_STAGING_VERSION" ;;
  scheduler-plugins) echo "$KUBERNETES_VERSION $KUBERNETES_STAGING_VERSION $SCHEDULER_PLUGINS_VERSION" ;;
  kuberay) echo "$KUBERAY_VERSION" ;;
  kwok) echo "$KWOK_VERSION" ;;
  kueue) echo "$KUEUE_VERSION" ;;
  node) echo "$KUBERNETES_VERSION $KUBERNETES_STAGING_VERSION $COREDNS_VERSION" ;;
  *) return 1 ;;
  esac
}

# What each component leaves in its directory (checked before it is marked complete).
products_of() {
  case "$1" in
  etcd) echo bin/etcd ;;
  kubernetes) echo bin/kube-apiserver bin/kube-controller-manager bin/kube-scheduler ;;
  scheduler-plugins)
    echo bin/kube-scheduler-plugins crds/scheduler-plugins/scheduling.x-k8s.io_podgroups.yaml
    ;;
  kuberay) echo bin/kuberay-operator crds/kuberay/ray.io_rayjobs.yaml ;;
  kwok) echo bin/kwok kwok-stages.yaml ;;
  kueue)
    echo bin/kueue kueue/crds/kueue.x-k8s.io_workloads.yaml kueue/webhooks.yaml \
      kueue/crd-conversion/webhook_in_workloads.yaml
    ;;
  node) echo bin/kubelet bin/kube-proxy bin/coredns ;;
  esac
}

# A component's key: its versions and the text of the functions that build it.
key_of() {
  local fns=("build_${1//-/_}" wrapper moddir copy_into)
  case "$1" in kubernetes | scheduler-plugins | node) fns+=(kube_wrapper kube_ldflags) ;; esac
  { versions_of "$1" && declare -f "${fns[@]}"; } | sha256sum | cut -c1-16
}

all_done() {
  local c
  for c in "${all[@]}"; do done_of "$c" || return 1; done
}
dir_of() { echo "$root/components/$1-$(key_of "$1")"; }
done_of() { [ -f "$(dir_of "$1")/.complete" ]; }

log() { echo "[control-plane $(date +%H:%M:%S)] $*" >&2; }

export GOFLAGS="-mod=mod"
export CGO_ENABLED=0
# Two cores: at most two compiles at a time (GO_BUILD_PARALLEL=1 beside other heavy work).
buildflags=(-p "${GO_BUILD_PARALLEL:-2}" -trimpath)

# A fresh wrapper module in $2/src; the caller adds requirements and replacements.
wrapper() {
  local dir="$2/src"
  rm -rf "$dir"
  mkdir -p "$dir"
  (cd "$dir" && go mod init "ppojob.local/control-plane/$1" >/dev/null 2>&1 && go mod edit -go=1.26.0)
  echo "$dir"
}

# A wrapper module for binaries of k8s.io/kubernetes: it requires $KUBERNETES_VERSION and
# replaces every staging module k8s.io/kubernetes points at ./staging/src/k8s.io/<name> with the
# matching $KUBERNETES_STAGING_VERSION release. Prints the module's directory.
kube_wrapper() {
  local dir kmod m
  dir="$(wrapper "$1" "$2")"
  kmod="$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" | sed -n 's/^\t"GoMod": "\(.*\)",$/\1/p')"
  local edits=(-require="k8s.io/kubernetes@$KUBERNETES_VERSION"
    -replace="k8s.io/kubernetes=k8s.io/kubernetes@$KUBERNETES_VERSION")
  for m in $(sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/src/.*#\1#p' "$kmod"); do
    edits+=(-replace="$m=$m@$KUBERNETES_STAGING_VERSION")
  done
  (cd "$dir" && go mod edit "${edits[@]}")
  echo "$dir"
}

# -ldflags of the Kubernetes binaries (their version, as `--version` and /version report it).
kube_ldflags() {
  local minor="${KUBERNETES_VERSION#v1.}"
  minor="${minor%%.*}"
  local ld="-s -w -X k8s.io/component-base/version.gitVersion=$KUBERNETES_VERSION"
  ld+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
  ld+=" -X k8s.io/component-base/version.gitTreeState=clean"
  ld+=" -X k8s.io/client-go/pkg/version.gitVersion=$KUBERNETES_VERSION"
  echo "$ld"
}

# Where the module cache holds MODULE@VERSION (downloading it if needed).
moddir() { go mod download -json "$1@$2" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p'; }

# Copy FILE... into DIR (module-cache files are read-only; ours must be writable).
copy_into() {
  local dir="$1"
  shift
  mkdir -p "$dir"
  cp "$@" "$dir/"
  chmod -R u+w "$dir"
}

# Each build_<component> DIR builds into DIR (bin/ and its other products).
build_etcd() {
  local src
  src="$(wrapper etcd "$1")"
  (cd "$src" && go mod edit -require="$ETCD_MODULE@$ETCD_VERSION" &&
    go build "${buildflags[@]}" -ldflags "-s -w" -o "$1/bin/etcd" "$ETCD_MODULE")
}

build_kubernetes() {
  local src c
  src="$(kube_wrapper kubernetes "$1")"
  for c in kube-apiserver kube-controller-manager kube-scheduler; do
    log "  $c"
    (cd "$src" && go build "${buildflags[@]}" -ldflags "$(kube_ldflags)" -o "$1/bin/$c" \
      "k8s.io/kubernetes/cmd/$c")
  done
}

build_scheduler_plugins() {
  local src
  src="$(kube_wrapper scheduler-plugins "$1")"
  # scheduler-plugins requires a later k8s.io/kubernetes patch release than the module proxy
  # serves whole; the wrapper's replacement pins the one in versions.env (same minor, same APIs).
  (cd "$src" && go mod edit -require="sigs.k8s.io/scheduler-plugins@$SCHEDULER_PLUGINS_VERSION" &&
    go build "${buildflags[@]}" -ldflags "$(kube_ldflags)" -o "$1/bin/kube-scheduler-plugins" \
      sigs.k8s.io/scheduler-plugins/cmd/scheduler)
  # the PodGroup CRD of the Coscheduling plugin, from the same module
  copy_into "$1/crds/scheduler-plugins" "$(moddir sigs.k8s.io/scheduler-plugins \
    "$SCHEDULER_PLUGINS_VERSION")/config/crd/bases/scheduling.x-k8s.io_podgroups.yaml"
}

build_kuberay() {
  local src mod=github.com/ray-project/kuberay/ray-operator
  src="$(wrapper kuberay "$1")"
  (cd "$src" && go mod edit -require="$mod@$KUBERAY_VERSION" &&
    go build "${buildflags[@]}" -ldflags "-s -w" -o "$1/bin/kuberay-operator" "$mod")
  # KubeRay's CRDs (RayCluster, RayJob, RayService) from the same module
  copy_into "$1/crds/kuberay" "$(moddir "$mod" "$KUBERAY_VERSION")"/config/crd/bases/*.yaml
}

build_kwok() {
  local src f
  src="$(wrapper kwok "$1")"
  (cd "$src" && go mod edit -require="sigs.k8s.io/kwok@$KWOK_VERSION" &&
    go build "${buildflags[@]}" -ldflags "-s -w" -o "$1/bin/kwok" sigs.k8s.io/kwok/cmd/kwok)
  # KWOK's own "fast" stages: nodes become Ready and keep a heartbeat; pods bound to a node become
  # Running/Ready at once, complete when owned by a Job, and go away when deleted (no kubelet).
  src="$(moddir sigs.k8s.io/kwok "$KWOK_VERSION")/kustomize/stage"
  for f in node/fast/node-initialize.yaml node/heartbeat/node-heartbeat.yaml \
    pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    echo "---"
    cat "$src/$f"
  done >"$1/kwok-stages.yaml"
}

build_kueue() {
  local src mod
  src="$(wrapper kueue "$1")"
  (cd "$src" && go mod edit -require="sigs.k8s.io/kueue@$KUEUE_VERSION" &&
    go build "${buildflags[@]}" \
      -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION" \
      -o "$1/bin/kueue" sigs.k8s.io/kueue/cmd/kueue)
  mod="$(moddir sigs.k8s.io/kueue "$KUEUE_VERSION")/config/components"
  # The CRDs, the webhook configurations (Services as clientConfig: the tests rewrite them to
  # URLs on 127.0.0.1) and the conversion-webhook patches that Kueue's own kustomization applies
  # to its CRDs (those not commented out in crd/kustomization.yaml).
  copy_into "$1/kueue/crds" "$mod"/crd/bases/*.yaml
  cp "$mod/webhook/manifests.yaml" "$1/kueue/webhooks.yaml"
  mkdir -p "$1/kueue/crd-conversion"
  local p
  for p in $(sed -n 's#^- path: \(patches/webhook_in_.*\.yaml\)$#\1#p' "$mod/crd/kustomization.yaml"); do
    cp "$mod/crd/$p" "$1/kueue/crd-conversion/"
  done
  chmod -R u+w "$1/kueue"
}

# The real node of tests/cluster/realnode (tests/helpers/realnode.py): the kubelet and kube-proxy
# of the same Kubernetes release, and CoreDNS with only the plugins a test cluster's DNS needs
# (kubernetes, cache, errors, log, health, ready, bind): no `forward` plugin is compiled in, so
# it cannot send a query off the machine whatever its Corefile says.
build_node() {
  local src c
  src="$(kube_wrapper node "$1")"
  for c in kubelet kube-proxy; do
    log "  $c"
    (cd "$src" && go build "${buildflags[@]}" -ldflags "$(kube_ldflags)" -o "$1/bin/$c" \
      "k8s.io/kubernetes/cmd/$c")
  done
  log "  coredns $COREDNS_VERSION"
  mkdir -p "$src/coredns"
  cat >"$src/coredns/main.go" <<'GO'
// CoreDNS for the test cluster: cluster.local from the API server, nothing forwarded.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
	"github.com/coredns/coredns/coremain"
)

func init() {
	// the order of CoreDNS's plugin.cfg, restricted to the plugins above
	dnsserver.Directives = []string{"bind", "ready", "health", "errors", "log", "cache", "kubernetes"}
}

func main() { coremain.Run() }
GO
  (cd "$src" && go mod edit -require="github.com/coredns/coredns@$COREDNS_VERSION" &&
    go build "${buildflags[@]}" -ldflags "-s -w" -o "$1/bin/coredns" ./coredns)
}

build_one() {
  local c="$1" dir p
  dir="$(dir_of "$c")"
  done_of "$c" && return 0
  log "$c $(versions_of "$c") -> $dir"
  rm -rf "$dir"
  mkdir -p "$dir/bin"
  "build_${c//-/_}" "$dir"
  for p in $(products_of "$c"); do
    [ -s "$dir/$p" ] || [ -d "$dir/$p" ] || {
      echo "build.sh: $c built no $p" >&2
      return 1
    }
  done
  rm -rf "$dir/src" # the wrapper module: go.sum only; the Go caches keep what matters
  touch "$dir/.complete"
}

# The directory the tests read: symbolic links to every component's products.
combined_dir() {
  local c keys=""
  for c in "${all[@]}"; do keys+="$c=$(key_of "$c") "; done
  echo "$root/$(echo "$keys" | sha256sum | cut -c1-16)"
}

assemble() {
  local out="$1" tmp c f rel
  tmp="$out.tmp.$$"
  rm -rf "$tmp"
  mkdir -p "$tmp"
  for c in "${all[@]}"; do
    (cd "$(dir_of "$c")" && find . -type f ! -name .complete ! -path './src/*') | while read -r f; do
      rel="${f#./}"
      mkdir -p "$tmp/$(dirname "$rel")"
      ln -s "$(dir_of "$c")/$rel" "$tmp/$rel"
    done
  done
  touch "$tmp/.complete"
  rm -rf "$out"
  mv "$tmp" "$out"
}

main() {
  local out c
  out="$(combined_dir)"
  if [ $# -eq 0 ] && [ -f "$out/.complete" ] && all_done; then
    echo "$out"
    return 0
  fi
  command -v go >/dev/null || {
    echo "build.sh: Go (>= 1.26) is needed to build the control plane" >&2
    return 1
  }
  # One build at a time per cache (two `make test` at once would remove each other's
  # half-built component directories); a waiting run then finds the other's work done.
  mkdir -p "$root"
  if command -v flock >/dev/null; then
    exec 9>"$root/.build.lock"
    flock 9
  fi
  # a build killed outright (no EXIT trap) left its caches behind; under the lock none is in use
  chmod -R u+w "$root"/go-mod.* 2>/dev/null || true
  rm -rf "$root"/go-build.* "$root"/go-mod.*
  # The compiler's cache of this build is its own, removed at the end: the binaries are what is
  # kept (components/), and a kept cache (~11 GB for the whole control plane) is disk the 7 GB
  # trainer image build needs next (it failed with "no space left on device" beside one).
  # The module cache too (2.3 GB for the whole control plane, measured on a fresh machine): a
  # component is built again only when its versions change, and then it downloads what it needs.
  # Go writes that cache read-only, so it goes by `go clean -modcache`.
  export GOCACHE="$root/go-build.$$" GOMODCACHE="$root/go-mod.$$"
  # shellcheck disable=SC2064 # expanded now: $out is local to main
  trap "go clean -modcache >/dev/null 2>&1; rm -rf '$out.tmp.$$' '$GOCACHE' '$GOMODCACHE'" EXIT
  local components=("$@")
  [ ${#components[@]} -gt 0 ] || components=("${all[@]}")
  for c in "${components[@]}"; do
    versions_of "$c" >/dev/null || {
      echo "build.sh: unknown component $c (one of ${all[*]})" >&2
      return 1
    }
    build_one "$c"
  done
  all_done || return 0 # a partial build: nothing to assemble
  assemble "$out"
  log "done: $out"
  echo "$out"
}

# One line: bash has read all of it before running, so editing this file mid-build is safe.
main "$@"; exit $?
