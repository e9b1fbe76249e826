"""The user documentation cannot drift from the code: the generated reference, every condition
and event reason, links, values keys, enums and the examples are checked here."""

from __future__ import annotations

import ast
import itertools
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml

from ppojob_api.crd import build_crd
from ppojob_api.reference import reference_markdown, write_reference
from ppojob_api.spec import PHASES
from ppojob_api.training import Algorithm, KLSpec, TrainingSettings
from ppojob_api.validation import load_manifests
from ppojob_operator import status as status_mod
from ppojob_operator.scheduling import GANG_SCHEDULERS
from tests.helpers.helm import CHART, ROOT

DOCS = ROOT / "docs"
OPERATOR = ROOT / "operator" / "ppojob_operator"
PAGES = [
    "index.md",
    "getting-started.md",
    "gang-scheduling.md",
    "reference.md",
    "trainer-guide.md",
    "architecture.md",
    "troubleshooting.md",
]
# Reasons KubeRay itself puts in a failed RayJob's status, which the operator passes through.
KUBERAY_FAILURE_REASONS = [
    "SubmissionFailed",
    "DeadlineExceeded",
    "AppFailed",
    "JobDeploymentStatusTransitionGracePeriodExceeded",
    "ValidationFailed",
]
DEPLOYMENT_STATUSES = [
    "",
    "New",
    "Initializing",
    "Waiting",
    "Running",
    "Complete",
    "Failed",
    "ValidationFailed",
    "Retrying",
    "Suspending",
    "Suspended",
    "SomethingNew",
]
JOB_STATUSES = ["", "PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED"]
# KubeRay marks a RayJob Complete only once its Ray job reached a terminal status.
TERMINAL_JOB_STATUSES = {"", "SUCCEEDED", "FAILED", "STOPPED"}


def _read(name: str) -> str:
    return (DOCS / name).read_text()


# ---------------------------------------------------------------------------------------------
# reference.md is generated
# ---------------------------------------------------------------------------------------------
def test_reference_is_up_to_date() -> None:
    assert _read("reference.md") == reference_markdown(), (
        "docs/reference.md is stale: python -m ppojob_api.reference > docs/reference.md"
    )


def test_reference_cli_and_writer(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ppojob_api.reference"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout == reference_markdown()
    target = write_reference(tmp_path / "ref.md")
    assert target.read_text() == reference_markdown()


def _crd_properties(node: dict[str, Any], path: str = "") -> list[tuple[str, dict]]:
    out = []
    for name, sub in (node.get("properties") or {}).items():
        out.append((f"{path}.{name}".lstrip("."), sub))
        out += _crd_properties(sub, f"{path}.{name}")
        if "items" in sub:
            out += _crd_properties(sub["items"], f"{path}.{name}[]")
    return out


def test_reference_documents_every_crd_field() -> None:
    """Every property of the CRD's schema is a row of the reference, with its description."""
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    text = _read("reference.md")
    rows = set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.M))
    for path, node in _crd_properties(schema):
        if path.startswith("metadata."):
            continue
        name = path.rsplit(".", 1)[-1]
        assert name in rows, f"{path} is missing from docs/reference.md"
        desc = node.get("description")
        if desc and path not in ("apiVersion", "kind", "metadata", "spec", "status"):
            assert desc in text, f"{path}: description missing from the reference"
        for value in node.get("enum", []):
            assert f"`{value}`" in text, f"{path}: enum value {value} not documented"


# ---------------------------------------------------------------------------------------------
# troubleshooting.md covers every reason
# ---------------------------------------------------------------------------------------------
def _status_reasons() -> set[str]:
    """Every reason the status logic can produce, by running it over every RayJob state, plus
    the CamelCase reason literals in status.py (and any REASONS collection it exports)."""
    reasons: set[str] = set(getattr(status_mod, "REASONS", ()))
    for dep, js, suspend, kueue in itertools.product(
        DEPLOYMENT_STATUSES, JOB_STATUSES, (False, True), (False, True)
    ):
        if dep == "Complete" and js not in TERMINAL_JOB_STATUSES:
            continue
        rayjob = {"status": {"jobDeploymentStatus": dep, "jobStatus": js}}
        phase, reason, _ = status_mod.phase_of(rayjob, suspend=suspend, kueue=kueue)
        assert phase in PHASES
        reasons.add(reason)
    tree = ast.parse((OPERATOR / "status.py").read_text())
    in_fstrings = {id(c) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for c in n.values}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in in_fstrings  # f-string pieces: covered by running phase_of
            and re.fullmatch(r"[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]+)+", node.value)
        ):
            reasons.add(node.value)
    return reasons


