"""Models and tokenizers: built-in tiny HF architectures for CPU runs, and the one loading path.

A built-in model (``builtin:tiny-llama``, ``builtin:tiny-qwen2``, ``builtin:small-llama``, and the
mixture-of-experts ``builtin:tiny-qwen3-moe`` and ``builtin:tiny-mixtral``) is a Hugging Face
architecture with a tiny config, initialised from a seed, plus a character-level
tokenizer built with the ``tokenizers`` library. Both are saved as an ordinary HF model directory
(``config.json``, ``model.safetensors``, ``tokenizer.json``...), so the workers load every model,
built-in or real, with the same ``from_pretrained`` calls.

The 14-token vocabulary is ``<pad> <s> </s> <unk> 0 1 ... 9``. ``tiny-llama`` (hidden 64,
intermediate 256, 2 layers, 4 heads, untied embeddings) has 133,184 parameters; ``small-llama``
(hidden 128, intermediate 512, 5 layers) about ten times as many. The two MoE models (hidden 64,
2 layers, 4 heads) route every token to 2 of 8 experts of intermediate size 64 in each layer
(Qwen3-MoE: its top-2 weights renormalised, ``norm_topk_prob``; Mixtral: always renormalised).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

BUILTIN_PREFIX = "builtin:"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
DIGITS = tuple("0123456789")
VOCAB = SPECIAL_TOKENS + DIGITS


@dataclass(frozen=True)
class BuiltinModel:
    """Shape of a built-in model."""

    arch: str  # "llama", "qwen2", "qwen3_moe" or "mixtral"
    hidden: int
    intermediate: int  # a MoE model's: each expert's
    layers: int
    heads: int
    experts: int = 0  # 0: a dense model
    experts_per_token: int = 0


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "tiny-llama": BuiltinModel("llama", 64, 256, 2, 4),
    "tiny-qwen2": BuiltinModel("qwen2", 64, 256, 2, 4),
    "small-llama": BuiltinModel("llama", 128, 512, 5, 4),
    "tiny-qwen3-moe": BuiltinModel("qwen3_moe", 64, 64, 2, 4, experts=8, experts_per_token=2),
    "tiny-mixtral": BuiltinModel("mixtral", 64, 64, 2, 4, experts=8, experts_per_token=2),
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name (`float32`, `bfloat16`, `float16`)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(
            f"model.dtype: unknown dtype {name!r}; use one of {list(_DTYPES)}"
        ) from None


def cache_root() -> Path:
    """Where built-in models are materialised: ``$PPOJOB_CACHE_DIR`` or ``~/.cache/ppojob``."""
    env = os.environ.get("PPOJOB_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "ppojob"


def build_char_tokenizer() -> Any:
    """The character-level tokenizer of the built-in models, as a ``PreTrainedTokenizerFast``.

    Every character is one token; unknown characters map to ``<unk>``; encoding prepends
    ``<s>``; decoding concatenates characters without spaces.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )


def builtin_config(name: str) -> Any:
    """The transformers config of a built-in model."""
    if name not in BUILTIN_MODELS:
        raise ValueError(
            f"model.path: unknown built-in model {BUILTIN_PREFIX}{name}; "
            f"use one of {[BUILTIN_PREFIX + n for n in BUILTIN_MODELS]}"
        )
    shape = BUILTIN_MODELS[name]
    common: dict[str, Any] = dict(
        vocab_size=len(VOCAB),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        pad_token_id=VOCAB.index("<pad>"),
        bos_token_id=VOCAB.index("<s>"),
        eos_token_id=VOCAB.index("</s>"),
        initializer_range=0.02,
    )
    if shape.arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    if shape.arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common,
            head_dim=shape.hidden // shape.heads,
            num_experts=shape.experts,
            num_experts_per_tok=shape.experts_per_token,
            moe_intermediate_size=shape.intermediate,
            norm_topk_prob=True,
        )
    if shape.arch == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(
            **common,
            num_local_experts=shape.experts,
            num_experts_per_tok=shape.experts_per_token,
        )
    from transformers import Qwen2Config

    return Qwen2Config(**common)


