"""The docs' figures and their records (bench/records/*.json, format in bench/records.py).

A figure the docs quote is a link to its record, ``[1.39x](bench/records/x.json#key)``: the
link's text must be the record's text for that key, every record must be complete and found
from a doc, and a bold figure with a unit in README.md, bench/README.md or docs/*.md must be
such a link (a figure left in plain prose must not be bold)."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.records import Figure, dump, format_figure, load_record, write_record

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "bench" / "records"
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
# spans never cross a blank line: a stray backtick or ** cannot hide the paragraphs after it
CODE = re.compile(r"(`+)(?!`)(?:(?!\n[ \t]*\n).)+?(?<!`)\1(?!`)", re.S)
# any link into a records directory, and the complete form: a .json file and a figure key
RECORD_TARGET = re.compile(r"\]\(([^)\s]*records/[^)\s]*)\)")
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s#]*records/[^)\s#]+\.json)#([^)\s]+)\)")
BOLD = re.compile(r"(\*\*|__)((?:(?!\n[ \t]*\n).)+?)\1", re.S)
ANY_RECORD = re.compile(r"records/[\w.-]+\.json")
UNITS = (
    "x|%|ms|s|min|h|GiB|MiB|KiB|TiB|GB|MB|KB|TB|bytes|steps?|tok/s|tokens/s|tests|passed|"
    "samples|mutants"
)
FIGURE = re.compile(rf"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:{UNITS})(?![\w/])")


def _blank(m: re.Match[str]) -> str:
    """The match with every character but newlines replaced: offsets and line numbers stay."""
    return re.sub(r"[^\n]", " ", m.group())


def _prose(text: str) -> str:
    """The markdown with fenced blocks and inline code blanked out."""
    return CODE.sub(_blank, FENCE.sub(_blank, text))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _links() -> list[tuple[Path, int, str, Path, str]]:
    """(doc, line, link text, record path, key) of every record link in the docs."""
    out = []
    for doc in DOCS:
        text = FENCE.sub(_blank, doc.read_text())
        for m in LINK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append((doc, line, m.group(1), (doc.parent / m.group(2)).resolve(), m.group(3)))
    return out


def _records() -> dict[Path, dict]:
    return {p.resolve(): load_record(p) for p in sorted(RECORDS.glob("*.json"))}


def test_there_are_records_and_links() -> None:
    assert len(_records()) >= 10
    assert len(_links()) >= 100


def test_every_link_to_a_record_resolves_to_the_figure_it_prints() -> None:
    records = _records()
    bad = []
    for doc in DOCS:
        text = FENCE.sub(_blank, doc.read_text())
        for m in RECORD_TARGET.finditer(text):
            if not re.search(r"records/[^)\s#]+\.json#\S+$", m.group(1)):
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{_rel(doc)}:{line}: {m.group(1)!r} names no record and figure key")
        # a record named any other way (a link with a title, a reference-style link, HTML)
        spans = [m.span() for m in LINK.finditer(text)]
        for m in ANY_RECORD.finditer(text):
            if not any(a <= m.start() < b for a, b in spans):
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{_rel(doc)}:{line}: {m.group()!r} outside a [figure](record#key) link")
    for doc, line, text, path, key in _links():
        where = f"{_rel(doc)}:{line}: [{text}]"
        if path not in records:
            bad.append(f"{where}: no record {path}")
            continue
        figures = records[path]["figures"]
        if key not in figures:
            bad.append(f"{where}: {path.name} has no figure {key!r}")
        elif figures[key]["text"] != text:
            bad.append(
                f"{where}: {path.name}#{key} is {figures[key]['text']!r} (value "
                f"{figures[key]['value']!r}), the doc prints {text!r}"
            )
    assert not bad, "\n".join(bad)


def _commit_exists(commit: str) -> bool:
    """The commit is HEAD's or an ancestor's (not merely an object in the clone)."""
    sha = commit.removesuffix("+dirty")
    out = subprocess.run(
        ["git", "merge-base", "--is-ancestor", sha, "HEAD"], cwd=ROOT, capture_output=True
    )
    return out.returncode == 0


def test_every_record_is_complete_and_names_a_commit_in_history() -> None:
    bad = []
    for path, rec in _records().items():
        name = path.name
        missing = [
            k for k in ("name", "figures", "command", "date", "commit", "machine") if k not in rec
        ]
        if missing:
            bad.append(f"{name}: no {', '.join(missing)}")
            continue
        if rec["name"] != path.stem:
            bad.append(f"{name}: name {rec['name']!r} is not the file's")
        cmd = rec["command"]
        if not (
            (isinstance(cmd, str) and cmd.strip())
            or (isinstance(cmd, list) and cmd and all(isinstance(c, str) and c for c in cmd))
        ):
            bad.append(f"{name}: command {cmd!r} is no shell line or list of them")
        try:
            dt.datetime.fromisoformat(rec["date"])
        except (TypeError, ValueError):
            bad.append(f"{name}: date {rec['date']!r} is not ISO 8601")
        commit = str(rec["commit"])
        if not re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", commit):
            bad.append(f"{name}: commit {commit!r} is no short hash")
        elif not _commit_exists(commit.removesuffix("+dirty")):
            bad.append(f"{name}: commit {commit} is not in this repository's history")
        machine = rec["machine"]
        if not isinstance(machine, dict) or "cores" not in machine or "load" not in machine:
            bad.append(f"{name}: machine {machine!r} lacks cores or load")
        if not rec["figures"]:
            bad.append(f"{name}: no figures")
        for key, fig in rec["figures"].items():
            try:
                text = Figure.from_json(fig).text
            except (KeyError, TypeError, ValueError) as exc:
                bad.append(f"{name}#{key}: {exc!r}")
                continue
            if fig["text"] != text:
                bad.append(f"{name}#{key}: text {fig['text']!r}, but its value formats as {text!r}")
        if path.read_text() != dump(rec):
            bad.append(f"{name}: not in the records' format (sorted keys, indent 2, newline)")
    assert not bad, "\n".join(bad)


def test_every_bold_figure_in_the_docs_is_a_record_link() -> None:
    bad = []
    for doc in DOCS:
        text = _prose(doc.read_text())
        for span in BOLD.finditer(text):
            inner = LINK.sub(_blank, span.group(2))
            for m in FIGURE.finditer(inner):
                at = span.start(2) + m.start()
                line = text.count("\n", 0, at) + 1
                bad.append(
                    f"{_rel(doc)}:{line}: bold {m.group()!r} (in {span.group()!r}) has no "
                    "record: link it to one, or unbold it"
                )
    assert not bad, "\n".join(bad)


def test_no_record_is_an_orphan() -> None:
    linked: dict[Path, set[str]] = {}
    for _, _, _, path, key in _links():
        linked.setdefault(path, set()).add(key)
    bad = []
    for path, rec in _records().items():
        if path not in linked:
            bad.append(f"{path.name}: no doc links to it")
        elif "source" in rec:  # transcribed for the docs: every figure of it is quoted
            unused = sorted(set(rec["figures"]) - linked[path])
            if unused:
                bad.append(f"{path.name}: figures no doc links to: {unused}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("args", "text"),
    [
        ((1.3912, "x", 2), "1.39x"),
        ((17.6, "s", 1), "17.6 s"),
        ((2.18, "%", 2), "2.18 %"),
        ((1983, "min s"), "33 min 3 s"),
        ((60, "min"), "60 min"),
        ((0.79, "", 2), "0.79"),
        ((28.4, "GiB", 0, False), "28"),
    ],
)
def test_format_figure(args: tuple, text: str) -> None:
    value, unit, *rest = args
    digits = rest[0] if rest else 0
    shown = rest[1] if len(rest) > 1 else True
    assert format_figure(value, unit, digits, unit_shown=shown) == text
    assert format_figure(2402, "tests", 0, unit_shown=False, grouping=True) == "2,402"


def test_write_record_to_a_directory_of_ones_own(tmp_path: Path) -> None:
    path = write_record(
        "t", {"a": Figure(1.391, "x", 2)}, ["python", "bench/x.py"], load="idle", directory=tmp_path
    )
    rec = json.loads(path.read_text())
    assert path == tmp_path / "t.json"
    assert rec["figures"]["a"] == {"value": 1.391, "unit": "x", "digits": 2, "text": "1.39x"}
    assert rec["machine"]["load"] == "idle" and rec["machine"]["cores"] == os.cpu_count()
    assert path.read_text() == dump(rec)
    dt.datetime.fromisoformat(rec["date"])


def test_memory_py_record_flag_writes_the_plans_peaks(tmp_path: Path) -> None:
    example = ROOT / "examples" / "ppojob-7b-megatron-volcano.yaml"
    bench = [sys.executable, str(ROOT / "bench" / "memory.py"), str(example)]
    env = {**os.environ, "PPOJOB_RECORDS_DIR": str(tmp_path)}
    without = subprocess.run(bench, capture_output=True, text=True, timeout=300, env=env)
    assert without.returncode == 0, without.stderr
    assert not list(tmp_path.iterdir())  # off by default
    out = subprocess.run(
        [*bench, "--record", "plan", "--load", "test"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rec = json.loads((tmp_path / "plan.json").read_text())
    figures = rec["figures"]
    assert set(figures) == {"actor.peak", "critic.peak", "rollout.peak"}
    for key in figures:  # the record's text is the one the plan printed
        role = key.split(".")[0]
        assert f"{role}: peak {figures[key]['text']} of" in out.stdout
    assert rec["command"].startswith("python bench/memory.py ")
    assert rec["machine"]["load"] == "test"


def test_packing_lora_figures_are_the_ones_its_table_prints() -> None:
    from bench.packing_lora import packing_figures

    # the hidden-1024 run's update medians (bench/README.md): its ratios come out as printed
    out = {"padded": 13.22, "padded+budget": 9.51, "packed+budget": 7.47}
    figures = packing_figures({k: {"update_s": v} for k, v in out.items()})
    recorded = load_record(RECORDS / "packing_h1024_e6ffd82.json")["figures"]
    for key in ("budget.update_vs_padded", "packed_budget.update_vs_padded"):
        assert figures[key].text == recorded[key]["text"]
    assert figures["packed_budget.update_vs_previous"].text == "1.27x"
    assert figures["padded.update"].text == "13.22 s"
