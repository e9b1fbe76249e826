"""Issue 23: every manifest a user can get wrong is answered with one line per problem naming the
field and the fix, never a traceback, a hang, or blame on a field the user never wrote. Each
table holds bad inputs and their valid neighbours."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from ppojob_api.problems import SpecError
from ppojob_api.validation import load_manifests, validate_manifest
from ppojob_api.yamlio import load_yaml_documents
from tests.helpers.manifests import set_path

EXAMPLES = Path(__file__).parents[2] / "examples"
TINY = yaml.safe_load((EXAMPLES / "ppojob-tiny.yaml").read_text())
HEAD = "apiVersion: ppojob.io/v1alpha1\nkind: PPOJob\nmetadata: {name: job}\n"


def _problems(text: str) -> list[str]:
    try:
        load_manifests(text)
    except SpecError as exc:
        return [str(p) for p in exc.problems]
    return []


def _bomb(levels: int) -> str:
    lines = ['l0: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


# --- item 6: aliases are followed with a guard -------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (HEAD + "spec: &a\n  image: x\n  nested: *a\n", "spec.nested: refers to itself"),
        ("a: &a [1, *a]\n", "a[1]: refers to itself"),
        (_bomb(9), "<file>: expands to more than 100,000 values"),
        ("a: " + "[" * 80 + "]" * 80 + "\n", "nests more than 64 levels"),
    ],
)
def test_recursive_aliases_and_alias_bombs_are_one_line_errors(text: str, expected: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(SpecError) as info:
        load_yaml_documents(text)
    assert time.monotonic() - t0 < 1.0
    assert len(info.value.problems) == 1
    assert expected in str(info.value.problems[0]), info.value


@pytest.mark.parametrize(
    "text",
    [
        "a: &a [1, 2]\nb: *a\nc: *a\n",  # an alias used twice, not into itself
        "base: &b {x: 1}\nd: {<<: *b, y: 2}\n",  # a merge key
        _bomb(4),  # 6,561 values: many, but a document may hold them
        "a: " + "[" * 60 + "]" * 60 + "\n",
    ],
)
def test_ordinary_aliases_still_load(text: str) -> None:
    assert load_yaml_documents(text)


def test_duplicate_keys_inside_a_merged_block_are_still_found() -> None:
    with pytest.raises(SpecError, match=r"d\.x: duplicate key"):
        load_yaml_documents("base: &b {x: 1}\nd:\n  <<: {x: 1, x: 2}\n")


# --- item 1: batch-size problems are blamed where the value was written ------------------------
def _tiny(**training: object) -> dict[str, Any]:
    doc = copy.deepcopy(TINY)
    doc["spec"]["training"].update(training)
    return doc


def _paths(doc: dict[str, Any]) -> list[str]:
    try:
        validate_manifest(doc)
    except SpecError as exc:
        return [p.path for p in exc.problems]
    return []


@pytest.mark.parametrize(
    ("training", "critic", "expected"),
    [
        ({"miniBatchSize": 7}, None, ["spec.training.miniBatchSize"]),
        ({"microBatchSize": 3}, None, ["spec.training.microBatchSize"]),
        ({"microBatchSize": 3}, {"colocateWithActor": True}, ["spec.training.microBatchSize"]),
        # the critic's own override is blamed as its user spelled it
        (
            {},
            {"colocateWithActor": True, "overrides": {"micro_batch_size": 3}},
            ["spec.roles.critic.overrides.micro_batch_size"],
        ),
        # an override that repairs the critic's batches leaves only the actor's problem
        (
            {"microBatchSize": 3},
            {"colocateWithActor": True, "overrides": {"microBatchSize": 4}},
            ["spec.training.microBatchSize"],
        ),
        ({"miniBatchSize": 64}, None, []),
        ({"miniBatchSize": 64, "microBatchSize": 8}, {"colocateWithActor": True}, []),
    ],
)
def test_batch_problems_are_reported_once_where_written(
    training: dict[str, Any], critic: dict[str, Any] | None, expected: list[str]
) -> None:
    doc = _tiny(**training)
    if critic is not None:
        doc["spec"]["roles"]["critic"] = critic
    assert _paths(doc) == expected


# --- item 2: resource fields take every quantity Kubernetes takes, meaning what it means -------
CPU = "spec.roles.actor.resources.cpus"
MEMORY = "spec.roles.actor.resources.memory"
HEAD_CPU = "spec.head.cpus"

QUANTITIES_ACCEPTED = [
    (CPU, "500m", 0.5),
    (CPU, 1.5, 1.5),
    (CPU, 2, 2.0),
    (CPU, "2", 2.0),
    (CPU, "1.5", 1.5),
    (CPU, "1e0", 1.0),
    (HEAD_CPU, "250m", 0.25),
    (HEAD_CPU, "1m", 0.001),  # Kubernetes' smallest CPU unit
    (MEMORY, "2Gi", "2Gi"),
    (MEMORY, "2e9", "2e9"),
    (MEMORY, 2e9, "2000000000"),  # a YAML float: the bytes kubectl sends
    (MEMORY, 2147483648, "2147483648"),
    (MEMORY, "1.5Gi", "1.5Gi"),
    (MEMORY, "512M", "512M"),
]


@pytest.mark.parametrize(("path", "value", "stored"), QUANTITIES_ACCEPTED)
def test_kubernetes_quantities_are_accepted(path: str, value: Any, stored: Any) -> None:
    job = validate_manifest(set_path(TINY, path, value))
    section, field = path.split(".")[-2:]
    owner = job.spec.head if section == "head" else job.spec.roles.actor.resources
    assert getattr(owner, field) == stored


QUANTITIES_REFUSED = [
    (CPU, "500x", "'500x' is not a Kubernetes quantity", "write cores as a number"),
    (CPU, "2 cores", "is not a Kubernetes quantity", 'a quantity string such as "500m"'),
    (CPU, 0, "must be more than 0", "write cores"),
    (CPU, "-1", "must be more than 0", "write cores"),
    (CPU, True, "got bool", "write cores"),
    (CPU, [1], "got list", "write cores"),
    (CPU, "1e3m", "is not a Kubernetes quantity", "write cores"),  # one suffix or exponent
    (CPU, "2000", "less than or equal to 1024", "use a value <= 1024"),
    (CPU, 0.0001, "less than 1m, Kubernetes' smallest CPU unit", '"1m"'),
    (CPU, "0.4m", "less than 1m", "at least 0.001 cores"),
    (MEMORY, 2048, "2,048 bytes, too little for a container (a bare number is bytes", "2Gi"),
    (MEMORY, "2048", "a bare number is bytes, as in Kubernetes", '"2048Mi"'),
    (MEMORY, "2 Gi", "is not a Kubernetes quantity", '"16Gi" (2^30 bytes each)'),
    (MEMORY, "2GB", "is not a Kubernetes quantity", '"2G" (10^9)'),
    (MEMORY, "2gi", "is not a Kubernetes quantity", "a bare number is bytes"),
    (MEMORY, 1.5e9 + 0.5, "not a whole number of bytes", "16Gi"),
]


@pytest.mark.parametrize(("path", "value", "message", "fix"), QUANTITIES_REFUSED)
def test_non_quantities_are_refused_saying_what_kubernetes_reads(
    path: str, value: Any, message: str, fix: str
) -> None:
    with pytest.raises(SpecError) as info:
        validate_manifest(set_path(TINY, path, value))
    (problem,) = info.value.problems
    assert problem.path == path
    assert message in problem.message, problem
    assert fix in problem.fix, problem


def test_a_bare_memory_number_is_shown_as_bytes_in_the_size_check() -> None:
    doc = set_path(TINY, MEMORY, 2**20)
    doc = set_path(doc, "spec.data.rolloutBatchSize", 512)
    with pytest.raises(SpecError) as info:
        validate_manifest(doc)
    messages = [p.message for p in info.value.problems if p.path == MEMORY]
    assert any("more than the pod's 1048576 bytes (a bare number is bytes" in m for m in messages)
    for message in messages:  # (and the Ray pod's floor says it the same way)
        assert "1048576 bytes (a bare number is bytes" in message


# --- item 3: the CLI accepts exactly the keys the API server accepts ---------------------------
SNAKE_CASE = [
    ("spec.training.learning_rate", 1e-3, "learningRate"),
    ("spec.training.mini_batch_size", 64, "miniBatchSize"),
    ("spec.data.rollout_batch_size", 16, "rolloutBatchSize"),
    ("spec.algorithm.advantage_estimator", "grpo", "advantageEstimator"),
    ("spec.roles.rollout.colocate_with_actor", True, "colocateWithActor"),
    ("spec.head.node_selector", {"a": "b"}, "nodeSelector"),
    ("spec.image_pull_policy", "Always", "imagePullPolicy"),
    ("spec.scheduling.gang_scheduler", "none", "gangScheduler"),
]


@pytest.mark.parametrize(("path", "value", "alias"), SNAKE_CASE)
def test_snake_case_keys_are_refused_naming_the_camel_case_field(
    path: str, value: Any, alias: str
) -> None:
    with pytest.raises(SpecError) as info:
        validate_manifest(set_path(TINY, path, value))
    (problem,) = [p for p in info.value.problems if p.path == path]
    assert problem.message == "unknown field"
    assert f"write it as `{alias}`" in problem.fix


@pytest.mark.parametrize(("path", "value", "alias"), SNAKE_CASE)
def test_the_camel_case_neighbours_are_accepted(path: str, value: Any, alias: str) -> None:
    camel = path.rsplit(".", 1)[0] + "." + alias
    doc = set_path(TINY, camel, value)
    if alias == "advantageEstimator":
        doc = set_path(doc, "spec.data.samplesPerPrompt", 8)
    validate_manifest(doc)


@pytest.mark.parametrize(
    ("path", "fix"),
    [
        ("spec.roles.actor.resorces", "did you mean `resources`?"),
        ("spec.trainnig", "did you mean `training`?"),
        ("spec.head.tolerations", None),
        ("spec.roles.actor.zzz", "the fields here are replicas, resources,"),
    ],
)
def test_unknown_keys_name_the_nearest_field(path: str, fix: str | None) -> None:
    value: Any = [{"keyy": "a"}] if path.endswith("tolerations") else {}
    with pytest.raises(SpecError) as info:
        validate_manifest(set_path(TINY, path, value))
    (problem,) = info.value.problems
    if fix is None:  # a list item's unknown key: the item's own fields are searched
        assert problem.path == "spec.head.tolerations[0].keyy"
        assert "did you mean `key`?" in problem.fix
    else:
        assert problem.path == path and fix in problem.fix


def test_critic_overrides_keep_any_spelling_as_the_api_server_does() -> None:
    """The CRD stores spec.roles.critic.overrides as written (preserve-unknown-fields), so the
    override keys' spellings are the overrides' own rule, not the schema's."""
    doc = set_path(TINY, "spec.roles.critic", {"overrides": {"learning_rate": 1e-4}})
    job = validate_manifest(doc)
    assert job.spec.roles.critic is not None


