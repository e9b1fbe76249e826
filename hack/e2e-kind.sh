#!/usr/bin/env bash
# End-to-end test on a local kind cluster. NOT RUN IN CI: it needs Docker, kind, kubectl, helm and
# network access (Helm repositories, base images, pip), and takes 20-40 minutes.
#
# It creates a kind cluster, installs Volcano (the gang scheduler) and KubeRay configured for it,
# builds the operator image and the CPU trainer image and loads them into kind, installs this
# chart, applies the tiny CPU example (examples/ppojob-tiny.yaml, gang-scheduled by Volcano) and
# waits for the PPOJob to reach phase Succeeded.
#
#   hack/e2e-kind.sh
#   KEEP_CLUSTER=1 hack/e2e-kind.sh      # leave the cluster running afterwards
#   SKIP_BUILD=1 hack/e2e-kind.sh        # reuse images already built (hack/build-images.sh)
#   PPOJOB_E2E=1 pytest tests/e2e        # the same, from pytest
#
# Environment: CLUSTER (ppojob-e2e), KUBERAY_VERSION (1.5.1), VOLCANO_VERSION (chart version,
# empty = latest), TAG (e2e), TIMEOUT_SECONDS (2700), KIND_NODE_IMAGE (empty = kind's default).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLUSTER="${CLUSTER:-ppojob-e2e}"
KUBERAY_VERSION="${KUBERAY_VERSION:-1.5.1}"
VOLCANO_VERSION="${VOLCANO_VERSION:-}"
TAG="${TAG:-e2e}"
TIMEOUT_SECONDS="${TIMEOUT_SECONDS:-2700}"
REGISTRY="localhost/ppojob"
OPERATOR_IMAGE="$REGISTRY/ppojob-operator:$TAG"
TRAINER_IMAGE="$REGISTRY/trainer:$TAG-cpu"
NS="ppojob-e2e"
JOB="tiny-count-up"
WORK="$(mktemp -d)"

log() { printf '\n== %s\n' "$*"; }

for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null 2>&1 || { echo "error: $tool is required" >&2; exit 1; }
done

cleanup() {
  local rc=$?
  if [[ $rc -ne 0 ]]; then
    log "FAILED (exit $rc); diagnostics"
    kubectl get ppojobs,rayjobs,rayclusters,podgroups.scheduling.volcano.sh,pods -n "$NS" -o wide || true
    kubectl describe ppojob "$JOB" -n "$NS" || true
    kubectl get events -n "$NS" --sort-by=.lastTimestamp | tail -n 40 || true
    kubectl logs -n ppojob-system deployment/ppojob-ppojob-operator --tail=200 || true
    kubectl logs -n "$NS" -l ray.io/node-type=head --all-containers --tail=200 || true
  fi
  rm -rf "$WORK"
  if [[ "${KEEP_CLUSTER:-0}" != "1" ]]; then
    kind delete cluster --name "$CLUSTER" || true
  fi
  exit $rc
}
trap cleanup EXIT

log "kind cluster $CLUSTER"
if ! kind get clusters | grep -qx "$CLUSTER"; then
  kind create cluster --name "$CLUSTER" ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"} --wait 120s
fi
kubectl config use-context "kind-$CLUSTER"

if [[ "${SKIP_BUILD:-0}" != "1" ]]; then
  log "building images"
  REGISTRY="$REGISTRY" TAG="$TAG" TRAINER_VARIANT=cpu "$ROOT/hack/build-images.sh"
fi
kind load docker-image --name "$CLUSTER" "$OPERATOR_IMAGE" "$TRAINER_IMAGE"

log "Volcano"
helm repo add volcano-sh https://volcano-sh.github.io/helm-charts --force-update >/dev/null
helm upgrade --install volcano volcano-sh/volcano -n volcano-system --create-namespace \
  ${VOLCANO_VERSION:+--version "$VOLCANO_VERSION"} --wait --timeout 10m

log "KubeRay $KUBERAY_VERSION with batchScheduler.name=volcano"
helm repo add kuberay https://ray-project.github.io/kuberay-helm/ --force-update >/dev/null
helm upgrade --install kuberay-operator kuberay/kuberay-operator --version "$KUBERAY_VERSION" \
  -n kuberay-system --create-namespace --set batchScheduler.name=volcano --wait --timeout 10m

log "ppojob-operator (this chart)"
helm upgrade --install ppojob "$ROOT/charts/ppojob-operator" -n ppojob-system --create-namespace \
  --set image.repository="$REGISTRY/ppojob-operator" --set image.tag="$TAG" \
  --set image.pullPolicy=Never --set logLevel=DEBUG --wait --timeout 5m
kubectl get crd ppojobs.ppojob.io >/dev/null

log "applying the tiny CPU example (gang-scheduled by Volcano)"
kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -
MANIFEST="$WORK/ppojob-tiny.yaml"
# Same job as examples/ppojob-tiny.yaml, with the locally built image, Volcano and a head pod
# small enough for a laptop.
sed -e "s#^  image: .*#  image: $TRAINER_IMAGE#" \
    -e "s#gangScheduler: none#gangScheduler: volcano#" \
    "$ROOT/examples/ppojob-tiny.yaml" > "$MANIFEST"
grep -q '^  imagePullPolicy:' "$MANIFEST" || printf '  imagePullPolicy: Never\n' >> "$MANIFEST"
grep -q '^  head:' "$MANIFEST" || printf '  head:\n    cpus: 1\n    memory: 3Gi\n' >> "$MANIFEST"
grep -q "gangScheduler: volcano" "$MANIFEST" \
  || printf '  scheduling:\n    gangScheduler: volcano\n' >> "$MANIFEST"
kubectl apply -n "$NS" -f "$MANIFEST"

log "waiting up to ${TIMEOUT_SECONDS}s for phase Succeeded"
deadline=$(( $(date +%s) + TIMEOUT_SECONDS ))
while true; do
  phase="$(kubectl get ppojob "$JOB" -n "$NS" -o jsonpath='{.status.phase}' 2>/dev/null || true)"
  kubectl get ppojob "$JOB" -n "$NS" --no-headers 2>/dev/null || true
  case "$phase" in
    Succeeded) break ;;
    Failed|Invalid) echo "PPOJob $JOB ended in phase $phase" >&2; exit 1 ;;
  esac
  if (( $(date +%s) > deadline )); then
    echo "timed out waiting for $JOB (phase '${phase:-none}')" >&2
    exit 1
  fi
  sleep 15
done

log "checking the result"
kubectl get ppojob "$JOB" -n "$NS" -o wide
reason="$(kubectl get ppojob "$JOB" -n "$NS" \
  -o jsonpath='{.status.conditions[?(@.type=="Succeeded")].reason}')"
echo "Succeeded condition reason: $reason"
kubectl get podgroups.scheduling.volcano.sh -n "$NS" || true
echo "E2E PASSED"
