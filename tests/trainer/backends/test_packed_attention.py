"""The per-sequence attention of packed rows (``packed_attention``): the same outputs as the
dense block-diagonal mask it replaces, and never a score across the row (what makes packing pay
on the CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ppojob_api.training import TrainingSettings
from ppojob_trainer import models
from ppojob_trainer.backends import packed_attention as pa
from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer
from ppojob_trainer.backends.torch_backend.value import TorchValueTrainer
from tests.helpers.batches import PROMPT_LENS, RESPONSE_LENS, mixed_batch, ppo_policy_loss

LENGTHS = [5, 3, 9, 5, 3, 1]  # sequences of one length are stacked: out of row order


def _qkv(heads: int, kv_heads: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, d = sum(LENGTHS), 8
    q = torch.randn(1, heads, n, d, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, n, d, generator=g, requires_grad=True)
    v = torch.randn(1, kv_heads, n, d, generator=g, requires_grad=True)
    return q, k, v


def _positions() -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in LENGTHS])[None]


def _dense(q, k, v, window: int | None = None, lengths: list[int] = LENGTHS) -> torch.Tensor:
    """Block-diagonal causal (optionally windowed) attention over the whole row, [1, T, H, d]."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i = torch.arange(seq.numel())
    mask = (seq[:, None] == seq[None, :]) & (i[None, :] <= i[:, None])
    if window is not None:
        mask &= i[:, None] - i[None, :] < window
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])
    return out.transpose(1, 2)


@pytest.mark.parametrize("dense_up_to", [0, 1_000])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("boundaries", ["cu_seq_lens", "position_ids"])
def test_per_sequence_attention_equals_the_block_diagonal_mask(
    window, boundaries, dense_up_to, monkeypatch
):
    """Grouped-query heads (4 query heads on 2 key/value heads), with and without a sliding
    window, boundaries from cumulative lengths or from restarting positions, per sequence or
    (a short row) in one call: outputs and gradients equal the dense mask's."""
    monkeypatch.setattr(pa, "DENSE_ROW_TOKENS", dense_up_to)
    q, k, v = _qkv(4, 2)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    if boundaries == "cu_seq_lens":
        kw = {"cu_seq_lens_q": torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])}
    else:
        kw = {"position_ids": _positions()}
    out, _ = pa.packed_attention_forward(module, q, k, v, None, sliding_window=window, **kw)
    ref = _dense(q, k, v, window)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_segment_offsets_and_a_bad_cover():
    n = sum(LENGTHS)
    want = [0, 5, 8, 17, 22, 25, 26]
    assert pa.segment_offsets({"position_ids": _positions()}, n) == want
    assert pa.segment_offsets({"cu_seq_lens_q": torch.tensor(want)}, n) == want
    with pytest.raises(ValueError, match="packing: the model's attention got neither"):
        pa.segment_offsets({}, n)  # a model that drops the attention's keyword arguments
    with pytest.raises(ValueError, match="does not cover the row's 26 positions"):
        pa.segment_offsets({"cu_seq_lens_q": torch.tensor([0, 5, 20])}, n)


def test_values_of_another_head_size_than_the_queries():
    """Models whose value heads differ in size from their query heads (multi-head latent
    attention: DeepSeek-V2/V3, MiniCPM3) attend per sequence too."""
    g = torch.Generator().manual_seed(2)
    n = sum(LENGTHS)
    q = torch.randn(1, 2, n, 12, generator=g)
    k = torch.randn(1, 2, n, 12, generator=g)
    v = torch.randn(1, 2, n, 8, generator=g)
    module = SimpleNamespace(num_key_value_groups=1, is_causal=True, training=False)
    for dense_up_to in (0, 1_000):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pa, "DENSE_ROW_TOKENS", dense_up_to)
            out, _ = pa.packed_attention_forward(module, q, k, v, None, position_ids=_positions())
        assert out.shape == (1, n, 2, 8)
        torch.testing.assert_close(out, _dense(q, k, v), atol=1e-6, rtol=1e-5)


