"""`data.rewards` travels from the PPOJob to the trainer: the rendered config holds every source
as written (the HTTP endpoint's token only as the name of a variable), and the variable reaches
the rollout's pods from a Secret through spec.podTemplate.env."""

from __future__ import annotations

import yaml

from ppojob_api.training import TrainerConfig
from ppojob_api.validation import validate_manifest
from ppojob_operator import builders
from tests.helpers.manifests import base_manifest

SOURCES = [
    {"function": "rewards:score", "weight": 1},
    {"model": {"path": "/models/rm", "batchSize": 16, "device": "cpu"}, "weight": 0.5},
    {"http": {"url": "https://rm.internal/score", "tokenEnv": "RM_TOKEN", "retries": 4}},
]
TOKEN = {"name": "RM_TOKEN", "valueFrom": {"secretKeyRef": {"name": "rm-api", "key": "token"}}}


def test_the_rendered_config_carries_the_reward_sources_and_the_secret_reaches_the_pods() -> None:
    doc = base_manifest(
        data={"prompts": "/data/train.jsonl", "rewards": SOURCES}, podTemplate={"env": [TOKEN]}
    )
    job = validate_manifest(doc)
    children = builders.build_children(job, namespace="ns1")
    cm = next(c for c in children if c["kind"] == "ConfigMap")
    text = cm["data"]["trainer.yaml"]
    cfg = TrainerConfig.model_validate(yaml.safe_load(text))
    assert cfg.data.rewards == job.spec.data.rewards
    assert [s.weight for s in cfg.data.rewards] == [1.0, 0.5, 1.0]
    http = cfg.data.rewards[2].http
    assert http is not None and (http.token_env, http.retries) == ("RM_TOKEN", 4)
    assert "rm-api" not in text  # the Secret's name and key stay in the pods' env
    rayjob = next(c for c in children if c["kind"] == "RayJob")
    spec = rayjob["spec"]["rayClusterSpec"]
    rollout = next(g for g in spec["workerGroupSpecs"] if g["groupName"] == "rollout")
    env = rollout["template"]["spec"]["containers"][0]["env"]
    assert TOKEN in env
