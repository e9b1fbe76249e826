"""LoRA (PEFT) in the torch backend: only the adapters train and checkpoint, the reference is
the base model with them disabled, the weight sync sends only the adapters and the torch engine
applies them, the HF export writes the adapter (and the merged model)."""

from __future__ import annotations

import json

import pytest
import torch

from ppojob_api.training import LoraSpec, TrainingSettings
from ppojob_trainer import models
from ppojob_trainer.backends.torch_backend.generation import TorchGenerationEngine
from ppojob_trainer.backends.torch_backend.lora import merged_lora_weights
from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer
from tests.helpers.batches import mixed_batch as _batch
from tests.helpers.batches import ppo_policy_loss as _policy_loss


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return models.materialize_builtin("tiny-llama", 5, tmp_path_factory.mktemp("cache"))


def _trainer(model_dir, **kw):
    lora = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], **kw)
    return TorchPolicyTrainer(
        model_dir,
        "float32",
        TrainingSettings(learning_rate=5e-2),
        total_updates=4,
        temperature=1.0,
        need_reference=True,
        lora=lora,
    )


def _base_logprobs(model_dir, batch) -> torch.Tensor:
    """The log-probs of the base model without adapters (a plain full-weights actor)."""
    plain = TorchPolicyTrainer(
        model_dir,
        "float32",
        TrainingSettings(),
        total_updates=1,
        temperature=1.0,
        need_reference=False,
    )
    return plain.logprobs(batch)


@pytest.fixture(scope="module")
def trained(model_dir):
    """A LoRA actor after two updates, with the base weights before them."""
    trainer = _trainer(model_dir)
    before = {k: v.clone() for k, v in trainer.lm.get_base_model().state_dict().items()}
    batch = _batch()
    for _ in range(2):
        trainer.update(batch, _policy_loss, 5)
    return trainer, before, batch


def test_only_the_adapters_train(trained):
    trainer, before, _ = trained
    names = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(trainer.opt.params) == len(names)
    after = trainer.lm.get_base_model().state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_" in k for k in changed)


def test_the_reference_is_the_base_model_with_adapters_disabled(trained, model_dir):
    trainer, _, batch = trained
    assert trainer.reference is None  # no second copy
    mask = batch["response_mask"]
    base = _base_logprobs(model_dir, batch)
    ref = trainer.logprobs(batch, reference=True)
    policy = trainer.logprobs(batch)
    torch.testing.assert_close(ref[mask], base[mask], atol=1e-5, rtol=1e-5)
    assert (policy[mask] - base[mask]).abs().max() > 1e-3  # the adapters are on again


def test_weight_sync_sends_only_adapters_and_the_engine_applies_them(trained, model_dir):
    trainer, _, batch = trained
    sent = trainer.export_weights()
    assert sent and all(k.endswith((".lora_A", ".lora_B")) for k in sent)
    full = merged_lora_weights(trainer.lm, torch.float32)
    sent_bytes = sum(t.numel() * t.element_size() for t in sent.values())
    full_bytes = sum(t.numel() * t.element_size() for t in full.values())
    assert sent_bytes < 0.1 * full_bytes
    tok = models.load_tokenizer(model_dir)
    engine = TorchGenerationEngine(model_dir, "float32", tok.all_special_ids, tok.pad_token_id)
    for _ in range(2):  # applied to the base weights each time, not on top of the last
        engine.update_weights(sent)
    state = engine.model.state_dict()
    for k, v in full.items():
        torch.testing.assert_close(state[k], v, atol=1e-6, rtol=1e-5)
    # the engine samples from the trained policy: its log-probs are the actor's
    gen = engine.generate(
        batch["prompt_ids"],
        batch["prompt_mask"],
        max_new_tokens=6,
        temperature=1.0,
        top_p=1.0,
        seed=1,
    )
    rollout = {
        "prompt_ids": batch["prompt_ids"],
        "prompt_mask": batch["prompt_mask"],
        "response_ids": gen.response_ids,
        "response_mask": gen.response_mask,
    }
    m = gen.response_mask
    torch.testing.assert_close(trainer.logprobs(rollout)[m], gen.logprobs[m], atol=1e-4, rtol=1e-4)


def test_checkpoint_holds_only_the_adapters_and_restores_them(trained, model_dir, tmp_path):
    import torch.distributed.checkpoint as dcp

    trainer, _, batch = trained
    trainer.opt.save_checkpoint(tmp_path / "ckpt")
    keys = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys)
    fresh = _trainer(model_dir)
    fresh.opt.load_checkpoint(tmp_path / "ckpt")
    mask = batch["response_mask"]
    torch.testing.assert_close(
        fresh.logprobs(batch)[mask], trainer.logprobs(batch)[mask], atol=1e-6, rtol=1e-6
    )
    assert fresh.opt.updates == trainer.opt.updates == 2


