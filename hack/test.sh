#!/usr/bin/env bash
# The test suite as `make test` and CI run it, in three pytest processes side by side:
#   - the real-node tests (tests/realnode/: PPOJobs in real pods on a kubelet built here, mostly
#     waiting for pods to start and Ray to form; themselves in two lanes on one node, then the
#     tests that need the whole node: tests/realnode/session.py),
#   - the control-plane tests (tests/cluster/: a real API server, KubeRay, Kueue, the gang
#     schedulers and KWOK; mostly waiting for controllers: about 40 % of one core, measured),
#   - everything else (the trainer's Ray and torch tests: the CPU-bound part),
# so the two waiting halves overlap the CPU-bound one. On 2 cores they load each other: every
# wait bound of the shared helpers is multiplied by PPOJOB_TEST_TIMEOUT_SCALE (3 by default
# here; tests/helpers/timeouts.py), which only matters when a condition is late.
# PPOJOB_TESTS_SEQUENTIAL=1 runs one pytest over everything instead (the times add up).
# All three must pass; the main output comes first, then the control-plane and real-node
# outputs (kept in build/cluster-tests.log and build/realnode-tests.log). Exit code: the main
# run's if it failed, else the control-plane run's, else the real-node run's (pytest's 5, "no
# tests collected", included).
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PY:-.venv/bin/python}"
if [ -n "${PPOJOB_TESTS_SEQUENTIAL:-}" ]; then
  exec "$py" -m pytest -q --durations=25
fi
export PPOJOB_TEST_TIMEOUT_SCALE="${PPOJOB_TEST_TIMEOUT_SCALE:-3}"
mkdir -p build
node_log=build/realnode-tests.log
cluster_log=build/cluster-tests.log
# the real node once, its tests in lanes side by side, then those that need the whole node
# (tests/realnode/session.py); PPOJOB_REALNODE_SEQUENTIAL=1: one pytest process, one at a time
if [ -n "${PPOJOB_REALNODE_SEQUENTIAL:-}" ]; then
  "$py" -m pytest -q --durations=15 -m realnode >"$node_log" 2>&1 &
else
  "$py" -m tests.realnode.session >"$node_log" 2>&1 &
fi
realnode=$!
"$py" -m pytest -q --durations=15 -m "not realnode" tests/cluster >"$cluster_log" 2>&1 &
cluster=$!
# an interrupted suite still tears the node and the control plane down (each pytest, and the
# real-node session with its lanes, turns SIGTERM into a clean stop)
trap 'kill -TERM "$realnode" "$cluster" 2>/dev/null; wait "$realnode" "$cluster"; exit 130' INT TERM
"$py" -m pytest -q --durations=25 -m "not realnode" --ignore=tests/cluster
main=$?
wait "$cluster"
cp_rc=$?
wait "$realnode"
node=$?
trap - INT TERM
echo
echo "==================== tests/cluster (ran alongside; exit code $cp_rc) ===================="
cat "$cluster_log"
echo
echo "==================== tests/realnode (ran alongside; exit code $node) ===================="
cat "$node_log"
if [ "$main" -ne 0 ]; then exit "$main"; fi
if [ "$cp_rc" -ne 0 ]; then exit "$cp_rc"; fi
exit "$node"
