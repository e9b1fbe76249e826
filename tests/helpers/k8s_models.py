"""Kubernetes' own object schemas, read from the `kubernetes` client's models (their
`attribute_map` and `openapi_types`): every type reachable from a root type, each as
{JSON field name: the client's type string}. The API package carries generated copies
(ppojob_api.k8s_types, the affinity table in ppojob_api.checks.pods) because it imports no
Kubernetes client; the tests compare those copies with this.

    PYTHONPATH=api:. python -m tests.helpers.k8s_models > api/ppojob_api/k8s_types.py
"""

from __future__ import annotations

import re
from pprint import pformat


def table(root: str) -> dict[str, dict[str, str]]:
    """Every model type reachable from `root` (e.g. "V1Volume"), by name."""
    import kubernetes.client.models as models

    out: dict[str, dict[str, str]] = {}

    def walk(name: str) -> None:
        if name in out:
            return
        cls = getattr(models, name)
        out[name] = {cls.attribute_map[a]: t for a, t in cls.openapi_types.items()}
        for t in out[name].values():
            for inner in re.findall(r"V1\w+", t):
                walk(inner)

    walk(root)
    return out


def module_text() -> str:
    import kubernetes

    body = pformat(table("V1Volume"), width=96, sort_dicts=True)
    version = kubernetes.__version__
    return (
        '"""core/v1 Volume, every level: each type\'s fields (JSON names) and the `kubernetes`\n'
        f"client's type strings, generated from the client's models (kubernetes {version})\n"
        "by `python -m tests.helpers.k8s_models` (tests/api checks it against those models).\n"
        "The operator copies spec.podTemplate.volumes into pods as written; the API server\n"
        'refuses (a RayJob\'s structural schema silently prunes) any other field."""\n\n'
        f"VOLUME_TYPES: dict[str, dict[str, str]] = {body}\n"
    )


if __name__ == "__main__":
    print(module_text(), end="")
