"""MLflow and W&B trackers (spec.trackers), each run read back with the library's own reader:
MLflow's client on a local file store, W&B's offline run file decoded with wandb's protobuf
records. Both get every step's metrics under the metrics.jsonl names, the resolved config (MLflow:
parameters; W&B: the run's config) and the output files as artifacts. A tracker that cannot be
reached, imported or authenticated is one warning, and the run goes on. No network: W&B runs
offline and its service listens on loopback (or a Unix socket) only."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from ppojob_api.validation import validate_manifest
from ppojob_trainer.progress import CompositeReporter, read_metrics
from ppojob_trainer.trackers import (
    MLFLOW_PARAM_VALUE_LIMIT,
    MlflowReporter,
    WandbReporter,
    local_reporters,
)
from tests.helpers.controlplane import ROOT
from tests.helpers.wandb_records import offline_run

TINY = yaml.safe_load((ROOT / "examples" / "ppojob-tiny.yaml").read_text())
STEPS = [
    {"reward/mean": 0.25, "kl/mean": 0.5, "kl/coef": 0.1, "time/step": 1.5, "note": "text"},
    {
        "reward/mean": 0.75,
        "kl/mean": 0.25,
        "kl/coef": 0.1,
        "time/step": 1.0,
        "critic/vf_loss": 0.125,
    },
]


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B offline, silent, its files and caches under tmp_path; no credentials anywhere."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_X_DISABLE_STATS", "true")
    for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    for var in ("WANDB_API_KEY", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(var, raising=False)


def _cfg(*trackers: dict[str, Any]) -> Any:
    doc = {**TINY, "spec": {**TINY["spec"], "trackers": list(trackers)}}
    return validate_manifest(doc).spec


def _drive(cfg: Any, out: Path) -> list[Any]:
    """metrics.jsonl, the curve and the trackers through the loop's calls (two steps)."""
    reporters = local_reporters(cfg, out, show_bar=False)
    both = CompositeReporter(reporters)
    both.start(2)
    for step, metrics in enumerate(STEPS, 1):
        both.report(step, metrics)
    both.finish({"steps": 2, "final_reward": 0.75})
    return reporters[1:]


def _numeric_names(out: Path) -> set[str]:
    return {
        k
        for r in read_metrics(out)
        for k, v in r.items()
        if isinstance(v, int | float) and k not in ("step", "elapsed_seconds")
    }


