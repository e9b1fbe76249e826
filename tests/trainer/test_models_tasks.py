"""Built-in models, the character tokenizer, built-in tasks, datasets and reward loading."""

from __future__ import annotations

import json
import random
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ppojob_trainer import models, tasks


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PPOJOB_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "ppojob-cache"))


def test_tiny_llama_has_the_comparison_shape():
    model = models.build_builtin_model("tiny-llama", seed=0)
    cfg = model.config
    assert cfg.model_type == "llama"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 256, 2)
    assert (cfg.num_attention_heads, cfg.vocab_size) == (4, 14)
    assert models.count_parameters(model) == 133_184


def test_other_builtins():
    qwen = models.build_builtin_model("tiny-qwen2", seed=0)
    assert qwen.config.model_type == "qwen2"
    small = models.build_builtin_model("small-llama", seed=0)
    ratio = models.count_parameters(small) / 133_184
    assert 9 <= ratio <= 11


def test_unknown_builtin_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown built-in model builtin:huge"):
        models.resolve_model_path("builtin:huge", 0)
    with pytest.raises(ValueError, match="does not exist"):
        models.resolve_model_path("/no/such/model", 0)


def test_builtin_directory_loads_like_a_real_model_and_is_seeded():
    path = models.materialize_builtin("tiny-llama", 3)
    assert (path / "config.json").exists() and (path / "tokenizer.json").exists()
    assert models.materialize_builtin("tiny-llama", 3) == path  # idempotent
    loaded = models.load_causal_lm(path)
    fresh = models.build_builtin_model("tiny-llama", 3)
    other = models.build_builtin_model("tiny-llama", 4)
    for (k, a), b in zip(loaded.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    pairs = zip(fresh.parameters(), other.parameters(), strict=True)
    assert not all(torch.equal(b, c) for b, c in pairs)
    tok = models.load_tokenizer(path)
    assert len(tok) == 14
    ids = tok("7031")["input_ids"]
    assert ids == [tok.bos_token_id, 11, 4, 7, 5]
    assert tok.decode(ids[1:]) == "7031"
    value = models.load_value_model(path, seed=0)
    out = value(torch.tensor([ids]))
    assert out.shape == (1, 5) and out.dtype == torch.float32


def test_count_up_definition():
    assert tasks.count_up_answer("7") == "89012345"
    assert tasks.count_up_reward(["7"], ["89012345"], [None]) == [1.0]
    assert tasks.count_up_reward(["7"], ["8901"], [None]) == [0.5]
    assert tasks.count_up_reward(["0"], ["12399999"], ["12345678"]) == [3 / 8]
    examples = tasks.make_task("builtin:count-up").sample(50, random.Random(0))
    assert all(len(e.prompt) == 1 and e.label == tasks.count_up_answer(e.prompt) for e in examples)


def test_random_policy_scores_about_003():
    rng = random.Random(0)
    vocab = models.VOCAB
    scores = []
    for _ in range(20000):
        d = str(rng.randrange(10))
        toks = [rng.choice(vocab) for _ in range(8)]
        cut = next((i for i, t in enumerate(toks) if t in models.SPECIAL_TOKENS), 8)
        scores += tasks.count_up_reward([d], ["".join(toks[:cut])], [None])
    assert 0.025 < sum(scores) / len(scores) < 0.035


def test_reverse_task():
    ex = tasks.make_task("builtin:reverse").sample(5, random.Random(1))
    assert all(e.label == e.prompt[::-1] and len(e.prompt) == 5 for e in ex)
    assert tasks.reverse_reward(["12345"], ["54321"], [None]) == [1.0]
    assert tasks.reverse_reward(["12345"], ["5"], [None]) == [0.2]


def test_datasets(tmp_path):
    rows = [{"prompt": "12", "label": "3"}, {"prompt": "45"}]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows))
    js = tmp_path / "d.json"
    js.write_text(json.dumps(rows))
    for path in (jl, js):
        task = tasks.make_task(str(path), shuffle=False)
        got = task.sample(3, random.Random(0))
        assert [e.prompt for e in got] == ["12", "45", "12"]
        assert got[0].label == "3" and got[1].label is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="no 'prompt' field holding a string or chat messages"):
        tasks.make_task(str(bad))
    with pytest.raises(ValueError, match="does not exist"):
        tasks.make_task(str(tmp_path / "missing.jsonl"))


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent("""
        def good(prompts, completions, labels):
            return [float(len(c)) for c in completions]
        def short(prompts, completions, labels):
            return [1.0]
        def nan(prompts, completions, labels):
            return [float("nan")] * len(prompts)
        def text(prompts, completions, labels):
            return ["high"] * len(prompts)
        def boom(prompts, completions, labels):
            raise KeyError("label")
        not_callable = 3
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_user_reward_function(reward_module):
    scorer = tasks.RewardScorer(f"{reward_module}:good", "data.jsonl")
    assert scorer(["a", "b"], ["xyz", ""], [None, None]) == [3.0, 0.0]


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        ("short", "1"),
        ("nan", "nan|finite"),
        ("text", "str|number|float"),
        ("boom", "raised KeyError"),
    ],
)
def test_bad_reward_functions_give_clear_errors(reward_module, fn, message):
    scorer = tasks.RewardScorer(f"{reward_module}:{fn}", "data.jsonl")
    with pytest.raises(ValueError, match=message) as err:
        scorer(["a", "b"], ["x", "y"], [None, None])
    assert fn in str(err.value)


def test_unloadable_reward_functions(reward_module):
    with pytest.raises(ValueError, match="rewardFunction"):
        tasks.RewardScorer("no_such_module_xyz:f", "data.jsonl")
    with pytest.raises(ValueError, match="rewardFunction"):
        tasks.RewardScorer(f"{reward_module}:missing", "data.jsonl")
    with pytest.raises(ValueError, match="rewardFunction"):
        tasks.RewardScorer(f"{reward_module}:not_callable", "data.jsonl")
    with pytest.raises(ValueError, match="needs a reward function"):
        tasks.RewardScorer(None, "data.jsonl")


def test_dataset_position_survives_a_checkpoint_round_trip():
    examples = [tasks.Example(str(i), str(i)) for i in range(7)]
    first = tasks.DatasetTask(examples, shuffle=True)
    rng = random.Random(3)
    first.sample(5, rng)  # part-way through the first epoch
    saved, rng_saved = json.loads(json.dumps(first.state())), rng.getstate()
    expected = first.sample(6, rng)  # crosses into the next (reshuffled) epoch
    resumed = tasks.DatasetTask(examples, shuffle=True)
    resumed.load_state(saved)
    rng.setstate(rng_saved)
    assert resumed.sample(6, rng) == expected
    assert tasks.CountUpTask().state() == {}


def _materialize_in(root: str) -> str:
    return str(models.materialize_builtin("tiny-llama", 5, Path(root)))


def test_concurrent_materialisation_gives_one_complete_directory(tmp_path):
    import multiprocessing

    # a directory left behind incomplete (a writer killed mid-way) must not be taken as built
    (tmp_path / "models" / "tiny-llama-seed5").mkdir(parents=True)
    (tmp_path / "models" / "tiny-llama-seed5" / "tokenizer.json").write_text("{}")
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        paths = pool.map(_materialize_in, [str(tmp_path)] * 3)
    assert len(set(paths)) == 1
    assert models.load_causal_lm(paths[0]).num_parameters() == 133_184
    leftovers = [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == ["tiny-llama-seed5"]


def test_size_checks_know_the_built_in_models_shapes() -> None:
    """check_sizes bounds memory with these shapes; they must be the models' own."""
    from ppojob_api.trainspec import constants as config
    from ppojob_trainer import models

    assert set(config.BUILTIN_SHAPES) == set(models.BUILTIN_MODELS) == set(config.BUILTIN_MODELS)
    for name, shape in models.BUILTIN_MODELS.items():
        assert config.BUILTIN_SHAPES[name] == (shape.hidden, shape.intermediate, shape.layers)
        hf = models.builtin_config(name)
        assert hf.max_position_embeddings == config.BUILTIN_CONTEXT


def test_models_load_without_hub_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers kernelizes every model it loads when `kernels` is installed (5.25 requires
    it): layers swapped for Hub kernels, again on each ``train()``, and a ValueError on the meta
    device. The policy, the critic's backbone and a reward model load with that off, and a
    loaded model moves to the meta device and trains there."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from ppojob_api.training import RewardModelSource
    from ppojob_trainer.rewards import RewardModelScorer

    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    path = models.materialize_builtin("tiny-llama", 3)
    # the check has something to bite on: with the locked versions a plain load kernelizes
    assert AutoModelForCausalLM.from_pretrained(str(path)).use_kernels
    policy = models.load_causal_lm(path)
    critic = models.load_value_model(path, seed=0)
    assert not policy.use_kernels and not critic.backbone.use_kernels
    policy.to("meta").train()  # kernelizing here raised "Unsupported device type 'meta'"
    critic.to("meta").train()

    rm = tmp_path / "rm"
    AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1).save_pretrained(rm)
    models.load_tokenizer(path).save_pretrained(rm)
    scorer = RewardModelScorer(
        RewardModelSource(path=str(rm)), "data.rewards[0].model", "cpu", "float32"
    )
    assert not scorer.model.use_kernels