def build_builtin_model(name: str, seed: int) -> Any:
    """A built-in causal LM, randomly initialised from ``seed`` (deterministic)."""
    from transformers import AutoModelForCausalLM

    config = builtin_config(name)
    devices_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.random.set_rng_state(devices_state)
    return model


def materialize_builtin(name: str, seed: int, root: Path | None = None, build: Any = None) -> Path:
    """Save built-in model ``name`` (seeded) and its tokenizer as a HF directory; return it.
    ``build``: a function of the seed making the model (default: :func:`build_builtin_model`
    of ``name``), for built-ins made another way (the distillation teachers).

    Idempotent and safe under concurrent callers (several worker processes start at once): one
    writer at a time holds a lock file, writes under a temporary name and renames the finished
    directory into place; a directory left incomplete by a killed writer is rebuilt.
    """
    import fcntl

    root = cache_root() if root is None else Path(root)
    models = root / "models"
    target = models / f"{name}-seed{seed}"
    models.mkdir(parents=True, exist_ok=True)
    with open(models / f".{name}-seed{seed}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():
            return target
        shutil.rmtree(target, ignore_errors=True)  # incomplete: rebuild it
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=models))
        try:
            quiet_transformers()
            model = build(seed) if build is not None else build_builtin_model(name, seed)
            save_pretrained_here(model, tmp)
            build_char_tokenizer().save_pretrained(tmp)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def save_pretrained_here(model: Any, directory: Path | str, **kwargs: Any) -> None:
    """``model.save_pretrained`` written by this process, whatever its ``torch.distributed``
    rank: transformers >= 5 silently writes nothing (no config, no weights) on ranks other than
    0, and the trainer decides itself which worker writes (a built-in model's first worker, a
    role's data-parallel leader)."""
    model.should_save_on_this_rank = lambda is_main_process: True  # this instance only
    try:
        model.save_pretrained(str(directory), **kwargs)
    finally:
        del model.should_save_on_this_rank


def resolve_model_path(path: str, seed: int, root: Path | None = None) -> Path:
    """A loadable model directory for ``model.path`` (the rule of
    :func:`ppojob_api.trainspec.model.model_path_kind`): built-ins are materialised, an existing
    directory is used as it is, a hub id is fetched through ``huggingface_hub`` into its cache
    (``HF_HOME`` / ``HF_HUB_CACHE``; with ``HF_HUB_OFFLINE=1`` only the cache is read)."""
    from ppojob_api.trainspec.model import model_path_kind

    if path.startswith(BUILTIN_PREFIX):
        return materialize_builtin(path[len(BUILTIN_PREFIX) :], seed, root)
    try:
        kind = model_path_kind(path)
    except ValueError as exc:
        raise ValueError(f"model.path: {exc}") from None
    local = Path(path).expanduser()
    if local.is_dir():
        from ppojob_trainer.preflight import model_dir_problem

        problem = model_dir_problem("model.path", path)
        if problem:
            raise ValueError(problem)
        return local
    if kind == "local":
        raise ValueError(
            f"model.path: directory {path!r} does not exist; give a Hugging Face model directory "
            f"present in the trainer image or a volume, a hub id, or one of "
            f"{[BUILTIN_PREFIX + n for n in BUILTIN_MODELS]}"
        )
    return download_hub_model(path)


def download_hub_model(repo_id: str) -> Path:
    """The local snapshot of hub model ``repo_id`` (downloaded once into the hub cache; every
    worker on a node shares it, huggingface_hub locks concurrent downloads)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id=repo_id))
    except LocalEntryNotFoundError as exc:
        raise ValueError(
            f"model.path: hub model {repo_id!r} is not in the Hugging Face cache and could not "
            f"be downloaded ({exc.__class__.__name__}); allow the trainer to reach the hub, or "
            "pre-populate HF_HOME / HF_HUB_CACHE (a volume), or give a local directory"
        ) from None
    except HfHubHTTPError as exc:
        raise ValueError(
            f"model.path: cannot download hub model {repo_id!r}: {exc}; check the id, and "
            "set HF_TOKEN in the role's env for a gated or private model"
        ) from None


_TRUST_REMOTE_CODE = False


def set_trust_remote_code(allowed: bool) -> None:
    """``model.trustRemoteCode`` for every model and tokenizer this process loads (each worker
    process serves one job, so the setting is process-wide)."""
    global _TRUST_REMOTE_CODE
    _TRUST_REMOTE_CODE = bool(allowed)


def trust_remote_code() -> bool:
    """The process's ``model.trustRemoteCode``."""
    return _TRUST_REMOTE_CODE


