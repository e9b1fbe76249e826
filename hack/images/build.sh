#!/usr/bin/env bash
# Build the project's two images on a machine with no container registry and no Docker engine,
# from the Dockerfiles users build (images/*.Dockerfile), for the real-node tests
# (tests/cluster/realnode/):
#
#   1. a Debian root filesystem made by debootstrap from this machine's own apt source (the
#      first URI of /etc/apt/sources.list.d/*.sources or /etc/apt/sources.list; no host name is
#      written here), committed as the local image localhost/ppojob-base:<suite>-<key>;
#   2. each Dockerfile built by buildah (no daemon) with that image as its base-image argument;
#   3. the node's sandbox image, from hack/node/pause.c.
# The images stay in buildah's store (no archive on disk: the trainer image is about 7 GB); the
# node's containerd imports each one it lacks through a pipe (`buildah push ... docker-archive:
# /dev/stdout | ctr images import -`, tests/helpers/realnode.py).
#
# Everything is cached by content hash: the root filesystem's tar under
# ${PPOJOB_IMAGE_CACHE:-$XDG_CACHE_HOME/ppojob/images} by the debootstrap inputs; each image as a
# tag in buildah's store whose key hashes its Dockerfile, the base's key and every file the build
# copies (pyproject.toml, constraints, locks/, hack/lock.py, api/ cli/ operator/ trainer/ sources); older tags of an
# image are removed. A warm run hashes files and exits. Prints `NAME=localhost/ppojob-NAME:KEY`
# lines on stdout, one per image.
#
# Usage: hack/images/build.sh [pause] [operator] [trainer]   (none = all three). Needs root, debootstrap and
# buildah (Debian packages); network to the apt source and PyPI at build time only.
set -euo pipefail

root_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cache="${PPOJOB_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ppojob/images}"
suite="${PPOJOB_BASE_SUITE:-bookworm}"
log() { echo "[images $(date +%H:%M:%S)] $*" >&2; }
die() {
  echo "hack/images/build.sh: $*" >&2
  exit 1
}

[ "$(id -u)" = 0 ] || die "needs root (debootstrap and buildah's rootful storage); run it as root"
for tool in debootstrap buildah; do
  command -v "$tool" >/dev/null || die "$tool is missing: apt-get install $tool"
done

# The machine's own Debian mirror: the first deb URI its apt configuration names.
apt_mirror() {
  local f uri
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    uri="$(sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*\).*/\1/p' "$f" | head -n1)"
    [ -n "$uri" ] && echo "$uri" && return 0
  done
  uri="$(sed -n 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]*\).*/\2/p' \
    /etc/apt/sources.list 2>/dev/null | head -n1)"
  [ -n "$uri" ] && echo "$uri" && return 0
  die "no Debian apt source in /etc/apt/sources.list(.d): cannot make the base image"
}

# Packages of the base: Python 3.11 (Debian 12's), venv, and what both Dockerfiles run.
base_packages=python3,python3-venv,python-is-python3,ca-certificates,procps

# The Debian root filesystem, as a tar archive (cached by the debootstrap inputs).
rootfs_tar() {
  local key tar rootfs
  key="$(printf '%s\n' "$suite" "$base_packages" "$(declare -f rootfs_tar)" | sha256sum | cut -c1-12)"
  tar="$cache/base-$suite-$key.tar"
  if [ ! -s "$tar" ]; then
    rootfs="$(mktemp -d "$cache/rootfs.XXXXXX")"
    log "debootstrap $suite ($base_packages) from the machine's apt source"
    debootstrap --variant=minbase --include="$base_packages" "$suite" "$rootfs" "$(apt_mirror)" \
      >"$cache/debootstrap.log" 2>&1 || {
      rm -rf "$rootfs"
      die "debootstrap failed: see $cache/debootstrap.log"
    }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" --numeric-owner -cf "$tar.tmp" .
    rm -rf "$rootfs"
    mv "$tar.tmp" "$tar"
  fi
  echo "$tar"
}

