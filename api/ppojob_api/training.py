"""The training half of a PPOJob: the trainer's own configuration model.

This module imports neither torch nor ray, so the operator can validate a spec with it and render it
into the trainer's ConfigMap, and `ppojob run` can feed it to a local trainer. Every field's
docstring becomes its description in the generated CRD (`kubectl explain`).

`TrainingHalf` and `TrainerConfig` are defined here; their parts are defined one section per module
in `ppojob_api.trainspec` (`model`, `roles`, `algorithm`, `data`, `settings`, `trackers`, and the
built-in names in `constants`), and every public model class is importable from here too.

Semantic rules that a schema cannot express live in `ppojob_api.checks`, which return *every*
problem with its field path and a fix; `SpecError` carries them as a `ValueError`.
"""

from __future__ import annotations

from pydantic import Field

from ppojob_api.base import ApiModel
from ppojob_api.overrides import apply_critic_overrides
from ppojob_api.trainspec.algorithm import (
    Algorithm,
    Distillation,
    DynamicSampling,
    ImportanceSampling,
    KLSpec,
    OverlongShaping,
)
from ppojob_api.trainspec.data import (
    AgentSpec,
    DataSpec,
    HttpRewardSource,
    JudgeRewardSource,
    RewardModelSource,
    RewardSource,
    ToolSpec,
)
from ppojob_api.trainspec.model import LoraSpec, ModelSpec
from ppojob_api.trainspec.roles import (
    ActorRole,
    CriticRole,
    ElasticRollout,
    EnvVar,
    Parallelism,
    Resources,
    RewardRole,
    Roles,
    RolloutRole,
    SandboxRole,
    Toleration,
)
from ppojob_api.trainspec.settings import Training, TrainingSettings
from ppojob_api.trainspec.trackers import (
    MlflowTracker,
    SecretRef,
    TensorBoardTracker,
    TrackerSpec,
    WandbTracker,
)

__all__ = [
    "ActorRole",
    "AgentSpec",
    "Algorithm",
    "CriticRole",
    "DataSpec",
    "Distillation",
    "DynamicSampling",
    "ElasticRollout",
    "EnvVar",
    "HttpRewardSource",
    "ImportanceSampling",
    "JudgeRewardSource",
    "KLSpec",
    "LoraSpec",
    "MlflowTracker",
    "ModelSpec",
    "OverlongShaping",
    "Parallelism",
    "Resources",
    "RewardModelSource",
    "RewardRole",
    "RewardSource",
    "Roles",
    "RolloutRole",
    "SandboxRole",
    "SecretRef",
    "TensorBoardTracker",
    "Toleration",
    "ToolSpec",
    "TrackerSpec",
    "TrainerConfig",
    "Training",
    "TrainingHalf",
    "TrainingSettings",
    "WandbTracker",
]


class TrainingHalf(ApiModel):
    """The fields of a PPOJob spec that the trainer reads."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    """Models of the actor and critic."""

    roles: Roles = Field(default_factory=Roles)
    """Actor, critic and rollout: replicas, resources, parallelism, backend, colocation."""

    algorithm: Algorithm = Field(default_factory=Algorithm)
    """The RL algorithm."""

    data: DataSpec = Field(default_factory=DataSpec)
    """Prompts, reward and sampling."""

    training: Training = Field(default_factory=Training)
    """Steps, optimisation and checkpoints."""

    trackers: list[TrackerSpec] = Field(default_factory=list)
    """Experiment trackers (`type`: tensorboard, mlflow or wandb): every step's metrics under
    the names of metrics.jsonl, the resolved config at the start. Credentials come from a
    Secret (secretRef), never from the PPOJob. A tracker that cannot be reached or written is a
    warning, never a failed run."""


class TrainerConfig(TrainingHalf):
    """What the trainer runs: the training half plus the few cluster facts it needs."""

    placement_timeout_seconds: int = Field(600, ge=1)
    """How long to wait for the placement group before failing (spec.scheduling.timeoutSeconds)."""

    job_name: str | None = None
    """Name of the PPOJob, for logs and progress reports."""

    stall_timeout_seconds: int | None = Field(None, ge=1)
    """Fail a wait of the driver whose workers have not all reported within the stall limit,
    naming each role, rank and phase still pending (spec.failurePolicy.stallTimeoutSeconds):
    the larger of this floor and 3 x the slowest step seen (``watchdog.Watchdog``). None: wait."""

    def critic_training(self) -> TrainingSettings:
        """The critic's training settings: the actor's, with the critic overrides on top."""
        critic = self.roles.effective_critic(self.algorithm.needs_critic)
        overrides = critic.overrides if critic else {}
        return apply_critic_overrides(self.training, overrides)
