"""Where the megatron backend's update paths put the tensors a loss function combines.

On a GPU the model's output (so the log-probs and values) is on CUDA while the mini-batch
crosses the seam on the CPU; a loss function mixing the two fails at its first subtraction.
Here the "GPU" is the ``meta`` device: the real ``_Sharded.update`` and ``run`` (the CPU
schedule) of a shard whose device is ``meta``, with a stand-in model returning ``meta`` logits,
record the device of every tensor each loss function is handed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ppojob_trainer.backends import megatron_backend as mb_
from ppojob_trainer.backends import megatron_logprobs, megatron_sharded
from ppojob_trainer.distributed import ShardIdentity

VOCAB = 7
HIDDEN = 5


class MetaModel(torch.nn.Module):
    """Hidden states [b, L, width] (the actor's: projected onto the vocabulary by its output
    layer's weight) or values [b, L, 1] on the meta device, like a GPU model's output."""

    share_embeddings_and_output_weights = False

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(width, device="meta"))
        self.output_layer = torch.nn.Linear(width, VOCAB, bias=False, device="meta")
        self.input_devices: set[str] = set()

    def forward(self, input_ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
        inputs = [input_ids, *(v for v in kwargs.values() if isinstance(v, torch.Tensor))]
        self.input_devices |= {str(t.device) for t in inputs}
        b, length = input_ids.shape
        return torch.zeros(b, length, 1, device="meta") + self.w


def meta_shard(width: int, packing: bool = False) -> megatron_sharded._Sharded:
    m = megatron_sharded._Sharded.__new__(megatron_sharded._Sharded)
    m.shard = ShardIdentity("actor")
    m.device, m.gpu, m.first, m.last = torch.device("meta"), False, True, True
    m.sequence_parallel, m.ddp, m.ps = False, None, SimpleNamespace()
    m.te = False
    m.routers, m.measure_routing = {}, False  # no routing replay
    m.router_aux_loss, m.routing_replay = 0.0, False  # nor a load-balancing loss
    m.settings = SimpleNamespace(
        micro_batch_size=None, max_tokens_per_micro_batch=None, packing=packing
    )
    m.model = MetaModel(width)
    m._step = lambda: {}  # the optimizer step is not what is checked here
    return m


def batch(n: int = 4, p: int = 3, t: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "prompt_ids": torch.randint(1, VOCAB, (n, p), generator=g),
        "prompt_mask": torch.ones(n, p, dtype=torch.bool),
        "response_ids": torch.randint(1, VOCAB, (n, t), generator=g),
        "response_mask": torch.ones(n, t, dtype=torch.bool),
        "old_logprobs": -torch.rand(n, t, generator=g),
        "advantages": torch.randn(n, t, generator=g),
        "returns": torch.randn(n, t, generator=g),
    }


@pytest.fixture
def meta_logprobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron-core's vocabulary-parallel cross entropy needs its tensor-parallel group; at
    tensor 1 it is a log-softmax, which runs on ``meta``."""

    def logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])[..., 0]

    monkeypatch.setattr(megatron_logprobs, "vocab_parallel_logprobs", logprobs)


@pytest.mark.parametrize("packing", [False, True])
def test_the_actor_loss_gets_its_micro_batch_on_the_log_probs_device(meta_logprobs, packing):
    """Padded and packed micro-batches (the packed row's index, positions and mask too)."""
    actor = mb_.MegatronPolicyTrainer.__new__(mb_.MegatronPolicyTrainer)
    actor.temperature, actor.need_entropy, actor.entropy_grad = 1.0, False, False
    actor.logits_chunk = 4  # several chunks per micro-batch
    actor.m = meta_shard(HIDDEN, packing)
    seen: list[set[str]] = []

    def loss_fn(logp, ent, mbatch):  # type: ignore[no-untyped-def]
        seen.append({str(logp.device)} | {str(v.device) for v in mbatch.values()})
        return (logp - mbatch["old_logprobs"]).mul(mbatch["advantages"]).mean(), {}

    actor.update(batch(), loss_fn, micro_batch_size=2)
    assert seen == [{"meta"}, {"meta"}]
    assert actor.m.model.input_devices == {"meta"}  # ids, positions, mask


def test_the_critic_loss_gets_its_micro_batch_on_the_values_device():
    critic = mb_.MegatronValueTrainer.__new__(mb_.MegatronValueTrainer)
    critic.m = meta_shard(1)
    seen: list[set[str]] = []

    def loss_fn(values, mbatch):  # type: ignore[no-untyped-def]
        seen.append({str(values.device)} | {str(v.device) for v in mbatch.values()})
        return (values - mbatch["returns"]).pow(2).mean(), {}

    critic.update(batch(), loss_fn, micro_batch_size=4)
    assert seen == [{"meta"}]


def test_bf16_logits_are_divided_by_the_temperature_in_float32(meta_logprobs):
    """The bf16 projection's logits become float32 before the temperature divides them (in bf16
    the quotient is rounded to 8 bits of mantissa: log-prob errors of ~1e-2), chunk by chunk."""
    actor = mb_.MegatronPolicyTrainer.__new__(mb_.MegatronPolicyTrainer)
    actor.temperature, actor.logits_chunk = 0.7, 4
    g = torch.Generator().manual_seed(0)
    output = (torch.randn(2, 6, 16, generator=g) * 2).to(torch.bfloat16)
    weight = (torch.randn(50, 16, generator=g) * 2).to(torch.bfloat16)
    model = SimpleNamespace(
        share_embeddings_and_output_weights=False, output_layer=SimpleNamespace(weight=weight)
    )
    mb = {
        "_index": torch.tensor([[1, 2, 3], [2, 3, 4]]),
        "response_ids": torch.tensor([[5] * 3] * 2),
    }
    got, _ = actor._token_stats(model, output, mb)
    logits = torch.nn.functional.linear(megatron_logprobs._select(output, mb["_index"]), weight)
    want = torch.log_softmax(logits.float() / 0.7, -1)[..., 5]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
