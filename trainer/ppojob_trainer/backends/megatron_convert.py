"""Hugging Face <-> megatron-core weight conversion for the Llama, Qwen2, Qwen3-MoE and Mixtral
families.

Pure tensor code (no megatron import, no process group): :func:`hf_to_megatron` cuts a Hugging
Face state dict into the state dict of one tensor/pipeline-parallel rank of a megatron-core
``GPTModel`` built with the local (non-Transformer-Engine) layer spec; :func:`megatron_to_hf`
puts the shards of every rank back together under the HF names. Both are exact: a round trip
returns bit-identical tensors. :func:`local_from_slices` builds one rank's tensor from only the
slices of the HF tensors that rank holds (what a rank reads from the checkpoint's files), equal
to :func:`hf_to_megatron`'s.

Layout facts (megatron-core 0.16, local spec):

- ``linear_qkv`` holds, per key/value group, that group's query heads then its key head then its
  value head (rows); tensor parallelism splits whole groups, so ``tensor`` must divide the number
  of key/value heads.
- ``linear_fc1`` of a gated MLP (SwiGLU) holds ``[gate; up]`` *per rank*: rank r's shard is its
  slice of ``gate_proj`` stacked on its slice of ``up_proj``.
- ``linear_proj`` and ``linear_fc2`` are row parallel (split along the input dimension); the
  embedding and the output layer are split along the vocabulary.
- Layer ``i`` of pipeline stage ``s`` is HF layer ``s * layers / pipeline + i``.
- Mixture-of-experts layers (Qwen3-MoE, Mixtral; megatron-core's ``MoELayer`` with its
  ``SequentialMLP``): the router ``mlp.router.weight`` [experts, hidden] is replicated; each
  expert is a gated MLP laid out like the dense one under ``mlp.experts.local_experts.<j>``, split
  over the tensor-parallel ranks (expert tensor parallelism = tensor), and expert parallel rank
  ``p`` of ``P`` holds experts ``p * experts / P`` onwards. ``transformers`` >= 5 keeps a layer's
  experts fused in two tensors, ``mlp.experts.gate_up_proj`` [experts, 2 x intermediate, hidden]
  (gate rows then up rows) and ``mlp.experts.down_proj`` [experts, hidden, intermediate]. Here a
  rank's experts travel stacked under :data:`STACKED_FC1` / :data:`STACKED_FC2` keys
  ([local experts, ...]: :func:`stack_experts`, :func:`unstack_experts`), so that expert
  parallel ranks' pieces concatenate along dimension 0. Qwen3's per-head ``q_norm`` / ``k_norm``
  are megatron's ``q_layernorm`` / ``k_layernorm``.

A critic is the same model with a value head instead of the output layer: HF-side names
``value_head.weight`` [1, hidden] and ``value_head.bias`` [1]; megatron-side ``output_layer.weight``
and ``output_layer.bias``, replicated on every tensor-parallel rank.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
MODEL_TYPES = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}
MOE_FAMILIES = ("qwen3_moe", "mixtral")
STACKED_FC1 = "mlp.experts.linear_fc1.weight"
STACKED_FC2 = "mlp.experts.linear_fc2.weight"
CHECKPOINT_EXPERT_NAMES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}
"""family -> (a MoE layer's block name in the model's checkpoint files, the file names of an
expert's gate, up and down projections): what transformers writes (``save_pretrained``
unfuses its in-memory ``mlp.experts.gate_up_proj``) and what SGLang's ``load_weights`` reads:
``model.layers.<i>.<block>.experts.<e>.<gate>.weight`` [intermediate, hidden], ..., the router
``model.layers.<i>.<block>.gate.weight``."""
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
# (low_freq_factor, high_freq_factor, original_max_position_embeddings) of the llama3 RoPE scaling
# megatron-core 0.16 implements (RotaryEmbedding._apply_scaling's fixed values).
LLAMA3_ROPE = (1.0, 4.0, 8192)


@dataclass(frozen=True)
class ModelShape:
    """What the conversion and the megatron config need from a HF ``config.json``."""

    family: str  # "llama", "qwen2", "qwen3_moe" or "mixtral"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rms_eps: float
    rope_theta: float
    qkv_bias: bool
    tied: bool
    max_positions: int
    pad_id: int | None = None  # HF's embedding ``padding_idx``: no lookup gradient to that row
    rope_scaling_factor: float | None = None  # llama3-type RoPE scaling (megatron's rope_scaling)
    experts: int = 0  # a MoE model's experts per layer (0: dense)
    experts_per_token: int = 0  # its router's top-k
    norm_topk: bool = True  # the top-k weights renormalised (Mixtral; Qwen3-MoE's norm_topk_prob)
    qk_norm: bool = False  # per-head RMSNorm of queries and keys (Qwen3)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @classmethod
    def from_hf_config(cls, config: Any, field: str = "spec.model.path") -> ModelShape:
        """The shape of a ``transformers`` config (or its ``to_dict()``); a clear error for an
        architecture or a feature the conversion does not cover."""
        c = config if isinstance(config, Mapping) else config.to_dict()
        archs = c.get("architectures") or [MODEL_TYPES.get(c.get("model_type", ""), "")]
        arch = archs[0] if archs else ""
        family = SUPPORTED_ARCHITECTURES.get(arch)
        if family is None:
            raise ValueError(
                f"{field}: architecture {arch or c.get('model_type')!r} is not supported by the "
                f"megatron backend (supported: {sorted(SUPPORTED_ARCHITECTURES)}); use backend "
                f"torch for this model"
            )
        # transformers >= 5 says rope_parameters; config.json files of older ones rope_scaling.
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        factor = None
        if (
            rope_type == "llama3"
            and (
                float(rope.get("low_freq_factor", 0)),
                float(rope.get("high_freq_factor", 0)),
                int(rope.get("original_max_position_embeddings", 0)),
            )
            == LLAMA3_ROPE
        ):
            factor = float(rope["factor"])  # megatron-core's rope_scaling (Llama 3.1 / 3.2)
        elif rope_type != "default":
            raise ValueError(
                f"{field}: RoPE scaling {rope!r} is not supported by the megatron backend (it "
                f"supports none, and llama3 with low/high frequency factors 1 and 4 over 8192 "
                f"positions); use backend torch for this model"
            )
        if c.get("use_sliding_window"):
            raise ValueError(
                f"{field}: sliding-window attention is not supported by the megatron backend; "
                f"use backend torch for this model"
            )
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        moe: dict[str, Any] = {}
        intermediate = int(c["intermediate_size"])
        if family in MOE_FAMILIES:
            moe, intermediate = _moe_fields(c, family, field)
        return cls(
            family=family,
            hidden=hidden,
            intermediate=intermediate,
            layers=int(c["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or hidden // heads),
            vocab=int(c["vocab_size"]),
            rms_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(c.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling_factor=factor,
            qkv_bias=family == "qwen2" or bool(c.get("attention_bias", False)),
            qk_norm=family == "qwen3_moe",
            tied=bool(c.get("tie_word_embeddings", False)),
            max_positions=int(c.get("max_position_embeddings", 4096)),
            pad_id=None if c.get("pad_token_id") is None else int(c["pad_token_id"]),
            **moe,
        )


def _moe_fields(c: Mapping[str, Any], family: str, field: str) -> tuple[dict[str, Any], int]:
    """(the MoE fields of :class:`ModelShape`, each expert's intermediate size) of a Qwen3-MoE or
    Mixtral config; a clear error for what megatron-core's MoE layer here would compute
    differently (dense layers between sparse ones, router noise, sliding windows)."""
    fix = "use backend torch for this model"
    if family == "qwen3_moe":
        if c.get("mlp_only_layers") or int(c.get("decoder_sparse_step", 1) or 1) != 1:
            raise ValueError(
                f"{field}: Qwen3-MoE configs with dense layers (mlp_only_layers, "
                f"decoder_sparse_step > 1) are not supported by the megatron backend; {fix}"
            )
        inter, norm = int(c["moe_intermediate_size"]), bool(c.get("norm_topk_prob", False))
    else:
        if c.get("sliding_window"):
            raise ValueError(
                f"{field}: sliding-window attention (sliding_window {c['sliding_window']}) is not "
                f"supported by the megatron backend; {fix}"
            )
        inter, norm = int(c["intermediate_size"]), True
    # (transformers >= 5 writes Qwen3-MoE's num_experts as num_local_experts too)
    experts = int(c.get("num_experts") or c["num_local_experts"])
    if float(c.get("router_jitter_noise") or 0.0):
        raise ValueError(
            f"{field}: router_jitter_noise {c['router_jitter_noise']} (noise on the router "
            f"during training) is not supported by the megatron backend; set it to 0 or {fix}"
        )
    top = int(c["num_experts_per_tok"])
    return {"experts": experts, "experts_per_token": top, "norm_topk": norm}, inter


def parallel_problems(
    shape: ModelShape, tensor: int, pipeline: int, expert: int = 1
) -> list[tuple[str, str]]:
    """(what, fix) for every way ``tensor`` x ``pipeline`` (x ``expert``) cannot split
    ``shape``."""
    out = []
    if expert > 1 and not shape.moe:
        out.append(
            (
                f"expert parallelism ({expert}) needs a mixture-of-experts model; this one is "
                "dense",
                "set expert: 1",
            )
        )
    elif shape.moe and shape.experts % expert:
        out.append(
            (
                f"expert {expert} does not divide the model's {shape.experts} experts",
                f"use an expert size that divides {shape.experts}",
            )
        )
    for name, n in (
        ("attention heads", shape.heads),
        ("key/value heads", shape.kv_heads),
        ("hidden size", shape.hidden),
        ("intermediate size", shape.intermediate),
        ("vocabulary size", shape.vocab),
    ):
        if n % tensor:
            out.append(
                (
                    f"tensor {tensor} does not divide the model's {n} {name}",
                    f"use a tensor size that divides {n}",
                )
            )
    if shape.layers % pipeline:
        out.append(
            (
                f"pipeline {pipeline} does not divide the model's {shape.layers} layers",
                f"use a pipeline size that divides {shape.layers}",
            )
        )
    if shape.tied and pipeline > 1:
        out.append(
            (
                "the model ties its input embedding and output layer, which the megatron backend "
                "supports with pipeline 1 only",
                "set pipeline: 1",
            )
        )
    return out


def _chunk(t: torch.Tensor, n: int, rank: int, dim: int) -> torch.Tensor:
    return t.chunk(n, dim=dim)[rank].clone()


def _qkv_rows(shape: ModelShape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Interleave q, k, v (rows, or bias entries) into megatron's per-group layout."""
    g, d = shape.kv_heads, shape.head_dim
    per = shape.heads // g
    tail = q.shape[1:]
    qg = q.reshape(g, per * d, *tail)
    kg = k.reshape(g, d, *tail)
    vg = v.reshape(g, d, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(g * (per + 2) * d, *tail)


def _split_qkv(shape: ModelShape, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    g, d = shape.kv_heads, shape.head_dim
    per = shape.heads // g
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *tail)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return (
        q.reshape(g * per * d, *tail).clone(),
        k.reshape(g * d, *tail).clone(),
        v.reshape(g * d, *tail).clone(),
    )


def stage_layers(shape: ModelShape, pp_rank: int, pp_size: int) -> range:
    """HF layer indices held by pipeline stage ``pp_rank``."""
    per = shape.layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor],
    shape: ModelShape,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    *,
    value_head: Mapping[str, torch.Tensor] | None = None,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> dict[str, torch.Tensor]:
    """The megatron state dict of rank (``tp_rank``, ``pp_rank``, ``ep_rank``) from a HF state
    dict, a MoE layer's experts stacked (:data:`STACKED_FC1`; :func:`unstack_experts` gives
    megatron's own names).

    ``hf`` uses the ``AutoModelForCausalLM`` names (``model.layers.0...``, ``lm_head.weight``).
    With ``value_head`` (``{"weight", "bias"}``) the last stage gets a value head instead of the
    output layer (the critic).
    """
    tp, r = tp_size, tp_rank
    out: dict[str, torch.Tensor] = {}
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    if first:
        out["embedding.word_embeddings.weight"] = _chunk(hf["model.embed_tokens.weight"], tp, r, 0)
    for local, i in enumerate(stage_layers(shape, pp_rank, pp_size)):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{local}."
        attn = src + "self_attn."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"].clone()
        qkv = _qkv_rows(
            shape,
            hf[attn + "q_proj.weight"],
            hf[attn + "k_proj.weight"],
            hf[attn + "v_proj.weight"],
        )
        out[dst + "self_attention.linear_qkv.weight"] = _chunk(qkv, tp, r, 0)
        if shape.qkv_bias:
            bias = _qkv_rows(
                shape, hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"]
            )
            out[dst + "self_attention.linear_qkv.bias"] = _chunk(bias, tp, r, 0)
        out[dst + "self_attention.linear_proj.weight"] = _chunk(
            hf[attn + "o_proj.weight"], tp, r, 1
        )
        if shape.qk_norm:
            for k in "qk":
                out[dst + f"self_attention.{k}_layernorm.weight"] = hf[
                    attn + f"{k}_norm.weight"
                ].clone()
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"].clone()
        if shape.moe:
            local = shape.experts // ep_size
            mine = slice(ep_rank * local, (ep_rank + 1) * local)
            out[dst + "mlp.router.weight"] = hf[src + "mlp.gate.weight"].clone()
            gate, up = hf[src + "mlp.experts.gate_up_proj"][mine].chunk(2, 1)
            out[dst + STACKED_FC1] = torch.cat([gate.chunk(tp, 1)[r], up.chunk(tp, 1)[r]], 1)
            out[dst + STACKED_FC2] = _chunk(hf[src + "mlp.experts.down_proj"][mine], tp, r, 2)
            continue
        gate = hf[src + "mlp.gate_proj.weight"].chunk(tp, 0)[r]
        up = hf[src + "mlp.up_proj.weight"].chunk(tp, 0)[r]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up], 0)
        out[dst + "mlp.linear_fc2.weight"] = _chunk(hf[src + "mlp.down_proj.weight"], tp, r, 1)
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if value_head is not None:
            out["output_layer.weight"] = value_head["weight"].clone()
            out["output_layer.bias"] = value_head["bias"].clone()
        elif not shape.tied:
            out["output_layer.weight"] = _chunk(hf["lm_head.weight"], tp, r, 0)
    return out


