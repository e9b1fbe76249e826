"""The Ray actor process that hosts one worker of one or more roles.

Colocated roles (the actor with a colocated critic and/or rollout) share one process, so on a
small machine the whole job can be a single worker process; roles with their own bundles get
their own processes. The host builds each role's logic, joins the role groups and exposes the
step phases as Ray methods. Tensors leave a host only through ``ray.put`` (the object store);
what the methods return to the driver is refs and float metrics.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import ray
import torch

from ppojob_api.training import TrainerConfig

from ..backends.base import WAKE_AFTER_SYNC, WAKE_FOR_SYNC
from ..backends.weight_sync import WeightStream, broadcast_stream, flatten, init_custom_group
from ..distributed import data_parallel_group, identity, init_role_groups, model_parallel_identity
from ..errors import naming
from ..models import resolve_model_path, set_trust_remote_code
from . import handoff


class WorkerHost:
    """One worker process; ``roles`` maps each hosted role to its (rank, world size)."""

    def __init__(
        self,
        cfg_json: str,
        roles: dict[str, tuple[int, int]],
        rendezvous: tuple[str, int] | None,
        threads: int,
        device: str = "cpu",
        cache_dir: str | None = None,
        one_process: bool = False,
    ) -> None:
        """``one_process``: the run's only worker process (every role reads what another put
        here, so the hand-overs stay in memory: :mod:`.handoff`)."""
        handoff.in_memory(one_process)
        # A failure to start is not raised here (Ray would print the actor's traceback and the
        # driver get an ActorDiedError): ready() reports it as one line naming the field.
        self._start_error: str | None = None
        self.roles = dict(roles)
        self.policy_version = 0
        """The weight sync this process's engine holds (0: the initial weights)."""
        self._offer: tuple[int, list[Any]] | None = None
        """Partial rollout: the newest weights offered (:meth:`offer_weights`), not loaded yet."""
        self._offer_lock = threading.Lock()
        try:
            self._init(cfg_json, roles, rendezvous, threads, device, cache_dir)
        except Exception as exc:
            from ..errors import one_line

            self._start_error = one_line(exc)

    def _init(
        self,
        cfg_json: str,
        roles: dict[str, tuple[int, int]],
        rendezvous: tuple[str, int] | None,
        threads: int,
        device: str,
        cache_dir: str | None,
    ) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        _undo_worker_niceness()
        if cache_dir:  # where built-in models are materialised, as the driver sees it
            os.environ["PPOJOB_CACHE_DIR"] = cache_dir
        torch.set_num_threads(max(1, threads))
        cfg = TrainerConfig.model_validate_json(cfg_json)
        self.cfg = cfg
        seed = cfg.training.seed
        torch.manual_seed(seed)
        self.roles = dict(roles)
        trained = [r for r in roles if r in ("actor", "critic")]
        groups: dict[str, Any] = {}
        if trained:
            rank, world = roles[trained[0]]
            addr, port = rendezvous if rendezvous else ("127.0.0.1", 0)
            backend = "nccl" if device.startswith("cuda") else "gloo"
            groups = init_role_groups(trained, rank, world, addr, port, backend)
        set_trust_remote_code(cfg.model.trust_remote_code)
        self.device = device
        self.events: deque[str] = deque(maxlen=4096)
        """The role and engine calls this process ran, in order (see :meth:`calls`)."""
        self.rollout = self.actor = self.critic = None
        if "actor" in roles:
            from .actor import ActorWorker

            path = resolve_model_path(cfg.model.path, seed)
            shard = model_parallel_identity(cfg, "actor", *roles["actor"])
            group = data_parallel_group(groups.get("actor"), shard)
            try:
                self.actor = ActorWorker(cfg, shard, path, device, group)
            except Exception as exc:  # one line naming the field (see errors.naming)
                raise RuntimeError(naming("model.path", exc, str(path))) from exc
        if "critic" in roles:
            from .critic import CriticWorker

            path = resolve_model_path(cfg.model.critic_path or cfg.model.path, seed)
            if cfg.model.critic_path is not None:
                from ..models import check_critic_tokenizer

                check_critic_tokenizer(resolve_model_path(cfg.model.path, seed), path)
            shard = model_parallel_identity(cfg, "critic", *roles["critic"])
            group = data_parallel_group(groups.get("critic"), shard)
            field = "model.criticPath" if cfg.model.critic_path else "model.path"
            try:
                self.critic = CriticWorker(cfg, shard, path, device, group)
            except Exception as exc:
                raise RuntimeError(naming(field, exc, str(path))) from exc
        self._weights: tuple[int, WeightStream] | None = None
        self._staged: Any = None  # the bucket an engine may still be reading (CUDA IPC)
        self._weight_group: tuple[Any, str] | None = None

    def start_rollout(
        self,
        visible_devices: list[str] | None = None,
        reward_workers: list[Any] | None = None,
        sandbox_workers: list[Any] | None = None,
    ) -> str | None:
        """Start the generation engine of the hosted rollout slot (after :meth:`ready`, so that
        a colocated engine spanning several GPUs knows its bundle's GPUs: ``visible_devices``,
        this process's own first). ``reward_workers``: the handles of the reward workers
        (``roles.reward``) that score the model sources; ``sandbox_workers``: those of the
        sandbox workers (``roles.sandbox``) that run data.agent's tool calls. Returns None,
        or one line naming the field and the cause when it cannot start (as :meth:`ready`
        does)."""
        if "rollout" not in self.roles:
            return None
        _fault_gate("start")
        from .rollout import RolloutWorker

        path = None
        try:
            path = resolve_model_path(self.cfg.model.path, self.cfg.training.seed)
            shard = identity("rollout", *self.roles["rollout"])
            self.rollout = RolloutWorker(
                self.cfg,
                shard,
                path,
                self.device,
                visible_devices,
                reward_workers,
                sandbox_workers,
            )
        except Exception as exc:
            return naming("model.path", exc, str(path) if path is not None else self.cfg.model.path)
        self.rollout.engine = RecordedEngine(self.rollout.engine, self.events)
        return None

    def set_reward_workers(self, workers: list[Any]) -> None:
        """``roles.reward``: the reward workers this engine's model sources score on from now on
        (the trainer replaced lost ones)."""
        if self.rollout is not None:
            self.rollout.scorer.set_reward_workers(workers)

    def _hang_gate(self, role: str, phase: str) -> None:
        """Tests only (:data:`HANG_GATE_ENV`): block for ever (or for the gate's seconds) when
        this process is the gate's rank of ``role`` entering ``phase``."""
        gates = os.environ.get(HANG_GATE_ENV)
        if not gates or role not in self.roles:
            return
        for gate in gates.split(","):
            want_role, want_rank, rest = gate.split(":", 2)
            want_phase, _, seconds = rest.partition(":")
            if (want_role, int(want_rank), want_phase) == (role, self.roles[role][0], phase):
                break
        else:
            return
        if seconds:  # a slow step, of a known length
            self.events.append(f"slow.{role}.{phase}")
            time.sleep(float(seconds))
            return
        self.events.append(f"hang.{role}.{phase}")
        threading.Event().wait()  # never set: the stall watchdog must name this rank

    def handoffs(self) -> tuple[str, int]:
        """How this process hands objects to its other roles (``memory`` or ``store``) and how
        many it holds in memory now (:mod:`.handoff`)."""
        return handoff.mode(), handoff.held()

    def calls(self) -> list[str]:
        """The calls this process ran so far, oldest first (``engine.generate``,
        ``engine.release_memory``, ``actor.train``...): the order of a step, checked by tests."""
        return list(self.events)

    def ready(self) -> dict[str, Any]:
        """Shard identities of the hosted roles (as plain dicts) and the pid; or, when the worker
        could not start, ``{"error": one line naming the field and the cause, "roles": [...]}``."""
        if self._start_error is not None:
            return {"error": self._start_error, "roles": sorted(self.roles)}
        out: dict[str, Any] = {"pid": os.getpid(), "threads": torch.get_num_threads()}
        out["gpus"] = [str(g) for g in ray.get_gpu_ids()]
        for name in ("rollout", "actor", "critic"):
            if name in self.roles:
                role = getattr(self, name, None)  # the rollout starts later (start_rollout)
                shard = role.shard if role is not None else identity(name, *self.roles[name])
                out[name] = shard.__dict__
        return out

    # ---- step phases -------------------------------------------------------------------------
    def generate(self, examples: list[Any], first_sample: int, seed: int) -> dict[str, Any]:
        self._hang_gate("rollout", "generate")
        batch, out = self._generate(examples, first_sample, seed)
        return {"batch": handoff.put(batch), **out}

    def _generate(
        self, examples: list[Any], first_sample: int, seed: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        t0, wall0 = time.perf_counter(), time.time()
        partial = self.cfg.algorithm.partial_rollout
        if partial:  # weights offered since the last generation, before it starts
            self._load_offer()
        version = self.policy_version  # (the oldest of its tokens')
        batch, metrics = self.rollout.generate(
            examples,
            first_sample,
            seed,
            version=version,
            **({"interrupt": self._interrupt(first_sample, seed)} if partial else {}),
        )
        if partial:  # samples whose tokens came from more than one policy version
            mask = batch["response_mask"].bool()
            top = batch["versions"].masked_fill(~mask, -1).amax(1)
            low = batch["versions"].masked_fill(~mask, 2**31 - 1).amin(1)
            metrics["switched_sum"] = float((top > low).sum())
        metrics["time/generate"] = time.perf_counter() - t0
        # (wall-clock span and version: the driver measures generation/training overlap)
        span = (wall0, time.time())
        from ..algorithms.dapo import informative_groups

        return batch, {
            "metrics": metrics,
            "span": span,
            "version": version,
            # (group ids, and those whose rewards differ: dynamic sampling's filter)
            "groups": batch["group_ids"].unique_consecutive().tolist(),
            "informative": informative_groups(batch["scores"], batch["group_ids"]),
        }

    @ray.method(num_returns=2)
    def generate_elastic(
        self, examples: list[Any], first_sample: int, seed: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """:meth:`generate` for elastic engines: (the batch, the rest of the result) as two
        return values, both owned by the caller (the driver), so an engine lost after
        generating does not take their refs with it (one this process put would die with it).
        A batch above Ray's inline size stays in this node's object store until the actor
        workers fetch it: lost with the node before then (docs/trainer-guide.md)."""
        _fault_gate(
            "generate",
            first_sample=first_sample,
            prompts=[e.prompt for e in examples],
            version=self.policy_version,
            checksum=self.engine_checksum(),
        )
        return self._generate(examples, first_sample, seed)

    def publish_weights(self, sync_id: int) -> list[Any]:
        """Elastic engines' sync, on the actor's leader: the actor's weights of sync ``sync_id``
        put in the object store bucket by bucket (refs, on the CPU), for any number of engines,
        including one started after the others."""
        stream = self._exported(sync_id)
        refs = [ray.put(flatten(stream.bucket(i).items(), "cpu")) for i in range(len(stream.plan))]
        self.drop_weights()
        return refs

    def load_weights(self, sync_id: int, buckets: list[Any]) -> dict[str, float]:
        """An elastic engine takes the weights :meth:`publish_weights` put (``buckets``: their
        refs); it then holds policy ``sync_id``. Returns seconds and that version
        (:func:`synced`)."""
        t0 = time.perf_counter()
        engine = self.rollout.engine
        engine.begin_weight_update()
        for i, ref in enumerate(buckets):
            engine.update_weights_from_tensor([ray.get(ref)], flush_cache=i == len(buckets) - 1)
        engine.end_weight_update()
        self.policy_version = int(sync_id)
        return synced(time.perf_counter() - t0, self.policy_version)

    def offer_weights(self, sync_id: int, buckets: list[Any]) -> float:
        """Partial rollout (``algorithm.partialRollout``): the weights :meth:`publish_weights`
        put for sync ``sync_id``, offered to this engine. The driver calls it in the ``sync``
        concurrency group, so it runs beside a generation in progress, which loads them between
        two tokens (:meth:`_take_offer`) and samples the rest from them; otherwise the next
        generation loads them first. A newer offer replaces one not loaded yet. Returns 0.0 (no
        wait: the load happens in the engine's own time)."""
        with self._offer_lock:
            if self._offer is None or self._offer[0] < int(sync_id):
                self._offer = (int(sync_id), list(buckets))
        return 0.0

    def _take_offer(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The offered weights (version, name -> tensor), once; None when none is waiting."""
        with self._offer_lock:
            offer, self._offer = self._offer, None
        if offer is None:
            return None
        sync_id, buckets = offer
        weights: dict[str, torch.Tensor] = {}
        for ref in buckets:
            weights.update(ray.get(ref).tensors())
        self.policy_version = sync_id
        return sync_id, weights

    def _interrupt(self, first_sample: int, seed: int) -> Any:
        """The hook a partial-rollout generation asks between two tokens (:meth:`_take_offer`;
        with the tests' fault gate set, the gate first hears of each token)."""
        gated = bool(os.environ.get(FAULT_GATE_ENV))

        def between_tokens() -> tuple[int, dict[str, torch.Tensor]] | None:
            if gated:
                info = {"first_sample": first_sample, "seed": seed, "version": self.policy_version}
                _fault_gate("token", **info)
            return self._take_offer()

        return between_tokens

    def _load_offer(self) -> None:
        """Load offered weights now (before a generation, an evaluation or a test's read)."""
        offer = self._take_offer()
        if offer is not None:
            self.rollout.engine.update_weights(offer[1])

    def engine_checksum(self) -> float | None:
        """A checksum of the torch engine's weights (the sum of every value, in float64), or
        None without one; for the fault-injection tests only (None when none is set up)."""
        if not os.environ.get(FAULT_GATE_ENV):
            return None
        model = getattr(getattr(self.rollout.engine, "inner", None), "model", None)
        if model is None:
            return None
        return float(sum(float(t.double().sum()) for t in model.state_dict().values()))

    def select_groups(
        self, first_sample: int, picks: list[tuple[int, int, bool]], *gens: Any
    ) -> dict[str, Any]:
        """Dynamic sampling: one rollout part of the step from the picked groups of this
        engine's generation rounds ``gens`` (``picks``: index into ``gens``, group id, in the
        loss), numbered from ``first_sample``."""
        from .rollout import select_groups

        batches = [handoff.get(g["batch"]) for g in gens]
        k = self.cfg.data.samples_per_prompt
        batch = select_groups(batches, picks, first_sample, k)
        # (the loop reports the rewards of every generated sample, not these picked ones)
        metrics = {"n": float(batch["response_ids"].shape[0])}
        return {
            "batch": handoff.put(batch),
            "metrics": metrics,
            "span": (min(g["span"][0] for g in gens), max(g["span"][1] for g in gens)),
            "version": min(g["version"] for g in gens),
        }

    def evaluate(self, examples: list[Any]) -> dict[str, float]:
        _fault_gate("evaluate", prompts=[e.prompt for e in examples])
        self._hang_gate("rollout", "evaluate")
        if self.cfg.algorithm.partial_rollout:
            self._load_offer()
        return self.rollout.evaluate(examples)

    # Results of earlier phases arrive as top-level arguments, which Ray resolves before the call
    # (the driver inlines these small dicts of refs); only the tensors they name are fetched here.
    def compute_values(
        self, ranges: list[tuple[int, int]], actor_ranges: list[tuple[int, int]], *gens: Any
    ) -> list[Any]:
        self.events.append("critic.values")
        self._hang_gate("critic", "values")
        self.work_start = time.time()  # this step's training-side work starts
        t0 = time.perf_counter()
        refs = self.critic.compute_values(_parts(ranges, gens), actor_ranges)
        self.values_s = time.perf_counter() - t0
        return refs

    def prepare(
        self,
        ranges: list[tuple[int, int]],
        critic_ranges: list[tuple[int, int]] | None,
        kl_coef: float,
        *gens_then_values: Any,
        policy_version: int = 0,
        value_refs: list[Any] | None = None,
    ) -> tuple[list[Any] | None, dict[str, float]]:
        """``gens_then_values``: the rollout results (one per range), then each critic
        worker's list of value refs (none without a critic). ``policy_version``: the actor's
        (its weights were last synced as this version). ``value_refs``: instead of those
        lists, the refs of the critic workers' ``compute_values`` calls (nested in a list, so
        Ray does not wait for them before this call: the actor fetches them once its log-probs
        are computed)."""
        self.events.append("actor.prepare")
        t0 = time.perf_counter()
        start = time.time()
        # (the step's training-side work started with the values, when this process has them)
        self.train_start = min(getattr(self, "work_start", None) or start, start)
        self.work_start = None
        gens, values = gens_then_values[: len(ranges)], gens_then_values[len(ranges) :]
        if value_refs is not None:
            values = tuple(value_refs)
        refs, metrics = self.actor.prepare(
            _parts(ranges, gens),
            list(values) if critic_ranges else None,
            critic_ranges,
            kl_coef,
            policy_version=policy_version,
        )
        metrics["time/prepare"] = time.perf_counter() - t0
        metrics["span/start"] = self.train_start
        metrics["span/end"] = time.time()
        return refs, metrics

    def train_critic(
        self, step: int, actor_ranges: list[tuple[int, int]], updates: int, *prepared: Any
    ) -> dict[str, float]:
        self.events.append("critic.train")
        self._hang_gate("critic", "train")
        t0 = time.perf_counter()
        metrics = self.critic.train(step, list(prepared), actor_ranges, updates)
        metrics["time/train_critic"] = time.perf_counter() - t0
        metrics["time/values"] = getattr(self, "values_s", 0.0)
        metrics["span/end"] = time.time()
        return metrics

    def train_actor(self, step: int) -> dict[str, float]:
        self.events.append("actor.train")
        self._hang_gate("actor", "train")
        t0 = time.perf_counter()
        metrics = self.actor.train(step)
        metrics["time/train_actor"] = time.perf_counter() - t0
        metrics["span/end"] = time.time()
        return metrics

    # ---- colocated engines: sleep and wake -----------------------------------------------------
    def release_memory(self) -> None:
        """Free the engine's weights and KV cache for training (``offload``)."""
        self._hang_gate("rollout", "release memory")
        self.rollout.engine.release_memory()

    def empty_cache(self) -> None:
        """Give the blocks this process's CUDA allocator caches (training's activations and
        gradients, a sync's buckets) back to the driver, so a waking engine can take them."""
        self.events.append("cuda.empty_cache")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def resume_memory(self, *after: Any) -> None:
        """Wake the engine's weights only (the weight sync follows; its KV cache and CUDA graphs
        wake after the sync, :meth:`sync_colocated`); ``after``: refs of the training calls that
        must have finished first on every GPU the engine spans (Ray resolves them before the
        call). The order is verl's: empty cache -> weights -> sync -> empty cache -> KV cache."""
        self.empty_cache()
        self.rollout.engine.resume_memory(WAKE_FOR_SYNC)

    # ---- weight sync ---------------------------------------------------------------------------
    def _exported(self, sync_id: int) -> WeightStream:
        """The actor's weights for sync ``sync_id``, bucket by bucket (one stream per sync: a
        sharded backend gathers each bucket when it is staged, so no worker holds the model)."""
        if self._weights is None or self._weights[0] != sync_id:
            limit = int(self.cfg.roles.rollout.weight_sync_bucket_mb * 2**20)
            if self.cfg.model.lora is not None and self.cfg.roles.rollout.backend == "sglang":
                from ..backends.sglang_backend import peft_adapter_tensors

                # SGLang loads an adapter in one call: PEFT names, one bucket
                weights = peft_adapter_tensors(self.actor.trainer.export_weights())
                stream = WeightStream.of(weights, plan=[list(weights)] if weights else [])
            else:
                stream = self.actor.trainer.export_weight_stream(limit)
                if self.cfg.roles.rollout.backend == "sglang":
                    stream = self._sglang_names(stream)
            self._weights = (sync_id, stream)
        return self._weights[1]

    def _sglang_names(self, stream: WeightStream) -> WeightStream:
        """``stream`` with each bucket under SGLang's names (a MoE model's experts one tensor
        each: :func:`~..backends.sglang_backend.sglang_weight_names`); the same buckets."""
        from ..backends.sglang_backend import sglang_weight_names

        model_type = self._model_type()
        if model_type is None:
            return stream
        return stream.mapped(lambda bucket: sglang_weight_names(model_type, bucket))

    def _model_type(self) -> str | None:
        """The actor's Hugging Face ``model_type`` when it is a MoE type whose names SGLang
        takes per expert, else None."""
        from ..backends.sglang_backend import SGLANG_EXPERT_NAMES

        config = getattr(getattr(self.actor.trainer, "lm", None), "config", None)
        if config is None:  # the megatron actor: its shape's family is the model type
            shape = getattr(getattr(self.actor.trainer, "m", None), "shape", None)
            kind = getattr(shape, "family", None)
        else:
            kind = getattr(config, "model_type", None)
        return kind if kind in SGLANG_EXPERT_NAMES else None

    def stage_weight_bucket(self, sync_id: int, index: int) -> Any:
        """Bucket ``index`` of this process's copy of the actor's weights, on its device, as the
        engine takes it from this process: the bucket itself (an engine in this process), or a
        serialized CUDA IPC handle for sglang. Kept alive until the next bucket is staged or
        the sync ends (:meth:`_release_staged`), both after the engine's call for it returned."""
        stream = self._exported(sync_id)
        self._release_staged()  # the engine's call for the previous bucket has returned
        bucket = flatten(stream.bucket(index).items(), self.device)
        if self.cfg.roles.rollout.backend == "sglang":
            from ..backends.sglang_backend import serialize_bucket

            self._staged = bucket
            return serialize_bucket(bucket)
        return bucket

    def export(self, sync_id: int) -> float:
        """Start the export of the actor's weights for sync ``sync_id`` (its buckets are made
        as they are staged); every actor worker calls it before any sync asks for a bucket.
        Returns seconds."""
        t0 = time.perf_counter()
        self._exported(sync_id)
        return time.perf_counter() - t0

    def join_export(self, sync_id: int) -> float:
        """An actor worker outside the sync joins the export when it is a collective (FSDP's
        gathers, megatron's tensor and pipeline collectives); returns its seconds."""
        t0 = time.perf_counter()
        if self.actor.trainer.export_is_collective:
            self._exported(sync_id).drain()  # every bucket's gather, one bucket held at a time
            self.drop_weights()
        return time.perf_counter() - t0

    def drop_weights(self) -> None:
        """Forget the exported weights and the last staged bucket (the sync is over)."""
        self._weights = None
        self._release_staged()

    def _release_staged(self) -> None:
        """Let go of the staged bucket once the engine's call that read it has returned.

        SGLang's ``update_weights_from_tensor`` returns once its scheduler has *queued* the
        copies out of our CUDA IPC memory (``load_weights``, then a CPU barrier: no device
        synchronisation). torch keeps such a block out of the allocator while the engine holds
        the handle (its receiver synchronises its stream before releasing it), but a block
        freed here while a release is pending waits in torch's IPC limbo, where neither the
        next bucket nor ``empty_cache`` before the KV cache wakes can take it. So: drop our
        reference only now, finish this process's own device work on the bucket
        (``synchronize``), and collect the released IPC blocks (``ipc_collect``), so the next
        bucket never lands on memory still being read and the sync holds one bucket at most."""
        if self._staged is None:
            return
        self._staged = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.ipc_collect()

    def sync_colocated(self, sync_id: int, peers: list[Any]) -> dict[str, float]:
        """Colocated sync, on the engine's process: bucket by bucket, this process and its
        ``peers`` (the other processes on the engine's GPUs, in tensor-parallel rank order) each
        stage the bucket on their GPU and the engine loads all of them at once."""
        t0 = time.perf_counter()
        stream = self._exported(sync_id)
        if not stream:
            raise RuntimeError("colocated weight sync: this actor worker exported no weights")
        engine = self.rollout.engine
        engine.begin_weight_update()
        n = len(stream.plan)
        for i in range(n):
            refs = [p.stage_weight_bucket.remote(sync_id, i) for p in peers]
            payloads = [self.stage_weight_bucket(sync_id, i), *ray.get(refs)]
            engine.update_weights_from_tensor(payloads, flush_cache=i == n - 1)
        engine.end_weight_update()
        self.policy_version = sync_id
        ray.get([p.drop_weights.remote() for p in peers])
        self.drop_weights()
        rollout = self.cfg.roles.rollout
        if rollout.releases_memory:  # the rest of the engine wakes
            self.empty_cache()
            engine.resume_memory(WAKE_AFTER_SYNC)
        return synced(time.perf_counter() - t0, self.policy_version)

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a port free on it (for a group's rendezvous here)."""
        from ..distributed import rendezvous_port

        host = ray.util.get_node_ip_address()
        return host, rendezvous_port(host)

    def close(self) -> None:
        """Stop the engine's own processes (SGLang's scheduler and detokenizer)."""
        rollout = getattr(self, "rollout", None)  # None too when the host failed to start
        inner = getattr(rollout.engine, "inner", None) if rollout is not None else None
        if inner is not None and hasattr(inner, "shutdown"):
            inner.shutdown()

    def init_weight_sender(
        self, address: str, port: int, world_size: int, group_name: str, backend: str
    ) -> None:
        """Join the weight-update group as rank 0 (the actor's data-parallel leader)."""
        group = init_custom_group(backend, address, port, world_size, 0, group_name)
        self._weight_group = (group, backend)

    def broadcast_weights(
        self, sync_id: int, engines: list[Any], group_name: str
    ) -> dict[str, float]:
        """Disaggregated sync, on the actor's leader: per bucket, every engine starts receiving
        (``update_weights_from_distributed``) and this process broadcasts the bucket packed in
        SGLang's ``flattened_bucket`` layout, one collective per bucket
        (:func:`~..backends.weight_sync.broadcast_stream`)."""
        group, backend = self._weight_group
        device = self.device if backend == "nccl" else "cpu"
        stream = self._exported(sync_id)
        ray.get([e.begin_weight_update.remote() for e in engines])

        def receive(names: list[str], dtypes: list[str], shapes: list[list[int]], last: bool):
            return [
                e.receive_weights.remote(names, dtypes, shapes, group_name, last) for e in engines
            ]

        stats = broadcast_stream(stream, group, device, receive, ray.get)
        held = ray.get([e.end_weight_update.remote(sync_id) for e in engines])
        self.drop_weights()
        self.last_send = stats
        wrong = [(i, v) for i, v in enumerate(held) if v != sync_id]
        if wrong:
            raise RuntimeError(f"weight sync {sync_id}: engines report other versions: {wrong}")
        return synced(stats.seconds, sync_id)

    def init_weights_update_group(
        self,
        address: str,
        port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join the weight-update group as ranks ``rank_offset ..`` (the engine's TP ranks)."""
        self.rollout.engine.init_weights_update_group(
            address, port, rank_offset, world_size, group_name, backend
        )

    def begin_weight_update(self) -> None:
        """Open the engine's weight-update session (before the first bucket of a sync)."""
        self.rollout.engine.begin_weight_update()

    def end_weight_update(self, version: int | None = None) -> int:
        """Close it (after the last bucket); the engine now holds policy ``version`` (the sync's
        number; the next one when not given), which it reports back."""
        self.rollout.engine.end_weight_update()
        self.policy_version = self.policy_version + 1 if version is None else int(version)
        return self.policy_version

    def receive_weights(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        flush_cache: bool,
    ) -> None:
        self.rollout.engine.update_weights_from_distributed(
            names, dtypes, shapes, group_name=group_name, flush_cache=flush_cache
        )

    # ---- checkpoints and inspection ----------------------------------------------------------
    def get_state(self, role: str) -> dict[str, Any]:
        return getattr(self, role).trainer.state_dict()

    def set_state(self, role: str, state: dict[str, Any]) -> None:
        getattr(self, role).trainer.load_state_dict(state)

    def rng_state(self) -> dict[str, Any]:
        """This process's Python, numpy and torch (CPU and CUDA) generator states."""
        from ..checkpoint import capture_rng_state

        return capture_rng_state()

    def set_rng_state(self, state: dict[str, Any]) -> None:
        from ..checkpoint import restore_rng_state

        restore_rng_state(state)

    def save_checkpoint(self, role: str, directory: str) -> None:
        """Write this worker's shard of ``role``'s training state into ``directory`` (shared by
        the role's workers; the driver only passes the path)."""
        self._hang_gate(role, "save checkpoint")
        worker = getattr(self, role)
        worker.trainer.save_checkpoint(Path(directory), worker.shard)

    def load_checkpoint(self, role: str, directory: str) -> None:
        worker = getattr(self, role)
        worker.trainer.load_checkpoint(Path(directory), worker.shard)

    def export_pretrained(self, role: str, directory: str) -> None:
        """Hugging Face export of ``role``'s model (the leader writes; every worker of a sharded
        role takes part in the gather)."""
        worker = getattr(self, role)
        worker.trainer.export_pretrained(Path(directory), worker.shard)

    def received_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sample indices, values) the actor received at the last step (tests only)."""
        return self.actor.batch["sample_idx"], self.actor.received_values

    def trained_ids(self) -> tuple[list[int], list[int]]:
        """(sample numbers, group ids) of the actor's samples of the last step (tests only)."""
        batch = self.actor.batch
        return batch["sample_idx"].tolist(), batch["group_ids"].tolist()

    def rollout_weights(self) -> dict[str, torch.Tensor]:
        """The torch engine's current weights (tests only)."""
        if self.cfg.algorithm.partial_rollout:
            self._load_offer()
        return {
            k: v.detach().cpu().clone()
            for k, v in self.rollout.engine.inner.model.state_dict().items()
        }

    def actor_weights(self) -> dict[str, torch.Tensor]:
        """The actor's current weights (tests only)."""
        return self.actor.trainer.export_weights()

    def computed_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sample indices, values) the critic computed at the last step (tests only)."""
        return self.critic.batch["sample_idx"], self.critic.batch["old_values"]


def synced(seconds: float, version: int) -> dict[str, float]:
    """What an engine's side of a weight sync returns to the driver: its seconds, and the policy
    version the engine now holds (the driver reads it back, :meth:`.WeightSync.durations`)."""
    return {"seconds": float(seconds), "version": int(version)}


HANG_GATE_ENV = "PPOJOB_HANG_GATE"
"""Fault injection for tests: ``role:rank:phase`` (e.g. ``actor:1:train``; phases generate,
evaluate, values, train, release memory, save checkpoint): that rank of that role blocks for ever on
entering that phase, inside a real step; ``role:rank:phase:seconds`` (``actor:0:train:15``): it
sleeps that long there, every step (steps of a known length, as a GPU job's are long); several
gates, comma-separated. Unset (always, outside tests): nothing."""

FAULT_GATE_ENV = "PPOJOB_ROLLOUT_FAULT_GATE"
"""Fault injection for tests: the name of a Ray actor that an engine's process asks before it
starts, before each elastic generation, before each evaluation and, with partial rollout,
between two tokens (``gate.arrive(event, this actor, info)``) and waits for; the tests' gate
may kill the engine or hold it right there. Unset (always, outside tests): nothing."""


def _fault_gate(event: str, **info: Any) -> None:
    name = os.environ.get(FAULT_GATE_ENV)
    if not name:
        return
    gate = ray.get_actor(name)
    ray.get(gate.arrive.remote(event, ray.get_runtime_context().current_actor, info))


def _undo_worker_niceness() -> None:
    """Ray starts workers with a raised niceness so its own daemons stay responsive; the workers
    are this job's compute, so they run at the driver's priority when the OS allows it."""
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)
        target = os.getpriority(os.PRIO_PROCESS, os.getppid())
        if current > target:
            os.setpriority(os.PRIO_PROCESS, 0, target)
    except (OSError, AttributeError):  # not permitted (unprivileged container) or not POSIX
        pass


def _parts(ranges: list[tuple[int, int]], gens: Any) -> list[tuple[int, int, Any]]:
    return [(int(a), int(b), g["batch"]) for (a, b), g in zip(ranges, gens, strict=True)]


class RecordedEngine:
    """A generation engine whose calls are appended to its process's call log (``engine.<name>``,
    with the memory tags of a wake: ``engine.resume_memory(weights)``) before they run: the
    order tests check, and what a stuck job's last calls were."""

    def __init__(self, engine: Any, log: deque[str]) -> None:
        self.inner = engine
        self.log = log

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if not callable(value) or name.startswith("_"):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            tags = kwargs.get("tags", args[0] if args and name == "resume_memory" else None)
            self.log.append(f"engine.{name}" + (f"({','.join(tags)})" if tags else ""))
            return value(*args, **kwargs)

        return call


RemoteWorkerHost = ray.remote(WorkerHost)
PartialRolloutHost = ray.remote(concurrency_groups={"sync": 1})(WorkerHost)
"""A rollout engine's process with partial rollout: its calls run one at a time, in order, in
Ray's default concurrency group, and :meth:`WorkerHost.offer_weights` in a ``sync`` group of
one thread beside them (Ray takes concurrency groups only where the actor class is defined)."""
