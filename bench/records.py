"""Records of the figures the docs quote: one JSON file per run of a bench script.

A bench script given ``--record`` calls :func:`write_record`, which writes
``bench/records/<name>.json`` (or ``$PPOJOB_RECORDS_DIR/<name>.json``, or ``directory``): keys
sorted, indent 2, a trailing newline. The format::

    {
      "command": "python bench/flops.py ...",      # shell line(s): a string, or a list of them
      "commit": "abc1234",                         # git rev-parse --short HEAD; "+dirty" appended
                                                   # when the tree had uncommitted changes
      "date": "2026-12-07T10:11:12+00:00",         # UTC, ISO 8601 (a transcribed record: the day)
      "figures": {
        "<key>": {                                 # a key: letters, digits, "_", "-", "."
          "digits": 2,                             # decimals shown
          "text": "1.39x",                         # format_figure(value, unit, digits, ...):
          "unit": "x",                             #   exactly what the docs print
          "value": 1.39,
          ...                                      # optional: "unit_shown": false (the docs print
        }                                          #   the number alone), "grouping": true
      },                                           #   (thousands separated by ","), "note"
      "machine": {"cores": 2, "cpu": "...", "gpu": null, "load": "...", "ram_gib": 7.8},
      "name": "<name>",
      "source": "..."                              # optional: where the figures came from when
    }                                              # not from this file's writer (transcribed)

The docs link a figure to its record: ``[1.39x](bench/records/packing_lora.json#key)`` (the path
relative to the markdown file), and ``tests/bench/test_records.py`` fails when a link's text is
not the record's ``text``, a record lacks a field, or a bold figure in the docs has no record.
No torch or Ray here: the scripts import it before anything heavy.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS_DIR = ROOT / "bench" / "records"
ENV_DIR = "PPOJOB_RECORDS_DIR"
KEY = re.compile(r"^[A-Za-z0-9_.-]+$")
# units printed right after the number, without a space ("1.39x")
ATTACHED = {"x"}


def format_figure(
    value: float,
    unit: str,
    digits: int = 0,
    *,
    unit_shown: bool = True,
    grouping: bool = False,
) -> str:
    """The text the docs print for a figure: ``value`` with ``digits`` decimals, then the unit
    (``x`` attached, any other after a space; ``""`` none). ``unit`` ``"min s"``: ``value`` is
    seconds, printed as whole minutes and seconds ("33 min 3 s"). ``unit_shown=False``: the
    number alone (a doc that prints "22.8 vs 32.5 s"); ``grouping``: "2,402"."""
    if unit == "min s":
        minutes, seconds = divmod(round(value), 60)
        number = f"{minutes} min {seconds} s"
        return number if unit_shown else number.removesuffix(" s")
    number = f"{value:,.{digits}f}" if grouping else f"{value:.{digits}f}"
    if not unit or not unit_shown:
        return number
    return f"{number}{unit}" if unit in ATTACHED else f"{number} {unit}"


@dataclass(frozen=True)
class Figure:
    """One figure: its value, unit and decimals shown; ``text`` is what the docs print."""

    value: float
    unit: str = ""
    digits: int = 0
    unit_shown: bool = True
    grouping: bool = False
    note: str | None = None

    @property
    def text(self) -> str:
        return format_figure(
            self.value,
            self.unit,
            self.digits,
            unit_shown=self.unit_shown,
            grouping=self.grouping,
        )

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "value": self.value,
            "unit": self.unit,
            "digits": self.digits,
            "text": self.text,
        }
        if not self.unit_shown:
            out["unit_shown"] = False
        if self.grouping:
            out["grouping"] = True
        if self.note:
            out["note"] = self.note
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, object]) -> Figure:
        return cls(
            value=float(d["value"]),  # type: ignore[arg-type]
            unit=str(d["unit"]),
            digits=int(d["digits"]),  # type: ignore[call-overload]
            unit_shown=bool(d.get("unit_shown", True)),
            grouping=bool(d.get("grouping", False)),
            note=d.get("note"),  # type: ignore[arg-type]
        )


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def current_commit() -> str:
    """``git rev-parse --short HEAD``, with ``+dirty`` when tracked files have changes."""
    try:
        commit = _git("rev-parse", "--short", "HEAD")
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def machine(load: str | None = None) -> dict[str, object]:
    """This machine: cores, RAM, CPU model, GPUs (``nvidia-smi``, if any), and ``load``: a
    free-form note (default: the load averages now)."""
    cpu = None
    ram_gib = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram_gib = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    gpu = None
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
            gpu = ", ".join(out.splitlines()) or None
        except (OSError, subprocess.SubprocessError):
            gpu = None
    if load is None:
        one, five, fifteen = os.getloadavg()
        load = f"load average {one:.1f} / {five:.1f} / {fifteen:.1f} when the record was written"
    return {"cores": os.cpu_count(), "ram_gib": ram_gib, "cpu": cpu, "gpu": gpu, "load": load}


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that ran, as a shell line (``python bench/<script>.py ...``)."""
    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0].endswith(".py"):
        path = Path(argv[0]).resolve()
        if path.is_relative_to(ROOT):
            argv[0] = str(path.relative_to(ROOT))
        argv.insert(0, "python")
    return shlex.join(argv)


