"""The `ppojob` command line: validate, crd, render, run.

Subcommands import what they need lazily, so `ppojob validate` works without torch or Ray.
Bad input never produces a traceback: every problem is printed with its file and field path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _cmd_validate(args: argparse.Namespace) -> int:
    from ppojob_api.problems import SpecError
    from ppojob_api.setflags import parse_set
    from ppojob_api.validation import load_manifests

    try:
        sets = [parse_set(s) for s in args.sets]
    except SpecError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    failed = 0
    for name in args.files:
        path = Path(name)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            print(f"{name}: cannot read: {_reason(exc)}", file=sys.stderr)
            failed += 1
            continue
        try:
            jobs = load_manifests(text, source=name, sets=sets, unsets=args.unsets)
        except SpecError as exc:
            print(str(exc), file=sys.stderr)
            failed += 1
            continue
        if args.pod_security and _pod_security_refused(name, jobs, args.pod_security):
            failed += 1
            continue
        names = ", ".join(j.metadata.name or "<unnamed>" for j in jobs)
        print(f"{name}: valid ({names})")
        _memory_warnings(name, jobs)
        if args.plan:
            for job in jobs:
                print(_plans(job))
    return 1 if failed else 0


def _pod_security_refused(name: str, jobs: list, level: str) -> bool:
    """Print what a namespace enforcing Pod Security ``level`` would refuse of each job's pods
    (``ppojob_api.checks.podsecurity``); whether anything is."""
    from ppojob_api.checks.podsecurity import check_pod_security, required_level

    refused = False
    for job in jobs:
        problems = check_pod_security(job.spec, level)
        if problems:
            refused = True
            head = f"{name}: {job.metadata.name or '<unnamed>'}: "
            head += f'refused under Pod Security "{level}" (needs "{required_level(job.spec)}"):'
            print("\n  - ".join([head, *map(str, problems)]), file=sys.stderr)
    return refused


def _plans(job: Any) -> str:
    """The memory plan and the time plan of one job, under a header naming it."""
    from ppojob_api.memory_plan import format_plan, gpu_gib_of, plan_job
    from ppojob_trainer.time_plan import format_time_plan, plan_time

    lines = [f"{job.metadata.name or '<unnamed>'}:"]
    actor = job.spec.roles.actor
    gib = gpu_gib_of(actor.node_selector, actor.resources.gpu_memory)
    memory = plan_job(job.spec, gib)
    lines.append(
        format_plan(memory, gib)
        if memory
        else f"memory: model {job.spec.model.path}: shape unknown"
    )
    timed = plan_time(job.spec)
    lines.append(
        format_time_plan(timed)
        if timed is not None
        else "time: no plan (the actor has no GPUs or the model's shape is unknown; a CPU job "
        "is timed by `ppojob run`)"
    )
    return "\n".join(lines)


def _reason(exc: Exception) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return "not a UTF-8 text file (a PPOJob manifest is YAML text)"
    return str(exc)


def _memory_warnings(name: str, jobs: list) -> None:
    """Warn (without failing) where a job's learning-rate warm-up outlasts its training (a plan
    that does not fit its GPUs is an error of validation: ppojob_api.checks.memory)."""
    for job in jobs:
        for warning in warmup_warnings(job):
            print(f"{name}: warning: {warning}", file=sys.stderr)


def warmup_warnings(job: Any) -> list[str]:
    """Learning-rate schedules that are legal but hardly meant: a warm-up at least as long as
    the run's optimizer updates, a decay longer than the updates after it
    (ppojob_api.checks.batches.schedule_warnings, the trainer's own count of updates)."""
    from ppojob_api.checks.batches import schedule_warnings

    return schedule_warnings(job.spec)


def _cmd_crd(args: argparse.Namespace) -> int:
    from ppojob_api.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def _cmd_render(args: argparse.Namespace) -> int:
    from ppojob_api.metadata import check_namespace
    from ppojob_api.problems import SpecError
    from ppojob_api.validation import load_manifests

    try:
        from ppojob_operator.builders import render_children_yaml
    except ImportError:  # pragma: no cover - the operator package is part of the distribution
        print("ppojob render needs the operator builders", file=sys.stderr)
        return 2
    bad_ns = check_namespace(args.namespace, "--namespace")
    if bad_ns:
        print(f"ppojob render: {bad_ns[0]}", file=sys.stderr)
        return 1
    path = Path(args.file)
    try:
        jobs = load_manifests(path.read_text(), source=args.file)
    except (OSError, UnicodeDecodeError) as exc:
        print(f"{args.file}: cannot read: {_reason(exc)}", file=sys.stderr)
        return 1
    except SpecError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    unnamed = [i + 1 for i, job in enumerate(jobs) if not job.metadata.name]
    if unnamed:
        print(
            f"{args.file}: metadata.name: required to render (document {unnamed[0]} has only "
            "generateName, which the API server resolves) (fix: set metadata.name)",
            file=sys.stderr,
        )
        return 1
    for job in jobs:
        sys.stdout.write(_plan_comment(job))
        sys.stdout.write(
            render_children_yaml(job, namespace=args.namespace, gang_default=args.gang_scheduler)
        )
    return 0


def _plan_comment(job: Any) -> str:
    """The job's memory plan as YAML comments (what `validate --plan` prints of it), so the
    rendered stream still applies."""
    from ppojob_api.memory_plan import format_plan, gpu_plans

    gib, plans = gpu_plans(job.spec)
    head = f"# memory plan of PPOJob {job.metadata.name} (per GPU, {gib:.0f} GiB GPUs):"
    if not plans:
        body = (
            "no GPU process, or the model's shape is unknown here (the trainer plans it at start)"
        )
        return f"{head} {body}\n"
    lines = format_plan(plans, gib).splitlines()
    return "\n".join([head, *(f"#   {line}" for line in lines)]) + "\n"


VALIDATE_HELP = (
    "Check PPOJob manifests offline, the way the operator judges a stored job: YAML syntax "
    "(duplicate keys, tabs, recursive aliases), apiVersion and kind, every field's type, range "
    "and spelling (camelCase, as the API server knows them), Kubernetes quantities (cpus, "
    "memory), metadata (name, labels, annotations), what reaches the pods (image, node "
    "selectors, tolerations, priority class, queue, env) by Kubernetes' own rules, and every "
    "semantic check of both halves (batch sizes, parallelism, colocation, KL, sizes). Each "
    "problem is one line: its field path, what is wrong, and a fix. Not checked here (only "
    "the cluster or the trainer can): that the image, the PVC, the PriorityClass, the queue or "
    "node labels exist, and paths inside the image or volumes (`ppojob run` checks local paths "
    "and hooks before it starts)."
)


def build_parser() -> argparse.ArgumentParser:
    from ppojob_api.setflags import add_set_arguments
    from ppojob_operator.scheduling import GANG_SCHEDULERS

    parser = argparse.ArgumentParser(
        prog="ppojob", description="PPO training of language models as a Kubernetes-native job."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "validate",
        help="check PPOJob manifests offline; exit 1 listing every problem",
        description=VALIDATE_HELP,
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="YAML files of PPOJob manifests")
    p.add_argument(
        "--plan",
        action="store_true",
        help="also print each job's memory plan (GiB per GPU) and time plan (seconds per step "
        "and for the job, with its assumptions)",
    )
    p.add_argument(
        "--pod-security",
        choices=["restricted", "baseline", "privileged"],
        help="also refuse a job whose pods the namespace's Pod Security level "
        "(pod-security.kubernetes.io/enforce) would refuse, naming the level each feature needs",
    )
    add_set_arguments(p, "check every job with")
    p.set_defaults(func=_cmd_validate)
    p = sub.add_parser(
        "crd",
        help="print the PPOJob CustomResourceDefinition",
        description=(
            "Print the PPOJob CustomResourceDefinition (apiextensions.k8s.io/v1) generated from "
            "the typed models: the schema the API server checks types, enums, bounds, quantity "
            "patterns and unknown fields with, and fills in defaults from. The same bytes as "
            "crds/ppojob.io_ppojobs.yaml and the Helm chart's crds/."
        ),
    )
    p.set_defaults(func=_cmd_crd)
    p = sub.add_parser("render", help="print the children the operator would create")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--namespace", default="default", help="namespace of the job (default: default)")
    p.add_argument(
        "--gang-scheduler",
        default=None,
        choices=GANG_SCHEDULERS,
        help="the operator's default gang scheduler, if any",
    )
    p.set_defaults(func=_cmd_render)
    try:
        from ppojob_trainer.run_cmd import add_run_parser
    except ImportError:
        pass
    else:
        add_run_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
