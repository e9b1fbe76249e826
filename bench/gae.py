"""Time compute_gae against a per-sample Python loop for B = 256, T = 4096.

Usage: python bench/gae.py [--batch 256] [--length 4096] [--repeats 5]
Prints the median time of each and the speed-up ratio, and checks both agree.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ppojob_trainer.algorithms import compute_gae


def loop_gae(rewards, values, mask, gamma: float, lam: float) -> tuple[list, list]:
    """The naive baseline: one sample at a time, one token at a time, in plain Python."""
    advs, rets = [], []
    for r, v, m in zip(rewards.tolist(), values.tolist(), mask.tolist(), strict=True):
        adv = [0.0] * len(r)
        ret = [0.0] * len(r)
        next_v = next_a = 0.0
        for t in range(len(r) - 1, -1, -1):
            if not m[t]:
                continue
            delta = r[t] + gamma * next_v - v[t]
            next_a = delta + gamma * lam * next_a
            next_v = v[t]
            adv[t] = next_a
            ret[t] = next_a + v[t]
        advs.append(adv)
        rets.append(ret)
    return advs, rets


def make_batch(batch: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=g) * 0.1
    values = torch.randn(batch, length, generator=g)
    # prompt | response | padding, with random prompt and response lengths
    prompt = torch.randint(0, length // 4, (batch, 1), generator=g)
    response = torch.randint(1, length - length // 4, (batch, 1), generator=g)
    pos = torch.arange(length)[None, :]
    mask = ((pos >= prompt) & (pos < prompt + response)).float()
    return rewards, values, mask


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    gamma, lam = 0.99, 0.95
    rewards, values, mask = make_batch(args.batch, args.length)

    compute_gae(rewards, values, mask, gamma, lam)  # warm-up
    fast = median_time(lambda: compute_gae(rewards, values, mask, gamma, lam), 3 * args.repeats)
    slow = median_time(
        lambda: loop_gae(rewards, values, mask, gamma, lam), max(1, args.repeats // 2)
    )

    adv, _ = compute_gae(rewards, values, mask, gamma, lam)
    ref, _ = loop_gae(rewards, values, mask, gamma, lam)
    err = (adv.double() - torch.tensor(ref, dtype=torch.float64)).abs().max().item()

    print(f"compute_gae B={args.batch} T={args.length} (torch threads={torch.get_num_threads()})")
    print(f"  vectorised compute_gae : {fast * 1e3:9.2f} ms")
    print(f"  per-sample Python loop: {slow * 1e3:9.2f} ms")
    print(f"  speed-up              : {slow / fast:9.1f}x")
    print(f"  max |difference|      : {err:.2e}")


if __name__ == "__main__":
    main()
