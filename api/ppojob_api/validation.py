"""A PPOJob manifest read the way the API server reads it, and judged once: schema, metadata, and
every semantic check of both halves."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ppojob_api.cel import bound_problems
from ppojob_api.checks import check_spec, check_training_half
from ppojob_api.metadata import check_metadata
from ppojob_api.problems import Problem, SpecError, pydantic_problems
from ppojob_api.spec import API_VERSION, KIND, PPOJob, PPOJobSpec
from ppojob_api.training import TrainerConfig, TrainingHalf
from ppojob_api.yamlio import load_yaml, load_yaml_documents


def validate_manifest(doc: Any, source: str = "") -> PPOJob:
    """Parse and validate one PPOJob document; raise SpecError listing every problem."""
    if doc is None:
        raise SpecError([Problem("<document>", "is empty", "write a PPOJob manifest")], source)
    if not isinstance(doc, dict):
        raise SpecError(
            [
                Problem(
                    "<document>",
                    f"expected a mapping, got {type(doc).__name__}",
                    "write a PPOJob manifest (apiVersion, kind, metadata, spec)",
                )
            ],
            source,
        )
    head: list[Problem] = []
    other_kind, other_group = doc.get("kind"), doc.get("apiVersion")
    if (
        isinstance(other_kind, str)
        and isinstance(other_group, str)
        and other_kind != KIND
        and not other_group.startswith("ppojob.io/")
    ):
        # another object (a PVC beside the job): not a PPOJob to repair
        raise SpecError(
            [
                Problem(
                    "kind",
                    f"this document is a {other_kind} ({other_group}), not a PPOJob; "
                    "ppojob validate checks PPOJob documents only",
                    f"keep the {other_kind} in a file of its own (kubectl apply -f both)",
                )
            ],
            source,
        )
    if doc.get("apiVersion") != API_VERSION:
        head.append(
            Problem(
                "apiVersion",
                f"expected {API_VERSION!r}, got {doc.get('apiVersion')!r}",
                f"set apiVersion: {API_VERSION}",
            )
        )
    if doc.get("kind") != KIND:
        head.append(
            Problem("kind", f"expected {KIND!r}, got {doc.get('kind')!r}", f"set kind: {KIND}")
        )
    if head:
        raise SpecError(head, source)
    body = prune_nulls({k: v for k, v in doc.items() if k != "status"})
    meta_problems = check_metadata(body.get("metadata")) + bound_problems(
        body.get("spec"), _schema()["properties"]["spec"]
    )
    try:
        # by alias only: the API server knows `learningRate`, never `learning_rate`
        job = PPOJob.model_validate(body, by_alias=True, by_name=False)
    except Exception as exc:  # pydantic.ValidationError
        # a metadata field already judged (`name: 123`) is reported once
        named = {p.path for p in meta_problems}
        rest = [p for p in pydantic_problems(exc) if p.path not in named]
        raise SpecError(meta_problems + rest, source) from None
    problems = meta_problems + check_spec(job.spec)
    if problems:
        raise SpecError(problems, source)
    return job


@functools.cache
def _schema() -> dict[str, Any]:
    from ppojob_api.crd import openapi_schema  # crd imports the models this module validates

    return openapi_schema()


def prune_nulls(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` as the API server reads it, so `ppojob validate` and the operator judge the same
    object: a null in a field that is not `nullable` is dropped before defaulting (and then takes
    its default), while nulls of nullable fields (where null means "off", like `valueClip: null`)
    are kept; a whole number written as a float (`steps: 100.0`, `1e3`) is an integer, as kubectl
    sends it."""

    def walk(node: Any, schema: dict[str, Any] | None) -> Any:
        if schema is None:
            return node
        if isinstance(node, dict):
            props = schema.get("properties") or {}
            extra = schema.get("additionalProperties")
            out = {}
            for key, value in node.items():
                sub = props.get(key, extra if isinstance(extra, dict) else None)
                if value is None and sub is not None and not sub.get("nullable"):
                    continue
                out[key] = walk(value, sub)
            return out
        if isinstance(node, list):
            return [walk(v, schema.get("items")) for v in node]
        if schema.get("type") == "integer" and isinstance(node, float) and node.is_integer():
            return int(node)
        return node

    return walk(doc, _schema())


