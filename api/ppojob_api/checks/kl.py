"""Checks of the KL penalty's settings against each other and the estimator."""

from __future__ import annotations

from ppojob_api.base import default_of
from ppojob_api.problems import Problem
from ppojob_api.training import KLSpec, TrainingHalf
from ppojob_api.trainspec.constants import GROUP_ESTIMATORS


def check_kl_target(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """An adaptive target needs a starting coefficient and acts on the KL in the reward."""
    kl = half.algorithm.kl
    if kl.target is None:
        return []
    p: list[Problem] = []
    if kl.coefficient == 0:
        p.append(
            Problem(
                f"{prefix}.algorithm.kl.target",
                "an adaptive KL target needs a starting coefficient",
                "set kl.coefficient > 0 or remove kl.target",
            )
        )
    if kl.mode == "loss":
        p.append(
            Problem(
                f"{prefix}.algorithm.kl.target",
                "the adaptive controller acts on the KL in the reward",
                "set kl.mode: reward or remove kl.target",
            )
        )
    return p


def check_kl_mode(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """k1 as a loss does not minimise KL; group estimators discard a per-token KL reward."""
    algo = half.algorithm
    kl = algo.kl
    if kl.coefficient == 0:
        return []
    if kl.mode == "loss" and kl.estimator == "k1":
        return [
            Problem(
                f"{prefix}.algorithm.kl.estimator",
                "k1 as a loss has a gradient that does not minimise KL",
                "use k2, k3 or low_var_kl with mode: loss",
            )
        ]
    if kl.mode == "reward" and algo.advantage_estimator in GROUP_ESTIMATORS:
        return [
            Problem(
                f"{prefix}.algorithm.kl.mode",
                f"{algo.advantage_estimator} compares outcome rewards "
                "within a group, which discards a per-token KL penalty",
                "set kl.mode: loss (with k3 or low_var_kl)",
            )
        ]
    return []


def check_kl_off(half: TrainingHalf, prefix: str = "spec") -> list[Problem]:
    """KL settings given while the coefficient is 0 (KL off) would silently do nothing."""
    kl = half.algorithm.kl
    changed = [
        f"{alias}: {getattr(kl, field)}"
        for field, alias in (("estimator", "estimator"), ("mode", "mode"))
        if getattr(kl, field) != default_of(KLSpec, field)
    ]
    if kl.coefficient != 0 or not changed:
        return []
    return [
        Problem(
            f"{prefix}.algorithm.kl.coefficient",
            f"KL settings are given ({', '.join(changed)}) but the coefficient is 0, so KL is off",
            "set kl.coefficient > 0 or remove kl",
        )
    ]
