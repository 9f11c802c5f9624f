"""Step throughput of data-parallel GRPO: one GPU against N GPUs, same per-GPU load (weak scaling).

A 7B-shape model (``qerl_kit.models`` preset ``Qwen2.5-7B``: the real shapes, random weights),
NVFP4-quantized, LoRA r 32, trained by the ordinary ``Trainer`` for a few GRPO steps. Prompts are
fixed-length strings of random token ids (a whitespace "tokenizer" turns them back into ids), no
stop token is known, so every completion runs to exactly ``--new-tokens``; the reward is random.
So a step is a fixed amount of work: rollout (``rollout.engine`` auto: StaticEngine on a GPU,
transformers' ``generate`` on the CPU; under AQN) + log-probs + update,
and under ``torchrun`` the DDP all-reduce of the adapter's gradients and the metric reductions.

Each process runs ``--prompts`` prompts x ``--group`` samples per GPU (``--strong``: the global
batch is fixed at prompts x group and split over the ranks instead). After ``--warmup`` steps
(Triton compilation) it times ``--steps`` steps (CUDA-synchronized, with a barrier before each)
and rank 0 writes ``ddp_w<W>[_strong].json`` into ``--out``. ``--report DIR`` turns those files
into ``ddp_bench.md`` and ``ddp_bench.csv`` (samples/s, speedup and efficiency against W=1).

    bash bench/run_ddp_bench.sh                      # 1 GPU, then torchrun on 2, then the table
    python -m bench.bench_ddp --device cpu --model qwen2-tiny --out /tmp/b   # CPU smoke test
    python -m torch.distributed.run --nproc_per_node 2 -m bench.bench_ddp --device cpu --model qwen2-tiny --out /tmp/b

NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1), set here before torch is imported and by the shell script.
"""

from __future__ import annotations

import os

for _key, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                     "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_key] = _value  # forced, not defaulted: multicast must stay off

import argparse  # noqa: E402
import csv  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

from bench.common import IdTokenizer  # noqa: E402 - prompts are whitespace-separated token ids

ROOT = Path(__file__).resolve().parents[1]


def _args(argv=None):
    from qerl_kit.formats import format_names

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="Qwen2.5-7B", help="a qerl_kit.models preset (random weights)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--format", default="nvfp4", choices=format_names())
    p.add_argument("--lora-r", type=int, default=32)
    p.add_argument("--prompts", type=int, default=8, help="prompts per GPU per step (weak scaling)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO group size)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128, help="generated tokens per sample (fixed)")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (kernel compilation)")
    p.add_argument("--time-budget", type=float, default=90.0, help="stop timing after this many seconds (>= 1 step)")
    p.add_argument("--strong", action="store_true", help="fixed global batch prompts x group split over ranks")
    p.add_argument("--out", default="bench/results/ddp", help="directory for the JSON result (rank 0)")
    p.add_argument("--report", metavar="DIR", help="only write ddp_bench.md/.csv from DIR's JSON files")
    return p.parse_args(argv)


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001 - no git on the machine is fine
        return "unknown"


