"""The tests' load factor on their wait bounds (tests/helpers/timeouts.py)."""

from __future__ import annotations

import pytest

from tests.helpers import controlplane, kmockenv
from tests.helpers.timeouts import scale, scaled


def test_unset_is_one_and_a_factor_multiplies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PPOJOB_TEST_TIMEOUT_SCALE", raising=False)
    assert scale() == 1.0 and scaled(20) == 20
    monkeypatch.setenv("PPOJOB_TEST_TIMEOUT_SCALE", "3")
    assert scaled(20) == 60


@pytest.mark.parametrize("raw", ["fast", "0", "-2"])
def test_a_bad_factor_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv("PPOJOB_TEST_TIMEOUT_SCALE", raw)
    with pytest.raises(ValueError, match="PPOJOB_TEST_TIMEOUT_SCALE"):
        scale()


def test_both_wait_helpers_apply_the_factor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bound of 1000 s scaled by 1e-4 gives up after 0.1 s: the helpers read the factor."""
    monkeypatch.setenv("PPOJOB_TEST_TIMEOUT_SCALE", "0.0001")
    with pytest.raises(TimeoutError, match="after 0s"):
        controlplane.wait_until(lambda: False, 1000, "never", interval=0.01)
    with pytest.raises(TimeoutError, match=r"within 0\.1s"):
        kmockenv.wait_for(lambda: False, timeout=1000, interval=0.01)
