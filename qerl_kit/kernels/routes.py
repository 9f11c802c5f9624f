"""The routing table: which kernel runs an NVFP4 (NF4, MXFP4) matmul, as data.

``ROUTES`` is an ordered tuple of ``Route`` rows. A call (op, M rows, an [N, K] weight, activation
dtype) takes the first row that matches it and whose kernel can run it here (installed, compiled,
the tensors' alignment fits); the last rows match everything, so every call finds one. Both the
dispatcher (``qerl_kit.kernels.nvfp4_linear`` / ``nvfp4_dgrad``) and ``qerl_kit.kernel_report``
read this table, so what the report says is what runs.

A row serves the weight formats in its ``formats`` (NVFP4 by default; the ``lut4_*`` rows NF4
and MXFP4, ``LUT4``), and the rows of each format end with their own catch-all reference row.
Each row cites the measurement it comes from (``why``); docs/kernels.md prints the table. A
kernel that is missing here (humming not installed, not a Hopper GPU for wgmma) is skipped, so
the rows below it are the fallback: without humming the table is exactly qerl_kit's own kernels.

The kernels a row may name are the registry ``KERNELS`` (name -> ``Kernel``: its family, its label
in reports, library, what it is, module), the one list of them: the dispatcher's backend switch
reads the families (``BACKENDS``: which families each of ``auto``, ``ours``, ``triton``, ``humming``,
``reference`` lets run), ``qerl_kit.kernel_report`` the labels, and docs/kernels.md prints
``kernels_markdown()`` (a test keeps them equal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BIG = 1 << 62
M = 1 << 20  # "weights" thresholds are written in mebi-weights (N x K / 2^20)
WIDE_N = 32768  # fused gate/up widths (7B 37888, 32B 55296, 72B 59136)


@dataclass(frozen=True)
class Route:
    """One row: ``kernel`` takes calls of ``op`` whose rows, N, K and N*K lie in the half-open
    ranges [lo, hi) and whose activation dtype is one of ``dtypes``."""

    kernel: str
    rows: tuple[int, int] = (1, BIG)
    n: tuple[int, int] = (0, BIG)
    k: tuple[int, int] = (0, BIG)
    weights: tuple[int, int] = (0, BIG)
    op: str = "forward"
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
    why: str = ""
    formats: tuple[str, ...] = ("nvfp4",)  # the weight formats the row takes (FORMATS_ROUTED)

    def matches(self, op: str, m: int, n: int, k: int, dtype: torch.dtype, fmt: str = "nvfp4") -> bool:
        return (op == self.op and fmt in self.formats and dtype in self.dtypes and self.rows[0] <= m < self.rows[1]
                and self.n[0] <= n < self.n[1] and self.k[0] <= k < self.k[1]
                and self.weights[0] <= n * k < self.weights[1])


@dataclass(frozen=True)
class Kernel:
    """One kernel the routing table may name. ``family`` decides which backend switches let it run
    (``BACKENDS``): ``humming``, ``cuda`` (our CUDA C), ``triton`` (ours) or ``reference``."""

    name: str
    family: str
    label: str      # what kernel_report calls it
    library: str    # docs/kernels.md's "library" column
    about: str      # what it is
    module: str     # where it lives (under qerl_kit/kernels/)


_HUMMING_LIB = ("[humming-kernels](https://pypi.org/project/humming-kernels/) (vLLM's W4A16 GEMM library), "
                "`pip install 'qerl_kit[gpu]'`")
KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("humming", "humming", "humming", _HUMMING_LIB,
           "JIT-compiled (nvcc/NVRTC) GEMM reading our tensors through its compressed-tensors schema "
           "(`nvfp4-pack-quantized`, `tensor_group`, group 16), repacked once per weight", "`nvfp4_humming.py`"),
    Kernel("cuda_decode", "cuda", "CUDA decode", "ours, CUDA C compiled at first use with the NVRTC PyTorch ships",
           "`mma.sync` decode kernel for 1-16 rows, bf16, exact dequantization by bit placement",
           "`nvfp4_decode_cuda.py` (+ `nvrtc.py`)"),
    Kernel("triton_gemv", "triton", "Triton decode", "ours, Triton",
           "decode kernel for up to 64 rows (block-dot at 1-4 rows, tensor cores above)",
           "`nvfp4_gemv_triton.py`, `nvfp4_blockdot_triton.py`, `splitk.py`"),
    Kernel("triton_tiles", "triton", "Triton tiles", "ours, Triton", "fused-dequantization tiled GEMM",
           "`nvfp4_gemm_triton.py`"),
    Kernel("dense", "triton", "dequant + cuBLAS", "ours (Triton dequantization) + cuBLAS",
           "dequantize into a transient bf16 weight, then `F.linear` / `dy @ W`; on layers with N >= 32768 from "
           "2048 rows, 4096 weight rows at a time", "`nvfp4_gemm_triton.py`, `nvfp4_dgrad_triton.py`"),
    Kernel("triton_dgrad", "triton", "Triton dgrad", "ours, Triton", "fused input-gradient kernel",
           "`nvfp4_dgrad_triton.py`"),
    Kernel("lut4_gemv", "triton", "Triton LUT4 decode", "ours, Triton",
           "NF4 / MXFP4 decode kernel for up to 64 rows (float32 FMAs at one row, `tl.dot` above), split-K",
           "`lut4_triton.py`"),
    Kernel("lut4_dense", "triton", "LUT4 dequant + cuBLAS", "ours (Triton dequantization) + cuBLAS",
           "NF4 / MXFP4: dequantize into a transient weight of the activation dtype (bit-identical to the "
           "format's reference), then `F.linear` / `dy @ W`", "`lut4_triton.py`"),
    Kernel("reference", "reference", "reference", "PyTorch",
           "dequantize, then matmul: the CPU path and the oracle every test compares against", "`reference.py`"),
)}
# The backend switch (kernels.backend.Backend's values) -> the kernel families it lets run; the
# reference can always run. humming forces humming for the forward and keeps Triton for the gradient.
BACKENDS: dict[str, tuple[str, ...]] = {"auto": ("humming", "cuda", "triton"), "ours": ("cuda", "triton"),
                                        "triton": ("triton",), "humming": ("humming", "triton"), "reference": ()}


def kernels_of(*families: str) -> frozenset[str]:
    """The names of the registered kernels of these families (read now: a kernel registered at runtime is in)."""
    return frozenset(name for name, k in KERNELS.items() if k.family in families)


def allowed(backend: str) -> frozenset[str]:
    """The kernels the backend switch ``backend`` lets the table route to (the reference included)."""
    return kernels_of(*BACKENDS[backend]) | {"reference"}


def kernels_markdown() -> str:
    """The registry as docs/kernels.md prints it (a test keeps the two equal)."""
    lines = ["| kernel (route name) | library | what it is | module |", "|---|---|---|---|"]
    lines += [f"| `{k.name}` | {k.library} | {k.about} | {k.module} |" for k in KERNELS.values()]
    return "\n".join(lines)


BF16 = (torch.bfloat16,)
LUT4 = ("nf4", "mxfp4")  # the formats of lut4_triton's kernels (a 16-value table times a block scale)
LUT4_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LUT4_DECODE_MAX_M = 64  # the most rows lut4_gemv takes (its largest tl.dot tile; lut4_triton.DECODE_MAX_M)
_RUN = "bench/results/routes_h200.md"   # humming, our kernels and bf16 per layer and M, in one run
_DECODE = "lab/results/cuda_decode_h200.md, against the Triton decode kernel (the rule without humming)"

_SWEEP = ("bench/results/fair_h200/hold13/sweep.md (H200, 2026-12-06: every lut4_gemv config that compiles "
          "without spilling against lut4_dense per 7B layer at 8 and 64 rows, CUDA graphs, one run)")
_FAIR = ("bench/results/fair_h100/hold12/lut4.md (H100 80GB, 2026-12-06: lut4_gemv against lut4_dequantize + "
         "cuBLAS bf16 per 7B layer, CUDA graphs, one run)")

ROUTES: tuple[Route, ...] = (
    # -- humming-kernels where it beat our kernels (skipped where it is not installed) ------------
    # One row: our CUDA decode kernel under 20M weights and from 72M with K < 5120 (7B gate_up:
    # 33.6 against 39.6 us), Triton's block-dot kernel between (14B q/o 10.6 against 13.7 us).
    Route("humming", rows=(1, 2), weights=(72 * M, BIG), k=(5120, BIG), why=_RUN + ": 14B gate_up 35.8 against 36.3 us"),
    # 2-4 rows: our decode kernel, except layers of 64M weights and more with K >= 5120 (72B down
    # 50.5 against 55.3 us, 14B gate/up 21.7 against 24.2; 14B down, 67.5M, loses 5% at 2 rows).
    Route("humming", rows=(2, 5), k=(5120, BIG), weights=(64 * M, BIG), why=_RUN),
    # 5-8 rows: humming above 8M weights (k/v, up to 8M, stay on Triton: humming's floor is 8-12 us),
    # but not on large K < 5120 layers (7B gate_up: our decode kernel 35.6 against 40.4 us).
    Route("humming", rows=(5, 9), weights=(8 * M + 1, 72 * M), why=_RUN),
    Route("humming", rows=(5, 9), weights=(72 * M, BIG), k=(5120, BIG), why=_RUN),
    # 9-511 rows: humming above 8M weights (1.0-2.0x our kernels); k/v keep Triton and the dense path.
    Route("humming", rows=(9, 512), weights=(8 * M + 1, BIG), why=_RUN),
    # 512-1023 rows: from 20M weights (7B q/o and qkv lost to the dense path at 512 rows); the
    # crossover to the dense path lies between 512 and 2048 rows, not measured in between.
    Route("humming", rows=(512, 1024), weights=(20 * M, BIG), why=_RUN),
    # From 1024 rows the dense path: humming won only the down projections at 2048 rows (K >= 13824,
    # 5-8%), and humming 0.1.10 (what vLLM 0.26 pins) is inaccurate there (7B down: 3.6e-2 relative
    # error against 2e-3); at 8192 rows the dense path is as fast or faster everywhere.
    # -- our CUDA C decode kernel (1-8 rows) ---------------------------------------------------
    Route("cuda_decode", rows=(1, 2), weights=(0, 20 * M), dtypes=BF16, why=_DECODE),
    Route("cuda_decode", rows=(1, 2), weights=(72 * M, BIG), dtypes=BF16, why=_DECODE),
    Route("cuda_decode", rows=(2, 3), dtypes=BF16, why=_DECODE),
    Route("cuda_decode", rows=(3, 5), weights=(4 * M, BIG), dtypes=BF16, why=_DECODE),
    Route("cuda_decode", rows=(5, 9), weights=(24 * M, BIG), dtypes=BF16, why=_DECODE),
    # -- Triton ---------------------------------------------------------------------------------
    Route("triton_gemv", rows=(1, 33), why="lab/results/sweep_small_m_h200.md"),
    Route("triton_gemv", rows=(33, 65), n=(0, WIDE_N), why="lab/results/sweep_small_m_h200.md: the tiled "
          "GEMM won at 33-64 rows only on the fused gate/up widths"),
    Route("triton_tiles", rows=(1, 128), why="bench/results/nvfp4_gemm_h200.md (DENSE_MIN_M)"),
    Route("dense", why="bench/results/nvfp4_gemm_h200.md, lab/results/dense_vs_fused_2048_h200.md: "
          "dequantize + cuBLAS beat the fused tiles from 128 rows"),
    Route("triton_tiles", why="Triton's CPU interpreter, where the dense path does not run"),
    Route("reference", why="no kernel can take the call here"),
    # -- the input gradient ---------------------------------------------------------------------
    Route("triton_dgrad", op="dgrad", rows=(1, 128), why="bench/results/nvfp4_gemm_h200.md (DENSE_MIN_M)"),
    Route("dense", op="dgrad", why="bench/results/nvfp4_gemm_h200.md"),
    Route("triton_dgrad", op="dgrad", why="Triton's CPU interpreter, where the dense path does not run"),
    Route("reference", op="dgrad", why="no kernel can take the call here"),
    # -- NF4 and MXFP4 (lut4_triton): the decode GEMV where it beat dequantize + cuBLAS, else the dense path --
    # Per 7B layer: H100 hold 12 (_FAIR: the GEMV against the same run's dequantization plus cuBLAS bf16)
    # and H200 hold 13 (_SWEEP: every GEMV config against lut4_dense itself). One row (the FMA path): the
    # GEMV for both formats (H100: NF4 gate/up 48.1 against 117.9 us, q/o 12.1 against 21.0; MXFP4 60.8
    # against 118.3, 14.1 against 21.9).
    Route("lut4_gemv", rows=(1, 2), dtypes=LUT4_DTYPES, formats=LUT4, why=_FAIR + ": one row"),
    # MXFP4 up to 16 rows (the MMA path's 16-row tile): H200 at 8 rows gate/up 73.7 against 96.3 us,
    # down 64.3 against 96.1, q/o 16.3 against 19.4, qkv 22.5 against 22.4 (H100 at 16: gate/up 73.0
    # against 116.6); at 64 rows the dense path (H200 gate/up 203.7 against 95.7); 17-63 not measured
    Route("lut4_gemv", rows=(2, 17), dtypes=LUT4_DTYPES, formats=("mxfp4",), why=_SWEEP + "; " + _FAIR),
    # NF4 up to 16 rows from 64M weights, on its one-stage MMA config (gemv_config): H200 at 8 rows
    # gate_up (fused) 143.5 against 179.8 us, down 81.1 against 91.7, gate/up 95.1 against 92.8 (a tie);
    # below 64M the dense path (qkv 20.8 against 27.3, k/v 10.9 against 12.1, q/o 18.6 both)
    Route("lut4_gemv", rows=(2, 17), weights=(64 * M, BIG), dtypes=LUT4_DTYPES, formats=("nf4",), why=_SWEEP),
    # Everything else the dense path: at 64 rows it beats every GEMV config on every 7B layer (H200: each
    # layer's best config by 1.5-3.1x for NF4, 1.3-2.3x for MXFP4); NVFP4's dense path wins from 128 rows too
    Route("lut4_dense", dtypes=LUT4_DTYPES, formats=LUT4, why=_SWEEP + "; " + _FAIR),
    Route("reference", dtypes=LUT4_DTYPES, formats=LUT4, why="no kernel can take the call here"),
    Route("lut4_dense", op="dgrad", dtypes=LUT4_DTYPES, formats=LUT4, why="the dense path: NF4/MXFP4 have no fused "
          "input-gradient kernel"),
    Route("reference", op="dgrad", dtypes=LUT4_DTYPES, formats=LUT4, why="no kernel can take the call here"),
)
FORMATS_ROUTED = ("nvfp4", *LUT4)  # the weight formats the table has rows for

OURS = kernels_of("cuda", "triton")  # the built-in kernels of ours (backend "ours" reads BACKENDS)


def candidates(op: str, m: int, n: int, k: int, dtype: torch.dtype, table=ROUTES, fmt: str = "nvfp4") -> list[Route]:
    """The rows that match this call on a ``fmt`` weight, in order (the dispatcher takes the first whose kernel runs)."""
    return [r for r in table if r.matches(op, m, n, k, dtype, fmt)]


def may_take(kernel: str, n: int, k: int, op: str = "forward", table=ROUTES, fmt: str = "nvfp4") -> bool:
    """Whether some row sends calls on an [n, k] ``fmt`` weight to ``kernel`` (at some row count)."""
    return any(r.kernel == kernel and r.op == op and fmt in r.formats and r.n[0] <= n < r.n[1] and r.k[0] <= k < r.k[1]
               and r.weights[0] <= n * k < r.weights[1] for r in table)


def check_table(table=ROUTES) -> None:
    """Raise ValueError if a row names an unknown kernel or op, a range is empty, or an op of a format
    does not end with a catch-all ``reference`` row taking every dtype that format's rows take (so
    every call a kernel row could take finds a row)."""
    for r in table:
        if r.kernel not in KERNELS:
            raise ValueError(f"route {r}: kernel {r.kernel!r} is not one of {sorted(KERNELS)}")
        if r.op not in ("forward", "dgrad"):
            raise ValueError(f"route {r}: op {r.op!r} is not 'forward' or 'dgrad'")
        for name in ("rows", "n", "k", "weights"):
            lo, hi = getattr(r, name)
            if not lo < hi:
                raise ValueError(f"route {r}: empty {name} range [{lo}, {hi})")
    for fmt in dict.fromkeys(f for r in table for f in r.formats):  # in the table's order: nvfp4 first
        for op in ("forward", "dgrad"):
            rows = [r for r in table if r.op == op and fmt in r.formats]
            where = "" if fmt == "nvfp4" else f" of {fmt}"
            if not rows or rows[-1] != Route("reference", op=op, dtypes=rows[-1].dtypes, why=rows[-1].why,
                                             formats=rows[-1].formats):
                raise ValueError(f"the {op} rows{where} do not end with a catch-all reference row")
            missing = [d for d in dict.fromkeys(d for r in rows for d in r.dtypes) if d not in rows[-1].dtypes]
            if missing:  # a call in such a dtype would match no row: it must fall through to the reference
                raise ValueError(f"the {op} rows{where} end with a reference row for dtypes {list(rows[-1].dtypes)}, "
                                 f"missing {missing} that other rows of it take")


def _span(lo: int, hi: int, unit: int = 1, suffix: str = "") -> str:
    """A half-open range [lo, hi) as the docs write it ("" when unbounded)."""
    text = lambda v: f"{v // unit}{suffix}"  # noqa: E731
    if lo <= 1 and hi == BIG:
        return ""
    if hi == BIG:
        return f">= {text(lo)}" if lo % unit == 0 else f"> {text(lo - 1)}"
    if lo == 0:
        return f"< {text(hi)}"
    if unit == 1:
        return f"{lo}" if hi == lo + 1 else f"{lo}..{hi - 1}"
    low = f">= {text(lo)}" if lo % unit == 0 else f"> {text(lo - 1)}"
    return f"{low}, < {text(hi)}"


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def as_markdown(table=ROUTES, fmt: str = "nvfp4") -> str:
    """The rows for ``fmt`` weights as docs/kernels.md prints them (a test keeps the two equal)."""
    lines = ["| # | op | rows | N | K | weights (N x K) | dtypes | kernel |", "|---:|---|---|---|---|---|---|---|"]
    for i, r in enumerate((r for r in table if fmt in r.formats), 1):
        weights = _span(r.weights[0], r.weights[1], M, "M")
        dtypes = ", ".join(_DTYPE_NAMES[d] for d in r.dtypes)
        lines.append(f"| {i} | {r.op} | {_span(*r.rows) or 'any'} | {_span(*r.n)} | {_span(*r.k)} | {weights} | "
                     f"{dtypes} | `{r.kernel}` |")
    return "\n".join(lines)


# -- decode on a dense copy the engine holds (rollout/static/fast.py) ------------------------------
# Where a decode matmul runs near its kernel's fixed cost (the small models' widths; the 7B's q/k/v and
# o from 64 rows), cuBLAS's is lower than the 4-bit kernels' by more than the 4-bit weight stream
# saves. There the StaticEngine's fused plan keeps a dense copy of a projection group (the exact
# dequantization of its NVFP4 weights: the same policy) and decodes it with cuBLAS at these rows.
# Capped at 17M weights a group: larger groups would cost the memory 4 bits save for a few percent
# (14B q/o, 26M, at 64 rows: 16.1 against 17.4 us). NVFP4 only: NF4 / MXFP4 were not measured.
_SMALL = ("bench/results/routes_h100/log.txt (H100 80GB, CUDA graphs, 2026-12-05: cuBLAS bf16 against the "
          "routed NVFP4 kernel per layer, one run)")
DENSE_DECODE: tuple[Route, ...] = (
    # 8 rows: Qwen2.5-0.5B q/k/v (1.0M weights) 4.3 against 7.0 us, o (0.8M) 4.2 against 6.9; not from 2M
    # (1.5B o, 2.4M: 5.4 against 5.7; 0.5B down, 4.4M: NVFP4 faster, 7.2 against 8.5). 1-4 rows: NVFP4 ties or wins
    Route("held_dense", rows=(5, 33), weights=(0, 2 * M), why=_SMALL),
    # 64 rows (33-63 not measured): every Qwen2.5-0.5B group (gate/up 8.7M: 8.7 against 12.4 us; down
    # 4.4M: 9.0 against 11.9) and the 1.5B's q/k/v (3.1M: 5.9 against 8.8) and o (2.4M: 5.5 against 9.5);
    # at 32 rows the 7B's q/o still run faster on NVFP4 (H200: 11.1 against 11.8 us)
    Route("held_dense", rows=(33, 64), weights=(0, 10 * M), why=_SMALL + "; " + _RUN),
    # From 64 rows also the 7B's q/k/v (16.5M: 11.2 against 13.5 us; 128 rows 12.2 against 17.2) and o
    # (12.8M: 9.1 against 12.5; 128 rows 9.4 against 16.5) on the H200, and the 1.5B's down (13.8M: 15.3
    # against 17.1, H100); not the 1.5B's gate/up (27.5M: NVFP4 faster, 18.0 against 23.7)
    Route("held_dense", rows=(64, BIG), weights=(0, 17 * M), why=_RUN + "; " + _SMALL),
)


def dense_decode(m: int, n: int, k: int, fmt: str = "nvfp4", dtype: torch.dtype = torch.bfloat16,
                 table=DENSE_DECODE) -> bool:
    """Whether a decode call of ``m`` rows on an [n, k] ``fmt`` weight runs faster on a dense copy (``DENSE_DECODE``)."""
    return any(r.matches("forward", m, n, k, dtype, fmt) for r in table)


def dense_decode_held(n: int, k: int, fmt: str = "nvfp4") -> bool:
    """Whether some decode row count sends an [n, k] ``fmt`` group to ``DENSE_DECODE``: whether the
    engine holds a dense copy of it (and the memory plan counts one)."""
    return may_take("held_dense", n, k, table=DENSE_DECODE, fmt=fmt)
