"""One update pass over a realistic-length batch: micro-batches on their own width against the batch's.

A GRPO batch is padded to its longest prompt and its longest completion; a micro-batch used to run
the model on that whole width ("padded"). ``qerl_kit.logprobs.completion_logprobs`` now cuts the
columns that are padding in every row of the micro-batch ("trimmed", ``trim=True``), and the Trainer
first sorts the rows by length so that a micro-batch holds rows of similar lengths ("sorted",
``loss.micro_batch_order: length``, ``logprobs.micro_batches``): the same log-probs and gradients up to
float rounding, on fewer tokens. This times one update pass (the trainer's: a forward with gradient
and a backward per micro-batch, inside the step's dense-weight block) each way, the modes' passes
taken in turns after one warm-up pass, and counts the tokens each runs through the model. The completion lengths are drawn as ``bench_step``
draws them (``--lengths``: ``measured:real15b``, the real 1.5B's own GSM8K lengths at the paper's
4096 cap, by default), the prompts fixed at ``--prompt`` tokens; random weights of the preset's shape
(``--narrow``: every width 64, the preset's depth, for a CPU), a random LoRA.

    python -m bench.bench_trim --model Qwen2.5-0.5B --narrow --formats none nvfp4          # CPU
    python -m bench.bench_trim --model Qwen2.5-7B --formats none nvfp4 --checkpointing     # GPU
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.bench_dense_cache import NARROW, make_policy
from bench.common import free, sync
from bench.step_lengths import draw_lengths
from qerl_kit import dense_update
from qerl_kit.logprobs import completion_logprobs, micro_batch_tokens, micro_batches

# mode -> (rows of each micro-batch in the batch's order or sorted by length, trim)
MODES = {"padded": ("batch", False), "trimmed": ("batch", True), "sorted": ("length", True),
         "packed": ("packed", True)}


def make_batch(rows: int, prompt: int, lengths: list[int], vocab: int, device: str, seed: int = 1):
    """(prompt_ids, prompt_mask, completion_ids, completion_mask) of ``rows`` rows: ``prompt`` tokens
    each, completions of ``lengths`` right-padded to the longest."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    prompt_ids = torch.randint(10, vocab - 10, (rows, prompt), generator=g)
    completion_ids = torch.randint(10, vocab - 10, (rows, width), generator=g)
    completion_mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return tuple(t.to(device) for t in (prompt_ids, torch.ones_like(prompt_ids), completion_ids * completion_mask,
                                        completion_mask))


def groups(batch, micro: int, mode: str) -> list:
    return micro_batches(batch[1], batch[3], micro, MODES[mode][0])


def tokens(batch, micro: int, mode: str) -> int:
    """Tokens the model runs on in one pass of ``mode``: each micro-batch's rows x its width, summed."""
    if not MODES[mode][1]:  # every micro-batch at the batch's width
        return batch[0].shape[0] * (batch[0].shape[1] + batch[2].shape[1])
    return sum(micro_batch_tokens(batch[1], batch[3], groups(batch, micro, mode)))


def one_pass(policy, batch, micro: int, mode: str) -> float:
    """Seconds of one update pass (forward with gradient + backward per micro-batch) in its own block."""
    policy.zero_grad(set_to_none=True)
    sync()
    t0 = time.perf_counter()
    with dense_update.update_cache(policy, None):
        for sl in groups(batch, micro, mode):
            logp = completion_logprobs(policy, *(t[sl] for t in batch), trim=MODES[mode][1])
            logp.sum().backward()
        sync()
    return time.perf_counter() - t0


def grads(policy) -> dict:
    return {n: p.grad.detach().float().clone() for n, p in policy.named_parameters() if p.grad is not None}


