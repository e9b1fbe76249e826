"""SGLang rollout without a GPU: engine sizing (placement, render, validation), weight buckets,
the adapter's pure parts, hub model ids and chat templates."""

from __future__ import annotations

import io
import json
import shutil
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
import yaml

from ppojob_api.checks import check_training_half
from ppojob_api.training import TrainerConfig
from ppojob_api.trainspec.model import model_path_kind
from ppojob_cli.main import main as ppojob
from ppojob_trainer.backends.sglang_backend import engine_args, generation_from_outputs
from ppojob_trainer.backends.weight_sync import flatten, plan_buckets, plan_weight_buckets
from ppojob_trainer.driver.topology import engine_count
from ppojob_trainer.placement import plan_placement

ROOT = Path(__file__).resolve().parents[3]
BIG = ROOT / "examples" / "ppojob-7b-megatron-volcano.yaml"


# ---------------------------------------------------------------------------------------------
# Engine sizing
# ---------------------------------------------------------------------------------------------
def _render(path: Path) -> list[dict]:
    out = io.StringIO()
    with redirect_stdout(out):
        assert ppojob(["render", str(path)]) == 0
    return [d for d in yaml.safe_load_all(out.getvalue()) if d]


def _pods(rayjob: dict) -> list[dict[str, float]]:
    """One Ray node per worker pod of the rendered RayJob: its GPUs, CPUs and role resources."""
    nodes = []
    for group in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        # JSON quoted for the shell of `ray start --resources=...`, as KubeRay reads it back
        custom = json.loads(group["rayStartParams"]["resources"].strip("'\""))
        node = {"CPU": float(limits["cpu"]), "GPU": float(limits.get("nvidia.com/gpu", 0))}
        nodes += [{**node, **custom} for _ in range(group["replicas"])]
    return nodes


def _first_fit(bundles: list[dict[str, float]], nodes: list[dict[str, float]]) -> list[int]:
    free = [dict(n) for n in nodes]
    where = []
    for b in bundles:
        i = next(i for i, n in enumerate(free) if all(n.get(k, 0) >= v for k, v in b.items()))
        for k, v in b.items():
            free[i][k] -= v
        where.append(i)
    return where


def test_7b_example_renders_and_plans_one_engine_per_tp_group():
    docs = _render(BIG)
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    (rayjob,) = [d for d in docs if d["kind"] == "RayJob"]
    cfg = TrainerConfig.model_validate(yaml.safe_load(next(iter(cm["data"].values()))))
    plan = plan_placement(cfg, pin_roles=True)
    rollout = plan.roles["rollout"]
    # 1 pod x 8 GPUs at tensor parallel 2: 4 engines, one bundle of 2 GPUs each
    assert engine_count(cfg) == 4 and rollout.count == 4
    engines = plan.bundles[rollout.offset : rollout.offset + rollout.count]
    assert engines == [{"GPU": 2.0, "CPU": 8.0, "ppojob-rollout": 2.0}] * 4
    assert len(plan.bundles) == 16 + 8 + 4  # actor and critic: one bundle per GPU
    # the plan fits the pods `ppojob render` makes, every bundle on a pod of its own role
    nodes = _pods(rayjob)
    where = _first_fit(plan.bundles, nodes)
    roles = [next(k for k in nodes[i] if k.startswith("ppojob-")) for i in where]
    assert roles == ["ppojob-actor"] * 16 + ["ppojob-critic"] * 8 + ["ppojob-rollout"] * 4
    # and uses them completely: nothing left over, nothing missing
    assert plan.total()["GPU"] == sum(n["GPU"] for n in nodes)


def test_colocated_engines_span_tensor_gpus_of_the_actors_bundles():
    cfg = TrainerConfig.model_validate(
        {
            "roles": {
                "actor": {"replicas": 2, "resources": {"gpus": 4, "cpus": 8}},
                "rollout": {
                    "backend": "sglang",
                    "colocateWithActor": True,
                    "parallelism": {"tensor": 2},
                },
            },
            "algorithm": {"advantageEstimator": "grpo"},
            "data": {"samplesPerPrompt": 2},
        }
    )
    plan = plan_placement(cfg)
    assert plan.bundles == [{"GPU": 2.0, "CPU": 4.0}] * 4
    actor, rollout = plan.roles["actor"], plan.roles["rollout"]
    assert (actor.count, actor.per_bundle) == (8, 2)  # 8 actor workers, 2 per engine bundle
    assert (rollout.count, rollout.per_bundle, rollout.owner) == (4, 1, "actor")
    assert engine_count(cfg) == 4


