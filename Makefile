# Every target creates (or reuses) its own virtualenv in $(VENV); torch is pinned to 2.13.0
# through constraints.txt so no other package can upgrade it.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# the gpu extra's sglang pin (pyproject.toml), e.g. 0.5.23
SGLANG_VERSION := $(shell sed -n 's/^ *"sglang==\([^"]*\)".*/\1/p' pyproject.toml)
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: install demo test lint format crd docs images node-images e2e clean control-plane mutation

$(STAMP): pyproject.toml constraints.txt tests/trainer/backends/sglang-runtime.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e '.[operator,trainer,trackers,dev]'
# the SGLang wheel tests/trainer/backends/test_sglang_contract.py reads (never installed: CUDA-only);
# the version is the gpu extra's pin in pyproject.toml
	$(PIP) download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
		--platform manylinux_2_34_x86_64 -d $(VENV)/test-cache/sglang \
		sglang==$(SGLANG_VERSION)
# ... and that wheel with the few pure-Python modules its weight updater imports, installed
# without dependencies beside the virtualenv (tests/trainer/backends/test_sglang_runtime.py runs
# SGLang's own weight-update code from there, in a subprocess)
	rm -rf $(VENV)/test-cache/sglang-runtime
	$(PIP) install --quiet --no-deps --target $(VENV)/test-cache/sglang-runtime \
		-r tests/trainer/backends/sglang-runtime.txt $(VENV)/test-cache/sglang/sglang-$(SGLANG_VERSION)-*.whl
	touch $(STAMP)

install: $(STAMP)

## The main job: train the tiny CPU example locally (count-up task, tiny Llama, PPO).
## The tiny example on this machine's CPU (a few minutes); its console output is kept in
## ppojob-out/demo/run.log, and the summary says where the reward curve and metrics are.
demo: SHELL := bash
demo: $(STAMP)
	@mkdir -p ppojob-out/demo
	set -o pipefail; $(VENV)/bin/ppojob run examples/ppojob-tiny.yaml --out ppojob-out/demo 2>&1 \
		| tee ppojob-out/demo/run.log
	@echo "  log:           ppojob-out/demo/run.log"

## The real control plane of tests/cluster/ (etcd, kube-apiserver, controller manager, schedulers,
## KubeRay, KWOK, Kueue), built from Go modules at hack/control-plane/versions.env, each component
## cached on its own outside the clone (~/.cache/ppojob/control-plane); a warm run takes a
## second. Needs Go >= 1.26.
control-plane:
	bash hack/control-plane/build.sh >/dev/null

## The test suite (what CI runs). pytest exits 5 when it collects no test: that fails too.
test: $(STAMP) control-plane
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	PY=$(PY) bash hack/test.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

## Regenerate the CRD (and the chart's copy) and the API reference from the models.
crd: $(STAMP)
	$(VENV)/bin/ppojob crd > crds/ppojob.io_ppojobs.yaml
	cp crds/ppojob.io_ppojobs.yaml charts/ppojob-operator/crds/ppojob.io_ppojobs.yaml
	$(PY) -m ppojob_api.reference > docs/reference.md

docs: crd

## Mutation testing (mutmut) of the pure modules, each group against its own unit tests; prints
## killed / timeout / survived per module and the surviving mutants (README, "Mutation testing").
## Not part of `make test` or CI. MUTATION_GROUPS picks groups (`hack/mutation.py --list`).
MUTATION_GROUPS ?=
MUTATION_CHILDREN ?= 2
mutation: $(STAMP)
	$(PY) hack/mutation.py --max-children $(MUTATION_CHILDREN) $(MUTATION_GROUPS)

## The images of the real-node tests (tests/realnode/): the pause image, the operator and the
## CPU trainer from images/*.Dockerfile on a debootstrap base, built with buildah (no Docker, no
## registry; root). Cached by content hash in ~/.cache/ppojob/images; `make test` builds them.
node-images:
	bash hack/images/build.sh

## Build both images (needs a Docker engine; not run in CI).
images:
	bash hack/build-images.sh

## End-to-end on a kind cluster (needs Docker and kind; not run in CI).
e2e:
	bash hack/e2e-kind.sh

clean:
	rm -rf $(VENV) build *.egg-info ppojob-out mutants
