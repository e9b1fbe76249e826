"""Run by tests/trainer/backends/test_sglang_routing.py in a subprocess whose path holds the
pinned SGLang package: our reader of ``meta_info.routed_experts``
(``sglang_backend.routed_experts_of``) against SGLang's OWN writer of it, on the CPU: the
per-layer capture into its device buffer (``BaseDeviceCache.capture(layer_id, topk_ids)``, as
its ``TopK`` layers call it, ``[tokens, num_layers, top_k]`` int32), the detokenizer's
base64 encoding of each request's rows (``DetokenizerManager._b64_encode_per_request``) and
SGLang's own reader (``extract_routed_experts_from_meta_info``). Prints one JSON object on its
last line.

Our engines run with ``skip_tokenizer_init``, where the scheduler's output bypasses the
detokenizer and the tokenizer manager encodes the same tensor itself, by the same expression
(``pybase64.b64encode(val.numpy().tobytes())``, ``_handle_batch_output``); that method needs
the whole manager, so the detokenizer's twin stands for it here.

What is not SGLang's own here: the rows of one request are captured in one batch (SGLang
captures a prefill batch, then one decode batch per token, and gathers a request's rows from
its host buffer by its token slots, ``get_topk``: the same ``[seqlen - 1, layers, k]`` rows in
token order); the stand-in modules of ``sglang_runtime_driver`` and ``uvloop`` (the tokenizer
manager's event loop, which nothing here runs)."""

from __future__ import annotations

import asyncio
import json
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from sglang_runtime_driver import install_stand_ins

LAYERS, TOP_K, EXPERTS = 3, 2, 8


def main() -> None:
    install_stand_ins()
    uvloop = types.ModuleType("uvloop")
    uvloop.EventLoopPolicy = asyncio.DefaultEventLoopPolicy  # type: ignore[attr-defined]
    sys.modules["uvloop"] = uvloop
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    from sglang.srt.state_capturer.base import BaseDeviceCache
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    from ppojob_trainer.backends.sglang_backend import routed_experts_of

    gen = torch.Generator().manual_seed(0)
    requests = [(2, 3), (4, 1), (3, 4)]  # (prompt tokens, response tokens)
    plen = max(p for p, _ in requests)
    width = max(n for _, n in requests)
    prompt_mask = torch.zeros(len(requests), plen, dtype=torch.bool)
    outs, truth, theirs_ok = [], [], True
    for i, (p, n) in enumerate(requests):
        prompt_mask[i, plen - p :] = True
        rows = p + n - 1  # every fed token: the last sampled one is never fed
        routing = torch.randint(0, EXPERTS, (rows, LAYERS, TOP_K), generator=gen, dtype=torch.int32)
        cache = BaseDeviceCache(
            max_batch_size=rows,
            num_layers=LAYERS,
            topk_size=TOP_K,
            device="cpu",
            name="routed_experts",
        )
        for layer in range(LAYERS):
            cache.capture(layer, routing[:, layer])
        (encoded,) = DetokenizerManager._b64_encode_per_request([cache.buffer[:rows]])
        meta = {"routed_experts": encoded, "output_token_logprobs": [(-0.5, 4, None)] * n}
        theirs = extract_routed_experts_from_meta_info({"meta_info": meta})
        theirs_ok &= theirs.tolist() == routing.flatten().tolist()
        outs.append({"meta_info": meta})
        truth.append(routing)
    prompt, response = routed_experts_of(outs, prompt_mask, width, LAYERS, TOP_K)
    placed = True
    for i, (p, n) in enumerate(requests):
        placed &= prompt[i, plen - p :].tolist() == truth[i][:p].tolist()
        placed &= bool((prompt[i, : plen - p] == -1).all())
        placed &= response[i, : n - 1].tolist() == truth[i][p:].tolist()
        placed &= bool((response[i, n - 1 :] == -1).all())
    short = dict(outs[0])
    short["meta_info"] = {**outs[0]["meta_info"], "output_token_logprobs": [(-0.5, 4, None)] * 5}
    try:
        routed_experts_of([short], prompt_mask[:1], width, LAYERS, TOP_K)
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    print(
        json.dumps(
            {
                "sglang_reads_its_own": theirs_ok,
                "placed": placed,
                "shapes": [list(prompt.shape), list(response.shape)],
                "dtype": str(response.dtype),
                "refused_a_wrong_count": refused,
            }
        )
    )


if __name__ == "__main__":
    main()
