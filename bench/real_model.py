"""Issue #42 on a real model: accuracy per base format, and the Trainer.evaluate() regression.

    python -m bench.real_model convert MODEL.gguf DIR      # dequantize once (bf16 safetensors + tokenizer)
    python -m bench.real_model eval DIR --out OUT [--formats none nvfp4 mxfp4 nf4] [--tasks gsm8k math500]
                                        [--pass-k 8] [--limit N]
    python -m bench.real_model regress DIR --out OUT [--steps 14]
    python -m bench.real_model load-time MODEL.gguf [--rounds 3]   # load_gguf with and without one_parse

``eval``: greedy pass@1 on every row of each task (GSM8K test 1319 at 512 new tokens, MATH-500 at
1024), through the same path ``qerl eval`` takes (``evaluate_task`` on the StaticEngine, all rows
in one engine call); with ``--pass-k K`` also K samples per problem at the paper's evaluation
sampling (temperature 0.6, top-p 0.95). One JSON per (format, task, mode) under OUT with accuracy,
pass@k, mean length, truncation rate, tokens/s, wall time, peak memory, and the first 20
completions; ``summary.md`` is the table.

``regress``: the issue's crash, replayed: NVFP4 + LoRA + AQN GRPO on GSM8K train for ``--steps``
steps (8 prompts x 8, 256 tokens), ``Trainer.evaluate()`` on 64 test problems after step 2 and
after every step from 10 on. Then the mechanism: a dropped engine state holding captured graphs,
collected by ``gc.collect()`` inside the next capture, with the fix (``DecodeState.release``) and with
it disabled. Writes ``regress.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from qerl_kit.formats import DENSE
from qerl_kit.formats import FORMATS as _REGISTERED

TASK_LENGTH = {"gsm8k": 512, "math500": 1024}
FORMATS = (DENSE, *_REGISTERED)  # bf16 first, then every registered format (qerl_kit.formats.FORMATS)


def _env() -> dict:
    import transformers

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def convert(gguf: str, out: str) -> None:
    from qerl_kit.gguf_model import load_gguf

    t0 = time.perf_counter()
    model, tok = load_gguf(gguf)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    info = model.gguf_info
    Path(out, "gguf_info.json").write_text(json.dumps({"file": str(info.path), "name": info.name,
                                                       "architecture": info.architecture, "tied_head": info.tied_head,
                                                       "tensor_types": info.tensor_types,
                                                       "seconds": time.perf_counter() - t0}))
    print(f"converted {gguf} -> {out} in {time.perf_counter() - t0:.1f} s")


def load_time(gguf: str, rounds: int) -> list[dict]:
    """``load_gguf``'s wall time with ``one_parse`` (one GGUFReader per file) and without it (transformers'
    own parses), alternated over ``rounds`` so a drift of the machine reaches both; prints a table."""
    import contextlib

    from qerl_kit import gguf_model

    shared, rows = gguf_model.one_parse, []
    try:
        for r in range(rounds):
            for mode in ("one parse", "a parse per reader") if r % 2 == 0 else ("a parse per reader", "one parse"):
                gguf_model.one_parse = shared if mode == "one parse" else contextlib.nullcontext
                t0 = time.perf_counter()
                gguf_model.load_gguf(gguf)
                rows.append({"round": r, "mode": mode, "seconds": round(time.perf_counter() - t0, 2)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        gguf_model.one_parse = shared
    env = _env()
    print(f"\n{Path(gguf).name}, {env['date']}, torch {env['torch']}, transformers {env['transformers']}, "
          f"{os.cpu_count()} CPUs, {torch.get_num_threads()} threads\n")
    print("| mode | seconds per load (each round) | median |\n|---|---|---:|")
    for mode in ("a parse per reader", "one parse"):
        secs = sorted(x["seconds"] for x in rows if x["mode"] == mode)
        print(f"| {mode} | {', '.join(str(x['seconds']) for x in rows if x['mode'] == mode)} | {secs[len(secs) // 2]} |")
    return rows


def _load(path: str, fmt: str, device: str):
    from qerl_kit.models import load_pretrained
    from qerl_kit.quantize import quantize_model

    model, tok = load_pretrained(path, dtype=torch.bfloat16, device=device)
    if fmt != "none":
        quantize_model(model, fmt=fmt)
    return model, tok


def evaluate_formats(path: str, out: str, formats, tasks, pass_k: int, limit: int | None,
                     only_pass_k: bool = False) -> list[dict]:
    from qerl_kit.config import DataConfig
    from qerl_kit.evaluate import evaluate_task
    from qerl_kit.rollout.static import StaticEngine
    from qerl_kit.tasks import make_task

    device = "cuda" if torch.cuda.is_available() else "cpu"
    Path(out).mkdir(parents=True, exist_ok=True)
    rows = []
    for fmt in formats:
        torch.cuda.empty_cache() if device == "cuda" else None
        model, tok = _load(path, fmt, device)
        engine = StaticEngine(model, tok, max_rows=int(os.environ.get("QERL_EVAL_MAX_ROWS", 2048)))
        for name in tasks:
            task = make_task(DataConfig(dataset=name, eval_size=limit or 10**9))
            modes = [] if only_pass_k else [("greedy", dict(samples=1, temperature=0.0))]
            if pass_k > 1:
                modes.append((f"pass{pass_k}", dict(samples=pass_k, temperature=0.6, top_p=0.95)))
            for mode, kw in modes:
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                res = evaluate_task(task, model, tok, engine=engine, max_new_tokens=TASK_LENGTH[name], **kw)
                wall = time.perf_counter() - t0
                row = {"format": fmt, "task": name, "mode": mode, "problems": res.num_problems,
                       "samples": res.samples, "accuracy": res.accuracy, "pass_at_k": res.pass_at_k,
                       "mean_length": res.mean_length, "truncation_rate": res.truncation_rate,
                       "tokens_per_s": res.stats.get("rollout/tokens_per_s"), "wall_s": wall,
                       "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
                       "max_new_tokens": TASK_LENGTH[name], **_env()}
                rows.append(row)
                first = [{k: p[k] for k in ("index", "answer", "scores", "lengths")} | {"completion": p["completions"][0]}
                         for p in res.per_problem[:20]]
                # every problem's pass rate, in test order: paired comparisons between formats
                rates = [p["pass_rate"] for p in res.per_problem]
                Path(out, f"{fmt}_{name}_{mode}.json").write_text(json.dumps({**row, "pass_rates": rates,
                                                                             "first": first}, indent=1))
                _table(rows, Path(out, "summary.md"), quiet=True)  # kept current: a timed-out call keeps its rows
                print(json.dumps({k: row[k] for k in ("format", "task", "mode", "accuracy", "pass_at_k",
                                                      "mean_length", "truncation_rate", "tokens_per_s", "wall_s")}),
                      flush=True)
        del engine, model
    _table(rows, Path(out, "summary.md"))
    return rows


def _table(rows: list[dict], path: Path, quiet: bool = False) -> None:
    lines = ["| format | task | mode | n | accuracy | pass@k | mean length | truncated | tok/s | wall s | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['format']} | {r['task']} | {r['mode']} | {r['problems']} | {r['accuracy']:.4f} | "
                     f"{r['pass_at_k']:.4f} | {r['mean_length']:.1f} | {r['truncation_rate']:.3f} | "
                     f"{(r['tokens_per_s'] or 0):,.0f} | {r['wall_s']:.1f} | "
                     f"{'' if r['peak_gib'] is None else format(r['peak_gib'], '.2f')} |")
    path.write_text("\n".join(lines) + "\n")
    if not quiet:
        print("\n".join(lines))


def regress(path: str, out: str, steps: int) -> dict:
    """Train NVFP4 GRPO past 11 steps and evaluate repeatedly; then the capture/GC mechanism."""
    from qerl_kit.config import preset
    from qerl_kit.lora import attach_lora
    from qerl_kit.tasks import make_task
    from qerl_kit.trainer import Trainer

    report: dict = {**_env(), "evals": [], "errors": []}
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs it too (a smoke test; no graphs)
    model, tok = _load(path, "nvfp4", device)
    policy = attach_lora(model, r=16, seed=0)
    cfg = preset("paper-gsm8k", model={"name": path, "lora_r": 16, "gradient_checkpointing": False},
                 data={"eval_size": 64}, rollout={"batch_size": 64, "max_new_tokens": 256},
                 loss={"mu": 1, "micro_batch": 16}, optim={"lr": 5e-5, "warmup_ratio": 0.0},
                 aqn={"stages": 5}, total_steps=steps, save_every=0, output_dir=str(Path(out, "regress_run")))
    trainer = Trainer(policy, tok, make_task(cfg.data), cfg, progress="none")
    for step in range(1, steps + 1):
        trainer.train(1)
        if step == 2 or step >= 10:
            t0 = time.perf_counter()
            try:
                acc = trainer.evaluate(max_new_tokens=256).accuracy
                report["evals"].append({"after_step": step, "accuracy": acc, "seconds": time.perf_counter() - t0})
            except Exception as err:  # noqa: BLE001 - the regression is exactly an exception here
                report["errors"].append({"after_step": step, "error": f"{type(err).__name__}: {err}"[:800]})
            print(json.dumps(report["evals"][-1] if report["evals"] else report["errors"][-1]), flush=True)
    report["history"] = [{k: v for k, v in r.items() if isinstance(v, (int, float))} for r in trainer.history]
    if device == "cuda":
        report["mechanism"] = {"with_fix": _gc_in_capture(trainer.engine, tok, fixed=True),
                               "without_fix": _gc_in_capture(trainer.engine, tok, fixed=False)}
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, "regress.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({"errors": report["errors"], "mechanism": report["mechanism"]}, indent=1))
    return report


def _gc_in_capture(engine, tok, fixed: bool) -> str:
    """Leave a state holding captured graphs for the cyclic GC, then collect inside the next capture."""
    import gc

    from qerl_kit.rollout.static.state import DecodeState
    from qerl_kit.rollout.types import SamplingParams

    release = DecodeState.release
    if not fixed:
        DecodeState.release = lambda self: None  # the old teardown: drop the reference, leave the cycle
    old_step = engine._step
    try:
        engine.max_rows = None  # stop_after needs every row in one batch
        prompts = [[int(t) for t in tok(f"Count to {i}:", add_special_tokens=False)["input_ids"]] for i in range(12)]
        # rows stop at different lengths, so compaction makes views (the cycle) and graphs on them
        engine.generate_ids(prompts, 2, SamplingParams(max_new_tokens=200, temperature=1.0, seed=1),
                            stop_after=[5 + 13 * (i % 12) for i in range(24)])

        def step_with_gc(*args, **kwargs):
            if torch.cuda.is_current_stream_capturing():
                gc.collect()
            return old_step(*args, **kwargs)

        engine._step = step_with_gc
        engine.generate_ids(prompts[:5], 3, SamplingParams(max_new_tokens=40, temperature=1.0, seed=2))
        torch.cuda.synchronize()
        return "ok"
    except Exception as err:  # noqa: BLE001 - the outcome is what this probe reports
        return f"{type(err).__name__}: {err}"[:400]
    finally:
        engine._step = old_step
        DecodeState.release = release
        engine.reset()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert")
    c.add_argument("gguf")
    c.add_argument("out")
    e = sub.add_parser("eval")
    e.add_argument("model")
    e.add_argument("--out", required=True)
    e.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    e.add_argument("--tasks", nargs="+", default=list(TASK_LENGTH), choices=list(TASK_LENGTH))
    e.add_argument("--pass-k", type=int, default=1)
    e.add_argument("--only-pass-k", action="store_true", help="skip the greedy runs")
    e.add_argument("--limit", type=int, default=None)
    e.add_argument("--max-new-tokens", type=int, default=None, help="override the tasks' lengths (smoke tests)")
    r = sub.add_parser("regress")
    r.add_argument("model")
    r.add_argument("--out", required=True)
    r.add_argument("--steps", type=int, default=14)
    t = sub.add_parser("load-time")
    t.add_argument("gguf")
    t.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    if a.cmd == "load-time":
        load_time(a.gguf, a.rounds)
    elif a.cmd == "convert":
        convert(a.gguf, a.out)
    elif a.cmd == "eval":
        if a.max_new_tokens:
            TASK_LENGTH.update({k: a.max_new_tokens for k in TASK_LENGTH})
        evaluate_formats(a.model, a.out, a.formats, a.tasks, a.pass_k, a.limit, a.only_pass_k)
    else:
        regress(a.model, a.out, a.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
