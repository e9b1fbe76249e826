"""How long tests wait for a condition, scaled to the machine's load.

``PPOJOB_TEST_TIMEOUT_SCALE`` (a number, default 1) multiplies every bound the shared wait helpers
use (``kmockenv.wait_for``, ``controlplane.wait_until`` and ``ControlPlane.kubectl``). A bound only
matters when a condition is late: scaling it never slows a passing test, and the default suite
sets 3 because it runs the real-node tests beside everything else on 2 cores
(``hack/test.sh``), where a poll that takes 5 s on a quiet machine can take 30.
"""

from __future__ import annotations

import os


def scale() -> float:
    """The factor from ``PPOJOB_TEST_TIMEOUT_SCALE`` (a positive number; 1 when unset)."""
    raw = os.environ.get("PPOJOB_TEST_TIMEOUT_SCALE", "").strip()
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"PPOJOB_TEST_TIMEOUT_SCALE={raw!r} is not a number: set a factor such as 3"
        ) from None
    if value <= 0:
        raise ValueError(
            f"PPOJOB_TEST_TIMEOUT_SCALE={raw!r} must be positive: set a factor such as 3"
        )
    return value


def scaled(seconds: float) -> float:
    """``seconds`` times :func:`scale`."""
    return seconds * scale()
