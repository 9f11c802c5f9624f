"""Rollout and whole-GRPO-step benchmark: StaticEngine (bf16 / NVFP4, + LoRA, + AQN) against
transformers' ``generate`` (bf16 + LoRA, bitsandbytes NF4 + LoRA = the QLoRA baseline) and the
memory-bandwidth floor, on random-initialised Qwen2.5 shapes. Everything in one process, one run.

    python -m bench.bench_rollout --out OUT            # the H200 run
    python -m bench.bench_rollout --smoke --out /tmp/x # CPU smoke (tiny presets)
    python -m bench.bench_rollout --parts rollout --models Qwen2.5-7B \
        --variants engine-nvfp4 engine-nf4 engine-mxfp4 hf-nf4 --out OUT   # NF4/MXFP4 on our engine (opt-in)

Parts (``--parts``): ``check`` (engine with graphs == eager == HF on a small model, on the GPU),
``rollout`` (tokens/s per model x batch), ``step`` (one GRPO step: time split and peak memory).
Each case runs in its own try block and a time guard (``--budget`` seconds) skips what would not
fit, so a partial run still writes its tables. Random weights: the speed of every kernel here is
independent of the values (no zeros: normal(0, 0.02) weights, random prompts).
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import time
import traceback
from pathlib import Path

import torch

# The shared helpers, also imported from here by tests and lab/ scripts (bench.bench_rollout.build, ...).
from bench.common import (T0, build, copy_bandwidth, free, log, random_prompts, sync, to_nf4,  # noqa: F401
                          weight_bytes, with_lora, write)
from qerl_kit.models import make_config
from qerl_kit.rollout import SamplingParams, StaticEngine


# An engine variant's StaticEngine options: "-sdpa" is the attention path before the split-KV
# kernel (every row holds its copy of the prompt's keys, scaled_dot_product_attention over them).
OLD_ATTENTION = dict(shared_prefix=False, attention="sdpa")


def engine_run(model, prompts, new: int, repeats: int = 1, n: int = 1, **engine_kw) -> dict:
    """``prompts`` x ``n`` rows (n samples of each prompt, as GRPO groups) at fixed length."""
    engine = StaticEngine(model, None, max_prefill_tokens=32768, **engine_kw)
    log(f"engine decode path: {engine.decoder.path}, attention {engine.decoder.attention}, "
        f"shared prefix {engine.shared_prefix}")
    sp = SamplingParams(max_new_tokens=new, temperature=1.0, seed=0)
    t = time.perf_counter()
    engine.generate_ids(prompts, n, sp, ignore_eos=True)  # warm-up: autotune, graph capture
    sync()
    warm = time.perf_counter() - t
    best = None
    for _ in range(repeats):
        t = time.perf_counter()
        out = engine.generate_ids(prompts, n, sp, ignore_eos=True)
        sync()
        total = time.perf_counter() - t
        if best is None or total < best["total_s"]:
            best = dict(total_s=total, prefill_s=out.stats["rollout/prefill_seconds"], decode_s=out.stats["rollout/decode_seconds"],
                        ms_per_step=1e3 * out.stats["rollout/decode_seconds"] / max(new - 1, 1), warmup_s=warm,
                        path=engine.decoder.path, kv_cache_gib=engine._state[1].cache.nbytes / 2**30)
    engine.reset()
    del engine
    free()
    return best


def hf_run(model, prompts, new: int, hf_tokens: int) -> dict:
    """transformers generate at fixed length; timed over ``hf_tokens`` new tokens (and 1, to split
    off the prefill), then extrapolated to ``new`` tokens."""
    dev = next(p for p in model.parameters() if p.device.type != "meta").device
    ids = torch.tensor(prompts, device=dev)
    mask = torch.ones_like(ids)

    def gen(k):
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=True,
                           temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
        sync()
        return time.perf_counter() - t

    gen(2)  # warm-up
    t1, tk = gen(1), gen(hf_tokens)
    per_step = (tk - t1) / (hf_tokens - 1)
    return dict(total_s=t1 + (new - 1) * per_step, prefill_s=t1, decode_s=(new - 1) * per_step,
                ms_per_step=1e3 * per_step, measured_tokens=hf_tokens)


def kv_bytes_per_token(model) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 2


def floor_ms_per_step(wbytes: int, model, batch: int, prompt: int, new: int, bw: float, n: int = 1) -> float:
    """Weights plus the KV cache read once per step at the copy bandwidth; with groups of n samples
    sharing one prompt, the prompt's keys are read once per group (a shared prefix)."""
    kv_tokens = batch // n * prompt + batch * new / 2
    return 1e3 * (wbytes + kv_tokens * kv_bytes_per_token(model)) / bw