def _event_reasons() -> set[str]:
    """Reasons passed as constants to any operator function with a `reason` parameter
    (`k8s.post_event`, and wrappers such as a post-once helper): every event the operator posts."""
    trees = [ast.parse(p.read_text()) for p in sorted(OPERATOR.glob("*.py"))]
    reason_index: dict[str, int] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names = [a.arg for a in node.args.args]
                if "reason" in names:
                    reason_index[node.name] = names.index("reason")
    reasons: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            if name not in reason_index:
                continue
            args = [kw.value for kw in node.keywords if kw.arg == "reason"]
            if len(node.args) > reason_index[name]:
                args.append(node.args[reason_index[name]])
            for arg in args:
                for sub in ast.walk(arg):
                    if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                        reasons.add(sub.value)
    return reasons


def test_troubleshooting_documents_every_condition_reason() -> None:
    text = _read("troubleshooting.md")
    reasons = _status_reasons() | set(KUBERAY_FAILURE_REASONS)
    assert len(reasons) > 10
    missing = sorted(r for r in reasons if f"`{r}`" not in text)
    assert not missing, f"docs/troubleshooting.md does not explain: {missing}"


def test_troubleshooting_documents_every_event_reason() -> None:
    text = _read("troubleshooting.md")
    reasons = _event_reasons()
    assert reasons, "found no k8s.post_event calls"
    missing = sorted(r for r in reasons if f"`{r}`" not in text)
    assert not missing, f"docs/troubleshooting.md does not explain events: {missing}"


def test_troubleshooting_names_every_phase_and_condition_type() -> None:
    text = _read("troubleshooting.md")
    for word in (*PHASES, *status_mod.CONDITION_TYPES):
        assert f"`{word}`" in text, word