@pytest.mark.parametrize(
    ("rollout", "ok"),
    [
        ({"replicas": 1, "resources": {"gpus": 8}, "parallelism": {"tensor": 4}}, True),
        ({"replicas": 2, "resources": {"gpus": 3}, "parallelism": {"tensor": 2}}, False),
        ({"replicas": 1, "resources": {"gpus": 2}, "parallelism": {"tensor": 4}}, False),
        ({"colocateWithActor": True, "parallelism": {"tensor": 4}}, False),  # actor pods: 6 GPUs
        ({"colocateWithActor": True, "parallelism": {"tensor": 3}}, True),
    ],
)
def test_a_tensor_size_that_does_not_tile_a_pods_gpus_is_rejected(rollout, ok):
    half = TrainerConfig.model_validate(
        {
            "roles": {
                "actor": {"replicas": 1, "resources": {"gpus": 6}},
                "rollout": {"backend": "sglang", **rollout},
            },
            "algorithm": {"advantageEstimator": "grpo"},
            "data": {"samplesPerPrompt": 2},
        }
    )
    problems = [p for p in check_training_half(half) if p.path.endswith("parallelism.tensor")]
    assert not problems if ok else "does not fit" in problems[0].message


# ---------------------------------------------------------------------------------------------
# Weight buckets
# ---------------------------------------------------------------------------------------------
def test_buckets_are_bounded_ordered_and_complete():
    sizes = [("a", 40), ("b", 40), ("c", 30), ("d", 100), ("e", 10), ("f", 10)]
    assert plan_buckets(sizes, 80) == [["a", "b"], ["c"], ["d"], ["e", "f"]]
    weights = {f"w{i}": torch.zeros(i + 1, 3) for i in range(10)}
    plan = plan_weight_buckets(weights, 64)
    assert [n for b in plan for n in b] == list(weights)
    for b in plan:
        total = sum(weights[n].numel() * 4 for n in b)
        assert total <= 64 or len(b) == 1


def test_a_flat_bucket_rebuilds_its_tensors_bit_identical():
    named = [
        ("x", torch.randn(3, 5)),
        ("y", torch.randn(7).to(torch.bfloat16)),
        ("z", torch.arange(6, dtype=torch.int64).view(2, 3)),
        ("t", torch.randn(4, 6).t()),  # not contiguous
    ]
    bucket = flatten(named, "cpu")
    assert bucket.flattened_tensor.dtype == torch.uint8
    assert all(m.start_idx % 16 == 0 for m in bucket.metadata)
    assert [m.numel for m in bucket.metadata] == [t.numel() * t.element_size() for _, t in named]
    rebuilt = bucket.tensors()
    assert [n for n, _ in rebuilt] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, rebuilt, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# The adapter's pure parts
# ---------------------------------------------------------------------------------------------
def test_generate_outputs_become_a_generation():
    outs = [
        {"meta_info": {"output_token_logprobs": [(-0.5, 7, "a"), (-1.0, 2, None)]}},
        {"meta_info": {"output_token_logprobs": [(-0.1, 5, "b"), (-0.2, 6, "c"), (-0.3, 9, "d")]}},
    ]
    gen = generation_from_outputs(outs, max_new_tokens=2, pad_id=0)
    assert gen.response_ids.tolist() == [[7, 2], [5, 6]]
    assert gen.lengths.tolist() == [2, 2] and gen.response_mask.all()
    assert torch.allclose(gen.logprobs, torch.tensor([[-0.5, -1.0], [-0.1, -0.2]]))
    short = generation_from_outputs(outs[:1], max_new_tokens=4, pad_id=0)
    assert short.response_mask.tolist() == [[True, True, False, False]]
    assert short.response_ids.tolist() == [[7, 2, 0, 0]] and short.logprobs[0, 2:].eq(0).all()


