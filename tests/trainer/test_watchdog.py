"""The stall watchdog names the role, rank and phase of every worker that did not report."""

from __future__ import annotations

import pytest

from ppojob_trainer.watchdog import StallError, wait_or_name


def test_a_worker_that_does_not_report_is_named(local_ray) -> None:
    import ray

    @ray.remote(num_cpus=0)
    class Gate:
        """Holds a task until released: the stuck worker, without sleeping a fixed time."""

        def __init__(self) -> None:
            import threading

            self.open = threading.Event()

        def wait(self) -> int:
            self.open.wait()
            return 1

        def release(self) -> None:
            self.open.set()

    @ray.remote(num_cpus=0)
    def quick() -> int:
        return 0

    gate = Gate.options(max_concurrency=2).remote()
    stuck = gate.wait.remote()
    done = quick.remote()
    ray.get(done)
    labelled = [("rollout", 0, "generate", done), ("actor", 1, "train", stuck)]
    with pytest.raises(StallError) as info:
        wait_or_name(labelled, timeout=1.0)
    assert info.value.pending == [("actor", 1, "train")]
    assert "actor rank 1 (train) did not report" in str(info.value)
    assert "rollout" not in str(info.value)
    ray.get(gate.release.remote())
    wait_or_name(labelled, timeout=30.0)  # everything reported: no error
    wait_or_name(labelled, timeout=None)  # off