# Keyword arguments of every ``from_pretrained`` of a model the trainer computes with.
# ``use_kernels=False``: transformers >= 5.2x kernelizes every model it loads when the `kernels`
# package is installed (transformers 5.25 requires it): layers marked for the Hugging Face Hub's
# kernels are swapped for kernels fetched from the Hub at load time and again on each
# ``train()``/``eval()``. The trainer opts out, because (1) the policy, its reference and the
# rollout engine's copy must compute the same function, or the log-prob ratios and KL measure the
# kernels, not the policy; (2) a training pod must not download and run code from the Hub (most
# GPU clusters reach no Hub); (3) `kernels` refuses a model on the meta device (``ValueError:
# Unsupported device type 'meta'``), which sizing and the off-CPU tests use. Older transformers
# (4.x) read the same keyword and default it to False.
HF_MODEL_OPTIONS: dict[str, Any] = {"use_kernels": False}


def quiet_transformers() -> None:
    """Silence transformers' progress bars and load reports (workers log through Ray)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_tokenizer(model_dir: Path | str) -> Any:
    """The tokenizer saved with a model, left-padding, with a pad token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=_TRUST_REMOTE_CODE)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def tokenizer_difference(actor: Any, critic: Any) -> str | None:
    """What differs between two tokenizers that must map text to the same ids (vocabulary,
    BOS/EOS/pad ids), or None when they agree."""
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        a, c = getattr(actor, name, None), getattr(critic, name, None)
        if a != c:
            return f"{name} is {a!r} for the actor and {c!r} for the critic"
    va, vc = actor.get_vocab(), critic.get_vocab()
    if va != vc:
        only_a = sorted(set(va) - set(vc))[:3]
        only_c = sorted(set(vc) - set(va))[:3]
        moved = sorted(t for t in set(va) & set(vc) if va[t] != vc[t])[:3]
        return (
            f"vocabularies differ ({len(va)} vs {len(vc)} tokens; only the actor's: {only_a}, "
            f"only the critic's: {only_c}, other ids: {moved})"
        )
    return None


def check_critic_tokenizer(actor_dir: Path | str, critic_dir: Path | str) -> None:
    """The critic reads the actor's token ids, so a critic at ``model.criticPath`` must use the
    actor's tokenizer; ``ValueError`` naming the field and the difference otherwise."""
    problem = tokenizer_difference(load_tokenizer(actor_dir), load_tokenizer(critic_dir))
    if problem is not None:
        raise ValueError(
            f"model.criticPath: {str(critic_dir)!r} has a different tokenizer than model.path "
            f"{str(actor_dir)!r}: {problem}. The critic scores the actor's token ids, so use a "
            "critic model trained with the actor's tokenizer, or unset criticPath"
        )


def load_causal_lm(model_dir: Path | str, dtype: str = "float32") -> Any:
    """The policy: ``AutoModelForCausalLM`` from a directory, in ``dtype``."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir),
        dtype=torch_dtype(dtype),
        trust_remote_code=_TRUST_REMOTE_CODE,
        **HF_MODEL_OPTIONS,
    )
    model.config.use_cache = True
    return model


class ValueModel(nn.Module):
    """The critic: a causal-LM backbone (without its LM head) and a scalar value head.

    ``forward(input_ids, attention_mask, position_ids)`` returns one value per position,
    [B, L], in float32.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int, seed: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        with torch.no_grad():
            for k, v in initial_value_head(hidden_size, seed).items():
                getattr(self.value_head, k).copy_(v)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **attention: Any,
    ) -> torch.Tensor:
        """``attention``: keyword arguments for the backbone's attention (a packed row's
        ``cu_seq_lens_q``...)."""
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **attention,
        )
        # a fresh tensor, not a view: an FSDP root's outputs carry its backward hooks
        return self.value_head(out.last_hidden_state).squeeze(-1).float().clone()


