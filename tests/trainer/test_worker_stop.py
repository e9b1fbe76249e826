"""A worker pod's stop, driven for real without pods.

In a pod, kubelet's SIGTERM reaches ``ray start --block`` (the container's first process), whose
handler (``ray._private.node.Node._register_shutdown_hooks``) first runs
``Node._drain_node_before_shutdown``: it marks the node as draining in the GCS (reason
PREEMPTION) and waits, up to ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``, for the raylet to go idle.
Here that same function of Ray's runs on the loopback Ray's own node (a second ``ray start`` node
would listen on every interface, so the signal handler's first step is called directly) while an
actor's step is in flight. The driver's :func:`~ppojob_trainer.preemption.watch` must hear of it
from the GCS at once, and the actor must live on and finish its step.
"""

from __future__ import annotations

import threading
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]

DRAIN_S = 120.0  # the worker's RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S (the operator: the grace)


def test_a_draining_node_stops_the_driver_at_once_and_its_step_in_flight_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray
    from ray._private import ray_constants
    from ray._private.worker import _global_node

    from ppojob_trainer.driver.run import draining_ray_nodes
    from ppojob_trainer.preemption import watch

    @ray.remote(num_cpus=0, max_concurrency=2)
    class Step:
        """A step in flight until the test lets it end."""

        def __init__(self) -> None:
            self.started, self.go = threading.Event(), threading.Event()

        def run(self) -> str:
            self.started.set()
            return "done" if self.go.wait(120) else "timed out"

        def wait_started(self) -> bool:
            return self.started.wait(60)

        def release(self) -> None:
            self.go.set()

    step = Step.remote()
    in_flight = step.run.remote()
    assert ray.get(step.wait_started.remote(), timeout=120)
    assert draining_ray_nodes() == []
    monkeypatch.setattr(ray_constants, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", DRAIN_S)
    with watch(grace_seconds=60.0, draining=draining_ray_nodes) as stop:
        assert not stop.requested
        t0 = time.monotonic()
        # what `ray start --block` does first on SIGTERM (it then waits for the raylet to idle)
        drain = threading.Thread(target=_global_node._drain_node_before_shutdown, daemon=True)
        drain.start()
        assert stop.wait(30), "the driver never heard of the draining node"
        heard_s = time.monotonic() - t0
        assert stop.cause is not None and stop.cause.startswith("Ray node ")
        assert "is stopping" in stop.cause
        (name, deadline), *_ = draining_ray_nodes()
        assert name in stop.cause
        assert deadline is not None and 0 < deadline - time.time() <= DRAIN_S
        # the step in flight is not lost: the actor answers and ends its step after the stop
        ray.get(step.release.remote(), timeout=30)
        assert ray.get(in_flight, timeout=30) == "done"
        assert drain.is_alive(), "the node stopped draining while its actor held a lease"
    assert heard_s < 10, f"the driver heard of the stop after {heard_s:.1f}s"
