"""Item 10 of issue 21, the megatron half: a weight sync from a megatron actor streams bucket by
bucket with tensor collectives (4 processes over real gloo, tensor 2 x pipeline 2 and tensor 2
x data 2). Each worker's ``WorkerHost`` stages every bucket as a colocated engine takes it, from
the real ``MegatronPolicyTrainer``, and

- the tensors every worker stages are bit-identical to the whole export of before
  (``export_weights``: every shard pickled to model-parallel rank 0 with ``gather_object`` and
  converted by ``megatron_to_hf``), names in the same order, for a Llama (untied, grouped
  key/value heads) and a tied Qwen2 (q/k/v biases); the critic's stream too;
- the stream calls no object collective (``gather_object``, ``all_gather_object``,
  ``broadcast_object_list`` are replaced by functions that raise while it runs);
- the stream holds one bucket at a time on every worker: the largest bucket's bytes, at most
  the bound (the largest tensor when it alone exceeds it), against the whole model. Measured by
  wrapping ``_Sharded._hf_tensor``, which makes each HF tensor of a bucket on every worker: at
  each call, the bytes of the stream's current bucket (which must be dropped before the next is
  made) and of the tensors of the bucket being made. (Not by the storages still alive, as the
  FSDP test measures: a gloo collective's worker thread lets go of the tensors it sent or
  received a moment after the call returns, so one tensor of the previous bucket now and then
  still looked alive there, a transient hold of the process group's, not the stream's);
- the other workers join each bucket's collectives in a disaggregated sync (``join_export``)
  while rank 0 streams, data-parallel replicas included: no deadlock;
- a fused tensor is all-gathered once (issue 40, finding 8): ``linear_qkv`` (weight, and bias)
  once for its q, k and v, ``linear_fc1`` once for gate and up; ``dist.all_gather`` calls are
  counted while a worker stages every bucket, against one per fused or split megatron tensor of
  its stage (the HF tensors were gathered one by one before: 3x and 2x).

The plan comes from the model's shape alone (:func:`hf_layout`): a pure test checks it against
the tensors ``megatron_to_hf`` makes. On Ray, the loop's sync paths (colocated, and engines on
their own workers) bring a megatron actor's weights to torch engines through the stream.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

WORLD = 4
BUCKET = 48 * 2**10  # bytes (several tensors a bucket; the largest tensor is 32 KiB)
# (model, tensor, pipeline, expert); data = 4 / (t * p)
CASES = [("llama", 2, 2, 1), ("qwen2", 2, 1, 1), ("mixtral", 1, 2, 2)]
DEADLOCK_S = 240  # the workers take ~50 s on a loaded 2-core machine
OBJECT_COLLECTIVES = ("gather_object", "all_gather_object", "broadcast_object_list")


def _hf_model(family: str):  # type: ignore[no-untyped-def]
    """A Llama with grouped key/value heads (untied), a tied Qwen2 (q/k/v biases), or a
    Mixtral of 4 experts (top 2) whose experts the case splits over 2 expert-parallel ranks."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mixtral": MixtralConfig}[family]
    moe = {"num_local_experts": 4, "num_experts_per_tok": 2} if family == "mixtral" else {}
    config = cls(
        **moe,
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=family == "qwen2",
        pad_token_id=0,
    )
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mixtral"])
def test_the_plan_follows_from_the_shape_alone(family: str) -> None:
    from ppojob_trainer.backends.megatron_convert import (
        ModelShape,
        hf_layout,
        hf_to_megatron,
        megatron_to_hf,
    )

    model = _hf_model(family)
    hf = model.state_dict()
    shape = ModelShape.from_hf_config(model.config)
    for tp, pp in ((1, 1), (2, 1), (2, 2)) if not shape.tied else ((1, 1), (2, 1)):
        shards = [[hf_to_megatron(hf, shape, t, tp, p, pp) for t in range(tp)] for p in range(pp)]
        whole = megatron_to_hf(shards, shape)
        layout = hf_layout(shape, pp)
        assert [t.name for t in layout] == list(whole)
        assert [t.shape for t in layout] == [tuple(v.shape) for v in whole.values()]
        for t in layout:  # the named stage holds the piece under the named key
            assert t.key in shards[t.stage][0], (t.name, t.key, t.stage)


def _cfg(tp: int, pp: int, ep: int = 1):  # type: ignore[no-untyped-def]
    from ppojob_api.training import TrainerConfig

    par = {"tensor": tp, "pipeline": pp, "expert": ep}
    return TrainerConfig.model_validate(
        {
            "roles": {
                "actor": {"replicas": WORLD, "backend": "megatron", "parallelism": par},
                "critic": {"colocateWithActor": True, "backend": "megatron", "parallelism": par},
                "rollout": {"colocateWithActor": True, "weightSyncBucketMb": BUCKET / 2**20},
            },
            "algorithm": {"advantageEstimator": "gae"},
        }
    )