@dataclass(frozen=True)
class HfTensor:
    """One Hugging Face tensor and where it lies in megatron's shards: pipeline stage
    ``stage`` holds it under ``key``, and its tensor-parallel pieces make it as ``kind`` says:

    - ``replicated``: every tensor-parallel rank holds all of it (tensor-parallel rank 0's copy);
    - ``cat0`` / ``cat1``: the pieces concatenated along dimension 0 / 1;
    - ``q``, ``k``, ``v``: those rows of each piece of ``linear_qkv`` (whole key/value groups per
      rank), concatenated over the pieces;
    - ``gate``, ``up``: that half of each piece of ``linear_fc1``, concatenated over the pieces;
    - ``experts_gate_up``: a MoE layer's experts' ``gate_up_proj`` from the stacked
      :data:`STACKED_FC1` pieces (every expert, expert parallel ranks' stacks concatenated);
    - ``experts_down``: their ``down_proj``, the stacked :data:`STACKED_FC2` pieces concatenated
      along dimension 2.
    """

    name: str
    stage: int
    key: str
    kind: str
    shape: tuple[int, ...]

    @property
    def split(self) -> bool:
        """Whether every tensor-parallel rank holds a different piece of it."""
        return self.kind != "replicated"


def hf_layout(shape: ModelShape, pp_size: int = 1, *, value: bool = False) -> list[HfTensor]:
    """Every HF tensor of the model (a critic's: backbone and ``value_head.*``), in the order
    :func:`megatron_to_hf` gives them. Needs only the shape: every rank computes the same list
    without communicating. A tied model's ``lm_head.weight`` is the embedding again."""
    h, d, v = shape.hidden, shape.head_dim, shape.vocab
    q_rows, kv_rows = shape.heads * d, shape.kv_heads * d
    rows = (("q", q_rows), ("k", kv_rows), ("v", kv_rows))
    out = [
        HfTensor("model.embed_tokens.weight", 0, "embedding.word_embeddings.weight", "cat0", (v, h))
    ]
    inter = shape.intermediate
    qkv = "self_attention.linear_qkv."
    layer: list[tuple[str, str, str, tuple[int, ...]]] = [  # (HF, megatron, kind, shape)
        ("input_layernorm.weight", "input_layernorm.weight", "replicated", (h,)),
        *((f"self_attn.{k}_proj.weight", qkv + "weight", k, (n, h)) for k, n in rows),
        *(
            (f"self_attn.{k}_proj.bias", qkv + "bias", k, (n,))
            for k, n in (rows if shape.qkv_bias else ())
        ),
        ("self_attn.o_proj.weight", "self_attention.linear_proj.weight", "cat1", (h, q_rows)),
        *(
            (
                f"self_attn.{k}_norm.weight",
                f"self_attention.{k}_layernorm.weight",
                "replicated",
                (d,),
            )
            for k in ("qk" if shape.qk_norm else "")
        ),
        ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight", "replicated", (h,)),
    ]
    e = shape.experts
    if shape.moe:
        layer += [
            ("mlp.gate.weight", "mlp.router.weight", "replicated", (e, h)),
            ("mlp.experts.gate_up_proj", STACKED_FC1, "experts_gate_up", (e, 2 * inter, h)),
            ("mlp.experts.down_proj", STACKED_FC2, "experts_down", (e, h, inter)),
        ]
    else:
        layer += [
            ("mlp.gate_proj.weight", "mlp.linear_fc1.weight", "gate", (inter, h)),
            ("mlp.up_proj.weight", "mlp.linear_fc1.weight", "up", (inter, h)),
            ("mlp.down_proj.weight", "mlp.linear_fc2.weight", "cat1", (h, inter)),
        ]
    for pp_rank in range(pp_size):
        for local, i in enumerate(stage_layers(shape, pp_rank, pp_size)):
            out += [
                HfTensor(f"model.layers.{i}.{name}", pp_rank, f"decoder.layers.{local}.{key}", k, n)
                for name, key, k, n in layer
            ]
    last = pp_size - 1
    out.append(
        HfTensor("model.norm.weight", last, "decoder.final_layernorm.weight", "replicated", (h,))
    )
    if value:
        out.append(HfTensor("value_head.weight", last, "output_layer.weight", "replicated", (1, h)))
        out.append(HfTensor("value_head.bias", last, "output_layer.bias", "replicated", (1,)))
    elif shape.tied:
        out.append(
            HfTensor("lm_head.weight", 0, "embedding.word_embeddings.weight", "cat0", (v, h))
        )
    else:
        out.append(HfTensor("lm_head.weight", last, "output_layer.weight", "cat0", (v, h)))
    return out


