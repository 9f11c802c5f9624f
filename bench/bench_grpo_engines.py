"""One whole GRPO step with each rollout engine, in one run: StaticEngine against vLLM.

    python -m bench.bench_grpo_engines --formats nvfp4 --out OUT   # on the H200, vLLM importable
    python -m bench.bench_grpo_engines --smoke --engines static    # CPU: the code path, tiny model

Per format (one per process: vLLM's memory is not given back inside one), the same random
Qwen2.5 policy with LoRA r32 trains with the Trainer (``bench.bench_rollout``'s step: 8 prompts x
group 8, prompt 256, 512 new tokens, every row to the end), first on our ``StaticEngine``, then on
``VLLMEngine`` (our export: ``nvfp4`` through vLLM's Marlin FP4, ``bf16`` as saved; colocated, sleep
mode on, the adapter synced through tmpfs before each rollout). ``--steps`` steps per engine; the
last is reported (the first pays graph capture and kernel compilation). Times are the Trainer's own:
``time/step`` = rollout (vLLM: wake + upload + generate + sleep) + log-probs + update.

The adapter's load into vLLM happens inside the next ``generate``; after the steps the bench times
it apart: sync (write + register) then a 1-token generate, against the same generate again.
``part_step`` is ``bench.bench_rollout --parts step`` (StaticEngine only, bigger models).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench.common import T0, IdTokenizer, build, free, log, random_id_task, random_prompts, timed_steps, with_lora
from bench.common import sync as sync_device
from qerl_kit.models import make_config
from qerl_kit.rollout import SamplingParams, StaticEngine


def step_trainer(peft, engine, args, out_dir: Path, *, checkpointing: bool = False, aqn: bool = False, vocab: int):
    """A Trainer for one GRPO step per call on random-id prompts: 8 prompts x group 8, prompt
    ``args.prompt``, ``args.new`` new tokens (the engine runs every row to the end: ``ignore_eos``)."""
    from qerl_kit.config import preset as cfg_preset
    from qerl_kit.trainer import Trainer

    cfg = cfg_preset("tiny-cpu", total_steps=10, save_every=0, output_dir=str(out_dir),
                     model=dict(gradient_checkpointing=checkpointing),
                     rollout=dict(batch_size=64, group_size=8, max_new_tokens=args.new),
                     loss=dict(micro_batch=args.micro_batch, old_logp=getattr(args, "old_logp", "fold")),
                     aqn=dict(enabled=aqn))
    return Trainer(peft, IdTokenizer(), random_id_task(64, args.prompt, vocab), cfg, engine=engine, progress="none")


def step_row(m: dict) -> dict:
    """The timings of a Trainer step's metrics (rollout, log-probs, update; a vLLM engine's sync too)."""
    return {k.replace("/", "_"): v for k, v in m.items() if k.startswith("time/")}


def part_step(args, device, results):
    """One GRPO step (8 prompts x group 8, prompt 256, 512 new tokens at fixed length), StaticEngine."""
    rows = results.setdefault("step", [])
    for spec in args.step_cases:
        preset, fmt = spec.split(":")
        vocab = make_config(preset).vocab_size  # ids in range for every preset
        ckpt = preset in args.checkpointing
        if time.perf_counter() - T0 > args.budget:
            log(f"budget spent: skip step {spec}")
            continue
        try:
            peft = with_lora(build(preset, fmt, device), args.lora_r)
            engine = StaticEngine(peft, IdTokenizer(), ignore_eos=True, keep_cache=not ckpt)
            trainer = step_trainer(peft, engine, args, Path(args.out) / "step_run", checkpointing=ckpt,
                                   aqn=fmt == "nvfp4", vocab=vocab)
            steps = 1 if ckpt else 2  # big models: one step (its peak includes graph capture)
            m, peak, _ = timed_steps(trainer, steps, f"step {spec}")
            rows.append(dict(model=preset, format=fmt, checkpointing=ckpt, keep_cache=engine.keep_cache,
                             steps_timed=1, step_index=steps - 1, peak_gib=peak, micro_batch=args.micro_batch,
                             **step_row(m)))
            del trainer, engine, peft
        except Exception as err:  # noqa: BLE001
            log(f"step {spec} failed: {err!r}\n{traceback.format_exc()}")
        free()


def adapter_load_seconds(engine, peft, prompt: list[int], repeats: int = 3) -> dict:
    """vLLM loads a new adapter inside the next generate: (sync, sync + first 1-token generate - a
    second one with the same adapter), medians of ``repeats``."""
    one = SamplingParams(max_new_tokens=1, temperature=1.0, seed=0)
    sync, load = [], []
    with engine.awake():
        for _ in range(repeats):
            sync_device()
            t = time.perf_counter()
            engine._upload_adapter(peft)
            sync.append(time.perf_counter() - t)
            t = time.perf_counter()
            engine.generate_ids([prompt], 1, one)
            first = time.perf_counter() - t
            t = time.perf_counter()
            engine.generate_ids([prompt], 1, one)
            load.append(first - (time.perf_counter() - t))
    return dict(adapter_sync_s=statistics.median(sync), adapter_load_s=statistics.median(load))


def vllm_engine(peft, fmt: str, args, root: Path):
    from bench.bench_vllm_lengths import export
    from qerl_kit.rollout.vllm import VLLMEngine

    path = export(peft, fmt, root)
    t = time.perf_counter()
    engine = VLLMEngine(path, IdTokenizer(), skip_tokenizer_init=True, ignore_eos=True,
                        gpu_memory_utilization=args.vllm_memory, max_lora_rank=args.lora_r,
                        max_model_len=-(-(args.prompt + args.new + 16) // 64) * 64, max_num_seqs=64)
    return engine, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results/grpo_engines"))
    ap.add_argument("--model", default="Qwen2.5-7B")
    ap.add_argument("--formats", nargs="+", default=["nvfp4"], choices=["nvfp4", "bf16"])
    ap.add_argument("--engines", nargs="+", default=["static", "vllm"], choices=["static", "vllm"])
    ap.add_argument("--steps", type=int, default=2, help="steps per engine; the last is reported")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--vllm-memory", type=float, default=0.3, help="vLLM's gpu_memory_utilization")
    ap.add_argument("--smoke", action="store_true", help="CPU, the qwen2-tiny preset, few tokens")
    ap.add_argument("--old-logp", default="fold", choices=["fold", "pass"],
                    help="loss.old_logp: the old log-probs from the update's first forward, or a separate pass")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.model, args.prompt, args.new, args.lora_r = "qwen2-tiny", 8, 6, 4
    vocab = make_config(args.model).vocab_size
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, args=vars(args),
                device=torch.cuda.get_device_name() if device == "cuda" else "cpu")
    rows: list[dict] = []
    root = Path(tempfile.mkdtemp(prefix="bench-grpo-"))

    def write():  # after every case, so a crash keeps what ran
        (out / f"grpo_engines_{'_'.join(args.formats)}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))

    for fmt in args.formats:
        peft = with_lora(build(args.model, "none" if fmt == "bf16" else fmt, device), args.lora_r)
        for name in args.engines:
            row = dict(model=args.model, format=fmt, engine=name, prompt=args.prompt, new=args.new, group=8, batch=64,
                       old_logp=args.old_logp)
            try:
                if name == "static":
                    engine = StaticEngine(peft, IdTokenizer(), ignore_eos=True)
                else:
                    import vllm

                    engine, row["engine_start_s"] = vllm_engine(peft, fmt, args, root)
                    row["engine"] = f"vllm-{vllm.__version__}"
                trainer = step_trainer(peft, engine, args, root / f"run-{fmt}-{name}", vocab=vocab)
                m, row["peak_gib"], _ = timed_steps(trainer, args.steps, f"{fmt} {name}")
                row.update(step_index=args.steps - 1, **step_row(m))
                if name == "vllm":
                    row.update(adapter_load_seconds(engine, peft, random_prompts(1, args.prompt, vocab, seed=9)[0]))
                    log(f"{fmt} vllm adapter: sync {row['adapter_sync_s'] * 1e3:.1f} ms, load in the next generate "
                        f"{row['adapter_load_s'] * 1e3:.1f} ms")
                    engine.close()
                del trainer, engine
            except Exception as err:  # noqa: BLE001 - say what failed, keep the other engine's row
                row["error"] = repr(err)[:500]
                log(f"{fmt} {name} failed: {err!r}\n{traceback.format_exc()}")
            rows.append(row)
            write()
            free()
        del peft
        free()
    write()
    shutil.rmtree(root, ignore_errors=True)  # the exports and run directories this bench made (GBs)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