# The base image: that root filesystem, plus the certificate authorities this machine trusts
# (an egress proxy may re-sign TLS: the builds inside fetch from the apt source and PyPI the way
# the machine does), pip and requests pointed at the system bundle (a venv's pip uses its own).
base_image() {
  local tar key tag ctr f
  tar="$(rootfs_tar)"
  key="$( (echo "$tar" && declare -f base_image && cat /etc/ssl/certs/ca-certificates.crt) |
    sha256sum | cut -c1-12)"
  tag="localhost/ppojob-base:$suite-$key"
  if buildah inspect --type image "$tag" >/dev/null 2>&1; then
    echo "$tag"
    return 0
  fi
  ctr="$(buildah from scratch)"
  buildah add --quiet "$ctr" "$tar" / >/dev/null
  for f in /usr/local/share/ca-certificates/*.crt; do
    [ -f "$f" ] && buildah copy --quiet "$ctr" "$f" /usr/local/share/ca-certificates/ >/dev/null
  done
  buildah copy --quiet "$ctr" /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    --env REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
    --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    --cmd /bin/bash "$ctr"
  buildah commit --quiet --rm "$ctr" "$tag" >/dev/null
  echo "$tag"
}

# The key of an image: its Dockerfile, the base's tag, its build arguments and the files it copies.
image_key() {
  local dockerfile="$1" base="$2"
  shift 2
  {
    echo "$base $*"
    cat "$root_dir/$dockerfile"
    (cd "$root_dir" && git ls-files -co --exclude-standard -- pyproject.toml \
      constraints.txt constraints-gpu.txt locks hack/lock.py api cli operator trainer | LC_ALL=C sort |
      while read -r f; do [ -f "$f" ] && sha256sum "$f"; done)
  } | sha256sum | cut -c1-12
}

# Older builds of image $1 (tags other than $2), and the layers only they used. The layer cache
# of the current build stays (a rebuild after a source change reuses the dependency layer).
prune() {
  buildah images --format '{{.Name}}:{{.Tag}}' 2>/dev/null | grep "^localhost/ppojob-$1:" |
    grep -v ":$2\$" | xargs -r buildah rmi >/dev/null 2>&1 || true
  rm -f "$cache/$1"-*.build.log.old
}

# Working containers a killed `buildah bud` left behind (each holds what its step wrote: the
# trainer's dependency step is about 6 GB; a failed build removes its own: --force-rm). Ours are
# bud's "<image id>-working-container"s whose image is one of our tags or an untagged
# intermediate (buildah prints no name for it); this runs under the build lock. (A killed base
# or pause build leaves a small "working-container" of scratch: left alone, it may not be ours.)
remove_stale_containers() {
  local id image name
  buildah containers --format '{{.ContainerID}} {{.ContainerName}} {{.ImageName}}' 2>/dev/null |
    while read -r id name image; do
      case "$name:$image" in
      *-working-container:localhost/ppojob-* | *-working-container:)
        buildah rm "$id" >/dev/null 2>&1 || true
        ;;
      esac
    done
}

# Free space (GiB) in buildah's store. Building an image holds what its largest step writes twice
# (the working container, then the committed layer): need_gib is that, plus 1 GiB of slack.
free_gib() {
  local dir
  dir="$(buildah info --format '{{.store.GraphRoot}}' 2>/dev/null || echo /var/lib/containers/storage)"
  mkdir -p "$dir"
  df -P -B1 "$dir" | awk 'NR == 2 { print int($4 / 2^30) }'
}
need_gib() {
  case "$1" in
  trainer) echo 15 ;; # its dependency step writes about 6.5 GB (PyPI's torch carries CUDA)
  *) echo 2 ;;
  esac
}

build_image() {
  local name="$1" dockerfile="$2" base="$3"
  shift 3
  local key tag need free
  key="$(image_key "$dockerfile" "$base" "$@")"
  tag="localhost/ppojob-$name:$key"
  if ! buildah inspect --type image "$tag" >/dev/null 2>&1; then
    need="$(need_gib "$name")"
    free="$(free_gib)"
    if [ "$free" -lt "$need" ]; then
      # older builds go first (their layer cache with them: the dependency layer is built
      # again, and the node imports it whole) when the disk is short
      log "$name: $free GiB free, building needs about $need GiB: removing older builds first" \
        "(their layer cache too)"
      prune "$name" "$key"
      free="$(free_gib)"
      [ "$free" -ge "$need" ] || die "building $name needs about $need GiB free in buildah's store \
($(buildah info --format '{{.store.GraphRoot}}' 2>/dev/null)), $free GiB is: free disk space \
(buildah rmi --prune drops unused images; rm -rf ~/.cache/ppojob/node/containerd empties the node's image cache when no test runs)"
    fi
    log "$name: buildah bud -f $dockerfile ($*)"
    local t0=$SECONDS
    # docker format: the Dockerfiles' SHELL (bash, pipefail) is kept, as `docker build` keeps it
    buildah bud --quiet --layers --force-rm --format docker --network=host -f "$root_dir/$dockerfile" -t "$tag" "$@" \
      "$root_dir" >"$cache/$name.build.log" 2>&1 || {
      tail -n 20 "$cache/$name.build.log" >&2
      die "building $name failed: see $cache/$name.build.log"
    }
    log "$name: built in $((SECONDS - t0)) s, $(buildah images --format '{{.Size}}' "$tag")"
    prune "$name" "$key"
  fi
  echo "$name=$tag"
}

# The sandbox image: hack/node/pause.c, static, alone in the image.
pause_image() {
  local key tag ctr bin
  key="$( (sha256sum <"$root_dir/hack/node/pause.c" && declare -f pause_image) | sha256sum | cut -c1-12)"
  tag="localhost/ppojob-pause:$key"
  if ! buildah inspect --type image "$tag" >/dev/null 2>&1; then
    command -v gcc >/dev/null || die "gcc is missing (builds the pause binary): apt-get install gcc libc6-dev"
    bin="$(mktemp -d "$cache/pause.XXXXXX")"
    gcc -Os -static -o "$bin/pause" "$root_dir/hack/node/pause.c"
    strip "$bin/pause"
    ctr="$(buildah from scratch)"
    buildah copy --quiet "$ctr" "$bin/pause" /pause >/dev/null
    buildah config --entrypoint '["/pause"]' --user 65535:65535 "$ctr"
    buildah commit --quiet --rm "$ctr" "$tag" >/dev/null
    rm -rf "$bin"
    prune pause "$key"
  fi
  echo "pause=$tag"
}

main() {
  local want=("$@") base
  [ ${#want[@]} -gt 0 ] || want=(pause operator trainer)
  mkdir -p "$cache"
  exec 9>"$cache/.build.lock"
  flock 9
  remove_stale_containers
  for name in "${want[@]}"; do
    case "$name" in
    pause) pause_image ;;
    *) base="${base:-$(base_image)}" ;;
    esac
    case "$name" in
    pause) ;;
    operator) build_image operator images/operator.Dockerfile "$base" \
      --build-arg "PYTHON_IMAGE=$base" ;;
    trainer) build_image trainer images/trainer.Dockerfile "$base" \
      --build-arg "BASE_IMAGE=$base" --build-arg EXTRAS=trainer,trackers ;;
    *) die "unknown image $name (pause, operator or trainer)" ;;
    esac
  done
}

main "$@"
