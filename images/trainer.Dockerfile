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

# trainer,gpu: torch, ray, transformers, megatron-core, sglang. trainer alone: the CPU path.
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
# The dependencies first, in a layer of their own: it is rebuilt only when pyproject.toml or the
# constraints change, not on every change to the sources (torch alone is gigabytes). torch first
# (from the CPU index when asked; pinned by constraints.txt), then the distribution's
# dependencies and those of ${EXTRAS}, read from pyproject.toml (torch and ray pinned by
# constraints.txt, so the image's Ray is the spec.rayVersion default). With the gpu extra,
# constraints-gpu.txt takes the place of constraints.txt (sglang pins its own torch,
# transformers and tokenizers; torch 2.14.1's PyPI wheels are CUDA 13 builds that carry their
# own CUDA libraries: the nodes' driver must support CUDA 13).
COPY pyproject.toml constraints.txt constraints-gpu.txt ./
# hadolint ignore=DL3013
RUN case ",${EXTRAS}," in *,gpu,*) cp constraints-gpu.txt constraints.txt ;; esac \
 && if [ -n "$TORCH_INDEX_URL" ]; then \
      pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" -c constraints.txt torch; \
    fi \
 && python -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"] + [d for e in sys.argv[1].split(",") \
for d in p["optional-dependencies"][e]]))' "$EXTRAS" > /tmp/requirements.txt \
 && pip install --no-cache-dir -c constraints.txt -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt
# With the gpu extra, Transformer Engine (megatron-core's fused layers and varlen attention),
# pinned in constraints-gpu.txt: its torch extension is an sdist that compiles with the base
# image's nvcc against the torch installed above, so without build isolation (an isolated build
# would fetch another torch).
# hadolint ignore=DL3013
RUN case ",${EXTRAS}," in \
      *,gpu,*) pip install --no-cache-dir --no-build-isolation -c constraints.txt \
                 "transformer-engine[pytorch,core-cu13]" ;; \
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
RUN pip install --no-cache-dir --no-deps ".[${EXTRAS}]" \
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