def test_export_writes_the_adapter_and_the_merged_model(trained, tmp_path):
    from ppojob_trainer.distributed import ShardIdentity

    trainer, _, batch = trained
    trainer.lora = trainer.lora.model_copy(update={"export_merged": True})
    trainer.export_pretrained(tmp_path / "hf", ShardIdentity("actor"))
    config = json.loads((tmp_path / "hf" / "adapter_config.json").read_text())
    assert config["r"] == 4 and set(config["target_modules"]) == {"q_proj", "v_proj", "down_proj"}
    assert (tmp_path / "hf" / "adapter_model.safetensors").exists()
    merged = TorchPolicyTrainer(
        tmp_path / "hf" / "merged",
        "float32",
        TrainingSettings(),
        total_updates=1,
        temperature=1.0,
        need_reference=False,
    )
    mask = batch["response_mask"]
    torch.testing.assert_close(
        merged.logprobs(batch)[mask], trainer.logprobs(batch)[mask], atol=1e-5, rtol=1e-5
    )


def test_an_unknown_target_module_names_the_field(model_dir):
    with pytest.raises(ValueError, match=r"spec\.model\.lora\.targetModules: \['qkv'\]"):
        TorchPolicyTrainer(
            model_dir,
            "float32",
            TrainingSettings(),
            total_updates=1,
            temperature=1.0,
            need_reference=False,
            lora=LoraSpec(target_modules=["q_proj", "qkv"]),
        )


@pytest.mark.parametrize("name", list(models.BUILTIN_MODELS))
def test_the_api_knows_the_linear_layers_of_the_builtin_models(name):
    from torch import nn

    from ppojob_api.checks.efficiency import BUILTIN_LINEAR_MODULES, BUILTIN_MOE_LINEAR_MODULES

    lm = models.build_builtin_model(name, 0)
    linear = {n.rsplit(".", 1)[-1] for n, m in lm.named_modules() if isinstance(m, nn.Linear)}
    moe = models.BUILTIN_MODELS[name].experts > 0
    assert linear - {"lm_head"} == set(
        BUILTIN_MOE_LINEAR_MODULES if moe else BUILTIN_LINEAR_MODULES
    )


def test_engines_without_adapter_loading_get_the_merged_weights(trained):
    trainer, _, _ = trained
    trainer.sync_adapters = False
    try:
        full = trainer.export_weights()
    finally:
        trainer.sync_adapters = True
    plain = models.build_builtin_model("tiny-llama", 0).state_dict()
    assert set(full) == set(plain)
    lora = trainer.export_weights()
    key = next(k for k in lora if k.endswith(".lora_A")).removesuffix(".lora_A")
    base = trainer.lm.get_base_model().state_dict()[f"{key}.base_layer.weight"]
    delta = lora[key + ".lora_B"] @ lora[key + ".lora_A"]
    assert delta.abs().max() > 0
    torch.testing.assert_close(full[f"{key}.weight"], base + delta)


def test_modules_to_save_train_in_full_and_go_with_the_adapters(model_dir):
    """modulesToSave [lm_head]: the head trains in full next to the adapters (a randomly
    initialised head caps what adapters alone can learn), the sync sends its whole weight with
    the adapters, the engine then holds the merged policy, and the reference keeps the original
    head."""
    trainer = _trainer(model_dir, modules_to_save=["lm_head"])
    head0 = trainer.lm.get_base_model().lm_head.original_module.weight.detach().clone()
    batch = _batch()
    for _ in range(2):
        trainer.update(batch, _policy_loss, 5)
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("lm_head.modules_to_save" in n for n in trained)
    sent = trainer.export_weights()
    assert not torch.equal(sent["lm_head.weight"], head0)  # the trained head goes along
    full = merged_lora_weights(trainer.lm, torch.float32)
    torch.testing.assert_close(full["lm_head.weight"], sent["lm_head.weight"])
    tok = models.load_tokenizer(model_dir)
    engine = TorchGenerationEngine(model_dir, "float32", tok.all_special_ids, tok.pad_token_id)
    engine.update_weights(sent)
    state = engine.model.state_dict()
    for k, v in full.items():
        torch.testing.assert_close(state[k], v, atol=1e-6, rtol=1e-5)
    # the reference is the base model: its original head, not the trained copy
    assert torch.equal(trainer.lm.get_base_model().lm_head.original_module.weight, head0)
    mask = batch["response_mask"]
    ref = trainer.logprobs(batch, reference=True)
    base = _base_logprobs(model_dir, batch)
    torch.testing.assert_close(ref[mask], base[mask], atol=1e-5, rtol=1e-5)
