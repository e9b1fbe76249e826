"""SGLang generation engine (GPU). Imported only when ``spec.roles.rollout.backend: sglang``.

One engine spans ``parallelism.tensor`` GPUs of one node: an offline ``sglang.Engine`` with
``tp_size = tensor`` started by one Ray process, which sees exactly those GPUs (its own bundle's
when the rollout has its own pods; the t GPUs of its actor bundle when colocated).

- Generation: ``Engine.generate(input_ids=..., sampling_params=..., return_logprob=True)``; the
  sampled tokens and their log-probs come from ``meta_info.output_token_logprobs``
  (``(logprob, token_id, text)`` per token; the text is None).
- The engine never loads its tokenizer (``skip_tokenizer_init``): the trainer applies the chat
  template and tokenizes the prompts itself, sends token ids, stops on token ids
  (``stop_token_ids``: no stop strings, stop regexes or ``min_new_tokens``, the only sampling
  parameters SGLang needs a tokenizer for) and decodes the responses itself, so SGLang's
  detokenizer, which decoded every response a second time, has nothing to do (its scheduler
  sends the token ids straight back). What SGLang stops on without its tokenizer: our
  ``stop_token_ids`` (the tokenizer's special tokens and EOS) and the model config's
  ``eos_token_id``; no longer its own extra list (``<|eom_id|>`` and two others, when the
  tokenizer's added vocabulary has them), so both backends stop on what the trainer names.
- Colocated sleep/wake (``offload``): ``release_memory_occupation`` (everything) before the
  actor trains; ``resume_memory_occupation(tags=["weights"])`` before the weight update and
  ``resume_memory_occupation(tags=["kv_cache", "cuda_graph"])`` after it (the host empties the
  allocator's cache before each wake), so the KV cache is never held while buckets are staged.
  With LoRA the engine keeps a host copy of its base weights while released
  (``enable_weights_cpu_backup``, :func:`offload_server_args`): an adapter sync sends no base
  weight, and without the copy they would come back undefined; the adapter refuses to release
  an engine started without it.
- Every weight update runs inside a session: ``begin_weight_update`` ... ``end_weight_update``
  (SGLang 0.5.23 refuses ``update_weights_from_*`` outside one, answering ``(False, msg)``).
  Every ``(success, message)`` SGLang returns is checked: a refusal raises, never passes.
- Colocated weight sync: ``update_weights_from_tensor`` with ``load_format="flattened_bucket"``:
  per bucket one payload per tensor-parallel rank, each the ``MultiprocessingSerializer``
  serialization of ``{"flattened_tensor", "metadata"}`` made by the process that owns that GPU
  (a CUDA IPC handle; SGLang's rank ``i`` deserializes only payload ``i``).
- Disaggregated weight sync: ``init_weights_update_group`` once (rank 0 the actor's leader),
  then ``update_weights_from_distributed(load_format="flattened_bucket")`` per bucket while the
  leader broadcasts the bucket once, packed as SGLang's ``FlattenedTensorBucket.empty`` lays it
  out from the names, dtypes and shapes (:func:`~.weight_sync.pack`).
- LoRA (``spec.model.lora``): the engine starts with SGLang's LoRA pool (:func:`lora_server_args`)
  and each sync sends the adapters only, in PEFT names (:func:`peft_adapter_tensors`), as ONE
  ``load_lora_adapter_from_tensors`` under the fixed name :data:`LORA_ADAPTER_NAME` after
  ``unload_lora_adapter`` of the previous version (SGLang refuses to load a name that is loaded;
  its unload waits for the requests using the adapter to finish). No weight-update session: SGLang
  0.5.23 gates only ``update_weights_from_*`` with one, and the base weights never change. A
  disaggregated engine takes the adapters through the object store (SGLang has no LoRA load from
  a broadcast). Every generate request names the adapter once one is loaded (``lora_path``).
- Routing replay (``algorithm.routingReplay: rollout``, a MoE model): the engine starts with
  ``enable_return_routed_experts`` and every request asks ``return_routed_experts``; SGLang
  answers ``meta_info.routed_experts``, base64 of an int32 ``[seqlen - 1, num_hidden_layers,
  num_experts_per_tok]`` array (every fed token: the prompt, then the response but its last
  token), which :func:`routed_experts_of` splits into the prompt's and the response's columns.

Every SGLang name used here is in :data:`ENGINE_CALLS`, :data:`RUNTIME_IMPORTS`,
:func:`engine_args`, :func:`sampling_params` and :data:`OUTPUT_FIELDS`;
``tests/trainer/backends/test_sglang_contract.py`` checks them against the source of the SGLang
release pinned in the ``gpu`` extra (:data:`SGLANG_VERSION`), without importing it.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import missing_backend
from .base import Generation, GenerationEngine
from .megatron_convert import CHECKPOINT_EXPERT_NAMES
from .weight_sync import FlatBucket

if TYPE_CHECKING:
    from ppojob_api.training import LoraSpec

SGLANG_VERSION = "0.5.23"
"""The release the adapter is checked against (``pyproject.toml``: ``gpu`` extra)."""

RUNTIME_IMPORTS: dict[str, tuple[str, str]] = {
    "Engine": ("sglang", "Engine"),
    "MultiprocessingSerializer": ("sglang.srt.utils.common", "MultiprocessingSerializer"),
    "monkey_patch_torch_reductions": (
        "sglang.srt.utils.patch_torch",
        "monkey_patch_torch_reductions",
    ),
    "FlattenedTensorMetadata": ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
}
"""(module, name) of every SGLang object the adapter loads."""

OUTPUT_FIELDS = ("meta_info", "output_token_logprobs")
"""Where a generate result holds the sampled tokens: ``out[meta_info][output_token_logprobs]``."""
ROUTED_EXPERTS_FIELDS = ("meta_info", "routed_experts")
"""Where a generate result asked with ``return_routed_experts`` holds them (base64, int32)."""

FLATTENED_BUCKET = "flattened_bucket"
BUCKET_KEYS = ("flattened_tensor", "metadata")
"""The keys of one flattened-bucket payload, as SGLang's weight updater reads them."""


