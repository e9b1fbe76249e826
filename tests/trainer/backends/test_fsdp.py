"""FSDP2 on CPU (gloo, two processes): sharded training equals ONE single-process update on
the full batch, and each worker's checkpoint shard restores it exactly (and at another
data-parallel size, 2 -> 1 and 1 -> 2, DCP resharding).

Both processes train the same actor (with a sharded reference model and the KL loss) and critic
for three updates on their half of the batch, once with ``sharding: none`` (replicas + one
all-reduce) and once with ``sharding: fsdp`` (FSDP2 ``fully_shard``); each process also trains a
single-process actor and critic (no group) on the whole batch: the reference. Both data-parallel
runs share the gradient-weighting code, so a loss-scaling bug would pass a comparison of the
two; against the single process it cannot. Gradient norms and the gathered weights must agree
with the single process within 1e-5 (float32); the sharded and replicated runs' own metrics too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
WORLD = 2
UPDATES = 3


def _batch(n: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    lengths = torch.tensor([1, 3, 6, 2, 5, 4, 6, 1])[:n]
    return {
        "prompt_ids": torch.randint(4, 14, (n, 3), generator=g),
        "prompt_mask": torch.ones(n, 3, dtype=torch.bool),
        "response_ids": torch.randint(4, 14, (n, 6), generator=g),
        "response_mask": torch.arange(6)[None, :] < lengths[:, None],
        "old_logprobs": -torch.rand(n, 6, generator=g) * 3,
        "advantages": torch.randn(n, 6, generator=g),
        "returns": torch.randn(n, 6, generator=g),
        "old_values": torch.zeros(n, 6),
    }


def policy_loss(logp, ent, mb):  # type: ignore[no-untyped-def]
    from ppojob_trainer import algorithms as A

    loss, _ = A.policy_loss(
        logp,
        mb["old_logprobs"],
        mb["advantages"],
        mb["response_mask"],
        entropy=ent,
        entropy_coef=0.01,
    )
    kl = A.kl_loss(logp, mb["ref_logprobs"], mb["response_mask"], "k3", "token-mean")
    return loss + 0.1 * kl, {"pg_loss": loss.detach(), "kl_loss": kl.detach()}


def value_loss(values, mb):  # type: ignore[no-untyped-def]
    from ppojob_trainer import algorithms as A

    loss, _ = A.value_loss(values, mb["old_values"], mb["returns"], mb["response_mask"], 0.2)
    return loss, {"vf_loss": loss.detach()}


def _worker(rank: int, model_dir: str, port: int, out: str) -> None:
    import torch.distributed as dist

    from ppojob_api.training import TrainingSettings
    from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer
    from ppojob_trainer.backends.torch_backend.sharding import full_state_dict
    from ppojob_trainer.backends.torch_backend.value import TorchValueTrainer
    from ppojob_trainer.distributed import ShardIdentity

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    group = dist.new_group(list(range(WORLD)), backend="gloo")
    shard = ShardIdentity("actor", dp_rank=rank, dp_size=WORLD)
    full = _batch()
    rows = slice(rank * 4, rank * 4 + 4)
    mine = {k: v[rows] for k, v in full.items()}

    def build(sharding: str):
        s = TrainingSettings(learning_rate=1e-2, sharding=sharding, grad_clip=1.0)
        kw = dict(total_updates=UPDATES, group=group, dp_size=WORLD)
        actor = TorchPolicyTrainer(
            model_dir, "float32", s, temperature=1.0, need_reference=True, entropy_grad=True, **kw
        )
        critic = TorchValueTrainer(model_dir, "float32", s, seed=0, **kw)
        return actor, critic

    def update(actor, critic):
        batch = dict(mine)
        batch["ref_logprobs"] = actor.logprobs(batch, reference=True)
        a = actor.update(batch, policy_loss, micro_batch_size=2)
        c = critic.update(batch, value_loss, micro_batch_size=2)
        return {
            **{f"actor/{k}": v for k, v in a.items()},
            **{f"critic/{k}": v for k, v in c.items()},
        }

    results = {}
    # the reference: one process, no group, the whole batch (same micro-batch size)
    s1 = TrainingSettings(learning_rate=1e-2, sharding="none", grad_clip=1.0)
    single_actor = TorchPolicyTrainer(
        model_dir,
        "float32",
        s1,
        temperature=1.0,
        need_reference=True,
        entropy_grad=True,
        total_updates=UPDATES,
    )
    single_critic = TorchValueTrainer(model_dir, "float32", s1, seed=0, total_updates=UPDATES)
    single_metrics = []
    for _ in range(UPDATES):
        batch = dict(full)
        batch["ref_logprobs"] = single_actor.logprobs(batch, reference=True)
        a = single_actor.update(batch, policy_loss, micro_batch_size=2)
        c = single_critic.update(batch, value_loss, micro_batch_size=2)
        single_metrics.append(
            {"actor/grad_norm": a["grad_norm"], "critic/grad_norm": c["grad_norm"]}
        )
    results["single"] = {
        "metrics": single_metrics,
        "actor": single_actor.export_weights(),
        "critic": full_state_dict(single_critic.model),
    }
    for sharding in ("none", "fsdp"):
        actor, critic = build(sharding)
        assert actor.opt.sharded == (sharding == "fsdp")
        metrics = []
        for i in range(UPDATES):
            if i == UPDATES - 1 and sharding == "fsdp":  # each worker writes its own shard
                actor.save_checkpoint(Path(out) / "ckpt" / "actor", shard)
                critic.save_checkpoint(Path(out) / "ckpt" / "critic", shard)
            metrics.append(update(actor, critic))
        results[sharding] = {
            "metrics": metrics,
            "actor": actor.export_weights()
            if sharding == "none"
            else {k: v.float() for k, v in full_state_dict(actor.lm).items()},
            "critic": full_state_dict(critic.model),
            "logprobs": actor.logprobs(mine),
        }
    # resume: fresh sharded trainers load the shards written before the last update
    actor, critic = build("fsdp")
    actor.load_checkpoint(Path(out) / "ckpt" / "actor", shard)
    critic.load_checkpoint(Path(out) / "ckpt" / "critic", shard)
    results["resumed"] = {
        "metrics": [update(actor, critic)],
        "actor": full_state_dict(actor.lm),
        "critic": full_state_dict(critic.model),
    }
    # another data-parallel size: the shards one process wrote (the test, before it started
    # these workers), resumed by two; the last update lands where the single process's did
    actor, critic = build("fsdp")
    actor.load_checkpoint(Path(out) / "ckpt1" / "actor", shard)
    critic.load_checkpoint(Path(out) / "ckpt1" / "critic", shard)
    results["from_one"] = {
        "updates": (actor.opt.updates, critic.opt.updates),
        "metrics": [update(actor, critic)],
        "actor": {k: v.float() for k, v in full_state_dict(actor.lm).items()},
        "critic": full_state_dict(critic.model),
    }
    # bfloat16 compute (FSDP mixed precision) over float32 sharded masters: lr 1e-6 moves
    # nearly every element in three updates
    s16 = TrainingSettings(learning_rate=1e-6, sharding="fsdp", grad_clip=None)
    bf16 = TorchPolicyTrainer(
        model_dir,
        "bfloat16",
        s16,
        total_updates=UPDATES,
        temperature=1.0,
        need_reference=True,
        group=group,
        dp_size=WORLD,
    )
    before = full_state_dict(bf16.lm)
    batch16 = dict(mine)
    batch16["ref_logprobs"] = bf16.logprobs(batch16, reference=True)
    for _ in range(UPDATES):
        bf16.update(batch16, policy_loss, micro_batch_size=2)
    after = full_state_dict(bf16.lm)
    changed = sum(int((after[k] != before[k]).sum()) for k in before)
    results["bf16_changed"] = changed / sum(v.numel() for v in before.values())
    results["bf16_dtypes"] = {str(p.dtype) for p in bf16.opt.params}
    local = actor.opt.params[1]
    results["shard_numel"] = (local.to_local().numel(), local.numel())
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _one_process(model_dir: Path) -> tuple:
    """A one-process FSDP actor and critic (no group) and its shard identity."""
    from ppojob_api.training import TrainingSettings
    from ppojob_trainer.backends.torch_backend.policy import TorchPolicyTrainer
    from ppojob_trainer.backends.torch_backend.value import TorchValueTrainer
    from ppojob_trainer.distributed import ShardIdentity

    s = TrainingSettings(learning_rate=1e-2, sharding="fsdp", grad_clip=1.0)
    actor = TorchPolicyTrainer(
        model_dir,
        "float32",
        s,
        temperature=1.0,
        need_reference=True,
        entropy_grad=True,
        total_updates=UPDATES,
    )
    critic = TorchValueTrainer(model_dir, "float32", s, seed=0, total_updates=UPDATES)
    return actor, critic, ShardIdentity("actor", dp_rank=0, dp_size=1)


def _one_process_shards(model_dir: Path, out: Path) -> None:
    """:func:`_one_process`'s actor and critic after all but the last update on the whole
    batch, checkpointed to ``out`` (``actor/``, ``critic/``)."""
    actor, critic, one = _one_process(model_dir)
    for _ in range(UPDATES - 1):
        batch = _batch()
        batch["ref_logprobs"] = actor.logprobs(batch, reference=True)
        actor.update(batch, policy_loss, micro_batch_size=2)
        critic.update(batch, value_loss, micro_batch_size=2)
    actor.save_checkpoint(out / "actor", one)
    critic.save_checkpoint(out / "critic", one)


def test_fsdp_matches_replicas_and_restores_its_shards(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from ppojob_trainer import models
    from ppojob_trainer.distributed import free_port

    model_dir = models.materialize_builtin("tiny-llama", 5, tmp_path / "cache")
    _one_process_shards(model_dir, tmp_path / "ckpt1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_worker, args=(str(model_dir), free_port(), str(tmp_path)), nprocs=WORLD)

    for rank in range(WORLD):
        r = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        local, whole = r["shard_numel"]
        assert local * WORLD == whole  # each worker holds half of a parameter
        for m_none, m_fsdp in zip(r["none"]["metrics"], r["fsdp"]["metrics"], strict=True):
            for key, value in m_none.items():
                assert m_fsdp[key] == pytest.approx(value, abs=1e-5, rel=1e-5), key
        for m_one, m_none in zip(r["single"]["metrics"], r["none"]["metrics"], strict=True):
            for key, value in m_one.items():  # global quantities: the gradient norms
                assert m_none[key] == pytest.approx(value, abs=1e-5, rel=1e-5), key
        for run in ("none", "fsdp"):
            diff_actor = _max_diff(r["single"]["actor"], r[run]["actor"])
            diff_critic = _max_diff(r["single"]["critic"], r[run]["critic"])
            print(
                f"rank {rank}: max |w_{run} - w_single| actor {diff_actor:.2e} critic "
                f"{diff_critic:.2e}"
            )
            assert diff_actor <= 1e-5 and diff_critic <= 1e-5, run
        torch.testing.assert_close(
            r["fsdp"]["logprobs"], r["none"]["logprobs"], atol=1e-5, rtol=1e-5
        )
        # data 1 -> 2: the two workers resume the one process's shards and land on the single
        # process's last update
        one = r["from_one"]
        assert one["updates"] == (UPDATES - 1, UPDATES - 1)
        assert one["metrics"][0]["actor/grad_norm"] == pytest.approx(
            r["single"]["metrics"][-1]["actor/grad_norm"], rel=1e-5
        )
        diff_actor = _max_diff(one["actor"], r["single"]["actor"])
        diff_critic = _max_diff(one["critic"], r["single"]["critic"])
        print(f"data 1 -> 2 resume: max |w - w_single| actor {diff_actor:.2e} {diff_critic:.2e}")
        assert diff_actor <= 1e-5 and diff_critic <= 1e-5
        # the resumed last update is the uninterrupted one, exactly
        assert r["resumed"]["metrics"][0] == r["fsdp"]["metrics"][-1]
        assert _max_diff(r["resumed"]["actor"], r["fsdp"]["actor"]) == 0.0
        assert _max_diff(r["resumed"]["critic"], r["fsdp"]["critic"]) == 0.0
        assert r["bf16_changed"] >= 0.99 and r["bf16_dtypes"] == {"torch.float32"}
    assert len(list((tmp_path / "ckpt" / "actor").glob("*.distcp"))) == WORLD

    # another data-parallel size: one process (no group) resumes from the two workers' shards
    # and makes the last update on the whole batch; it lands where the two workers' did
    from ppojob_trainer.backends.torch_backend.sharding import full_state_dict

    actor, critic, one = _one_process(model_dir)
    actor.load_checkpoint(tmp_path / "ckpt" / "actor", one)
    critic.load_checkpoint(tmp_path / "ckpt" / "critic", one)
    assert actor.opt.updates == critic.opt.updates == UPDATES - 1
    batch = _batch()
    batch["ref_logprobs"] = actor.logprobs(batch, reference=True)
    a = actor.update(batch, policy_loss, micro_batch_size=2)
    critic.update(batch, value_loss, micro_batch_size=2)
    r = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert a["grad_norm"] == pytest.approx(r["fsdp"]["metrics"][-1]["actor/grad_norm"], rel=1e-5)
    diff_actor = _max_diff(
        {k: v.float() for k, v in full_state_dict(actor.lm).items()}, r["fsdp"]["actor"]
    )
    diff_critic = _max_diff(full_state_dict(critic.model), r["fsdp"]["critic"])
    print(f"data 2 -> 1 resume: max |w - w_fsdp| actor {diff_actor:.2e} critic {diff_critic:.2e}")
    assert diff_actor <= 1e-5 and diff_critic <= 1e-5
