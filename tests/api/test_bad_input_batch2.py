"""Issue 23, the second hand-written batch (bench/bad_input_batch2.py): the misses it found, each
fixed at its rule, with tables of the bad input and its valid neighbours. Extra volumes checked
at every level against Kubernetes' Volume schema; the affinity rules the first pass left out
(namespaces, matchLabelKeys, label-selector values); YuniKorn queue names by yunikorn-core's
rule; learning-rate schedules longer than the run (a warning, from the trainer's own count of
updates); a `--set` value that is not YAML as one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ppojob_api.checks.batches import planned_updates, schedule_warnings
from ppojob_api.checks.cluster import check_scheduling
from ppojob_api.checks.pods import check_pod_fields, yunikorn_queue
from ppojob_api.checks.podtemplate import check_pod_template
from ppojob_api.k8s_types import VOLUME_TYPES
from ppojob_api.problems import SpecError
from ppojob_api.setflags import parse_set
from ppojob_api.spec import PPOJobSpec
from ppojob_api.validation import load_manifests
from tests.helpers.k8s_models import table

TINY = (Path(__file__).parents[2] / "examples" / "ppojob-tiny.yaml").read_text()


def _spec(**fields: Any) -> PPOJobSpec:
    return PPOJobSpec.model_validate(
        {"image": "trainer:1", "model": {"path": "builtin:tiny-llama"}, **fields}
    )


def _volume_paths(*volumes: dict[str, Any]) -> list[str]:
    spec = _spec(podTemplate={"volumes": list(volumes)})
    return [p.path for p in check_pod_template(spec)]


V = "spec.podTemplate.volumes[0]"

VOLUMES: list[tuple[str, dict[str, Any], list[str]]] = [
    ("a misspelt source (silently an emptyDir on disk)", {"emptydir": {}}, [f"{V}.emptydir"]),
    (
        "a misspelt key two levels down",
        {"secret": {"secretName": "s", "items": [{"key": "a", "pth": "a"}]}},
        [f"{V}.secret.items[0].pth"],
    ),
    (
        "a misspelt key four levels down",
        {"projected": {"sources": [{"configMap": {"name": "c", "itemz": []}}]}},
        [f"{V}.projected.sources[0].configMap.itemz"],
    ),
    (
        "a mode written as a string",
        {"secret": {"secretName": "s", "defaultMode": "0644"}},
        [f"{V}.secret.defaultMode"],
    ),
    ("readOnly as a string", {"csi": {"driver": "d", "readOnly": "yes"}}, [f"{V}.csi.readOnly"]),
    ("two sources", {"emptyDir": {}, "hostPath": {"path": "/x"}}, [V]),
    (
        "a selector deep in an ephemeral claim, its operator misspelt",
        {
            "ephemeral": {
                "volumeClaimTemplate": {
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "selector": {"matchExpressions": [{"key": "a", "operator": "in"}]},
                    }
                }
            }
        },
        [f"{V}.ephemeral.volumeClaimTemplate.spec.selector.matchExpressions[0].operator"],
    ),
    (
        "a CSI attribute that is a number",
        {"csi": {"driver": "d", "volumeAttributes": {"size": 10}}},
        [f"{V}.csi.volumeAttributes.size"],
    ),
    (
        "a claim's storage request that is no quantity",
        {
            "ephemeral": {
                "volumeClaimTemplate": {"spec": {"resources": {"requests": {"storage": True}}}}
            }
        },
        [f"{V}.ephemeral.volumeClaimTemplate.spec.resources.requests.storage"],
    ),
    # valid neighbours
    (
        "a claim's storage request as a bare number (bytes)",
        {
            "ephemeral": {
                "volumeClaimTemplate": {"spec": {"resources": {"requests": {"storage": 1000000}}}}
            }
        },
        [],
    ),
    (
        "an emptyDir in memory with a size",
        {"emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
        [],
    ),
    ("a size as a bare number (bytes)", {"emptyDir": {"sizeLimit": 1000000}}, []),
    (
        "a secret with items and a mode",
        {"secret": {"secretName": "s", "defaultMode": 420, "items": [{"key": "a", "path": "a"}]}},
        [],
    ),
    (
        "an ephemeral claim at every level",
        {
            "ephemeral": {
                "volumeClaimTemplate": {
                    "metadata": {"labels": {"a": "b"}},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "1Gi"}},
                        "storageClassName": "fast",
                    },
                }
            }
        },
        [],
    ),
    ("a CSI volume with attributes", {"csi": {"driver": "d", "volumeAttributes": {"k": "v"}}}, []),
    ("a claim", {"persistentVolumeClaim": {"claimName": "c", "readOnly": True}}, []),
]


@pytest.mark.parametrize(
    ("volume", "paths"), [(v, p) for _, v, p in VOLUMES], ids=[n for n, _, _ in VOLUMES]
)
def test_extra_volumes_are_checked_at_every_level(volume: dict[str, Any], paths: list[str]) -> None:
    assert _volume_paths({"name": "extra", **volume}) == paths


def test_the_volume_table_is_kubernetes_own() -> None:
    """ppojob_api.k8s_types is the kubernetes client's models, every type reachable from a
    Volume (regenerate it with `python -m tests.helpers.k8s_models`)."""
    assert table("V1Volume") == VOLUME_TYPES


def test_a_misspelt_volume_source_is_refused_with_the_nearest_name() -> None:
    [problem] = check_pod_template(
        _spec(podTemplate={"volumes": [{"name": "x", "emptydir": {"medium": "Memory"}}]})
    )
    assert problem.message.startswith("not a field of a Kubernetes Volume")
    assert problem.fix == "did you mean `emptyDir`?"


A = "spec.head.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0]"


def _term(**fields: Any) -> dict[str, Any]:
    term = {"topologyKey": "kubernetes.io/hostname", **fields}
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}


SELECTOR = {"matchLabels": {"app": "x"}}

AFFINITY: list[tuple[str, dict[str, Any], list[str]]] = [
    ("a namespace with upper case", _term(namespaces=["Team_A"]), [f"{A}.namespaces[0]"]),
    (
        "matchLabelKeys without a labelSelector",
        _term(matchLabelKeys=["pod-template-hash"]),
        [f"{A}.matchLabelKeys"],
    ),
    (
        "a key in matchLabelKeys and mismatchLabelKeys",
        _term(labelSelector=SELECTOR, matchLabelKeys=["team"], mismatchLabelKeys=["team"]),
        [f"{A}.matchLabelKeys[0]"],
    ),
    (
        "a matchLabelKeys entry that is not a label key",
        _term(labelSelector=SELECTOR, matchLabelKeys=["a b"]),
        [f"{A}.matchLabelKeys[0]"],
    ),
    (
        "a label-selector value with a space",
        _term(
            labelSelector={
                "matchExpressions": [{"key": "app", "operator": "In", "values": ["a b"]}]
            }
        ),
        [f"{A}.labelSelector.matchExpressions[0].values[0]"],
    ),
    # valid neighbours
    ("namespaces", _term(namespaces=["team-a", "default"]), []),
    (
        "matchLabelKeys and mismatchLabelKeys with a selector",
        _term(labelSelector=SELECTOR, matchLabelKeys=["a"], mismatchLabelKeys=["b"]),
        [],
    ),
    (
        "selector values that are label values",
        _term(
            labelSelector={
                "matchExpressions": [{"key": "app", "operator": "In", "values": ["a.b-c_d"]}]
            }
        ),
        [],
    ),
]


def test_a_non_string_label_in_a_selector_is_refused_once() -> None:
    spec = _spec(head={"affinity": _term(labelSelector={"matchLabels": {"app": 1}})})
    [problem] = check_pod_fields(spec)
    assert (problem.path, problem.message, problem.fix) == (
        f"{A}.labelSelector.matchLabels.app",
        "must be a string",
        "quote it",
    )


@pytest.mark.parametrize(
    ("affinity", "paths"), [(a, p) for _, a, p in AFFINITY], ids=[n for n, _, _ in AFFINITY]
)
def test_affinity_value_rules(affinity: dict[str, Any], paths: list[str]) -> None:
    spec = _spec(head={"affinity": affinity})
    assert [p.path for p in check_pod_fields(spec)] == paths


LONG_DOTTED = "a" * 20 + "." + "b" * 20 + "." + "c" * 21  # 63: a label value
YUNIKORN: list[tuple[str, bool]] = [
    ("root..ml", False),  # an empty part
    ("root.ml team", False),
    ("root." + "a" * 65, False),  # a part longer than 64
    (LONG_DOTTED, False),  # one name: 71 characters once its dots are written as _dot_
    # valid neighbours
    ("root.ml-team_a", True),
    ("root.ml:x", True),  # yunikorn-core >= 1.6 takes ':' (the label check refuses it)
    ("team-a", True),
    ("a.b", True),  # the child queue a_dot_b
    ("root." + LONG_DOTTED, True),  # each part short; the label check judges the length
]


@pytest.mark.parametrize(("queue", "valid"), YUNIKORN)
def test_yunikorn_queue_names_by_yunikorn_cores_rule(queue: str, valid: bool) -> None:
    assert (yunikorn_queue(queue) == []) is valid
    spec = _spec(scheduling={"gangScheduler": "yunikorn", "queue": queue})
    paths = [p.path for p in check_pod_fields(spec)]
    assert paths == ([] if valid else ["spec.scheduling.queue"])


def test_a_yunikorn_queue_is_also_a_label_value() -> None:
    """yunikorn-core takes ':', '#', '/' and '@' in a name, but the queue travels in a label."""
    spec = _spec(scheduling={"gangScheduler": "yunikorn", "queue": "root.ml@team"})
    assert check_pod_fields(spec) == []
    assert [p.path for p in check_scheduling(spec)] == ["spec.scheduling.queue"]


def _half(**training: Any) -> PPOJobSpec:
    """The tiny example's spec with `training` written over spec.training."""
    [job] = load_manifests(TINY)
    doc = job.spec.model_dump(by_alias=True, exclude_none=True)
    doc["training"] |= training
    return PPOJobSpec.model_validate(doc)