def load_manifests(
    text: str,
    source: str = "",
    sets: Sequence[tuple[str, Any]] = (),
    unsets: Sequence[str] = (),
) -> list[PPOJob]:
    """Parse a YAML stream of PPOJobs (each with the ``--set``/``--unset`` changes applied, see
    ``setflags``); raise SpecError listing every problem of every document."""
    from ppojob_api.setflags import apply_spec_overrides

    docs = [d for d in load_yaml_documents(text, source) if d is not None] or [None]
    if sets or unsets:
        try:
            docs = [
                apply_spec_overrides(d, sets, unsets) if isinstance(d, dict) else d for d in docs
            ]
        except SpecError as exc:
            raise SpecError(exc.problems, source) from None
    jobs, problems = [], []
    for i, doc in enumerate(docs):
        try:
            jobs.append(validate_manifest(doc))
        except SpecError as exc:
            prefix = f"document {i + 1}: " if len(docs) > 1 else ""
            problems += [Problem(prefix + p.path, p.message, p.fix) for p in exc.problems]
    if problems:
        raise SpecError(problems, source)
    first: dict[tuple[str | None, str], int] = {}
    for i, job in enumerate(jobs):
        key = (job.metadata.namespace, job.metadata.name or "")
        if job.metadata.name and key in first:
            problems.append(
                Problem(
                    f"document {i + 1}: metadata.name",
                    f"{job.metadata.name!r} is also the name of document {first[key] + 1}: "
                    "`kubectl apply` would make this one replace it",
                    "give each job its own name",
                )
            )
        first.setdefault(key, i)
    if problems:
        raise SpecError(problems, source)
    return jobs


def trainer_config_from_spec(spec: PPOJobSpec, job_name: str | None = None) -> TrainerConfig:
    """The trainer's config: the training half of the spec plus the placement timeout."""
    half = {name: getattr(spec, name) for name in TrainingHalf.model_fields}
    return TrainerConfig(
        **half,
        placement_timeout_seconds=spec.scheduling.timeout_seconds,
        job_name=job_name,
        stall_timeout_seconds=spec.failure_policy.stall_timeout_seconds or None,
    )


_CONFIG_FORM = (
    "write the training half of a PPOJob spec (model, roles, algorithm, data, training) as a "
    "YAML mapping, as the operator renders it into the trainer's ConfigMap"
)


def load_trainer_config(path: str | Path) -> TrainerConfig:
    """Read a trainer config file (the ConfigMap's YAML) and validate it completely. An empty
    file, a file that is not UTF-8 text, and a PPOJob manifest are refused in one line each."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError:
        raise SpecError(
            [Problem(source, "is not a UTF-8 text file (a trainer config is YAML)", _CONFIG_FORM)]
        ) from None
    doc = load_yaml(text, source)
    if doc is None:
        raise SpecError([Problem(source, "is empty", _CONFIG_FORM)])
    if not isinstance(doc, dict):
        raise SpecError(
            [Problem(source, f"expected a mapping, got {type(doc).__name__}", _CONFIG_FORM)]
        )
    if "apiVersion" in doc or "kind" in doc:
        raise SpecError(
            [
                Problem(
                    source,
                    f"is a {doc.get('kind') or 'Kubernetes'} manifest, not a trainer config",
                    f"run a PPOJob manifest with `ppojob run {source}` (or `kubectl apply -f` "
                    "it); ppojob-train reads the config the operator renders from its spec",
                )
            ]
        )
    try:
        # by alias only, as for a manifest: `learning_rate` is not `learningRate`
        cfg = TrainerConfig.model_validate(doc, by_alias=True, by_name=False)
    except Exception as exc:
        raise SpecError(pydantic_problems(exc), source) from None
    problems = check_training_half(cfg, prefix="config")
    if problems:
        raise SpecError(problems, source)
    return cfg