def test_the_trainer_config_file_refuses_snake_case_too(tmp_path: Path) -> None:
    from ppojob_api.validation import load_trainer_config

    path = tmp_path / "trainer.yaml"
    path.write_text("training: {learning_rate: 0.001}\n")
    with pytest.raises(SpecError, match=r"config|training\.learning_rate") as info:
        load_trainer_config(path)
    assert "write it as `learningRate`" in str(info.value)


# --- item 8: YAML mistakes named as what they are -----------------------------------------------
SPEC = HEAD + "spec:\n  image: x\n  model: {path: 'builtin:tiny-llama'}\n"
YAML_MISTAKES = [
    (HEAD + "spec:\n\timage: x\n", "line 5, column 1: not valid YAML: a tab character", "tab"),
    (SPEC + "  roles:\n    actor: {}\n   rollout: {}\n", "indented differently", "lines 8-9"),
    (HEAD + "spec:\n  image: x: y\n", "holds `: ` in an unquoted value", "quote the value"),
    (HEAD + "spec: {image: [x\n", "an unclosed quote or bracket", "close the quote or bracket"),
    (SPEC + "on: 1\n", "on: the key `on` (line 7) is read as a boolean", '"on":'),
    (SPEC + "  roles: {actor: {nodeSelector: {yes: a}}}\n", "nodeSelector.yes: the key", '"yes":'),
]