def test_planned_updates_count_the_actors_and_the_critics() -> None:
    """The tiny example: 16 x 8 = 128 samples a step, mini-batches of 64: 2 updates a pass."""
    spec = _half(steps=10, ppoEpochs=3)
    assert planned_updates(spec, "actor") == 10 * 3 * 2
    doc = spec.model_dump(by_alias=True, exclude_none=True)
    doc["algorithm"] |= {"criticWarmupSteps": 4, "criticUpdatesPerStep": 2}
    warm = PPOJobSpec.model_validate(doc)
    assert planned_updates(warm, "actor") == (10 - 4) * 3 * 2
    assert planned_updates(warm, "critic") == 10 * 2 * 3 * 2


SCHEDULES: list[tuple[str, dict[str, Any], list[str]]] = [
    # 500 steps x 2 updates = 1000; 20 warm-up updates leave 980
    ("a decay longer than the run", {"lrDecaySteps": 981}, ["spec.training.lrDecaySteps"] * 2),
    ("a warm-up as long as the run", {"lrWarmupSteps": 1000}, ["spec.training.lrWarmupSteps"] * 2),
    # valid neighbours
    ("a decay over every update after the warm-up", {"lrDecaySteps": 980}, []),
    ("the example's own decay", {}, []),
    ("no decay", {"lrDecaySteps": 0}, []),
]


