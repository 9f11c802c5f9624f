#!/usr/bin/env python
"""Train a ~19M-parameter Qwen2 model on Countdown (``qerl_kit.tasks.countdown``), for issue #28's
testbed: a policy that starts weak on greedy decoding but finds answers when it samples.

    python scripts/train_countdown.py --device cuda --out runs/countdown-19m     # the H200 run
    python scripts/train_countdown.py --smoke --out /tmp/cd                      # CPU smoke (seconds)

What it does:

1. Builds the shipped tiny model's byte-level tokenizer (``qerl_kit.tiny.build_tokenizer``) and a
   randomly initialised ``Qwen2ForCausalLM`` of ``--layers`` x ``--hidden`` (default 6 x 512,
   MLP 1536, 8 heads / 4 kv heads: ~19M parameters, ~38 MB in bf16), seeded.
2. Trains with next-token loss on the assistant turn only, on distinct train-split problems of
   levels 3-5. The target is ``#### <solution>``; with probability ``--miss`` it is a *near miss*
   instead: the solution with one operator changed (a well-formed answer over the given numbers
   with the wrong value). That noise is the calibration: greedy decoding follows the majority
   form, sampling still finds the exact expression some of the time, so RL has room and signal.
3. Every ``--eval-every`` steps, held-out greedy accuracy (the curve goes to OUT/train_report.json).
4. Saves the HF directory (bf16 safetensors, tokenizer, generation config) to ``--out`` (refused if
   it exists and is not empty) and prints the calibration: greedy accuracy dense and NVFP4, and
   accuracy / pass@8 of samples at T = 1, by level. The aim (issue #28): greedy 10-40%, pass@8
   clearly higher; ``--miss``, ``--steps`` and ``--stop-at-acc`` (stop once greedy accuracy reaches
   it, before training overshoots the band) are the knobs.

On the H200 (2026-12-02), ``--miss 0.0 --time-budget 120`` stopped at step 747 (~3 minutes in all)
with greedy 18.3% (NVFP4 19.0%) and pass@8 53.7% on 300 held-out problems; ``--stop-at-step 747``
replays it (docs/experiments.md has the command, bench/results/experiments_countdown_h200/calibration/ the
logs and the shards' sha256). The replay is reproducible in distribution, not bit for bit (GPU
training is not deterministic): two later replays gave other shards and greedy 18.7% / 21.0%, pass@8
57.0% / 57.0% (bench/device.sh cdtrain compares the sums and says so). The CPU smoke test
is tests/test_countdown.py.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from qerl_kit.tasks import countdown as cd  # noqa: E402
from qerl_kit.tiny import build_tokenizer, tiny_config  # noqa: E402
from scripts.train_tiny import pad_pairs  # noqa: E402

OPS = "+-*/"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--pool", type=int, default=60_000, help="distinct train problems (all ~2.9k of level 3, the rest levels 4-5)")
    p.add_argument("--miss", type=float, default=0.5, help="share of near-miss training targets")
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-n", type=int, default=256)
    p.add_argument("--final-eval-n", type=int, default=600)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48, help="completion budget of the evaluations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds of training (after the pool is built) after which it stops early; the cosine "
                        "schedule still spans --steps")
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="stop after this step (evaluating there), the cosine schedule still spanning --steps: "
                        "replays a run that a --time-budget stopped (its train_report.json names the step)")
    p.add_argument("--stop-at-acc", type=float, default=None,
                   help="stop at the first evaluation whose held-out greedy accuracy reaches this (e.g. 0.3: "
                        "the calibration band is 10-40%%, and more training only overshoots it)")
    p.add_argument("--shard-mb", type=int, default=14, help="largest safetensors shard written (MB)")
    p.add_argument("--curve", default=None, help="also write the training curve here (JSON lines; it is in OUT/train_report.json)")
    p.add_argument("--smoke", action="store_true", help="a tiny model and a few steps (CPU tests)")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.batch_size, args.layers, args.hidden, args.pool = 6, 8, 1, 64, 200
        args.eval_every, args.eval_n, args.final_eval_n, args.samples, args.max_new_tokens = 3, 3, 3, 2, 6
    if not 0.0 <= args.miss <= 1.0:
        p.error(f"--miss must be in [0, 1]; got {args.miss}")
    if args.stop_at_step is not None and not 1 <= args.stop_at_step <= args.steps:
        p.error(f"--stop-at-step must be in [1, --steps={args.steps}]; got {args.stop_at_step}")
    if args.stop_at_acc is not None and not 0.0 <= args.stop_at_acc <= 1.0:
        p.error(f"--stop-at-acc must be in [0, 1]; got {args.stop_at_acc}")
    return args


def near_miss(solution: str, numbers, target: int, rng: random.Random) -> str | None:
    """The solution with one operator changed so that it is still well formed over the numbers
    but its value is not the target; None when no such change exists."""
    spots = [i for i, c in enumerate(solution) if c in OPS]
    rng.shuffle(spots)
    for i in spots:
        for op in rng.sample(OPS, len(OPS)):
            if op == solution[i]:
                continue
            cand = solution[:i] + op + solution[i + 1:]
            parsed = cd.parse_expression(cand)
            if parsed is not None and parsed[0] != target:
                return cand
    return None


def encode(tok, rows, rng: random.Random, miss: float):
    """(prompt ids, target ids) per row; targets are ``#### expression`` + end of turn."""
    from qerl_kit.tasks.countdown import countdown_prompt

    out = []
    for r in rows:
        expr = r["solution"]
        if rng.random() < miss:
            expr = near_miss(expr, r["numbers"], r["target"], rng) or expr
        prompt = tok(countdown_prompt(tok, r), add_special_tokens=False)["input_ids"]
        target = tok(f"#### {expr}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append((prompt, target))
    return out


def evaluate(model, tok, rows, max_new_tokens: int, samples: int = 1, temperature: float = 0.0) -> dict:
    from qerl_kit.evaluate import evaluate as evaluate_rows
    from qerl_kit.tasks.countdown import countdown_prompt, countdown_reward

    res = evaluate_rows(model, tok, rows, countdown_reward, samples=samples, temperature=temperature, top_p=1.0,
                        max_new_tokens=max_new_tokens, batch_size=256, prompt_fn=countdown_prompt)
    return {"accuracy": res.accuracy, "pass_at_k": res.pass_at_k, "samples": samples,
            "by_level": {k: v["accuracy"] for k, v in res.by("level").items()}}


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out} exists and is not empty; choose a new directory")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(args.seed)
    rng = random.Random(f"train-countdown:{args.seed}")
    t0 = time.perf_counter()
    tok = build_tokenizer()
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = tiny_config(tok, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                         num_key_value_heads=max(1, args.hidden // 128))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    train_rows = cd.make_dataset("train", args.pool, seed=args.seed)
    pairs = encode(tok, train_rows, rng, args.miss)
    eval_rows = cd.make_dataset("test", args.eval_n, seed=0)
    print(f"device {device}, {n_params / 1e6:.1f} M parameters, {len(train_rows)} train problems", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    curve = []
    stopped_at = args.steps
    t_train = time.perf_counter()  # the time budget counts training only, not building the pool (~40 s for 60k)
    for step in range(1, args.steps + 1):
        warm = min(1.0, step / args.warmup)
        cos = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = args.lr * warm * cos
        ids, lab, mask = (t.to(device) for t in pad_pairs([pairs[rng.randrange(len(pairs))]
                                                       for _ in range(args.batch_size)], tok.pad_token_id))
        model.train()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out_of_time = args.time_budget is not None and time.perf_counter() - t_train > args.time_budget
        stop_here = out_of_time or step == args.stop_at_step  # either way: evaluate at this step, then stop
        reached = False
        if step % args.eval_every == 0 or step == args.steps or stop_here:
            model.eval()
            acc = evaluate(model, tok, eval_rows, args.max_new_tokens)["accuracy"]
            curve.append({"step": step, "loss": round(loss.item(), 4), "heldout_greedy_acc": round(acc, 4),
                          "elapsed_s": round(time.perf_counter() - t0, 1)})
            print(curve[-1], flush=True)
            reached = args.stop_at_acc is not None and acc >= args.stop_at_acc
        if reached:
            stopped_at = step
            print(f"held-out greedy accuracy {acc:.1%} reached --stop-at-acc {args.stop_at_acc:.0%}: stopped at "
                  f"step {step} of {args.steps}", flush=True)
            break
        if stop_here:
            stopped_at = step
            why = f"time budget of {args.time_budget:.0f} s spent" if out_of_time else f"--stop-at-step {step}"
            print(f"{why}: stopped at step {step} of {args.steps}", flush=True)
            break
    model = model.to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               do_sample=False, max_new_tokens=48)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True, max_shard_size=f"{args.shard_mb}MB")
    tok.save_pretrained(str(out))
    final_rows = cd.make_dataset("test", args.final_eval_n, seed=0)
    from qerl_kit.tiny import load_tiny

    dense, tok2 = load_tiny(out, device=device)
    quant, _ = load_tiny(out, quantize="nvfp4", device=device)
    n = args.max_new_tokens
    calib = {"greedy_dense": evaluate(dense, tok2, final_rows, n), "greedy_nvfp4": evaluate(quant, tok2, final_rows, n),
             "sampled_t1_nvfp4": evaluate(quant, tok2, final_rows, n, samples=args.samples, temperature=1.0)}
    summary = {"params": n_params, "steps": stopped_at, "seconds": round(time.perf_counter() - t0, 1),
               "device": str(device), "args": vars(args), "curve": curve, "calibration": calib}
    (out / "train_report.json").write_text(json.dumps(summary, indent=1, default=str))
    if args.curve:
        Path(args.curve).write_text("\n".join(json.dumps(r) for r in curve) + "\n")
    for name, r in calib.items():
        extra = f", pass@{r['samples']} {r['pass_at_k']:.1%}" if r["samples"] > 1 else ""
        print(f"{name:18s} accuracy {r['accuracy']:.1%}{extra}  by level {r['by_level']}", flush=True)
    return summary


if __name__ == "__main__":
    main()
