"""Where the CUDA decode kernel's time goes: time it with stages left out (H200.md's method when
there are no hardware counters). Variants are the same source compiled with ``-DQK_ABLATE=bits``
(their results are wrong by design): 1 no dequantization (the raw codes feed the MMA), 2 no MMA
(an xor keeps the operands live), 4 no x loads, 8 no scale conversion, and their combinations;
15 leaves only the weight loads and the loop; 16, not a cut but a
variant, caps registers so that 8 blocks fit per SM, and is checked against the full kernel before
it is timed. (Variants measured slower and removed from the source are in
lab/results/cuda_decode_variants_h200.md.) Same timing as bench_nvfp4_gemm.py (CUDA-graph
replays, > 200 MB of weight copies, cold L2), bf16 in the same run.

    python -m lab.ablate_cuda_decode --out lab/results
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.bench_nvfp4_gemm import copies_for, copy_bandwidth, random_nvfp4, time_graph

from qerl_kit.kernels.nvfp4_decode_cuda import nvfp4_decode_cuda

VARIANTS = {0: "full kernel", 8: "no scale conversion", 4: "no x loads", 1: "no dequantization",
            2: "no MMA", 3: "no dequant, no MMA", 15: "weight loads only", 16: "full, 8 blocks/SM"}
FULL_BITS = 16  # variants of the full kernel (the rest are cuts): checked against it before timing
SHAPES = [("7B q/o", 3584, 3584), ("7B gate_up", 37888, 3584), ("32B down", 5120, 27648),
          ("72B gate_up", 59136, 8192)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="lab/results")
    ap.add_argument("--name", default="cuda_decode_ablation_h200.md")
    ap.add_argument("--ms", nargs="+", type=int, default=[1, 8, 16])
    ap.add_argument("--variants", nargs="+", type=int, default=list(VARIANTS))
    args = ap.parse_args()
    variants = {v: VARIANTS[v] for v in args.variants}
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    lines = [f"# CUDA decode kernel, stages left out ({torch.cuda.get_device_name()}, {datetime.date.today()}, "
             f"torch {torch.__version__})", "",
             f"Same-run copy bandwidth {copy_bw / 1e12:.2f} TB/s. Each cell: microseconds, and the weight stream "
             "(4.5 bits per weight) as a fraction of the copy bandwidth.", "",
             "| layer | M | bf16 us | " + " | ".join(variants.values()) + " |",
             "|---|---:|---:|" + "---:|" * len(variants)]
    for label, n, k in SHAPES:
        q_bytes = n * k // 2 + n * k // 16
        weights = [random_nvfp4(n, k) for _ in range(copies_for(q_bytes))]
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(2 * n * k))]
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf = time_graph([lambda d=d: F.linear(x, d) for d in dense])
            cells = []
            y0 = nvfp4_decode_cuda(x, *weights[0]).float()
            for v in variants:
                t = time_graph([lambda w=w: nvfp4_decode_cuda(x, *w, ablate=v) for w in weights])
                cells.append(f"{t * 1e6:.1f} ({q_bytes / t / copy_bw:.0%})")
                if v and not v & ~FULL_BITS:  # a variant, not a cut: must agree with the full kernel
                    y = nvfp4_decode_cuda(x, *weights[0], ablate=v).float()
                    err = (y - y0).norm() / y0.norm()
                    if not torch.equal(y, y0):  # same arithmetic in the same order: expect identical bits
                        cells[-1] += f" {'WRONG' if err > 1e-2 else 'differs'} ({err:.1e})"
            lines.append(f"| {label} | {m} | {t_bf * 1e6:.1f} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
        del weights, dense
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / args.name).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