def grad_diff(got: dict, ref: dict) -> tuple[float, float]:
    """(the largest per-tensor max |got - ref| / max |ref|, ||got - ref|| / ||ref|| over all the tensors)."""
    worst = max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp(min=1e-30)) for k in ref)
    num = sum(float((got[k] - ref[k]).pow(2).sum()) for k in ref)
    den = sum(float(ref[k].pow(2).sum()) for k in ref)
    return worst, (num / den) ** 0.5 if den > 0 else float("nan")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="Qwen2.5-0.5B")
    ap.add_argument("--formats", nargs="+", default=["none", "nvfp4"], help="nvfp4, nf4, mxfp4, none (bf16 + LoRA)")
    ap.add_argument("--lengths", default="measured:real15b", help="a bench_step length spec")
    ap.add_argument("--rows", type=int, default=128, help="rows of the batch (the paper's 16 prompts x 8)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--narrow", action="store_true", help="every width 64, the preset's depth (a CPU run)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="the lengths' draw")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                    help="the modes to time; the first is the one the others are compared with")
    ap.add_argument("--out", default=None, help="a markdown file to write the table to")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    drawn = draw_lengths(args.lengths, args.rows, seed=args.seed)
    lengths = drawn["lengths"]
    if lengths is None:
        sys.exit(f"--lengths {args.lengths}: a drawn spec is needed (natural lengths come from a real model)")
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    lines = [f"# One update pass, micro-batches trimmed vs padded to the batch ({gpu}, {datetime.date.today()}, "
             f"torch {torch.__version__})", "", f"`python -m bench.bench_trim {' '.join(sys.argv[1:] if argv is None else argv)}`",
             "", f"{args.model}{' narrowed (every width 64, vocabulary 512)' if args.narrow else ''}, LoRA r {args.lora_r}, "
             f"{args.rows} rows of {args.prompt} prompt tokens + completions `{args.lengths}` (seed {args.seed}: mean "
             f"{statistics.mean(lengths):.0f}, longest {max(lengths)}, sha {drawn['lengths_sha']}), micro-batch "
             f"{args.micro_batch}, gradient checkpointing {'on' if args.checkpointing else 'off'}, "
             f"{torch.get_num_threads()} CPU thread(s)", "",
             f"Speed-up and LoRA gradients against the first mode's ({args.modes[0]}): the largest per-tensor max "
             f"|diff| / max |{args.modes[0]}|, and the relative norm of the difference over all of them; "
             f"\"{args.modes[0]} again\" compares its pass with its own earlier repeat (the run-to-run floor: 0 "
             "where the backward is deterministic).", "",
             f"| format | mode | micro-batches | tokens | s | speed-up | LoRA grads max rel. diff from {args.modes[0]} | "
             "rel. norm of the diff |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    for fmt in args.formats:
        policy = make_policy(args.model, fmt, device, args.lora_r, args.checkpointing, **(NARROW if args.narrow else {}))
        batch = make_batch(args.rows, args.prompt, lengths, policy.config.vocab_size, device)
        one_pass(policy, batch, args.micro_batch, "sorted")  # warm-up (and the CUDA auto budget's measurement)
        ref = args.modes[0]
        times, got, first = {m: [] for m in args.modes}, {}, None
        for _ in range(args.repeats):
            for mode in args.modes:
                times[mode].append(one_pass(policy, batch, args.micro_batch, mode))
                got[mode] = grads(policy)
                first = got[ref] if first is None else first
        base = statistics.median(times[ref])
        if args.repeats > 1:
            worst, norm = grad_diff(got[ref], first)
            lines.append(f"| {fmt} | {ref} again | | | | | {worst:.1e} | {norm:.1e} |")
            print(lines[-1], flush=True)
        for mode in args.modes:
            worst, norm = grad_diff(got[mode], got[ref])
            s = statistics.median(times[mode])
            row = (f"| {fmt} | {mode} | {len(groups(batch, args.micro_batch, mode))} | "
                   f"{tokens(batch, args.micro_batch, mode)} | {s:.3f} | {base / s:.2f}x | {worst:.1e} | {norm:.1e} |")
            print(row, flush=True)
            lines.append(row)
        del policy, batch
        free()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
