#!/usr/bin/env bash
# Build the operator and trainer images (needs Docker or a Docker-compatible CLI; not run in CI).
#
#   hack/build-images.sh                       # ghcr.io/ppojob/ppojob-operator:<version>, ghcr.io/ppojob/trainer:<version>
#   REGISTRY=registry.example.com/ml TAG=dev hack/build-images.sh
#   TRAINER_VARIANT=cpu hack/build-images.sh   # CPU-only trainer (tiny example, kind)
#   PUSH=1 hack/build-images.sh                # also push both
#
# Environment: REGISTRY (default ghcr.io/ppojob), TAG (default: version in pyproject.toml),
# TRAINER_VARIANT (gpu | cpu, default gpu), PUSH (1 pushes), DOCKER (default docker),
# PLATFORM (default linux/amd64).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DOCKER="${DOCKER:-docker}"
REGISTRY="${REGISTRY:-ghcr.io/ppojob}"
VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml" | head -n1)"
TAG="${TAG:-$VERSION}"
TRAINER_VARIANT="${TRAINER_VARIANT:-gpu}"
PLATFORM="${PLATFORM:-linux/amd64}"

if ! command -v "$DOCKER" >/dev/null 2>&1; then
  echo "error: '$DOCKER' not found. Install Docker (or set DOCKER=podman) to build images." >&2
  exit 1
fi

OPERATOR_IMAGE="$REGISTRY/ppojob-operator:$TAG"
case "$TRAINER_VARIANT" in
  gpu)
    TRAINER_IMAGE="$REGISTRY/trainer:$TAG"
    TRAINER_ARGS=()
    ;;
  cpu)
    TRAINER_IMAGE="$REGISTRY/trainer:$TAG-cpu"
    # Debian 12: Python 3.11, the Python of locks/trainer-cpu.txt
    TRAINER_ARGS=(--build-arg BASE_IMAGE=debian:bookworm --build-arg EXTRAS=trainer,trackers
                  --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu)
    ;;
  *)
    echo "error: TRAINER_VARIANT must be gpu or cpu, got '$TRAINER_VARIANT'" >&2
    exit 2
    ;;
esac

echo ">> building $OPERATOR_IMAGE"
"$DOCKER" build --platform "$PLATFORM" -f "$ROOT/images/operator.Dockerfile" \
  -t "$OPERATOR_IMAGE" "$ROOT"

echo ">> building $TRAINER_IMAGE ($TRAINER_VARIANT)"
"$DOCKER" build --platform "$PLATFORM" -f "$ROOT/images/trainer.Dockerfile" \
  ${TRAINER_ARGS[@]+"${TRAINER_ARGS[@]}"} -t "$TRAINER_IMAGE" "$ROOT"

if [[ "${PUSH:-0}" == "1" ]]; then
  "$DOCKER" push "$OPERATOR_IMAGE"
  "$DOCKER" push "$TRAINER_IMAGE"
fi

echo "operator image: $OPERATOR_IMAGE"
echo "trainer image:  $TRAINER_IMAGE"
