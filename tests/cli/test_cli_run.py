"""`ppojob run` and `ppojob-train`: argument handling, error paths, and one real run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from ppojob_api.problems import SpecError
from ppojob_api.training import TrainerConfig
from ppojob_cli.main import main as ppojob
from ppojob_trainer import entrypoint, run_cmd
from ppojob_trainer.manifest import apply_spec_overrides, load_manifest, parse_set
from ppojob_trainer.progress import REQUIRED_KEYS, read_metrics

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "ppojob-tiny.yaml"
SMALL = ["--set", "data.rolloutBatchSize=4", "--set", "training.miniBatchSize=32"]


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replace the training by a recorder: what `ppojob run` would have trained."""
    calls: list[dict[str, Any]] = []

    def fake(cfg: TrainerConfig, out_dir: Path, num_cpus: int | None = None, **kw: Any) -> int:
        calls.append({"cfg": cfg, "out": out_dir, "num_cpus": num_cpus})
        return 0

    monkeypatch.setattr(run_cmd, "train_locally", fake)
    return calls


def write(tmp_path: Path, doc: Any, name: str = "job.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc) if not isinstance(doc, str) else doc)
    return str(path)


def tiny_doc() -> dict[str, Any]:
    return yaml.safe_load(TINY.read_text())


# ---------------------------------------------------------------------------------------------
# ppojob run: argument handling (no training)
# ---------------------------------------------------------------------------------------------
def test_overrides_steps_seed_and_default_out(captured, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    rc = ppojob(
        [
            "run",
            str(TINY),
            "--steps",
            "5",
            "--seed",
            "3",
            "--num-cpus",
            "2",
            "--set",
            "training.learningRate=1e-4",
        ]
    )
    assert rc == 0
    (call,) = captured
    cfg = call["cfg"]
    assert (cfg.training.steps, cfg.training.seed, cfg.training.learning_rate) == (5, 3, 1e-4)
    assert cfg.job_name == "tiny-count-up" and call["num_cpus"] == 2
    assert call["out"] == Path("ppojob-out/tiny-count-up")
    assert (tmp_path / "ppojob-out" / "tiny-count-up").is_dir()


def test_grpo_from_the_same_manifest_with_one_field_changed(captured, tmp_path) -> None:
    out = tmp_path / "grpo"
    rc = ppojob(["run", str(TINY), "--set", "algorithm.advantageEstimator=grpo", "--out", str(out)])
    assert rc == 0
    cfg = captured[0]["cfg"]
    assert cfg.algorithm.advantage_estimator == "grpo" and not cfg.algorithm.needs_critic
    assert captured[0]["out"] == out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--steps", "0"], "spec.training.steps"),
        (["--steps", "many"], "spec.training.steps"),
        (["--set", "roles.actor.replica=2"], "spec.roles.actor.replica: unknown field"),
        (["--set", "noequals"], "expected KEY=VALUE"),
        (["--set", "data.prompts.x=1"], "spec.data.prompts is a str, not a mapping"),
        (["--set", "algorithm.advantageEstimator=ppo"], "advantageEstimator"),
        (
            ["--set", "algorithm.advantageEstimator=grpo", "--set", "roles.critic.replicas=1"],
            "spec.roles.critic",
        ),
        (["--num-cpus", "0"], "--num-cpus must be >= 1"),
    ],
)
def test_bad_input_exits_1_with_the_field_and_no_traceback(
    captured, capsys, argv: list[str], expected: str
) -> None:
    assert ppojob(["run", str(TINY), *argv]) == 1
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert captured == []


def test_bad_files_exit_1(captured, capsys, tmp_path) -> None:
    cases = {
        str(tmp_path / "missing.yaml"): "cannot read",
        write(tmp_path, "a: [1,", "broken.yaml"): "not valid YAML",
        write(tmp_path, {**tiny_doc(), "kind": "RayJob"}, "kind.yaml"): "kind: expected 'PPOJob'",
        write(tmp_path, "---\n" + TINY.read_text() + "---\n" + TINY.read_text(), "two.yaml"): (
            "expected one PPOJob document, found 2"
        ),
    }
    for path, expected in cases.items():
        assert ppojob(["run", path]) == 1, path
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err, err
    assert captured == []


