"""The PPOJob API as the real API server serves it: defaults, verdicts, columns, explain."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.cluster_jobs import PPOJOB, condition, gpu_job, status, table
from tests.helpers.controlplane import ROOT, wait_until

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def ppojob_validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ppojob_cli", "validate", str(path)],
        capture_output=True,
        text=True,
    )


def stored_manifest(obj: dict) -> dict:
    """The object as stored (the server's defaults filled in), without server-owned metadata."""
    meta = obj["metadata"]
    return {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "spec": obj["spec"],
    }


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_stored_gets_the_verdict_of_the_file(cp, operator, ns, example, tmp_path):
    file_verdict = ppojob_validate(example)
    cp.kubectl("apply", "-n", ns, "-f", str(example))
    name = yaml.safe_load(example.read_text())["metadata"]["name"]
    stored = cp.get(PPOJOB, name, ns)
    assert stored is not None
    stored_file = tmp_path / "stored.yaml"
    stored_file.write_text(yaml.safe_dump(stored_manifest(stored)))
    stored_verdict = ppojob_validate(stored_file)
    assert (stored_verdict.returncode == 0) == (file_verdict.returncode == 0), (
        f"file: {file_verdict.stdout}{file_verdict.stderr}\n"
        f"stored: {stored_verdict.stdout}{stored_verdict.stderr}"
    )
    # the operator judges the stored object: the same verdict in its Valid condition
    valid = wait_until(
        lambda: condition(status(cp, name, ns), "Valid").get("status"),
        60,
        f"the operator's Valid condition on {name}",
    )
    assert (valid == "True") == (file_verdict.returncode == 0), status(cp, name, ns)


def test_get_ppojobs_shows_the_printer_columns(cp, operator, ns):
    cp.apply(gpu_job("cols", ns))
    wait_until(lambda: status(cp, "cols", ns).get("rayJobName"), 60, "status.rayJobName")
    progress = {"step": 3, "totalSteps": 10, "rewardMean": 0.25, "kl": 0.01}
    cp.kubectl(
        "patch",
        PPOJOB,
        "cols",
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": {"progress": progress}}),
    )
    plain = cp.kubectl("get", "ppojobs", "-n", ns).stdout
    assert plain.split("\n")[0].split() == [
        "NAME",
        "PHASE",
        "REASON",
        "STEP",
        "STEPS",
        "REWARD",
        "GPUS",
        "AGE",
    ]
    wide = cp.kubectl("get", "ppojobs", "-n", ns, "-o", "wide").stdout
    header = wide.split("\n")[0].split()
    assert header == [
        "NAME",
        "PHASE",
        "REASON",
        "STEP",
        "STEPS",
        "REWARD",
        "KL",
        "GPUS",
        "RAYJOB",
        "AGE",
    ]
    (row,) = table(wide)
    assert row["NAME"] == "cols" and row["STEP"] == "3" and row["STEPS"] == "10"
    assert row["REWARD"] == "0.25" and row["KL"] == "0.01"
    assert row["GPUS"] == "4" and row["RAYJOB"] == "cols"

    def phase_and_reason_shown() -> bool:
        # (the operator may move the job on between a table and a status read: a table read
        # between two status reads that agree shows what the status held)
        before = status(cp, "cols", ns)
        (now,) = table(cp.kubectl("get", "ppojobs", "-n", ns, "-o", "wide").stdout)
        after = status(cp, "cols", ns)
        held = [(s["phase"], s["reason"]) for s in (before, after)]
        return (
            held[0] == held[1] and bool(now["REASON"]) and (now["PHASE"], now["REASON"]) == held[1]
        )

    wait_until(phase_and_reason_shown, 60, "the PHASE and REASON columns showing the status")
    # conditions are metav1.Condition-shaped: the API server keeps one per type (list map)
    conds = status(cp, "cols", ns)["conditions"]
    assert len({c["type"] for c in conds}) == len(conds)
    assert all(c["reason"] and c["lastTransitionTime"] for c in conds)
    # the short name works too
    assert "cols" in cp.kubectl("get", "ppo", "-n", ns).stdout


def test_kubectl_explain_prints_our_descriptions(cp):
    crd = yaml.safe_load((ROOT / "crds" / "ppojob.io_ppojobs.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    actor = schema["properties"]["spec"]["properties"]["roles"]["properties"]["actor"]
    out = wait_until(
        lambda: cp.kubectl("explain", "ppojob.spec.roles.actor", check=False).stdout,
        30,
        "kubectl explain (OpenAPI published)",
    )
    first_words = " ".join(actor["description"].split()[:6])
    assert first_words in " ".join(out.split()), out
    for field, sub in actor["properties"].items():
        assert f"{field}\t" in out or f"  {field} " in out or f"{field}\t<" in out, (field, out)
        assert sub.get("description"), field
    replicas = cp.kubectl("explain", "ppojob.spec.roles.actor.replicas").stdout
    desc = " ".join(actor["properties"]["replicas"]["description"].split()[:5])
    assert desc in " ".join(replicas.split()), replicas
