"""Kubernetes resource quantities, read as Kubernetes reads them.

The grammar is k8s.io/apimachinery's `resource.Quantity` (pkg/api/resource/quantity.go):

    <quantity> ::= <signedNumber><suffix>
    <suffix>   ::= <binarySI> | <decimalExponent> | <decimalSI>
    binarySI: Ki Mi Gi Ti Pi Ei; decimalSI: m "" k M G T P E; decimalExponent: e<n> or E<n>

so `500m` is half a core, `2e9` and `2G` are 2,000,000,000 bytes, `2Gi` is 2 x 2^30 bytes, and a
bare number is cores for CPU and bytes for memory (`memory: 2048` is 2 KiB, as in a pod). Both
YAML numbers (`cpus: 1.5`, `memory: 2048`) and strings (`cpus: "500m"`) are quantities.

The CRD gives these fields `x-kubernetes-preserve-unknown-fields` (any JSON value: a CRD's
`x-kubernetes-int-or-string` would refuse `cpus: 1.5`, which a pod takes) and the pattern below,
which the API server applies to strings; `ppojob validate` and the operator apply the same
pattern and refuse what is not a positive quantity. The pattern is the one controller-gen writes
for a `resource.Quantity` field.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

from pydantic import BeforeValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_QUANTITY = re.compile(QUANTITY_PATTERN)
_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_SUFFIX |= {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": 10**3}
_SUFFIX |= {"M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}


def quantity_value(value: str | int | float) -> float:
    """The number a Kubernetes quantity stands for (`500m` -> 0.5, `2Gi` -> 2147483648.0,
    `2e9` -> 2e9). Raises ValueError for anything Kubernetes would refuse."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a quantity")
    if isinstance(value, int | float):
        return float(value)
    text = value.strip() if isinstance(value, str) else value
    if not isinstance(text, str) or text != value or not _QUANTITY.fullmatch(text):
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    number = text.rstrip("KMGTPEinumk")
    suffix = text[len(number) :]
    try:
        if suffix:
            return float(Decimal(number) * _SUFFIX[suffix])
        return float(Decimal(number))  # a plain number or one with an exponent (2e9)
    except (InvalidOperation, KeyError):
        raise ValueError(f"{value!r} is not a Kubernetes quantity") from None


_CPU_FIX = 'write cores as a number (2, 0.5) or a quantity string such as "500m" (0.5 cores)'
_MEMORY_FIX = (
    'write a quantity such as "16Gi" (2^30 bytes each) or "2G" (10^9); a bare number is bytes'
)


def _quantity(value: Any, fix: str) -> tuple[float, Any]:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise PydanticCustomError(
            "k8s_quantity",
            "expected a number or a Kubernetes quantity string, got {kind}",
            {"kind": type(value).__name__, "fix": fix},
        )
    try:
        number = quantity_value(value)
    except ValueError:
        raise PydanticCustomError(
            "k8s_quantity",
            "{shown} is not a Kubernetes quantity (a number with an optional suffix: m, k, M, G, "
            "Ki, Mi, Gi, ... or an exponent such as e9)",
            {"shown": repr(value)[:40], "fix": fix},
        ) from None
    if not number > 0:
        raise PydanticCustomError(
            "k8s_quantity", "{shown} must be more than 0", {"shown": repr(value)[:40], "fix": fix}
        )
    return number, value


def _cpu(value: Any) -> float:
    number = _quantity(value, _CPU_FIX)[0]
    if number < 0.001:  # the pod would get cpu: 0 (Kubernetes counts CPU in whole millicores)
        raise PydanticCustomError(
            "k8s_quantity",
            "{shown} is less than 1m, Kubernetes' smallest CPU unit (the pod would get 0)",
            {"shown": repr(value)[:40], "fix": 'use at least 0.001 cores ("1m")'},
        )
    return number


MIN_MEMORY = 2**20
"""Less than this is no memory for a container at all: `memory: 2048` is 2 KiB (a bare number is
bytes), almost always meant as 2048Mi or 2Gi."""


def _memory(value: Any) -> str:
    number, raw = _quantity(value, _MEMORY_FIX)
    if number < MIN_MEMORY:
        raise PydanticCustomError(
            "k8s_quantity",
            "{shown} is {n} bytes, too little for a container ({unit})",
            {
                "shown": repr(raw)[:40],
                "n": f"{number:,.0f}",
                "unit": "a bare number is bytes, as in Kubernetes"
                if isinstance(raw, int | float) or is_bare_number(raw)
                else "at least 1Mi",
                "fix": 'write the unit, e.g. "2048Mi" or "2Gi"',
            },
        )
    if isinstance(raw, str):
        return raw
    if number != int(number):
        raise PydanticCustomError(
            "k8s_quantity",
            "{shown} bytes is not a whole number of bytes",
            {"shown": repr(raw), "fix": _MEMORY_FIX},
        )
    return str(int(number))  # 2e9 (a YAML float) is 2000000000 bytes, as kubectl sends it


def _schema(what: str) -> dict[str, Any]:
    return {"x-kubernetes-preserve-unknown-fields": True, "pattern": QUANTITY_PATTERN}


CpuQuantity = Annotated[float, BeforeValidator(_cpu), WithJsonSchema(_schema("cpu"))]
"""CPU cores: a number (`2`, `0.5`) or a Kubernetes quantity string (`"500m"`)."""

MemoryQuantity = Annotated[str, BeforeValidator(_memory), WithJsonSchema(_schema("memory"))]
"""Memory: a Kubernetes quantity string (`"16Gi"`, `"2G"`, `"2e9"`) or a number of bytes."""


def is_bare_number(quantity: str) -> bool:
    """Whether a quantity has no suffix or exponent (Kubernetes reads it as bytes for memory)."""
    return bool(re.fullmatch(r"[+-]?(\d+(\.\d*)?|\.\d+)", quantity))
