"""The dense strategy (NVFP4 -> transient bf16 W, then cuBLAS) in one piece or in pieces of weight
rows through one reused buffer, against torch's bf16 matmul, all timed in one run.

    python -m lab.bench_dense_chunks [--ms 2048 8192] [--rows 2048 4096 8192]

Prints a markdown table; lab/results/dense_chunks_h200.md holds the H200's. The pieces are
``nvfp4_gemm_triton._dense_gemm`` itself, with ``DENSE_CHUNK_*`` set per row of the table.
"""

from __future__ import annotations

import argparse

import torch

from bench.bench_nvfp4_gemm import copies_for, random_nvfp4, time_graph

from qerl_kit.kernels import nvfp4_gemm_triton as g

# The wide projections (fused gate_up of 7B, 32B, 72B) and, for contrast, 72B down and k/v.
SHAPES = [("7B gate_up", 37888, 3584), ("32B gate_up", 55296, 5120), ("72B gate_up", 59136, 8192),
          ("72B down", 8192, 29568), ("72B k/v", 1024, 8192)]


def dense(x, w, rows):
    """The dense path in pieces of ``rows`` weight rows (None: one piece), whatever the shape; the
    module's thresholds are set for this call only (a graph capture keeps the launches it recorded)."""
    saved = g.DENSE_CHUNK_N, g.DENSE_CHUNK_MIN_N, g.DENSE_CHUNK_MIN_M
    g.DENSE_CHUNK_N, g.DENSE_CHUNK_MIN_N, g.DENSE_CHUNK_MIN_M = (rows or 1 << 30), 0, 0
    try:
        return g._dense_gemm(x, *w, None)
    finally:
        g.DENSE_CHUNK_N, g.DENSE_CHUNK_MIN_N, g.DENSE_CHUNK_MIN_M = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", nargs="+", type=int, default=[2048, 8192])
    ap.add_argument("--rows", nargs="+", type=int, default=[2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| layer | N x K | M | bf16 us | one piece us | " + " | ".join(f"{r} rows us" for r in args.rows)
          + " | one piece x bf16 | " + " | ".join(f"{r} rows x bf16" for r in args.rows) + " |")
    print("|---|---|---:|" + "---:|" * (2 + 2 * len(args.rows) + 1))
    for name, n, k in SHAPES:
        qb = n * k // 2 + n * k // 16
        ws = [random_nvfp4(n, k) for _ in range(copies_for(qb))]
        ds = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2))]
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            whole = dense(x, ws[0], None)
            for rows in args.rows:
                err = ((dense(x, ws[0], rows).float() - whole.float()).norm() / whole.float().norm()).item()
                assert err < 1e-3, (name, m, rows, err)
            best = {}
            for _ in range(args.repeats):  # interleaved, best of the repeats (clock and power drift)
                for key in ["bf16", None, *args.rows]:
                    if key == "bf16":
                        t = time_graph([lambda d=d: torch.nn.functional.linear(x, d) for d in ds])
                    else:
                        t = time_graph([lambda w=w, r=key: dense(x, w, r) for w in ws])
                    best[key] = min(best.get(key, t), t)
            bf = best["bf16"]
            times = [best[None]] + [best[r] for r in args.rows]
            print(f"| {name} | {n} x {k} | {m} | {bf * 1e6:.0f} | " + " | ".join(f"{t * 1e6:.0f}" for t in times)
                  + " | " + " | ".join(f"{bf / t:.2f}" for t in times) + " |", flush=True)
        del ws, ds
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