def records_dir(directory: str | os.PathLike[str] | None = None) -> Path:
    """``directory``, else ``$PPOJOB_RECORDS_DIR``, else ``bench/records``."""
    if directory is not None:
        return Path(directory)
    return Path(os.environ.get(ENV_DIR) or RECORDS_DIR)


def make_record(
    name: str,
    figures: Mapping[str, Figure],
    command: str | Sequence[str],
    *,
    load: str | None = None,
    date: str | None = None,
    commit: str | None = None,
    machine_info: Mapping[str, object] | None = None,
    source: str | None = None,
) -> dict[str, object]:
    """The record as a dict (see the module docstring); date, commit and machine are this
    run's unless given (a transcribed record gives them as the docs state them)."""
    if not KEY.match(name):
        raise ValueError(f"record name {name!r}: letters, digits, '_', '-' and '.' only")
    bad = [k for k in figures if not KEY.match(k)]
    if bad:
        raise ValueError(f"figure keys {bad}: letters, digits, '_', '-' and '.' only")
    if not figures:
        raise ValueError(f"record {name!r} has no figures")
    record: dict[str, object] = {
        "name": name,
        "command": command if isinstance(command, str) else list(command),
        "date": date or _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "commit": commit or current_commit(),
        "machine": dict(machine_info) if machine_info is not None else machine(load),
        "figures": {k: f.to_json() for k, f in figures.items()},
    }
    if source:
        record["source"] = source
    return record


def dump(record: Mapping[str, object]) -> str:
    """The file's text: keys sorted, indent 2, a trailing newline."""
    return json.dumps(record, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_record(
    name: str,
    figures: Mapping[str, Figure],
    command: str | Sequence[str] | None = None,
    *,
    load: str | None = None,
    directory: str | os.PathLike[str] | None = None,
    **fields: str | None,
) -> Path:
    """Write ``<records dir>/<name>.json`` and return its path. ``command`` defaults to this
    process's command line; ``load`` is the free-form note of the machine's load; ``fields``:
    ``date``, ``commit``, ``machine_info``, ``source`` (see :func:`make_record`)."""
    record = make_record(
        name,
        figures,
        command if command is not None else command_line(),
        load=load,
        **fields,  # type: ignore[arg-type]
    )
    out = records_dir(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(dump(record))
    print(f"record: {path}", flush=True)
    return path


def add_record_arguments(parser: object, default: str | None = None) -> None:
    """``--record [NAME]`` (off by default; NAME defaults to ``default``) and ``--load NOTE`` on
    a bench script's argparse parser."""
    parser.add_argument(  # type: ignore[attr-defined]
        "--record",
        nargs="?",
        const=default,
        metavar="NAME",
        help=f"write the printed figures to bench/records/NAME.json (default NAME: {default}; "
        f"${ENV_DIR} moves the directory)",
    )
    parser.add_argument(  # type: ignore[attr-defined]
        "--load", help="with --record: a note of the machine's load (default: load averages)"
    )


def load_record(path: str | os.PathLike[str]) -> dict[str, object]:
    return json.loads(Path(path).read_text())
