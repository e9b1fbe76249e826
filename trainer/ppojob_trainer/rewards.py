"""Reward sources and their weighted sum (``data.rewards``).

A step's reward of a sample is ``sum_i weight_i x r_i``, over the sources of ``data.rewards``:

``function``  a reward function (``module:function`` or ``builtin:<task>``), as
              ``data.rewardFunction`` (:class:`ppojob_trainer.tasks.RewardScorer`)
``model``     a Hugging Face sequence-classification reward model with one output
              (:class:`RewardModelScorer`), held by the rollout engine's process, on its device;
              with ``roles.reward`` held by the reward workers instead
              (:class:`~ppojob_trainer.workers.reward.RewardHost`), which the engine asks
              (:class:`RemoteRewardModelScorer`)
``http``      a remote endpoint (:class:`HttpRewardScorer`): POST ``{"prompts", "completions",
              "labels"}`` -> ``{"rewards": [...]}``
``judge``     a generative judge (:class:`JudgeScorer`): a causal LM on a rollout engine (the
              policy's own, or one loaded for it) asked with a template, its score parsed with
              a regular expression

``data.rewardFunction`` (or, unset, the built-in task's reward) is the shorthand of one function
source of weight 1. Every scorer returns one finite float per sample, or raises a one-line
``ValueError`` naming its field (``data.rewards[1].http.url: ...``).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppojob_api.training import (
    DataSpec,
    HttpRewardSource,
    JudgeRewardSource,
    RewardModelSource,
)

from .tasks import RewardScorer

Scorer = Callable[[list[str], list[str], list[Any]], list[float]]


def shown_url(url: str) -> str:
    """``url`` as messages show it: without the credentials it may hold (``user:password@``
    is dropped, each query value is ``***``)."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    query = "&".join(
        f"{k}=***" if sep else k
        for k, sep, _ in (q.partition("=") for q in parts.query.split("&") if q)
    )
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def retried(status: int) -> bool:
    """Whether an HTTP answer is worth another attempt: 408, 429 and 5xx (the endpoint is busy,
    restarting or failing for now)."""
    return status in (408, 429) or status >= 500


class RewardModelScorer:
    """A sequence-classification reward model (``num_labels=1``) scoring ``prompt +
    completion``, in batches of ``batchSize``, on ``device``. Texts longer than ``maxLength``
    tokens lose their beginning."""

    def __init__(
        self, spec: RewardModelSource, field: str, device: str, default_dtype: str
    ) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        from .models import HF_MODEL_OPTIONS, quiet_transformers, torch_dtype, trust_remote_code

        self.field = field
        where = f"{field}.path: {spec.path!r}"
        path = Path(spec.path).expanduser()
        if not path.is_dir():
            raise ValueError(
                f"{where} is not a directory here (relative to {os.getcwd()}); give the "
                "directory of a reward model saved with save_pretrained, in the trainer image "
                "or a volume"
            )
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{where} holds no config.json, so it is not a Hugging Face model directory "
                "(write one with save_pretrained)"
            )
        quiet_transformers()
        remote = trust_remote_code()
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=remote)
        archs = list(getattr(config, "architectures", None) or [])
        if not any(a.endswith("ForSequenceClassification") for a in archs):
            raise ValueError(
                f"{where} is not a sequence-classification model (architectures: {archs}); a "
                "reward model is saved from AutoModelForSequenceClassification with num_labels=1"
            )
        if config.num_labels != 1:
            raise ValueError(
                f"{where} has {config.num_labels} outputs (num_labels); a reward model has one "
                "(save it with num_labels=1)"
            )
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=remote)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
        if tok.pad_token is None:
            raise ValueError(
                f"{where}: its tokenizer has no pad, EOS or unknown token to pad batches with; "
                "save the tokenizer with a pad token"
            )
        tok.truncation_side = "left"  # the score is read at the end of the text: keep it
        model = AutoModelForSequenceClassification.from_pretrained(
            str(path),
            dtype=torch_dtype(spec.dtype or default_dtype),
            trust_remote_code=remote,
            **HF_MODEL_OPTIONS,  # no Hub kernels (models.HF_MODEL_OPTIONS)
        )
        if model.config.pad_token_id is None:  # it finds each row's last token by the pad id
            model.config.pad_token_id = tok.pad_token_id
        self.device = "cpu" if spec.device == "cpu" else device
        self.model = model.to(self.device).eval()
        self.tokenizer = tok
        self.batch_size = spec.batch_size
        self.max_length = spec.max_length
        self._torch = torch

    def __call__(
        self, prompts: list[str], completions: list[str], labels: list[Any]
    ) -> list[float]:
        torch = self._torch
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        out: list[float] = []
        with torch.inference_mode():
            for lo in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(
                    texts[lo : lo + self.batch_size],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                ).to(self.device)
                logits = self.model(
                    input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]
                ).logits
                out += logits[:, 0].float().cpu().tolist()
        bad = next((i for i, v in enumerate(out) if not math.isfinite(v)), None)
        if bad is not None:
            raise ValueError(
                f"{self.field}.path: the reward model scored sample {bad} {out[bad]} (not "
                "finite); check its weights and dtype (float16 overflows easily)"
            )
        return out