def test_engine_args_follow_the_spec():
    def cfg(**rollout):
        return TrainerConfig.model_validate(
            {
                "model": {"path": "org/m", "dtype": "bfloat16"},
                "roles": {
                    "actor": {"resources": {"gpus": 4}},
                    "rollout": {"backend": "sglang", "parallelism": {"tensor": 2}, **rollout},
                },
                "algorithm": {"advantageEstimator": "grpo"},
                "data": {"samplesPerPrompt": 2},
            }
        )

    colocated = engine_args(cfg(colocateWithActor=True, gpuMemoryFraction=0.4), Path("/m"))
    assert colocated["tp_size"] == 2 and colocated["mem_fraction_static"] == 0.4
    assert colocated["enable_memory_saver"] is True and colocated["trust_remote_code"] is False
    own = engine_args(cfg(resources={"gpus": 4}), Path("/m"))
    assert own["enable_memory_saver"] is False and own["model_path"] == "/m"


def _model_dir(tmp_path: Path, shape) -> Path:
    """A model directory holding only the config.json of ``shape`` (what the engine reads)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "hidden_size": shape.hidden,
                "num_hidden_layers": shape.layers,
                "num_attention_heads": shape.heads,
                "num_key_value_heads": shape.kv_heads,
                "intermediate_size": shape.intermediate,
                "vocab_size": shape.vocab,
                "tie_word_embeddings": shape.tied,
            }
        )
    )
    return model


def _colocated(path: str = "org/unknown-to-the-operator", **rollout) -> TrainerConfig:
    from ppojob_api.validation import trainer_config_from_spec, validate_manifest
    from tests.helpers.manifests import memory_base

    return trainer_config_from_spec(validate_manifest(memory_base(path, **rollout)).spec)


def test_a_colocated_engine_left_unset_gets_the_plans_fraction(tmp_path):
    """Unset, a colocated engine's mem_fraction_static is the plan's, from the model directory
    it loads (a hub id the operator could not plan) and the GPU it runs on: never above what
    fits after step 1; a smaller GPU gets a smaller fraction. An explicit one is passed as is;
    an engine on its own GPUs keeps SGLang's 0.85."""
    from ppojob_api import memory_plan as M

    shape = M.KNOWN_SHAPES["Qwen/Qwen2.5-1.5B"]
    model = _model_dir(tmp_path, shape)
    cfg = _colocated()
    plan = M.plan_job(cfg, 80.0, shape)[0]
    args = engine_args(cfg, model)
    assert args["mem_fraction_static"] == plan.engine_fraction <= plan.wake_max_fraction
    smaller = engine_args(cfg, model, gpu_gib=60.0)["mem_fraction_static"]
    assert smaller < args["mem_fraction_static"]
    assert smaller <= M.plan_job(cfg, 60.0, shape)[0].wake_max_fraction
    assert engine_args(_colocated(gpuMemoryFraction=0.3), model)["mem_fraction_static"] == 0.3
    own = _colocated(colocateWithActor=False, replicas=1, resources={"gpus": 8})
    assert engine_args(own, model)["mem_fraction_static"] == 0.85


def test_a_colocated_engine_that_cannot_fit_fails_at_start_with_the_plans_words(tmp_path):
    """A 7B model behind a hub id the operator cannot plan: the engine refuses to start (before
    training) in the line `ppojob validate` would have printed for a known model."""
    from ppojob_api import memory_plan as M
    from ppojob_trainer.errors import StartupError

    model = _model_dir(tmp_path, M.KNOWN_SHAPES["Qwen/Qwen2.5-7B"])
    with pytest.raises(StartupError) as refused:
        engine_args(_colocated(), model)
    text = str(refused.value)
    assert "\n" not in text and "roles.actor: the memory plan needs" in text
    assert "training.sharding: fsdp" in text


class RecordingEngine:
    """Stands for ``sglang.Engine``: records its keyword arguments and the environment its
    subprocesses would inherit, and the sampling parameters of each generate call."""

    made: list[dict] = []

    def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
        import os

        env = {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES")}
        RecordingEngine.made.append({"args": kwargs, "env": env})
        self.params: list = []

    def generate(  # type: ignore[no-untyped-def]
        self,
        input_ids,
        sampling_params,
        return_logprob,
        lora_path=None,
        return_routed_experts=False,
    ):
        self.params.append(sampling_params)
        self.lora_path = lora_path
        self.return_routed_experts = return_routed_experts  # routingReplay: rollout only
        return [{"meta_info": {"output_token_logprobs": [(-0.5, 7, "")]}} for _ in input_ids]


def _sglang_cfg() -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "roles": {"rollout": {"backend": "sglang", "colocateWithActor": True}},
            "algorithm": {"advantageEstimator": "grpo"},
        }
    )


