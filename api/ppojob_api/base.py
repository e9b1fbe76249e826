"""The base of every PPOJob API model, and the patterns its fields share.

Imports neither torch nor ray nor kopf: the operator, the trainer and the CLI all stand on it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

HOOK_PATTERN = r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$"
URL_PATTERN = r"^https?://\S+$"
NAME_PATTERN = r"^[a-z0-9]([a-z0-9_.-]{0,61}[a-z0-9])?$"
"""A name that keys metrics (a reward source's): lowercase, at most 63 characters."""


class ApiModel(BaseModel):
    """Base of every API model: camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        # Types as the API server checks them: `steps: true` or `"3"` is not an integer, `1` not
        # a boolean; NaN and infinities are never numbers.
        strict=True,
        allow_inf_nan=False,
    )

    def explicit(self, name: str) -> bool:
        """Whether this field was given (as opposed to taking its default).

        Never use it to *validate*: the API server fills in the CRD's defaults before the operator
        reads a job, so a check based on presence gives a stored job another verdict than the
        manifest as written. Checks judge values (see `check_training_half`)."""
        return name in self.model_fields_set


def default_of(model: type[BaseModel], field: str) -> Any:
    """The default of a model field (what the API server fills in when it is omitted)."""
    return model.model_fields[field].get_default(call_default_factory=True)


def dump(model: ApiModel) -> dict[str, Any]:
    """Serialise a model the way it appears in Kubernetes (camelCase, no nulls)."""
    return model.model_dump(by_alias=True, exclude_none=True, mode="json")