# -- parts --------------------------------------------------------------------------------------
def part_check(args, device, results):
    """Graphs vs eager vs transformers on a small random model in the run's dtype."""
    from qerl_kit.models import build_model
    from qerl_kit.quantize import quantize_model

    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    out = {}
    for preset in ("qwen2-tiny", "qwen3-tiny", "llama-tiny"):
        model = build_model(preset, dtype=dtype, device=device, hidden_size=256, intermediate_size=512,
                            num_attention_heads=4, num_key_value_heads=2)
        quantize_model(model, "nvfp4")
        model = with_lora(model, 8)
        prompts = random_prompts(6, 37, 512, seed=1)
        sp = SamplingParams(max_new_tokens=40, temperature=0)
        with torch.no_grad():
            a = StaticEngine(model, None, cuda_graphs=True, length_bucket=16).generate_ids(prompts, 2, sp, ignore_eos=True)
            b = StaticEngine(model, None, cuda_graphs=False, length_bucket=16).generate_ids(prompts, 2, sp, ignore_eos=True)
            ids = torch.cat([torch.tensor(prompts, device=device).repeat_interleave(2, 0), a.completion_ids], 1)
            logits = model(input_ids=ids).logits[:, 36:-1].float()
        ref = torch.log_softmax(logits, -1).gather(2, a.completion_ids[:, :, None]).squeeze(2)
        sampled = StaticEngine(model, None).generate_ids(prompts, 2, SamplingParams(max_new_tokens=40, seed=5),
                                                         ignore_eos=True)
        ids_s = torch.cat([torch.tensor(prompts, device=device).repeat_interleave(2, 0), sampled.completion_ids], 1)
        with torch.no_grad():
            ls = torch.log_softmax(model(input_ids=ids_s).logits[:, 36:-1].float(), -1)
        ref_s = ls.gather(2, sampled.completion_ids[:, :, None]).squeeze(2)
        out[preset] = dict(
            graph_eq_eager_tokens=bool(torch.equal(a.completion_ids, b.completion_ids)),
            graph_vs_eager_logprob_maxdiff=(a.logprobs - b.logprobs).abs().max().item(),
            greedy_logprob_vs_hf_forward_maxdiff=(a.logprobs - ref).abs().max().item(),
            sampled_logprob_vs_hf_forward_maxdiff=(sampled.logprobs - ref_s).abs().max().item(),
            sampled_distinct_rows=len({tuple(r) for r in sampled.completion_ids.tolist()}))
        log(f"check {preset}: {out[preset]}")
        del model
        free()
    results["check"] = out


