"""NF4 and MXFP4 weights in Triton: a dequantize kernel (the dense path) and a decode GEMV.

Both formats are "a 4-bit code looked up in a 16-value table, times a block scale", so one kernel
of each kind serves both, the format a compile-time constant (``FMT``: 0 NF4, 1 MXFP4)::

    packed  [N, K/2]   uint8; NF4: W[n, 2j] in the HIGH nibble (bitsandbytes' order),
                              MXFP4: W[n, 2j] in the LOW nibble (NVFP4's order, qerl_kit.fp4)
    scales  [N, K/BS]  NF4: float32 absmax, BS = 64; MXFP4: uint8 biased E8M0 exponent, BS = 32
    lut     [16]       float32: NF4's codebook (``nf4._codebook``'s per-device copy), gathered per
                       code; MXFP4 reads no table: its E2M1 values are built from the code's bits
                       (``_e2m1_to_f32``, exact), and the launchers pass ``packed`` as a dummy pointer
    W[n, k] = lut[code] * scale   (one float32 multiply, then rounded to the activation dtype)

The MXFP4 scale 2^(byte - 127) is built from its bits (byte << 23; byte 0 is the subnormal 2^-127),
as ``mxfp4.e8m0_scales`` builds the reference's, so the product is the reference's float32 product.

* ``lut4_dequantize`` writes the dense W in bf16/fp16/fp32 in one launch: bit-identical to
  ``nf4.dequantize`` / ``mxfp4.dequantize`` (the same float32 product, rounded to nearest even
  once); its BLOCK_K is the largest of 256, 128, 64 that divides K (``dequant_config``), so real
  shapes take whole tiles without masks along K. The dense path (``lut4_dense_linear`` /
  ``lut4_dense_dgrad``) then calls cuBLAS.
* ``lut4_gemv`` takes up to ``DECODE_MAX_M`` rows (decode), following ``nvfp4_gemv_triton``: a
  grid over N times a split of K, packed tiles [BLOCK_N, BLOCK_K/2] loaded along a weight row,
  the pair's two weights multiplied with x's even and odd columns (x split in registers, never
  the weight interleaved); one row takes float32 FMAs, 2..64 rows ``tl.dot`` with the weight on
  the MMA's wide side and x's rows on its narrow side (BLOCK_M = 16, 32 or 64, the next power of
  two, as ``nvfp4_gemv``; rows past M are clamped on load and dropped on store). The weight is
  rounded to x's dtype first (what the reference multiplies), products accumulate in float32
  (fp32 activations: ``input_precision="ieee"``, no TF32). Split
  slices park float32 partial tiles and the last to arrive sums them in slice order
  (deterministic; the atomics touch only ``splitk``'s counters, never y).

NF4's levels come from its 16-entry table (a gather; NF4 has no closed form), MXFP4's from the bits.

Tile configs are fixed, chosen by shape (``gemv_config``), not autotuned. Under the interpreter
(CPU, ``TRITON_INTERPRET=1``) the kernels compute and store float32 and the launcher rounds with
torch (the interpreter's float32 -> bf16 cast truncates). Tests: tests/test_lut4_kernels.py (the
interpreter; the GPU), tests/test_lut4_compile.py (compiled for sm_90 on the CPU: no register spills).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qerl_kit import mxfp4, nf4
from qerl_kit.kernels.nvfp4_gemm_triton import HAS_TRITON, launch_options
from qerl_kit.kernels.routes import LUT4_DECODE_MAX_M, LUT4_DTYPES
from qerl_kit.kernels.splitk import arrival_counters, choose_split_k

FORMAT_IDS = {"nf4": 0, "mxfp4": 1}
BLOCK_SIZES = {"nf4": nf4.BLOCK_SIZE, "mxfp4": mxfp4.BLOCK_SIZE}
SCALE_DTYPES = {"nf4": torch.float32, "mxfp4": torch.uint8}
DTYPES = LUT4_DTYPES  # activation dtypes the kernels take (bf16, fp16, fp32: the routing table's)
DECODE_MAX_M = LUT4_DECODE_MAX_M  # the most rows lut4_gemv takes (the dense path takes any number): 64, as nvfp4_gemv
K_TILES = (256, 128, 64)  # BLOCK_K candidates, widest first: the first that divides K is taken

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qerl_kit.kernels.nvfp4_gemm_triton import _e2m1_to_f32, _round_f32_to, split_even_odd
    from qerl_kit.kernels.splitk import k_slice

    @triton.jit
    def _scale_f32(s, FMT: tl.constexpr):
        """The block scales as float32: NF4's absmax as loaded, MXFP4's 2^(byte - 127) from its bits."""
        if FMT == 0:
            return s
        b = s.to(tl.int32)
        return tl.where(b == 0, 0x00400000, b << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def dequant_lut4(p, s, lut_ptr, FMT: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        """packed [BN, BK/2] + scales [BN, BK/BS] -> (W[:, 0::2], W[:, 1::2]) float32 [BN, BK/2],
        each the reference's exact float32 product lut[code] * scale."""
        c = p.to(tl.int32)
        if FMT == 0:  # NF4: the first weight of a pair in the high nibble
            c_even, c_odd = c >> 4, c & 15
        else:
            c_even, c_odd = c & 15, c >> 4
        sc = _scale_f32(s, FMT)
        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, BLOCK_K // BS, BS // 2)), (BLOCK_N, BLOCK_K // 2))
        if FMT == 0:  # NF4's codebook has no closed form: a gather from the 16-entry table (L1-resident)
            return tl.load(lut_ptr + c_even) * sc, tl.load(lut_ptr + c_odd) * sc
        return _e2m1_to_f32(c_even) * sc, _e2m1_to_f32(c_odd) * sc  # E2M1 from the bits, as NVFP4's kernels

    @triton.jit
    def _lut4_dequant_kernel(p_ptr, s_ptr, lut_ptr, w_ptr, N, K, stride_pn, stride_sn, stride_wn,
                             FMT: tl.constexpr, BS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """W[n, k0:k0+BK] for BLOCK_N rows: one tile of the dense weight per program (EVEN_N, EVEN_K:
        whole tiles along N, K: no mask there; a row mask alone keeps the loads along K vectorized)."""
        k0 = tl.program_id(1) * BLOCK_K
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_j = tl.arange(0, BLOCK_K // 2)
        offs_g = tl.arange(0, BLOCK_K // BS)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        p_ptrs = p_ptr + offs_n[:, None] * stride_pn + (k0 // 2 + offs_j)[None, :]
        s_ptrs = s_ptr + offs_n[:, None] * stride_sn + (k0 // BS + offs_g)[None, :]
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
        if EVEN_N and EVEN_K:
            even, odd = dequant_lut4(tl.load(p_ptrs), tl.load(s_ptrs), lut_ptr, FMT, BS, BLOCK_N, BLOCK_K)
            tl.store(w_ptrs, tl.interleave(even, odd).to(w_ptr.dtype.element_ty))  # rounded once, to nearest even
        else:
            rows = offs_n[:, None] < N
            if EVEN_K:
                p = tl.load(p_ptrs, mask=rows, other=0)
                s = tl.load(s_ptrs, mask=rows, other=0)
                w_mask = rows
            else:
                p = tl.load(p_ptrs, mask=rows & (offs_j[None, :] < (K - k0) // 2), other=0)
                s = tl.load(s_ptrs, mask=rows & (offs_g[None, :] < (K - k0) // BS), other=0)
                w_mask = rows & (offs_k[None, :] < K)
            even, odd = dequant_lut4(p, s, lut_ptr, FMT, BS, BLOCK_N, BLOCK_K)
            tl.store(w_ptrs, tl.interleave(even, odd).to(w_ptr.dtype.element_ty), mask=w_mask)

    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr):
        """acc + a @ b; float32 operands (fp32 activations, the interpreter) without TF32."""
        if IEEE:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit(do_not_specialize=["M"])  # one binary for every row count
    def _lut4_gemv_kernel(
        x_ptr, p_ptr, s_ptr, lut_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
        M, N, K,
        stride_xm, stride_xk, stride_pn, stride_sn, stride_ym, stride_yn,
        FMT: tl.constexpr, BS: tl.constexpr, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
        IEEE: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr, SPLIT_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """y[M, N] = x[M, K] @ W[N, K]^T (+ bias); program (i, s) owns columns [i*BN, (i+1)*BN)
        and the s-th of SPLIT_K slices of K.

        Long because: one @triton.jit kernel is one GPU program whose signature is its launch ABI;
        the K loop and the split-K epilogue share offsets, pointers and the accumulator, which a
        Triton helper could only take and hand back as a tuple. The separable steps are helpers
        (k_slice, dequant_lut4, split_even_odd, _dot)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        k_start, k_end = k_slice(pid_k, K, BLOCK_K, SPLIT_K)

        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_m = tl.arange(0, BLOCK_M) % M
        offs_k = tl.arange(0, BLOCK_K)
        offs_j = tl.arange(0, BLOCK_K // 2)
        offs_g = tl.arange(0, BLOCK_K // BS)
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
        p_ptrs = p_ptr + offs_n[:, None] * stride_pn + (k_start // 2 + offs_j)[None, :]
        s_ptrs = s_ptr + offs_n[:, None] * stride_sn + (k_start // BS + offs_g)[None, :]
        if USE_DOT:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            if EVEN_K:  # whole tiles: no masks along K (16-byte loads of packed rows where the tile allows)
                x = tl.load(x_ptrs)
                p = tl.load(p_ptrs)
                s = tl.load(s_ptrs)
            else:
                x = tl.load(x_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
                p = tl.load(p_ptrs, mask=offs_j[None, :] < (K - k0) // 2, other=0)
                s = tl.load(s_ptrs, mask=offs_g[None, :] < (K - k0) // BS, other=0)
            w_even, w_odd = dequant_lut4(p, s, lut_ptr, FMT, BS, BLOCK_N, BLOCK_K)
            if INTERPRET:  # float32 holding the activation dtype's rounding (the interpreter's cast truncates)
                w_even = _round_f32_to(w_even, x_ptr.dtype.element_ty)
                w_odd = _round_f32_to(w_odd, x_ptr.dtype.element_ty)
            else:
                w_even = w_even.to(x_ptr.dtype.element_ty)
                w_odd = w_odd.to(x_ptr.dtype.element_ty)
            x_even, x_odd = split_even_odd(x, BLOCK_M, BLOCK_K)
            if USE_DOT:
                acc = _dot(w_even, tl.trans(x_even), acc, IEEE)
                acc = _dot(w_odd, tl.trans(x_odd), acc, IEEE)
            else:  # BLOCK_M == 1: the single row of x broadcast over BLOCK_N weight rows
                acc += w_even.to(tl.float32) * x_even.to(tl.float32)
                acc += w_odd.to(tl.float32) * x_odd.to(tl.float32)
            x_ptrs += BLOCK_K * stride_xk
            p_ptrs += BLOCK_K // 2
            s_ptrs += BLOCK_K // BS
        if USE_DOT:
            out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
        else:
            out = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]

        rows = tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
        y_mask = (rows[:, None] < M) & (cols[None, :] < N)
        if SPLIT_K == 1:
            if HAS_BIAS:
                out += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)
        else:
            # Each slice parks its partial tile; the last to arrive (counter) sums them in slice
            # order, writes y and resets the counter for the next call (as nvfp4_gemv_triton).
            tile = rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            ws_tile = ws_ptr + pid_n * (SPLIT_K * BLOCK_M * BLOCK_N)
            tl.store(ws_tile + pid_k * (BLOCK_M * BLOCK_N) + tile, out)
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for i in tl.static_range(SPLIT_K):
                    total += tl.load(ws_tile + i * (BLOCK_M * BLOCK_N) + tile, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
                tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")


def lut(fmt: str, packed: torch.Tensor) -> torch.Tensor:
    """The kernels' ``lut_ptr`` for a ``fmt`` weight: NF4's 16 float32 levels on ``packed``'s device
    (``nf4._codebook``'s per-device copy, the one ``nf4.dequantize`` uses); for MXFP4, which the
    kernels decode from the bits, ``packed`` itself (a dummy pointer, never read). The first NF4 call
    on a device uploads the table: inside CUDA-graph capture that copy would invalidate the capture,
    so it is an error there (run the layer once eagerly first, as for the split-K counters)."""
    if fmt != "nf4":
        return packed
    device = packed.device
    if device.type == "cuda" and device not in nf4._BOOK_CACHE and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"the NF4 codebook is not on {device} yet: call lut4_gemv / lut4_dequantize (or the "
                           f"layer) once outside CUDA-graph capture first (warm-up)")
    return nf4._codebook(device)


def check_lut4_operands(packed: torch.Tensor, scales: torch.Tensor, fmt: str, a: torch.Tensor | None = None,
                        a_cols: int | None = None, what: str = "x") -> None:
    """Raise a clear error for a format, weight or activation the kernels do not take."""
    if fmt not in FORMAT_IDS:
        raise ValueError(f"the LUT4 kernels take formats {sorted(FORMAT_IDS)}; got {fmt!r}")
    bs, n, k2 = BLOCK_SIZES[fmt], packed.shape[0], packed.shape[1]
    if (packed.dim() != 2 or packed.dtype != torch.uint8 or scales.dtype != SCALE_DTYPES[fmt]
            or (2 * k2) % bs or scales.shape != (n, 2 * k2 // bs)):
        raise ValueError(f"bad {fmt.upper()} weight: packed {tuple(packed.shape)} {packed.dtype}, scales "
                         f"{tuple(scales.shape)} {scales.dtype} (want uint8 [N, K/2] and {SCALE_DTYPES[fmt]} "
                         f"[N, K/{bs}])")
    if packed.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError(f"packed and scales need unit stride along K (stride(1) == 1); got packed strides "
                         f"{packed.stride()}, scales strides {scales.stride()} (pass .contiguous() tensors)")
    if a is not None:
        if a.dim() != 2 or a.shape[1] != a_cols:
            raise ValueError(f"{what} must be 2-D with {a_cols} columns; got {tuple(a.shape)}")
        if a.dtype not in DTYPES:
            raise TypeError(f"the LUT4 kernels take bfloat16, float16 or float32 {what}; got {a.dtype}")
        if len({a.device, packed.device, scales.device}) != 1:
            raise ValueError(f"{what}, packed and scales must be on one device")


def lut4_dequantize(packed: torch.Tensor, scales: torch.Tensor, fmt: str,
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dense W [N, K] in ``dtype`` (bf16/fp16/fp32), one launch; bit-identical to the format's
    reference ``dequantize``."""
    if not HAS_TRITON:
        raise ImportError("the LUT4 Triton kernels need triton (pip install triton)")
    check_lut4_operands(packed, scales, fmt)
    if dtype not in DTYPES:
        raise TypeError(f"lut4_dequantize writes bfloat16, float16 or float32; got {dtype}")
    n, k = packed.shape[0], packed.shape[1] * 2
    interpret = launch_options(packed.device)["INTERPRET"]
    w = torch.empty((n, k), dtype=torch.float32 if interpret else dtype, device=packed.device)
    bn, bk = dequant_config(k, interpret)
    _lut4_dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        packed, scales, lut(fmt, packed), w, n, k, packed.stride(0), scales.stride(0), w.stride(0),
        FMT=FORMAT_IDS[fmt], BS=BLOCK_SIZES[fmt], EVEN_N=n % bn == 0, EVEN_K=k % bk == 0, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=4)
    return w.to(dtype)


def lut4_dense_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, fmt: str,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """The dense path: y = x @ W^T + bias with W from ``lut4_dequantize`` (transient), then cuBLAS.
    The dense W comes through ``qerl_kit.dense_cache.cached``: made once per open block that takes it
    (the training pass's), shared by the forward and the input gradient."""
    return F.linear(x, _dense_weight(packed, scales, fmt, x.dtype), bias)


def _dense_weight(packed: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype,
                  held_only: bool = False) -> torch.Tensor | None:
    """The dense weight through ``dense_cache.cached`` under the tag ``fmt``, deliberately the one the
    reference (``kernels.reference.lut4_dequantize``) and the layer path (``linear._dense``) use: the
    kernel's output is bit-identical to the format's ``dequantize`` (tests/test_lut4_kernels.py), so
    one cache entry per weight serves every path of a block, whichever made it. ``held_only``: the
    open block's copy or None (``dense_cache.cached_or_none``), never a per-call one."""
    from qerl_kit.dense_cache import cached, cached_or_none

    return (cached_or_none if held_only else cached)(
        (packed, scales), dtype, lambda: lut4_dequantize(packed, scales, fmt, dtype),
        shape=(packed.shape[0], packed.shape[1] * 2), tag=fmt)


def held_dense_weight(packed: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The dense W ``lut4_dense_linear`` and ``lut4_dense_dgrad`` would use, where an open
    ``qerl_kit.dense_cache`` block holds it (made now on its first call); None otherwise."""
    return _dense_weight(packed, scales, fmt, dtype, held_only=True)


def lut4_dense_dgrad(dy: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """The dense path's input gradient: dx = dy @ W."""
    return dy @ _dense_weight(packed, scales, fmt, dy.dtype)


def k_tile(k: int, widest: int = 256) -> int:
    """The widest BLOCK_K of ``K_TILES`` (up to ``widest``) that divides K, so the K loop runs whole,
    unmasked tiles (Qwen2.5-0.5B's K = 896 takes 128); ``widest`` when none divides (masked tail)."""
    return next((t for t in K_TILES if t <= widest and k % t == 0), widest)


def dequant_config(k: int, interpret: bool) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of ``lut4_dequantize``: 32 rows x ``k_tile(K)`` (16 x 64 in the interpreter)."""
    return (16, 64) if interpret else (32, k_tile(k))


def gemv_block_m(m: int, use_dot: bool) -> int:
    """The rows one ``lut4_gemv`` program holds: 1 on the FMA path, else the MMA's narrow side, the
    next power of two of M from 16 to 64 (``nvfp4_gemv``'s rule; one binary per value)."""
    return max(16, 1 << max(0, (m - 1).bit_length())) if use_dot else 1


def gemv_config(m: int, n: int, k: int, fmt: str, interpret: bool) -> dict:
    """The fixed tile config of ``lut4_gemv`` for this shape (no autotuning: reproducible runs).

    One row: float32 FMAs over [32, BLOCK_K / 2] weight pairs per step, BLOCK_K = ``k_tile(K)``;
    2..64 rows: ``tl.dot`` tiles of 64 weight rows x BLOCK_K 64 x BLOCK_M (``gemv_block_m``), three
    pipeline stages for MXFP4 and one for NF4. The tiles were chosen by compiling for sm_90
    (``tests/test_lut4_compile.py``: NVFP4's decode shapes, 64 x 256 FMA and 64 x 128 x 4 stages dot,
    spill registers here; these do not), the stages by timing (H200, hold 13,
    bench/results/fair_h200/hold13/sweep.md, every config that compiles without spilling, per 7B
    layer): with three stages Triton's pipeliner turns NF4's table gather into one 4-byte async copy
    per weight through shared memory (sm_90 SASS: 69 LDGSTS per loop at 8 rows against MXFP4's 6), and
    one stage halves NF4's time at 8 rows (gate/up 95.1 against 172.8 us; 1.2-1.8x on every layer, and
    at 64 rows); MXFP4 keeps three (gate/up 73.7 against 79.6 us with one). One row loads packed rows
    as 16-byte vectors when K is a whole number of tiles (the compile test checks that too), more rows
    stream them through shared memory with cp.async. K is split until the grid has two programs per
    SM (``splitk.choose_split_k``)."""
    if interpret:
        cfg = dict(BLOCK_N=16, BLOCK_K=64, USE_DOT=m > 1, num_warps=4, num_stages=1)
    elif m == 1:
        cfg = dict(BLOCK_N=32, BLOCK_K=k_tile(k), USE_DOT=False, num_warps=4, num_stages=2)
    else:  # 64 rows: 8 warps (at 4, NF4's fp32 tile spills 8 bytes at 168 registers)
        cfg = dict(BLOCK_N=64, BLOCK_K=64, USE_DOT=True, num_warps=8 if m > 32 else 4,
                   num_stages=1 if fmt == "nf4" else 3)
    cfg["SPLIT_K"] = choose_split_k(n, k, cfg["BLOCK_N"], cfg["BLOCK_K"], 2)
    return cfg


def lut4_gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, fmt: str,
              bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """y = x @ W^T + bias for x [M, K] with M <= ``DECODE_MAX_M`` (``config`` overrides ``gemv_config``'s keys;
    a tile given without SPLIT_K gets the split ``gemv_config``'s rule picks for it)."""
    if not HAS_TRITON:
        raise ImportError("the LUT4 Triton kernels need triton (pip install triton)")
    n, k = packed.shape[0], packed.shape[1] * 2
    check_lut4_operands(packed, scales, fmt, x, k)
    m = x.shape[0]
    if m > DECODE_MAX_M:
        raise ValueError(f"lut4_gemv takes at most {DECODE_MAX_M} rows; got {m} (use the dense path)")
    interpret = launch_options(x.device)["INTERPRET"]
    y = torch.empty((m, n), dtype=torch.float32 if interpret else x.dtype, device=x.device)
    if m == 0:
        return y.to(x.dtype)
    cfg = {**gemv_config(m, n, k, fmt, interpret), **(config or {})}
    if config and "SPLIT_K" not in config and {"BLOCK_N", "BLOCK_K"} & set(config):  # the split follows the tile
        cfg["SPLIT_K"] = choose_split_k(n, k, cfg["BLOCK_N"], cfg["BLOCK_K"], 2)
    if not cfg["USE_DOT"] and m != 1:
        raise ValueError(f"USE_DOT=False (the FMA path) takes M == 1; got M={m}")
    if cfg["BLOCK_K"] % BLOCK_SIZES[fmt]:
        raise ValueError(f"BLOCK_K {cfg['BLOCK_K']} is not a multiple of {fmt.upper()}'s block {BLOCK_SIZES[fmt]}")
    block_m = gemv_block_m(m, cfg["USE_DOT"])
    split, block_n = cfg["SPLIT_K"], cfg["BLOCK_N"]
    # the split-K workspace: SPLIT_K partial tiles of [BLOCK_M, BLOCK_N] float32 per N tile
    ws = torch.empty(max(1, triton.cdiv(n, block_n) * split * block_m * block_n if split > 1 else 1),
                     dtype=torch.float32, device=x.device)
    _lut4_gemv_kernel[(triton.cdiv(n, block_n), split)](
        x, packed, scales, lut(fmt, packed), bias if bias is not None else y, y, ws, arrival_counters(x.device),
        m, n, k, x.stride(0), x.stride(1), packed.stride(0), scales.stride(0), y.stride(0), y.stride(1),
        FMT=FORMAT_IDS[fmt], BS=BLOCK_SIZES[fmt], HAS_BIAS=bias is not None, INTERPRET=interpret,
        IEEE=interpret or x.dtype == torch.float32, EVEN_K=k % cfg["BLOCK_K"] == 0,
        USE_DOT=cfg["USE_DOT"], SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y.to(x.dtype)
