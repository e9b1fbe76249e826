"""The sglang adapter against the source of the SGLang release pinned in the `gpu` extra.

SGLang cannot be installed on a CPU machine (it pins a CUDA build of torch), but its wheel can be
downloaded without dependencies and read. These tests never import sglang: they parse its source
with `ast` and check that what the adapter (`backends/sglang_backend.py`) calls, sets and reads
exists there. What the adapter uses is read from the adapter itself (its source, and the tables
and functions it calls at run time), so a new call in the adapter is checked without editing
this file, and a renamed keyword in a new SGLang release fails here instead of on a cluster.

The wheel is never downloaded here (no network at test time): `make install` puts it in the
virtualenv's `test-cache/sglang/` (`pip download --no-deps`); `$PPOJOB_SGLANG_CACHE` names another
folder holding it. Without it the tests skip, saying how to fill the cache; under CI (`CI=true`)
they fail instead.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import sys
import zipfile
from dataclasses import fields
from pathlib import Path

import pytest

from ppojob_api.checks.efficiency import SGLANG_LORA_MODULES
from ppojob_api.training import LoraSpec, TrainerConfig
from ppojob_trainer.backends import sglang_backend as adapter
from ppojob_trainer.backends.weight_sync import TensorMeta

ROOT = Path(__file__).resolve().parents[3]


def pinned_version() -> str:
    """The `sglang==X` pin of the `gpu` extra in pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text()
    gpu = re.search(r"^gpu = \[(.*?)^\]", text, flags=re.S | re.M)
    assert gpu, "pyproject.toml has no gpu extra"
    pin = re.search(r'"sglang==([^"]+)"', gpu.group(1))
    assert pin, "the gpu extra must pin sglang exactly (sglang==X.Y.Z)"
    return pin.group(1)


class Source:
    """Files of the downloaded wheel, parsed on demand."""

    def __init__(self, wheel: Path) -> None:
        self.zip = zipfile.ZipFile(wheel)
        self.names = set(self.zip.namelist())
        self._trees: dict[str, ast.Module] = {}

    def tree(self, path: str) -> ast.Module:
        if path not in self._trees:
            self._trees[path] = ast.parse(self.zip.read(path).decode())
        return self._trees[path]

    def module_file(self, module: str) -> str:
        base = module.replace(".", "/")
        for path in (f"{base}.py", f"{base}/__init__.py"):
            if path in self.names:
                return path
        raise AssertionError(f"module {module} is not in the sglang wheel")

    def classes(self, path: str) -> dict[str, ast.ClassDef]:
        return {n.name: n for n in self.tree(path).body if isinstance(n, ast.ClassDef)}


def wheel_cache() -> Path:
    """The folder holding the sglang wheel: `$PPOJOB_SGLANG_CACHE`, else the one `make install`
    fills, `<virtualenv>/test-cache/sglang`."""
    env = os.environ.get("PPOJOB_SGLANG_CACHE")
    return Path(env) if env else Path(sys.prefix) / "test-cache" / "sglang"


@pytest.fixture(scope="module")
def sglang() -> Source:
    version = pinned_version()
    folder = wheel_cache()
    wheels = sorted(folder.glob(f"sglang-{version}-*.whl"))
    if not wheels:
        message = (
            f"no sglang {version} wheel in {folder}: fill the cache with `make install` or "
            f"`{sys.executable} -m pip download --no-deps --only-binary=:all: "
            f"--python-version 3.11 --platform manylinux_2_34_x86_64 -d {folder} "
            f"sglang=={version}`"
        )
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"{message} (under CI a missing cache is an error)")
        pytest.skip(message)
    return Source(wheels[-1])