def sglang_object(name: str) -> Any:
    """An SGLang object of :data:`RUNTIME_IMPORTS`, with a clear error when SGLang is absent."""
    module, attr = RUNTIME_IMPORTS[name]
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError:
        raise missing_backend("sglang", "sglang", "spec.roles.rollout.backend") from None


def engine_args(
    cfg: Any,
    model_dir: Path,
    ports: tuple[int, int] | None = None,
    gpu_gib: float | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``sglang.Engine`` (``ServerArgs`` fields) for this job. ``ports``:
    this engine's own ``port`` and ``nccl_port`` (several engines share a node: SGLang's
    defaults would collide); ``gpu_gib``: the memory of the GPU it runs on (else the node
    selector's, as ``ppojob validate`` assumes)."""
    rollout = cfg.roles.rollout
    own = {"port": ports[0], "nccl_port": ports[1]} if ports else {}
    return {
        **own,
        "model_path": str(model_dir),
        "dtype": cfg.model.dtype,
        "tp_size": rollout.parallelism.tensor,
        "base_gpu_id": 0,  # the process sees exactly its engine's GPUs
        "mem_fraction_static": engine_fraction(cfg, model_dir, gpu_gib),
        "random_seed": cfg.training.seed,
        "trust_remote_code": cfg.model.trust_remote_code,
        "skip_tokenizer_init": True,  # ids in, ids out: the trainer tokenizes and decodes
        **offload_server_args(cfg),
        **(lora_server_args(cfg.model.lora) if cfg.model.lora is not None else {}),
        **({"enable_return_routed_experts": True} if records_routing(cfg) else {}),
    }


def records_routing(cfg: Any) -> bool:
    """Whether the engine returns the experts of every token (``algorithm.routingReplay``)."""
    return cfg.algorithm.routing_replay == "rollout"


def engine_fraction(cfg: Any, model_dir: Path, gpu_gib: float | None = None) -> float:
    """The engine's ``mem_fraction_static``: the spec's, else on its own GPUs 0.85, else
    (colocated) the memory plan's for the model it loads (``model_dir``'s config.json, else the
    shape ``model.path`` names), never
    above what fits after a training step. A colocated engine the plan says cannot fit is
    refused here, before training, in the line ``ppojob validate`` prints for a model whose shape
    it knows (:class:`StartupError`)."""
    from ppojob_api.memory_plan import (
        DEFAULT_ENGINE_FRACTION,
        gpu_gib_of,
        plan_job,
        plan_problems,
        resolve_shape,
    )

    from ..errors import StartupError

    rollout = cfg.roles.rollout
    written = rollout.gpu_memory_fraction
    if not rollout.colocate_with_actor:
        return DEFAULT_ENGINE_FRACTION if written is None else written
    shape = resolve_shape(str(model_dir)) or resolve_shape(cfg.model.path)
    if shape is None:
        if written is not None:
            return written
        raise StartupError(
            "spec.roles.rollout.gpuMemoryFraction: unset, and the memory plan cannot size the "
            f"colocated engine: {model_dir} holds no readable config.json (fix: set "
            "roles.rollout.gpuMemoryFraction)"
        )
    actor = cfg.roles.actor
    gib = (
        gpu_gib
        if gpu_gib is not None
        else gpu_gib_of(actor.node_selector, actor.resources.gpu_memory)
    )
    problems = plan_problems(cfg, "spec", gib, shape)
    if problems:
        raise StartupError("the memory plan refuses this job: " + "; ".join(map(str, problems)))
    fraction = plan_job(cfg, gib, shape)[0].engine_fraction
    return float(written if fraction is None else fraction)


def _device_gib() -> float | None:
    """Memory of this process's GPU in GiB (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30


def offload_server_args(cfg: Any) -> dict[str, bool]:
    """``ServerArgs`` fields of a colocated engine's sleep and wake (``offload``): SGLang's
    memory saver (torch_memory_saver), whose release unmaps the weights without a host copy
    unless ``enable_weights_cpu_backup`` is on (SGLang opens its weights region with
    ``enable_cpu_backup`` from it). A full sync rewrites every weight after the wake, so none is
    needed; with LoRA a sync sends the adapters only, and the base weights must come back from
    the host copy (host memory: the engine's weights per GPU; the memory plan says so)."""
    rollout = cfg.roles.rollout
    offload = rollout.releases_memory
    return {
        "enable_memory_saver": offload,
        "enable_weights_cpu_backup": offload and cfg.model.lora is not None,
    }


LORA_ADAPTER_NAME = "policy"
"""The name the actor's adapter is loaded under (the same every sync: unload, then load)."""

LORA_TARGET_ALL = "all"
"""SGLang's spelling of every supported linear layer (``--lora-target-modules all``); PEFT's
``all-linear`` is not among its choices."""


def lora_server_args(lora: LoraSpec) -> dict[str, Any]:
    """``ServerArgs`` fields of SGLang's LoRA pool for the actor's adapter: one adapter of
    ``lora.rank`` on ``lora.target_modules`` (SGLang needs both up front when no adapter is
    given at start), one adapter slot per batch (every request uses the same one)."""
    targets = list(lora.target_modules)
    return {
        "enable_lora": True,
        "max_lora_rank": lora.rank,
        "lora_target_modules": [LORA_TARGET_ALL] if targets == ["all-linear"] else targets,
        "max_loras_per_batch": 1,
    }


PEFT_PREFIX = "base_model.model."


def peft_adapter_tensors(adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The torch backend's adapter export (``<module>.lora_A`` / ``<module>.lora_B``, HF module
    names) in PEFT's names, which SGLang's ``LoRAAdapter`` parses (the layer index from
    ``layers.<i>.``, the projection from the module name, A or B from ``lora_A``/``lora_B``):
    ``base_model.model.<module>.lora_A.weight``."""
    from .torch_backend.lora import LORA_A, LORA_B

    out = {}
    for name, t in adapters.items():
        if not name.endswith((LORA_A, LORA_B)):
            raise ValueError(f"adapter sync: {name!r} is no LoRA tensor")
        out[f"{PEFT_PREFIX}{name}.weight"] = t
    return out


def lora_config_dict(lora: LoraSpec) -> dict[str, Any]:
    """The PEFT ``adapter_config.json`` SGLang's ``LoRAConfig.from_dict`` reads with our tensors.
    Our export multiplies B by alpha / r already, and SGLang scales B A by its
    ``lora_alpha / r``: so ``lora_alpha`` is ``r`` here (a scaling of 1), not the spec's alpha."""
    targets = list(lora.target_modules)
    return {
        "peft_type": "LORA",
        "r": lora.rank,
        "lora_alpha": lora.rank,
        "target_modules": "all-linear" if targets == ["all-linear"] else targets,
        "bias": "none",
        "use_dora": False,
        "task_type": "CAUSAL_LM",
    }


def row_seeds(seed: int, rows: int) -> list[int]:
    """One sampling seed per prompt row: SGLang seeds a row's sampler with its seed and the
    token position, so rows sharing a seed (the samples of one prompt) would sample the same
    tokens under its deterministic inference."""
    return [(seed * 1_000_003 + i) % 2**31 for i in range(rows)]


def sampling_params(
    max_new_tokens: int, temperature: float, top_p: float, stop_ids: Sequence[int], seed: int
) -> dict[str, Any]:
    """``sampling_params`` of ``Engine.generate`` (``SamplingParams`` fields) for one row.
    ``sampling_seed`` takes effect only under SGLang's deterministic inference (off here)."""
    return {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "stop_token_ids": list(stop_ids),
        "sampling_seed": seed,
    }


ENGINE_ENV_DROPPED = ("PYTORCH_CUDA_ALLOC_CONF",)
"""Variables of the trainer process the engine's subprocesses must not inherit: the training
allocator's settings (``expandable_segments`` does not work with the memory saver's pools)."""


@contextmanager
def _engine_env(devices: Sequence[str] | None) -> Iterator[None]:
    """The environment the engine's subprocesses start with: ``CUDA_VISIBLE_DEVICES`` (colocated:
    the bundle's t GPUs, this process's own first, so device 0 stays this process's GPU) and
    none of :data:`ENGINE_ENV_DROPPED`; this process's own is restored after."""
    changes: dict[str, str | None] = dict.fromkeys(ENGINE_ENV_DROPPED)
    if devices:
        changes["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    saved = {k: os.environ.get(k) for k in changes}
    for k, v in changes.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


SGLANG_EXPERT_NAMES = CHECKPOINT_EXPERT_NAMES
"""model_type -> (the MoE block's module name in SGLang 0.5.23's model, its checkpoint names of
an expert's gate, up and down projections: ``FusedMoE.make_expert_params_mapping``'s
``ckpt_gate_proj_name``, ``ckpt_up_proj_name``, ``ckpt_down_proj_name`` in its ``load_weights``):
the names transformers writes to a checkpoint's files. A test reads them from SGLang's source."""

_FUSED_EXPERTS = re.compile(
    r"^(.*\.layers\.\d+\.)mlp\.(experts\.(?:gate_up_proj|down_proj)|gate\.weight)$"
)


def sglang_weight_names(
    model_type: str, named: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``named`` (the trainer's Hugging Face names: transformers >= 5 keeps a MoE layer's
    experts fused, ``mlp.experts.gate_up_proj`` [E, 2I, h] and ``mlp.experts.down_proj``
    [E, h, I]) under the names SGLang's ``load_weights`` takes: the checkpoint's, one tensor
    per expert and projection (``...experts.<e>.<gate>.weight`` [I, h], ...), the MoE block's
    router under SGLang's block name. SGLang skips a name it does not know without a word: the
    fused names would leave the engine's experts at their first weights. Dense models and
    other names pass unchanged."""
    if model_type not in SGLANG_EXPERT_NAMES:
        return dict(named)
    block, (gate, up, down) = SGLANG_EXPERT_NAMES[model_type]
    out: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            out[name] = t
            continue
        head, what = m.group(1) + block + ".", m.group(2)
        if what == "gate.weight":
            out[head + what] = t
        elif what == "experts.gate_up_proj":
            g, u = t.chunk(2, 1)
            for e in range(t.shape[0]):
                out[f"{head}experts.{e}.{gate}.weight"] = g[e]
                out[f"{head}experts.{e}.{up}.weight"] = u[e]
        else:
            for e in range(t.shape[0]):
                out[f"{head}experts.{e}.{down}.weight"] = t[e]
    return out


def serialize_bucket(bucket: FlatBucket) -> bytes:
    """One tensor-parallel rank's payload of a colocated bucket: a CUDA IPC handle of the flat
    tensor (this process keeps it alive until the engine has loaded it) and its metadata as
    SGLang's ``FlattenedTensorMetadata``."""
    sglang_object("monkey_patch_torch_reductions")()  # devices travel as UUIDs, not indices
    meta_cls = sglang_object("FlattenedTensorMetadata")
    metadata = [
        meta_cls(
            name=m.name,
            shape=torch.Size(m.shape),
            dtype=m.dtype,
            start_idx=m.start_idx,
            end_idx=m.end_idx,
            numel=m.numel,
        )
        for m in bucket.metadata
    ]
    payload = dict(zip(BUCKET_KEYS, (bucket.flattened_tensor, metadata), strict=True))
    return sglang_object("MultiprocessingSerializer").serialize(payload)


ENGINE_CALLS = (
    "generate",
    "release_memory_occupation",
    "resume_memory_occupation",
    "begin_weight_update",
    "end_weight_update",
    "update_weights_from_tensor",
    "init_weights_update_group",
    "update_weights_from_distributed",
    "load_lora_adapter_from_tensors",
    "unload_lora_adapter",
    "shutdown",
)
"""The ``sglang.Engine`` methods called below (the contract tests also read the calls and their
keywords from this module's source)."""


class SGLangGenerationEngine(GenerationEngine):
    """One SGLang engine (tensor parallel inside it) per rollout engine slot."""

    lora: LoraSpec | None = None
    """The actor's adapters (``spec.model.lora``): syncs load them, requests name them."""
    adapter_loaded = False
    """Whether the engine holds the actor's adapter (none before the first sync)."""
    routing: tuple[int, int] | None = None
    """(layers, experts per token) when the engine returns routed experts
    (``algorithm.routingReplay: rollout``); None: not asked for."""

    def __init__(
        self,
        cfg: Any,
        model_dir: Path,
        tokenizer: Any,
        stop_ids: Sequence[int],
        visible_devices: Sequence[str] | None = None,
    ) -> None:
        from ..distributed import free_ports

        engine_cls = sglang_object("Engine")
        # a colocated engine is sized by the plan for the GPU it shares with the actor
        gib = _device_gib() if cfg.roles.rollout.colocate_with_actor else None
        server_port, nccl_port = free_ports(2)
        with _engine_env(visible_devices):
            args = engine_args(cfg, model_dir, (server_port, nccl_port), gpu_gib=gib)
            self.engine = engine_cls(**args)
        self.pad_id = int(tokenizer.pad_token_id)
        self.stop_ids = sorted(set(stop_ids))
        rollout = cfg.roles.rollout
        self.offload = rollout.releases_memory
        self.lora = cfg.model.lora
        self.adapter_loaded = False
        self.routing = None
        if records_routing(cfg):
            from transformers import AutoConfig

            hf = AutoConfig.from_pretrained(
                str(model_dir), trust_remote_code=cfg.model.trust_remote_code
            ).get_text_config()  # SGLang sizes its buffer by hf_text_config
            self.routing = (int(hf.num_hidden_layers), int(hf.num_experts_per_tok))

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
    ) -> Generation:
        prompts = [row[m].tolist() for row, m in zip(prompt_ids, prompt_mask.bool(), strict=True)]
        params = [
            sampling_params(max_new_tokens, temperature, top_p, self.stop_ids, row_seed)
            for row_seed in row_seeds(seed, len(prompts))
        ]
        outs = self.engine.generate(
            input_ids=prompts,
            sampling_params=params,
            return_logprob=True,
            lora_path=self.lora_paths(len(prompts)),
            return_routed_experts=self.routing is not None,
        )
        gen = generation_from_outputs(outs, max_new_tokens, self.pad_id)
        if self.routing is None:
            return gen
        gen.prompt_routed_experts, gen.routed_experts = routed_experts_of(
            outs, prompt_mask, gen.response_ids.shape[1], *self.routing
        )
        return gen

    def lora_paths(self, rows: int) -> list[str | None] | None:
        """``lora_path`` of a generate call: the adapter's name for every row once the actor's
        adapter is loaded; None before (the base model: the actor's adapter starts at B = 0)."""
        return [LORA_ADAPTER_NAME] * rows if self.adapter_loaded else None

    def load_adapter(self, tensors: Any, load_format: str | None) -> None:
        """The actor's new adapter version: unload the loaded one (SGLang waits for requests
        using it), then load this one under the same name. ``tensors``: PEFT-named CPU tensors
        (SGLang serializes them per rank), or one flattened-bucket payload per rank."""
        assert self.lora is not None
        if self.adapter_loaded:
            _check_lora(self.engine.unload_lora_adapter(lora_name=LORA_ADAPTER_NAME), "unload")
            self.adapter_loaded = False
        _check_lora(
            self.engine.load_lora_adapter_from_tensors(
                lora_name=LORA_ADAPTER_NAME,
                tensors=tensors,
                config_dict=lora_config_dict(self.lora),
                load_format=load_format,
            ),
            "load",
        )
        self.adapter_loaded = True

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """All weights at once, from this process (a single-GPU engine in this process), in a
        session of its own; with LoRA, the adapter."""
        if self.lora is not None:
            self.load_adapter(dict(named_tensors), None)
            return
        self.begin_weight_update()
        _check(
            self.engine.update_weights_from_tensor(
                named_tensors=list(named_tensors.items()), flush_cache=True
            ),
            "update_weights_from_tensor",
        )
        self.end_weight_update()

    def begin_weight_update(self) -> None:
        if self.lora is None:  # an adapter load needs no session (base weights stay)
            _check(self.engine.begin_weight_update(), "begin_weight_update")

    def end_weight_update(self) -> None:
        if self.lora is None:
            _check(self.engine.end_weight_update(), "end_weight_update")

    def update_weights_from_tensor(self, payloads: Sequence[Any], *, flush_cache: bool) -> None:
        if self.lora is not None:
            if not flush_cache:  # the host plans one bucket for an adapter
                raise RuntimeError("adapter sync: SGLang loads an adapter in one call, not buckets")
            if all(isinstance(p, FlatBucket) for p in payloads):  # the object store's copy
                self.load_adapter(dict(payloads[0].tensors()), None)
            else:
                self.load_adapter(list(payloads), FLATTENED_BUCKET)
            return
        _check(
            self.engine.update_weights_from_tensor(
                named_tensors=list(payloads), load_format=FLATTENED_BUCKET, flush_cache=flush_cache
            ),
            "update_weights_from_tensor",
        )

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> None:
        _check(
            self.engine.init_weights_update_group(
                master_address=master_address,
                master_port=master_port,
                rank_offset=rank_offset,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
            ),
            "init_weights_update_group",
        )

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str,
        flush_cache: bool,
    ) -> None:
        if self.lora is not None:  # the loop sends adapters through the object store
            raise RuntimeError("adapter sync: SGLang loads no adapter from a broadcast")
        _check(
            self.engine.update_weights_from_distributed(
                names=list(names),
                dtypes=list(dtypes),
                shapes=[list(s) for s in shapes],
                group_name=group_name,
                flush_cache=flush_cache,
                load_format=FLATTENED_BUCKET,  # one broadcast of the packed bucket
            ),
            "update_weights_from_distributed",
        )

    def release_memory(self) -> None:
        if self.offload:
            self._check_weights_come_back()
            self.engine.release_memory_occupation()

    def _check_weights_come_back(self) -> None:
        """An adapter sync rewrites no base weight: an engine that would release its weights
        without a host copy (``enable_weights_cpu_backup`` off in the arguments it started
        with) would sample from undefined base weights after the wake, so it is an error."""
        if self.lora is None:
            return
        server_args = getattr(self.engine, "server_args", None)
        if not getattr(server_args, "enable_weights_cpu_backup", False):
            raise RuntimeError(
                "sglang engine with LoRA and offload started without enable_weights_cpu_backup: "
                "releasing its memory would lose the base weights (an adapter sync sends none)"
            )

    def resume_memory(self, tags: Sequence[str]) -> None:
        if self.offload:
            self.engine.resume_memory_occupation(tags=list(tags))

    def shutdown(self) -> None:
        self.engine.shutdown()


def _check(result: Any, what: str) -> None:
    """SGLang's weight calls return ``(success, message)``; anything else, or a failure, raises
    (a discarded ``(False, msg)`` leaves the engine sampling from stale weights)."""
    if not (isinstance(result, tuple) and len(result) >= 2):
        raise RuntimeError(f"sglang {what} returned {result!r}, not (success, message)")
    if not result[0]:
        raise RuntimeError(f"sglang {what} failed: {result[1]}")


def _check_lora(result: Any, what: str) -> None:
    """SGLang's LoRA calls return a ``LoRAUpdateOutput`` (``success``, ``error_message``); a
    failure raises (the engine would sample from the previous adapter, or none)."""
    if not hasattr(result, "success"):
        raise RuntimeError(f"sglang LoRA {what} returned {result!r}, not a LoRAUpdateOutput")
    if not result.success:
        raise RuntimeError(f"sglang LoRA {what} failed: {result.error_message}")


def generation_from_outputs(
    outs: Sequence[Mapping[str, Any]], max_new_tokens: int, pad_id: int
) -> Generation:
    """A :class:`Generation` from ``Engine.generate`` results (``meta_info`` ->
    ``output_token_logprobs``: ``[(logprob, token_id, text), ...]`` per prompt; the text, None
    under ``skip_tokenizer_init``, is not read)."""
    meta, field = OUTPUT_FIELDS
    bsz = len(outs)
    ids = torch.full((bsz, max_new_tokens), pad_id, dtype=torch.long)
    logps = torch.zeros(bsz, max_new_tokens)
    lengths = torch.zeros(bsz, dtype=torch.long)
    for i, out in enumerate(outs):
        toks = out[meta][field][:max_new_tokens]
        for t, (lp, tok, _text) in enumerate(toks):
            ids[i, t] = int(tok)
            logps[i, t] = float(lp)
        lengths[i] = len(toks)
    mask = torch.arange(max_new_tokens)[None, :] < lengths[:, None]
    return Generation(ids, mask, logps, lengths)


def routed_experts_of(
    outs: Sequence[Mapping[str, Any]],
    prompt_mask: torch.Tensor,
    width: int,
    layers: int,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's ``[B, P, layers, k]`` and the response's ``[B, width, layers, k]`` routed
    experts (int16, ``-1`` where none: padding, the last response token) of ``generate``
    results asked with ``return_routed_experts`` (``meta_info.routed_experts``: base64 of
    int32 ``[prompt + response - 1, layers, k]``, as SGLang's
    ``extract_routed_experts_from_meta_info`` reads it)."""
    import base64

    import numpy as np

    from .torch_backend.moe import EXPERT_DTYPE, NO_EXPERT

    meta, field = ROUTED_EXPERTS_FIELDS
    bsz, plen = prompt_mask.shape
    prompt = torch.full((bsz, plen, layers, k), NO_EXPERT, dtype=EXPERT_DTYPE)
    response = torch.full((bsz, width, layers, k), NO_EXPERT, dtype=EXPERT_DTYPE)
    for i, out in enumerate(outs):
        encoded = out[meta].get(field)
        if encoded is None:
            raise RuntimeError(
                "sglang returned no routed experts: is the model a MoE model and the engine "
                "started with enable_return_routed_experts?"
            )
        flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
        rows = torch.from_numpy(flat.copy()).reshape(-1, layers, k).to(EXPERT_DTYPE)
        p = int(prompt_mask[i].sum())
        n_out = len(out[meta][OUTPUT_FIELDS[1]])
        if rows.shape[0] != p + n_out - 1:
            raise RuntimeError(
                f"sglang returned routed experts for {rows.shape[0]} tokens, not the "
                f"{p + n_out - 1} it fed (prompt {p} + response {n_out} - 1)"
            )
        prompt[i, plen - p :] = rows[:p]
        fed = min(n_out - 1, width)
        response[i, :fed] = rows[p : p + fed]
    return prompt, response
