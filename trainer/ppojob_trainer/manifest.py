"""Reading a PPOJob manifest for `ppojob run`: validation is the API's (`ppojob_api.validation`),
so a manifest that `kubectl apply` accepts runs locally unchanged, cluster fields included.

`--set KEY=VALUE` / `--unset KEY` change spec fields before validation (`ppojob_api.setflags`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ppojob_api.problems import Problem, SpecError
from ppojob_api.setflags import apply_spec_overrides, parse_set
from ppojob_api.training import TrainerConfig
from ppojob_api.yamlio import load_yaml_documents

__all__ = ["apply_spec_overrides", "config_from_doc", "load_manifest", "parse_set"]


def config_from_doc(doc: Any, source: str = "") -> TrainerConfig:
    """Validate a PPOJob document completely and return the trainer config of its spec."""
    from ppojob_api.validation import trainer_config_from_spec, validate_manifest

    job = validate_manifest(doc, source)
    return trainer_config_from_spec(job.spec, job_name=job.metadata.name)


def read_manifest_doc(path: str | Path) -> dict[str, Any]:
    """The single YAML document of a manifest file; SpecError if unreadable or not one mapping."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([Problem(source, f"cannot read: {exc}", "check the path")]) from None
    docs = [d for d in load_yaml_documents(text, source) if d is not None]
    if len(docs) != 1:
        raise SpecError(
            [
                Problem(
                    "<file>",
                    f"expected one PPOJob document, found {len(docs)}",
                    "put one PPOJob in the file",
                )
            ],
            source,
        )
    if not isinstance(docs[0], dict):
        raise SpecError(
            [
                Problem(
                    "<document>",
                    f"expected a mapping, got {type(docs[0]).__name__}",
                    "write a PPOJob manifest",
                )
            ],
            source,
        )
    return docs[0]


def load_manifest(
    path: str | Path, sets: Sequence[tuple[str, Any]] = (), unsets: Sequence[str] = ()
) -> tuple[dict[str, Any], TrainerConfig]:
    """Read a PPOJob manifest, apply spec overrides, validate; returns (document, config).

    Raises SpecError listing every problem (apiVersion, kind, unknown or invalid fields, and the
    semantic checks of both spec halves).
    """
    doc = apply_spec_overrides(read_manifest_doc(path), sets, unsets)
    return doc, config_from_doc(doc, str(path))