# ---------------------------------------------------------------------------------------------
# What the adapter uses, read from the adapter
# ---------------------------------------------------------------------------------------------
def adapter_engine_calls() -> dict[str, list[tuple[set[str], int]]]:
    """Every `self.engine.<method>(...)` call in the adapter: method -> [(keywords, #args)]."""
    tree = ast.parse(inspect.getsource(adapter))
    calls: dict[str, list[tuple[set[str], int]]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        if (
            isinstance(owner, ast.Attribute)
            and owner.attr == "engine"
            and isinstance(owner.value, ast.Name)
            and owner.value.id == "self"
        ):
            kws = {k.arg for k in node.keywords}
            assert None not in kws, f"self.engine.{node.func.attr}(**...) cannot be checked"
            calls.setdefault(node.func.attr, []).append((kws, len(node.args)))
    return calls


def tiny_cfg(**rollout) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "model": {
                "path": "Qwen/Qwen2.5-0.5B-Instruct",
                "dtype": "bfloat16",
                "trustRemoteCode": True,
            },
            "roles": {
                "actor": {"resources": {"gpus": 2}},
                "rollout": {
                    "backend": "sglang",
                    "colocateWithActor": True,
                    "parallelism": {"tensor": 2},
                    **rollout,
                },
            },
            "algorithm": {"advantageEstimator": "grpo"},
            "data": {"samplesPerPrompt": 2},
        }
    )


# ---------------------------------------------------------------------------------------------
# Helpers reading sglang's source
# ---------------------------------------------------------------------------------------------
def _params(fn: ast.FunctionDef) -> tuple[set[str], bool, int]:
    """(keyword-passable names, has **kwargs, positional slots after self)."""
    a = fn.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs} - {"self"}
    positional = len([x for x in a.posonlyargs + a.args if x.arg != "self"])
    return names, a.kwarg is not None, positional


def engine_methods(src: Source) -> dict[str, ast.FunctionDef]:
    """Methods of `sglang.Engine`, its own and those of its bases defined in sglang."""
    path = src.module_file("sglang.srt.entrypoints.engine")
    todo = [(path, "Engine")]
    out: dict[str, ast.FunctionDef] = {}
    seen = set()
    while todo:
        file, name = todo.pop(0)
        if (file, name) in seen:
            continue
        seen.add((file, name))
        cls = src.classes(file).get(name)
        if cls is None:  # a base imported into `file` from elsewhere in sglang
            origin = next(
                (
                    n.module
                    for n in src.tree(file).body
                    if isinstance(n, ast.ImportFrom)
                    and n.module
                    and n.module.startswith("sglang")
                    and name in {a.name for a in n.names}
                ),
                None,
            )
            if origin is None:
                continue
            file = src.module_file(origin)
            cls = src.classes(file).get(name)
            if cls is None:
                continue
        for node in cls.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                out.setdefault(node.name, node)
        todo += [(file, b.id) for b in cls.bases if isinstance(b, ast.Name)]
    return out