def _case(
    rank: int, model_dir: str, tp: int, pp: int, critic: bool, ep: int = 1
) -> dict[str, object]:
    import dataclasses
    import types
    from collections import deque

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ppojob_trainer.backends import megatron_sharded
    from ppojob_trainer.backends.megatron_backend import (
        MegatronPolicyTrainer,
        MegatronValueTrainer,
    )
    from ppojob_trainer.distributed import identity
    from ppojob_trainer.workers.host import WorkerHost

    cfg = _cfg(tp, pp, ep)
    shard = identity("actor", rank, WORLD, tp, pp, 1, ep)
    actor = MegatronPolicyTrainer(cfg, Path(model_dir), shard, need_reference=False)
    result: dict[str, object] = {"dp_rank": shard.dp_rank}
    result["before"] = actor.export_weights()  # the whole export of before ({} off its leader)

    streams: list[object] = []  # the streams the backend made (the last one is walked)
    making: list[torch.Tensor] = []  # the tensors of the bucket being made
    peaks: list[int] = []
    weight_stream = megatron_sharded._Sharded.weight_stream
    hf_tensor = megatron_sharded._Sharded._hf_tensor

    def tracked(self, max_bytes):  # type: ignore[no-untyped-def]
        stream = weight_stream(self, max_bytes)
        produce = stream._produce

        def one_bucket(names):  # type: ignore[no-untyped-def]
            try:
                return produce(names)
            finally:
                making.clear()

        stream._produce = one_bucket
        streams.append(stream)
        return stream

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = hf_tensor(self, *args, **kwargs)
        making.append(out)
        held = [*(streams[-1]._current or {}).values(), *making]
        peaks.append(sum(t.numel() * t.element_size() for t in held))
        return out

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("an object collective was called on the stream path")

    gathers: list[int] = []
    all_gather = dist.all_gather

    def counted_gather(*args, **kwargs):  # type: ignore[no-untyped-def]
        gathers.append(1)
        return all_gather(*args, **kwargs)

    saved = {name: getattr(dist, name) for name in OBJECT_COLLECTIVES}
    megatron_sharded._Sharded._hf_tensor = counted
    megatron_sharded._Sharded.weight_stream = tracked
    for name in OBJECT_COLLECTIVES:
        setattr(dist, name, refuse)

    def peak_of(run):  # type: ignore[no-untyped-def]
        peaks.clear()
        out = run()
        return max(peaks), out

    host = WorkerHost.__new__(WorkerHost)
    host.cfg, host.device, host.events = cfg, "cpu", deque()
    host.actor = types.SimpleNamespace(trainer=actor)
    host._weights = host._staged = None

    def stage_all(sync_id: int) -> dict[str, torch.Tensor]:  # what a colocated engine receives
        host.export(sync_id)
        received: dict[str, torch.Tensor] = {}
        for i in range(len(host._exported(sync_id).plan)):
            bucket = host.stage_weight_bucket(sync_id, i)
            received.update((k, v.clone()) for k, v in bucket.tensors())
            del bucket
        host.drop_weights()
        return received

    try:
        # colocated: every worker stages every bucket (its all-gathers counted)
        dist.all_gather = counted_gather
        try:
            result["peak_stream"], result["received"] = peak_of(lambda: stage_all(1))
        finally:
            dist.all_gather = all_gather
        result["all_gathers"] = len(gathers)
        result["pp_rank"] = shard.pp_rank
        # disaggregated: rank 0 streams to its engines, every other worker joins
        if rank == 0:
            result["peak_joined"], result["sent"] = peak_of(lambda: stage_all(2))
        else:
            result["peak_joined"], _ = peak_of(lambda: host.join_export(2))
        result["plan"] = actor.export_weight_stream(BUCKET).plan
        if critic:
            role = dataclasses.replace(shard, role="critic")
            value = MegatronValueTrainer(cfg, Path(model_dir), role)
            result["critic_stream"] = value.export_weight_stream(BUCKET).materialise()
    finally:
        megatron_sharded._Sharded._hf_tensor = hf_tensor
        megatron_sharded._Sharded.weight_stream = weight_stream
        for name, fn in saved.items():
            setattr(dist, name, fn)
    if critic:
        result["critic_before"] = value.export_weights()
    ps.destroy_model_parallel()
    return result


