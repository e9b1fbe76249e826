"""A batch of hand-written bad manifests, as a new user would write them (issue 23): how many get a
clear answer from `ppojob validate`.

Method: each entry is a small YAML edit of examples/ppojob-tiny.yaml (or a whole text) written by
hand for this batch, none copied from the tests. Each is judged exactly as the generated corpus
judges (tests/helpers/bad_manifests.py `judge`): *clear* = refused with every problem one line,
with a fix, naming a field of the input or the schema; *accepted* = validate accepts (then the
trainer's loader must too); *unclear* or *crash* otherwise. The batch is meant to be refused
throughout, so an acceptance counts as a miss. Prints each verdict, the share answered clearly,
and the slowest verdict.

    PYTHONPATH=api:operator:trainer:cli:. python -m bench.bad_input_batch
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.bad_manifests import judge

TINY = (Path(__file__).parents[1] / "examples" / "ppojob-tiny.yaml").read_text()
HEAD = "apiVersion: ppojob.io/v1alpha1\nkind: PPOJob\nmetadata:\n  name: my-job\n"


RES = "{cpus: 2, memory: 2Gi}"
IMAGE = "image: ghcr.io/ppojob/trainer:0.1.0-cpu"
LR = "learningRate: 1.0e-3"
ROLLOUT = "    rollout:"
NAME = "  name: tiny-count-up"


def edit(old: str, new: str) -> str:
    assert old in TINY, old
    return TINY.replace(old, new, 1)


BATCH: list[tuple[str, str]] = [
    ("cpu as a pod writes it, but typo'd", edit(RES, "{cpus: 2core, memory: 2Gi}")),
    ("memory in GB", edit(RES, "{cpus: 2, memory: 2GB}")),
    ("memory as a bare number meant as MiB", edit(RES, "{cpus: 2, memory: 2048}")),
    ("gpus as a string", edit(RES, '{cpus: 2, memory: 2Gi, gpus: "1"}')),
    ("snake_case learning rate", edit(LR, "learning_rate: 1.0e-3")),
    ("kebab-case key", edit("rolloutBatchSize: 16", "rollout-batch-size: 16")),
    ("estimator misspelt", edit("advantageEstimator: gae", "advantageEstimator: GRPO")),
    ("a tab in the indentation", edit("    seed: 1", "\tseed: 1")),
    ("dedented training key", edit("    seed: 1", "  seed: 1")),
    ("name with upper case", edit("name: tiny-count-up", "name: Tiny-Count-Up")),
    ("name too long", edit("name: tiny-count-up", "name: " + "a" * 60)),
    ("labels misspelt", edit(NAME, "  name: tiny-count-up\n  lables: {team: a}")),
    ("label value with a space", edit(NAME, "  name: tiny-count-up\n  labels: {team: ml team}")),
    ("image with a space", edit(IMAGE, "image: ghcr.io/ppojob/trainer 0.1.0")),
    ("image with upper case", edit(IMAGE, "image: ghcr.io/PPOJob/trainer:0.1.0")),
    (
        "toleration Exists with value",
        edit(
            ROLLOUT, "      tolerations: [{key: gpu, operator: Exists, value: 'true'}]\n" + ROLLOUT
        ),
    ),
    ("nodeSelector with a number", edit(ROLLOUT, "      nodeSelector: {gpu-count: 8}\n" + ROLLOUT)),
    (
        "priority class upper case",
        edit("gangScheduler: none", "gangScheduler: none\n    priorityClassName: High"),
    ),
    ("kueue without a queue", edit("gangScheduler: none", "gangScheduler: kueue")),
    ("minibatch not dividing", edit("miniBatchSize: 64", "miniBatchSize: 60")),
    ("negative steps", edit("steps: 500", "steps: -5")),
    ("learning rate as a string", edit(LR, 'learningRate: "1e-3"')),
    ("KL estimator unknown", edit("estimator: low_var_kl", "estimator: k4")),
    (
        "env setting CUDA_VISIBLE_DEVICES",
        edit(ROLLOUT, "      env: [{name: CUDA_VISIBLE_DEVICES, value: '0'}]\n" + ROLLOUT),
    ),
    ("duplicate key", edit("    seed: 1", "    seed: 1\n    seed: 2")),
    ("yes as a key", TINY + "  yes: true\n"),
    (
        "a PVC in the same file",
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {name: c}\n---\n" + TINY,
    ),
    ("two jobs of one name", TINY + "\n---\n" + TINY),
    ("empty spec", HEAD + "spec: {}\n"),
    ("spec as a list", HEAD + "spec:\n  - image: x\n"),
    ("unclosed bracket", edit("{cpus: 1, memory: 3Gi}", "{cpus: 1, memory: 3Gi")),
    ("recursive alias", edit("  model:", "  x: &a [*a]\n  model:")),
    (
        "prompts file of another format",
        edit("prompts: builtin:count-up", "prompts: /data/train.csv\n    rewardFunction: r:score"),
    ),
    (
        "reward function as a file name",
        edit(
            "prompts: builtin:count-up", "prompts: builtin:count-up\n    rewardFunction: reward.py"
        ),
    ),
]


def main() -> None:
    clear, slowest = 0, 0.0
    for name, text in BATCH:
        verdict = judge(text)
        slowest = max(slowest, verdict.seconds)
        ok = verdict.kind == "clear"
        clear += ok
        first = verdict.lines[0] if verdict.lines else verdict.why or "(accepted)"
        print(f"{'clear ' if ok else verdict.kind:8} {name}: {first[:160]}")
    share = clear / len(BATCH)
    print(f"\n{clear} of {len(BATCH)} answered clearly ({share:.0%}); slowest {slowest:.3f}s")


if __name__ == "__main__":
    main()