@pytest.mark.parametrize(
    ("training", "fields"), [(t, f) for _, t, f in SCHEDULES], ids=[n for n, _, _ in SCHEDULES]
)
def test_schedule_warnings_name_the_field(training: dict[str, Any], fields: list[str]) -> None:
    """Actor and critic (the tiny example's, colocated) inherit spec.training: one warning each."""
    warnings = schedule_warnings(_half(**training))
    assert [w.split(":")[0] for w in warnings] == fields


def test_a_critic_decay_override_is_warned_at_the_override() -> None:
    spec = _half()
    doc = spec.model_dump(by_alias=True, exclude_none=True)
    doc["roles"]["critic"] = {"colocateWithActor": True, "overrides": {"lrDecaySteps": 5000}}
    [warning] = schedule_warnings(PPOJobSpec.model_validate(doc))
    assert warning.startswith("spec.roles.critic.overrides.lrDecaySteps: 5000 decay updates")
    assert "the critic makes only 980 optimizer updates after its 20 warm-up" in warning


def test_a_set_value_that_is_not_yaml_is_one_line_naming_the_flag() -> None:
    with pytest.raises(SpecError) as exc:
        parse_set("data.rewards=[{function: x:y")
    [problem] = exc.value.problems
    assert problem.path == "--set data.rewards"
    assert "\n" not in problem.message and "column 16" in problem.message
    assert problem.fix.startswith("close the quote or bracket")