def test_the_mask_is_left_out_only_for_a_whole_row_without_padding_or_cache():
    """No mask for a whole row (the attention finds the sequences); sdpa's mask for padding
    and for a cache's earlier tokens (which the attention cannot rebuild)."""
    common = dict(batch_size=1, mask_function=lambda b, h, q, kv: kv <= q, device="cpu")
    assert pa.packed_attention_mask(q_length=6, kv_length=6, **common) is None
    cached = pa.packed_attention_mask(
        q_length=2, kv_length=6, q_offset=4, kv_offset=0, allow_is_causal_skip=False, **common
    )
    assert cached is not None and cached.shape[-2:] == (2, 6)
    padding = torch.tensor([[False, True, True, True, True, True]])
    padded = pa.packed_attention_mask(q_length=6, kv_length=6, attention_mask=padding, **common)
    assert padded is not None and not bool(padded[0, 0, :, 0].any())


def test_a_padded_batch_is_plain_sdpa():
    """With a padding mask (a padded batch) the implementation is transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = _qkv(2, 2, seed=1)
    mask = torch.ones(1, 1, q.shape[2], q.shape[2], dtype=torch.bool).tril()
    mask[..., :3] = False  # three padded key positions
    mask[..., :3, 0] = True  # (rows that would be empty attend to something)
    module = SimpleNamespace(num_key_value_groups=1, is_causal=True, training=False)
    out, _ = pa.packed_attention_forward(module, q, k, v, mask, position_ids=_positions())
    ref, _ = sdpa_attention_forward(module, q, k, v, mask)
    assert torch.equal(out, ref)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return models.materialize_builtin("tiny-qwen2", 5, tmp_path_factory.mktemp("cache"))


def _key_lengths(monkeypatch) -> list[int]:
    """The key length of every scaled-dot-product attention call from now on."""
    seen: list[int] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, *a, **kw):
        seen.append(k.shape[-2])
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return seen


def test_packed_training_never_attends_across_the_row(model_dir, monkeypatch):
    """With packing, the actor (log-probs, reference, update) and the critic attend within one
    sequence at a time: no attention call's key length exceeds the longest sequence, though
    the packed row is several times longer (a row longer than ``DENSE_ROW_TOKENS``; here 0)."""
    monkeypatch.setattr(pa, "DENSE_ROW_TOKENS", 0)
    batch = mixed_batch()
    longest = max(p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS, strict=True))
    row = sum(PROMPT_LENS) + sum(RESPONSE_LENS)
    settings = TrainingSettings(learning_rate=1e-2, packing=True, micro_batch_size=5)
    actor = TorchPolicyTrainer(
        model_dir, "float32", settings, total_updates=1, temperature=0.7, need_reference=True
    )
    critic = TorchValueTrainer(model_dir, "float32", settings, total_updates=1, seed=3)
    seen = _key_lengths(monkeypatch)
    actor.logprobs(batch)
    actor.logprobs(batch, reference=True)
    actor.update(batch, ppo_policy_loss, 5)
    critic.values(batch)
    assert seen, "no attention call was recorded"
    assert max(seen) == longest < row


def test_gradient_checkpointing_recomputes_per_sequence(model_dir, monkeypatch):
    """Activation checkpointing recomputes each block in backward: the recomputation gets the
    sequences' boundaries too (they travel as keyword arguments, not as state)."""
    batch = mixed_batch()
    longest = max(p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS, strict=True))
    grads = []
    monkeypatch.setattr(pa, "DENSE_ROW_TOKENS", 0)
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    for checkpointing in (False, True):
        settings = TrainingSettings(
            learning_rate=1e-2,
            packing=True,
            micro_batch_size=5,
            gradient_checkpointing=checkpointing,
        )
        actor = TorchPolicyTrainer(
            model_dir, "float32", settings, total_updates=1, temperature=0.7, need_reference=False
        )
        got: list = []

        def capture(into=got, actor=actor):
            into.append([p.grad.clone() for p in actor.opt.params])
            return {}

        actor.opt.step = capture
        seen = _key_lengths(monkeypatch)
        actor.update(batch, ppo_policy_loss, 5)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", real_sdpa)
        assert max(seen) == longest
        grads.append(got[0])
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_a_short_row_is_one_call_with_the_block_mask(model_dir, monkeypatch):
    """Below ``DENSE_ROW_TOKENS`` a packed row is one attention call over the whole row (a call
    per sequence would cost more there), with the same log-probs as per sequence."""
    batch = mixed_batch()
    row = sum(PROMPT_LENS) + sum(RESPONSE_LENS)
    settings = TrainingSettings(learning_rate=1e-2, packing=True, micro_batch_size=5)
    actor = TorchPolicyTrainer(
        model_dir, "float32", settings, total_updates=1, temperature=0.7, need_reference=False
    )
    seen = _key_lengths(monkeypatch)
    dense = actor.logprobs(batch)
    assert set(seen) == {row}
    seen.clear()
    monkeypatch.setattr(pa, "DENSE_ROW_TOKENS", 0)
    per_sequence = actor.logprobs(batch)
    assert max(seen) < row
    torch.testing.assert_close(dense, per_sequence, atol=1e-6, rtol=1e-5)