def test_mlflow_run_read_back_with_the_mlflow_client(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    store = f"file:{tmp_path / 'mlruns'}"
    out = tmp_path / "out"
    (tracker,) = _drive(_cfg({"type": "mlflow", "trackingUri": store, "experimentName": "e"}), out)
    assert isinstance(tracker, MlflowReporter) and tracker.disabled is None
    client = MlflowClient(tracking_uri=store)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "ppojob"
    assert client.get_experiment(run.info.experiment_id).name == "e"
    # every step's metrics, under the names of metrics.jsonl
    # (`kl` beside `kl/coef` keeps the loop's name, kl/mean: the file store cannot hold both)
    history = {
        key: [
            (m.step, m.value)
            for m in client.get_metric_history(tracker.run_id, "kl/mean" if key == "kl" else key)
        ]
        for key in _numeric_names(out)
    }
    assert history["reward_mean"] == [(1, 0.25), (2, 0.75)]
    assert history["kl"] == [(1, 0.5), (2, 0.25)]
    assert history["kl/coef"] == [(1, 0.1), (2, 0.1)]
    assert history["time/step"] == [(1, 1.5), (2, 1.0)]
    assert history["value_loss"] == [(2, 0.125)]
    assert "note" not in run.data.metrics
    assert run.data.metrics["summary/final_reward"] == 0.75
    # the resolved config as parameters, nested keys dotted, every value within MLflow's limit
    params = run.data.params
    assert params["data.prompts"] == "builtin:count-up"
    assert params["training.lrScheduler"] == "cosine"
    assert json.loads(params["trackers"])[0]["trackingUri"] == store
    assert max(len(v) for v in params.values()) <= MLFLOW_PARAM_VALUE_LIMIT
    # the reward curve, metrics.jsonl, the summary and the whole config as artifacts
    names = {f.path for f in client.list_artifacts(tracker.run_id)}
    assert {"reward_curve.png", "metrics.jsonl", "summary.json", "ppojob"} <= names
    png = Path(client.download_artifacts(tracker.run_id, "reward_curve.png", str(tmp_path)))
    assert png.read_bytes() == (out / "reward_curve.png").read_bytes()
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_mlflow_params_are_cut_at_the_value_limit(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    store = f"file:{tmp_path / 'mlruns'}"
    long = "x" * 2000
    reporter = MlflowReporter(store, "e", "r", {"a": {"b": long}, "n": [1, 2]}, tmp_path)
    reporter.start(1)
    reporter.finish({})
    params = MlflowClient(tracking_uri=store).get_run(reporter.run_id).data.params
    assert params["a.b"] == long[: MLFLOW_PARAM_VALUE_LIMIT - 3] + "..."
    assert params["n"] == "[1, 2]"


def test_a_resumed_run_goes_on_in_the_same_mlflow_run(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    store = f"file:{tmp_path / 'mlruns'}"
    first = MlflowReporter(store, "e", "r", {}, tmp_path)
    first.start(4)
    first.report(1, {"reward/mean": 0.1})
    first.fail("preempted")
    again = MlflowReporter(store, "e", "r", {}, tmp_path)
    again.start(4, start_step=1)
    again.report(2, {"reward/mean": 0.2})
    again.finish({})
    assert again.run_id == first.run_id
    client = MlflowClient(tracking_uri=store)
    assert [m.step for m in client.get_metric_history(first.run_id, "reward_mean")] == [1, 2]
    assert client.get_run(first.run_id).info.status == "FINISHED"
    fresh = MlflowReporter(store, "e", "r", {}, tmp_path)
    fresh.start(4)  # a fresh start is a new run
    assert fresh.run_id != first.run_id


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_warning(caplog: pytest.LogCaptureFixture) -> str:
    (warning,) = [
        r.getMessage()
        for r in caplog.records
        if r.name == "ppojob_trainer.trackers" and r.levelno >= logging.WARNING
    ]
    return warning


def test_an_unreachable_mlflow_server_is_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    uri = f"http://127.0.0.1:{_closed_port()}"
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING):
        (tracker,) = _drive(_cfg({"type": "mlflow", "trackingUri": uri}), out)
    assert tracker.disabled is not None
    warning = _one_warning(caplog)
    assert f"tracker mlflow ({uri}): start failed" in warning
    assert "training goes on without it" in warning
    assert [r["step"] for r in read_metrics(out)] == [1, 2]  # the run went on
    assert (out / "reward_curve.png").exists()


def test_a_missing_library_is_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow raises ImportError
    monkeypatch.setitem(sys.modules, "wandb", None)
    with caplog.at_level(logging.WARNING):
        ml, wb = _drive(
            _cfg(
                {"type": "mlflow", "trackingUri": f"file:{tmp_path / 'm'}"},
                {"type": "wandb", "project": "p", "mode": "offline"},
            ),
            tmp_path / "out",
        )
    warnings = [r.getMessage() for r in caplog.records if r.name == "ppojob_trainer.trackers"]
    assert len(warnings) == 2
    assert "tracker mlflow" in warnings[0] and "tracker wandb" in warnings[1]
    assert all("pip install 'ppojob[trackers]'" in w for w in warnings)
    assert ml.disabled and wb.disabled


LOOPBACK = ("127.0.0.1", "::1")


def _beyond_loopback(pids: set[int]) -> list[Any]:
    """The internet sockets of these processes that listen on, or talk to, another address."""
    return [
        c
        for c in psutil.net_connections(kind="inet")
        if c.pid in pids
        and (
            (c.status == psutil.CONN_LISTEN and c.laddr.ip not in LOOPBACK)
            or (c.raddr and c.raddr.ip not in LOOPBACK)
        )
    ]


def test_wandb_offline_run_read_back_from_its_run_file(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg = _cfg({"type": "wandb", "project": "ppo-demo", "mode": "offline", "runName": "tiny"})
    local, tracker = local_reporters(cfg, out, show_bar=False)
    assert isinstance(tracker, WandbReporter) and tracker.dir == out / "wandb"
    both = CompositeReporter([local, tracker])
    both.start(2)
    for step, metrics in enumerate(STEPS, 1):
        both.report(step, metrics)
    # W&B's service, while the run is open: no socket beyond loopback, listening or connected
    me = psutil.Process()
    pids = {me.pid, *(p.pid for p in me.children(recursive=True))}
    assert len(pids) > 1, "wandb's service process"
    assert _beyond_loopback(pids) == []
    both.finish({"steps": 2, "final_reward": 0.75})
    assert tracker.disabled is None
    run = offline_run(out / "wandb")
    assert (run["project"], run["name"], run["exit_code"]) == ("ppo-demo", "tiny", 0)
    # every step's metrics, under the names of metrics.jsonl
    assert sorted(run["history"]) == [1, 2]
    for step, row in run["history"].items():
        (line,) = [r for r in read_metrics(out) if r["step"] == step]
        for name in _numeric_names(out):
            assert row.get(name) == line.get(name), (step, name)
    assert run["history"][1]["reward_mean"] == 0.25 and run["history"][2]["time/step"] == 1.0
    assert "note" not in run["history"][1]
    assert run["summary"]["final_reward"] == 0.75
    # the resolved config
    assert run["config"]["data"]["prompts"] == "builtin:count-up"
    assert run["config"]["training"]["lrScheduler"] == "cosine"
    # the output files as an artifact
    (files,) = run["artifacts"].values()
    assert {"reward_curve.png", "metrics.jsonl", "summary.json"} <= set(files)


def test_wandb_run_file_is_complete_when_finish_returns_however_late_the_service_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run.finish()`` ends by only informing wandb's service that the run is over (no reply),
    and the service writes the run file out when it handles that message. Here the service is
    stopped (SIGSTOP) as that message goes out, as a loaded machine may leave it unscheduled,
    and resumed only when someone waits for it through wandb's teardown (or at the test's end):
    the reporter's finish must still return with the whole run in the file."""
    from wandb.sdk.lib.service.service_connection import ServiceConnection

    stopped: list[psutil.Process] = []
    inform_finish, teardown = ServiceConnection.inform_finish, ServiceConnection.teardown

    def inform_finish_to_a_stopped_service(self: Any, run_id: str) -> None:
        me = psutil.Process()
        (core,) = [p for p in me.children(recursive=True) if p.name() == "wandb-core"]
        core.suspend()
        stopped.append(core)
        inform_finish(self, run_id)

    def teardown_resuming_it(self: Any, exit_code: int) -> int | None:
        for core in stopped:
            core.resume()
        return teardown(self, exit_code)

    monkeypatch.setattr(ServiceConnection, "inform_finish", inform_finish_to_a_stopped_service)
    monkeypatch.setattr(ServiceConnection, "teardown", teardown_resuming_it)
    reporter = WandbReporter("ppo-demo", "lagging", tmp_path / "wandb", mode="offline")
    try:
        reporter.start(2)
        reporter.report(1, {"reward/mean": 0.5})
        reporter.report(2, {"reward/mean": 0.75})
        reporter.finish({"final_reward": 0.75})
        assert stopped, "the service was stopped while the run ended"
        run = offline_run(tmp_path / "wandb")
    finally:
        for core in stopped:
            with contextlib.suppress(psutil.NoSuchProcess):
                core.resume()
    assert reporter.disabled is None
    assert (run["project"], run["name"], run["exit_code"]) == ("ppo-demo", "lagging", 0)
    assert {s: r["reward_mean"] for s, r in run["history"].items()} == {1: 0.5, 2: 0.75}
    assert run["summary"]["final_reward"] == 0.75


def test_wandb_run_file_of_many_blocks_reads_back_whole(tmp_path: Path) -> None:
    """The run file's reader (tests/helpers/wandb_records.py) on a file of many 32 KiB blocks:
    a config record spanning three of them, 300 history records across block ends (with
    padding wherever a block's tail is shorter than a chunk header)."""
    blob = "".join(f"{i:05d}" for i in range(16000))  # 80 kB: a first, two middles, a last
    reporter = WandbReporter("p", "big", tmp_path / "wandb", mode="offline", config={"b": blob})
    reporter.start(300)
    for step in range(1, 301):
        reporter.report(step, {f"k{i}/v": step + i / 64 for i in range(24)})
    reporter.finish({})
    (path,) = (tmp_path / "wandb").glob("wandb/offline-run-*/run-*.wandb")
    assert path.stat().st_size > 8 * 32768
    run = offline_run(tmp_path / "wandb")
    assert run["config"]["b"] == blob and run["exit_code"] == 0
    assert sorted(run["history"]) == list(range(1, 301))
    assert all(r[f"k{i}/v"] == s + i / 64 for s, r in run["history"].items() for i in range(24))


def test_wandb_online_without_an_api_key_is_one_warning_not_a_prompt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WANDB_MODE")
    reporter = WandbReporter("p", "r", tmp_path / "wandb", mode="online", out_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        reporter.start(1)
        reporter.report(1, {"reward/mean": 0.5})
        reporter.finish({})
    warning = _one_warning(caplog)
    assert "tracker wandb (p, online): start failed" in warning and "WANDB_API_KEY" in warning
    assert not list(tmp_path.glob("wandb/wandb/*run-*"))


@pytest.mark.usefixtures("ray_session")
def test_ppojob_run_logs_to_every_tracker_and_survives_an_unreachable_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ppojob run` end to end (two short steps on the local Ray): the file-store MLflow run and
    the offline W&B run hold what metrics.jsonl holds; an MLflow server that is down is one
    warning and exit code 0."""
    from mlflow import MlflowClient

    from ppojob_cli.main import main as ppojob

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    store, down = f"file:{tmp_path / 'mlruns'}", f"http://127.0.0.1:{_closed_port()}"
    doc = {
        **TINY,
        "spec": {
            **TINY["spec"],
            "trackers": [
                {"type": "mlflow", "trackingUri": store, "runName": "tiny"},
                {"type": "wandb", "project": "ppo-demo", "mode": "offline"},
                {"type": "mlflow", "trackingUri": down},
            ],
        },
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"
    small = ["--set", "data.rolloutBatchSize=4", "--set", "training.miniBatchSize=32"]
    rc = ppojob(["run", str(job), "--steps", "2", "--out", str(out), "--no-progress", *small])
    assert rc == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "tracker " in line]
    assert len(warnings) == 1 and f"tracker mlflow ({down}): start failed" in warnings[0]
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs(
        [client.get_experiment_by_name(TINY["metadata"]["name"]).experiment_id]
    )
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    rewards = client.get_metric_history(run.info.run_id, "reward_mean")
    assert [(m.step, m.value) for m in rewards] == [(r["step"], r["reward_mean"]) for r in records]
    assert "reward_curve.png" in {f.path for f in client.list_artifacts(run.info.run_id)}
    wb = offline_run(out / "wandb")
    assert [wb["history"][r["step"]]["reward_mean"] for r in records] == [
        r["reward_mean"] for r in records
    ]
    assert wb["exit_code"] == 0
