#!/usr/bin/env python
"""Train the shipped tiny model (``qerl_kit/assets/tiny-arith``) from scratch, reproducibly.

    python scripts/train_tiny.py                       # GPU if there is one, else CPU (slow)
    python scripts/train_tiny.py --device cuda --out /tmp/tiny-arith --curve /tmp/curve.csv

What it does (docs/tiny-model.md records the command, wall time and results of the shipped run):

1. Builds the byte-level tokenizer and a randomly initialised ``Qwen2ForCausalLM``
   (``qerl_kit.tiny.build_tokenizer`` / ``tiny_config``), seeded.
2. Draws a pool of distinct train-split problems (``qerl_kit.tasks.arith.make_dataset``, levels 1-4)
   and trains on them with next-token loss on the assistant turn only (solution + ``<|end|>``).
   Each example is drawn with the GSM8K instruction suffix (``--suffix-prob``) or without, and for
   levels >= 2 its target is, with probability ``--slip``, a careless solution that skips the last
   step (``careless_solution``). That noise is the calibration: greedy decoding follows the
   majority (the slip) on levels >= 2, sampling still finds the full solution ~40% of the time.
3. Every ``--eval-every`` steps, greedy accuracy of the dense model on held-out problems; the curve
   (step, loss, lr, held-out greedy accuracy, elapsed seconds) goes to ``--curve`` as CSV.
4. Saves the HF directory (bf16 safetensors, config, generation config, tokenizer, chat template)
   to ``--out``, checks that the saved tokenizer loaded through ``AutoTokenizer`` gives the training
   ids, reloads the directory the way users do (``qerl_kit.tiny.load_tiny``) and prints the
   calibration: greedy accuracy dense and after NVFP4, accuracy and pass@8 of samples at T=1, by
   level, on ``--final-eval-n`` held-out problems.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from qerl_kit.data import GSM8K_SUFFIX, build_prompt  # noqa: E402
from qerl_kit.tasks.arith import LEVELS, careless_solution, make_dataset  # noqa: E402
from qerl_kit.evaluate import evaluate as evaluate_rows  # noqa: E402
from qerl_kit.rewards import gsm8k_reward  # noqa: E402
from qerl_kit.tasks.arith import PROMPT_SUFFIX  # noqa: E402
from qerl_kit.tiny import TINY_DIR, build_tokenizer, load_tiny, tiny_config  # noqa: E402


def evaluate(model, tok, rows, samples: int = 1, temperature: float = 0.0, batch_size: int = 64,
             suffix: str = PROMPT_SUFFIX) -> dict:
    """Accuracy (mean pass@1), pass@k and both by level, through ``qerl_kit.evaluate`` (greedy, or
    ``samples`` completions at ``temperature`` with top-p off); ``batch_size`` counts completions."""
    res = evaluate_rows(model, tok, rows, gsm8k_reward, samples=samples, temperature=temperature, top_p=1.0,
                        max_new_tokens=64, batch_size=max(1, batch_size // samples),
                        prompt_fn=lambda t, r: build_prompt(t, r["prompt"], suffix=suffix))
    return {"accuracy": res.accuracy, "pass_at_k": res.pass_at_k, "by_level": res.by("level"), "n": res.num_problems,
            "samples": samples, "temperature": temperature}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decay floor, x lr")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pool", type=int, default=300_000, help="distinct train problems to draw from")
    p.add_argument("--slip", type=float, default=0.6,
                   help="probability that a level>=2 target skips its last step (calibration)")
    p.add_argument("--suffix-prob", type=float, default=0.5,
                   help="share of prompts with the GSM8K instruction suffix of build_prompt")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-n", type=int, default=128)
    p.add_argument("--final-eval-n", type=int, default=400)
    p.add_argument("--samples", type=int, default=8, help="k of pass@k in the final calibration")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--out", default=str(TINY_DIR))
    p.add_argument("--curve", default=str(ROOT / "bench" / "results" / "tiny_train_h200" / "curve.csv"))
    p.add_argument("--report", default=None, help="also write the calibration numbers as JSON here")
    p.add_argument("--time-limit", type=float, default=None,
                   help="stop training after this many seconds (the run is then not the default one)")
    return p.parse_args(argv)


def encode_pool(tok, rows, rng: random.Random):
    """Token ids of each row's two prompt forms and two targets (clean, slipped).

    The tokenizer maps every byte b of plain text to the id ``offset + b`` (no merges), so the
    pool is encoded from the UTF-8 bytes directly; the chat template and ``<|end|>`` go through the
    tokenizer once, and the first rows are checked against the tokenizer itself.
    """
    offset = tok.convert_tokens_to_ids("!") - ord("!")

    def ids(text: str) -> list[int]:
        return [offset + b for b in text.encode()]

    eos = [tok.eos_token_id]
    forms = []
    for suffix in ("", GSM8K_SUFFIX):  # the chat template rendered once around a placeholder
        head, tail = build_prompt(tok, "\x00", suffix=suffix).split("\x00")
        head_ids, tail_ids = (tok(t, add_special_tokens=False)["input_ids"] for t in (head, tail))
        forms.append([head_ids + ids(r["prompt"]) + tail_ids for r in rows])
    clean = [ids(r["solution"]) + eos for r in rows]
    slipped = [ids(careless_solution(r, rng, 1.0)) + eos for r in rows]
    for i, r in enumerate(rows[:200]):
        for form, suffix in zip(forms, ("", GSM8K_SUFFIX)):
            text = build_prompt(tok, r["prompt"], suffix=suffix) + r["solution"] + tok.eos_token
            assert form[i] + clean[i] == tok(text, add_special_tokens=False)["input_ids"], text
    return tuple([np.asarray(x, dtype=np.int64) for x in part]
                 for part in (forms[0], forms[1], clean, slipped))


def make_batch(pool, levels, idx, rng: random.Random, args, pad_id: int):
    """Right-padded (input_ids, labels, attention_mask); labels only on the assistant turn."""
    bare, suffixed, clean, slipped = pool
    parts = []
    for i in idx:
        prompt = suffixed[i] if rng.random() < args.suffix_prob else bare[i]
        target = slipped[i] if levels[i] >= 2 and rng.random() < args.slip else clean[i]
        parts.append((prompt, target))
    return pad_pairs(parts, pad_id)


def pad_pairs(parts, pad_id: int):
    """(prompt ids, target ids) pairs -> right-padded (input_ids, labels, attention_mask) tensors,
    labels only on the target (the assistant turn). Also used by scripts/train_countdown.py."""
    width = max(len(p) + len(t) for p, t in parts)
    ids = np.full((len(parts), width), pad_id, dtype=np.int64)
    lab = np.full((len(parts), width), -100, dtype=np.int64)
    mask = np.zeros((len(parts), width), dtype=np.int64)
    for j, (p, t) in enumerate(parts):
        n, m = len(p), len(p) + len(t)
        ids[j, :n] = p
        ids[j, n:m] = t
        lab[j, n:m] = t
        mask[j, :m] = 1
    return torch.from_numpy(ids), torch.from_numpy(lab), torch.from_numpy(mask)


def check_tokenizer(tok, out_dir: str, rows) -> None:
    """The saved tokenizer, loaded as users load it, must give the ids the model was trained on."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    for r in rows:
        text = build_prompt(tok, r["prompt"]) + r["solution"] + tok.eos_token
        want = tok(text, add_special_tokens=False)["input_ids"]
        assert loaded(text, add_special_tokens=False)["input_ids"] == want, \
            f"{type(loaded).__name__} loaded from {out_dir} tokenizes differently"
    assert loaded.decode(loaded(text)["input_ids"]) == text


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(args.steps - args.warmup, 1)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def calibrate(out_dir: str, device, n: int, samples: int) -> dict:
    """Greedy (bf16 weights, dense and NVFP4) and sampled (T=1) accuracy on held-out problems."""
    rows = make_dataset("test", n, seed=0, levels=LEVELS)
    bs = 512 if torch.device(device).type == "cuda" else 64
    res = {}
    dense, tok = load_tiny(out_dir, device=device)
    res["greedy_dense"] = evaluate(dense, tok, rows, batch_size=bs)
    quant, _ = load_tiny(out_dir, quantize="nvfp4", device=device)
    res["greedy_nvfp4"] = evaluate(quant, tok, rows, batch_size=bs)
    res["greedy_nvfp4_gsm8k_suffix"] = evaluate(quant, tok, rows, batch_size=bs, suffix=GSM8K_SUFFIX)
    res["sampled_t1_nvfp4"] = evaluate(quant, tok, rows, samples=samples, temperature=1.0, batch_size=bs)
    res["sampled_t1_dense"] = evaluate(dense, tok, rows, samples=samples, temperature=1.0, batch_size=bs)
    return res