def annotated_fields(cls: ast.ClassDef) -> set[str]:
    return {
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


def server_args_fields(src: Source) -> set[str]:
    """`ServerArgs` fields: its own annotations plus, in releases that declare them by
    namespace (`arg_groups/fields/*.py`, classes with `_NS_PATH`), those namespaces' fields."""
    path = src.module_file("sglang.srt.server_args")
    found = annotated_fields(src.classes(path)["ServerArgs"])
    for name in sorted(src.names):
        if name.startswith("sglang/srt/arg_groups/fields/") and name.endswith(".py"):
            for cls in src.classes(name).values():
                assigns = {
                    t.id
                    for n in cls.body
                    if isinstance(n, ast.Assign)
                    for t in n.targets
                    if isinstance(t, ast.Name)
                }
                if "_NS_PATH" in assigns | annotated_fields(cls):
                    found |= annotated_fields(cls)
    return found


def function(src: Source, path: str, name: str) -> ast.FunctionDef:
    for node in ast.walk(src.tree(path)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return node
    raise AssertionError(f"{name} not found in {path}")


def strings_in(node: ast.AST) -> set[str]:
    return {
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


# ---------------------------------------------------------------------------------------------
# The contract
# ---------------------------------------------------------------------------------------------
def test_the_adapter_is_checked_against_the_pinned_release(sglang):
    assert pinned_version() == adapter.SGLANG_VERSION
    assert f"sglang-{pinned_version()}.dist-info/METADATA" in sglang.names


def test_every_engine_call_exists_with_every_keyword_the_adapter_passes(sglang):
    calls = adapter_engine_calls()
    # the declared table and the code agree, so neither can drift from the other
    assert set(calls) == set(adapter.ENGINE_CALLS)
    methods = engine_methods(sglang)
    for method, uses in sorted(calls.items()):
        assert method in methods, f"sglang.Engine has no method {method}"
        names, kwargs, positional = _params(methods[method])
        for kws, n_pos in uses:
            assert n_pos <= positional, f"Engine.{method} takes {positional} positional args"
            missing = kws - names
            assert kwargs or not missing, f"Engine.{method} has no keyword(s) {sorted(missing)}"


def test_engine_is_exported_and_every_server_arg_the_adapter_sets_exists(sglang):
    init = sglang.tree(sglang.module_file("sglang"))
    assert "Engine" in {
        t.id
        for n in ast.walk(init)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    } | {
        a.asname or a.name for n in ast.walk(init) if isinstance(n, ast.ImportFrom) for a in n.names
    }
    known = server_args_fields(sglang)
    assert {"model_path", "tp_size"} <= known, "ServerArgs fields not found: parser broken"
    lora = tiny_cfg()
    lora.model.lora = LoraSpec(rank=8)
    for cfg in (tiny_cfg(), tiny_cfg(colocateWithActor=False, resources={"gpus": 2}), lora):
        args = adapter.engine_args(cfg, Path("/models/m"), (30001, 30002))
        assert {"port", "nccl_port"} <= set(args)
        assert set(args) <= known, f"unknown ServerArgs fields {sorted(set(args) - known)}"
    assert args["tp_size"] == 2 and args["trust_remote_code"] is True
    assert args["enable_lora"] is True and args["max_lora_rank"] == 8


def test_the_lora_target_modules_we_allow_are_sglangs(sglang):
    """``check_lora``'s list for sglang engines and the ``all`` we send for ``all-linear`` are
    among SGLang's ``SUPPORTED_LORA_TARGET_MODULES`` / ``LORA_TARGET_ALL_MODULES`` (the choices
    of ``--lora-target-modules``)."""
    tree = sglang.tree(sglang.module_file("sglang.srt.utils.common"))
    values = {
        t.id: n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    supported = strings_in(values["SUPPORTED_LORA_TARGET_MODULES"])
    assert {"q_proj", "lm_head"} <= supported, "SUPPORTED_LORA_TARGET_MODULES: parser broken"
    assert set(SGLANG_LORA_MODULES) <= supported, set(SGLANG_LORA_MODULES) - supported
    assert values["LORA_TARGET_ALL_MODULES"].value == adapter.LORA_TARGET_ALL
    args = adapter.lora_server_args(LoraSpec(target_modules=["all-linear"]))
    assert args["lora_target_modules"] == [adapter.LORA_TARGET_ALL]


def test_every_sampling_param_the_adapter_sends_exists(sglang):
    path = sglang.module_file("sglang.srt.sampling.sampling_params")
    cls = sglang.classes(path)["SamplingParams"]
    known = annotated_fields(cls)
    init = next(
        (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None
    )
    if init is not None:
        known |= _params(init)[0]
    sent = adapter.sampling_params(8, 1.0, 0.9, [2], 7)
    assert set(sent) <= known, f"unknown sampling params {sorted(set(sent) - known)}"


def subscript_writes(sglang, path) -> set[tuple[str, object]]:  # type: ignore[no-untyped-def]
    """Every ``name[constant] = ...`` assignment in the module at ``path``."""
    return {
        (t.value.id, t.slice.value)
        for n in ast.walk(sglang.tree(path))
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Subscript)
        and isinstance(t.value, ast.Name)
        and isinstance(t.slice, ast.Constant)
    }


def test_the_output_fields_the_adapter_reads_are_produced(sglang):
    meta, field = adapter.OUTPUT_FIELDS
    path = sglang.module_file("sglang.srt.managers.tokenizer_manager")
    written = subscript_writes(sglang, path)
    assert (meta, field) in written, f"{meta}[{field!r}] is never written"
    # each entry is (logprob, token_id, text): the tuples detokenize_logprob_tokens builds
    fn = function(sglang, path, "detokenize_logprob_tokens")
    widths = {len(n.elts) for n in ast.walk(fn) if isinstance(n, ast.Tuple)}
    zips = {
        len(n.args)
        for n in ast.walk(fn)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "zip"
    }
    assert 3 in widths and 3 in zips


def test_the_routed_experts_the_adapter_asks_for_are_sglangs(sglang):
    """Routing replay: the server arg that starts SGLang's capturer, the request keyword (also
    in the keyword test above), the meta_info field the tokenizer manager writes, and its
    int32 rows, as SGLang's own reader decodes them."""
    cfg = tiny_cfg()
    cfg.algorithm.routing_replay = "rollout"
    args = adapter.engine_args(cfg, Path("/models/m"), (30001, 30002))
    assert args["enable_return_routed_experts"] is True
    assert set(args) <= server_args_fields(sglang)
    engine = sglang.classes(sglang.module_file("sglang.srt.entrypoints.engine"))["Engine"]
    generate = next(
        n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "generate"
    )
    assert "return_routed_experts" in _params(generate)[0]
    meta, field = adapter.ROUTED_EXPERTS_FIELDS
    path = sglang.module_file("sglang.srt.managers.tokenizer_manager")
    written = subscript_writes(sglang, path)
    assert (meta, field) in written, f"{meta}[{field!r}] is never written"
    reader = function(
        sglang,
        sglang.module_file("sglang.srt.state_capturer.routed_experts"),
        "extract_routed_experts_from_meta_info",
    )
    dtypes = {n.attr for n in ast.walk(reader) if isinstance(n, ast.Attribute)}
    assert "int32" in dtypes and "b64decode" in dtypes


def test_the_engine_skips_its_tokenizer_as_nothing_we_ask_needs_it(sglang):
    """``skip_tokenizer_init`` (issue 40, finding 8: the engine detokenized what the trainer
    decodes again): on for every engine; prompts go in as token ids (SGLang refuses a text
    prompt without its tokenizer); the log-prob tuples then come back without text, and the
    adapter does not read it. (The sampling parameters pass SGLang's own check without a
    tokenizer: ``test_sglang_runtime.py``.)"""
    lora = tiny_cfg()
    lora.model.lora = LoraSpec(rank=8)
    for cfg in (tiny_cfg(), tiny_cfg(colocateWithActor=False, resources={"gpus": 2}), lora):
        args = adapter.engine_args(cfg, Path("/models/m"), (30001, 30002))
        assert args["skip_tokenizer_init"] is True
    assert "skip_tokenizer_init" in server_args_fields(sglang)
    generate = adapter_engine_calls()["generate"]
    assert generate and all(
        "input_ids" in kws and not kws & {"text", "prompt"} for kws, _ in generate
    )
    path = sglang.module_file("sglang.srt.managers.tokenizer_manager")
    flags = [
        ast.unparse(arg)
        for n in ast.walk(sglang.tree(path))
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "convert_logprob_style"
        for arg in n.args
    ]
    assert any(f.endswith("and (not self.skip_tokenizer_init)") for f in flags), flags
    meta, field = adapter.OUTPUT_FIELDS
    outs = [{meta: {field: [(-0.5, 7, None), (-1.5, 2, None)]}}]
    gen = adapter.generation_from_outputs(outs, 3, pad_id=0)
    assert gen.response_ids.tolist() == [[7, 2, 0]] and gen.lengths.tolist() == [2]
    assert gen.logprobs.tolist() == [[-0.5, -1.5, 0.0]]


def test_every_runtime_import_exists(sglang):
    for module, name in adapter.RUNTIME_IMPORTS.values():
        tree = sglang.tree(sglang.module_file(module))
        defined = set()
        for n in tree.body:
            if isinstance(n, ast.ClassDef | ast.FunctionDef):
                defined.add(n.name)
            elif isinstance(n, ast.Assign):
                defined |= {t.id for t in n.targets if isinstance(t, ast.Name)}
            elif isinstance(n, ast.ImportFrom):
                defined |= {a.asname or a.name for a in n.names}
        assert name in defined, f"{module} defines no {name}"


def test_the_memory_tags_of_a_wake_are_sglangs(sglang):
    """The tags a colocated engine wakes with (``backends/base.py``) are SGLang's
    ``GPU_MEMORY_TYPE_*`` constants, and together they are all of them."""
    from ppojob_trainer.backends import base

    tree = sglang.tree(sglang.module_file("sglang.srt.constants"))
    consts = {
        t.id: n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
        for t in n.targets
        if isinstance(t, ast.Name) and t.id.startswith("GPU_MEMORY_TYPE_")
    }
    assert consts["GPU_MEMORY_TYPE_WEIGHTS"] == base.MEMORY_WEIGHTS
    assert consts["GPU_MEMORY_TYPE_KV_CACHE"] == base.MEMORY_KV_CACHE
    assert consts["GPU_MEMORY_TYPE_CUDA_GRAPH"] == base.MEMORY_CUDA_GRAPH
    assert sorted(base.WAKE_FOR_SYNC + base.WAKE_AFTER_SYNC) == sorted(consts.values())


def test_colocated_bucket_payloads_are_what_sglangs_weight_updater_reads(sglang):
    updater = sglang.module_file("sglang.srt.model_executor.model_runner_components.weight_updater")
    # update_weights_from_tensor dispatches on load_format == "flattened_bucket" ...
    assert adapter.FLATTENED_BUCKET in strings_in(
        function(sglang, updater, "update_weights_from_tensor")
    )
    # ... and reads the bucket's two keys
    reader = function(sglang, updater, "_update_weights_from_flattened_bucket")
    assert set(adapter.BUCKET_KEYS) <= strings_in(reader)
    # the metadata class: the fields the adapter fills, which mirror TensorMeta's
    module, name = adapter.RUNTIME_IMPORTS["FlattenedTensorMetadata"]
    meta = sglang.classes(sglang.module_file(module))[name]
    assert annotated_fields(meta) == {f.name for f in fields(TensorMeta)}
    call = next(
        n
        for n in ast.walk(ast.parse(inspect.getsource(adapter.serialize_bucket)))
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "meta_cls"
    )
    assert {k.arg for k in call.keywords} == annotated_fields(meta)
    # SGLang unpickles payloads with an allow-list: the metadata class must be on it
    common = sglang.module_file("sglang.srt.utils.common")
    unpickler = sglang.classes(common)["SafeUnpickler"]
    allowed = {
        (e.elts[0].value, e.elts[1].value)
        for n in ast.walk(unpickler)
        if isinstance(n, ast.Set)
        for e in n.elts
        if isinstance(e, ast.Tuple) and len(e.elts) == 2
    }
    assert (module, name) in allowed


def test_the_weight_update_group_is_formed_and_fed_as_the_adapter_expects(sglang):
    """The actor's side (`weight_sync.init_custom_group`, one broadcast from rank 0 per tensor
    in order) must meet SGLang's side: a TCP rendezvous whose store is prefixed with the group
    name, and per tensor a broadcast from src 0."""
    common = sglang.module_file("sglang.srt.utils.common")
    group = function(sglang, common, "init_custom_process_group")
    prefix = [
        n
        for n in ast.walk(group)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "PrefixStore"
    ]
    assert prefix and [getattr(a, "id", None) for a in prefix[0].args] == ["group_name", "store"]
    updater = sglang.module_file("sglang.srt.model_executor.model_runner_components.weight_updater")
    receives = [
        n
        for n in ast.walk(sglang.tree(updater))
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "broadcast"
    ]
    srcs = {k.value.value for n in receives for k in n.keywords if k.arg == "src"}
    assert srcs == {0}
    init = function(sglang, updater, "init_weights_update_group")
    assert "rank_offset" in {a.arg for a in init.args.args}


# ---------------------------------------------------------------------------------------------
# Issue 40, finding 7: the NCCL environment SGLang's Engine sets in its own process
# ---------------------------------------------------------------------------------------------
class _Cfg:
    """Server arguments as ``_set_envs_and_config`` reads them: ``fields``; a name that is not
    among them raises (a new one in a new release is looked at, not guessed)."""

    def __init__(self, values: dict[str, object]) -> None:
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> object:
        raise AttributeError(f"ServerArgs.{name} has no default this test could read")


class _EnvFlag:
    def get(self) -> None:
        return None


def server_arg_defaults(src: Source) -> dict[str, object]:
    """The literal defaults of ``ServerArgs``'s fields (``sglang/srt/arg_groups/fields/*.py``)."""
    out: dict[str, object] = {}
    for path in sorted(n for n in src.names if n.startswith("sglang/srt/arg_groups/fields/")):
        if not path.endswith(".py"):
            continue
        for cls in src.classes(path).values():
            for node in cls.body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    try:
                        out[node.target.id] = ast.literal_eval(node.value) if node.value else None
                    except ValueError:
                        continue
    return out


def set_envs_and_config(src: Source) -> ast.FunctionDef:
    tree = src.tree(src.module_file("sglang.srt.entrypoints.engine"))
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    return next(n for n in fns if n.name == "_set_envs_and_config")


def environ_keys(fn: ast.FunctionDef) -> set[str]:
    """Every key ``fn`` writes into ``os.environ`` (``os.environ[K] = ...``, ``setdefault``)."""
    keys = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
            target = node.targets[0]
            if ast.unparse(target.value) == "os.environ" and isinstance(target.slice, ast.Constant):
                keys.add(target.slice.value)
        call = isinstance(node, ast.Call) and ast.unparse(node.func) == "os.environ.setdefault"
        if call and isinstance(node.args[0], ast.Constant):
            keys.add(node.args[0].value)
    return keys


def run_set_envs(src: Source, server_args: dict[str, object], environ: dict[str, str]) -> None:
    """SGLang's own ``_set_envs_and_config``, from the wheel, on ``server_args`` (defaults
    otherwise) with ``environ`` as the process environment; what it does beyond the
    environment (ulimit, signal handlers, version checks, the mp start method) is stubbed."""
    import logging
    import random
    import time
    import types

    fn = set_envs_and_config(src)
    module = ast.Module(body=[fn], type_ignores=[])
    stub = types.SimpleNamespace
    scope: dict[str, object] = {
        "os": stub(environ=environ, getpid=os.getpid),
        "ServerArgs": object,
        "resolving_view": lambda args: args,
        "resolved_view": lambda args: args,
        "is_mnnvl_fabric_device": lambda: False,
        "envs": stub(
            SGLANG_ENABLE_KV_SHARD_ZERO_SM_GATHER=_EnvFlag(),
            SGLANG_MOONCAKE_CUSTOM_MEM_POOL=_EnvFlag(),
        ),
        "logger": logging.getLogger("sglang-stub"),
        "time": time,
        "random": random,
        "set_prometheus_multiproc_dir": lambda: None,
        "set_ulimit": lambda: None,
        "get_bool_env_var": lambda *a, **k: True,  # skip the kernel version checks
        "attention_backends_of": lambda cfg: [],
        "assert_pkg_version": lambda *a, **k: None,
        "_is_cuda": False,
        "threading": stub(current_thread=lambda: "worker", main_thread=lambda: "main"),
        "signal": stub(signal=lambda *a: None, SIGQUIT=3),
        "kill_process_tree": lambda pid: None,
        "mp": stub(set_start_method=lambda *a, **k: None),
        "gc": stub(set_threshold=lambda *a: None),
    }
    exec(compile(module, "sglang/srt/entrypoints/engine.py", "exec"), scope)
    values = {**server_arg_defaults(src), **server_args}
    scope["_set_envs_and_config"](_Cfg(values))


@pytest.mark.parametrize(
    "rollout",
    [
        {"colocateWithActor": True, "offload": True},  # the memory saver on
        {"colocateWithActor": True, "offload": False},
        {"colocateWithActor": False},
    ],
)
def test_every_nccl_variable_sglangs_engine_sets_is_in_every_workers_env(
    sglang: Source, rollout: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Engine.__init__`` calls ``_set_envs_and_config``, which sets NCCL variables in the
    engine-hosting process (0.5.23: ``NCCL_CUMEM_ENABLE=0``, ``NCCL_NVLS_ENABLE=0``); the
    actor's ranks that host no engine would build their communicators with NCCL's defaults.
    Every worker's environment (``worker_env``, set before any process group exists) must
    already hold each of them with SGLang's value, and SGLang must then change none."""
    from ppojob_trainer.driver.cluster import worker_env

    for key in list(os.environ):
        if key.startswith("NCCL_"):
            monkeypatch.delenv(key)
    fn = set_envs_and_config(sglang)
    nccl = {k for k in environ_keys(fn) if k.startswith("NCCL_")}
    assert {"NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE"} <= nccl  # the read found them
    args = adapter.engine_args(tiny_cfg(**rollout), Path("/models/m"))

    fresh: dict[str, str] = {}
    run_set_envs(sglang, args, fresh)
    set_by_sglang = {k: v for k, v in fresh.items() if k.startswith("NCCL_")}
    ours = worker_env()
    assert set_by_sglang, "SGLang set no NCCL variable: the stubs no longer match its code"
    assert {k: ours.get(k) for k in set_by_sglang} == set_by_sglang

    environ = dict(ours)
    run_set_envs(sglang, args, environ)
    assert {k: v for k, v in environ.items() if k.startswith("NCCL_")} == {
        k: v for k, v in ours.items() if k.startswith("NCCL_")
    }


# ---------------------------------------------------------------------------------------------
# A MoE model's weight names as SGLang's load_weights takes them
# ---------------------------------------------------------------------------------------------
def _expert_mapping(sglang: Source, model: str) -> tuple[str, tuple[str, str, str]]:
    """(the MoE block's module name, the checkpoint names of an expert's gate, up and down
    projections) that SGLang's ``<model>.py`` builds and passes to
    ``FusedMoE.make_expert_params_mapping`` in its ``load_weights``."""
    text = sglang.zip.read(sglang.module_file(f"sglang.srt.models.{model}")).decode()
    call = re.search(r"make_expert_params_mapping\((.*?)\)", text, flags=re.S)
    assert call, f"{model}.py no longer calls make_expert_params_mapping"
    kw = dict(re.findall(r'ckpt_(\w+?)_proj_name="(\w+)"', call.group(1)))
    path = sglang.module_file(f"sglang.srt.models.{model}")
    blocks = {  # the classes whose __init__ holds the experts (``self.experts = ...``)
        name
        for name, cls in sglang.classes(path).items()
        if any(
            isinstance(t, ast.Attribute) and t.attr == "experts"
            for node in ast.walk(cls)
            if isinstance(node, ast.Assign)
            for t in node.targets
        )
    }
    found = set()
    for node in ast.walk(sglang.tree(path)):  # self.<attr> = <block>(..., prefix=add_prefix(..))
        if not (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id in blocks
        ):
            continue
        prefix = next(k.value for k in node.value.keywords if k.arg == "prefix")
        assert isinstance(prefix, ast.Call) and isinstance(prefix.args[0], ast.Constant)
        found.add((node.targets[0].attr, prefix.args[0].value))  # type: ignore[union-attr]
    assert len(found) == 1, f"{model}.py: MoE blocks {found}"
    ((attr, name),) = found
    assert attr == name
    return name, (kw["gate"], kw["up"], kw["down"])


@pytest.mark.parametrize("model", sorted(adapter.SGLANG_EXPERT_NAMES))
def test_moe_weight_names_are_the_ones_sglangs_load_weights_maps(
    sglang: Source, model: str
) -> None:
    """The adapter's table against SGLang's source, and the names it makes against
    ``FusedMoE.make_expert_params_mapping``'s ``experts.{expert_id}.{weight_name}.``."""
    assert adapter.SGLANG_EXPERT_NAMES[model] == _expert_mapping(sglang, model)
    layer = sglang.zip.read(
        sglang.module_file("sglang.srt.layers.moe.fused_moe_triton.layer")
    ).decode()
    assert 'f"experts.{expert_id}.{weight_name}."' in layer
    import torch

    fused = {
        "model.layers.1.mlp.experts.gate_up_proj": torch.arange(3 * 8 * 2.0).view(3, 8, 2),
        "model.layers.1.mlp.experts.down_proj": torch.arange(3 * 2 * 4.0).view(3, 2, 4),
        "model.layers.1.mlp.gate.weight": torch.ones(3, 2),
        "model.layers.1.self_attn.q_proj.weight": torch.zeros(2, 2),
    }
    out = adapter.sglang_weight_names(model, fused)
    block, (gate, up, down) = adapter.SGLANG_EXPERT_NAMES[model]
    head = f"model.layers.1.{block}."
    assert len(out) == 3 * 3 + 2
    assert torch.equal(out[f"{head}experts.2.{gate}.weight"], fused[next(iter(fused))][2, :4])
    assert torch.equal(out[f"{head}experts.2.{up}.weight"], fused[next(iter(fused))][2, 4:])
    assert torch.equal(out[f"{head}experts.0.{down}.weight"], fused[list(fused)[1]][0])
    assert f"{head}gate.weight" in out and "model.layers.1.self_attn.q_proj.weight" in out
    assert adapter.sglang_weight_names("llama", fused) == fused  # dense types: unchanged
