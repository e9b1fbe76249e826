# syntax=docker/dockerfile:1
# The ppojob trainer: CUDA, torch, Ray, megatron-core, sglang and the ppojob trainer. Every pod of
# a PPOJob (the Ray head with the PPO driver, and every worker) runs this image. Non-root.
#
#   docker build -f images/trainer.Dockerfile -t ghcr.io/ppojob/trainer:0.1.0 .
#
# A CPU-only variant (the tiny example, kind clusters, CI-sized runs):
#   docker build -f images/trainer.Dockerfile -t ppojob-trainer:cpu \
#     --build-arg BASE_IMAGE=ubuntu:24.04 --build-arg EXTRAS=trainer \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#
# Your own code (reward functions, custom advantage functions, datasets) goes into an image built
# FROM this one: see docs/trainer-guide.md, "Custom hooks".

ARG BASE_IMAGE=nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04
FROM ${BASE_IMAGE}

# With gpu: locks/trainer-gpu.txt (torch, ray, transformers, megatron-core, sglang, Transformer
# Engine, trackers). Without: locks/trainer-cpu.txt (the trainer and trackers extras).
ARG EXTRAS=trainer,trackers,gpu
# Empty: torch from PyPI (CUDA wheels). https://download.pytorch.org/whl/cpu: CPU wheels.
ARG TORCH_INDEX_URL=""

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/ppojob \
    PATH=/opt/ppojob/bin:$PATH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# wget: KubeRay's exec liveness/readiness probes of Ray pods call it (KubeRay >= 1.1).
# git, build-essential, python3-dev: sglang and megatron-core build small native extensions.
# Versions float with the base image's distribution release (the base image is pinned).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-venv python3-dev build-essential git wget ca-certificates procps \
      libnuma1 \
 && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv "$VIRTUAL_ENV"

WORKDIR /src
# The dependencies first, in a layer of their own: it is rebuilt only when a lock changes, not on
# every change to the sources (torch alone is gigabytes). They come from a lock (locks/, written
# by `make lock`: every distribution at one version, with hashes): locks/trainer-gpu.txt when
# ${EXTRAS} has gpu (Python 3.12: torch, transformers and tokenizers as sglang pins them;
# torch 2.14.1's PyPI wheels are CUDA 13 builds carrying their own CUDA libraries, so the nodes'
# driver must support CUDA 13), else locks/trainer-cpu.txt (trainer and trackers, Python 3.11).
# A TORCH_INDEX_URL build takes the locked torch version from that index instead (pinned by
# version there, not by hash) and leaves out the CUDA libraries PyPI's torch needs.
COPY pyproject.toml constraints.txt constraints-gpu.txt ./
COPY locks/trainer-cpu.txt locks/trainer-gpu.txt locks/
COPY hack/lock.py hack/
# hadolint ignore=DL3013
RUN case ",${EXTRAS}," in *,gpu,*) lock=locks/trainer-gpu.txt py=3.12 ;; *) lock=locks/trainer-cpu.txt py=3.11 ;; esac; \
    python -c 'import sys; sys.exit(".".join(map(str, sys.version_info[:2])) != sys.argv[1])' "$py" \
      || { echo "$lock is resolved for Python $py: use a base image with Python $py" >&2; exit 1; }; \
    drop=(); \
    if [ -n "$TORCH_INDEX_URL" ]; then \
      torch="$(sed -n 's/^torch==\([^ ]*\).*/\1/p' "$lock")"; \
      pip install --no-cache-dir --no-deps --index-url "$TORCH_INDEX_URL" "torch==$torch" || exit 1; \
      drop=(torch triton "nvidia-*" "cuda-*"); \
    fi; \
    python hack/lock.py without "$lock" transformer-engine-torch "${drop[@]}" > /tmp/requirements.txt \
 && pip install --no-cache-dir --require-hashes --no-deps -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt
# With the gpu extra, Transformer Engine's torch extension (megatron-core's fused layers and
# varlen attention), locked in locks/trainer-gpu.txt with the rest of Transformer Engine: an sdist
# that compiles with the base image's nvcc against the torch installed above, so without build
# isolation (an isolated build would fetch another torch).
# hadolint ignore=DL3013
RUN case ",${EXTRAS}," in \
      *,gpu,*) python hack/lock.py only locks/trainer-gpu.txt transformer-engine-torch > /tmp/te.txt \
               && pip install --no-cache-dir --require-hashes --no-deps --no-build-isolation \
                    -r /tmp/te.txt \
               && rm /tmp/te.txt ;; \
    esac
# Then the project itself, without dependencies (all present), and a check that it imports, as
# does the Ray autoscaler KubeRay runs from this image for elastic rollout groups
# (`ray kuberay-autoscaler` in the head pod).
# (DL3013: the project itself, from the build context; its dependencies are pinned above.)
COPY api/ api/
COPY cli/ cli/
COPY operator/ operator/
COPY trainer/ trainer/
# pyproject.toml's readme: a one-line stand-in, so editing the README never rebuilds an image
RUN echo "ppojob: PPO training of language models as a Kubernetes-native job" > README.md
# hadolint ignore=DL3013
RUN PYTHONWARNINGS=ignore pip install --no-cache-dir --no-deps --no-build-isolation ".[${EXTRAS}]" \
 && pip check \
 && python -c "import torch, ray, ppojob_trainer; print('torch', torch.__version__, 'ray', ray.__version__)" \
 && ppojob-train --help > /dev/null \
 && python -c "import ray.autoscaler._private.kuberay.run_autoscaler"

RUN groupadd --gid 10001 ppojob \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/ppojob --shell /bin/bash ppojob \
 && mkdir -p /workspace \
 && chown ppojob:ppojob /workspace
ENV HOME=/home/ppojob \
    HF_HOME=/home/ppojob/.cache/huggingface
WORKDIR /workspace
USER 10001:10001
