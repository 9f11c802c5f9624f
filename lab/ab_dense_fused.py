"""At 2048 rows, on the cells that dip under 0.85x bf16: the fused tiled kernel against the dense
path (dequantization pass + cuBLAS) and bf16, forward and input gradient; then the dequantization
pass's tile against others. Each time the best of two alternations.

    python -m lab.ab_dense_fused            # on the GPU; results: lab/results/dense_vs_fused_2048_h200.md
"""

from __future__ import annotations

import torch

from bench.bench_nvfp4_gemm import copies_for, random_nvfp4, time_alternating

from qerl_kit.kernels import nvfp4_gemm_triton as G
from qerl_kit.kernels.nvfp4_dgrad_triton import nvfp4_dgrad

SHAPES = [("7B k/v", 512, 3584), ("14B k/v", 1024, 5120), ("72B k/v", 1024, 8192), ("7B q/o", 3584, 3584),
          ("7B gate/up", 18944, 3584), ("32B gate_up", 55296, 5120), ("72B gate_up", 59136, 8192)]
TILES = [(32, 256, 4), (16, 256, 4), (16, 256, 2), (32, 128, 4), (16, 128, 2), (8, 256, 2), (64, 256, 8), (32, 512, 8)]


def strategies(m: int = 2048) -> None:
    print("| layer | kind | fused us | dense us | bf16 us | fused x bf16 | dense x bf16 | fused vs dense rel. diff |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, n, k in SHAPES:
        ws = [random_nvfp4(n, k) for _ in range(copies_for(n * k // 2 + n * k // 16))]
        ds = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2))]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        for kind in ("forward", "dgrad"):
            if kind == "forward":
                def ours(q, s):
                    return G.nvfp4_gemm(x, *q, strategy=s)

                def base(d):
                    return torch.nn.functional.linear(x, d)
            else:
                def ours(q, s):
                    return nvfp4_dgrad(dy, *q, strategy=s)

                def base(d):
                    return dy @ d
            ref = ours(ws[0], "dense").float()
            err = ((ours(ws[0], "fused").float() - ref).norm() / ref.norm()).item()
            t = time_alternating({s: [lambda q=q, s=s: ours(q, s) for q in ws] for s in ("fused", "dense")}
                                 | {"bf16": [lambda d=d: base(d) for d in ds]}, rounds=2)
            print(f"| {name} | {kind} | {t['fused'] * 1e6:.1f} | {t['dense'] * 1e6:.1f} | {t['bf16'] * 1e6:.1f} | "
                  f"{t['bf16'] / t['fused']:.2f} | {t['bf16'] / t['dense']:.2f} | {err:.1e} |", flush=True)
        del ws, ds
        torch.cuda.empty_cache()


def dequant(packed, scales, gs, w, bn: int, bk: int, warps: int) -> None:
    import triton
    import triton.language as tl

    n, k = packed.shape[0], packed.shape[1] * 2
    G._nvfp4_dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        packed, scales.view(torch.uint8), gs, w, n, k, packed.stride(0), scales.stride(0), w.stride(0),
        W_DTYPE=tl.bfloat16, EVEN_K=k % bk == 0, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, FAST=True,
        INTERPRET=False)


def dequant_tiles() -> None:
    print("\n| N x K | " + " | ".join(f"{a}x{b} w{c} us" for a, b, c in TILES) + " |")
    print("|---|" + "---:|" * len(TILES))
    for n, k in [(512, 3584), (1024, 5120), (1024, 8192), (3584, 3584), (4608, 3584), (5120, 5120),
                 (18944, 3584), (8192, 8192), (59136, 8192)]:
        ws = [random_nvfp4(n, k) for _ in range(copies_for(n * k // 2 + n * k // 16))]
        out = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
        ref = G.nvfp4_dequantize(*ws[0])
        cells = []
        for bn, bk, warps in TILES:
            dequant(*ws[0], out, bn, bk, warps)
            assert torch.equal(out, ref), f"tile {bn}x{bk}: not bit-identical to nvfp4_dequantize"
            t = time_alternating({"t": [lambda q=q, o=out, c=(bn, bk, warps): dequant(*q, o, *c) for q in ws]},
                                 rounds=2)["t"]
            cells.append(f"{t * 1e6:.1f}")
        print(f"| {n} x {k} | " + " | ".join(cells) + " |", flush=True)
        del ws, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    strategies()
    dequant_tiles()