def test_cluster_fields_are_accepted_and_unset_restores_a_default(tmp_path) -> None:
    doc = tiny_doc()
    doc["spec"]["suspend"] = False
    doc["spec"]["scheduling"] = {"gangScheduler": "none", "timeoutSeconds": 42}
    doc["spec"]["roles"]["critic"] = {"colocateWithActor": True}
    path = write(tmp_path, doc)
    with pytest.raises(SpecError, match=r"spec\.roles\.critic"):
        load_manifest(path, [("algorithm.advantageEstimator", "grpo")])
    _, cfg = load_manifest(path, [("algorithm.advantageEstimator", "grpo")], ["roles.critic"])
    assert cfg.placement_timeout_seconds == 42 and cfg.roles.critic is None


def test_parse_set_values_are_yaml_and_overrides_do_not_mutate() -> None:
    assert parse_set("training.learningRate=3e-4") == ("training.learningRate", 3e-4)
    assert parse_set("data.prompts=a=b.jsonl") == ("data.prompts", "a=b.jsonl")
    assert parse_set("spec.data.shuffle=false") == ("spec.data.shuffle", False)
    assert parse_set("algorithm.valueClip=null") == ("algorithm.valueClip", None)
    doc = {"spec": {"training": {"steps": 1}}}
    new = apply_spec_overrides(doc, [("spec.training.steps", 2), ("data.temperature", 0.5)])
    assert new["spec"] == {"training": {"steps": 2}, "data": {"temperature": 0.5}}
    assert doc == {"spec": {"training": {"steps": 1}}}


# ---------------------------------------------------------------------------------------------
# ppojob-train
# ---------------------------------------------------------------------------------------------
def trainer_config_file(tmp_path: Path, estimator: str = "gae") -> str:
    sets = [("algorithm.advantageEstimator", estimator)]
    _, cfg = load_manifest(TINY, sets)
    doc = cfg.model_dump(by_alias=True, exclude_unset=True, mode="json")
    return write(tmp_path, doc, "trainer.yaml")


def test_critic_override_file_is_merged_onto_the_config(tmp_path) -> None:
    cfg = TrainerConfig.model_validate(
        yaml.safe_load(Path(trainer_config_file(tmp_path)).read_text())
    )
    cfg = cfg.model_copy(deep=True)
    merged = entrypoint.apply_critic_override_file(cfg, {"learning_rate": 1e-5, "ppoEpochs": 2})
    critic = merged.critic_training()
    assert (critic.learning_rate, critic.ppo_epochs) == (1e-5, 2)
    assert merged.training.learning_rate == cfg.training.learning_rate  # actor unchanged
    again = entrypoint.apply_critic_override_file(merged, {"learningRate": 2e-5})
    assert again.critic_training().learning_rate == 2e-5  # file wins, whatever the spelling
    assert again.critic_training().ppo_epochs == 2


def test_entrypoint_rejects_bad_config_and_override_files(tmp_path, capsys) -> None:
    good = trainer_config_file(tmp_path)
    bad_override = write(tmp_path, {"critic": [{"name": "x", "overrides": {"gpus": 2}}]}, "c.yaml")
    assert entrypoint.main(["--config", good, "--critic-config-path", bad_override]) == 1
    assert "may not change GPU allocation" in capsys.readouterr().err
    grpo = trainer_config_file(tmp_path, "grpo")
    override = write(tmp_path, {"critic": [{"name": "x", "overrides": {"lr": 1e-5}}]}, "c2.yaml")
    assert entrypoint.main(["--config", grpo, "--critic-config-path", override]) == 1
    assert "uses no critic" in capsys.readouterr().err
    broken = write(tmp_path, {"training": {"steps": 0}}, "broken.yaml")
    assert entrypoint.main(["--config", broken]) == 1
    err = capsys.readouterr().err
    assert "broken.yaml" in err and "training.steps" in err and "Traceback" not in err
    missing = str(tmp_path / "nope.yaml")
    assert entrypoint.main(["--config", missing, "--critic-config-path", override]) == 1


