"""CPU generation on the real 0.5B (issue #42): load time, and decode speed of bf16 / float32 / NVFP4
with and without the dense-weight cache (qerl_kit.dense_cache), on GSM8K test problems 1, 10, 16.

    QERL_DATA=../shared/data python -m lab.real_model.cpu_generation [GGUF] [--tokens 320] [--threads N]

Prints a table and writes lab/results/real_model_cpu_generation.json when --save is given.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", nargs="?", default=os.path.expanduser("~/.cache/qerl-models/qwen2.5-coder-0.5b-instruct.gguf"))
    ap.add_argument("--tokens", type=int, default=320)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--save", action="store_true")
    ap.add_argument("--cases", nargs="+", default=["bf16", "float32", "nvfp4", "nvfp4-nocache"])
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from qerl_kit import dense_cache
    from qerl_kit.config import DataConfig
    from qerl_kit.models import load_pretrained
    from qerl_kit.quantize import quantize_model
    from qerl_kit.rollout.static import StaticEngine
    from qerl_kit.tasks import make_task

    task = make_task(DataConfig(dataset="gsm8k"))
    rows = [task.eval[i] for i in (1, 10, 16)]
    out = {"machine": platform.machine(), "processor": platform.processor(), "threads": torch.get_num_threads(),
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "tokens": a.tokens, "cases": {}}
    t0 = time.perf_counter()
    base, tok = load_pretrained(a.gguf)
    out["load_gguf_s"] = time.perf_counter() - t0
    print(f"load {out['load_gguf_s']:.1f} s")
    state = {k: v.clone() for k, v in base.state_dict().items()}
    for case in a.cases:
        model = base
        model.load_state_dict(state)
        if case == "float32":
            model = base.float()
        else:
            model = base.to(torch.bfloat16)
        if case.startswith("nvfp4"):
            import copy

            model = copy.deepcopy(base)
            quantize_model(model, fmt="nvfp4")
        engine = StaticEngine(model, tok)
        enabled = dense_cache.dense_weight_cache
        if case.endswith("nocache"):
            dense_cache.dense_weight_cache = lambda enabled=True: enabled_off()  # noqa: E731
        t = time.perf_counter()
        res = task.evaluate(model, tok, rows=rows, engine=engine, temperature=0.0, max_new_tokens=a.tokens)
        secs = time.perf_counter() - t
        dense_cache.dense_weight_cache = enabled
        toks = sum(sum(p["lengths"]) for p in res.per_problem)
        out["cases"][case] = {"seconds": secs, "tokens": toks, "tokens_per_s": toks / secs,
                              "scores": [p["scores"][0] for p in res.per_problem],
                              "lengths": [p["lengths"][0] for p in res.per_problem]}
        print(case, json.dumps(out["cases"][case]), flush=True)
    if a.save:
        Path("lab/results/real_model_cpu_generation.json").write_text(json.dumps(out, indent=1))


def enabled_off():
    import contextlib

    return contextlib.nullcontext()


if __name__ == "__main__":
    main()
