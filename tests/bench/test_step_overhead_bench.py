"""bench/step_overhead.py's one-process step runs the workers' own role code without Ray: the
same phases as ``PPOTrainer.step``, each a number of seconds inside the step's own, and a mean
reward (the bench checks the Ray step gives the same one). A role method whose return changed
shape (``sync_colocated`` now answers ``{"seconds", "version"}``) broke the bench unseen."""

from __future__ import annotations

import itertools

import pytest

from bench.step_overhead import PHASES, ROOT, load_cfg, local_steps


@pytest.mark.slow
def test_the_one_process_step_times_every_phase_within_the_step() -> None:
    cfg = load_cfg(ROOT / "examples" / "ppojob-tiny.yaml", "builtin:tiny-llama")
    rows = list(itertools.islice(local_steps(cfg, threads=1), 2))
    for row in rows:
        times = [row[k] for k in PHASES]
        assert all(isinstance(t, float) and t >= 0 for t in times), row
        # the example trains its actor and critic and syncs every step
        assert row["generate"] > 0 and row["train_actor"] > 0 and row["weight_sync"] > 0, row
        assert sum(times) <= row["step"], row
        assert 0 <= row["reward"] <= 1, row
