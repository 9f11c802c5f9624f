"""Realistic completion lengths on our engine: decoding live rows only (compaction) against
decoding every row until the longest stops, with the fixed-length step time as the yardstick.

    python -m bench.bench_live_rows --out OUT            # the H200 run
    python -m bench.bench_live_rows --smoke --out /tmp/x # CPU smoke (tiny preset)

Per case (model preset x format bf16 | nvfp4, + LoRA r32, x batch; random weights, random prompts
of ``--prompt`` tokens), completion lengths are drawn from a committed distribution: lognormal with
mean ``--mean`` (300) and log-std ``--sigma`` (0.8), capped at ``--cap`` (1024), seed 0. They are
forced with ``StaticEngine.generate_ids(stop_after=...)`` (random weights never stop on their own).
Each mode runs twice, the first to capture graphs; the second is timed:

* ``dense``: ``compact=False``, every row decodes until the longest stops: its ms per step is the
  fixed-length step time over the same lengths;
* ``live``: ``compact=True``.

``ratio = live wall / (mean length x dense ms per step)``; the issue's target is <= 1.3.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import random
import time
from pathlib import Path

import torch

from bench.common import build, free, log, random_prompts, sync, with_lora
from qerl_kit.rollout import SamplingParams, StaticEngine


def lengths_for(batch: int, mean: float, sigma: float, cap: int, seed: int = 0) -> list[int]:
    """``batch`` lognormal lengths of mean ``mean`` (before the cap), in [1, cap]."""
    rng = random.Random(f"lengths/{seed}/{batch}")
    mu = math.log(mean) - sigma ** 2 / 2
    return [max(1, min(cap, round(rng.lognormvariate(mu, sigma)))) for _ in range(batch)]


def add_length_args(ap: argparse.ArgumentParser) -> None:
    """The prompt length and the completion-length distribution: one definition for this script and
    ``bench.bench_vllm_lengths``, so both draw the same lengths."""
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--mean", type=float, default=300.0)
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--cap", type=int, default=1024)


def run_case(model, prompts, lengths, compact: bool, check_every: int = 32) -> dict:
    engine = StaticEngine(model, None, max_prefill_tokens=32768, compact=compact, check_every=check_every)
    sp = SamplingParams(max_new_tokens=max(lengths), temperature=1.0, seed=0)
    engine.generate_ids(prompts, 1, sp, ignore_eos=True, stop_after=lengths)  # graph capture
    sync()
    t = time.perf_counter()
    out = engine.generate_ids(prompts, 1, sp, ignore_eos=True, stop_after=lengths)
    sync()
    wall = time.perf_counter() - t
    assert out.completion_mask.sum(1).tolist() == lengths
    steps = max(lengths) - 1
    row = dict(wall_s=wall, prefill_s=out.stats["rollout/prefill_seconds"], decode_s=out.stats["rollout/decode_seconds"],
               ms_per_step=1e3 * out.stats["rollout/decode_seconds"] / max(steps, 1),
               row_steps=out.stats["rollout/row_steps"], dense_row_steps=out.stats["rollout/dense_row_steps"],
               compactions=out.stats["rollout/compactions"], path=engine.decoder.path)
    engine.reset()
    del engine
    free()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results/live_rows"))
    ap.add_argument("--models", nargs="+", default=["Qwen2.5-7B"])
    ap.add_argument("--formats", nargs="+", default=["nvfp4", "bf16"])
    ap.add_argument("--batches", nargs="+", type=int, default=[64, 256])
    add_length_args(ap)
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--check-every", type=int, default=32, help="the engine's stop check (and compaction) interval")
    ap.add_argument("--budget", type=float, default=520.0, help="seconds after which remaining cases are skipped")
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny preset, short lengths")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.models, args.batches, args.prompt, args.mean, args.cap, args.lora_r = ["qwen2-tiny"], [8], 8, 12.0, 32, 4
        args.check_every = 4
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = []
    for preset in args.models:
        for fmt in args.formats:
            if time.perf_counter() - t0 > args.budget:
                log(f"budget spent: skip {preset} {fmt}")
                continue
            model = with_lora(build(preset, fmt, device), args.lora_r)
            vocab = model.get_base_model().config.vocab_size
            for batch in args.batches:
                if time.perf_counter() - t0 > args.budget:
                    log(f"budget spent: skip {preset} {fmt} batch {batch}")
                    continue
                lengths = lengths_for(batch, args.mean, args.sigma, args.cap)
                prompts = random_prompts(batch, args.prompt, vocab)
                case = dict(model=preset, format=fmt, batch=batch, prompt=args.prompt, mean_length=sum(lengths) / batch,
                            max_length=max(lengths), lengths_sha=hash_lengths(lengths))
                dense = run_case(model, prompts, lengths, compact=False, check_every=args.check_every)
                live = run_case(model, prompts, lengths, compact=True, check_every=args.check_every)
                ratio = live["wall_s"] / (case["mean_length"] * dense["ms_per_step"] / 1e3)
                rows.append({**case, "dense_wall_s": dense["wall_s"], "dense_ms_per_step": dense["ms_per_step"],
                             "live_wall_s": live["wall_s"], "live_decode_s": live["decode_s"],
                             "live_row_steps_share": live["row_steps"] / live["dense_row_steps"],
                             "compactions": live["compactions"], "speedup": dense["wall_s"] / live["wall_s"],
                             "ratio_to_mean_length": ratio, "path": live["path"]})
                log(f"{preset} {fmt} batch {batch}: mean len {case['mean_length']:.0f} (max {case['max_length']}), "
                    f"dense {dense['wall_s']:.2f}s ({dense['ms_per_step']:.2f} ms/step), live {live['wall_s']:.2f}s "
                    f"({live['compactions']} compactions, {rows[-1]['live_row_steps_share']:.0%} of row-steps), "
                    f"ratio {ratio:.2f}")
            del model
            free()
    meta = dict(date=time.strftime("%Y-%m-%d"), machine=platform.node(), device=torch.cuda.get_device_name() if device == "cuda"
                else platform.processor(), torch=torch.__version__, args=vars(args))
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        meta["humming_kernels"] = version("humming-kernels")
    except Exception:  # noqa: BLE001 - not installed
        pass
    (out / "live_rows.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    if rows:
        with open(out / "live_rows.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    log(f"wrote {out}")


def hash_lengths(lengths: list[int]) -> str:
    import hashlib

    return hashlib.sha256(",".join(map(str, lengths)).encode()).hexdigest()[:12]


if __name__ == "__main__":
    main()