# ---------------------------------------------------------------------------------------------
# links, commands, values
# ---------------------------------------------------------------------------------------------
def _slug(heading: str) -> str:
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page: str) -> None:
    text = re.sub(r"```.*?```", "", _read(page), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans (a pattern such as `[a-z]([a-z])`)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file_part, _, anchor = target.partition("#")
        path = (DOCS / file_part).resolve() if file_part else DOCS / page
        assert path.exists(), f"{page}: broken link {target}"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{page}: no heading for #{anchor} in {path.name}"


def test_index_links_every_page() -> None:
    text = _read("index.md")
    for page in PAGES:
        if page != "index.md":
            assert f"({page})" in text, page


def test_getting_started_covers_the_whole_path() -> None:
    text = _read("getting-started.md")
    for needle in (
        "KubeRay",
        "gang-scheduling.md",
        "helm install ppojob charts/ppojob-operator",
        "kubectl apply -f examples/ppojob-tiny.yaml",
        "kubectl get ppojobs",
        "Succeeded",
        "troubleshooting.md",
    ):
        assert needle in text, needle
    assert (ROOT / "examples" / "ppojob-tiny.yaml").exists()


def _value_paths(values: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in values.items():
        path = f"{prefix}{key}"
        out.add(path)
        if isinstance(value, dict):
            out |= _value_paths(value, f"{path}.")
    return out


def test_documented_helm_values_exist() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    known = _value_paths(values)
    for page in PAGES:
        for line in _read(page).splitlines():
            if "helm" not in line and "--set" not in line:
                continue
            if "ppojob" not in line and "--set" in line and "kuberay" in line:
                continue
            if re.search(r"ppojob (run|validate) ", line):  # spec fields, not chart values
                continue
            for key in re.findall(r"--set '?([A-Za-z][\w.]*)=", line):
                if key.startswith("batchScheduler"):  # KubeRay's chart, not ours
                    continue
                parts = key.split(".")
                prefixes = {".".join(parts[: i + 1]) for i in range(len(parts))}
                assert prefixes & known, f"{page}: --set {key} is not a value of our chart"


def test_every_scheduler_has_a_section_with_its_kuberay_setting() -> None:
    text = _read("gang-scheduling.md")
    headings = {h.strip().lower() for h in re.findall(r"^## (.+)$", text, flags=re.M)}
    for name in GANG_SCHEDULERS:
        assert any(h.startswith(name) for h in headings), f"no section for {name}"
    settings = ["batchScheduler.name=volcano", "batchScheduler.name=yunikorn"]
    settings += ["batchScheduler.name=kai-scheduler"]
    settings += ["batchScheduler.enabled", "ray.io/rayjob", "scheduler-plugins-scheduler"]
    for setting in settings:
        assert setting in text, setting


def test_trainer_guide_names_every_choice() -> None:
    text = _read("trainer-guide.md")
    estimators = get_args(Algorithm.model_fields["advantage_estimator"].annotation)
    kl_estimators = get_args(KLSpec.model_fields["estimator"].annotation)
    for value in (*estimators, *kl_estimators, "reward", "loss"):
        assert f"`{value}`" in text, value
    for name, info in TrainingSettings.model_fields.items():
        assert f"`{info.alias or name}`" in text, f"overridable key {name} not in the guide"
    for section in (
        "Custom hooks",
        "Checkpoints and resume",
        "Backends: CPU and GPU",
        "The critic and its overrides",
        "KL to the reference policy",
    ):
        assert f"## {section}" in text


# ---------------------------------------------------------------------------------------------
# examples
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate(path: Path) -> None:
    jobs = load_manifests(path.read_text(), source=str(path))
    assert jobs


def test_gpu_examples_show_what_they_promise() -> None:
    (big,) = load_manifests((ROOT / "examples" / "ppojob-7b-megatron-volcano.yaml").read_text())
    s = big.spec
    assert s.roles.actor.backend == "megatron" and s.roles.actor.parallelism.tensor > 1
    assert s.roles.critic is not None and s.roles.critic.overrides
    assert s.roles.rollout.backend == "sglang" and not s.roles.rollout.colocate_with_actor
    assert s.roles.rollout.resources.gpus > 0
    assert s.scheduling.gang_scheduler == "volcano"
    assert s.checkpoint_volume is not None and s.checkpoint_volume.persistent_volume_claim
    (grpo,) = load_manifests((ROOT / "examples" / "ppojob-grpo-kueue.yaml").read_text())
    g = grpo.spec
    assert g.algorithm.advantage_estimator == "grpo"
    assert g.roles.rollout.backend == "sglang" and g.roles.rollout.colocate_with_actor
    assert g.scheduling.gang_scheduler == "kueue" and g.scheduling.queue


# Blocks with a PPOJob in them, per file: (full manifests, spec fragments). Exact, so a block
# that stops being recognised (a new fence style, a changed layout) fails here instead of
# silently dropping out of the check below.
PPOJOB_BLOCKS = {
    "README.md": (1, 0),
    "docs/gang-scheduling.md": (0, 5),
    "docs/trainer-guide.md": (0, 10),
}
# The smallest PPOJob: what a spec fragment of the docs is merged into.
BASE: dict[str, Any] = {
    "apiVersion": "ppojob.io/v1alpha1",
    "kind": "PPOJob",
    "metadata": {"name": "docs-fragment"},
    "spec": {"image": "registry.example.com/ppojob-trainer:0.1.0", "model": {"path": "/models/m"}},
}


def _user_docs() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _yaml_blocks(text: str) -> list[str]:
    return re.findall(r"^```ya?ml[ \t]*\n(.*?)^```", text, flags=re.S | re.M)


def _merged(base: Any, fragment: Any) -> Any:
    if isinstance(base, dict) and isinstance(fragment, dict):
        out = dict(base)
        for key, value in fragment.items():
            out[key] = _merged(base.get(key), value)
        return out
    return fragment


def _ppojob_blocks(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """(full PPOJob manifests as written, PPOJob spec fragments) of a page's ```yaml blocks.

    A document with `kind: PPOJob` is a full manifest; a document with no `kind` whose keys are
    `spec` or PPOJob spec fields is a fragment; a document of another kind is not ours. Any
    other YAML block fails: a fragment with a misspelled key must not slip through."""
    spec_fields = set(
        build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
            "properties"
        ]
    )
    full, fragments = [], []
    for block in _yaml_blocks(path.read_text()):
        docs = [d for d in yaml.safe_load_all(block) if d is not None]
        if any(isinstance(d, dict) and d.get("kind") == "PPOJob" for d in docs):
            full.append(block)
            continue
        for doc in docs:
            assert isinstance(doc, dict), f"{path.name}: a YAML block that is not a mapping"
            if "kind" in doc:
                continue
            spec = doc["spec"] if set(doc) == {"spec"} else doc
            unknown = sorted(set(spec) - spec_fields)
            assert not unknown, (
                f"{path.name}: YAML block with keys {unknown} is neither a manifest nor a PPOJob "
                "spec fragment"
            )
            fragments.append(spec)
    return full, fragments


def test_docs_ppojob_snippets_validate() -> None:
    """Every PPOJob in README.md and docs/*.md validates: full manifests as written, spec
    fragments merged into the smallest PPOJob (BASE)."""
    found = {}
    for path in _user_docs():
        name = str(path.relative_to(ROOT))
        full, fragments = _ppojob_blocks(path)
        for block in full:
            load_manifests(block, source=name)
        for fragment in fragments:
            doc = {**BASE, "spec": _merged(BASE["spec"], fragment)}
            load_manifests(yaml.safe_dump(doc), source=f"{name} (a spec fragment)")
        if full or fragments:
            found[name] = (len(full), len(fragments))
    assert found == PPOJOB_BLOCKS, (
        f"PPOJob blocks (full, fragments) per file: found {found}, expected {PPOJOB_BLOCKS}"
    )
