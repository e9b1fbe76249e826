"""Experiment trackers (spec.trackers): a tracking URI MLflow can open, W&B names W&B accepts,
credentials only from a Secret, and Secret names Kubernetes accepts."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from ppojob_api.problems import Problem
from ppojob_api.training import TrainingHalf

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_WANDB_FORBIDDEN = set("/\\#?%:")  # W&B refuses these in project and entity names


def check_trackers(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """Each tracker's values are ones its library and Kubernetes accept, and carry no
    credentials."""
    p: list[Problem] = []
    for i, tracker in enumerate(half.trackers):
        at = f"{prefix}.trackers[{i}]"
        if tracker.type == "mlflow":
            p += _tracking_uri(tracker.tracking_uri, f"{at}.trackingUri")
        if tracker.type == "wandb":
            for field, value in (("project", tracker.project), ("entity", tracker.entity)):
                bad = sorted(set(value or "") & _WANDB_FORBIDDEN)
                if bad or (value is not None and value != value.strip()):
                    shown = " ".join(bad) or "leading or trailing spaces"
                    p.append(
                        Problem(
                            f"{at}.{field}",
                            f"W&B does not accept {shown} in the {field} name {value!r}",
                            "use letters, digits, '-', '_' and '.'",
                        )
                    )
        ref = getattr(tracker, "secret_ref", None)
        if ref is not None and (len(ref.name) > 253 or not _DNS_SUBDOMAIN.match(ref.name)):
            p.append(
                Problem(
                    f"{at}.secretRef.name",
                    f"{ref.name!r} is not a Secret name",
                    "use lowercase letters, digits, '-' and '.', at most 253 characters",
                )
            )
    return p


def _tracking_uri(uri: str, path: str) -> list[Problem]:
    if uri != uri.strip() or any(c.isspace() for c in uri):
        return [Problem(path, f"{uri!r} contains spaces", "remove them")]
    if uri != "databricks" and not _SCHEME.match(uri):
        return [
            Problem(
                path,
                f"{uri!r} is not a URI",
                "write http(s)://host:port of a tracking server, databricks, or file:/absolute/dir",
            )
        ]
    parts = urlsplit(uri)
    if parts.scheme in ("http", "https") and not parts.hostname:
        return [Problem(path, f"{uri!r} names no host", "write http(s)://host:port")]
    if parts.password is not None or (parts.scheme in ("http", "https") and parts.username):
        return [
            Problem(
                path,
                "credentials never go in a PPOJob, the tracking URI included",
                "remove user:password@ and put MLFLOW_TRACKING_USERNAME and "
                "MLFLOW_TRACKING_PASSWORD in a Secret named in secretRef",
            )
        ]
    return []
