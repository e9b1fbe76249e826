"""The training half of a PPOJob: experiment trackers (`spec.trackers`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from ppojob_api.base import ApiModel


class SecretRef(ApiModel):
    """A reference to a Secret in the job's namespace."""

    name: str = Field(min_length=1)
    """Secret name."""


class TensorBoardTracker(ApiModel):
    """TensorBoard event files."""

    type: Literal["tensorboard"]
    """The tracker: `tensorboard` (TensorBoard event files), `mlflow` (an MLflow tracking server
    or store) or `wandb` (Weights & Biases); the other fields depend on it. All need the
    `trackers` extra (`pip install 'ppojob[trackers]'`)."""

    log_dir: str = Field("tensorboard", min_length=1)
    """TensorBoard: directory of the event files. A relative path is inside the run's output
    directory (`<checkpointDir>/output` on spec.checkpointVolume)."""


class MlflowTracker(ApiModel):
    """An MLflow run: every step's metrics, the resolved config as parameters, the reward curve
    and metrics.jsonl as artifacts (MLflow's client, `mlflow-skinny`, in the `trackers`
    extra)."""

    type: Literal["mlflow"]
    """The tracker: `tensorboard` (TensorBoard event files), `mlflow` (an MLflow tracking server
    or store) or `wandb` (Weights & Biases); the other fields depend on it. All need the
    `trackers` extra (`pip install 'ppojob[trackers]'`)."""

    tracking_uri: str = Field(min_length=1)
    """MLflow: where runs are recorded: `http(s)://host:port` of a tracking server,
    `databricks`, or a store URI such as `file:/path` (MLflow's MLFLOW_TRACKING_URI)."""

    experiment_name: str | None = Field(None, min_length=1, max_length=500)
    """MLflow: the experiment of the run (created when missing). Unset: the PPOJob's name."""

    run_name: str | None = Field(None, min_length=1, max_length=128)
    """MLflow, W&B: the run's name. Unset: the PPOJob's name."""

    secret_ref: SecretRef | None = None
    """MLflow, W&B: the tracker's credentials, a Secret whose every key becomes an environment
    variable of the trainer's head pod (mlflow: MLFLOW_TRACKING_TOKEN, or
    MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD; wandb: WANDB_API_KEY, and
    WANDB_BASE_URL for a self-hosted server). `ppojob run` reads them from its own
    environment."""


class WandbTracker(ApiModel):
    """A Weights & Biases run: every step's metrics, the resolved config, the reward curve and
    metrics.jsonl as an artifact (`wandb`, in the `trackers` extra)."""

    type: Literal["wandb"]
    """The tracker: `tensorboard` (TensorBoard event files), `mlflow` (an MLflow tracking server
    or store) or `wandb` (Weights & Biases); the other fields depend on it. All need the
    `trackers` extra (`pip install 'ppojob[trackers]'`)."""

    project: str = Field(min_length=1, max_length=128)
    """W&B: the project (created when missing)."""

    entity: str | None = Field(None, min_length=1)
    """W&B: the user or team owning the project. Unset: the API key's default entity."""

    run_name: str | None = Field(None, min_length=1, max_length=128)
    """MLflow, W&B: the run's name. Unset: the PPOJob's name."""

    mode: Literal["online", "offline"] = "online"
    """W&B: `online` sends to the W&B server (WANDB_BASE_URL, default api.wandb.ai); `offline`
    writes the run under `dir` only, to upload later with `wandb sync`."""

    dir: str = Field("wandb", min_length=1)
    """W&B: directory of the run's files. A relative path is inside the run's output
    directory."""

    secret_ref: SecretRef | None = None
    """MLflow, W&B: the tracker's credentials, a Secret whose every key becomes an environment
    variable of the trainer's head pod (mlflow: MLFLOW_TRACKING_TOKEN, or
    MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD; wandb: WANDB_API_KEY, and
    WANDB_BASE_URL for a self-hosted server). `ppojob run` reads them from its own
    environment."""


TrackerSpec = Annotated[
    TensorBoardTracker | MlflowTracker | WandbTracker, Field(discriminator="type")
]
"""An experiment tracker the trainer logs to, besides metrics.jsonl and the PPOJob status."""
TRACKER_TYPES = ("tensorboard", "mlflow", "wandb")
