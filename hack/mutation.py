"""Mutation testing of the pure modules with mutmut 3, one group of modules at a time.

Usage: python hack/mutation.py [--max-children 2] [--survivors | --show | --list] [GROUP ...]

mutmut names a mutant after its file's path from the directory it runs in, and puts only
`mutants/`, `mutants/src` and `mutants/source` on `sys.path`; this repository keeps each package
one folder down (`api/ppojob_api`, `trainer/ppojob_trainer`, ...). So each group runs in its own
staging folder, `mutants/<group>/`, holding a copy of the repository with the group's package at
the top (`mutants/<group>/ppojob_trainer/`) and a `[tool.mutmut]` section appended to its
pyproject.toml: the module names mutmut sees are then the ones the tests import. The other
packages are imported from where the virtualenv (or PYTHONPATH) finds them, unmutated.

Each group mutates only its own modules (`only_mutate`) and runs only its own unit tests (no Ray,
no cluster); a mutant is run against the tests that call the mutated function. A fresh run wipes
the group's staging folder first; `--survivors` keeps it, refreshes the tests from the checkout
and reruns only the mutants that survived (new tests are picked up).

Prints, per module: mutants, killed, timeout, survived, other (no tests, suspicious, ...) and
% killed = (killed + timeout) / mutants (a mutant that makes a test hang was detected), then
the names of the surviving mutants (`cd mutants/<group> && mutmut show NAME` shows the diff;
`--show` prints every survivor's diff with its file and line). mutmut's own progress goes to
`mutants/<group>/mutmut.log`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "mutants"
# top-level entries of the checkout never copied into a staging folder
SKIP = {".git", ".venv", "mutants", "build", "ppojob-out", ".hypothesis", ".ruff_cache"}
PACKAGE_ROOTS = {"api", "operator", "trainer", "cli"}


@dataclass(frozen=True)
class Group:
    root: str  # the package's folder in the checkout
    package: str
    modules: list[str]  # paths inside the package
    tests: list[str]
    # test ids (prefixes) left out: too slow to run for each mutant
    deselect: list[str] = field(default_factory=list)
    forkserver: bool = False  # torch is not fork-safe once its thread pools have started


# Left out of the operator groups: each mutant's run would pay the strict schema validators'
# session setup (~20 s on a loaded 2-core machine) or start a Python subprocess; the same
# children are compared with plain assertions in the other builder tests.
OPERATOR_SLOW = [
    "tests/operator/test_builders.py::test_children_validate_strictly",
    "tests/operator/test_builders.py::test_render_cli_prints_the_builders_output",
]

GROUPS: dict[str, Group] = {
    "algorithms": Group(
        root="trainer",
        package="ppojob_trainer",
        modules=["algorithms/advantages.py", "algorithms/losses.py", "algorithms/kl.py"],
        tests=[
            "tests/trainer/algorithms/test_advantages.py",
            "tests/trainer/algorithms/test_losses.py",
            "tests/trainer/algorithms/test_hooks.py",
            "tests/trainer/algorithms/test_stats.py",
            "tests/trainer/algorithms/test_advantage_invariance.py",
            # policy_loss's importance weights (TIS) and gspo_policy_loss
            "tests/trainer/algorithms/test_offpolicy.py",
            "tests/trainer/algorithms/test_dapo_gspo.py",
        ],
        deselect=[
            "tests/trainer/algorithms/test_advantage_invariance.py::test_advantages_are_the_same_for_dp_1_2_and_3",
        ],
        forkserver=True,
    ),
    "checks": Group(
        root="api",
        package="ppojob_api",
        modules=["checks/*.py", "overrides.py"],
        tests=[
            "tests/api/test_checks.py",
            "tests/api/test_validation.py",
            "tests/api/test_overrides.py",
            # the spec tests of single features: they validate specs through the same checks
            "tests/api/test_bad_input.py",
            "tests/api/test_bad_input_batch2.py",
            "tests/api/test_agent_spec.py",
            "tests/api/test_algorithm_pack_spec.py",
            "tests/api/test_reward_sources_spec.py",
            "tests/api/test_staleness_spec.py",
            "tests/api/test_trackers_spec.py",
        ],
    ),
    "operator": Group(
        root="operator",
        package="ppojob_operator",
        modules=["builders.py", "status.py"],
        tests=[
            "tests/operator/test_builders.py",
            "tests/operator/test_status.py",
            # status.py's restart record and spec-edit conditions
            "tests/operator/test_restart_policy.py",
            "tests/operator/test_status_edits.py",
        ],
        deselect=OPERATOR_SLOW,
    ),
    "scheduling": Group(
        root="operator",
        package="ppojob_operator",
        modules=["scheduling.py"],
        tests=[
            "tests/operator/test_scheduling.py",
            "tests/operator/test_builders.py",
            "tests/operator/test_status.py",
        ],
        deselect=OPERATOR_SLOW,
    ),
}


def _toml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def stage(name: str, group: Group) -> Path:
    """A fresh copy of the checkout with the group's package at the top; returns its folder."""
    where = OUT / name
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    for entry in ROOT.iterdir():
        if entry.name in SKIP or entry.name in PACKAGE_ROOTS or entry.name.startswith(".git"):
            continue
        if entry.is_dir():
            shutil.copytree(entry, where / entry.name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(entry, where / entry.name)
    shutil.copytree(
        ROOT / group.root / group.package,
        where / group.package,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    tests = [t for t in group.tests if (ROOT / t).exists()]
    selection = tests + [f"--deselect={d}" for d in group.deselect]
    also_copy = sorted(
        e.name
        for e in where.iterdir()
        if e.name not in {group.package, "pyproject.toml", "tests", "mutants"}
    )
    section = "\n".join(
        [
            "",
            "[tool.mutmut]",
            f"source_paths = {_toml_list([group.package])}",
            f"only_mutate = {_toml_list([f'{group.package}/{m}' for m in group.modules])}",
            f"also_copy = {_toml_list(also_copy)}",
            f"pytest_add_cli_args_test_selection = {_toml_list(selection)}",
            f'process_isolation = "{"forkserver" if group.forkserver else "fork"}"',
            "use_git_change_detection = false",
            "",
        ]
    )
    pyproject = where / "pyproject.toml"
    pyproject.write_text(pyproject.read_text() + section)
    return where


def refresh_tests(where: Path) -> None:
    """The checkout's tests over the staged copy (mutmut copies them on into mutants/)."""
    shutil.copytree(
        ROOT / "tests",
        where / "tests",
        dirs_exist_ok=True,
        ignore=shutil.ignore_patterns("__pycache__"),
    )


STATUS = {1: "killed", 3: "killed", 0: "survived", 36: "timeout", -24: "timeout", 24: "timeout"}
STATUS |= {152: "timeout", 255: "timeout"}


def results(where: Path, group: Group) -> dict[str, dict[str, str]]:
    """{module file: {mutant name: status}} from mutmut's .meta files."""
    out: dict[str, dict[str, str]] = {}
    for meta in sorted((where / "mutants" / group.package).rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        module = str(meta.relative_to(where / "mutants"))[: -len(".meta")]
        out[module] = {k: STATUS.get(v, "other") for k, v in data["exit_code_by_key"].items()}
    return out


def summary(rows: dict[str, dict[str, str]]) -> list[str]:
    lines = [
        f"{'module':<40} {'mutants':>7} {'killed':>7} {'timeout':>7} {'survived':>8} "
        f"{'other':>6} {'% killed':>8}"
    ]
    for module, statuses in rows.items():
        c = Counter(statuses.values())
        total = len(statuses)
        pct = 100.0 * (c["killed"] + c["timeout"]) / total if total else 100.0
        lines.append(
            f"{module:<40} {total:>7} {c['killed']:>7} {c['timeout']:>7} {c['survived']:>8} "
            f"{c['other']:>6} {pct:>7.1f}%"
        )
    return lines


SHOW = """
import json, sys
from mutmut.mutation.diff_apply import get_diff_for_mutant
for name in json.loads(sys.argv[1]):
    try:
        diff = get_diff_for_mutant(name).splitlines()[2:]
    except Exception as exc:  # a mutant of a file changed since the run
        diff = [f"? {exc}"]
    print(json.dumps([name, [d for d in diff if d[:1] in "+-?"]]))
"""


def show(where: Path, group: Group, names: list[str]) -> list[str]:
    """One line per mutant: `file:line  name`, then the changed lines of its diff."""
    out = subprocess.run(
        [sys.executable, "-c", SHOW, json.dumps(names)],
        cwd=where,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = []
    for row in out.splitlines():
        name, diff = json.loads(row)
        module = name.split(".x_")[0].split(".x\u01c1")[0]
        path = where / (module.replace(".", "/") + ".py")
        if not path.exists():
            path = where / module.replace(".", "/") / "__init__.py"
        source = path.read_text().splitlines()
        removed = next((d[1:].strip() for d in diff if d.startswith("-")), "")
        lineno = next((i + 1 for i, t in enumerate(source) if removed and t.strip() == removed), 0)
        lines.append(f"{path.relative_to(where)}:{lineno}  {name}")
        lines += [f"    {d}" for d in diff]
    return lines


def mutmut(where: Path, group: Group, max_children: int, names: list[str]) -> int:
    exe = Path(sys.executable).parent / "mutmut"
    cmd = [str(exe), "run", "--max-children", str(max_children), *names]
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # mutmut's forked workers import a lot
    log = where / "mutmut.log"
    print(
        f"mutmut run in {where.relative_to(ROOT)} (progress: {log.relative_to(ROOT)})", flush=True
    )
    with log.open("a") as out:
        return subprocess.run(
            cmd, cwd=where, env=env, stdout=out, stderr=out, check=False
        ).returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("groups", nargs="*", help=f"groups to run (default: all): {', '.join(GROUPS)}")
    p.add_argument("--max-children", type=int, default=2, help="parallel mutant workers")
    p.add_argument("--survivors", action="store_true", help="rerun last run's survivors only")
    p.add_argument("--list", action="store_true", help="print the groups and exit")
    p.add_argument("--show", action="store_true", help="print last run's survivors' diffs")
    args = p.parse_args(argv)
    if args.list:
        for name, g in GROUPS.items():
            print(f"{name}: {g.root}/{g.package}/{{{','.join(g.modules)}}} <- {' '.join(g.tests)}")
        return 0
    unknown = [g for g in args.groups if g not in GROUPS]
    if unknown:
        p.error(f"unknown group(s) {unknown}: choose from {', '.join(GROUPS)}")
    report: list[str] = []
    rc = 0
    for name in args.groups or list(GROUPS):
        group = GROUPS[name]
        where = OUT / name
        start = time.monotonic()
        if args.show:
            rows = results(where, group)
            names = [k for r in rows.values() for k, s in r.items() if s == "survived"]
            print("\n".join(show(where, group, names)))
            continue
        if args.survivors and (where / "mutants").is_dir():
            refresh_tests(where)
            before = results(where, group)
            names = [k for rows in before.values() for k, s in rows.items() if s != "killed"]
            if names:
                rc |= mutmut(where, group, args.max_children, names)
        else:
            where = stage(name, group)
            rc |= mutmut(where, group, args.max_children, [])
        minutes = (time.monotonic() - start) / 60
        rows = results(where, group)
        report += ["", f"== {name}: {minutes:.1f} min", *summary(rows)]
        survivors = [k for r in rows.values() for k, s in r.items() if s == "survived"]
        report += [f"   survived: {k}" for k in survivors]
        (where / "summary.json").write_text(json.dumps(rows, indent=1, sort_keys=True))
    print("\n".join(report))
    return rc


if __name__ == "__main__":
    sys.exit(main())
