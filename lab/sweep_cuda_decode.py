"""Sweep the CUDA decode kernel's launch configs (rows per warp, K slices) at M <= 16.

For each layer shape of the chosen models and each M, it times, in the same run and the same way
as ``bench_nvfp4_gemm.py`` (CUDA-graph replays cycling through > 200 MB of weight copies, cold
L2): torch's bf16 matmul, the Triton decode kernel (``set_backend("triton")``), the CUDA kernel
with its default config, and (``--configs``) every config of the grid below, each checked
against the float32 reference first.

    python -m lab.sweep_cuda_decode --out lab/results [--configs]
"""

from __future__ import annotations

import argparse
import csv
import datetime
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.bench_nvfp4_gemm import copies_for, layer_shapes, random_nvfp4, time_graph

from qerl_kit.kernels import nvfp4_linear, set_backend
from qerl_kit.kernels.nvfp4_decode_cuda import K_STEP, choose_config, nvfp4_decode_cuda
from qerl_kit.kernels.reference import nvfp4_linear_ref

COVER = (1, 2, 4, 8, 16)  # blocks per SM the K split aims at


def configs(n: int, k: int, sms: int) -> list[tuple[int, int]]:
    steps = -(-k // K_STEP)
    out = []
    for nt in (1, 2):
        blocks_n = -(-n // (64 * nt))
        for cover in COVER:
            slices = max(1, min(steps, round(cover * sms / blocks_n)))
            cfg = (nt, -(-steps // slices))
            if cfg not in out:
                out.append(cfg)
    return out


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="lab/results")
    ap.add_argument("--models", nargs="+", default=["Qwen2.5-7B", "Qwen2.5-32B"])
    ap.add_argument("--ms", nargs="+", type=int, default=[1, 4, 8, 16])
    ap.add_argument("--configs", action="store_true", help="time every config of the grid too")
    args = ap.parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = {}
    for model in args.models:
        for proj, n, k in layer_shapes(model):
            shapes.setdefault((n, k), f"{model.split('-')[1]} {proj}")
    rows = []
    for (n, k), label in shapes.items():
        q_bytes = n * k // 2 + n * k // 16
        weights = [random_nvfp4(n, k) for _ in range(copies_for(q_bytes))]
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(2 * n * k))]
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = nvfp4_linear_ref(x.float(), *weights[0])
            t_bf = time_graph([lambda d=d: F.linear(x, d) for d in dense])
            with set_backend("triton"):
                t_tri = time_graph([lambda w=w: nvfp4_linear(x, *w) for w in weights])
            default = choose_config(m, n, k)
            todo = [default] + ([c for c in configs(n, k, sms) if c != default] if args.configs else [])
            for nt, ips in todo:
                err = rel_err(nvfp4_decode_cuda(x, *weights[0], nt=nt, ips=ips), ref)
                t = time_graph([lambda w=w: nvfp4_decode_cuda(x, *w, nt=nt, ips=ips) for w in weights])
                slices = -(-(-(-k // K_STEP)) // ips)
                row = dict(layer=label, n=n, k=k, m=m, nt=nt, ips=ips, slices=slices,
                           default=(nt, ips) == default, err=err, cuda_us=t * 1e6, triton_us=t_tri * 1e6,
                           bf16_us=t_bf * 1e6, cuda_x_bf16=t_bf / t, triton_x_bf16=t_bf / t_tri,
                           cuda_gbs=(q_bytes + 2 * m * k + 2 * m * n) / t / 1e9)
                rows.append(row)
                print(" ".join(f"{key}={val:.3g}" if isinstance(val, float) else f"{key}={val}"
                               for key, val in row.items()), flush=True)
        del weights, dense
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "cuda_decode_sweep_h200" if args.configs else "cuda_decode_h200"
    with open(out / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    gpu = torch.cuda.get_device_name()
    lines = [f"# CUDA decode kernel vs bf16 and Triton ({gpu}, {datetime.date.today()}, torch {torch.__version__})", "",
             "| layer | N x K | M | nt | K steps/slice | slices | rel err | cuda us | triton us | bf16 us | "
             "cuda x bf16 | triton x bf16 | cuda GB/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mark = "*" if r["default"] else ""
        lines.append(f"| {r['layer']} | {r['n']} x {r['k']} | {r['m']} | {r['nt']}{mark} | {r['ips']} | {r['slices']} | "
                     f"{r['err']:.1e} | {r['cuda_us']:.1f} | {r['triton_us']:.1f} | {r['bf16_us']:.1f} | "
                     f"{r['cuda_x_bf16']:.2f} | {r['triton_x_bf16']:.2f} | {r['cuda_gbs']:.0f} |")
    lines.append("")
    lines.append("`*` the default config (`choose_config`). GB/s counts the 4.5-bit weight, x and y.")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
