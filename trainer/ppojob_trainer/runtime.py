"""Starting and stopping Ray for the trainer.

A local Ray (tests, CI, `ppojob run`) binds every listener to 127.0.0.1 and sends nothing
anywhere else: `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` makes every Ray listener (GCS, raylet,
object manager, dashboard agent, core workers) use the node IP instead of 0.0.0.0, and the node IP
is pinned to loopback. Usage statistics are switched off. The variables are set in `os.environ`
before Ray starts, so the Ray processes and every worker they spawn inherit them.

In a cluster (`RAY_ADDRESS` set by KubeRay) the trainer connects to the existing Ray instead:
see `connect_ray`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

LOOPBACK = "127.0.0.1"

# Environment every local Ray process and worker must see.
LOCAL_RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # listeners on the node IP (loopback), not 0.0.0.0
    "RAY_USAGE_STATS_ENABLED": "0",  # never phone home
    "RAY_USAGE_STATS_PROMPT_ENABLED": "0",
    "RAY_DEDUP_LOGS": "1",
}

log = logging.getLogger(__name__)


def start_local_ray(num_cpus: int | None = None, **kw: Any) -> None:
    """Start a single-node Ray bound to 127.0.0.1 only; a no-op when Ray is already running.

    `num_cpus` is Ray's logical CPU count (default: `os.cpu_count()`). Further keyword arguments
    go to `ray.init` (for example `resources={"widget": 1}` or `num_gpus=0`); the address, node
    IP and dashboard settings cannot be overridden, since they are what keep Ray on loopback.
    """
    for key in ("address", "_node_ip_address", "include_dashboard", "dashboard_host"):
        if key in kw:
            raise ValueError(
                f"start_local_ray: {key!r} cannot be set; a local Ray always binds to 127.0.0.1 "
                "without a dashboard (use connect_ray for an existing cluster)"
            )
    if num_cpus is not None and num_cpus < 1:
        raise ValueError(f"start_local_ray: num_cpus must be >= 1, got {num_cpus}")
    os.environ.update(LOCAL_RAY_ENV)
    import ray

    if ray.is_initialized():
        log.debug("Ray is already running; start_local_ray does nothing")
        return
    _pin_loopback_constant()
    kw.setdefault("logging_level", logging.WARNING)
    kw.setdefault("log_to_driver", True)
    kw.setdefault("configure_logging", True)
    ray.init(
        address="local",
        _node_ip_address=LOOPBACK,
        include_dashboard=False,
        num_cpus=num_cpus if num_cpus is not None else (os.cpu_count() or 1),
        **kw,
    )
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(
            f"local Ray came up on {node_ip} instead of {LOOPBACK}; refusing to run. Start it "
            "with ppojob_trainer.runtime.start_local_ray before anything else calls ray.init"
        )


def _pin_loopback_constant() -> None:
    # Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when `ray` is first imported. If it was
    # imported before the variable was set, the driver would resolve the node IP from the
    # machine's interfaces (measured: GCS, raylet and agents then listen on 0.0.0.0/:: and the
    # host IP, ignoring _node_ip_address). Setting the module constant too makes the order of
    # imports irrelevant; Ray's own processes start later and read the variable themselves.
    from ray._private import ray_constants

    if hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        ray_constants.ENABLE_RAY_CLUSTER = False


def connect_ray() -> None:
    """Connect to the Ray cluster named by `RAY_ADDRESS` (in-cluster), else start a local one."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(address="auto", logging_level=logging.WARNING)
    else:
        start_local_ray()


def shutdown_ray() -> None:
    """Stop (or disconnect from) Ray if it is running; safe to call more than once."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
