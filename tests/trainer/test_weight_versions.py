"""Issue 40 (weight sync as a subsystem): each sync carries a version, the engines report the
version they hold with their side of it, and the driver keeps the oldest one reported."""

from __future__ import annotations

from ppojob_trainer.driver.weights import WeightSync
from ppojob_trainer.workers.host import synced


def test_the_engines_reported_versions_are_read_back_beside_the_seconds():
    sync = WeightSync(groups=None)  # (the reading needs no group)
    assert sync.reported == 0  # the initial weights
    seconds = sync.read_reports([synced(0.5, 3), synced(0.25, 2), 0.125])
    assert seconds == [0.5, 0.25, 0.125]  # an actor worker's share reports seconds only
    assert sync.reported == 2  # the oldest version an engine holds
    assert sync.read_reports([0.1]) == [0.1] and sync.reported == 2  # no engine: unchanged
