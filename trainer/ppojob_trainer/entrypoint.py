"""`ppojob-train`: the trainer's entrypoint inside the cluster (the RayJob's submitted command).

    ppojob-train --config /etc/ppojob/trainer.yaml [--critic-config-path FILE] [--out DIR]

Reads the trainer config rendered by the operator (`config.load_trainer_config`), applies the
critic overrides file (`critic: [{name, overrides}]`) on top of the config's critic overrides,
connects to the job's Ray cluster (`RAY_ADDRESS`, set by KubeRay) or starts a loopback-only local
one, and trains. Progress goes to the local reporter and, when `PPOJOB_NAME` and
`PPOJOB_NAMESPACE` are set, to the PPOJob's `status.progress` (`ppojob_trainer.k8s_progress`).
Before Ray it runs the pre-flight of `ppojob run` (`ppojob_trainer.preflight`: dataset and model
paths, hook modules and signatures) in the image the job runs in.
Exit codes: 0 done, 1 bad config (or pre-flight), 2 training or placement failed, 75 preempted
(SIGTERM or the stop file of the head's preStop hook: the step in flight finished and
checkpointed).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from ppojob_api.checks import check_training_half
from ppojob_api.overrides import parse_critic_override_file
from ppojob_api.problems import Problem, SpecError, pydantic_problems
from ppojob_api.training import CriticRole, TrainerConfig
from ppojob_api.validation import load_trainer_config

log = logging.getLogger("ppojob_trainer.entrypoint")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ppojob-train",
        description=(
            "Run the PPO trainer inside a PPOJob's Ray cluster. --config is the trainer config "
            "the operator renders into the job's ConfigMap: the training half of a PPOJob spec "
            "(model, roles, algorithm, data, training) as YAML, not a PPOJob manifest (run "
            "one of those with `ppojob run`). It is checked completely (fields, types, every "
            "semantic check of `ppojob validate`) before Ray starts; exit 1 names each problem."
        ),
    )
    p.add_argument(
        "--config",
        required=True,
        metavar="FILE",
        help="trainer config: YAML with model, roles, algorithm, data, training (camelCase keys)",
    )
    p.add_argument(
        "--critic-config-path",
        metavar="FILE",
        default=None,
        help="critic overrides file: `critic: [{name: default, overrides: {learningRate: 1e-5}}]`",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        default=None,
        help="output directory (default: $PPOJOB_OUTPUT_DIR, else ./ppojob-out/<job name>)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _norm(key: str) -> str:
    return re.sub(r"[^a-z0-9]", "", str(key).lower())


def apply_critic_override_file(
    cfg: TrainerConfig, overrides: dict[str, Any], source: str = "critic config"
) -> TrainerConfig:
    """`cfg` with `overrides` merged onto its critic's overrides (the file wins per key, whatever
    its spelling), revalidated as a whole."""
    if not overrides:
        return cfg
    if not cfg.algorithm.needs_critic:
        raise SpecError(
            [
                Problem(
                    "critic[0].overrides",
                    f"advantageEstimator {cfg.algorithm.advantage_estimator} uses no critic",
                    "drop --critic-config-path or use gae",
                )
            ],
            source,
        )
    critic = cfg.roles.effective_critic(True) or CriticRole(colocate_with_actor=True)
    file_keys = {_norm(k) for k in overrides}
    merged = {k: v for k, v in critic.overrides.items() if _norm(k) not in file_keys}
    merged.update(overrides)
    doc = cfg.model_dump(by_alias=True, exclude_unset=True)
    roles = doc.setdefault("roles", {})
    crit = roles.get("critic") or {"colocateWithActor": True}
    crit["overrides"] = merged
    roles["critic"] = crit
    try:
        new = TrainerConfig.model_validate(doc)
    except Exception as exc:  # pydantic.ValidationError
        raise SpecError(pydantic_problems(exc, "config"), source) from None
    problems = check_training_half(new, prefix="config")
    if problems:
        raise SpecError(problems, source)
    return new


def _reporters(out_dir: Path, show_bar: bool, cfg: Any = None) -> Any:
    from ppojob_trainer.progress import CompositeReporter, LocalProgressReporter
    from ppojob_trainer.trackers import local_reporters

    reporters: list[Any] = (
        [LocalProgressReporter(out_dir, show_bar=show_bar)]
        if cfg is None
        else local_reporters(cfg, out_dir, show_bar)
    )
    name, namespace = os.environ.get("PPOJOB_NAME"), os.environ.get("PPOJOB_NAMESPACE")
    if name and namespace:
        try:
            mod = importlib.import_module("ppojob_trainer.k8s_progress")
        except ModuleNotFoundError as exc:
            if exc.name != "ppojob_trainer.k8s_progress":
                raise
            log.warning(
                "PPOJOB_NAME is set but ppojob_trainer.k8s_progress is missing; "
                "progress is not written to the PPOJob status"
            )
        else:
            reporters.append(mod.KubernetesProgressReporter(name=name, namespace=namespace))
    return CompositeReporter(reporters)


def main(argv: list[str] | None = None) -> int:
    """Run the trainer; returns the exit code."""
    args = build_parser().parse_args(argv)
    from ppojob_trainer.run_cmd import _configure_logging, format_summary

    _configure_logging()
    try:
        cfg = load_trainer_config(args.config)
        if args.critic_config_path:
            path = Path(args.critic_config_path)
            try:
                text = path.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise SpecError(
                    [Problem(str(path), f"cannot read: {exc}", "check the path")]
                ) from None
            overrides = parse_critic_override_file(text, str(path))
            cfg = apply_critic_override_file(cfg, overrides, str(path))
    except OSError as exc:
        print(f"ppojob-train: {args.config}: cannot read: {exc}", file=sys.stderr)
        return 1
    except SpecError as exc:
        print(f"ppojob-train: {exc}", file=sys.stderr)
        return 1
    out_dir = args.out or Path(
        os.environ.get("PPOJOB_OUTPUT_DIR") or Path("ppojob-out") / (cfg.job_name or "job")
    )
    try:
        from ppojob_trainer.driver.run import train
    except ImportError as exc:
        from ppojob_trainer.run_cmd import missing_trainer_extra

        print(f"ppojob-train: {missing_trainer_extra(exc)}", file=sys.stderr)
        return 2
    import ray

    from ppojob_trainer.errors import StartupError, describe_failure
    from ppojob_trainer.placement import GangIncompleteError, PlacementError
    from ppojob_trainer.preemption import PREEMPTED_EXIT_CODE, Preempted
    from ppojob_trainer.preflight import preflight
    from ppojob_trainer.runtime import connect_ray, shutdown_ray
    from ppojob_trainer.watchdog import StallError

    owns_ray = not ray.is_initialized()
    t0 = time.monotonic()
    reporter: Any = None
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        reporter = _reporters(out_dir, show_bar=not args.no_progress, cfg=cfg)
        problems = preflight(cfg)  # as `ppojob run` does: before Ray, in the image the job runs
        if problems:
            reporter.fail("; ".join(problems))  # reaches the PPOJob's Failed condition
            print(f"ppojob-train: {args.config}: " + "; ".join(problems), file=sys.stderr)
            return 1
        connect_ray()
        result = train(cfg, out_dir, reporter)
    except Preempted as exc:
        # A SIGTERM (or the head's preStop stop file) answered with a checkpoint: the operator
        # restarts the job from it without counting the restart (spec.failurePolicy).
        if reporter is not None:
            reporter.fail(f"{exc.reason}: {exc}")
        print(f"ppojob-train: {exc.reason}: {exc}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    except StallError as exc:
        # names the role, rank and phase that did not report; the failure policy restarts
        # (spec.failurePolicy.onStall) from the newest checkpoint
        if reporter is not None:
            reporter.fail(f"{exc.reason}: {exc}")
        print(f"ppojob-train: {exc.reason}: {exc}", file=sys.stderr)
        return 2
    except GangIncompleteError as exc:
        # `<Reason>: ...` reaches the PPOJob (status.progress.error, and the RayJob's message,
        # where Ray keeps the entrypoint's last log lines); the operator makes it the Failed
        # condition's reason.
        if reporter is not None:
            reporter.fail(f"{exc.reason}: {exc}")
        print(f"ppojob-train: {exc.reason}: {exc}", file=sys.stderr)
        return 2
    except PlacementError as exc:
        if reporter is not None:
            reporter.fail(describe_failure(exc))
        print(f"ppojob-train: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        log.debug("training failed", exc_info=True)
        message = describe_failure(exc)
        if not isinstance(exc, StartupError):
            message = f"training failed: {message}"
        if reporter is not None:
            reporter.fail(message)  # reaches the PPOJob's Failed condition on a cluster
        print(f"ppojob-train: {message}", file=sys.stderr)
        return 2
    finally:
        if owns_ray:
            shutdown_ray()
    print(format_summary(cfg, result, out_dir, time.monotonic() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