def reward_parts(n: int, workers: int, first: int = 0) -> list[tuple[int, int, int]]:
    """How ``n`` samples are split over ``workers`` reward workers: ``(worker, lo, hi)``, one
    contiguous near-equal part per worker (fewer parts when ``n < workers``), the parts handed
    to the workers from ``first`` on (an engine's rank: engines with few samples then use
    different workers)."""
    if workers < 1:
        raise ValueError(f"reward_parts: {workers} reward workers")
    parts = min(n, workers)
    out = []
    for k in range(parts):
        base, extra = divmod(n, parts)
        lo = k * base + min(k, extra)
        hi = lo + base + (1 if k < extra else 0)
        out.append(((first + k) % workers, lo, hi))
    return out


class RemoteRewardModelScorer:
    """A model source scored on the reward workers (``roles.reward``): the engine splits its
    samples with :func:`reward_parts`, sends each part's prompt and completion strings to its
    worker by an actor call (all parts at once, straight from the engine's process, never
    through the driver), and joins the answers in order. Labels are not sent (a reward model
    reads the text only).

    A worker lost mid-call (its process died: killed, OOMKilled, its pod gone) is dropped for
    good (later calls split over the workers left) and its part is sent again to the workers
    left, cut at its ``batch_size`` batches (:meth:`resplit`): each worker scores the same
    batches as the lost one would have, so the scores are those of an undisturbed call. Only
    when no worker is left does the call fail, with one line naming roles.reward."""

    def __init__(
        self,
        workers: Sequence[Any],
        source: int,
        field: str,
        first: int = 0,
        batch_size: int = 1,
    ) -> None:
        if not workers:
            raise ValueError(f"{field}: roles.reward is set, but no reward worker is running")
        self.workers = list(workers)
        self.started = len(self.workers)
        self.source = source
        self.field = field
        self.first = first
        self.batch_size = max(1, batch_size)
        self.lost = 0
        """Reward workers found lost so far (by this engine)."""
        self.last_remote = 0
        """Samples the reward workers scored in the latest call (``reward/<name>_remote``)."""
        self.last_resent = 0
        """Samples sent again in the latest call, their worker lost (``reward/<name>_resent``)."""

    def resplit(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Samples ``lo:hi`` (a lost worker's part) over the workers left: ``(worker, lo,
        hi)``, cut only at the part's own batch boundaries (``lo + m x batch_size``)."""
        size = self.batch_size
        chunks = -(-(hi - lo) // size)
        return [
            (w, lo + a * size, min(lo + b * size, hi))
            for w, a, b in reward_parts(chunks, len(self.workers), self.first)
        ]

    def __call__(
        self, prompts: list[str], completions: list[str], labels: list[Any]
    ) -> list[float]:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        from .errors import one_line

        parts = [
            (self.workers[w], lo, hi)
            for w, lo, hi in reward_parts(len(prompts), len(self.workers), self.first)
        ]
        got: dict[int, list[float]] = {}
        resent = 0
        while parts:
            refs = [
                h.score.remote(self.source, prompts[lo:hi], completions[lo:hi])
                for h, lo, hi in parts
            ]
            lost = []
            for (h, lo, hi), ref in zip(parts, refs, strict=True):
                try:
                    answer = ray.get(ref)
                except RayTaskError as exc:  # the worker's own one-line error (names the field)
                    raise ValueError(one_line(exc.cause) if exc.cause else one_line(exc)) from None
                except RayActorError:  # its process is gone: its part goes elsewhere
                    lost.append((h, lo, hi))
                    continue
                if len(answer) != hi - lo:
                    raise ValueError(
                        f"{self.field}: a reward worker answered {len(answer)} of {hi - lo}"
                    )
                got[lo] = answer
            if not lost:
                break
            self._drop([h for h, _, _ in lost])
            parts = []
            for _, lo, hi in lost:
                resent += hi - lo
                parts += [(self.workers[w], a, b) for w, a, b in self.resplit(lo, hi)]
        out = [v for lo in sorted(got) for v in got[lo]]
        self.last_remote = len(out)
        self.last_resent = resent
        return out

    def _drop(self, dead: list[Any]) -> None:
        """Forget lost workers (each once); no worker left fails the call."""
        for h in dead:
            if any(w is h for w in self.workers):
                self.workers = [w for w in self.workers if w is not h]
                self.lost += 1
        if not self.workers:
            raise ValueError(
                f"{self.field}: roles.reward: all {self.started} reward worker(s) were lost "
                f"({self.lost} lost, 0 left), so the step cannot be scored; see their logs, and "
                "give roles.reward more memory if they were OOMKilled"
            )


class HttpRewardScorer:
    """A remote reward endpoint.

    Request: ``POST url`` with ``Content-Type: application/json`` and the body
    ``{"prompts": [str], "completions": [str], "labels": [any]}`` (labels that are not JSON are
    sent as strings), plus ``Authorization: Bearer <token>`` when ``tokenEnv`` names a variable.
    Answer: a 2xx status and ``{"rewards": [number, ...]}``, one finite number per sample, in
    order. Connection errors, timeouts and the statuses :func:`retried` names are retried
    ``retries`` times, waiting ``backoffSeconds`` and then twice as long each time. Each attempt
    has ``timeoutSeconds`` in all (connecting, and reading the whole answer: an endpoint that
    trickles its answer is cut off too). Messages show the URL without credentials
    (:func:`shown_url`: validation refuses ``user:password@``, query values are hidden).
    """

    def __init__(
        self,
        spec: HttpRewardSource,
        field: str,
        env: dict[str, str] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.spec = spec
        self.field = field
        self.sleep = sleep
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        self.shown = shown_url(spec.url)
        if spec.token_env is not None:
            token = (os.environ if env is None else env).get(spec.token_env)
            if not token:
                raise ValueError(
                    f"{field}.tokenEnv: the environment variable {spec.token_env} is not set "
                    "(or empty) in the trainer; fill it from a Secret with spec.podTemplate.env "
                    "(valueFrom.secretKeyRef), or unset tokenEnv"
                )
            self.headers["Authorization"] = f"Bearer {token}"

    def __call__(
        self, prompts: list[str], completions: list[str], labels: list[Any]
    ) -> list[float]:
        size = self.spec.batch_size or max(len(prompts), 1)
        out: list[float] = []
        for lo in range(0, len(prompts), size):
            hi = lo + size
            out += self._post(prompts[lo:hi], completions[lo:hi], labels[lo:hi])
        return out

    def _post(self, prompts: list[str], completions: list[str], labels: list[Any]) -> list[float]:
        spec, where = self.spec, f"{self.field}.url: POST {self.shown}"
        body = json.dumps(
            {"prompts": prompts, "completions": completions, "labels": labels}, default=str
        ).encode()
        attempts = spec.retries + 1
        why = ""
        for attempt in range(attempts):
            if attempt:
                self.sleep(spec.backoff_seconds * 2 ** (attempt - 1))
            request = urllib.request.Request(spec.url, body, self.headers, method="POST")
            deadline = time.monotonic() + spec.timeout_seconds
            try:
                with urllib.request.urlopen(request, timeout=spec.timeout_seconds) as answer:
                    raw = _read_until(answer, deadline)
            except urllib.error.HTTPError as exc:
                try:
                    detail = exc.read(200).decode(errors="replace").strip().replace("\n", " ")
                except OSError:
                    detail = ""
                why = f"answered HTTP {exc.code} {exc.reason}" + (f": {detail}" if detail else "")
                if not retried(exc.code):
                    raise ValueError(
                        f"{where} {why} (fix the request the endpoint refuses, or the url)"
                    ) from None
                continue
            except http.client.HTTPException as exc:  # a malformed or cut-off answer
                why = f"broken answer ({type(exc).__name__}: {exc})"
                continue
            except (TimeoutError, urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                if isinstance(reason, TimeoutError) or isinstance(exc, TimeoutError):
                    why = f"no answer within timeoutSeconds ({spec.timeout_seconds:g} s)"
                else:
                    why = f"cannot connect ({reason})"
                continue
            return self._rewards(raw, len(prompts), where)
        raise ValueError(
            f"{where} failed {attempts} time(s), last: {why} (check that the endpoint is up and "
            "reachable from the rollout role's pods, or raise retries / timeoutSeconds)"
        )

    @staticmethod
    def _rewards(raw: bytes, n: int, where: str) -> list[float]:
        """The ``rewards`` of an answer: ``n`` finite numbers, else a one-line error."""
        try:
            doc = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            shown = raw[:80].decode(errors="replace")
            raise ValueError(
                f"{where} answered with invalid JSON ({exc.msg}: {shown!r}); the endpoint must "
                'answer {"rewards": [number, ...]}'
            ) from None
        values = doc.get("rewards") if isinstance(doc, dict) else None
        if not isinstance(values, list):
            raise ValueError(
                f"{where} answered without a list under 'rewards'; the endpoint must answer "
                '{"rewards": [number, ...]}, one number per sample'
            )
        if len(values) != n:
            raise ValueError(
                f"{where} answered {len(values)} rewards for {n} samples; it must answer one "
                "reward per sample, in order"
            )
        out = []
        for i, v in enumerate(values):
            ok = isinstance(v, int | float) and not isinstance(v, bool)
            if not ok or not math.isfinite(v):
                raise ValueError(
                    f"{where} answered rewards[{i}] = {v!r}, not a finite number; the endpoint "
                    "must answer finite numbers (no null, NaN or Infinity)"
                )
            out.append(float(v))
        return out


def _read_until(answer: Any, deadline: float) -> bytes:
    """The whole body of ``answer``, or :class:`TimeoutError` once ``deadline`` (a monotonic
    time) has passed: the socket's timeout bounds each read only, not a trickled answer."""
    chunks = []
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError("the answer took longer than timeoutSeconds")
        chunk = answer.read1(65_536)
        if not chunk:
            missing = getattr(answer, "length", None)
            if missing:  # (read1 does not tell a cut-off answer: read does)
                raise http.client.IncompleteRead(b"".join(chunks), missing)
            return b"".join(chunks)
        chunks.append(chunk)


class JudgeScorer:
    """A generative judge (``judge``): ``template`` filled with each prompt, response and label
    (rendered with the judge tokenizer's chat template when on), completed by ``engine`` (a
    :class:`~ppojob_trainer.backends.base.GenerationEngine`: the policy's own, or one loaded
    for the judge) in one batched call; the first match of ``scorePattern`` in each verdict
    (cut at its first special token), clamped to [minScore, maxScore], is the reward. A
    verdict without one scores ``defaultScore``; :attr:`last_unparsed` counts them in the
    latest call (reported as ``reward/<name>_unparsed``)."""

    def __init__(self, spec: JudgeRewardSource, field: str, engine: Any, tokenizer: Any) -> None:
        self.spec, self.field = spec, field
        self.engine, self.tokenizer = engine, tokenizer
        try:
            self.pattern = re.compile(spec.score_pattern)
        except re.error as exc:
            raise ValueError(f"{field}.scorePattern: does not compile ({exc})") from None
        if self.pattern.groups != 1:
            raise ValueError(
                f"{field}.scorePattern: has {self.pattern.groups} groups; keep exactly one "
                "around the number"
            )
        has_template = bool(getattr(tokenizer, "chat_template", None))
        self.chat = has_template if spec.apply_chat_template is None else spec.apply_chat_template
        if self.chat and not has_template:
            raise ValueError(
                f"{field}.applyChatTemplate: the judge's tokenizer has no chat template; set "
                "applyChatTemplate: false"
            )
        self.pad = tokenizer.pad_token_id
        if self.pad is None:
            self.pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self.special = set(tokenizer.all_special_ids)
        if tokenizer.eos_token_id is not None:
            self.special.add(int(tokenizer.eos_token_id))
        self.calls = 0
        self.last_unparsed = 0

    def judge_prompt(self, prompt: str, completion: str, label: Any) -> str:
        """The judge's prompt text of one sample."""
        text = self.spec.template.format(
            prompt=prompt, response=completion, label="" if label is None else label
        )
        if not self.chat:
            return text
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )

    def score_of(self, verdict: str) -> float | None:
        """The clamped score in a verdict, or None when the pattern finds no finite number."""
        match = self.pattern.search(verdict)
        if match is None or match.group(1) is None:
            return None
        try:
            value = float(match.group(1))
        except ValueError:
            return None
        if not math.isfinite(value):
            return None
        return min(max(value, self.spec.min_score), self.spec.max_score)

    def verdicts(self, prompts: list[str], completions: list[str], labels: list[Any]) -> list[str]:
        """The judge's verdict on each sample, decoded and cut at its first special token."""
        import torch

        texts = [
            self.judge_prompt(p, c, lab)
            for p, c, lab in zip(prompts, completions, labels, strict=True)
        ]
        rows = self.tokenizer(texts, add_special_tokens=not self.chat)["input_ids"]
        keep = self.spec.max_prompt_length
        rows = [list(r[-keep:]) for r in rows]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = True
        self.calls += 1
        gen = self.engine.generate(
            ids,
            mask,
            max_new_tokens=self.spec.max_new_tokens,
            temperature=self.spec.temperature,
            top_p=1.0,
            seed=7_919 * self.calls,
        )
        out = []
        for row, n in zip(gen.response_ids.tolist(), gen.lengths.tolist(), strict=True):
            row = row[:n]
            cut = next((k for k, t in enumerate(row) if t in self.special), len(row))
            out.append(self.tokenizer.decode(row[:cut]))
        return out

    def __call__(
        self, prompts: list[str], completions: list[str], labels: list[Any]
    ) -> list[float]:
        if not prompts:
            self.last_unparsed = 0
            return []
        scores = [self.score_of(v) for v in self.verdicts(prompts, completions, labels)]
        self.last_unparsed = sum(s is None for s in scores)
        return [self.spec.default_score if s is None else s for s in scores]


def load_judge_engine(
    spec: JudgeRewardSource, field: str, device: str, dtype: str
) -> tuple[Any, Any]:
    """(engine, tokenizer) of a judge model that is not the policy: ``builtin:<model>`` (seed
    0) or a Hugging Face causal-LM directory, on the torch engine the trainer samples with."""
    from .backends.torch_backend.generation import TorchGenerationEngine
    from .models import load_tokenizer, materialize_builtin

    where = f"{field}.model: {spec.model!r}"
    if spec.model.startswith("builtin:"):
        path = materialize_builtin(spec.model.removeprefix("builtin:"), 0)
    else:
        path = Path(spec.model).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{where} is not a model directory here (no config.json; relative to "
                f"{os.getcwd()}); give the directory of a causal LM saved with save_pretrained, "
                "or use policy"
            )
    tok = load_tokenizer(path)
    stop = set(tok.all_special_ids) | ({tok.eos_token_id} - {None})
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    engine = TorchGenerationEngine(path, dtype, stop_ids=sorted(stop), pad_id=pad, device=device)
    return engine, tok


@dataclass(frozen=True)
class Source:
    """One reward source: its name in the metrics, its weight and its scorer."""

    name: str
    weight: float
    scorer: Scorer


class CombinedReward:
    """The weighted sum of the reward sources. Called, it returns the rewards; :meth:`score`
    also returns each source's (unweighted) rewards."""

    def __init__(self, sources: Sequence[Source], report_sources: bool) -> None:
        self.sources = list(sources)
        self.report_sources = report_sources  # per-source metrics (data.rewards set)
        # judges' unparsed verdicts and remote model sources' samples in the latest score
        self.last_counts: dict[str, int] = {}

    def set_reward_workers(self, workers: Sequence[Any]) -> None:
        """``roles.reward``: the model sources score on ``workers`` from now on (the trainer
        started replacements of lost ones)."""
        for s in self.sources:
            if isinstance(s.scorer, RemoteRewardModelScorer) and workers:
                s.scorer.workers = list(workers)
                s.scorer.started = len(workers)

    def score(
        self, prompts: list[str], completions: list[str], labels: list[Any]
    ) -> tuple[list[float], dict[str, list[float]]]:
        """(the weighted sum per sample, each source's rewards per sample)."""
        parts = {s.name: s.scorer(prompts, completions, labels) for s in self.sources}
        self.last_counts = {
            f"{s.name}_unparsed": s.scorer.last_unparsed
            for s in self.sources
            if isinstance(s.scorer, JudgeScorer)
        }
        for s in self.sources:  # roles.reward: samples its workers scored, and sent again
            if isinstance(s.scorer, RemoteRewardModelScorer):
                self.last_counts[f"{s.name}_remote"] = s.scorer.last_remote
                self.last_counts[f"{s.name}_resent"] = s.scorer.last_resent
        total = [0.0] * len(prompts)
        for s in self.sources:
            for i, v in enumerate(parts[s.name]):
                total[i] += s.weight * v
        return total, parts

    def __call__(
        self, prompts: list[str], completions: list[str], labels: list[Any]
    ) -> list[float]:
        return self.score(prompts, completions, labels)[0]


def no_reward(prompts: list[str], completions: list[str], labels: list[Any]) -> list[float]:
    """The reward of a job whose teacher is its only signal and whose dataset has no reward
    function: 0 for every sample."""
    return [0.0] * len(prompts)


def make_reward(
    data: DataSpec,
    prompts: str,
    device: str = "cpu",
    model_dtype: str = "float32",
    policy: tuple[Any, Any] | None = None,
    reward_workers: Sequence[Any] | None = None,
    engine_rank: int = 0,
    needed: bool = True,
) -> CombinedReward:
    """The reward of ``data``: its ``rewards`` sources, or the ``rewardFunction`` shorthand
    (unset: the built-in task of ``prompts``). A model source (and a judge's own model) is
    loaded onto ``device``; ``policy``: the rollout engine and tokenizer a ``judge: {model:
    policy}`` asks. ``reward_workers`` (``roles.reward``): the reward workers' handles, which
    score the model sources instead (``engine_rank`` chooses the first worker of a split).
    ``needed`` false (a distillation teacher is the only signal): a dataset without a reward
    function scores 0."""
    alone = not data.rewards and data.reward_function is None and not needed
    if alone and not prompts.startswith("builtin:"):
        return CombinedReward([Source("reward", 1.0, no_reward)], False)
    if not data.rewards:
        return CombinedReward(
            [Source("reward", 1.0, RewardScorer(data.reward_function, prompts))], False
        )
    if data.reward_function is not None:
        raise ValueError(
            "data.rewards: rewards and rewardFunction are both set; move rewardFunction into "
            "rewards as {function: ...}, or remove rewards"
        )
    sources = []
    for i, src in enumerate(data.rewards):
        field = f"data.rewards[{i}]"
        scorer: Scorer
        if src.function is not None:
            scorer = RewardScorer(src.function, prompts, field=f"{field}.function")
        elif src.model is not None and reward_workers is not None:
            scorer = RemoteRewardModelScorer(
                reward_workers, i, f"{field}.model", engine_rank, src.model.batch_size
            )
        elif src.model is not None:
            scorer = RewardModelScorer(src.model, f"{field}.model", device, model_dtype)
        elif src.http is not None:
            scorer = HttpRewardScorer(src.http, f"{field}.http")
        elif src.judge is not None:
            where = f"{field}.judge"
            if src.judge.model == "policy":
                if policy is None:
                    raise ValueError(f"{where}.model: policy, but no policy engine is here")
                engine, tok = policy
            else:
                engine, tok = load_judge_engine(src.judge, where, device, model_dtype)
            scorer = JudgeScorer(src.judge, where, engine, tok)
        else:
            raise ValueError(f"{field}: needs exactly one of function, model, http and judge")
        sources.append(Source(src.default_name(), src.weight, scorer))
    names = [s.name for s in sources]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"data.rewards: two sources are named {dup!r}; give each a unique name")
    return CombinedReward(sources, True)


__all__ = [
    "CombinedReward",
    "HttpRewardScorer",
    "JudgeScorer",
    "RemoteRewardModelScorer",
    "RewardModelScorer",
    "Source",
    "make_reward",
    "reward_parts",
]