def hf_from_pieces(shape: ModelShape, t: HfTensor, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """HF tensor ``t`` from the tensors under ``t.key`` of every tensor-parallel rank of its
    stage, in rank order (a replicated tensor: tensor-parallel rank 0's alone will do)."""
    if t.kind == "replicated":
        return pieces[0].clone()
    if t.kind in ("cat0", "cat1"):
        return torch.cat(list(pieces), int(t.kind[-1]))
    if t.kind in ("q", "k", "v"):
        j = "qkv".index(t.kind)
        return torch.cat([_split_qkv_local(shape, p, len(pieces))[j] for p in pieces], 0)
    if t.kind in ("gate", "up"):
        j = ("gate", "up").index(t.kind)
        return torch.cat([p.chunk(2, 0)[j] for p in pieces], 0)
    if t.kind == "experts_gate_up":
        halves = [torch.cat([p.chunk(2, 1)[j] for p in pieces], 1) for j in (0, 1)]
        return torch.cat(halves, 1)
    if t.kind == "experts_down":
        return torch.cat(list(pieces), 2)
    raise ValueError(f"unknown piece layout {t.kind!r} of {t.name}")


def checkpoint_names(family: str, t: HfTensor, expert: int) -> str:
    """The name in the checkpoint files of HF tensor ``t`` (a router: ``expert`` unused) or of
    expert ``expert``'s part of it: ``experts_gate_up`` the gate's (``"<gate>|<up>"``: both,
    split on ``|``), ``experts_down`` the down projection's."""
    block, (gate, up, down) = CHECKPOINT_EXPERT_NAMES[family]
    head = t.name.split(".mlp.")[0] + f".{block}."
    if t.kind == "experts_gate_up":
        return f"{head}experts.{expert}.{gate}.weight|{head}experts.{expert}.{up}.weight"
    if t.kind == "experts_down":
        return f"{head}experts.{expert}.{down}.weight"
    return head + "gate.weight"


def stack_experts(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` with each MoE layer's ``local_experts.<j>.linear_fc1/2.weight`` stacked in ``j``'s
    order under :data:`STACKED_FC1` / :data:`STACKED_FC2` (a dense model's: unchanged)."""
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for k, v in sd.items():
        m = _LOCAL_EXPERT.match(k)
        if m is None:
            out[k] = v
        else:
            stacks.setdefault(m.group(1) + m.group(3), {})[int(m.group(2))] = v
    for key, experts in stacks.items():
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(f"megatron conversion: experts {sorted(experts)} of {key}")
        out[key] = torch.stack([experts[j] for j in range(len(experts))])
    return out


def unstack_experts(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`stack_experts` undone: megatron-core's own names."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        for stacked in (STACKED_FC1, STACKED_FC2):
            if k.endswith("." + stacked):
                head = k[: -len(stacked)]
                leaf = stacked.rsplit(".", 2)[-2] + ".weight"
                for j, piece in enumerate(v.unbind(0)):
                    out[f"{head}mlp.experts.local_experts.{j}.{leaf}"] = piece
                break
        else:
            out[k] = v
    return out


SliceReader = Callable[[str, int, int, int], torch.Tensor]
"""``read(name, dim, start, stop)``: HF tensor ``name`` restricted to ``start:stop`` along ``dim``
(a new tensor: only those entries are read)."""


def stage_pieces(
    shape: ModelShape, pp_rank: int = 0, pp_size: int = 1, *, value: bool = False
) -> dict[str, list[HfTensor]]:
    """The megatron keys of pipeline stage ``pp_rank`` (what :func:`hf_to_megatron` gives it)
    and the HF tensors each is made of (:func:`hf_layout`; a tied ``lm_head.weight`` is the
    embedding's, listed once)."""
    out: dict[str, list[HfTensor]] = {}
    for t in hf_layout(shape, pp_size, value=value):
        if t.stage != pp_rank:
            continue
        parts = out.setdefault(t.key, [])
        if all(p.kind != t.kind for p in parts):
            parts.append(t)
    return out


def local_from_slices(
    shape: ModelShape,
    parts: Sequence[HfTensor],
    read: SliceReader,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> torch.Tensor:
    """Tensor-parallel rank ``tp_rank``'s piece of the megatron tensor made of ``parts`` (one
    entry of :func:`stage_pieces`), built from the HF tensors' slices that rank holds, read
    with ``read``: equal to :func:`hf_to_megatron`'s, without ever holding a whole split tensor.

    ``q``/``k``/``v`` rows: tensor parallelism splits whole key/value groups, and a group's query
    heads are contiguous HF rows, so rank r reads its groups' rows of each and interleaves them as
    :func:`hf_to_megatron` does for a model of ``heads / tp`` heads over ``kv_heads / tp`` groups.
    """

    def rows_of(t: HfTensor, dim: int) -> torch.Tensor:
        n = t.shape[dim] // tp_size
        return read(t.name, dim, tp_rank * n, (tp_rank + 1) * n)

    kinds = {t.kind: t for t in parts}
    first = parts[0]
    if first.kind == "replicated":
        return read(first.name, 0, 0, first.shape[0])
    if first.kind in ("cat0", "cat1"):
        return rows_of(first, int(first.kind[-1]))
    if set(kinds) == {"q", "k", "v"}:
        local = ModelShape(
            **{
                **shape.__dict__,
                "heads": shape.heads // tp_size,
                "kv_heads": shape.kv_heads // tp_size,
            }
        )
        return _qkv_rows(local, *(rows_of(kinds[k], 0) for k in "qkv"))
    if set(kinds) == {"gate", "up"}:
        return torch.cat([rows_of(kinds["gate"], 0), rows_of(kinds["up"], 0)], 0)
    # (a MoE layer's fused experts: transformers writes them to its files per expert, so a
    # checkpoint's files never hold them under these names and they are loaded whole)
    raise ValueError(f"megatron tensor {first.key}: unknown piece layouts {sorted(kinds)}")


def megatron_to_hf(
    shards: Sequence[Sequence[Mapping[str, torch.Tensor]]],
    shape: ModelShape,
    *,
    value: bool = False,
) -> dict[str, torch.Tensor]:
    """The HF state dict from ``shards[pp_rank][tp_rank]`` (every rank's megatron state dict),
    tensor by tensor (:func:`hf_layout`, :func:`hf_from_pieces`).

    A critic's shards give its backbone under HF names plus ``value_head.weight`` and
    ``value_head.bias``; a tied model gives ``lm_head.weight`` equal to the embedding (the same
    tensor), as ``transformers`` reports it.
    """
    out: dict[str, torch.Tensor] = {}
    made: dict[tuple[int, str, str], torch.Tensor] = {}
    for t in hf_layout(shape, len(shards), value=value):
        ident = (t.stage, t.key, t.kind)
        if ident not in made:
            made[ident] = hf_from_pieces(shape, t, [s[t.key] for s in shards[t.stage]])
        out[t.name] = made[ident]
    return out


def _split_qkv_local(shape: ModelShape, qkv: torch.Tensor, tp: int) -> tuple[torch.Tensor, ...]:
    """q, k, v rows of one rank's ``linear_qkv`` shard (``kv_heads / tp`` groups)."""
    local = ModelShape(
        **{**shape.__dict__, "heads": shape.heads // tp, "kv_heads": shape.kv_heads // tp}
    )
    return _split_qkv(local, qkv)


__all__ = [
    "CHECKPOINT_EXPERT_NAMES",
    "MOE_FAMILIES",
    "STACKED_FC1",
    "STACKED_FC2",
    "SUPPORTED_ARCHITECTURES",
    "HfTensor",
    "ModelShape",
    "checkpoint_names",
    "hf_from_pieces",
    "hf_layout",
    "hf_to_megatron",
    "local_from_slices",
    "megatron_to_hf",
    "parallel_problems",
    "stack_experts",
    "stage_layers",
    "stage_pieces",
    "unstack_experts",
]
