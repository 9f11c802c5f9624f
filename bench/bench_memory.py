"""Peak memory of GRPO steps against the memory plan, one command per model: the plan's check on a GPU.

    python -m bench.bench_memory --models 0.5B 7B 32B --formats nvfp4 bf16 --out OUT --append tests/data/measured_peaks.json
    python -m bench.bench_memory --smoke --out /tmp/mem          # CPU: the code path and the table, tiny model

Per (model, format, checkpointing): a random Qwen2.5-shaped policy (``bench.common.build``: presets
of ``qerl_kit.models``, 0.5B and 1.5B as 7B's config with their sizes) with LoRA, trained by the
``Trainer`` for ``--steps`` GRPO steps on the ``StaticEngine`` (``--prompts`` prompts x group
``--group``, prompts of ``--prompt`` random ids, every row to ``--new`` tokens: ``ignore_eos``),
``torch.cuda.max_memory_allocated()`` over all of them (the first step's graph captures and kernel
compilations included) next to ``plan_memory(...).allocated`` for the same settings. Writes
``OUT/memory.json`` and ``OUT/memory.md`` (a table: measured, plan, ratio, what the plan's largest
parts are), and with ``--append FILE`` adds each GPU row as a case to that measured-peaks file
(tests/test_memory_plan.py checks the plan against every case in it). On a CPU the peak is not
measured (``tracemalloc``/RSS are not the CUDA allocator's counter): the rows say so and nothing is
appended.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback
from pathlib import Path

import torch

from bench.bench_ddp import IdTokenizer  # prompts are whitespace-separated token ids
from bench.common import build, free, log, random_prompts, with_lora

# name -> (qerl_kit.models preset, config overrides): Qwen2.5's published sizes
MODELS = {
    "tiny": ("qwen2-tiny", {}),
    "0.5B": ("Qwen2.5-7B", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)),
    "1.5B": ("Qwen2.5-7B", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)),
    "7B": ("Qwen2.5-7B", {}), "14B": ("Qwen2.5-14B", {}), "32B": ("Qwen2.5-32B", {}),
}


_SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "tie_word_embeddings", "model_type")  # what memory_plan.model_shape reads


def _trainer(peft, engine, args, out_dir: Path, checkpointing: bool, vocab: int):
    """A Trainer for GRPO steps on random-id prompts with random rewards (the settings the plan gets)."""
    from qerl_kit.config import preset
    from qerl_kit.tasks import Task

    g = torch.Generator().manual_seed(0)
    data = [{"prompt": " ".join(map(str, p)), "answer": "0"}
            for p in random_prompts(8 * args.prompts, args.prompt, vocab, seed=3)]
    cfg = preset("tiny-cpu", total_steps=10, save_every=0, output_dir=str(out_dir),
                 model=dict(gradient_checkpointing=checkpointing, lora_r=args.lora_r),
                 rollout=dict(batch_size=args.prompts * args.group, group_size=args.group, max_new_tokens=args.new),
                 loss=dict(micro_batch=args.micro_batch), aqn=dict(enabled=False))
    reward = lambda completions, **_: torch.rand(len(completions), generator=g).tolist()  # noqa: E731
    task = Task("random-ids", data, [], (reward,), lambda tok, row: row["prompt"])
    from qerl_kit.trainer import Trainer

    return Trainer(peft, IdTokenizer(), task, cfg, engine=engine, progress="none"), cfg


def _humming_on() -> bool:
    from qerl_kit.kernels import nvfp4_humming

    return nvfp4_humming.humming_status()[0]


def case(name: str, fmt: str, checkpointing: bool, args, device: str) -> dict:
    """One policy, ``args.steps`` GRPO steps, its measured peak and its plan."""
    from qerl_kit.memory_plan import plan_memory
    from qerl_kit.rollout import StaticEngine

    preset, overrides = MODELS[name]
    peft = with_lora(build(preset, "none" if fmt == "bf16" else fmt, device, **overrides), args.lora_r)
    keep = not checkpointing  # as bench_rollout's step: the big models free the cache before the update
    engine = StaticEngine(peft, IdTokenizer(), ignore_eos=True, keep_cache=keep)
    vocab = peft.config.vocab_size
    shape = preset if not overrides else {k: getattr(peft.config, k) for k in _SHAPE}
    trainer, cfg = _trainer(peft, engine, args, Path(args.out) / "run", checkpointing, vocab)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.steps):
        m = trainer.train_step()
        log(f"{name} {fmt} ckpt={checkpointing} step {i}: {m['time/step']:.2f} s")
    measured = torch.cuda.max_memory_allocated() if device == "cuda" else math.nan
    engine_class = type(trainer.engine).__name__  # the engine the steps ran on (the plan's "static")
    settings = dict(fmt="none" if fmt == "bf16" else fmt, lora_r=args.lora_r, optimizer=cfg.optim.optimizer,
                    rollout_batch=args.prompts * args.group, group_size=args.group, prompt_len=args.prompt,
                    max_new_tokens=args.new, micro_batch=args.micro_batch, gradient_checkpointing=checkpointing,
                    engine="static", keep_cache=keep, humming=device == "cuda" and fmt == "nvfp4" and _humming_on())
    plan = plan_memory(peft.config, **settings)
    del trainer, engine, peft
    free()
    top = sorted(plan.parts.items(), key=lambda kv: -kv[1])[:3]
    return dict(model=name, shape=shape, settings=settings, engine_class=engine_class,
                measured_gib=measured / 2**30, plan_gib=plan.allocated / 2**30, ratio=plan.allocated / measured,
                largest=[f"{k}: {v / 2**30:.2f} GiB" for k, v in top])


def table(rows: list[dict]) -> str:
    lines = ["| model | format | batch | prompt + new | micro-batch | checkpointing | keep cache | humming | "
             "measured GiB | plan GiB | plan / measured | largest parts of the plan |",
             "|---|---|---:|---|---:|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        s = r["settings"]
        if "error" in r:
            lines.append(f"| {r['model']} | {s['fmt']} | | | | {s['gradient_checkpointing']} | | | failed: {r['error'][:80]} | | | |")
            continue
        measured = "not measured (CPU)" if math.isnan(r["measured_gib"]) else f"{r['measured_gib']:.2f}"
        ratio = "" if math.isnan(r["ratio"]) else f"{r['ratio']:.2f}"
        lines.append(f"| {r['model']} | {s['fmt']} | {s['rollout_batch']} | {s['prompt_len']} + {s['max_new_tokens']} | "
                     f"{s['micro_batch']} | {s['gradient_checkpointing']} | {s['keep_cache']} | {s['humming']} | "
                     f"{measured} | {r['plan_gib']:.2f} | {ratio} | {'; '.join(r['largest'])} |")
    return "\n".join(lines)


def append(path: Path, rows: list[dict], meta: dict, source: str) -> int:
    """Add the measured rows as cases of the measured-peaks file; returns how many."""
    data = json.loads(path.read_text())
    new = [dict(name=f"{r['model']} {r['settings']['fmt']} GRPO steps, bench.bench_memory", date=meta["date"],
                model=r["shape"], settings=r["settings"],
                measured_gib=round(r["measured_gib"], 3), absent_then=[],
                notes=f"{meta['device']}, torch {meta['torch']}, {meta['args']['steps']} steps, every row to "
                      f"{r['settings']['max_new_tokens']} tokens", source=source)
           for r in rows if "error" not in r and not math.isnan(r["measured_gib"])]
    data["cases"].extend(new)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return len(new)


def main(argv=None) -> None:
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
    ap.add_argument("--out", default="bench/results/memory")
    ap.add_argument("--append", default=None, help="a measured-peaks JSON file to add the GPU rows to")
    ap.add_argument("--smoke", action="store_true", help="the tiny preset, few tokens (a CPU check of this script)")
    args = ap.parse_args(argv)
    if args.append and not Path(args.append).is_file():
        ap.error(f"--append {args.append}: no such file (the measured-peaks file is tests/data/measured_peaks.json)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.models, args.formats, args.prompts, args.group = ["tiny"], ["nvfp4"], 2, 2
        args.prompt, args.new, args.micro_batch, args.lora_r, args.steps = 8, 4, 2, 4, 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, args=vars(args),
                device=torch.cuda.get_device_name() if device == "cuda" else "cpu")
    rows = []
    for name in args.models:
        for fmt in args.formats:
            ckpt = name in args.checkpointing
            try:
                rows.append(case(name, fmt, ckpt, args, device))
            except Exception as err:  # noqa: BLE001 - keep the other rows; say what failed
                log(f"{name} {fmt} failed: {err!r}\n{traceback.format_exc()}")
                rows.append(dict(model=name, settings=dict(fmt=fmt, gradient_checkpointing=ckpt), error=repr(err)))
                free()
            (out / "memory.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    md = f"{meta['device']}, {meta['date']}, torch {meta['torch']}\n\n{table(rows)}\n"
    (out / "memory.md").write_text(md)
    print(md)
    if args.append:
        n = append(Path(args.append), rows, meta, str(out / "memory.json"))
        log(f"appended {n} measured cases to {args.append}" + ("" if n else " (none: no GPU peak measured)"))


if __name__ == "__main__":
    main()
