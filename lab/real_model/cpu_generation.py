"""CPU generation on the real 0.5B (issue #42): does a 4-bit model still dequantize every layer at
every token? Times greedy decoding of GSM8K test problems 1, 10 and 16 on the StaticEngine with the
dense base (bf16, as ``load_pretrained`` gives a GGUF) and with NVFP4, with and without
the dense-weight cache (``qerl_kit.dense_cache``), and checks that the cache changes no token.

    QERL_DATA=../shared/data python -m lab.real_model.cpu_generation [MODEL] [--tokens 32] [--save]

MODEL: a .gguf file or a converted directory (default: the fetched 0.5B GGUF). --save writes
lab/results/real_model_generation_cpu.json.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?",
                    default=os.path.expanduser("~/.cache/qerl-models/qwen2.5-coder-0.5b-instruct.gguf"))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--save", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from qerl_kit import dense_cache
    from qerl_kit.config import DataConfig
    from qerl_kit.models import load_pretrained
    from qerl_kit.quantize import quantize_model
    from qerl_kit.rollout.static import StaticEngine
    from qerl_kit.rollout.types import SamplingParams
    from qerl_kit.tasks import make_task

    task = make_task(DataConfig(dataset="gsm8k", eval_size=20))
    out = {"machine": platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__, "model": a.model,
           "date": time.strftime("%Y-%m-%d"), "new_tokens": a.tokens, "problems": [1, 10, 16], "cases": {}}
    t0 = time.perf_counter()
    dense, tok = load_pretrained(a.model)
    out["load_s"] = time.perf_counter() - t0
    out["dtype"] = str(dense.dtype).replace("torch.", "")
    prompts = task.encode(tok, [task.eval[i] for i in (1, 10, 16)])
    nvfp4 = copy.deepcopy(dense)
    quantize_model(nvfp4, fmt="nvfp4")
    sampling = SamplingParams(max_new_tokens=a.tokens, temperature=0.0)
    real_cache = dense_cache.dense_weight_cache
    ids = {}
    for case, model, cache in (("dense", dense, True), ("nvfp4, cache", nvfp4, True),
                               ("nvfp4, no cache", nvfp4, False)):
        if not cache:  # the old behaviour: every layer dequantized at every call
            dense_cache.dense_weight_cache = lambda enabled=True: contextlib.nullcontext()
        try:
            engine = StaticEngine(model, tok)
            t = time.perf_counter()
            gen = engine.generate_ids(prompts, 1, sampling)
            secs = time.perf_counter() - t
        finally:
            dense_cache.dense_weight_cache = real_cache
        ids[case] = gen.completion_ids
        out["cases"][case] = {"seconds": secs, "decode_s_per_step": gen.stats["rollout/decode_seconds"] / max(1, a.tokens - 1),
                              "prefill_s": gen.stats["rollout/prefill_seconds"]}
        print(case, json.dumps(out["cases"][case]), flush=True)
    out["same_tokens_with_and_without_cache"] = bool(torch.equal(ids["nvfp4, cache"], ids["nvfp4, no cache"]))
    out["speedup"] = out["cases"]["nvfp4, no cache"]["seconds"] / out["cases"]["nvfp4, cache"]["seconds"]
    print(json.dumps({k: out[k] for k in ("load_s", "same_tokens_with_and_without_cache", "speedup")}))
    if a.save:
        Path("lab/results/real_model_generation_cpu.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
