"""The fused decode step's LoRA: the grouped Triton kernels (``qerl_kit.kernels.lora_triton``, two
launches per projection group) against the torch path they replaced (a concatenation, a matmul and
one ``addmm`` per projection) and against no LoRA work at all (a lower bound, wrong outputs), in the
same run, on Qwen2.5-7B with random weights, LoRA r = 32, a 256-token prompt and 256 new tokens.

    python -m bench.bench_lora_engine --out bench/results
    python -m bench.bench_lora_engine --smoke --out /tmp/x   # CPU, tiny model
    python -m bench.bench_lora_engine --tiling 8,64,4 --batches 8 64 --out OUT   # one more path: that Tiling

``--tiling SPLITS,BLOCK_M,N_BLOCKS[,reduce]`` adds the grouped kernels cut by that ``lora_triton.Tiling`` as a
path of its own (``bench.bench_lora_tiling`` times the tilings launch by launch).
"""

from __future__ import annotations

import argparse
import datetime
import functools
from pathlib import Path

import torch

from bench import bench_rollout as br
from bench.bench_lora_tiling import lora_path, parse_tiling
from qerl_kit.kernels.lora_triton import lora_apply_, lora_apply_ref_

PATHS = {"torch ops": lora_apply_ref_, "grouped kernels": lora_apply_, "no LoRA work": lambda y, *args: y}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--model", default="Qwen2.5-7B")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny model, a few tokens")
    ap.add_argument("--tiling", default=None,
                    help="SPLITS,BLOCK_M,N_BLOCKS[,reduce]: one more path, the kernels so cut")
    args = ap.parse_args()
    paths = dict(PATHS)
    if args.tiling:
        try:
            tiling = parse_tiling(args.tiling)
        except ValueError as err:
            ap.error(f"--tiling: {err}")
        paths = {"torch ops": PATHS["torch ops"], "grouped kernels": lora_apply_,
                 f"grouped kernels, tiling {args.tiling}": functools.partial(lora_apply_, tiling=tiling),
                 "no LoRA work": PATHS["no LoRA work"]}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompt, vocab, rank = 256, 152064, 32
    if args.smoke:
        args.model, args.batches, args.new = "qwen2-tiny", [1, 2], 4
        prompt, vocab, rank = 8, 512, 4
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    lines = [f"# Engine decode step, LoRA paths ({gpu}, {datetime.date.today()}, torch {torch.__version__})", "",
             f"{args.model}, random weights, LoRA r = {rank} on every projection, prompt {prompt}, {args.new} new "
             f"tokens, {'CUDA graphs' if device == 'cuda' else 'eager (CPU)'}; decode ms per step, all in one run.", "",
             "| weights | batch | " + " | ".join(paths) + " | LoRA cost, each path in turn (less no LoRA work) |",
             "|---|---:|" + "---:|" * len(paths) + "---|"]
    for fmt in ("nvfp4", "bf16"):
        model = br.with_lora(br.build(args.model, fmt, device), rank)
        for batch in args.batches:
            prompts = br.random_prompts(batch, prompt, vocab)
            ms = {}
            for name, fn in paths.items():
                with lora_path(fn):
                    ms[name] = br.engine_run(model, prompts, args.new)["ms_per_step"]
            base = ms["no LoRA work"]
            costs = " -> ".join(f"{v - base:.2f}" for k, v in ms.items() if k != "no LoRA work")
            lines.append(f"| {fmt} | {batch} | " + " | ".join(f"{v:.2f}" for v in ms.values()) + f" | {costs} ms |")
            print(lines[-1], flush=True)
        del model
        br.free()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora_engine_h200.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