def _recording_adapter(monkeypatch, visible=None):  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from ppojob_trainer.backends import sglang_backend

    RecordingEngine.made = []
    monkeypatch.setattr(sglang_backend, "sglang_object", lambda name: RecordingEngine)
    tok = SimpleNamespace(pad_token_id=0)
    return sglang_backend.SGLangGenerationEngine(_sglang_cfg(), Path("/m"), tok, [2], visible)


def test_engine_processes_start_without_the_trainers_allocator_settings(monkeypatch):
    """PYTORCH_CUDA_ALLOC_CONF (the training allocator's expandable segments) must not reach
    SGLang's processes; the trainer's own environment is restored after the start."""
    import os

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    _recording_adapter(monkeypatch, ["3", "4"])
    (made,) = RecordingEngine.made
    assert made["env"] == {"PYTORCH_CUDA_ALLOC_CONF": None, "CUDA_VISIBLE_DEVICES": "3,4"}
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"


def test_every_engine_gets_its_own_ports(monkeypatch):
    """Engines sharing a node each get their own ``port`` and ``nccl_port`` (SGLang's defaults
    would be the same for all)."""
    made = []
    for _ in range(2):
        _recording_adapter(monkeypatch)
        made += RecordingEngine.made
    ports = [m["args"][k] for m in made for k in ("port", "nccl_port")]
    assert len(set(ports)) == 4, ports


def test_every_sample_of_a_prompt_gets_its_own_sampling_seed(monkeypatch):
    """SGLang seeds a row's sampler with (its seed, the position): the samples of one prompt
    (repeated rows) must not share a seed, and a seed gives the same seeds again."""
    engine = _recording_adapter(monkeypatch)
    ids, mask = torch.ones(4, 3, dtype=torch.long), torch.ones(4, 3, dtype=torch.bool)
    for seed in (5, 5, 6):
        engine.generate(ids, mask, max_new_tokens=1, temperature=1.0, top_p=1.0, seed=seed)
    a, b, c = ([p["sampling_seed"] for p in params] for params in engine.engine.params)
    assert len(set(a)) == 4 and a == b and not set(a) & set(c)
    assert engine.engine.return_routed_experts is False  # routingReplay none: not asked


# ---------------------------------------------------------------------------------------------
# Model paths: hub ids, one rule for validate and the runtime
# ---------------------------------------------------------------------------------------------
PATHS = [
    ("Qwen/Qwen2.5-7B-Instruct", "hub"),
    ("gpt2", "hub"),
    ("/models/qwen", "local"),
    ("./models/qwen", "local"),
    ("builtin:tiny-llama", "builtin"),
    ("builtin:nope", None),
    ("s3://bucket/model", None),
    ("a/b/c", None),
    ("org--x/name", None),
    ("has space/x", None),
]


def _offline_hub(monkeypatch, cache: Path) -> None:
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE=cache, as huggingface_hub reads them (at import)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))


@pytest.mark.parametrize(("path", "kind"), PATHS)
def test_validate_and_the_runtime_accept_the_same_model_paths(path, kind, tmp_path, monkeypatch):
    from ppojob_trainer.models import resolve_model_path

    half = TrainerConfig.model_validate({"model": {"path": path}})
    problems = [p for p in check_training_half(half) if p.path == "spec.model.path"]
    _offline_hub(monkeypatch, tmp_path / "empty-hub")
    monkeypatch.setenv("PPOJOB_CACHE_DIR", str(tmp_path / "cache"))
    if kind is None:
        assert problems
        with pytest.raises(ValueError, match=r"model\.path"):
            resolve_model_path(path, 0)
        return
    assert not problems and model_path_kind(path) == kind
    if kind == "builtin":
        assert (resolve_model_path(path, 0) / "config.json").exists()
    else:  # accepted, then looked up: absent here, with an error that says where it looked
        with pytest.raises(ValueError, match=r"does not exist|not in the Hugging Face cache"):
            resolve_model_path(path, 0)


