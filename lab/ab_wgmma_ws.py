"""The shipped wgmma kernel (warp-specialized, session 9) against the one it replaced (session 8's
single-role kernel, ``proto_wgmma_gemm.py``'s 256-row, x-two-steps-ahead configuration, SASS
identical to what shipped then), the dispatcher and bf16, at 32 and 64 rows, in one run.

    python -m lab.ab_wgmma_ws            # on the GPU; results: lab/results/proto_wgmma_gemm_h200.md (session 9)
    python -m lab.ab_wgmma_ws --wide     # the wide fused gate_up layers at 33/48/64 rows against the Triton path

Each column is the best of two alternations; both kernels use ``choose_ips``'s K split and are
checked against the reference on the timed shape first.
"""

from __future__ import annotations

import sys

from bench.bench_nvfp4_gemm import time_alternating, time_graph
from lab.proto_wgmma_gemm import baselines, layer_rows, nvfp4_gemm_wgmma

from lab import nvfp4_wgmma_cuda as wgk
from qerl_kit.kernels.reference import nvfp4_linear_ref

SHAPES = [(4608, 3584), (3584, 18944), (18944, 3584), (13824, 5120), (55296, 5120), (8192, 29568), (59136, 8192)]


def session8(x, packed, scales, global_scale):
    ips = wgk.choose_ips(x.shape[0], packed.shape[0], packed.shape[1] * 2)
    return nvfp4_gemm_wgmma(x, packed, scales, global_scale, ips=ips, warps=8, nt=2, xd=2)


def wide() -> None:
    """The shipped kernel against the Triton path (the tiled GEMM on N >= WIDE_N from 33 rows), the
    evidence for routing the wide layers with K >= 5120 to it."""
    import torch

    from bench.bench_nvfp4_gemm import copies_for, random_nvfp4

    from qerl_kit.kernels import nvfp4_linear

    print("| N x K | M | shipped wgmma us | Triton (tiled GEMM) us | Triton / shipped |")
    print("|---|---:|---:|---:|---:|")
    for n, k in [(55296, 5120), (59136, 8192), (37888, 3584)]:
        ws = [random_nvfp4(n, k) for _ in range(copies_for(n * k // 2 + n * k // 16))]
        for m in (33, 48, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t = time_alternating({"a": [lambda q=q: wgk.nvfp4_wgmma_cuda(x, *q) for q in ws],
                                  "b": [lambda q=q: nvfp4_linear(x, *q, backend="triton") for q in ws]}, rounds=2)
            print(f"| {n} x {k} | {m} | {t['a'] * 1e6:.1f} | {t['b'] * 1e6:.1f} | {t['b'] / t['a']:.2f} |", flush=True)
        del ws
        torch.cuda.empty_cache()


def main() -> None:
    if "--wide" in sys.argv:
        return wide()
    print("| N x K | M | session 8 us | shipped us | dispatch us | bf16 us | shipped / session 8 | shipped x bf16 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    failures = 0
    for n, k, m, x, weights, dense in layer_rows(SHAPES):
        ref = nvfp4_linear_ref(x.float(), *weights[0])
        for f in (session8, wgk.nvfp4_wgmma_cuda):
            err = ((f(x, *weights[0]).float() - ref).norm() / ref.norm()).item()
            if err > 3e-3:
                failures += 1
                print(f"FAIL {f.__name__} {n} x {k} M={m}: rel err {err:.1e}", flush=True)
        t = time_alternating({"old": [lambda q=q: session8(x, *q) for q in weights],
                              "new": [lambda q=q: wgk.nvfp4_wgmma_cuda(x, *q) for q in weights]}, rounds=2)
        t_disp, t_bf = baselines(time_graph, x, weights, dense)
        print(f"| {n} x {k} | {m} | {t['old'] * 1e6:.1f} | {t['new'] * 1e6:.1f} | {t_disp * 1e6:.1f} | "
              f"{t_bf * 1e6:.1f} | {t['new'] / t['old']:.2f} | {t_bf / t['new']:.2f} |", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