@pytest.mark.parametrize(("text", "expected", "fix"), YAML_MISTAKES)
def test_yaml_mistakes_are_named_in_one_line(text: str, expected: str, fix: str) -> None:
    with pytest.raises(SpecError) as info:
        load_manifests(text)
    (problem,) = info.value.problems
    assert "\n" not in str(problem)
    assert expected in str(problem), problem
    assert fix in problem.fix, problem


@pytest.mark.parametrize(
    "text",
    [
        SPEC + '  roles: {actor: {nodeSelector: {"yes": a}}}\n',
        SPEC + "  data: {promptKey: 'q: a'}\n",
        HEAD + "spec:\n  image: x  # a comment\n  model: {path: 'builtin:tiny-llama'}\n",
    ],
)
def test_their_valid_neighbours_load(text: str) -> None:
    assert load_manifests(text)


# --- items 4 and 8: metadata by Kubernetes' rules, blamed once ---------------------------------
def _meta(**fields: Any) -> dict[str, Any]:
    doc = copy.deepcopy(TINY)
    doc["metadata"] = {"name": "job", **fields}
    return doc


METADATA_REFUSED = [
    ({"lables": {"a": "b"}}, "metadata.lables", "did you mean `labels`?"),
    ({"name": 123}, "metadata.name", "e.g. `name: my-job`"),
    ({"labels": {"team/a/b": "x"}}, "metadata.labels.team/a/b", "a key such as team"),
    ({"labels": {"team": "a b"}}, "metadata.labels.team", "a value of at most 63"),
    ({"labels": {"team": "x" * 64}}, "metadata.labels.team", "at most 63"),
    ({"labels": {"x" * 64: "a"}}, "metadata.labels." + "x" * 64, "a key such as team"),
    ({"labels": {"replicas": 3}}, "metadata.labels.replicas", 'quote it: replicas: "3"'),
    ({"labels": ["a"]}, "metadata.labels", "write metadata.labels: {key: value}"),
    ({"annotations": {"Bad Key": "x"}}, "metadata.annotations.Bad Key", "example.com/note"),
    ({"annotations": {"big": "x" * 262142}}, "metadata.annotations", "keep large data out"),
]


