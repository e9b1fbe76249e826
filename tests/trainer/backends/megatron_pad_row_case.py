"""The gradient of the pad token's embedding row on the megatron backend against the HF model's.

Run as a script (``python megatron_pad_row_case.py OUT.json``): one process, tensor 1, for a
Qwen2 whose output layer is its input embedding (tied) and one whose is not, each with a
``pad_token_id``. The HF model's ``nn.Embedding(padding_idx=...)`` keeps the lookup's gradient
off the pad row; a tied model's ``lm_head`` still sends it its projection's gradient. One
backward of the same log-prob loss (the rows read by the lookup include the pad token) through
the megatron actor and through the HF model; writes, per case, the max abs difference of the
embedding's gradient (and of the output layer's, untied), the pad row's included, relative to
the gradient's largest entry, and the pad row's gradient on each side.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from megatron_cases import _batch, _cfg  # (this script's directory is on sys.path)

PAD = 0


def _case(tied: bool, root: Path) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from ppojob_trainer.backends import megatron_backend as mb_
    from ppojob_trainer.backends import megatron_inputs
    from ppojob_trainer.distributed import identity

    config = Qwen2Config(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        pad_token_id=PAD,
    )
    torch.manual_seed(1)
    hf = AutoModelForCausalLM.from_config(config).float()
    path = root / ("tied" if tied else "untied")
    hf.save_pretrained(path)
    cfg: Any = _cfg(1, 1, 4)
    one = cfg.roles.actor.model_copy(update={"replicas": 1})
    cfg = cfg.model_copy(update={"roles": cfg.roles.model_copy(update={"actor": one})})
    actor = mb_.MegatronPolicyTrainer(
        cfg, path, identity("actor", 0, 1, 1, 1, 1), need_reference=False
    )
    batch = _batch(4, 3)
    ids, index = megatron_inputs.left_aligned(batch)
    assert bool((ids == PAD).any()), "the lookup must read the pad row"

    def head(output: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, None]:
        logp, _ = actor._token_stats(actor.m.model, output, mb)
        return -(logp * mb["response_mask"]).sum(), None

    model = actor.m.model
    model.train()
    actor.m.run(batch, 4, head, forward_only=False)

    logits = hf(input_ids=ids).logits.float() / actor.temperature
    logp = torch.log_softmax(logits, -1)
    at = logp.gather(1, index[..., None].expand(-1, -1, logp.shape[-1]))
    tok = at.gather(-1, batch["response_ids"][..., None])[..., 0]
    (-(tok * batch["response_mask"]).sum()).backward()

    pairs = [(model.embedding.word_embeddings.weight.grad, hf.model.embed_tokens.weight.grad)]
    if not tied:
        pairs.append((model.output_layer.weight.grad, hf.lm_head.weight.grad))
    rel = max(float((m - h).abs().max() / h.abs().max()) for m, h in pairs)
    emb_m, emb_h = pairs[0]
    return {
        "grad_rel": rel,
        "pad_row_megatron": float(emb_m[PAD].abs().max()),
        "pad_row_hf": float(emb_h[PAD].abs().max()),
    }


def main() -> None:
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        out = {f"tied={t}": _case(t, Path(tmp)) for t in (True, False)}
    Path(sys.argv[1]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
