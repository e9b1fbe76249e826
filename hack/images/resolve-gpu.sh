#!/usr/bin/env bash
# Resolve the GPU trainer image's Python dependencies with pip's own resolver, without building
# the image (no CUDA base image is needed): the image's `pip install -c constraints.txt -r
# requirements` step (constraints-gpu.txt in place of constraints.txt, the extras
# trainer,trackers,gpu) for the base image's Python (Ubuntu 24.04: 3.12) on x86_64 Linux,
# wheels only, then the Transformer Engine files the image's second step takes (the
# core-cu13 wheel and the torch extension's sdist, which the image compiles without build
# isolation). Needs PyPI (a developer's check, never run by the tests: they are offline and
# read the wheels' metadata instead, tests/chart/test_gpu_constraints.py).
#
#   bash hack/images/resolve-gpu.sh     # prints what the image would install; exit 1 if not
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
PYVER="${PYVER:-3.12}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$PY" - trainer,trackers,gpu > "$work/requirements.txt" <<'PYEOF'
import sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = sys.argv[1].split(",") if len(sys.argv) > 1 else []
print("\n".join(p["dependencies"] + [d for e in extras for d in p["optional-dependencies"][e]]))
PYEOF
platforms=()
for n in $(seq 39 -1 5); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform linux_x86_64)
"$PY" -m pip install --dry-run --quiet --ignore-installed --only-binary=:all: \
  --python-version "$PYVER" "${platforms[@]}" --target "$work/target" \
  -c constraints-gpu.txt -r "$work/requirements.txt" --report "$work/report.json"
"$PY" - "$work/report.json" <<'PYEOF'
import json, sys
report = json.load(open(sys.argv[1]))
got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
print(f"resolved {len(got)} distributions for the GPU image; the pinned ones:")
for name in ("torch", "sglang", "megatron-core", "ray", "transformers", "tokenizers"):
    print(f"  {name}=={got[name]}")
PYEOF
te=$(sed -n 's/^transformer-engine==\(.*\)$/\1/p' constraints-gpu.txt)
# the torch extension is an sdist: its metadata needs a build against torch, so only its
# presence in the index is checked here
if "$PY" -m pip index versions transformer-engine-torch 2>/dev/null | grep -q "[ ,]$te\(,\|$\)"; then
  echo "transformer-engine-torch==$te: in the index (the image compiles its sdist)"
else
  echo "transformer-engine-torch==$te: not in the index" >&2
  exit 1
fi
