"""bench/flops.py: the FLOP count behind the benches' MFU, against a hand count and against
torch's FlopCounterMode on the real torch backend (the actor's and critic's forwards and updates
of a tiny Llama with padded micro-batches)."""

from __future__ import annotations

import pytest

from bench.flops import Micro, forward_flops, micro_batches, total_flops

SHAPE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=50,
)


def test_forward_flops_is_the_hand_count_of_a_tiny_config():
    # hidden 8, 1 layer, 2 heads (head dim 4), 1 kv head (kv dim 4), MLP 16, vocabulary 10;
    # 2 rows of 3 positions, the LM head on 2 of them
    micro = Micro(rows=2, seq=3, head_positions=2)
    q_o = 2 * 8 * 8  # q and o projections: 8 x 8 multiply-adds each
    k_v = 2 * 8 * 4  # k and v: 8 x 4 each
    mlp = 3 * 8 * 16  # gate, up, down
    linear = 2 * (q_o + k_v + mlp) * 6  # 2 FLOPs per multiply-add, 6 positions
    attention = 2 * 2 * 8 * (1 + 2 + 3) * 2  # QK^T and PV, 8 = heads x head dim, causal pairs
    head = 2 * 8 * 10 * 2 * 2  # LM head on 2 positions of 2 rows
    assert linear + attention + head == 7936
    assert forward_flops(8, 1, 2, 1, 16, 10, micro) == 7936
    # the full square of attention pairs instead of the causal ones: 9 pairs per row, not 6
    assert forward_flops(8, 1, 2, 1, 16, 10, micro, causal=False) == 7936 + 2 * 2 * 8 * 3 * 2
    # a value head (8 -> 1) on all 6 positions instead of the LM head; no head at all
    assert forward_flops(8, 1, 2, 1, 16, 10, micro, head="value") == 7936 - head + 2 * 8 * 6
    assert forward_flops(8, 1, 2, 1, 16, 10, micro, head="none") == 7936 - head


def test_an_update_is_three_forwards_and_micro_batches_add_up():
    micros = [Micro(2, 5, 3), Micro(1, 4, 2)]
    one = total_flops(SHAPE, micros, train=False)
    assert one == sum(total_flops(SHAPE, [m], train=False) for m in micros)
    assert total_flops(SHAPE, micros, train=True) == 3 * one


def test_forward_flops_rejects_a_head_it_does_not_know():
    with pytest.raises(ValueError, match="head must be"):
        forward_flops(8, 1, 2, 1, 16, 10, Micro(1, 1, 1), head="lm_head")


@pytest.fixture(scope="module")
def tiny_backend(tmp_path_factory):
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    from ppojob_api.training import TrainingSettings
    from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer
    from ppojob_trainer.backends.torch_backend.value import TorchValueTrainer

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(**SHAPE, max_position_embeddings=64, pad_token_id=0)
    ).save_pretrained(path)
    settings = TrainingSettings(micro_batch_size=2)
    actor = TorchPolicyTrainer(
        path, "float32", settings, total_updates=2, temperature=1.0, need_reference=False
    )
    critic = TorchValueTrainer(path, "float32", settings, total_updates=2, seed=0)
    # eager attention: Q K^T and P V are matmuls FlopCounterMode counts (CPU SDPA is not), over
    # the full square of pairs (flops.py: causal=False)
    actor.lm.config._attn_implementation = "eager"
    critic.model.backbone.config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(0)
    b, p, t = 5, 6, 7
    pmask = torch.ones(b, p, dtype=torch.bool)
    for i, pad in enumerate([3, 1, 1, 2, 2]):  # left padding; micro-batches trim their own
        pmask[i, :pad] = False
    rmask = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate([7, 3, 2, 3, 4]):  # right padding; micro-batches trim their own
        rmask[i, :n] = True
    batch = {
        "prompt_ids": torch.randint(1, SHAPE["vocab_size"], (b, p), generator=g),
        "prompt_mask": pmask,
        "response_ids": torch.randint(1, SHAPE["vocab_size"], (b, t), generator=g),
        "response_mask": rmask,
        "returns": torch.zeros(b, t),
    }
    return actor, critic, batch


def _counted(fn) -> int:  # type: ignore[no-untyped-def]
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.slow
def test_counts_equal_flop_counter_mode_on_the_torch_backend(tiny_backend):
    actor, critic, batch = tiny_backend
    micros = micro_batches(batch["prompt_mask"], batch["response_mask"], 2)
    assert [(m.rows, m.seq, m.head_positions) for m in micros] == [(2, 12, 7), (2, 8, 3), (1, 8, 4)]

    def policy_loss(lp, ent, mb):  # type: ignore[no-untyped-def]
        return -(lp * mb["response_mask"]).sum(), {}

    def value_loss(v, mb):  # type: ignore[no-untyped-def]
        return ((v - mb["returns"]) ** 2 * mb["response_mask"]).sum(), {}

    square = {"causal": False}
    assert _counted(lambda: actor.logprobs(batch)) == total_flops(
        SHAPE, micros, train=False, **square
    )
    assert _counted(lambda: actor.update(batch, policy_loss, 2)) == total_flops(
        SHAPE, micros, train=True, **square
    )
    assert _counted(lambda: critic.values(batch)) == total_flops(
        SHAPE, micros, train=False, head="value", **square
    )
    assert _counted(lambda: critic.update(batch, value_loss, 2)) == total_flops(
        SHAPE, micros, train=True, head="value", **square
    )