def _worker(rank: int, model_dirs: list[str], port: int, out: str) -> None:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    results = {}
    for model_dir, (family, tp, pp, ep) in zip(model_dirs, CASES, strict=True):
        results[family] = _case(rank, model_dir, tp, pp, family != "qwen2", ep)
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_megatron_sync_streams_bucket_by_bucket_and_sends_the_same_tensors(
    tmp_path: Path,
) -> None:
    pytest.importorskip("megatron.core")
    import torch.multiprocessing as mp

    from ppojob_trainer.distributed import free_port
    from ppojob_trainer.models import build_char_tokenizer

    dirs = []
    for family, *_ in CASES:
        d = tmp_path / family
        _hf_model(family).save_pretrained(d)
        build_char_tokenizer().save_pretrained(d)
        dirs.append(str(d))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.spawn(_worker, args=(dirs, free_port(), str(tmp_path)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + DEADLOCK_S
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:  # a collective some worker never joins
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"the workers did not finish in {DEADLOCK_S} s: a collective deadlocked")

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for family, tp, pp, ep in CASES:
        res = [r[family] for r in ranks]
        before = res[0]["before"]
        model_bytes = sum(v.numel() * v.element_size() for v in before.values())
        largest = max(v.numel() * v.element_size() for v in before.values())
        bound = max(BUCKET, largest)
        r0 = res[0]
        biggest = max(
            sum(before[n].numel() * before[n].element_size() for n in b) for b in r0["plan"]
        )
        print(
            f"{family} tensor {tp} x pipeline {pp} x data {WORLD // (tp * pp)} (expert {ep}): "
            f"model "
            f"{model_bytes} B, bound {bound} B, {len(r0['plan'])} buckets (largest {biggest} B); "
            f"peak held by the stream on rank 0: colocated {r0['peak_stream']} B, disaggregated "
            f"{r0['peak_joined']} B"
        )
        assert len(before) > 20 and 3 * bound < model_bytes  # several buckets: a real bound
        assert all(r["plan"] == r0["plan"] for r in res)  # one plan on every rank
        for rank, r in enumerate(res):
            got = r["received"]
            assert list(got) == list(before), (family, rank)
            for k, v in before.items():
                assert torch.equal(got[k], v), (family, rank, k)
            # one bucket at a time: the largest one, no more
            assert r["peak_stream"] == r["peak_joined"] == biggest <= bound, (family, rank)
        # one all-gather per split megatron tensor of the worker's stage (consecutive HF tensors
        # of one megatron key share it), not one per HF tensor
        from transformers import AutoConfig

        from ppojob_trainer.backends.megatron_convert import ModelShape, hf_layout

        config = AutoConfig.from_pretrained(tmp_path / family)
        layout = hf_layout(ModelShape.from_hf_config(config), pp)
        for rank, r in enumerate(res):
            mine = [t for t in layout if t.stage == r["pp_rank"] and t.split]
            runs = [t for i, t in enumerate(mine) if i == 0 or mine[i - 1].key != t.key]
            assert len(runs) < len(mine)  # fused tensors exist: the check means something
            # a MoE layer's experts: one more all-gather each, over the expert-parallel ranks
            experts = sum(t.kind.startswith("experts") for t in mine) if ep > 1 else 0
            want = (len(runs) if tp > 1 else 0) + experts
            assert r["all_gathers"] == want, (family, rank, r["all_gathers"], len(mine))
        assert list(r0["sent"]) == list(before)
        assert all(torch.equal(r0["sent"][k], v) for k, v in before.items())
        if "critic_stream" in r0:
            critic = r0["critic_before"]
            assert "value_head.weight" in critic
            for r in res:
                assert list(r["critic_stream"]) == list(critic)
                assert all(torch.equal(r["critic_stream"][k], v) for k, v in critic.items())


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")  # conftest: loopback Ray + model cache
@pytest.mark.parametrize("colocated", [True, False])
def test_a_megatron_actor_syncs_its_engines_through_the_stream_on_ray(colocated: bool) -> None:
    """The loop's sync paths with a megatron actor (tensor 2 over two workers) and torch
    engines: colocated (every actor worker exports, each engine loads the buckets its worker
    stages) and on their own workers (the leader broadcasts, the other worker joins each
    bucket's collectives). After a step every engine holds the actor's weights."""
    pytest.importorskip("megatron.core")
    import ray

    from ppojob_api.training import TrainerConfig
    from ppojob_trainer.driver.trainer import PPOTrainer

    rollout = (
        {"colocateWithActor": True} if colocated else {"replicas": 2, "resources": {"cpus": 1}}
    )
    cfg = TrainerConfig.model_validate(
        {
            "roles": {
                "actor": {
                    "replicas": 2,
                    "backend": "megatron",
                    "parallelism": {"tensor": 2},
                    "resources": {"cpus": 1},
                },
                "rollout": {**rollout, "weightSyncBucketMb": 0.1},
            },
            "algorithm": {"advantageEstimator": "grpo"},
            "data": {"rolloutBatchSize": 2, "samplesPerPrompt": 2, "maxResponseLength": 4},
            "training": {"steps": 1, "learningRate": 1e-2, "seed": 5},
        }
    )
    trainer = PPOTrainer(cfg)
    try:
        before = ray.get(trainer.hosts["rollout"][0].rollout_weights.remote())
        trainer.step(0)
        exported = ray.get([h.actor_weights.remote() for h in trainer.hosts["actor"]])
        actor = exported[0]  # the leader's (a collective over both workers)
        engines = ray.get([h.rollout_weights.remote() for h in trainer.hosts["rollout"]])
        assert len(engines) == 2
        assert not _same(before, actor), "the actor did not change: nothing to check"
        assert all(_same(actor, e) for e in engines)
    finally:
        trainer.shutdown()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