def part_rollout(args, device, results, bw):
    rows = results.setdefault("rollout", [])
    done = _done_cases(args.skip_done)
    for preset in args.models:
        variants = args.variants if preset not in args.nvfp4_only else ["engine-nvfp4", "engine-nvfp4-aqn"]
        batches = {v: args.aqn_batches if v == "engine-nvfp4-aqn" else args.batches for v in variants}
        variants = [v for v in variants if any((preset, v, b) not in done for b in batches[v])]
        todo = lambda v, b: v in variants and (preset, v, b) not in done  # noqa: E731
        vocab = make_config(preset).vocab_size  # ids in range for every preset (0.5B/1.5B: 151936)
        # 1) the bf16 model: transformers and our engine, both with LoRA
        if any(v in variants for v in ("hf-bf16", "engine-bf16", "engine-bf16-sdpa", "hf-nf4")):
            if time.perf_counter() - T0 > args.budget:
                log(f"budget spent: skip {preset} bf16")
            else:
                try:
                    t = time.perf_counter()
                    base = build(preset, "bf16", device)
                    peft = with_lora(base, args.lora_r)
                    wb = weight_bytes(peft)
                    log(f"{preset} bf16 built in {time.perf_counter() - t:.1f}s, {wb / 2**30:.1f} GiB read per step")
                    for batch in args.batches:
                        n = group(args, batch)
                        prompts = random_prompts(batch // n, args.prompt, vocab)
                        dense = random_prompts(batch, args.prompt, vocab)  # transformers: one row per prompt
                        for variant, fn in (("engine-bf16", lambda: engine_run(peft, prompts, args.new, n=n)),
                                            ("engine-bf16-sdpa", lambda: engine_run(peft, prompts, args.new, n=n,
                                                                                    **OLD_ATTENTION)),
                                            ("hf-bf16", lambda: hf_run(peft, dense, args.new, args.hf_tokens))):
                            if todo(variant, batch):
                                _case(rows, preset, variant, batch, fn, wb, peft, args, bw)
                    if "hf-nf4" in variants:
                        base = peft.unload()
                        peft = None  # freed (None, not del: the closures above read the name)
                        free()
                        peft = with_lora(to_nf4(base), args.lora_r)
                        wb = weight_bytes(peft)
                        for batch in (b for b in args.batches if todo("hf-nf4", b)):
                            prompts = random_prompts(batch, args.prompt, vocab)
                            _case(rows, preset, "hf-nf4", batch,
                                  lambda: hf_run(peft, prompts, args.new, args.hf_tokens), wb, peft, args, bw)
                    peft = base = None
                except Exception as err:  # noqa: BLE001 - record and go on
                    log(f"{preset} bf16/nf4 failed: {err!r}\n{traceback.format_exc()}")
                free()
        # 1b) NF4 / MXFP4 + LoRA on our engine (the lut4 kernels): QLoRA's format, decoded by the same
        # fused engine step as NVFP4
        _lut4_engine_cases(args, preset, device, rows, todo, variants, vocab, bw)
        # 2) NVFP4 + LoRA on our engine, with and without AQN
        if not any(v in variants for v in ("engine-nvfp4", "engine-nvfp4-sdpa", "engine-nvfp4-ours",
                                           "engine-nvfp4-aqn")):
            continue
        if time.perf_counter() - T0 > args.budget:
            log(f"budget spent: skip {preset} nvfp4")
            continue
        try:
            t = time.perf_counter()
            peft = with_lora(build(preset, "nvfp4", device), args.lora_r)
            wb = weight_bytes(peft)
            log(f"{preset} nvfp4 built in {time.perf_counter() - t:.1f}s, {wb / 2**30:.1f} GiB read per step")
            from qerl_kit.aqn import AQN

            aqn = AQN(sigma_start=1e-2, sigma_end=5e-4, stages=10, total_steps=100)
            for batch in args.batches:
                n = group(args, batch)
                prompts = random_prompts(batch // n, args.prompt, vocab)
                if todo("engine-nvfp4", batch):
                    _case(rows, preset, "engine-nvfp4", batch, lambda: engine_run(peft, prompts, args.new, n=n),
                          wb, peft, args, bw)
                if todo("engine-nvfp4-sdpa", batch):
                    _case(rows, preset, "engine-nvfp4-sdpa", batch,
                          lambda: engine_run(peft, prompts, args.new, n=n, **OLD_ATTENTION), wb, peft, args, bw)
                if todo("engine-nvfp4-ours", batch):  # the routing table without humming-kernels
                    def run_ours():
                        from qerl_kit.kernels import set_backend

                        with set_backend("ours"):
                            return engine_run(peft, prompts, args.new, n=n)
                    _case(rows, preset, "engine-nvfp4-ours", batch, run_ours, wb, peft, args, bw)
                if todo("engine-nvfp4-aqn", batch) and batch in args.aqn_batches:
                    def run_aqn():
                        with aqn.noise(peft, step=15):
                            return engine_run(peft, prompts, args.new, n=n)
                    _case(rows, preset, "engine-nvfp4-aqn", batch, run_aqn, wb, peft, args, bw)
            peft = None
        except Exception as err:  # noqa: BLE001
            log(f"{preset} nvfp4 failed: {err!r}\n{traceback.format_exc()}")
        free()


def _lut4_engine_cases(args, preset, device, rows, todo, variants, vocab, bw) -> None:
    """``engine-nf4`` / ``engine-mxfp4`` (opt-in variants): the bf16 model quantized to that format
    (``quantize_model``), LoRA attached, decoded by the StaticEngine, whose fused step runs the
    NF4/MXFP4 Triton kernels (docs/kernels.md): the same engine and kernels' structure as NVFP4's."""
    from qerl_kit.quantize import quantize_model

    for fmt in ("nf4", "mxfp4"):
        variant = f"engine-{fmt}"
        if variant not in variants:
            continue
        if time.perf_counter() - T0 > args.budget:
            log(f"budget spent: skip {preset} {fmt}")
            continue
        try:
            base = build(preset, "bf16", device)
            quantize_model(base, fmt)
            peft = with_lora(base, args.lora_r)
            wb = weight_bytes(peft)
            for batch in (b for b in args.batches if todo(variant, b)):
                n = group(args, batch)
                prompts = random_prompts(batch // n, args.prompt, vocab)
                _case(rows, preset, variant, batch, lambda: engine_run(peft, prompts, args.new, n=n), wb, peft, args, bw)
            peft = base = None  # freed before the next format's model is built
        except Exception as err:  # noqa: BLE001 - record and go on
            log(f"{preset} {fmt} failed: {err!r}\n{traceback.format_exc()}")
        free()


def group(args, batch: int) -> int:
    """Samples per prompt at this batch: ``--n``, or the whole batch when it is smaller."""
    return max(1, min(args.n, batch))


def _done_cases(paths) -> set:
    """(model, variant, batch) of the rows in earlier runs' rollout.csv files."""
    done = set()
    for path in paths:
        with open(path, newline="") as f:
            done |= {(r["model"], r["variant"], int(r["batch"])) for r in csv.DictReader(f)}
    return done


def _case(rows, preset, variant, batch, fn, wb, model, args, bw):
    if time.perf_counter() - T0 > args.budget:
        log(f"budget spent: skip {preset} {variant} B={batch}")
        return
    try:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        r = fn()
        n = group(args, batch) if variant.startswith("engine") else 1
        shared = variant.startswith("engine") and not variant.endswith("-sdpa")
        floor = floor_ms_per_step(wb, model, batch, args.prompt, args.new, bw, n if shared else 1)
        row = dict(model=preset, variant=variant, batch=batch, n=n, prompt=args.prompt, new_tokens=args.new,
                   tokens_per_s=batch * args.new / r["total_s"], total_s=r["total_s"], prefill_s=r["prefill_s"],
                   decode_ms_per_step=r["ms_per_step"], floor_ms_per_step=floor,
                   x_floor=r["ms_per_step"] / floor, measured_tokens=r.get("measured_tokens", args.new),
                   warmup_s=r.get("warmup_s", float("nan")), path=r.get("path", "transformers"),
                   kv_cache_gib=r.get("kv_cache_gib", float("nan")),
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan"))
        rows.append(row)
        log(f"{preset} {variant} B={batch}: {row['tokens_per_s']:.0f} tok/s, {r['ms_per_step']:.2f} ms/step "
            f"(floor {floor:.2f}), prefill {r['prefill_s']:.2f}s")
    except Exception as err:  # noqa: BLE001
        log(f"{preset} {variant} B={batch} failed: {err!r}\n{traceback.format_exc()}")
        free()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results/rollout"))
    ap.add_argument("--parts", nargs="+", default=["check", "rollout", "step"])
    ap.add_argument("--models", nargs="+", default=["Qwen2.5-7B", "Qwen2.5-32B", "Qwen2.5-14B", "Qwen2.5-72B"])
    ap.add_argument("--nvfp4-only", nargs="*", default=["Qwen2.5-72B"])
    ap.add_argument("--variants", nargs="+", default=["engine-bf16", "hf-bf16", "hf-nf4", "engine-nvfp4", "engine-nvfp4-aqn"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256])
    ap.add_argument("--aqn-batches", nargs="+", type=int, default=[8])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--hf-tokens", type=int, default=24)
    ap.add_argument("--n", type=int, default=1, help="samples per prompt on the engine (GRPO's group size); "
                    "batch / n distinct prompts (transformers: batch distinct prompts)")
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--step-cases", nargs="*", default=["Qwen2.5-7B:bf16", "Qwen2.5-7B:nvfp4", "Qwen2.5-32B:nvfp4",
                                                        "Qwen2.5-72B:nvfp4"])
    ap.add_argument("--checkpointing", nargs="*", default=["Qwen2.5-32B", "Qwen2.5-72B"])
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--skip-done", nargs="*", default=[], metavar="CSV",
                    help="earlier runs' rollout.csv: the (model, variant, batch) cases in them are not run again")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds after which remaining cases are skipped")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny presets, few tokens")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.models, args.nvfp4_only, args.batches, args.aqn_batches = ["qwen2-tiny", "llama-tiny"], ["llama-tiny"], [1, 4], [4]
        args.prompt, args.new, args.hf_tokens, args.lora_r = 8, 6, 3, 4
        args.step_cases, args.checkpointing = ["qwen2-tiny:none", "qwen2-tiny:nvfp4", "llama-tiny:nvfp4"], ["llama-tiny"]
        args.variants = [v for v in args.variants if v != "hf-nf4"]
    args.step_cases = [c.replace(":bf16", ":none") for c in args.step_cases]
    out = Path(args.out)
    results = {"meta": dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, python=platform.python_version(),
                            device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
                            args=vars(args))}
    try:
        import transformers
        import triton

        results["meta"].update(transformers=transformers.__version__, triton=triton.__version__)
        from importlib.metadata import PackageNotFoundError, version

        try:
            results["meta"]["humming"] = version("humming-kernels")
        except PackageNotFoundError:
            results["meta"]["humming"] = "not installed"
    except ImportError:
        pass
    bw = copy_bandwidth(device)
    results["meta"]["copy_bandwidth_GBps"] = bw / 1e9
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s on {results['meta']['device']}")
    for part in args.parts:
        try:
            if part == "check":
                part_check(args, device, results)
            elif part == "rollout":
                part_rollout(args, device, results, bw)
            elif part == "step":  # bench.bench_grpo_engines builds on this module's helpers
                from bench.bench_grpo_engines import part_step

                part_step(args, device, results)
        except Exception as err:  # noqa: BLE001
            log(f"part {part} failed: {err!r}\n{traceback.format_exc()}")
        write(results, out)
    write(results, out)
    log("done")


if __name__ == "__main__":
    main()
