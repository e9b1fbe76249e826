# Every target creates (or reuses) its own virtualenv in $(VENV), installed from locks/dev.txt
# (torch 2.13.0 through constraints.txt, which the lock obeys).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: install demo test lint format crd docs images node-images e2e clean control-plane mutation \
	lock newest

# Everything installs from locks/dev.txt (every distribution, exact versions, hashes: `make lock`
# writes it); the project itself without dependencies and without build isolation (the locked
# setuptools builds it). A venv made from an older lock first loses what the new one lacks.
$(STAMP): pyproject.toml locks/dev.txt locks/sglang-runtime.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { echo "locks/dev.txt is \
	resolved for Python 3.11 and $(VENV) has $$($(PY) -V): rm -rf $(VENV) and set PYTHON=python3.11" >&2; exit 1; }
	$(PY) hack/lock.py unlocked dev | xargs -r $(PIP) uninstall --quiet -y
	$(PIP) install --quiet --require-hashes --no-deps -r locks/dev.txt
	PYTHONWARNINGS=ignore $(PIP) install --quiet --no-deps --no-build-isolation -e .
	$(PY) hack/lock.py check
	$(PY) hack/lock.py drift dev
# the SGLang wheel tests/trainer/backends/test_sglang_contract.py reads (never installed: CUDA-only)
# and, beside the virtualenv, that wheel with the few pure-Python modules its weight updater
# imports, without dependencies (tests/trainer/backends/test_sglang_runtime.py runs SGLang's own
# weight-update code from there, in a subprocess): locks/sglang-runtime.txt, hashed
	rm -rf $(VENV)/test-cache/sglang $(VENV)/test-cache/sglang-runtime
	$(PIP) download --quiet --no-deps --require-hashes --only-binary=:all: \
		-d $(VENV)/test-cache/sglang -r locks/sglang-runtime.txt
	$(PIP) install --quiet --no-deps --no-index --require-hashes --find-links $(VENV)/test-cache/sglang \
		--target $(VENV)/test-cache/sglang-runtime -r locks/sglang-runtime.txt
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

## Re-resolve every lock in locks/ from PyPI (uv, the newest versions pyproject.toml and the
## constraints allow) and print what changed; then `make install` and `make test`. Run it to take
## a new dependency or version, or when `make newest` shows one worth taking.
lock: $(STAMP)
	$(PY) hack/lock.py compile

## The next breakage before users see it (not part of `make test`): resolve the newest versions
## allowed into build/newest.txt, print how they differ from locks/dev.txt, install them into a
## scratch virtualenv (build/newest-venv) and run the fast tests there.
NEWEST_VENV := build/newest-venv
newest: $(STAMP)
	rm -rf $(NEWEST_VENV) && mkdir -p build
	$(PY) hack/lock.py newest build/newest.txt
	$(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/pip install --quiet --require-hashes --no-deps -r build/newest.txt
	PYTHONWARNINGS=ignore $(NEWEST_VENV)/bin/pip install --quiet --no-deps --no-build-isolation -e .
	cp -r $(VENV)/test-cache $(NEWEST_VENV)/test-cache
	PPOJOB_LOCK=build/newest.txt $(NEWEST_VENV)/bin/python -m pytest -q -m "not slow and not realnode" \
		--ignore=tests/realnode --ignore=tests/cluster --ignore=tests/e2e

clean:
	rm -rf $(VENV) build *.egg-info ppojob-out mutants
