"""Peak memory of GRPO steps against the memory plan, one command per model: the plan's check on a GPU.

    python -m bench.bench_memory --models 0.5B 7B 32B --formats nvfp4 bf16 --out OUT --append tests/data/measured_peaks.json
    python -m bench.bench_memory --smoke --out /tmp/mem          # CPU: the code path and the table, tiny model

Per (model, format, checkpointing), a case: a random Qwen2.5-shaped policy (``bench.common.build`` of
the ``qerl_kit.models`` preset ``Qwen2.5-0.5B``, ``-1.5B``, ``-7B``, ``-14B`` or ``-32B``) with LoRA, trained
by the ``Trainer`` for ``--steps`` GRPO steps on the ``StaticEngine`` (``--prompts`` prompts x group
``--group``, prompts of ``--prompt`` random ids, every row to ``--new`` tokens: ``ignore_eos``), with
``model.dense_cache_gib`` set by ``--dense-cache`` (``all``: every 4-bit projection's dense copy; ``auto``:
the Trainer's budget; or GiB), ``torch.cuda.max_memory_allocated()`` over all of the steps (the first step's graph captures and
kernel compilations included; ``bench.bench_step``'s peak is its last step's alone) next to
``plan_memory(...).allocated`` for the same settings and the dense cache the steps held (the most
``memory/dense_cache_gib`` of any step, ``dense_cache_bytes`` in the settings). Each case runs in a
process of its own on a GPU (``--isolate auto``: no case's peak holds what an earlier model left), and
none starts once ``--budget`` seconds are spent. After each case ``OUT/memory.json`` and
``OUT/memory.md`` (a table: measured, plan, ratio, what the plan's largest parts are) are rewritten, and
with ``--append FILE`` its GPU row is added as a case to that measured-peaks file
(tests/test_memory_plan.py checks the plan against every case in it): a call killed later keeps them.
On a CPU the peak is not measured (``tracemalloc``/RSS are not the CUDA allocator's counter): the
rows say so and nothing is appended.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.child_rows import crash_line
from bench.common import IdTokenizer, build, dense_cache_arg, free, log, random_id_task, with_lora

# name -> qerl_kit.models preset (Qwen2.5's published sizes)
MODELS = {"tiny": "qwen2-tiny", "0.5B": "Qwen2.5-0.5B", "1.5B": "Qwen2.5-1.5B", "7B": "Qwen2.5-7B",
          "14B": "Qwen2.5-14B", "32B": "Qwen2.5-32B"}


def _trainer(peft, engine, args, out_dir: Path, checkpointing: bool, vocab: int, dense_gib: float | None):
    """A Trainer for GRPO steps on random-id prompts with random rewards (the settings the plan gets)."""
    from qerl_kit.config import preset

    cfg = preset("tiny-cpu", total_steps=10, save_every=0, output_dir=str(out_dir),
                 model=dict(gradient_checkpointing=checkpointing, lora_r=args.lora_r, dense_cache_gib=dense_gib),
                 rollout=dict(batch_size=args.prompts * args.group, group_size=args.group, max_new_tokens=args.new),
                 loss=dict(micro_batch=args.micro_batch), aqn=dict(enabled=False))
    from qerl_kit.trainer import Trainer

    task = random_id_task(8 * args.prompts, args.prompt, vocab)
    return Trainer(peft, IdTokenizer(), task, cfg, engine=engine, progress="none"), cfg


def _humming_on() -> bool:
    from qerl_kit.kernels import nvfp4_humming

    return nvfp4_humming.humming_status()[0]


def case(name: str, fmt: str, checkpointing: bool, args, device: str) -> dict:
    """One policy, ``args.steps`` GRPO steps, its measured peak and its plan."""
    from qerl_kit.dense_update import GIB, dense_projection_bytes
    from qerl_kit.memory_plan import plan_memory
    from qerl_kit.rollout import StaticEngine

    preset = MODELS[name]
    peft = with_lora(build(preset, "none" if fmt == "bf16" else fmt, device), args.lora_r)
    keep = not checkpointing  # as bench_rollout's step: the big models free the cache before the update
    engine = StaticEngine(peft, IdTokenizer(), ignore_eos=True, keep_cache=keep,
                          share_weights=args.share_weights == "on")
    dense_gib = None if args.dense_cache == "auto" else \
        dense_projection_bytes(peft) / GIB if args.dense_cache == "all" else float(args.dense_cache)
    trainer, cfg = _trainer(peft, engine, args, Path(args.out) / "run", checkpointing, peft.config.vocab_size,
                            dense_gib)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    held = 0.0
    for i in range(args.steps):
        m = trainer.train_step()
        held = max(held, m.get("memory/dense_cache_gib", 0.0))
        log(f"{name} {fmt} ckpt={checkpointing} step {i}: {m['time/step']:.2f} s")
    measured = torch.cuda.max_memory_allocated() if device == "cuda" else math.nan
    engine_class = type(trainer.engine).__name__  # the engine the steps ran on (the plan's "static")
    settings = dict(fmt="none" if fmt == "bf16" else fmt, lora_r=args.lora_r, optimizer=cfg.optim.optimizer,
                    rollout_batch=args.prompts * args.group, group_size=args.group, prompt_len=args.prompt,
                    max_new_tokens=args.new, micro_batch=args.micro_batch, gradient_checkpointing=checkpointing,
                    engine="static", keep_cache=keep, humming=device == "cuda" and fmt == "nvfp4" and _humming_on(),
                    dense_cache_bytes=int(held * GIB), share_weights=args.share_weights == "on")
    plan = plan_memory(peft.config, **settings)
    del trainer, engine, peft
    free()
    top = sorted(plan.parts.items(), key=lambda kv: -kv[1])[:3]
    return dict(model=name, shape=preset, settings=settings, engine_class=engine_class, dense_cache_gib=dense_gib,
                measured_gib=measured / 2**30, plan_gib=plan.allocated / 2**30, ratio=plan.allocated / measured,
                largest=[f"{k}: {v / 2**30:.2f} GiB" for k, v in top])


def table(rows: list[dict]) -> str:
    lines = ["| model | format | batch | prompt + new | micro-batch | checkpointing | keep cache (shared weights) | "
             "humming | "
             "dense cache held GiB | measured GiB | plan GiB | plan / measured | largest parts of the plan |",
             "|---|---|---:|---|---:|---|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        s = r["settings"]
        if "error" in r:
            lines.append(f"| {r['model']} | {s['fmt']} | | | | {s['gradient_checkpointing']} | | | | "
                         f"failed: {r['error'][:80]} | | | |")
            continue
        measured = "not measured (CPU)" if math.isnan(r["measured_gib"]) else f"{r['measured_gib']:.2f}"
        ratio = "" if math.isnan(r["ratio"]) else f"{r['ratio']:.2f}"
        lines.append(f"| {r['model']} | {s['fmt']} | {s['rollout_batch']} | {s['prompt_len']} + {s['max_new_tokens']} | "
                     f"{s['micro_batch']} | {s['gradient_checkpointing']} | {s['keep_cache']}"
                     f"{' (shared)' if s.get('share_weights') else ''} | {s['humming']} | "
                     f"{s['dense_cache_bytes'] / 2**30:.2f} | {measured} | {r['plan_gib']:.2f} | {ratio} | {'; '.join(r['largest'])} |")
    return "\n".join(lines)


def append(path: Path, rows: list[dict], meta: dict, source: str) -> int:
    """Add the measured rows as cases of the measured-peaks file; returns how many."""
    data = json.loads(path.read_text())
    new = [dict(name=f"{r['model']} {r['settings']['fmt']} GRPO steps, bench.bench_memory", date=meta["date"],
                model=r["shape"], settings=r["settings"],
                measured_gib=round(r["measured_gib"], 3), absent_then=[],
                notes=f"{meta['device']}, torch {meta['torch']}, {meta['args']['steps']} steps (the peak over all of "
                      f"them), every row to {r['settings']['max_new_tokens']} tokens, model.dense_cache_gib "
                      f"{r.get('dense_cache_gib', 0):.2f}", source=source)
           for r in rows if "error" not in r and not math.isnan(r["measured_gib"])]
    data["cases"].extend(new)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return len(new)


_PASSED = ("prompts", "group", "prompt", "new", "micro_batch", "lora_r", "steps", "out", "dense_cache", "share_weights")


def isolated_case(name: str, fmt: str, ckpt: bool, args, limit: float) -> dict:
    """``case`` in a fresh process (its peak holds nothing an earlier case left); a process that fails or
    is killed at ``limit`` seconds is an error row with its last error line."""
    out = Path(args.out)
    row_path, log_path = out / f"case_{name}_{fmt}.json", out / f"case_{name}_{fmt}_log.txt"
    row_path.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "bench.bench_memory", "--worker", name, fmt, str(int(ckpt)), str(row_path)]
    for key in _PASSED:
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    with open(log_path, "w") as logf:
        try:
            rc = subprocess.run(argv, stdout=logf, stderr=subprocess.STDOUT, timeout=max(limit, 1),
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout (killed at --limit)"
    if row_path.exists():
        return json.loads(row_path.read_text())
    return dict(model=name, settings=dict(fmt=fmt, gradient_checkpointing=ckpt),
                error=f"process exit {rc}: {crash_line(log_path)}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["0.5B", "7B", "32B"], choices=sorted(MODELS))
    ap.add_argument("--formats", nargs="+", default=["nvfp4", "bf16"], choices=["nvfp4", "bf16"])
    ap.add_argument("--checkpointing", nargs="*", default=["32B"], help="models run with gradient checkpointing")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--dense-cache", default="all", type=dense_cache_arg,
                    help="model.dense_cache_gib: all (every 4-bit projection's dense copy) or GiB (0: off)")
    ap.add_argument("--share-weights", default="off", choices=["on", "off"],
                    help="the StaticEngine's share_weights (on: the policy's q/k/v and gate/up are its fused "
                         "buffers, no second copy); the settings record it")
    ap.add_argument("--out", default="bench/results/memory")
    ap.add_argument("--append", default=None, help="a measured-peaks JSON file to add the GPU rows to")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds after which no new case starts")
    ap.add_argument("--limit", type=float, default=None, help="seconds after which a case's process is killed "
                    "(default budget + 60)")
    ap.add_argument("--isolate", default="auto", choices=["auto", "on", "off"],
                    help="one process per case (auto: on a GPU)")
    ap.add_argument("--smoke", action="store_true", help="the tiny preset, few tokens (a CPU check of this script)")
    ap.add_argument("--worker", nargs=4, metavar=("MODEL", "FORMAT", "CKPT", "ROW_JSON"), help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> None:
    """Long because: the arguments' checks, the case loop with its budget, and the per-case outputs."""
    ap = _parser()
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:  # one case in this process (``isolated_case``'s child)
        name, fmt, ckpt, row_path = args.worker
        Path(row_path).write_text(json.dumps(case(name, fmt, ckpt == "1", args, device)))
        return
    if args.append and not Path(args.append).is_file():
        ap.error(f"--append {args.append}: no such file (the measured-peaks file is tests/data/measured_peaks.json)")
    if args.smoke:
        args.models, args.formats, args.prompts, args.group = ["tiny"], ["nvfp4"], 2, 2
        args.prompt, args.new, args.micro_batch, args.lora_r, args.steps = 8, 4, 2, 4, 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, args=vars(args),
                device=torch.cuda.get_device_name() if device == "cuda" else "cpu")
    isolate = args.isolate == "on" or (args.isolate == "auto" and device == "cuda")
    limit = args.budget + 60 if args.limit is None else args.limit
    start, rows, appended = time.perf_counter(), [], 0
    for name in args.models:
        for fmt in args.formats:
            ckpt = name in args.checkpointing
            spent = time.perf_counter() - start
            if spent > args.budget:
                row = dict(model=name, settings=dict(fmt=fmt, gradient_checkpointing=ckpt),
                           error=f"skipped: --budget {args.budget:g} s spent before this case started")
            elif isolate:
                row = isolated_case(name, fmt, ckpt, args, limit - spent)
            else:
                try:
                    row = case(name, fmt, ckpt, args, device)
                except Exception as err:  # noqa: BLE001 - keep the other rows; say what failed
                    log(f"{name} {fmt} failed: {err!r}\n{traceback.format_exc()}")
                    row = dict(model=name, settings=dict(fmt=fmt, gradient_checkpointing=ckpt), error=repr(err))
                    free()
            rows.append(row)
            log(f"{name} {fmt}: " + (row["error"] if "error" in row else f"measured {row['measured_gib']:.2f} GiB, "
                                     f"plan {row['plan_gib']:.2f} GiB"))
            # after each case: the table, the JSON and the measured-peaks file hold every case so far
            (out / "memory.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
            md = f"{meta['device']}, {meta['date']}, torch {meta['torch']}\n\n{table(rows)}\n"
            (out / "memory.md").write_text(md)
            if args.append:
                appended += append(Path(args.append), [row], meta, str(out / "memory.json"))
    print(md)
    if args.append:
        log(f"appended {appended} measured cases to {args.append}" + ("" if appended else " (none: no GPU peak measured)"))


if __name__ == "__main__":
    main()
