"""Time the NF4 / MXFP4 kernels (``qerl_kit/kernels/lut4_triton.py``) against bf16 and NVFP4, same run.

For the linear layers of Qwen2.5-7B (``bench_nvfp4_gemm.layer_shapes``) and M rows (default 1, 8,
16, 64, 2048), each cell times, on random data (never zeros):

* ``bf16``:        ``F.linear`` with a dense bf16 weight
* ``nvfp4``:       ``kernels.nvfp4_linear`` (the routing table on the run's backend)
* ``nf4``/``mxfp4``: ``kernels.lut4_linear``, the routed NF4 / MXFP4 kernels (GEMV or dense path)
* ``nf4_generic``: ``lut4_linear_ref``, the plain-PyTorch dequantize + matmul every NF4/MXFP4 layer
                   ran before these kernels (the 4x-slower-than-NVFP4 baseline)
* ``nf4_bnb``:     bitsandbytes' own ``matmul_4bit`` on the same NF4 bytes (``--bnb``, where
                   bitsandbytes is installed: our layout is its layout, docs/kernels.md)

and, at the GEMV's row counts (up to 64), both of the routing table's choices forced whichever it takes:
``nf4_gemv`` / ``mxfp4_gemv`` (``lut4_gemv`` at ``gemv_config``'s tile) and ``nf4_dense`` /
``mxfp4_dense`` (``lut4_dense_linear``: dequantize + cuBLAS), so the crossover the table's rows encode
shows at every row count (``bench.bench_lut4_sweep`` times the GEMV's other tile configs)

plus the dense path's dequantization alone (``lut4_dequantize`` against the PyTorch reference).
GPU timing is ``bench_nvfp4_gemm.time_alternating``: CUDA-graph replays of back-to-back calls
cycling through > 200 MB of weight copies (cold L2), the sides alternated, each side's best.
``--smoke`` runs one tiny shape on the CPU (Triton's interpreter, wall-clock timing: numbers that
only show the script works)::

    python -m bench.bench_lut4 --out $OUT/lut4                     # H200: table + CSV
    python -m bench.bench_lut4 --bnb --ms 1 8 16 --out $OUT/lut4   # with bitsandbytes' kernels
    TRITON_INTERPRET=1 python -m bench.bench_lut4 --smoke --out /tmp/lut4
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib.util
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.bench_nvfp4_gemm import copies_for, layer_shapes, random_nvfp4, time_alternating
from qerl_kit import kernels, mxfp4, nf4
from qerl_kit.kernels import lut4_triton
from qerl_kit.kernels.reference import lut4_linear_ref

MS = [1, 8, 16, 64, 2048]
SIDES = ("bf16", "nvfp4", "nf4", "mxfp4", "nf4_gemv", "mxfp4_gemv", "nf4_dense", "mxfp4_dense", "nf4_generic",
         "nf4_bnb")


def random_lut4(fmt: str, n: int, k: int, device: str):
    """Valid random NF4 / MXFP4 tensors (any byte is two codes; scales of a real weight's size)."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    if fmt == "nf4":
        return packed, torch.rand(n, k // nf4.BLOCK_SIZE, device=device) * 0.1 + 0.01
    return packed, torch.randint(118, 124, (n, k // mxfp4.BLOCK_SIZE), dtype=torch.uint8, device=device)


def bnb_call(x, packed, absmax, n: int, k: int):
    """bitsandbytes' NF4 matmul on our bytes ([N*K/2, 1] packed, flat float32 absmax, blocks of 64)."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import QuantState, get_4bit_type

    state = QuantState(absmax=absmax.reshape(-1), shape=torch.Size((n, k)), blocksize=nf4.BLOCK_SIZE,
                       code=get_4bit_type("nf4", device=x.device), quant_type="nf4", dtype=x.dtype)
    w = packed.reshape(-1, 1)
    return lambda: bnb.matmul_4bit(x, w.t(), quant_state=state)


def cell_calls(m: int, n: int, k: int, device: str, with_bnb: bool, copies: int | None = None) -> dict:
    """{side: [calls]}: each side's calls over enough weight copies to miss L2."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    c = copies or copies_for(n * k // 2)
    sides = {"bf16": [lambda w=torch.randn(n, k, device=device, dtype=torch.bfloat16): F.linear(x, w)
                      for _ in range(copies or copies_for(2 * n * k))],
             "nvfp4": [lambda w=random_nvfp4(n, k, device): kernels.nvfp4_linear(x, *w) for _ in range(c)]}
    for fmt in ("nf4", "mxfp4"):
        sides[fmt] = [lambda w=random_lut4(fmt, n, k, device), f=fmt: kernels.lut4_linear(x, *w, f) for _ in range(c)]
    if m <= lut4_triton.DECODE_MAX_M:  # the table's two choices forced, at the GEMV's own row counts
        for fmt in ("nf4", "mxfp4"):
            sides[f"{fmt}_gemv"] = [lambda w=random_lut4(fmt, n, k, device), f=fmt: lut4_triton.lut4_gemv(x, *w, f)
                                    for _ in range(c)]
            sides[f"{fmt}_dense"] = [lambda w=random_lut4(fmt, n, k, device), f=fmt: lut4_triton.lut4_dense_linear(
                x, *w, f) for _ in range(c)]
    sides["nf4_generic"] = [lambda w=random_lut4("nf4", n, k, device): lut4_linear_ref(x, *w, "nf4") for _ in range(c)]
    if with_bnb:
        sides["nf4_bnb"] = [bnb_call(x, *random_lut4("nf4", n, k, device), n, k) for _ in range(c)]
    return sides


def time_cpu(sides: dict, reps: int = 2) -> dict:
    """Wall-clock seconds per call on the CPU (the smoke run: shows the script works, nothing more)."""
    out = {}
    for name, calls in sides.items():
        calls[0]()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            calls[0]()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return out


def max_rel_err(fmt: str, m: int, n: int, k: int, device: str) -> float:
    """The routed kernel against the float32 product of x and the reference's bf16 weight."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    packed, scales = random_lut4(fmt, n, k, device)
    ref = lut4_linear_ref(x.float(), packed, scales, fmt)
    return ((kernels.lut4_linear(x, packed, scales, fmt).float() - ref).abs().max() / ref.abs().max()).item()


def run(shapes, ms, device: str, with_bnb: bool, smoke: bool) -> list[dict]:
    rows = []
    for proj, n, k in shapes:
        for m in ms:
            sides = cell_calls(m, n, k, device, with_bnb, copies=1 if smoke else None)
            t = time_cpu(sides) if smoke else time_alternating(sides)
            x = torch.empty(m, k, device=device, dtype=torch.bfloat16)
            nf = random_lut4("nf4", n, k, device)
            row = dict(proj=proj, M=m, N=n, K=k, **{f"{s}_us": t[s] * 1e6 for s in t},
                       nf4_path=kernels.route("forward", x, *nf, fmt="nf4"),
                       nf4_rel_err=max_rel_err("nf4", min(m, 64), n, k, device),
                       mxfp4_rel_err=max_rel_err("mxfp4", min(m, 64), n, k, device))
            row["nf4_vs_nvfp4"] = t["nvfp4"] / t["nf4"]
            row["nf4_vs_generic"] = t["nf4_generic"] / t["nf4"]
            rows.append(row)
            print(" ".join(f"{key}={v:.4g}" if isinstance(v, float) else f"{key}={v}" for key, v in row.items()),
                  flush=True)
        if not smoke:  # the dense path's dequantization alone, once per shape
            for fmt in ("nf4", "mxfp4"):
                packed, scales = random_lut4(fmt, n, k, device)
                qt = (nf4.NF4Tensor if fmt == "nf4" else mxfp4.MXFP4Tensor)(packed, scales)
                t = time_alternating({"triton": [lambda: lut4_triton.lut4_dequantize(packed, scales, fmt)],
                                      "torch": [lambda: qt.dequantize(torch.bfloat16)]})
                rows.append(dict(proj=f"{proj} dequantize {fmt}", M=0, N=n, K=k, triton_us=t["triton"] * 1e6,
                                 torch_us=t["torch"] * 1e6))
    return rows


def write_table(out: Path, stem: str, rows: list[dict], cols: list[str], head: list[str], fmt) -> None:
    """``out/<stem>.csv`` (every key of the rows) and ``out/<stem>.md`` (``head`` lines, then ``cols`` of
    the rows, each cell ``fmt(column, value)``)."""
    out.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(key for r in rows for key in r))
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    lines = head + ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(c, r.get(c, "")) for c in cols) + " |" for r in rows]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


def write(out: Path, rows: list[dict], info: dict) -> None:
    keys = {key for r in rows for key in r}
    cols = ["proj", "M", "N", "K"] + [f"{s}_us" for s in SIDES] + ["nf4_path", "nf4_vs_nvfp4", "nf4_vs_generic",
                                                                  "triton_us", "torch_us"]

    def fmt(c, v):
        return (f"{v:.2f}" if "_vs_" in c else f"{v:.1f}") if isinstance(v, float) else str(v)

    head = [f"# NF4 / MXFP4 kernels against bf16 and NVFP4 ({info['device']}, {info['date']}, torch "
            f"{info['torch']}, triton {info['triton']})", ""] + ([info["note"], ""] if info.get("note") else [])
    write_table(out, "lut4", rows, [c for c in cols if c in keys], head, fmt)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--model", default="Qwen2.5-7B")
    ap.add_argument("--ms", nargs="+", type=int, default=MS)
    ap.add_argument("--bnb", action="store_true", help="also time bitsandbytes' matmul_4bit on the NF4 bytes")
    ap.add_argument("--smoke", action="store_true", help="one tiny shape on the CPU (Triton's interpreter)")
    args = ap.parse_args(argv)
    import triton

    smoke = args.smoke or not torch.cuda.is_available()
    device = "cpu" if smoke else "cuda"
    shapes = [("tiny", 64, 128)] if smoke else layer_shapes(args.model)
    ms = [1, 3, 65] if smoke else args.ms  # 1 and 3 rows: lut4_gemv (FMA and MMA paths); 65: the dense path
    info = dict(device="CPU (interpreter smoke run)" if smoke else torch.cuda.get_device_name(),
                date=datetime.date.today().isoformat(), torch=torch.__version__, triton=triton.__version__)
    with_bnb = args.bnb and not smoke
    if with_bnb and importlib.util.find_spec("bitsandbytes") is None:  # the other sides still run
        with_bnb, info["note"] = False, "--bnb: bitsandbytes is not importable here, its side (nf4_bnb) not timed"
    print(info, flush=True)
    # smoke: the kernels in the interpreter (TRITON_INTERPRET=1), not the CPU's reference path
    with kernels.set_backend("triton" if smoke else kernels.get_backend()):
        rows = run(shapes, ms, device, with_bnb, smoke)
    write(Path(args.out), rows, info)


if __name__ == "__main__":
    main()