def run(args) -> dict | None:
    if args.device == "cpu":
        os.environ.setdefault("QERL_DIST_BACKEND", "gloo")
    import torch

    from qerl_kit import distributed
    from qerl_kit.config import from_dict
    from qerl_kit.lora import attach_lora
    from qerl_kit.models import PRESETS, build_model
    from qerl_kit.quantize import quantize_model
    from qerl_kit.tasks import Task
    from qerl_kit.trainer import Trainer

    warnings.filterwarnings("ignore", message=".*no EOS or stop token id known.*")
    distributed.init()
    ctx = distributed.Context(distributed.rank(), distributed.world_size()) if distributed.active() \
        else distributed.Context()
    W, main = ctx.world, ctx.main
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but no CUDA GPU here (use --device cpu for a smoke test)")
        dev = distributed.device()
        torch.cuda.set_device(dev)
        dtype = torch.bfloat16
    else:
        dev, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

    t_build = time.perf_counter()
    model = build_model(args.model, seed=0, dtype=dtype, device=dev)
    model.generation_config.eos_token_id = None  # fixed-length completions
    model.generation_config.bos_token_id = None
    if args.format != "none":
        quantize_model(model, fmt=args.format)
    policy = attach_lora(model, r=args.lora_r, seed=0)
    if args.device == "cuda":
        torch.cuda.synchronize()
    t_build = time.perf_counter() - t_build

    vocab = PRESETS[args.model]["vocab_size"]
    rng = random.Random(1234)
    rows = [{"prompt": " ".join(str(rng.randrange(1, vocab)) for _ in range(args.prompt_len)), "answer": ""}
            for _ in range(512)]
    reward_rng = random.Random(99 + ctx.rank)

    def random_reward(prompts, completions, **_):
        return [reward_rng.random() for _ in completions]

    per_gpu = args.prompts * args.group // (W if args.strong else 1)
    batch = per_gpu * W
    if args.strong and args.prompts % W:
        raise SystemExit(f"--strong needs --prompts ({args.prompts}) divisible by the world size ({W})")
    total = args.warmup + args.steps
    cfg = from_dict(dict(
        model=dict(name=args.model, format=args.format, lora_r=args.lora_r),
        rollout=dict(batch_size=batch, group_size=args.group, max_new_tokens=args.new_tokens, temperature=1.0),
        loss=dict(loss="dapo", micro_batch=args.micro_batch),
        optim=dict(lr=1e-5), aqn=dict(enabled=True, stages=3),
        total_steps=max(3, total), save_every=0, output_dir=str(Path(args.out) / f"run_w{W}")))
    task = Task("random-ids", rows, [], (random_reward,), lambda tok, row: row["prompt"])
    trainer = Trainer(policy, IdTokenizer(), task, cfg, progress="none")

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()
        ctx.barrier()

    times, rows_out, started = [], [], None
    for i in range(total):
        sync()
        t0 = time.perf_counter()
        metrics = trainer.train_step()
        sync()
        dt = time.perf_counter() - t0
        if i < args.warmup:
            if main:
                print(f"warmup step {i + 1}: {dt:.2f} s", flush=True)
            continue
        started = started or t0
        times.append(dt)
        rows_out.append(metrics)
        if main:
            print(f"step {len(times)}: {dt:.2f} s ({batch / dt:.1f} samples/s)", flush=True)
        over = time.perf_counter() - started > args.time_budget
        if ctx.any(over) and i + 1 < total:  # every rank stops at the same step
            if main:
                print(f"time budget of {args.time_budget:.0f} s used up after {len(times)} timed steps", flush=True)
            break
    peak = torch.tensor([torch.cuda.max_memory_allocated(dev) / 2**30 if args.device == "cuda" else 0.0])
    peak = float(ctx.max(peak))
    step_s = statistics.median(times)

    def phase(key):
        return statistics.median(r[key] for r in rows_out)

    gen_tokens = statistics.median(r["num_tokens"] for r in rows_out)
    result = {
        "world_size": W, "mode": "strong" if args.strong else "weak", "model": args.model, "format": args.format,
        "device": torch.cuda.get_device_name(dev) if args.device == "cuda" else "cpu",
        "lora_r": args.lora_r, "prompts_per_gpu": per_gpu // args.group, "group": args.group,
        "samples_per_gpu": per_gpu, "global_batch": batch, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "micro_batch": args.micro_batch, "timed_steps": len(times),
        "step_s": step_s, "step_s_all": times, "samples_per_s": batch / step_s,
        "gen_tokens_per_s": gen_tokens / step_s, "rollout_s": phase("time/rollout"),
        "logprob_s": phase("time/logprob"), "update_s": phase("time/update"), "peak_gib": peak,
        "build_s": t_build, "torch": torch.__version__, "commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                "NVSHMEM_DISABLE_NVLS")},
    }
    if main:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"ddp_w{W}{'_strong' if args.strong else ''}.json"
        (out / name).write_text(json.dumps(result, indent=1))
        print(f"wrote {out / name}: {result['samples_per_s']:.1f} samples/s on {W} rank(s)", flush=True)
    distributed.shutdown()
    return result


COLUMNS = ["mode", "world_size", "global_batch", "samples_per_gpu", "step_s", "samples_per_s", "speedup",
           "efficiency", "rollout_s", "logprob_s", "update_s", "gen_tokens_per_s", "peak_gib", "timed_steps"]


def report(directory: str | Path) -> str:
    """ddp_bench.md and ddp_bench.csv from the JSON results in ``directory``; returns the markdown."""
    directory = Path(directory)
    results = [json.loads(p.read_text()) for p in sorted(directory.glob("ddp_w*.json"))]
    if not results:
        raise SystemExit(f"no ddp_w*.json results in {directory}")
    base = next((r for r in results if r["world_size"] == 1), None)
    rows = []
    for r in sorted(results, key=lambda r: (r["mode"] != "weak", r["world_size"])):
        row = {k: r.get(k) for k in COLUMNS}
        row["speedup"] = r["samples_per_s"] / base["samples_per_s"] if base else float("nan")
        row["efficiency"] = row["speedup"] / r["world_size"]
        rows.append(row)
    with open(directory / "ddp_bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    ref = base or results[0]
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = [
        "# Data-parallel GRPO step throughput",
        "",
        f"{ref['model']} shapes (random weights), {ref['format']} base, LoRA r {ref['lora_r']}, "
        f"DAPO loss, AQN on; {ref['prompts_per_gpu']} prompts x {ref['group']} samples per GPU (weak scaling), "
        f"prompt {ref['prompt_len']} tokens, exactly {ref['new_tokens']} generated tokens per sample, "
        f"micro-batch {ref['micro_batch']}. Device: {ref['device']}; torch {ref['torch']}; commit "
        f"{ref['commit']}; {ref['date']}. Median of the timed steps after warm-up; a step = rollout + "
        "log-probs + update (+ the DDP all-reduce and metric reductions on more than one GPU). "
        "speedup = samples/s over the 1-GPU run's. NVLink multicast off (NCCL_NVLS_ENABLE=0).",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(fmt(row[c]) for c in COLUMNS) + " |" for row in rows]
    weak2 = next((row for row in rows if row["mode"] == "weak" and row["world_size"] == 2), None)
    if weak2 and base:
        verdict = "met" if weak2["speedup"] >= 1.8 else "NOT met"
        lines += ["", f"Target (>= 1.8x samples/s on two GPUs, weak scaling): {weak2['speedup']:.2f}x, {verdict}."]
    text = "\n".join(lines) + "\n"
    (directory / "ddp_bench.md").write_text(text)
    return text


def main(argv=None) -> int:
    args = _args(argv)
    if args.report:
        print(report(args.report))
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
