"""One update pass through a 4-bit base with and without the dense-weight cache (``qerl_kit.dense_update``).

An update pass is what the trainer's update phase runs: ``mu`` times, for each micro-batch, the
policy's completion log-probs (a forward through every 4-bit projection) and a backward (an input
gradient through each, and a second forward with ``--checkpointing``). "packed" dequantizes every
weight at every call (``model.dense_cache_gib: 0``); "dense cache" opens one ``update_cache`` block
per pass, as the trainer does per step, so each weight is dequantized once per pass (its cost is
inside the timing). A bf16 + LoRA model (``--formats none``) gives the baseline. Random weights of
the preset's shape, a random LoRA, random tokens; the LoRA gradients of the two modes are compared
bit for bit. Prints a small markdown table (and writes it with ``--out``).

``--profile DIR`` then runs one more pass of each format (with the dense cache, as the trainer does)
under ``torch.profiler`` and writes DIR/profile_<format>.txt (the top kernels by their own GPU time,
CPU time on a CPU) and DIR/profile.md (each format's total and largest kernels side by side): where an
update pass through a 4-bit base spends the time a bf16 pass does not.

    python -m bench.bench_dense_cache --model Qwen2.5-0.5B --formats nvfp4 nf4 mxfp4 none   # GPU
    python -m bench.bench_dense_cache --smoke                                               # CPU, tiny
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch

from bench.common import build, free, profiled, sync, with_lora
from qerl_kit import dense_update
from qerl_kit.logprobs import completion_logprobs


# The real-model sizes the issue measures that qerl_kit.models.PRESETS lacks: overrides of the 7B preset
# (Qwen2.5-0.5B's and 1.5B's config.json: hidden, MLP width, layers, heads, tied embeddings).
SMALL = {"Qwen2.5-0.5B": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                              num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
         "Qwen2.5-1.5B": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                              num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)}


def make_policy(preset: str, fmt: str, device: str, lora_r: int, checkpointing: bool):
    """A random ``preset``-shaped model (a preset of qerl_kit.models or a key of ``SMALL``) in ``fmt``
    (none = bf16) with a random LoRA of rank ``lora_r``."""
    if preset not in SMALL and fmt in ("nvfp4", "none"):
        model = build(preset, "nvfp4" if fmt == "nvfp4" else "bf16", device)  # nvfp4 built from meta
    else:
        from qerl_kit.models import build_model
        from qerl_kit.quantize import quantize_model

        base, over = ("Qwen2.5-7B", SMALL[preset]) if preset in SMALL else (preset, {})
        model = build_model(base, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device, **over)
        if fmt != "none":
            quantize_model(model, fmt=fmt)
    policy = with_lora(model, lora_r)
    if checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.enable_input_require_grads()
    return policy.train()


def update_pass(policy, batches, mu: int) -> None:
    """``mu`` passes of forward + backward over ``batches`` (gradients accumulate, as between optimizer steps)."""
    for _ in range(mu):
        for prompt, completion in batches:
            ones_p, ones_c = torch.ones_like(prompt), torch.ones_like(completion)
            logp = completion_logprobs(policy, prompt, ones_p, completion, ones_c)
            logp.mean().backward()


def time_mode(policy, batches, mu: int, gib: float | None, repeats: int) -> dict:
    """Seconds per pass (median of ``repeats``, after one warm-up pass that also measures the CUDA
    working set the auto budget needs), the GiB the cache held, the peak memory and the LoRA gradients."""
    times, held = [], 0.0
    for i in range(repeats + 1):
        policy.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        with dense_update.update_cache(policy, gib) as block:
            update_pass(policy, batches, mu)
            sync()
        if i:
            times.append(time.perf_counter() - t0)
        held = block.peak_bytes / dense_update.GIB
    grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}
    peak = torch.cuda.max_memory_allocated() / dense_update.GIB if torch.cuda.is_available() else float("nan")
    return {"s": statistics.median(times), "gib": held, "peak": peak, "grads": grads}


def profile_pass(policy, batches, mu: int, gib: float | None, top: int = 30) -> tuple[str, list[tuple[str, float, int]]]:
    """One dense-cache pass under torch.profiler: (its key_averages table, [(name, own ms, calls)] of
    the ``top`` names by their own device time, CPU time without a GPU)."""
    def one_pass():
        with dense_update.update_cache(policy, gib):
            update_pass(policy, batches, mu)
            sync()  # the pass's kernels end inside the block, as when it was timed

    policy.zero_grad(set_to_none=True)
    _, table, rows = profiled(one_pass, top)
    return table, rows


def profile_markdown(profiles: dict[str, list[tuple[str, float, int]]], top: int = 12) -> list[str]:
    """Each format's largest kernels (own ms, calls) side by side with their sum."""
    lines = ["", "## Where a pass spends its time (torch.profiler, one pass with the dense cache)", ""]
    for fmt, rows in profiles.items():
        total = sum(ms for _, ms, _ in rows)
        lines += [f"### {fmt}: {total:.1f} ms in its top {len(rows)} names", "", "| kernel / op | own ms | calls |",
                  "|---|---:|---:|"]
        lines += [f"| `{name[:80]}` | {ms:.2f} | {n} |" for name, ms, n in rows[:top]]
        lines.append("")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="Qwen2.5-0.5B")
    ap.add_argument("--formats", nargs="+", default=["nvfp4"], help="nvfp4, nf4, mxfp4, none (bf16 + LoRA)")
    ap.add_argument("--micro-batch", type=int, default=16, help="sequences per forward/backward")
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per pass")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--completion", type=int, default=384, help="completion tokens per sequence")
    ap.add_argument("--mu", type=int, default=1)
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on")
    ap.add_argument("--gib", type=float, default=None, help="the cache budget (default: auto)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="a markdown file to write the table to")
    ap.add_argument("--smoke", action="store_true", help="CPU, the tiny model, small shapes")
    ap.add_argument("--profile", default=None, help="a folder: one more pass per format under torch.profiler")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.model, args.micro_batch, args.prompt, args.completion, args.lora_r, args.repeats = \
            "qwen2-tiny", 2, 8, 24, 4, 1
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    lines = [f"# One update pass, packed vs dense cache ({gpu}, {datetime.date.today()}, torch {torch.__version__})",
             "", f"`python -m bench.bench_dense_cache {' '.join(_argv())}`", "",
             f"{args.model}, LoRA r {args.lora_r}, {args.micro_batches} x {args.micro_batch} sequences of "
             f"{args.prompt} + {args.completion} tokens, mu {args.mu}, gradient checkpointing "
             f"{'on' if args.checkpointing else 'off'}", "",
             "| format | packed s | dense cache s | speed-up | cache MiB | peak GiB (packed / cache) "
             "| LoRA grads equal |",
             "|---|---:|---:|---:|---:|---|---|"]
    print("\n".join(lines), flush=True)
    profiles: dict[str, list] = {}
    for fmt in args.formats:
        policy = make_policy(args.model, fmt, device, args.lora_r, args.checkpointing)
        vocab = policy.config.vocab_size
        g = torch.Generator().manual_seed(1)
        batches = [tuple(torch.randint(10, vocab - 10, (args.micro_batch, n), generator=g).to(device)
                         for n in (args.prompt, args.completion)) for _ in range(args.micro_batches)]
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        packed = time_mode(policy, batches, args.mu, 0, args.repeats)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        dense = time_mode(policy, batches, args.mu, args.gib, args.repeats)
        same = packed["grads"].keys() == dense["grads"].keys() and all(
            torch.equal(packed["grads"][k], dense["grads"][k]) for k in packed["grads"])
        row = (f"| {fmt} | {packed['s']:.3f} | {dense['s']:.3f} | {packed['s'] / dense['s']:.2f}x | "
               f"{dense['gib'] * 1024:.1f} | {packed['peak']:.2f} / {dense['peak']:.2f} | {'yes' if same else 'NO'} |")
        print(row, flush=True)
        lines.append(row)
        if args.profile:
            table, profiles[fmt] = profile_pass(policy, batches, args.mu, args.gib)
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            (Path(args.profile) / f"profile_{fmt}.txt").write_text(table)
        del policy, batches, packed, dense
        free()
    if profiles:
        lines += profile_markdown(profiles)
        (Path(args.profile) / "profile.md").write_text("\n".join(lines) + "\n")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")


def _argv() -> list[str]:
    import sys

    return sys.argv[1:]


if __name__ == "__main__":
    main()