VALUE_HEAD_FILE = "value_head.safetensors"


def initial_value_head(hidden_size: int, seed: int) -> dict[str, torch.Tensor]:
    """A new critic's value head (fp32 ``weight`` [1, hidden], ``bias`` [1]) from ``seed``: the
    same on every backend."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn((1, hidden_size), generator=gen) / (hidden_size + 1)
    return {"weight": weight, "bias": torch.zeros(1)}


def value_head_state(
    model_dir: Path | str, hidden_size: int, dtype: str = "float32", seed: int = 0
) -> dict[str, torch.Tensor]:
    """The value head :func:`load_value_model` gives the critic of ``model_dir`` (the saved
    ``value_head.safetensors`` of a critic exported by the trainer, else a new one from
    ``seed``), in ``dtype``, without loading the backbone."""
    head = initial_value_head(hidden_size, seed)
    path = Path(model_dir) / VALUE_HEAD_FILE
    if path.is_file():
        from safetensors.torch import load_file

        saved = load_file(str(path))
        head = {k: saved[k].to(torch.float32).reshape(v.shape) for k, v in head.items()}
    return {k: v.to(torch_dtype(dtype)) for k, v in head.items()}


class CheckpointSlices:
    """The tensors of a Hugging Face model directory's safetensors files, read a slice at a
    time (``safe_open(...).get_slice(name)[...]``): only the entries asked for are copied into
    memory. Each read opens its file and closes it again, so no mapping of the file (whose
    pages a process's resident memory counts once touched) outlives the read."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files  # tensor name -> the file holding it

    @classmethod
    def open(cls, model_dir: Path | str) -> CheckpointSlices | None:
        """The checkpoint of ``model_dir`` (``model.safetensors``, or the files of
        ``model.safetensors.index.json``), or None when it has no safetensors weights."""
        import json

        from safetensors import safe_open

        d = Path(model_dir)
        index = d / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return cls({name: d / f for name, f in weight_map.items()})
        single = d / "model.safetensors"
        if not single.is_file():
            return None
        with safe_open(str(single), framework="pt") as f:
            return cls(dict.fromkeys(f.keys(), single))

    def __contains__(self, name: object) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of tensor ``name`` (read from the file's header)."""
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def read(
        self,
        name: str,
        dim: int = 0,
        start: int | None = None,
        stop: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Tensor ``name``'s entries ``start:stop`` along ``dim`` (all of it by default), as a
        tensor of its own (in ``dtype`` if given)."""
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as f:
            part = f.get_slice(name)
            t = part[(slice(None),) * dim + (slice(start, stop),)]
        return t if dtype is None or t.dtype == dtype else t.to(dtype)


def load_value_model(model_dir: Path | str, dtype: str = "float32", seed: int = 0) -> ValueModel:
    """The critic from a causal-LM directory: its backbone (``AutoModel``) and a value head, new
    (from ``seed``) or, in a critic exported by the trainer, the saved ``value_head.safetensors``.
    """
    from transformers import AutoModel

    quiet_transformers()
    backbone = AutoModel.from_pretrained(
        str(model_dir),
        dtype=torch_dtype(dtype),
        trust_remote_code=_TRUST_REMOTE_CODE,
        **HF_MODEL_OPTIONS,
    )
    model = ValueModel(backbone, backbone.config.hidden_size, seed)
    head = Path(model_dir) / VALUE_HEAD_FILE
    if head.is_file():
        from safetensors.torch import load_file

        model.value_head.load_state_dict(load_file(str(head)))
    return model.to(torch_dtype(dtype))


def count_parameters(model: nn.Module) -> int:
    """Number of parameters of a module."""
    return sum(p.numel() for p in model.parameters())