@pytest.mark.parametrize(("meta", "path", "fix"), METADATA_REFUSED)
def test_metadata_is_judged_by_kubernetes_rules_once(
    meta: dict[str, Any], path: str, fix: str
) -> None:
    doc = _meta(**meta)
    if "name" in meta:
        doc["metadata"] = meta
    with pytest.raises(SpecError) as info:
        validate_manifest(doc)
    (problem,) = info.value.problems
    assert problem.path == path and fix in problem.fix, problem


# the annotations below are 256 KiB exactly, keys and values together
METADATA_ACCEPTED = [
    {"labels": {"team": "a", "example.com/Team_x": "", "a.io/" + "n" * 63: "x" * 63}},
    {
        "annotations": {"Example.com/Note": "any text, spaces and all", "big": "x" * 262101}
    },  # 256 KiB exactly
    {"namespace": "ml", "generation": 2, "uid": "x", "resourceVersion": "1"},
]


@pytest.mark.parametrize("meta", METADATA_ACCEPTED)
def test_valid_metadata_neighbours_are_accepted(meta: dict[str, Any]) -> None:
    validate_manifest(_meta(**meta))


def test_another_object_in_the_file_is_named_not_repaired() -> None:
    pvc = "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {name: c}\n---\n"
    with pytest.raises(SpecError) as info:
        load_manifests(pvc + yaml.safe_dump(TINY))
    (problem,) = info.value.problems
    assert problem.path == "document 1: kind"
    assert "is a PersistentVolumeClaim (v1), not a PPOJob" in problem.message
    assert "in a file of its own" in problem.fix
    # its neighbour, a PPOJob with a wrong kind, is still told the kind to write
    wrong = copy.deepcopy(TINY)
    wrong["kind"] = "PPOjob"
    with pytest.raises(SpecError, match=r"kind: expected 'PPOJob'.*set kind: PPOJob"):
        validate_manifest(wrong)


# --- item 5: contradictions that would be resolved silently -------------------------------------
def test_two_jobs_of_one_name_in_a_file_are_refused() -> None:
    one = yaml.safe_dump(TINY)
    with pytest.raises(SpecError) as info:
        load_manifests(one + "---\n" + one)
    (problem,) = info.value.problems
    assert problem.path == "document 2: metadata.name"
    assert "also the name of document 1" in problem.message
    other = copy.deepcopy(TINY)
    other["metadata"]["name"] = "another"
    assert len(load_manifests(one + "---\n" + yaml.safe_dump(other))) == 2
    other["metadata"] = {"name": TINY["metadata"]["name"], "namespace": "elsewhere"}
    assert len(load_manifests(one + "---\n" + yaml.safe_dump(other))) == 2


@pytest.mark.parametrize(
    ("text", "path", "fix"),
    [
        (
            SPEC + "  actor: {replicas: 1}\n",
            "spec.actor",
            "a field of `roles`: indent it under roles:",
        ),
        (SPEC + "  steps: 3\n", "spec.steps", "a field of `training`: indent it under training:"),
        (SPEC + "  algorithm:\n    coefficient: 0.1\n", "spec.algorithm.coefficient", "under kl:"),
        (SPEC + "  coefficient: 0.1\n", "spec.coefficient", "a field of `algorithm.kl`"),
    ],
)
def test_a_key_indented_too_little_is_told_where_it_belongs(text: str, path: str, fix: str) -> None:
    with pytest.raises(SpecError) as info:
        load_manifests(text)
    (problem,) = info.value.problems
    assert problem.path == path and fix in problem.fix, problem


def test_a_key_at_its_right_depth_loads() -> None:
    assert load_manifests(SPEC + "  roles: {actor: {replicas: 1}}\n  training: {steps: 3}\n")


def test_a_list_too_short_says_how_to_fix_it() -> None:
    """pydantic's length errors carry a fix like every other message."""
    doc = set_path(TINY, "spec.model.lora", {"rank": 8, "targetModules": []})
    with pytest.raises(SpecError) as info:
        validate_manifest(doc)
    (problem,) = info.value.problems
    assert problem.path == "spec.model.lora.targetModules"
    assert problem.fix == "give at least 1 item, or remove the field", problem
