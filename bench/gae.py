"""Time compute_gae against a per-timestep torch loop, on contiguous and on holed masks.

Usage: python bench/gae.py [--batch 256] [--length 4096] [--repeats 9]

Method. Inputs: B rows of T positions, rewards ~ 0.1 N(0, 1), values ~ N(0, 1) (seed 0). Two
mask layouts, each timed and checked:

* contiguous: prompt | response | padding, random prompt and response lengths per row (the
  layout of single-turn rollouts; compute_gae's in-place fast path);
* holed: the same rows with 1 to 4 gaps of masked-out positions inside each response (the
  layout of multi-turn rollouts, where tool outputs or user turns sit between the policy's
  tokens; compute_gae's compaction path).

Baseline: ``loop_gae`` below, the usual way GAE is written in PPO trainers for LMs (in the style of
verl's ``compute_gae_advantage_return``; written here, not copied): one iteration per position
``t`` in ``reversed(range(T))``, each a few torch ops on whole-batch [B] columns, no Python
per-sample work. Semantics on masked-out positions, the same as compute_gae's: a masked-out
position is skipped, i.e. the next value and the running advantage carry over it unchanged, so
each response token is linked to the next *response* token (``V`` after the last one is 0), and
advantages and returns are 0 off the mask (the loop's carried values there are zeroed at the
end). Both are compared on every position; the printed error is the max |difference|. Times are
medians over ``--repeats`` runs of each, alternating the two (so a neighbour's load hits both
alike), after one warm-up call of each, on the CPU with torch's default thread count, under
``torch.no_grad()`` in float32.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ppojob_trainer.algorithms import compute_gae


def loop_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The baseline: a reversed loop over positions, whole-batch torch ops at each position."""
    m = mask.to(rewards.dtype)
    bsz, length = rewards.shape
    next_v = torch.zeros(bsz, dtype=rewards.dtype)
    next_a = torch.zeros(bsz, dtype=rewards.dtype)
    adv = torch.empty_like(rewards)
    for t in reversed(range(length)):
        mt = m[:, t]
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        a = delta + gamma * lam * next_a
        # a masked-out position leaves the carried value and advantage unchanged
        next_v = values[:, t] * mt + (1 - mt) * next_v
        next_a = a * mt + (1 - mt) * next_a
        adv[:, t] = next_a
    adv = adv * m
    return adv, adv + values * m


def make_batch(
    batch: int, length: int, holes: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=g) * 0.1
    values = torch.randn(batch, length, generator=g)
    # prompt | response | padding, with random prompt and response lengths
    prompt = torch.randint(0, length // 4, (batch, 1), generator=g)
    response = torch.randint(1, length - length // 4, (batch, 1), generator=g)
    pos = torch.arange(length)[None, :]
    mask = (pos >= prompt) & (pos < prompt + response)
    if holes:  # 1 to 4 gaps (tool outputs) of up to 1/8 of the response, inside each response
        for i in range(batch):
            start, size = int(prompt[i]), int(response[i])
            for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
                width = int(torch.randint(1, max(2, size // 8), (1,), generator=g))
                at = start + int(torch.randint(0, max(1, size - width), (1,), generator=g))
                mask[i, at : at + width] = False
    return rewards, values, mask.float()


def median_times(fns, repeats: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Median time of each function; runs alternate (a, b, a, b...) so load hits both alike."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def run_case(name: str, args: argparse.Namespace, holes: bool) -> None:
    gamma, lam = 0.99, 0.95
    rewards, values, mask = make_batch(args.batch, args.length, holes)
    m = mask.bool()
    runs = (m[:, :1].sum(1) + (m[:, 1:] & ~m[:, :-1]).sum(1)).float().mean().item()
    with torch.no_grad():
        ours = compute_gae(rewards, values, mask, gamma, lam)  # also the warm-up
        ref = loop_gae(rewards, values, mask, gamma, lam)
        fast, slow = median_times(
            [
                lambda: compute_gae(rewards, values, mask, gamma, lam),
                lambda: loop_gae(rewards, values, mask, gamma, lam),
            ],
            args.repeats,
        )
    err = max((a.double() - b.double()).abs().max().item() for a, b in zip(ours, ref, strict=True))
    print(f"{name}: {runs:.2f} response runs per row, {int(m.sum()):,} response tokens")
    print(f"  compute_gae               : {fast * 1e3:9.2f} ms")
    print(f"  per-timestep torch loop   : {slow * 1e3:9.2f} ms")
    print(f"  speed-up                  : {slow / fast:9.1f}x")
    print(f"  max |difference| adv, ret : {err:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    print(f"GAE B={args.batch} T={args.length} (torch threads={torch.get_num_threads()})")
    run_case("contiguous mask (prompt | response | padding)", args, holes=False)
    run_case("holed mask (1-4 masked-out gaps inside each response)", args, holes=True)


if __name__ == "__main__":
    main()