def print_calibration(res: dict) -> None:
    print(f"{'metric':28s} {'all':>6s} " + " ".join(f"{'L' + str(k):>6s}" for k in LEVELS))
    for name, r in res.items():
        for key in ("accuracy", "pass_at_k") if name.startswith("sampled") else ("accuracy",):
            label = name if key == "accuracy" else f"{name} pass@{r['samples']}"
            cells = " ".join(f"{r['by_level'][k][key]:6.1%}" for k in LEVELS)
            print(f"{label:28s} {r[key]:6.1%} {cells}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = random.Random(f"train-tiny:{args.seed}")
    t0 = time.perf_counter()

    tok = build_tokenizer()
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_config(tiny_config(tok), dtype=torch.float32).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    train_rows = make_dataset("train", args.pool, seed=args.seed, levels=LEVELS)
    pool = encode_pool(tok, train_rows, random.Random(0))
    levels = [r["level"] for r in train_rows]
    eval_rows = make_dataset("test", args.eval_n, seed=0, levels=LEVELS)
    print(f"device {device}, {n_params / 1e6:.2f} M parameters, pool {len(train_rows)} train problems "
          f"({time.perf_counter() - t0:.1f} s to build)", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), fused=device.type == "cuda")
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
           else torch.autocast("cpu", enabled=False))
    curve = []
    os.makedirs(os.path.dirname(os.path.abspath(args.curve)), exist_ok=True)
    losses = []
    step = 0
    train_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step - 1, args)
        idx = [rng.randrange(len(train_rows)) for _ in range(args.batch_size)]
        batch = make_batch(pool, levels, idx, rng, args, tok.pad_token_id)
        ids, lab, mask = (t.to(device, non_blocking=True) for t in batch)
        model.train()
        with amp:
            loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        last = step == args.steps
        timed_out = args.time_limit is not None and time.perf_counter() - train_start > args.time_limit
        if step % 50 == 0 or last or timed_out:
            row = {"step": step, "loss": round(torch.stack(losses).mean().item(), 5), "lr": lr_at(step - 1, args),
                   "heldout_greedy_acc": "", "elapsed_s": round(time.perf_counter() - t0, 1)}
            losses = []
            if step % args.eval_every == 0 or last or timed_out:
                model.eval()
                acc = evaluate(model, tok, eval_rows, batch_size=512 if device.type == "cuda" else 64)
                row["heldout_greedy_acc"] = round(acc["accuracy"], 4)
                row["elapsed_s"] = round(time.perf_counter() - t0, 1)
                print(f"step {step:6d}  loss {row['loss']:.4f}  lr {row['lr']:.2e}  held-out greedy "
                      f"{acc['accuracy']:.1%} " + str({k: round(v['accuracy'], 2) for k, v in acc['by_level'].items()})
                      + f"  {row['elapsed_s']} s", flush=True)
            curve.append(row)
        if timed_out:
            print(f"time limit reached after {step} of {args.steps} steps", flush=True)
            break
    train_seconds = time.perf_counter() - train_start
    with open(args.curve, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(curve[0]))
        w.writeheader()
        w.writerows(curve)

    model = model.to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               do_sample=False, max_new_tokens=64)
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    check_tokenizer(tok, args.out, train_rows[:200])
    size = sum(p.stat().st_size for p in Path(args.out).iterdir() if p.is_file())
    print(f"saved {args.out} ({size / 2**20:.2f} MiB); trained {step} steps in {train_seconds:.0f} s", flush=True)

    res = calibrate(args.out, device, args.final_eval_n, args.samples)
    print_calibration(res)
    summary = {"steps": step, "train_seconds": round(train_seconds, 1),
               "total_seconds": round(time.perf_counter() - t0, 1), "device": str(device),
               "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "params": n_params, "dir_bytes": size,
               "args": vars(args), "calibration": res}
    if args.report:
        with open(args.report, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    print(f"total {summary['total_seconds']} s", flush=True)
    return summary


if __name__ == "__main__":
    main()
