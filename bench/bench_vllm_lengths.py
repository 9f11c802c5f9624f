"""vLLM on the cases of ``bench.bench_live_rows``: the same random Qwen2.5 shapes, LoRA r32, prompts
and forced completion lengths (lognormal mean 300, cap 1024, seed 0), so the two tables compare.

    python -m bench.bench_vllm_lengths --out OUT      # on the H200, with vLLM 0.26 importable

One format per process (vLLM's memory is not given back inside one): ``--formats nvfp4``, then
``--formats bf16``. Per format (``nvfp4``: our compressed-tensors export, which vLLM runs with its Marlin FP4 kernels;
``bf16``: ``save_pretrained`` of the same random model; ``nf4``: that bf16 checkpoint quantized by vLLM
with ``quantization="bitsandbytes"``, the QLoRA baseline), one ``vllm.LLM`` with LoRA (the adapter as
a ``LoRARequest``, as ``qerl_kit.rollout.vllm`` sends it) and per-token log-probs on, as an RL
rollout needs. Each request gets ``min_tokens = max_tokens = L`` and ``ignore_eos`` (its forced
length); vLLM batches continuously, so finished rows leave the batch. Also, at ``--fixed-batches``
(1, 8, 64, 256), a fixed-length run (every row ``--fixed`` = 512 tokens, and 1 token
for the prefill; best of ``--repeats``) for vLLM's ms per decode step at that batch.

At 32B (fixed lengths only):

    python -m bench.bench_vllm_lengths --model Qwen2.5-32B --formats nvfp4 --batches --gpu-util 0.6
    python -m bench.bench_vllm_lengths --model Qwen2.5-32B --formats bf16 --batches --dummy-weights --gpu-util 0.93

(``--dummy-weights``: vLLM's own random weights, as no 61 GiB checkpoint fits on the machine's disk.
0.93 leaves the KV cache room for all 256 rows of 784 tokens next to the 61 GiB of weights: on the
H200, vLLM's log read "Maximum concurrency for 784 tokens per request: 340.41x".)
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.bench_live_rows import add_length_args, hash_lengths, lengths_for
from bench.common import build, free, log, random_prompts, with_lora


def export(peft, fmt: str, root: Path, weights: bool = True) -> Path:
    """The checkpoint vLLM loads: ``nvfp4`` our compressed-tensors export, ``bf16`` the base as saved.
    ``weights=False`` (bf16 only) writes the config alone, for vLLM's ``load_format="dummy"``:
    a 32B bf16 checkpoint (61 GiB) does not fit next to the rest on the H200 machine's 64 GiB disk,
    and the weights are random either way."""
    path = Path(tempfile.mkdtemp(prefix=f"vllm-{fmt}-", dir=root))
    if not weights:
        if fmt != "bf16":
            raise ValueError(f"weights=False is for fmt='bf16' (vLLM's dummy loader fills every tensor with "
                             f"uniform noise, which is no NVFP4 checkpoint); got fmt={fmt!r}")
        peft.get_base_model().config.save_pretrained(str(path))
    elif fmt == "nvfp4":
        from qerl_kit.export import save_nvfp4

        save_nvfp4(peft, path)
    else:  # the base's own tensor names: without peft's ``base_layer`` level and the LoRA matrices
        base = peft.get_base_model()
        state = {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if ".lora_" not in k}
        base.save_pretrained(str(path), state_dict=state, safe_serialization=True)
    return path


def timed(llm, prompts, params, lora) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    return wall, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results/vllm_lengths"))
    ap.add_argument("--model", default="Qwen2.5-7B")
    ap.add_argument("--formats", nargs="+", default=["nvfp4"])
    ap.add_argument("--batches", nargs="*", type=int, default=[64, 256], help="batches of the realistic-lengths runs "
                    "(none: fixed lengths only)")
    ap.add_argument("--fixed-batches", nargs="*", type=int, default=[1, 8, 64, 256])
    add_length_args(ap)
    ap.add_argument("--fixed", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2, help="fixed-length runs per batch (the best is kept)")
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--budget", type=float, default=400.0)
    ap.add_argument("--gpu-util", type=float, default=0.6, help="vLLM's gpu_memory_utilization")
    ap.add_argument("--dummy-weights", action="store_true", help="bf16 only: vLLM's load_format='dummy' "
                    "(random weights, no checkpoint written; for 32B)")
    ap.add_argument("--prefix-caching", action="store_true", help="vLLM's prefix caching on (off by default: "
                    "runs repeat their prompts)")
    args = ap.parse_args()
    if not args.batches and not args.fixed_batches:
        ap.error("--batches and --fixed-batches are both empty: nothing to measure")
    if args.dummy_weights and set(args.formats) != {"bf16"}:
        ap.error(f"--dummy-weights is for --formats bf16 alone; got --formats {' '.join(args.formats)}")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from qerl_kit.rollout.vllm import AdapterWriter

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0, rows = time.perf_counter(), []
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    # room for the longest request: the cap of the realistic runs, the fixed length of the others
    max_len = args.prompt + max(args.cap if args.batches else 0, args.fixed if args.fixed_batches else 0) + 16
    for fmt in args.formats:
        if time.perf_counter() - t0 > args.budget:
            log(f"budget spent: skip {fmt}")
            continue
        # nf4 = the QLoRA baseline of the paper: the bf16 checkpoint, quantized by vLLM with bitsandbytes
        peft = with_lora(build(args.model, "bf16" if fmt == "nf4" else fmt, "cuda"), args.lora_r)
        vocab = peft.get_base_model().config.vocab_size
        path = export(peft, "bf16" if fmt == "nf4" else fmt, root, weights=not args.dummy_weights)
        writer = AdapterWriter(root)
        lora_id, lora_path = writer.write(peft)
        del peft
        free()
        t = time.perf_counter()
        # prefix caching off: the fixed-length runs and the realistic run send the same prompts, and a
        # cached prompt would take vLLM's prefill out of its wall time (ours always pays it)
        kwargs = dict(model=str(path), gpu_memory_utilization=args.gpu_util, max_model_len=max_len,
                      enable_prefix_caching=args.prefix_caching,
                      max_num_seqs=max(args.batches + args.fixed_batches), skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                      logprobs_mode="processed_logprobs")
        if fmt == "nf4":  # needs the bitsandbytes package next to vLLM
            kwargs["quantization"] = "bitsandbytes"
        if args.dummy_weights:
            kwargs["load_format"] = "dummy"
        try:
            llm = LLM(enable_lora=True, max_lora_rank=args.lora_r, max_loras=1, **kwargs)
            lora = LoRARequest("bench", lora_id, str(lora_path))
        except Exception as err:  # noqa: BLE001 - say what failed, measure without the adapter
            log(f"vLLM with LoRA failed to start ({err!r:.300}); measuring without LoRA")
            llm, lora = LLM(**kwargs), None
        log(f"vLLM {vllm.__version__} {fmt}: LLM built in {time.perf_counter() - t:.1f}s (LoRA {lora is not None})")
        sp = lambda n_tok: SamplingParams(n=1, max_tokens=n_tok, min_tokens=n_tok, ignore_eos=True, temperature=1.0,  # noqa: E731
                                          logprobs=0, detokenize=False, seed=0)
        timed(llm, random_prompts(8, args.prompt, vocab, seed=1), [sp(16)] * 8, lora)  # warm-up: LoRA load, kernels
        for batch in sorted(set(args.batches) | set(args.fixed_batches)):
            if time.perf_counter() - t0 > args.budget:
                log(f"budget spent: skip {fmt} batch {batch}")
                continue
            prompts = random_prompts(batch, args.prompt, vocab)
            row = dict(engine=f"vllm-{vllm.__version__}", model=args.model, format=fmt, lora=lora is not None,
                       batch=batch, prompt=args.prompt, dummy_weights=args.dummy_weights)
            if batch in args.fixed_batches:
                prefill = min(timed(llm, prompts, [sp(1)] * batch, lora)[0] for _ in range(args.repeats))
                fixed = min(timed(llm, prompts, [sp(args.fixed)] * batch, lora)[0] for _ in range(args.repeats))
                ms = 1e3 * (fixed - prefill) / (args.fixed - 1)
                row.update(fixed_len=args.fixed, fixed_wall_s=fixed, prefill_s=prefill, ms_per_step_fixed=ms)
                log(f"vLLM {fmt} batch {batch}: fixed {args.fixed} tokens {fixed:.2f}s = {ms:.2f} ms/step, "
                    f"prefill {prefill:.3f}s")
            if batch in args.batches:
                lengths = lengths_for(batch, args.mean, args.sigma, args.cap)
                wall, outs = timed(llm, prompts, [sp(L) for L in lengths], lora)
                got = [len(o.outputs[0].token_ids) for o in outs]
                assert got == lengths, (got[:8], lengths[:8])
                mean = sum(lengths) / batch
                row.update(mean_length=mean, max_length=max(lengths), lengths_sha=hash_lengths(lengths),
                           realistic_wall_s=wall)
                if "ms_per_step_fixed" in row:
                    row["ratio_to_mean_length"] = wall / (mean * row["ms_per_step_fixed"] / 1e3)
                log(f"vLLM {fmt} batch {batch}: realistic {wall:.2f}s (mean {mean:.0f}, max {max(lengths)})")
            rows.append(row)
        del llm
        writer.cleanup()
        shutil.rmtree(path, ignore_errors=True)  # our own export (5-15 GB): the machine's disk is shared by the calls
        free()
    meta = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__,
                vllm=vllm.__version__, args=vars(args))
    tag = "_".join(args.formats)
    (out / f"vllm_lengths_{tag}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    if rows:
        with open(out / f"vllm_lengths_{tag}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            w.writeheader()
            w.writerows(rows)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