def _with(spec: PPOJobSpec, **parts: dict[str, Any]) -> PPOJobSpec:
    doc = spec.model_dump(by_alias=True, exclude_none=True)
    for key, fields in parts.items():
        doc.setdefault(key, {})
        doc[key] |= fields
    return PPOJobSpec.model_validate(doc)


def test_planned_updates_without_a_critic_or_with_its_own_settings() -> None:
    """10 steps x 3 epochs x 2 mini-batches = 60 actor updates. Without a critic the warm-up
    steps (the critic's) take nothing from the actor and the critic makes none; a warm-up as
    long as the run leaves the actor none; the critic counts with its own overrides."""
    ten = _half(steps=10, ppoEpochs=3)
    grpo = _with(ten, algorithm={"advantageEstimator": "grpo", "criticWarmupSteps": 4})
    assert (planned_updates(grpo, "actor"), planned_updates(grpo, "critic")) == (60, 0)
    warm = _with(_half(steps=4, ppoEpochs=3), algorithm={"criticWarmupSteps": 6})
    assert (planned_updates(warm, "actor"), planned_updates(warm, "critic")) == (0, 4 * 3 * 2)
    own = {"colocateWithActor": True, "overrides": {"ppoEpochs": 1, "miniBatchSize": 32}}
    critic = _with(ten, roles={"critic": own})
    assert (planned_updates(critic, "actor"), planned_updates(critic, "critic")) == (60, 10 * 4)


def test_schedule_warnings_read_in_full() -> None:
    """What `ppojob validate` prints: the role, its count of updates and the bound to set."""
    assert schedule_warnings(_half(lrWarmupSteps=1000))[0] == (
        "spec.training.lrWarmupSteps: 1000 warm-up updates, but the actor makes only 1000 "
        "optimizer updates in the whole run (steps x ppoEpochs x mini-batches per step): its "
        "learning rate never reaches learningRate; lower lrWarmupSteps"
    )
    assert schedule_warnings(_half(lrDecaySteps=981))[1] == (
        "spec.training.lrDecaySteps: 981 decay updates, but the critic makes only 980 optimizer "
        "updates after its 20 warm-up updates: the decay spans those 980 (as lrDecaySteps 0); "
        "set lrDecaySteps <= 980 for a stable phase before it"
    )


def test_schedule_warnings_count_each_roles_own_updates() -> None:
    """A critic that updates twice a step makes 2,000 updates: a warm-up of 1,000 is the
    actor's problem only. A critic's own warm-up is warned at its override. A constant schedule
    has no decay to warn about (check_learning_rate refuses its lrDecaySteps)."""
    twice = _with(_half(lrWarmupSteps=1000), algorithm={"criticUpdatesPerStep": 2})
    assert [w.split(":")[0] for w in schedule_warnings(twice)] == ["spec.training.lrWarmupSteps"]
    own = {"colocateWithActor": True, "overrides": {"lrWarmupSteps": 1000}}
    [warning] = schedule_warnings(_with(_half(), roles={"critic": own}))
    assert warning.startswith(
        "spec.roles.critic.overrides.lrWarmupSteps: 1000 warm-up updates, but the critic makes "
        "only 1000 optimizer updates"
    )
    constant = _half(lrScheduler="constant", lrDecaySteps=5000, lrWarmupSteps=0)
    assert schedule_warnings(constant) == []