def test_only_an_sdpa_model_is_switched(model_dir):
    """flash-attention (varlen kernels already) and eager (maybe there for soft-capping) stay."""
    sdpa = models.load_causal_lm(model_dir, "float32")
    assert sdpa.config._attn_implementation == "sdpa"
    assert pa.use_packed_attention(sdpa)
    assert sdpa.config._attn_implementation == pa.NAME
    eager = models.load_causal_lm(model_dir, "float32")
    eager.set_attn_implementation("eager")
    assert not pa.use_packed_attention(eager)
    assert eager.config._attn_implementation == "eager"
    # a sliding window (which some models apply through the mask alone) keeps sdpa's mask
    windowed = models.load_causal_lm(model_dir, "float32")
    windowed.config.sliding_window, windowed.config.use_sliding_window = 4, True
    assert not pa.use_packed_attention(windowed)
    assert windowed.config._attn_implementation == "sdpa"


def test_a_rows_plan_is_worked_out_once_per_micro_batch_not_per_layer(model_dir, monkeypatch):
    """Reading a row's boundaries (``cu_seq_lens_q`` to the host: a device synchronisation on a
    GPU) and building its index tensors happen once per model call, whatever the layer count,
    and activation checkpointing's recomputation reuses them."""
    monkeypatch.setattr(pa, "DENSE_ROW_TOKENS", 0)
    reads: list[int] = []
    real = pa.segment_offsets

    def counting(kwargs, length):
        reads.append(length)
        return real(kwargs, length)

    monkeypatch.setattr(pa, "segment_offsets", counting)
    batch = mixed_batch()
    settings = TrainingSettings(
        learning_rate=1e-2, packing=True, micro_batch_size=5, gradient_checkpointing=True
    )
    actor = TorchPolicyTrainer(
        model_dir, "float32", settings, total_updates=1, temperature=0.7, need_reference=False
    )
    assert actor.lm.config.num_hidden_layers > 1
    calls: list[int] = []
    actor.lm.get_decoder().register_forward_pre_hook(lambda module, args: calls.append(1))
    actor.logprobs(batch)
    actor.update(batch, ppo_policy_loss, 5)
    assert calls and len(reads) == len(calls)


def test_another_thread_finds_the_plan_of_the_same_boundaries(monkeypatch):
    """On a GPU, autograd recomputes a checkpointed block in its own device thread: that thread
    reuses the plan the forward made for the same boundaries tensor."""
    import threading

    reads: list[int] = []
    real = pa.segment_offsets
    monkeypatch.setattr(pa, "segment_offsets", lambda kw, n: reads.append(n) or real(kw, n))
    q, k, v = _qkv(4, 2)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    first, _ = pa.packed_attention_forward(module, q, k, v, None, cu_seq_lens_q=cu)
    out: list = []
    worker = threading.Thread(
        target=lambda: out.append(
            pa.packed_attention_forward(module, q, k, v, None, cu_seq_lens_q=cu)
        )
    )
    worker.start()
    worker.join()
    assert len(reads) == 1
    torch.testing.assert_close(out[0][0], first)


def test_boundaries_changed_in_place_get_a_new_plan():
    """The plan is kept for the same boundaries tensor only while it is unchanged: rewritten in
    place (a reused buffer), the next call attends by its new boundaries."""
    q, k, v = _qkv(4, 2)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    first, _ = pa.packed_attention_forward(module, q, k, v, None, cu_seq_lens_q=cu)
    torch.testing.assert_close(first, _dense(q, k, v), atol=1e-6, rtol=1e-5)
    cu.copy_(torch.tensor([0, 2, 8, 17, 22, 24, 26]))
    second, _ = pa.packed_attention_forward(module, q, k, v, None, cu_seq_lens_q=cu)
    ref = _dense(q, k, v, lengths=[2, 6, 9, 5, 2, 2])
    torch.testing.assert_close(second, ref, atol=1e-6, rtol=1e-5)
