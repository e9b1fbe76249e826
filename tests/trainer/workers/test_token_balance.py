"""Token-balanced shares of each mini-batch over the data-parallel workers (with
maxTokensPerMicroBatch): no worker waits on one holding the long samples."""

from __future__ import annotations

import torch

from ppojob_trainer.distributed import ShardIdentity
from ppojob_trainer.workers.actor import mini_batch_rows
from ppojob_trainer.workers.group import balanced_shares, balanced_split, shard_range


def _skewed(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(8, 257, (n,), generator=g).tolist()


def test_balanced_split_deals_equal_counts_with_balanced_tokens():
    tokens = _skewed(64)
    parts = balanced_split(tokens, 4)
    assert sorted(i for p in parts for i in p) == list(range(64))
    assert {len(p) for p in parts} == {16}
    loads = [sum(tokens[i] for i in p) for p in parts]
    contiguous = [sum(tokens[slice(*shard_range(64, 4, r))]) for r in range(4)]
    # the spread is at most one sample's tokens, and far below a contiguous split's
    assert max(loads) - min(loads) <= max(tokens)
    assert max(loads) - min(loads) < (max(contiguous) - min(contiguous)) / 4


def _loads(tokens, parts):
    return [sum(tokens[i] for i in p) for p in parts]


def test_longest_first_each_to_the_lightest_part():
    # longest first: the two long samples go to different workers (in given order, not)
    assert _loads([10, 1, 1, 10], balanced_split([10, 1, 1, 10], 2)) == [11, 11]
    # to the lightest part: not dealt round-robin (that gives 200 and 198)
    tokens = [100, 99, 98, 97, 1, 1, 1, 1]
    assert _loads(tokens, balanced_split(tokens, 2)) == [199, 199]


def test_balanced_mini_batches_are_the_shared_orders_mini_batches():
    """Each mini-batch over all workers holds exactly the samples of one cut of the shared
    order, whichever worker takes them: the update is that of the same mini-batch."""
    dp, n, mini = 2, 16, 4  # mini per worker: 8 samples per mini-batch
    rmask = torch.arange(300)[None, :] < torch.tensor(_skewed(n, 1))[:, None]
    batch = {"prompt_mask": torch.ones(n, 3, dtype=torch.bool), "response_mask": rmask}
    batch["response_ids"] = torch.zeros(n, 300, dtype=torch.long)
    shares = []
    for rank in range(dp):
        gen = torch.Generator().manual_seed(7)
        rows = mini_batch_rows(batch, mini, ShardIdentity("actor", rank, dp), gen, True)
        shares.append(rows)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(7)).tolist()
    for m in range(n // (mini * dp)):
        together = sorted(shares[0][m].tolist() + shares[1][m].tolist())
        assert together == sorted(order[m * 8 : (m + 1) * 8])
        assert len(shares[0][m]) == len(shares[1][m]) == mini
    tokens = (batch["prompt_mask"].sum(1) + rmask.sum(1)).tolist()
    for m in range(n // 8):
        cut = order[m * 8 : (m + 1) * 8]
        split = balanced_split([tokens[i] for i in cut], dp)
        assert sorted(shares[1][m].tolist()) == sorted(cut[j] for j in split[1])
    assert balanced_shares(tokens, order, 8, dp, 1) == [r.tolist() for r in shares[1]]


def test_unbalanced_mini_batches_are_todays():
    n, mini = 8, 4
    batch = {"response_ids": torch.zeros(n, 2)}
    rows = mini_batch_rows(
        batch, mini, ShardIdentity("actor"), torch.Generator().manual_seed(3), False
    )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(3))
    assert [r.tolist() for r in rows] == [order[:4].tolist(), order[4:].tolist()]
