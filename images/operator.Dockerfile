# syntax=docker/dockerfile:1
# The PPOJob operator: slim Python, kopf and the Kubernetes client, the `operator` extra only.
# No torch, no Ray. Runs as a non-root user; the chart also makes the root filesystem read-only.
#
#   docker build -f images/operator.Dockerfile -t ghcr.io/ppojob/ppojob-operator:0.1.0 .
# (build context: the repository root; see hack/build-images.sh)

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml ./
COPY locks/operator.txt locks/
# pyproject.toml's readme: a one-line stand-in, so editing the README never rebuilds an image
RUN echo "ppojob: PPO training of language models as a Kubernetes-native job" > README.md
COPY api/ api/
COPY cli/ cli/
COPY operator/ operator/
COPY trainer/ trainer/
# The dependencies from locks/operator.txt (the `operator` extra: kopf, kubernetes,
# prometheus-client and what they need, exact versions with hashes; resolved for Python 3.11),
# then the distribution itself without dependencies, built by the locked setuptools. It holds
# every package; the operator imports only the trainer's config model (pydantic, no torch).
RUN python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
 || { echo "locks/operator.txt is resolved for Python 3.11: use a Python 3.11 image" >&2; exit 1; }
RUN python -m venv /opt/ppojob \
 && /opt/ppojob/bin/pip install --no-cache-dir --require-hashes --no-deps -r locks/operator.txt \
 && PYTHONWARNINGS=ignore /opt/ppojob/bin/pip install --no-cache-dir --no-deps --no-build-isolation ".[operator]" \
 && /opt/ppojob/bin/pip check \
 && /opt/ppojob/bin/python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ('torch', 'ray')))" \
 && /opt/ppojob/bin/ppojob-operator --help > /dev/null

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="ppojob-operator" \
      org.opencontainers.image.description="PPOJob operator (kopf): PPOJob -> gang-scheduled KubeRay RayJob" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 ppojob \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin ppojob
COPY --from=build /opt/ppojob /opt/ppojob
ENV PATH=/opt/ppojob/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 8080 8081
ENTRYPOINT ["ppojob-operator"]
CMD ["--all-namespaces"]
