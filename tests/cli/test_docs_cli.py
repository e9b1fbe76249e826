"""The docs of `ppojob run`, its output files and the suspend/resume walk-through match the code."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import yaml

from ppojob_api.validation import validate_manifest
from ppojob_cli.main import build_parser
from ppojob_trainer.progress import REQUIRED_KEYS

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs" / "trainer-guide.md").read_text()
START = (ROOT / "docs" / "getting-started.md").read_text()


def _run_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]


def test_every_ppojob_run_flag_is_documented() -> None:
    flags = [
        opt
        for action in _run_parser()._actions
        for opt in action.option_strings
        if opt.startswith("--") and opt != "--help"
    ]
    assert {"--steps", "--set", "--unset", "--out", "--num-cpus", "--no-progress"} <= set(flags)
    table = GUIDE.split("## Running locally", 1)[1]
    for flag in flags:
        assert re.search(rf"^\| `{flag}[ `]", table, re.M), f"{flag} is not in the flag table"


def test_metrics_and_summary_keys_are_documented() -> None:
    from ppojob_trainer.driver import run as driver_run

    section = GUIDE.split("### The output directory", 1)[1]
    for key in REQUIRED_KEYS:
        assert f"`{key}`" in section, key
    # the keys the loop writes into summary.json (its reporter.finish call)
    source = Path(driver_run.__file__).read_text()
    call = source.split("reporter.finish(", 1)[1].split(")", 1)[0]
    keys = re.findall(r'"([\w.]+)":', call)
    assert keys, call
    for key in keys:
        assert f"`{key}`" in section, f"summary.json key {key} is not documented"


def test_the_suspend_resume_walk_through_uses_a_resumable_example() -> None:
    path = ROOT / "examples" / "ppojob-tiny-resumable.yaml"
    assert "examples/ppojob-tiny-resumable.yaml" in START
    job = validate_manifest(yaml.safe_load(path.read_text()))
    training = job.spec.training
    assert training.checkpoint_interval > 0 and training.checkpoint_dir.startswith("/")
    claim = job.spec.checkpoint_volume.persistent_volume_claim.claim_name
    walk = START.split("### Suspend and resume", 1)[1].split("\n## ", 1)[0]
    pvc = yaml.safe_load(walk.split("<<'YAML'\n", 1)[1].split("\nYAML", 1)[0])
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["metadata"]["name"] == claim
    name = job.metadata.name
    assert f"kubectl patch ppojob {name} " in walk and '"suspend":false' in walk
    assert f"step-{training.checkpoint_interval:06d}" in walk


def test_parquet_is_in_the_trainer_extra_it_is_advertised_with(tmp_path: Path) -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(dep.startswith("pyarrow") for dep in extras["trainer"])
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ppojob_trainer.tasks import _read_records

    file = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["1", "2"], "label": ["a", "b"]}), file)
    assert _read_records(file) == [{"prompt": "1", "label": "a"}, {"prompt": "2", "label": "b"}]
