"""Which ``lut4_gemv`` config decodes NF4 / MXFP4 fastest, per 7B layer and row count, against the dense path.

``gemv_config`` fixes one MMA-path config for 2-64 rows (64 x 64 tiles; NF4 one pipeline stage, MXFP4
three: hold 13's run of this sweep, H200, chose NF4's). This sweep times, per (format, layer, rows),
every candidate that compiles for sm_90 without spilling (tests/test_lut4_compile.py): BLOCK_K 64 or 128
with one or three pipeline stages, 256 with one or two up to 16 rows, with ``lut4_dense_linear``
(dequantize + cuBLAS) as the alternative the routing table takes instead. Timing is ``bench_lut4``'s:
CUDA-graph replays over weight copies past L2, the candidates alternated, each one's best. The table
gives each candidate's microseconds, the fastest and its ratio to today's config; ``gemv_config`` and
the routing table's rows change from these numbers::

    python -m bench.bench_lut4_sweep --out $OUT/lut4-sweep          # GPU: sweep.md + sweep.csv
    TRITON_INTERPRET=1 python -m bench.bench_lut4_sweep --smoke --out /tmp/sweep   # CPU: the script works
"""

from __future__ import annotations

import argparse
import datetime
import itertools
from pathlib import Path

import torch

from bench.bench_lut4 import random_lut4, time_cpu, write_table
from bench.bench_nvfp4_gemm import copies_for, layer_shapes, time_alternating
from qerl_kit.kernels import lut4_triton
from qerl_kit.kernels.reference import lut4_linear_ref

MS = [8, 64]  # the MMA path's two tile heights' row counts (BLOCK_M 16: 2-16 rows, 64: 33-64); one row is the FMA path


def candidates(fmt: str, m: int) -> dict[str, dict]:
    """{name: config overrides}: today's config ("default") and the variants worth timing, each compiled
    for sm_90 without spilling by tests/test_lut4_compile.py: BLOCK_K 64 and 128 with one or three stages,
    and 256 (8 warps, one or two stages) up to 16 rows, where its tile fits the registers (at 64 rows it
    spills)."""
    today = lut4_triton.gemv_config(m, 4608, 3584, fmt, interpret=False)
    out = {"default": {}}
    for bk, stages in [(64, 1), (64, 3), (128, 1), (128, 3)] + ([(256, 1), (256, 2)] if m <= 16 else []):
        if (bk, stages) == (today["BLOCK_K"], today["num_stages"]):
            continue  # today's
        warps = 8 if bk > 64 or m > 32 else 4  # 4 warps at BLOCK_K 128 hold 156-254 registers (no spill, but few warps)
        out[f"k{bk}-s{stages}"] = dict(BLOCK_K=bk, num_stages=stages, num_warps=warps)
    return out


def sides_for(fmt: str, m: int, n: int, k: int, device: str, copies: int | None) -> dict:
    """{candidate: [calls]} over enough weight copies to miss L2, the dense path included."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    c = copies or copies_for(n * k // 2)
    sides = {name: [lambda w=random_lut4(fmt, n, k, device), cfg=cfg: lut4_triton.lut4_gemv(x, *w, fmt, config=cfg)
                    for _ in range(c)] for name, cfg in candidates(fmt, m).items()}
    sides["dense"] = [lambda w=random_lut4(fmt, n, k, device): lut4_triton.lut4_dense_linear(x, *w, fmt)
                      for _ in range(c)]
    return sides


def worst_rel_err(fmt: str, m: int, n: int, k: int, device: str) -> float:
    """The largest relative error of any candidate against the float32 product with the reference's
    weight (every candidate computes the layer; a wrong one must not win on time)."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    packed, scales = random_lut4(fmt, n, k, device)
    ref = lut4_linear_ref(x.float(), packed, scales, fmt)
    outs = [lut4_triton.lut4_gemv(x, packed, scales, fmt, config=cfg) for cfg in candidates(fmt, m).values()]
    return max(((y.float() - ref).abs().max() / ref.abs().max()).item() for y in outs)


def sweep(shapes, ms, formats, device: str, smoke: bool, done=lambda rows: None) -> list[dict]:
    """One row per (format, layer, rows); ``done(rows)`` after each, so a run cut short keeps what it timed."""
    rows = []
    for fmt, (proj, n, k), m in itertools.product(formats, shapes, ms):
        sides = sides_for(fmt, m, n, k, device, 1 if smoke else None)
        t = time_cpu(sides, reps=1) if smoke else time_alternating(sides)
        best = min(t, key=t.get)
        row = dict(fmt=fmt, proj=proj, M=m, N=n, K=k, **{f"{s}_us": v * 1e6 for s, v in t.items()},
                   best=best, best_vs_default=t["default"] / t[best], worst_rel_err=worst_rel_err(fmt, m, n, k, device))
        rows.append(row)
        done(rows)
        print(" ".join(f"{key}={v:.4g}" if isinstance(v, float) else f"{key}={v}" for key, v in row.items()), flush=True)
    return rows


def cell(column: str, value) -> str:
    """A table cell: ratios to two decimals, errors in exponent form, microseconds to one decimal."""
    if not isinstance(value, float):
        return str(value)
    return f"{value:.2f}" if column == "best_vs_default" else f"{value:.1e}" if column == "worst_rel_err" \
        else f"{value:.1f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/lut4_sweep")
    ap.add_argument("--model", default="Qwen2.5-7B")
    ap.add_argument("--ms", nargs="+", type=int, default=MS)
    ap.add_argument("--formats", nargs="+", choices=sorted(lut4_triton.FORMAT_IDS), default=["nf4", "mxfp4"])
    ap.add_argument("--smoke", action="store_true", help="one tiny shape on the CPU (Triton's interpreter)")
    args = ap.parse_args(argv)
    if any(not 2 <= m <= lut4_triton.DECODE_MAX_M for m in args.ms):
        ap.error(f"--ms: the MMA path's rows, 2 to {lut4_triton.DECODE_MAX_M}; got {args.ms}")
    import triton

    smoke = args.smoke or not torch.cuda.is_available()
    device = "cpu" if smoke else "cuda"
    shapes = [("tiny", 64, 128)] if smoke else layer_shapes(args.model)
    ms = [3] if smoke else args.ms
    gpu = "CPU (interpreter smoke run)" if smoke else torch.cuda.get_device_name()
    head = (f"# lut4_gemv's MMA-path configs against the dense path ({gpu}, {datetime.date.today()}, torch "
            f"{torch.__version__}, triton {triton.__version__}), microseconds per call")
    print(head, flush=True)
    def done(rows):  # the table so far, rewritten after every cell
        write_table(Path(args.out), "sweep", rows, list(dict.fromkeys(key for r in rows for key in r)), [head, ""], cell)
    sweep(shapes, ms, args.formats, device, smoke, done)


if __name__ == "__main__":
    main()
