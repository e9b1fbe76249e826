"""The test suite's times from a `make test` (or `.ci/run`) log, printed and optionally recorded.

Method: hack/test.sh prints the main pytest's output, then the control-plane tests' and the
real-node run's (tests/realnode/session.py: its lanes, each with pytest's summary, then
``real-node run: N s in all``). This script reads pytest's summary lines in that order
(``N passed[, M failed] ... in S s``) and the real-node total; ``.ci/run`` prints the whole
run's wall time last (``[ci] make test took N s``), and ``--total`` gives it for an older log.

Run: .venv/bin/python bench/suite_times.py build/ci.log [--total SECONDS] [--record NAME]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.records import Figure, add_record_arguments, write_record

SUMMARY = re.compile(r"^=*\s*(?P<counts>(?:\d+ \w+(?:, )?)+) in (?P<seconds>[\d.]+)s\b")
REALNODE_TOTAL = re.compile(r"^real-node run: (\d+) s in all")
CI_TOTAL = re.compile(r"^\[ci\] make test took (\d+) s")
LANE = re.compile(r"^-+ (?P<lane>[\w-]+) \(exit code (?P<rc>\d+), (?P<seconds>\d+) s\) -+$")


def parse(text: str) -> dict[str, dict[str, float]]:
    """``{"main": {...}, "control_plane": {...}, "realnode": {...}, "total": {...}}``: each part's
    counts (``passed``, ``failed``, ...) and ``seconds``; a real-node lane's under its name."""
    parts: dict[str, dict[str, float]] = {}
    order = ["main", "control_plane"]
    lane: str | None = None
    for line in text.splitlines():
        if m := LANE.match(line):
            lane = m["lane"]
            continue
        if m := REALNODE_TOTAL.match(line):
            parts.setdefault("realnode", {})["seconds"] = float(m[1])
            continue
        if m := CI_TOTAL.match(line):
            parts["total"] = {"seconds": float(m[1])}
            continue
        m = SUMMARY.match(line)
        if not m or ("passed" not in m["counts"] and "failed" not in m["counts"]):
            continue
        counts = {w: float(n) for n, w in (c.split(" ", 1) for c in m["counts"].split(", "))}
        counts["seconds"] = float(m["seconds"])
        if lane is not None:
            parts[f"realnode.{lane}"] = counts
            real = parts.setdefault("realnode", {})
            for k in ("passed", "failed"):
                if counts.get(k):
                    real[k] = real.get(k, 0.0) + counts[k]
        elif order:
            parts[order.pop(0)] = counts
        else:  # a sequential real-node run (PPOJOB_REALNODE_SEQUENTIAL=1): one pytest
            parts["realnode"] = counts
    return parts


def figures(parts: dict[str, dict[str, float]]) -> dict[str, Figure]:
    out: dict[str, Figure] = {}
    for part, counts in parts.items():
        if part == "total":
            continue
        for key, value in counts.items():
            if key == "seconds":
                out[f"{part}.time"] = Figure(value, "min s")
            elif key in ("passed", "failed"):
                out[f"{part}.{key}"] = Figure(value, "tests", unit_shown=False, grouping=True)
    if "total" in parts:
        out["total"] = Figure(parts["total"]["seconds"], "min s")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path)
    p.add_argument("--total", type=float, help="the whole run's seconds (an older .ci/run log)")
    p.add_argument("--commit", help="with --record: the commit the run tested (default: HEAD)")
    add_record_arguments(p, default="suite_times")
    a = p.parse_args(argv)
    parts = parse(a.log.read_text(errors="replace"))
    if a.total is not None:
        parts["total"] = {"seconds": a.total}
    if "main" not in parts:
        print(f"{a.log}: no pytest summary found", file=sys.stderr)
        return 1
    figs = figures(parts)
    for key, fig in figs.items():
        print(f"{key:28s} {fig.text}")
    if a.record:
        write_record(a.record, figs, load=a.load, commit=a.commit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
