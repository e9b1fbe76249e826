"""A step's metrics from the workers' reports (floats only: the driver never fetches a tensor)."""

from __future__ import annotations

from typing import Any

from ..algorithms import interval_overlap


def generation_metrics(gens: list[dict[str, Any]]) -> dict[str, float]:
    """Rewards and responses of the engines' results ``gens``."""
    n = sum(g["metrics"]["n"] for g in gens)

    def mean(key: str) -> float:
        return sum(g["metrics"].get(key, 0.0) for g in gens) / n

    out = {
        "reward/mean": mean("reward_sum"),
        "reward/overlong_penalty_mean": mean("overlong_penalty_sum"),
        "response/length": mean("length_sum"),
        "response/truncated_share": mean("truncated_sum"),
        "time/generate": max(g["metrics"].get("time/generate", 0.0) for g in gens),
    }
    if "switched_sum" in gens[0]["metrics"]:  # partial rollout: samples spanning versions
        out["rollout/switched_share"] = mean("switched_sum")
    for key in gens[0]["metrics"]:  # data.rewards: each source's unweighted mean
        if key.startswith("reward_sum/"):
            out[f"reward/{key.removeprefix('reward_sum/')}_mean"] = mean(key)
        elif key.startswith("reward_count/"):  # judges' unparsed verdicts: a count
            count = sum(g["metrics"].get(key, 0.0) for g in gens)
            out[f"reward/{key.removeprefix('reward_count/')}"] = count
        elif key.startswith("agent/") and key.endswith("_sum"):  # data.agent: per sample
            out[key.removesuffix("_sum") + "_mean"] = mean(key)
    return out


def step_metrics(
    gens: list[dict[str, Any]],
    prep: list[tuple[Any, dict[str, float]]],
    critic_m: list[dict[str, float]],
    actor_m: list[dict[str, float]],
    sync_s: list[Any],
) -> dict[str, float]:
    """The step's metrics: generation, the actor leaders' ``prep`` (advantages, KL, log-prob
    drift, staleness, importance weights), the updates' and the weight sync's."""
    n = sum(g["metrics"]["n"] for g in gens)
    out = generation_metrics(gens)
    out["time/prepare"] = max(p[1]["time/prepare"] for p in prep)
    if any("kl_sum" in p[1] for p in prep):
        out["kl/mean"] = sum(p[1].get("kl_sum", 0.0) for p in prep) / n
    if any("distill_kl_sum" in p[1] for p in prep):  # algorithm.distillation
        out["distill/reverse_kl"] = sum(p[1].get("distill_kl_sum", 0.0) for p in prep) / n
    tokens = sum(p[1]["tokens"] for p in prep)
    out["advantage/abs_mean"] = sum(p[1]["adv_abs_sum"] for p in prep) / max(tokens, 1.0)
    # |engine sampling log-prob - actor recomputed log-prob| on the same tokens
    out["rollout/logprob_diff_mean"] = sum(p[1]["logprob_diff_sum"] for p in prep) / max(
        tokens, 1.0
    )
    out["rollout/logprob_diff_max"] = max(p[1]["logprob_diff_max"] for p in prep)
    if any("router_choices" in p[1] for p in prep):  # algorithm.routingReplay: rollout
        choices = sum(p[1].get("router_choices", 0.0) for p in prep)
        same = sum(p[1].get("router_agree_sum", 0.0) for p in prep)
        out["moe/router_agreement"] = same / max(choices, 1.0)
    for group in (critic_m, actor_m):
        if group:
            for key in group[0]:
                vals = [g[key] for g in group if key in g]
                agg = max if key.startswith("time/") else (lambda v: sum(v) / len(v))
                out[key] = agg(vals)
    if sync_s:  # (seconds, or an engine's report of its seconds and version)
        out["time/weight_sync"] = max(v["seconds"] if isinstance(v, dict) else v for v in sync_s)
    out.update(_staleness(prep, tokens))
    if any("is_tokens" in p[1] for p in prep):  # importanceSampling's weights
        is_tokens = max(sum(p[1]["is_tokens"] for p in prep), 1.0)
        out["is/weight_mean"] = sum(p[1]["is_raw_sum"] for p in prep) / is_tokens
        out["is/weight_max"] = max(p[1]["is_raw_max"] for p in prep)
        out["is/capped_share"] = sum(p[1]["is_capped"] for p in prep) / is_tokens
    return out


def _staleness(prep: list[tuple[Any, dict[str, float]]], tokens: float) -> dict[str, float]:
    """Per-token policy versions: their mean and max age, and the share of each age."""
    out: dict[str, float] = {}
    if any("staleness_sum" in p[1] for p in prep):
        out["staleness/mean"] = sum(p[1]["staleness_sum"] for p in prep) / max(tokens, 1.0)
        out["staleness/max"] = max(p[1]["staleness_max"] for p in prep)
        s = 0
        while any(f"staleness_hist_{s}" in p[1] for p in prep):
            count = sum(p[1].get(f"staleness_hist_{s}", 0.0) for p in prep)
            out[f"staleness/share_{s}"] = count / max(tokens, 1.0)
            s += 1
    return out


def train_span(
    prep: list[tuple[Any, dict[str, float]]],
    critic_m: list[dict[str, float]],
    actor_m: list[dict[str, float]],
) -> tuple[float, float]:
    """When the step's training ran: from the first prepare to the end of the last update
    (the span keys are taken out of the reports)."""
    return (
        min(p[1].pop("span/start") for p in prep),
        max(
            [p[1].pop("span/end") for p in prep]
            + [m.pop("span/end") for m in [*critic_m, *actor_m]]
        ),
    )


def overlap_seconds(span: tuple[float, float], gens: list[dict[str, Any]]) -> float:
    """Seconds of ``span`` (the step's training) during which an engine was generating one of
    ``gens`` (this step's samples or, launched ahead, later steps')."""
    return interval_overlap(span, [tuple(g["span"]) for g in gens])
