"""bench/suite_times.py reads a `make test` log: the main, control-plane and real-node parts."""

from __future__ import annotations

from bench.suite_times import figures, parse

LANES_LOG = """\
ruff: All checks passed!
........                                                                 [100%]
=========================== short test summary info ============================
FAILED tests/trainer/test_x.py::test_y - AssertionError
1 failed, 2402 passed, 21 deselected, 17 warnings in 1983.57s (0:33:03)

==================== tests/cluster (ran alongside; exit code 0) ====================
66 passed in 735.87s (0:12:15)

==================== tests/realnode (ran alongside; exit code 0) ====================
real node: images 0.6s, control plane 17.9s, node 3.3s, helm install 6.9s

---------- lane-a (exit code 0, 631 s) ----------
15 passed, 6 deselected in 629.17s (0:10:29)

---------- lane-b (exit code 0, 724 s) ----------
3 passed, 18 deselected in 721.66s (0:12:01)

---------- whole-node (exit code 1, 499 s) ----------
1 failed, 2 passed, 18 deselected in 498.24s (0:08:18)
real-node run: 1266 s in all
[ci] make test took 2101 s (exit code 1)
"""


def test_each_part_and_lane_is_read_in_order() -> None:
    parts = parse(LANES_LOG)
    assert parts["main"] == {
        "failed": 1,
        "passed": 2402,
        "deselected": 21,
        "warnings": 17,
        "seconds": 1983.57,
    }
    assert parts["control_plane"] == {"passed": 66, "seconds": 735.87}
    assert parts["realnode.lane-b"]["seconds"] == 721.66
    # the real node's counts add up over its lanes; its time is the whole run's, not a lane's
    assert parts["realnode"] == {"passed": 20, "failed": 1, "seconds": 1266}
    assert parts["total"] == {"seconds": 2101}


def test_the_figures_print_as_the_readme_writes_them() -> None:
    figs = figures(parse(LANES_LOG))
    assert figs["main.time"].text == "33 min 4 s"
    assert figs["main.passed"].text == "2,402"
    assert figs["realnode.time"].text == "21 min 6 s"
    assert figs["total"].text == "35 min 1 s"


def test_a_sequential_real_node_run_is_the_third_summary() -> None:
    log = "5 passed in 10.0s\n3 passed in 20.0s\n21 passed, 2469 deselected in 3389.13s\n"
    parts = parse(log)
    assert parts["realnode"] == {"passed": 21, "deselected": 2469, "seconds": 3389.13}
