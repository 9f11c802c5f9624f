"""The dense strategy's dequantization pass: the CUDA C kernel against the Triton kernel it
replaces, per layer shape, as a fraction of the copy bandwidth measured in the same run. Bytes moved
per call: packed codes + scales read, bf16 W written (2.56 bytes per weight). Same timing as
bench_nvfp4_gemm.py (CUDA-graph replays over > 200 MB of weight copies).

    PYTHONPATH=. python bench/bench_dequant.py --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_nvfp4_gemm import MODELS, copies_for, copy_bandwidth, layer_shapes, random_nvfp4, time_graph  # noqa: E402

from qerl_kit.kernels.nvfp4_dequant_cuda import nvfp4_dequantize_cuda  # noqa: E402
from qerl_kit.kernels.nvfp4_gemm_triton import nvfp4_dequantize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--models", nargs="+", default=MODELS)
    args = ap.parse_args()
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    lines = [f"# NVFP4 dequantization to bf16 ({torch.cuda.get_device_name()}, {datetime.date.today()}, "
             f"torch {torch.__version__})", "",
             f"Same-run copy bandwidth {copy_bw / 1e12:.2f} TB/s. Each cell: microseconds, and bytes moved "
             "(codes + scales read, bf16 W written) over time as a fraction of it.", "",
             "| layer | N | K | Triton us | CUDA us | CUDA / Triton |", "|---|---:|---:|---:|---:|---:|"]
    seen = set()
    for model in args.models:
        for proj, n, k in layer_shapes(model):
            if (n, k) in seen:
                continue
            seen.add((n, k))
            moved = n * k // 2 + n * k // 16 + 2 * n * k
            weights = [random_nvfp4(n, k) for _ in range(copies_for(moved))]
            t_tri = time_graph([lambda w=w: nvfp4_dequantize(*w, FAST=True) for w in weights])  # pinned: Triton
            t_cuda = time_graph([lambda w=w: nvfp4_dequantize_cuda(*w) for w in weights])
            lines.append(f"| {model.removeprefix('Qwen2.5-')} {proj} | {n} | {k} | {t_tri * 1e6:.1f} "
                         f"({moved / t_tri / copy_bw:.0%}) | {t_cuda * 1e6:.1f} ({moved / t_cuda / copy_bw:.0%}) "
                         f"| {t_tri / t_cuda:.2f}x |")
            print(lines[-1], flush=True)
            del weights
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dequant_h200.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