@pytest.fixture
def builtin_dir(tmp_path, monkeypatch) -> Path:
    from ppojob_trainer.models import materialize_builtin

    return materialize_builtin("tiny-llama", 0, tmp_path / "cache")


def _hub_cache(root: Path, repo: str, model_dir: Path) -> Path:
    """A Hugging Face hub cache holding `repo` at one revision (the layout huggingface_hub
    writes: models--org--name/{refs/main, snapshots/<commit>/...})."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    snapshot = repo_dir / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    return snapshot


def test_a_hub_id_resolves_from_an_offline_cache_and_loads(builtin_dir, tmp_path, monkeypatch):
    from ppojob_trainer.models import load_causal_lm, load_tokenizer, resolve_model_path

    snapshot = _hub_cache(tmp_path / "hub", "acme/tiny-chat", builtin_dir)
    _offline_hub(monkeypatch, tmp_path / "hub")
    monkeypatch.chdir(tmp_path)
    got = resolve_model_path("acme/tiny-chat", 0)
    assert got.resolve() == snapshot.resolve()
    assert load_tokenizer(got).pad_token == "<pad>"
    assert load_causal_lm(got).config.num_hidden_layers == 2
    # a local directory of the same name wins, as in transformers' from_pretrained
    shutil.copytree(builtin_dir, tmp_path / "acme" / "tiny-chat")
    assert resolve_model_path("acme/tiny-chat", 0) == Path("acme/tiny-chat")


def test_trust_remote_code_reaches_every_loader(builtin_dir, monkeypatch):
    import transformers

    from ppojob_trainer import models

    seen = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    try:
        models.set_trust_remote_code(True)
        models.load_tokenizer(builtin_dir)
        models.set_trust_remote_code(False)
        models.load_tokenizer(builtin_dir)
    finally:
        models.set_trust_remote_code(False)
    assert seen == [True, False]


# ---------------------------------------------------------------------------------------------
# Prompts: strings or chat messages, chat templates
# ---------------------------------------------------------------------------------------------
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'][0] }}{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>a{% endif %}"
)


def _worker(model_dir: Path, apply: bool | None):
    from ppojob_trainer.distributed import ShardIdentity
    from ppojob_trainer.workers.rollout import RolloutWorker

    cfg = TrainerConfig.model_validate(
        {"model": {"path": str(model_dir)}, "data": {"applyChatTemplate": apply}}
    )
    return RolloutWorker(cfg, ShardIdentity("rollout"), model_dir, "cpu")


def test_chat_messages_and_strings_are_rendered_with_the_template(builtin_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(builtin_dir))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(builtin_dir))

    worker = _worker(builtin_dir, None)  # default: on, the tokenizer has a template
    assert worker.chat
    messages = [{"role": "system", "content": "9"}, {"role": "user", "content": "12"}]
    texts, ids, mask = worker.encode([messages, "3"])
    assert texts == ["<s>s9</s><s>u12</s><s>a", "<s>u3</s><s>a"]
    t = worker.tokenizer
    # the template holds the special tokens: no second <s> is added in front
    assert ids[0][mask[0]].tolist() == t(texts[0], add_special_tokens=False)["input_ids"]
    assert ids[0][mask[0]].tolist()[:2] == [t.bos_token_id, t.convert_tokens_to_ids("<unk>")]

    off = _worker(builtin_dir, False)
    texts, _, _ = off.encode(["3"])
    assert texts == ["3"]
    with pytest.raises(ValueError, match="chat messages needs the tokenizer's chat template"):
        off.encode([messages])


def test_without_a_template_default_is_off_and_forcing_it_is_an_error(builtin_dir):
    assert not _worker(builtin_dir, None).chat
    with pytest.raises(ValueError, match="applyChatTemplate is true but the model's tokenizer"):
        _worker(builtin_dir, True)


def test_datasets_may_hold_chat_messages(tmp_path):
    from ppojob_trainer.tasks import load_dataset

    rows = [
        {"prompt": [{"role": "user", "content": "hi"}], "label": "1"},
        {"prompt": "plain", "label": "2"},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    examples = load_dataset(path)
    assert examples[0].prompt == [{"role": "user", "content": "hi"}]
    assert examples[1].prompt == "plain"
    path.write_text(json.dumps({"prompt": [{"role": "user"}]}))
    with pytest.raises(ValueError, match="string or chat messages"):
        load_dataset(path)