# ---------------------------------------------------------------------------------------------
# A real run (loopback Ray from the module fixture; `ppojob run` leaves a caller's Ray running)
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ppojob_run_trains_and_prints_a_summary(local_ray, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    rc = ppojob(["run", str(TINY), "--steps", "2", "--out", str(out), "--no-progress", *SMALL])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "tiny-count-up finished" in captured.out
    assert "steps:         2 of 2" in captured.out and f"output:        {out}" in captured.out
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    assert all(set(REQUIRED_KEYS) <= set(r) for r in records)
    assert (out / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((out / "summary.json").read_text())
    assert isinstance(summary["final_reward"], float)

    # The same command again: nothing to train; it says so and how to go on, and keeps the files.
    before = (out / "summary.json").read_text(), (out / "metrics.jsonl").read_text()
    rc = ppojob(["run", str(TINY), "--steps", "2", "--out", str(out), "--no-progress", *SMALL])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "is already complete: 2 of 2 steps" in captured.out
    assert "to start fresh:    --out NEW_DIR" in captured.out and "n/a" not in captured.out
    assert ((out / "summary.json").read_text(), (out / "metrics.jsonl").read_text()) == before

    # More steps resume from the checkpoint: step 3 is appended, steps 1-2 are kept.
    rc = ppojob(["run", str(TINY), "--steps", "3", "--out", str(out), "--no-progress", *SMALL])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "steps:         3 of 3" in captured.out and "final reward:  n/a" not in captured.out
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


@pytest.mark.slow
def test_a_worker_that_cannot_start_ends_the_run_with_one_line(local_ray, tmp_path, capsys) -> None:
    """What the pre-flight cannot see (a model directory whose config.json holds no model) ends
    the run when a worker starts: one line naming the field, no Ray traceback."""
    empty = tmp_path / "empty-model"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    out = tmp_path / "out"
    argv = ["run", str(TINY), "--steps", "1", "--out", str(out), "--no-progress", *SMALL]
    rc = ppojob([*argv, "--set", f"model.path={empty}"])
    err = capsys.readouterr().err
    assert rc == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("ppojob run: the ") and "worker could not start: " in last, err
    assert ": model.path: " in last, last
    # told once, in that line: not again in a Ray worker's forwarded traceback
    assert "Traceback" not in err and "ActorDiedError" not in err
    assert err.count("Unrecognized model") == 1, err
    assert not (out / "summary.json").exists()


@pytest.mark.slow
def test_ppojob_run_that_cannot_be_placed_exits_2(local_ray, tmp_path, capsys) -> None:
    rc = ppojob(
        ["run", str(TINY), "--out", str(tmp_path), "--set", "roles.actor.resources.cpus=64"]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "cannot place the job" in err and "CPU: the job needs 64" in err
    assert "Traceback" not in err


def test_entrypoint_adds_the_kubernetes_reporter_from_the_env(tmp_path, monkeypatch) -> None:
    from ppojob_trainer.k8s_progress import KubernetesProgressReporter
    from ppojob_trainer.progress import LocalProgressReporter

    monkeypatch.delenv("PPOJOB_NAME", raising=False)
    assert len(entrypoint._reporters(tmp_path, show_bar=False).reporters) == 1
    monkeypatch.setenv("PPOJOB_NAME", "job-a")
    monkeypatch.setenv("PPOJOB_NAMESPACE", "team-b")
    local, kube = entrypoint._reporters(tmp_path, show_bar=False).reporters
    assert isinstance(local, LocalProgressReporter) and isinstance(kube, KubernetesProgressReporter)
    assert (kube.name, kube.namespace) == ("job-a", "team-b")


@pytest.mark.slow
def test_ppojob_train_runs_the_rendered_config_with_critic_overrides(
    local_ray, tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("PPOJOB_NAME", raising=False)
    sets = [("training.steps", 1), ("data.rolloutBatchSize", 4), ("training.miniBatchSize", 32)]
    _, cfg = load_manifest(TINY, sets)
    config = write(tmp_path, cfg.model_dump(by_alias=True, exclude_unset=True, mode="json"))
    critic = write(tmp_path, {"critic": [{"name": "c", "overrides": {"learningRate": 1e-4}}]}, "c")
    out = tmp_path / "out"
    argv = ["--config", config, "--critic-config-path", critic, "--out", str(out), "--no-progress"]
    rc = entrypoint.main(argv)
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "steps:         1 of 1" in captured.out
    assert [r["step"] for r in read_metrics(out)] == [1]


def test_a_reward_function_returning_the_wrong_count_is_one_line_naming_the_field(
    tmp_path, monkeypatch
) -> None:
    """At step time the error comes back from a Ray task: the root cause is what is printed."""
    from ray.exceptions import RayTaskError

    from ppojob_trainer.errors import describe_failure
    from ppojob_trainer.tasks import RewardScorer

    (tmp_path / "short_rewards.py").write_text("def score(p, c, l):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    scorer = RewardScorer("short_rewards:score", "data.jsonl")
    with pytest.raises(ValueError) as info:
        scorer(["a", "b"], ["x", "y"], [None, None])
    assert str(info.value).startswith("data.rewardFunction: reward function short_rewards:score")
    assert "expected 2, got 1" in str(info.value)
    wrapped = RayTaskError(
        "WorkerHost.generate", "Traceback (most recent call last):\n  ...", info.value
    ).as_instanceof_cause()
    line = describe_failure(wrapped)
    assert line.startswith("ValueError: data.rewardFunction: ") and "\n" not in line


def test_interrupted_is_printed_on_its_own_line(tmp_path, monkeypatch, capsys) -> None:
    from ppojob_trainer import runtime
    from ppojob_trainer.driver import run as driver_run

    def fake_train(cfg, out_dir, reporter):
        reporter.start(5)
        reporter.report(1, {"reward/mean": 0.5})
        raise KeyboardInterrupt

    monkeypatch.setattr(driver_run, "train", fake_train)
    monkeypatch.setattr(runtime, "start_local_ray", lambda num_cpus=None: None)
    monkeypatch.setattr(runtime, "shutdown_ray", lambda: None)
    rc = ppojob(["run", str(TINY), "--out", str(tmp_path)])  # with the progress bar
    err = capsys.readouterr().err
    assert rc == 130
    assert "\nppojob run: interrupted; run the same command again to resume" in err, repr(err)
    assert not (tmp_path / "summary.json").exists()


def test_critic_override_file_reads_1e_5_as_a_number() -> None:
    """Strict types must not turn away `learningRate: 1e-5` (a string to YAML 1.1)."""
    from ppojob_api.overrides import parse_critic_override_file

    text = "critic:\n- name: default\n  overrides:\n    learningRate: 1e-5\n"
    assert parse_critic_override_file(text) == {"learningRate": 1e-5}


@pytest.mark.slow
def test_one_local_runs_config_visits_no_module_more_than_4_times(local_ray, tmp_path) -> None:
    """Issue 39's reading test: from ``train_locally`` to the first step, the config (or a part
    of it) passes through each of our modules at most 4 times (distinct functions entered from
    elsewhere: tests/helpers/structure.py ConfigTrail). Before the driver package, ``loop.py``
    took it 13 times and ``placement.py`` 9 (placement helpers took the whole config)."""
    import sys

    from tests.helpers.structure import ConfigTrail

    trail = ConfigTrail("train_locally", until=("trainer", "step"))
    sys.setprofile(trail)
    try:
        rc = ppojob(["run", str(TINY), "--steps", "1", "--out", str(tmp_path / "run"), *SMALL])
    finally:
        sys.setprofile(None)
    assert rc == 0 and trail.done, trail.calls  # the first step was reached
    visits = trail.visits()
    # the story's pieces are all on it: the driver's modules, placement and the spec's helpers
    assert {"ppojob_trainer.driver.run", "ppojob_trainer.driver.topology"} <= set(visits), visits
    assert "ppojob_trainer.placement" in visits, visits
    assert max(visits.values()) <= 4, visits
