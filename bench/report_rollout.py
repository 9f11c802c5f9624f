"""Markdown tables from bench_rollout.py's results.json (rollout throughput, ratios, GRPO steps).

    python bench/report_rollout.py RESULTS_DIR > bench/results/rollout_h200.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VARIANTS = ["hf-bf16", "hf-nf4", "engine-bf16", "engine-nvfp4", "engine-nvfp4-aqn"]


def _fmt(x, spec=".0f"):
    return "" if x is None else format(x, spec)


def rollout_tables(rows: list[dict]) -> list[str]:
    out = []
    models = list(dict.fromkeys(r["model"] for r in rows))
    by = {(r["model"], r["variant"], r["batch"]): r for r in rows}
    for m in models:
        batches = sorted({r["batch"] for r in rows if r["model"] == m})
        have = [v for v in VARIANTS if any((m, v, b) in by for b in batches)]
        out += [f"### {m}", "",
                "tokens/s (decode ms/step in parentheses; `floor` = bytes per step / copy bandwidth)", "",
                "| batch | " + " | ".join(have) + " | floor ms bf16 / NVFP4 | NVFP4 / bf16 (engine) | engine x floor bf16 / NVFP4 |",
                "|---:|" + "---:|" * len(have) + "---:|---:|---:|"]
        for b in batches:
            cells = []
            for v in have:
                r = by.get((m, v, b))
                cells.append("" if r is None else f"{r['tokens_per_s']:.0f} ({r['decode_ms_per_step']:.2f})")
            nv, bf = by.get((m, "engine-nvfp4", b)), by.get((m, "engine-bf16", b))
            floors = " / ".join(_fmt(r["floor_ms_per_step"], ".2f") if r else "-" for r in (bf, nv))
            ratio = f"{nv['tokens_per_s'] / bf['tokens_per_s']:.2f}x" if nv and bf else ""
            xf = " / ".join(f"{r['x_floor']:.2f}" if r else "-" for r in (bf, nv))
            out.append(f"| {b} | " + " | ".join(cells) + f" | {floors} | {ratio} | {xf} |")
        out.append("")
    return out


def step_table(rows: list[dict]) -> list[str]:
    out = ["`step` 0 is a model's first step: it includes Triton autotuning and CUDA-graph capture "
           "(big models ran one step only, to fit the device time).", "",
           "| model | format | grad. ckpt | keep cache | step | step s | rollout s | log-prob s | update s | peak GiB |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        fmt = "bf16" if r["format"] == "none" else r["format"]
        out.append(f"| {r['model']} | {fmt} | {r['checkpointing']} | {r['keep_cache']} | {r['step_index']} | {r['time_step']:.1f} | "
                   f"{r['time_rollout']:.1f} | {r['time_logprob']:.1f} | {r['time_update']:.1f} | {r['peak_gib']:.1f} |")
    return out


def main(path: str) -> None:
    res = json.loads((Path(path) / "results.json").read_text())
    meta = res["meta"]
    a = meta["args"]
    lines = [f"GPU {meta['device']}, {meta['date']}, torch {meta['torch']}, transformers {meta.get('transformers')}, "
             f"triton {meta.get('triton')}; same-run copy bandwidth {meta['copy_bandwidth_GBps']:.0f} GB/s.",
             f"Prompt {a['prompt']} tokens, {a['new']} generated tokens at fixed length, LoRA r={a['lora_r']}, "
             f"temperature 1; transformers' generate timed over {a['hf_tokens']} tokens and extrapolated.", ""]
    if res.get("check"):
        lines += ["Engine correctness on this GPU (bf16 NVFP4 + LoRA, small random models):", "",
                  "| model | graphs == eager tokens | greedy log-prob vs HF forward (max abs) | "
                  "sampled log-prob vs HF forward (max abs) |", "|---|---|---:|---:|"]
        for k, v in res["check"].items():
            lines.append(f"| {k} | {v['graph_eq_eager_tokens']} | {v['greedy_logprob_vs_hf_forward_maxdiff']:.4f} | "
                         f"{v['sampled_logprob_vs_hf_forward_maxdiff']:.4f} |")
        lines.append("")
    if res.get("rollout"):
        lines += ["## Rollout", ""] + rollout_tables(res["rollout"])
    if res.get("step"):
        lines += ["## One GRPO step (8 prompts x 8 samples)", ""] + step_table(res["step"])
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/rollout")
