"""bench/weight_sync.py runs end to end on a small Qwen2-shaped model: three processes over gloo
on loopback, both methods bring the sender's tensors to both engines bit for bit, with the same
bytes; the packed sync makes one collective per packed bucket, the per-tensor one per tensor."""

from __future__ import annotations

from bench.weight_sync import qwen2_shapes, run


def test_the_bench_syncs_a_small_model_to_two_engines() -> None:
    shapes = qwen2_shapes(layers=2, hidden=56, inter=64, vocab=97)
    out = run(syncs=1, bucket_mb=0.02, layers=2, warmup=0, shapes=shapes)
    assert out["equal"]
    packed, per_tensor = out["results"]["packed"][0], out["results"]["per-tensor"][0]
    assert packed["bytes"] == per_tensor["bytes"] == out["model_bytes"]
    assert per_tensor["collectives"] == out["tensors"] == len(shapes)
    assert packed["collectives"] == packed["buckets"] < per_tensor["collectives"]
