"""Shared helpers of the operator tests: the external CRDs children are validated against, how
KubeRay reads what we write, and a loopback HTTP server."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
EXTERNAL_CRDS = REPO / "tests" / "external-crds"


def _strict(schema: Any) -> Any:
    """Close every object schema that lists properties (unless it preserves unknown fields)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        if out.get("x-kubernetes-int-or-string") and "type" not in out:
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def crd_validator(filename: str, version: str) -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((EXTERNAL_CRDS / filename).read_text())
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            schema = _strict(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
            return jsonschema.Draft7Validator(schema)
    raise LookupError(f"{filename} has no version {version}")


def kuberay_resources_map(value: str) -> dict[str, float]:
    """How KubeRay v1.5 reads ``rayStartParams.resources`` (``getResourcesMap`` in
    ray-operator/controllers/ray/common/pod.go): Go's ``strings.Trim(value, "'\\"` ")`` (Python's
    ``str.strip`` has the same cut-set semantics), then ``json.Unmarshal`` into a
    ``map[string]float64`` (any non-number value is an error)."""
    import json

    obj = json.loads(value.strip("'\"` "))
    if not isinstance(obj, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in obj.values()
    ):
        raise ValueError(f"not a map of numbers: {value!r}")
    return {str(k): float(v) for k, v in obj.items()}


def ray_start_resources(value: str) -> dict[str, float]:
    """What ``ray start`` receives: KubeRay writes ``--resources=<value>`` verbatim into the
    container's shell command (``convertParamMap``); the shell removes the quoting and Ray
    ``json.loads`` the argument."""
    import json
    import shlex

    args = shlex.split(f"ray start --resources={value}")
    return json.loads(args[2].removeprefix("--resources="))


async def serve_on_loopback(handle: Any) -> tuple[Any, str]:
    """An aiohttp server answering every request with ``handle`` on 127.0.0.1 (a free port);
    returns its runner (``await runner.cleanup()`` stops it) and its URL."""
    from aiohttp import web

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


RAYJOB_CRD = yaml.safe_load((EXTERNAL_CRDS / "ray.io_rayjobs.yaml").read_text())


def pre_1_5(crd: dict) -> dict:
    """The same CRD as KubeRay 1.4 shipped it, as far as the check looks: `deletionPolicy`
    instead of `deletionStrategy` (ray-operator/apis/ray/v1/rayjob_types.go, v1.4.2 vs v1.5.0)."""
    old = copy.deepcopy(crd)
    for v in old["spec"]["versions"]:
        props = v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        if v["name"] == "v1":
            props["deletionPolicy"] = props.pop("deletionStrategy")
    return old
