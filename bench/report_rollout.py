"""Markdown tables from bench_rollout.py's results.json (rollout throughput, ratios, GRPO steps).

    python -m bench.report_rollout RESULTS_DIR > bench/results/rollout_h200.md
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


def merge(results: list[dict]) -> dict:
    """Several runs' results.json as one: a case measured again (same model, variant and batch; same
    step model, format and checkpointing) takes the later run's row; ``meta["runs"]`` lists them all."""
    rollout, step, check = {}, {}, {}
    for res in results:
        for r in res.get("rollout") or []:
            rollout[(r["model"], r["variant"], r["batch"])] = r
        for r in res.get("step") or []:
            step[(r["model"], r["format"], r["checkpointing"])] = r
        check.update(res.get("check") or {})
    runs = [m for res in results for m in _runs(res["meta"])]
    return {"meta": {**results[-1]["meta"], "runs": runs}, "check": check,
            "rollout": list(rollout.values()), "step": list(step.values())}


def _runs(meta: dict) -> list[dict]:
    """A results.json's runs: itself, or those it lists (older merges kept a dict of partial metas)."""
    runs = meta.get("runs")
    if runs is None:
        return [meta]
    if isinstance(runs, dict):
        top = {k: v for k, v in meta.items() if k not in ("runs", "args")}
        return [{**top, **r} for r in runs.values()]
    return runs


def report(res: dict) -> str:
    runs = _runs(res["meta"])
    a = runs[0]["args"]
    lines = [f"GPU {m['device']}, {m['date']}, torch {m['torch']}, transformers {m.get('transformers')}, "
             f"triton {m.get('triton')}; same-run copy bandwidth {m['copy_bandwidth_GBps']:.0f} GB/s"
             + (f" (run {i}: {', '.join(m['args']['models'])}, parts {' '.join(m['args']['parts'])})" if len(runs) > 1 else ".")
             + (f"; {m['note']}." if m.get("note") else "")
             for i, m in enumerate(runs, 1)]
    lines += ["", f"Prompt {a['prompt']} tokens, {a['new']} generated tokens at fixed length, LoRA r={a['lora_r']}, "
              f"temperature 1; transformers' generate timed over {a['hf_tokens']} tokens and extrapolated. "
              "Each row's floor uses the copy bandwidth of the run that measured it.", ""]
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
        notes = [r["note"] for r in res["step"] if r.get("note")]
        lines += ["## One GRPO step (8 prompts x 8 samples)", ""] + [f"**Note**: {n}" for n in dict.fromkeys(notes)]
        lines += [""] * bool(notes) + step_table(res["step"])
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """``report_rollout.py DIR [DIR ...] [--write DIR]``: the report of one run or of several merged
    (later runs win); ``--write`` also saves the merged results.json, rollout.csv and step.csv."""
    write_to = None
    if "--write" in argv:
        i = argv.index("--write")
        write_to, argv = Path(argv[i + 1]), argv[:i] + argv[i + 2:]
    res = merge([json.loads((Path(p) / "results.json").read_text()) for p in (argv or ["bench/results/rollout"])])
    if write_to is not None:
        from bench.common import write

        write({k: v for k, v in res.items() if v}, write_to, log=False)
    print(report(res))


if __name__ == "__main__":
    main(sys.argv[1:])
