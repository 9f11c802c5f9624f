"""Same-run before/after for the decode path: the M = 1 FMA kernel of 2026-11-29 (and the
tensor-core path for M > 1) vs the block-dot kernel (float32 and fp16 products), vs bf16.

    python -m lab.decode_compare --out /tmp/decode
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.bench_nvfp4_gemm import copies_for, copy_bandwidth, random_nvfp4, time_graph
from qerl_kit.kernels.nvfp4_gemv_triton import nvfp4_gemv

SHAPES = [(4608, 3584), (18944, 3584), (3584, 18944), (1024, 8192), (59136, 8192), (8192, 29568)]
OLD_M1 = dict(BLOCKDOT=False, BLOCK_N=64, BLOCK_K=256, USE_DOT=False, PREFETCH=True, CTAS_PER_SM=4,
              num_warps=4, num_stages=1)
OLD_MMA = dict(BLOCKDOT=False, BLOCK_N=64, BLOCK_K=128, USE_DOT=True, num_warps=4, num_stages=4)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/decode")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth()
    print(f"copy {bw / 1e12:.2f} TB/s", flush=True)
    variants = {
        "old": None,
        "bd_f32": dict(BLOCKDOT=True, BLOCK_N=128, BLOCK_K=256, HALF=False, PREFETCH=True, CTAS_PER_SM=4,
                       EVICT="evict_first", num_warps=4, num_stages=1),
        "bd_f16": dict(BLOCKDOT=True, BLOCK_N=128, BLOCK_K=256, HALF=True, PREFETCH=True, CTAS_PER_SM=4,
                       EVICT="evict_first", num_warps=4, num_stages=1),
        "bd_f16_64x512": dict(BLOCKDOT=True, BLOCK_N=64, BLOCK_K=512, HALF=True, PREFETCH=True, CTAS_PER_SM=4,
                              EVICT="evict_first", num_warps=4, num_stages=1),
        "bd_f16_noprefetch": dict(BLOCKDOT=True, BLOCK_N=128, BLOCK_K=256, HALF=True, PREFETCH=False,
                                  CTAS_PER_SM=4, EVICT="evict_first", num_warps=4, num_stages=1),
        "bd_f16_ctas8": dict(BLOCKDOT=True, BLOCK_N=128, BLOCK_K=256, HALF=True, PREFETCH=True, CTAS_PER_SM=8,
                             EVICT="evict_first", num_warps=4, num_stages=1),
        "tuned": "default",
    }
    rows = []
    for n, k in SHAPES:
        q_bytes = n * k // 2 + n * k // 16
        weights = [random_nvfp4(n, k) for _ in range(copies_for(q_bytes))]
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(2 * n * k))]
        for m in (1, 2, 4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = time_graph([lambda w=w: F.linear(x, w) for w in dense], reps=5)
            line = f"N={n:6d} K={k:6d} M={m}: bf16 {base * 1e6:7.1f}us"
            for name, cfg in variants.items():
                if name == "old":
                    cfg = OLD_M1 if m == 1 else OLD_MMA
                try:
                    if cfg == "default":
                        f = [lambda w=w: nvfp4_gemv(x, *w) for w in weights]
                    else:
                        f = [lambda w=w, c=cfg: nvfp4_gemv(x, *w, config=dict(c)) for w in weights]
                    t = time_graph(f, reps=5)
                except Exception as e:  # noqa: BLE001
                    print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:150]}", flush=True)
                    continue
                moved = q_bytes + 2 * m * (n + k)
                rows.append(dict(N=n, K=k, M=m, variant=name, us=t * 1e6, bf16_us=base * 1e6,
                                 speedup=base / t, bw_frac=moved / t / bw))
                line += f" | {name} {t * 1e6:6.1f}us x{base / t:4.2f} {moved / t / bw:4.0%}"
            print(line, flush=True)
        del weights, dense
        torch.cuda.empty_cache()
    with open(out / "decode_compare.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
