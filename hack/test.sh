#!/usr/bin/env bash
# The test suite as `make test` and CI run it, in two pytest processes side by side: the
# real-node tests (tests/realnode/: PPOJobs in real pods on a kubelet built here, mostly waiting
# for pods to start and Ray to form) and everything else, so the real node's waits overlap the
# rest (about 20 of the suite's minutes are those waits). On 2 cores the two halves load each
# other: every wait bound of the shared helpers is multiplied by PPOJOB_TEST_TIMEOUT_SCALE (3 by
# default here; tests/helpers/timeouts.py), which only matters when a condition is late.
# PPOJOB_TESTS_SEQUENTIAL=1 runs one pytest over everything instead (the two halves' times add
# up). Both halves must pass; the real-node output is printed after the main output (and kept in
# build/realnode-tests.log). Exit code: the main run's if it failed, else the real-node run's
# (pytest's 5, "no tests collected", included).
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PY:-.venv/bin/python}"
if [ -n "${PPOJOB_TESTS_SEQUENTIAL:-}" ]; then
  exec "$py" -m pytest -q --durations=25
fi
export PPOJOB_TEST_TIMEOUT_SCALE="${PPOJOB_TEST_TIMEOUT_SCALE:-3}"
mkdir -p build
log=build/realnode-tests.log
"$py" -m pytest -q --durations=15 -m realnode >"$log" 2>&1 &
realnode=$!
# an interrupted suite still tears the node down (its pytest turns SIGTERM into a clean stop)
trap 'kill -TERM "$realnode" 2>/dev/null; wait "$realnode"; exit 130' INT TERM
"$py" -m pytest -q --durations=25 -m "not realnode"
main=$?
wait "$realnode"
node=$?
trap - INT TERM
echo
echo "==================== tests/realnode (ran alongside; exit code $node) ===================="
cat "$log"
if [ "$main" -ne 0 ]; then exit "$main"; fi
exit "$node"
