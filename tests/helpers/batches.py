"""Hand-made training batches of mixed lengths for the backend tests (packing, LoRA)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

PROMPT_LENS = [3, 1, 5, 2, 4]
RESPONSE_LENS = [7, 0, 2, 9, 1]


def mixed_batch(
    prompt_lens: Sequence[int] = PROMPT_LENS,
    response_lens: Sequence[int] = RESPONSE_LENS,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Left-padded prompts and right-padded responses of the given lengths (token ids 4..13),
    with old log-probs, advantages, old values and returns."""
    g = torch.Generator().manual_seed(seed)
    n, p, t = len(prompt_lens), max(prompt_lens), max(response_lens)
    pmask = torch.arange(p)[None, :] >= (p - torch.tensor(prompt_lens))[:, None]
    rmask = torch.arange(t)[None, :] < torch.tensor(response_lens)[:, None]
    return {
        "prompt_ids": torch.where(pmask, torch.randint(4, 14, (n, p), generator=g), 0),
        "prompt_mask": pmask,
        "response_ids": torch.where(rmask, torch.randint(4, 14, (n, t), generator=g), 0),
        "response_mask": rmask,
        "old_logprobs": -torch.rand(n, t, generator=g) * 3,
        "advantages": torch.randn(n, t, generator=g),
        "old_values": torch.randn(n, t, generator=g),
        "returns": torch.randn(n, t, generator=g),
    }


def ppo_policy_loss(
    logp: torch.Tensor, ent: torch.Tensor | None, mb: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped PPO loss with an entropy bonus, token-mean."""
    from ppojob_trainer.algorithms import policy_loss

    loss, _ = policy_loss(
        logp,
        mb["old_logprobs"],
        mb["advantages"],
        mb["response_mask"],
        entropy=ent,
        entropy_coef=0.01,
    )
    return loss, {"loss": loss.detach()}
