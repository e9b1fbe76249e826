#!/usr/bin/env bash
# Check, with pip (a second installer beside the uv that wrote it), that locks/trainer-gpu.txt
# installs on the GPU image's platform without building the image (no CUDA base image is
# needed): every entry but Transformer Engine's torch extension has a wheel for CPython 3.12 on
# x86_64 manylinux with a hash the lock lists, and the extension's sdist is in the index. Exactly the image's first install step (`pip install --require-hashes
# --no-deps`), as a dry run; then pip's own resolver over the same pins with dependencies, so a
# Requires-Dist the lock does not satisfy fails here. Needs PyPI (a developer's check, never run
# by the tests: they are offline and read the locks and the wheels' metadata instead,
# tests/test_locks.py and tests/chart/test_gpu_constraints.py).
#
#   bash hack/images/resolve-gpu.sh     # prints what it checked; exit 1 if the lock does not install
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
PYVER="${PYVER:-3.12}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$PY" hack/lock.py without locks/trainer-gpu.txt transformer-engine-torch >"$work/wheels.txt"
"$PY" hack/lock.py only locks/trainer-gpu.txt transformer-engine-torch >"$work/te.txt"
platforms=()
for n in $(seq 39 -1 5); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform linux_x86_64)
common=(--quiet --ignore-installed --only-binary=:all: --python-version "$PYVER" "${platforms[@]}"
  --target "$work/target")
# the image's step: hashes, no dependencies followed
"$PY" -m pip install --dry-run "${common[@]}" --require-hashes --no-deps -r "$work/wheels.txt" \
  --report "$work/report.json"
# the same pins, dependencies followed: nothing outside the lock may be needed
sed -n 's/^\([A-Za-z0-9][A-Za-z0-9._-]*\)==\([^ ;\\]*\).*/\1==\2/p' "$work/wheels.txt" >"$work/pins.txt"
"$PY" -m pip install --dry-run "${common[@]}" -r "$work/pins.txt" --report "$work/closed.json"
"$PY" - "$work/report.json" "$work/closed.json" <<'PYEOF'
import json, re, sys
def name(i):
    return re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower()
got = [{name(i): i["metadata"]["version"] for i in json.load(open(p))["install"]} for p in sys.argv[1:]]
if got[0] != got[1]:
    extra = sorted(set(got[1].items()) - set(got[0].items()))
    sys.exit(f"pip's resolver wants more than the lock: {extra}")
print(f"locks/trainer-gpu.txt: {len(got[0])} wheels install for the GPU image, hashes checked, "
      "closed under their dependencies; the pinned ones:")
for name in ("torch", "sglang", "megatron-core", "ray", "transformers", "tokenizers",
             "transformer-engine", "transformer-engine-cu13"):
    print(f"  {name}=={got[0][name]}")
PYEOF
# the torch extension is an sdist whose metadata needs a CUDA build: only its presence in the
# index is checked here (the image's install checks its locked hash)
te=$(sed -n 's/^transformer-engine-torch==\([^ ]*\).*/\1/p' "$work/te.txt")
if "$PY" -m pip index versions transformer-engine-torch 2>/dev/null | grep -q "[ ,]$te\(,\|$\)"; then
  echo "transformer-engine-torch==$te: in the index (the image compiles its sdist)"
else
  echo "transformer-engine-torch==$te: not in the index" >&2
  exit 1
fi
