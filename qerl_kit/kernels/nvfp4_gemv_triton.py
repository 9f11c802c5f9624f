"""NVFP4 x bf16 decode kernels in Triton (M = 1..64 rows): y = x @ W^T + bias, memory-bound.

In decode every weight byte serves only M rows, so the job is to stream ``packed`` and ``scales``
at full memory bandwidth with few instructions per weight. Layout and dequantization helpers are
``nvfp4_gemm_triton``'s (see its docstring).

* Grid over N times a split of K: a program owns BLOCK_N output features for all M rows and one
  slice of K. Slices write float32 partial tiles; the last to arrive (an int32 counter per N tile,
  reset by it) sums them in slice order (deterministic) and writes y: one launch, no memset.
* ``packed`` tiles [BLOCK_N, BLOCK_K/2] are loaded as 16-byte vectors along a row; a software
  pipeline (``num_stages``, or ``PREFETCH``) keeps the next tile's loads in flight.
* M = 1, ``USE_DOT=False``: no tensor cores; the dequantized even/odd weights times x's even/odd
  columns in float32 FMAs, reduced along K at the end.
* M = 2..64, ``USE_DOT=True``: the product is taken transposed, acc[BLOCK_N, BLOCK_M] = W @ x^T,
  so the weight fills the MMA's M side and the few rows of x its narrow N side (BLOCK_M = 16, 32
  or 64; rows past M are clamped on load and dropped on store).
* Block-dot kernel (``_nvfp4_gemv_blockdot_kernel``; M <= ``BLOCKDOT_MAX_M`` by default, up to 4
  with ``config=dict(BLOCKDOT=True, ...)``): reads ``packed`` as int32 words and multiplies the
  raw E2M1 codes (an fp16 bit placement) with x, one scale multiply per 16 weights; faster than
  both paths above for one row (docs/kernels.md).

Configs are autotuned per (M bucket, N, K); the launcher does no host sync, so a warmed-up call
can be captured in a CUDA graph. Registered as ``torch.ops.qerl_kit.nvfp4_gemv``;
qerl_kit/kernels/routes.py decides which calls reach it. Tests: tests/test_kernels.py (Triton's
interpreter on the CPU; real shapes and CUDA graphs on a GPU).
"""

from __future__ import annotations

import torch

from qerl_kit.kernels.backend import register_linear_op
from qerl_kit.kernels.nvfp4_gemm_triton import (HAS_TRITON, check_nvfp4_operands, launch_options,
                                                m_bucket)

DECODE_MAX_M = 64  # the most rows nvfp4_gemv takes (nvfp4_gemm takes any number)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qerl_kit.kernels.nvfp4_gemm_triton import (_e2m1_to_f32, _e4m3_bits_to_f32, _quick_bench, acc_fix,
                                                    dequant_nvfp4, mma, split_even_odd)

    def even_k(args) -> bool:
        return args["K"] % args["BLOCK_K"] == 0

    def block_m(args) -> int:
        return max(16, args["M_BUCKET"]) if args["USE_DOT"] else 1

    def split_k(args) -> int:
        return choose_split_k(args["N"], args["K"], args["BLOCK_N"], args["BLOCK_K"], args["CTAS_PER_SM"])

    @triton.jit
    def _k_slice(pid_k, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        """[k_start, k_end): the pid_k-th of SPLIT_K slices of K, whole BLOCK_K tiles each."""
        k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_start = pid_k * k_per_split
        return k_start, min(K, k_start + k_per_split)

    @triton.jit
    def _load_next(x_ptrs, p_ptrs, s_ptrs, k1, k_end, K, offs_k, offs_j, offs_g, EVEN_K: tl.constexpr):
        """The tiles at k1 (zeros past this slice's end); a scalar mask keeps 16-byte vectors."""
        ok = k1 < k_end
        if EVEN_K:
            return (tl.load(x_ptrs, mask=ok, other=0.0), tl.load(p_ptrs, mask=ok, other=0),
                    tl.load(s_ptrs, mask=ok, other=0))
        return (tl.load(x_ptrs, mask=ok & (offs_k[None, :] < K - k1), other=0.0),
                tl.load(p_ptrs, mask=ok & (offs_j[None, :] < (K - k1) // 2), other=0),
                tl.load(s_ptrs, mask=ok & (offs_g[None, :] < (K - k1) // 16), other=0))

    @triton.jit
    def _fma_step(acc, x, p, s, gscale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  FAST: tl.constexpr, INTERPRET: tl.constexpr):
        """M == 1 without tensor cores: acc[BN, BK/2] += W_even * x_even + W_odd * x_odd."""
        w_even, w_odd = dequant_nvfp4(p, s, gscale, BLOCK_N, BLOCK_K, x.dtype, FAST, INTERPRET)
        x_even, x_odd = split_even_odd(x, 1, BLOCK_K)
        acc += w_even.to(tl.float32) * x_even.to(tl.float32)
        acc += w_odd.to(tl.float32) * x_odd.to(tl.float32)
        return acc

    @triton.heuristics({"EVEN_K": even_k, "BLOCK_M": block_m, "SPLIT_K": split_k})
    @triton.jit(do_not_specialize=["M", "M_BUCKET"])  # one binary for every row count
    def _nvfp4_gemv_kernel(
        # pointers (ws: float32 partial tiles, cnt: int32 arrival counters, zero between calls)
        x_ptr, p_ptr, s_ptr, gs_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
        # sizes
        M, N, K, M_BUCKET,
        # strides
        stride_xm, stride_xk, stride_pn, stride_sn, stride_ym, stride_yn,
        # tuning knob read only by the SPLIT_K heuristic (target programs per SM)
        CTAS_PER_SM,
        # meta-parameters
        HAS_BIAS: tl.constexpr, FAST: tl.constexpr, INTERPRET: tl.constexpr,
        EVEN_K: tl.constexpr, USE_DOT: tl.constexpr, SPLIT_K: tl.constexpr, PREFETCH: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """y[M, N] = x[M, K] @ W[N, K]^T (+ bias); program (i, s) owns columns [i*BN, (i+1)*BN)
        and the s-th of SPLIT_K slices of K."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        k_start, k_end = _k_slice(pid_k, K, BLOCK_K, SPLIT_K)

        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_m = tl.arange(0, BLOCK_M) % M
        offs_k = tl.arange(0, BLOCK_K)
        offs_j = tl.arange(0, BLOCK_K // 2)
        offs_g = tl.arange(0, BLOCK_K // 16)
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
        p_ptrs = p_ptr + offs_n[:, None] * stride_pn + (k_start // 2 + offs_j)[None, :]
        s_ptrs = s_ptr + offs_n[:, None] * stride_sn + (k_start // 16 + offs_g)[None, :]
        gscale = tl.load(gs_ptr)

        if USE_DOT:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
        if PREFETCH:  # M == 1 path: the next tile's loads are in flight while this one computes
            x_n, p_n, s_n = _load_next(x_ptrs, p_ptrs, s_ptrs, k_start, k_end, K, offs_k, offs_j, offs_g, EVEN_K)
            for k0 in range(k_start, k_end, BLOCK_K):
                x, p, s = x_n, p_n, s_n
                x_ptrs += BLOCK_K * stride_xk
                p_ptrs += BLOCK_K // 2
                s_ptrs += BLOCK_K // 16
                x_n, p_n, s_n = _load_next(x_ptrs, p_ptrs, s_ptrs, k0 + BLOCK_K, k_end, K,
                                           offs_k, offs_j, offs_g, EVEN_K)
                acc = _fma_step(acc, x, p, s, gscale, BLOCK_N, BLOCK_K, FAST, INTERPRET)
        else:
            for k0 in range(k_start, k_end, BLOCK_K):
                if EVEN_K:
                    x = tl.load(x_ptrs)
                    p = tl.load(p_ptrs)
                    s = tl.load(s_ptrs)
                else:
                    x = tl.load(x_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
                    p = tl.load(p_ptrs, mask=offs_j[None, :] < (K - k0) // 2, other=0)
                    s = tl.load(s_ptrs, mask=offs_g[None, :] < (K - k0) // 16, other=0)
                if USE_DOT:
                    w_even, w_odd = dequant_nvfp4(p, s, gscale, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty,
                                                  FAST, INTERPRET)
                    x_even, x_odd = split_even_odd(x, BLOCK_M, BLOCK_K)
                    acc = mma(w_even, tl.trans(x_even), acc, INTERPRET)
                    acc = mma(w_odd, tl.trans(x_odd), acc, INTERPRET)
                else:  # BLOCK_M == 1: broadcast the single row of x over BLOCK_N weight rows
                    acc = _fma_step(acc, x, p, s, gscale, BLOCK_N, BLOCK_K, FAST, INTERPRET)
                x_ptrs += BLOCK_K * stride_xk
                p_ptrs += BLOCK_K // 2
                s_ptrs += BLOCK_K // 16
        if USE_DOT:
            out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
        else:
            out = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
        out = out * acc_fix(x_ptr.dtype.element_ty, FAST)

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
            # order (deterministic), writes y and resets the counter for the next call.
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

    # -- block-dot kernel (M = 1..4): raw E2M1 codes times x, one scale multiply per 16 ---------

    # One packed int32 word (8 codes, nibble p = column 8j + p) dotted with its 8 x values
    # (float32, $2..$9): per pair (p, p + 4) the two nibbles go to the top of the two 16-bit
    # lanes, sign -> bit 15, magnitude -> bits 9..11, which reads as fp16 e2m1 * 2^-14 (exact,
    # subnormal code 0.5 included); each half is widened to float32 (HADD2.F32) and FMA'd.
    # Result: sum_p e2m1(code_p) * x_p * 2^-14, in float32.
    # The placement: a sign moves 3 bits further than its magnitude, so the word is merged once
    # with itself rotated right by 3 (w0 keeps the sign bits of codes 0, 2, 4, 6 and takes every
    # other bit from the rotated copy, w1 those of 1, 3, 5, 7; the bits a pair needs never collide),
    # then each pair is one rotate and one mask: 10 instructions per word, against 15 for a shift,
    # mask, shift, mask and or per pair. The CUDA decode kernel does the same for bf16 (nvfp4_decode_cuda.py).
    _PAIRS_F16 = """
    shf.r.wrap.b32 r, $1, $1, 3;
    lop3.b32 w0, $1, r, 0x08080808, 0xE4; lop3.b32 w1, $1, r, 0x80808080, 0xE4;
    shf.l.wrap.b32 h0, w0, w0, 12; and.b32 h0, h0, 0x8E008E00;
    shf.l.wrap.b32 h1, w1, w1, 8; and.b32 h1, h1, 0x8E008E00;
    shf.l.wrap.b32 h2, w0, w0, 4; and.b32 h2, h2, 0x8E008E00;
    and.b32 h3, w1, 0x8E008E00;
    """
    _WORD_DOT_ASM = """
    {
    .reg .b32 r, w0, w1, h0, h1, h2, h3;
    .reg .b16 l, g;
    .reg .f32 a, b, s;
    """ + _PAIRS_F16 + """
    mov.b32 {l, g}, h0; cvt.f32.f16 a, l; cvt.f32.f16 b, g;
    mul.rn.f32 s, a, $2; fma.rn.f32 s, b, $6, s;
    mov.b32 {l, g}, h1; cvt.f32.f16 a, l; cvt.f32.f16 b, g;
    fma.rn.f32 s, a, $3, s; fma.rn.f32 s, b, $7, s;
    mov.b32 {l, g}, h2; cvt.f32.f16 a, l; cvt.f32.f16 b, g;
    fma.rn.f32 s, a, $4, s; fma.rn.f32 s, b, $8, s;
    mov.b32 {l, g}, h3; cvt.f32.f16 a, l; cvt.f32.f16 b, g;
    fma.rn.f32 s, a, $5, s; fma.rn.f32 $0, b, $9, s;
    }
    """
    _WORD_DOT = tl.constexpr(_WORD_DOT_ASM)
    # The same in fp16 (HALF): $2..$5 hold x pairs (x_p, x_{p+4}) as f16x2, already scaled by a
    # power of two per row; the pair products are accumulated with HFMA2 in fp16 (4 per lane),
    # then the two lanes are widened and added in float32.
    _WORD_DOT_HALF_ASM = """
    {
    .reg .b32 r, w0, w1, h0, h1, h2, h3, c;
    .reg .b16 l, g;
    .reg .f32 a;
    """ + _PAIRS_F16 + """
    mul.rn.f16x2 c, h0, $2;
    fma.rn.f16x2 c, h1, $3, c;
    fma.rn.f16x2 c, h2, $4, c;
    fma.rn.f16x2 c, h3, $5, c;
    mov.b32 {l, g}, c; cvt.f32.f16 a, l; cvt.f32.f16 $0, g; add.rn.f32 $0, $0, a;
    }
    """
    _WORD_DOT_HALF = tl.constexpr(_WORD_DOT_HALF_ASM)
    _PACK_F16X2 = tl.constexpr("cvt.rn.f16x2.f32 $0, $2, $1;")  # lo = $1, hi = $2
    CODE_FOLD = tl.constexpr(2.0 ** 14 * 256.0)  # undoes the 2^-14 of the codes and the 2^-8 of the scale decode

    @triton.jit
    def _word_dot(q, x0, x1, x2, x3, x4, x5, x6, x7, FAST: tl.constexpr, HALF: tl.constexpr):
        """sum_p e2m1(nibble p of q) * x_p * 2^-14 for int32 words q (8 codes each), float32.
        HALF (GPU only): x0..x3 are f16x2 pairs (x_p, x_{p+4}), products summed in fp16."""
        if FAST:
            if HALF:
                return tl.inline_asm_elementwise(_WORD_DOT_HALF, "=r,r,r,r,r,r", [q, x0, x1, x2, x3],
                                                 dtype=tl.float32, is_pure=True, pack=1)
            return tl.inline_asm_elementwise(_WORD_DOT, "=r,r,r,r,r,r,r,r,r,r",
                                             [q, x0, x1, x2, x3, x4, x5, x6, x7],
                                             dtype=tl.float32, is_pure=True, pack=1)
        s = _e2m1_to_f32(q & 15) * x0
        s += _e2m1_to_f32((q >> 4) & 15) * x1
        s += _e2m1_to_f32((q >> 8) & 15) * x2
        s += _e2m1_to_f32((q >> 12) & 15) * x3
        s += _e2m1_to_f32((q >> 16) & 15) * x4
        s += _e2m1_to_f32((q >> 20) & 15) * x5
        s += _e2m1_to_f32((q >> 24) & 15) * x6
        s += _e2m1_to_f32((q >> 28) & 15) * x7
        return s * (1.0 / 16384.0)

    @triton.jit
    def _x8(xr, k0, K, stride_xk, offs_w, MASK_K: tl.constexpr):
        """The 8 float32 columns 8j + p (p = 0..7) of one row of x for the words j of a tile."""
        c = k0 + offs_w * 8
        ok = (c < K) | (not MASK_K)
        return (tl.load(xr + c * stride_xk, mask=ok, other=0.0).to(tl.float32),
                tl.load(xr + (c + 1) * stride_xk, mask=ok, other=0.0).to(tl.float32),
                tl.load(xr + (c + 2) * stride_xk, mask=ok, other=0.0).to(tl.float32),
                tl.load(xr + (c + 3) * stride_xk, mask=ok, other=0.0).to(tl.float32),
                tl.load(xr + (c + 4) * stride_xk, mask=ok, other=0.0).to(tl.float32),
                tl.load(xr + (c + 5) * stride_xk, mask=ok, other=0.0).to(tl.float32),
                tl.load(xr + (c + 6) * stride_xk, mask=ok, other=0.0).to(tl.float32),
                tl.load(xr + (c + 7) * stride_xk, mask=ok, other=0.0).to(tl.float32))

    @triton.jit
    def _pack2(lo, hi, FAST: tl.constexpr):
        if FAST:
            return tl.inline_asm_elementwise(_PACK_F16X2, "=r,r,r", [lo, hi], dtype=tl.int32, is_pure=True, pack=1)
        return lo.to(tl.int32, bitcast=True)  # unused off the GPU

    @triton.jit
    def _row_step(acc, q, sf, xr, xs, k0, K, stride_xk, offs_w, MASK_K: tl.constexpr, FAST: tl.constexpr,
                  HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """acc[BN, BK/16] += (dot of each 16-code block with x) * its scale, one row of x
        (xs: the row's power-of-two prescale, HALF only)."""
        x0, x1, x2, x3, x4, x5, x6, x7 = _x8(xr, k0, K, stride_xk, offs_w, MASK_K)
        if HALF and FAST:
            p0 = _pack2(x0 * xs, x4 * xs, FAST)
            p1 = _pack2(x1 * xs, x5 * xs, FAST)
            p2 = _pack2(x2 * xs, x6 * xs, FAST)
            p3 = _pack2(x3 * xs, x7 * xs, FAST)
            d = _word_dot(q, p0[None, :], p1[None, :], p2[None, :], p3[None, :], p0[None, :], p0[None, :],
                          p0[None, :], p0[None, :], FAST, True)
        else:
            d = _word_dot(q, x0[None, :] * xs, x1[None, :] * xs, x2[None, :] * xs, x3[None, :] * xs,
                          x4[None, :] * xs, x5[None, :] * xs, x6[None, :] * xs, x7[None, :] * xs, FAST, False)
        d = tl.sum(tl.reshape(d, (BLOCK_N, BLOCK_K // 16, 2)), axis=2)  # the two words of a block
        return acc + d * sf

    @triton.jit
    def _row_prescale(xr, k_start, k_end, K, stride_xk, HALF: tl.constexpr, BLOCK_K: tl.constexpr):
        """HALF: 2^e with e such that max |x * 2^e| over this slice of the row lies in [2^13, 2^14)
        (the fp16 products and sums then neither overflow nor lose small terms); else 1."""
        if HALF:
            offs = tl.arange(0, BLOCK_K)
            amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(k_start, k_end, BLOCK_K):
                v = tl.load(xr + (k0 + offs) * stride_xk, mask=k0 + offs < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(v))
            e = (tl.max(amax, axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent
            bits = tl.minimum(tl.maximum(267 - e, 1), 254)
            return tl.where(e == 0, 1.0, (bits << 23).to(tl.float32, bitcast=True))
        return 1.0

    @triton.heuristics({"EVEN_K": even_k, "SPLIT_K": split_k})
    @triton.jit(do_not_specialize=["M"])
    def _nvfp4_gemv_blockdot_kernel(
        x_ptr, q_ptr, s_ptr, gs_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
        M, N, K,
        stride_xm, stride_xk, stride_qn, stride_sn, stride_ym, stride_yn,
        CTAS_PER_SM,
        HAS_BIAS: tl.constexpr, FAST: tl.constexpr, INTERPRET: tl.constexpr, EVEN_K: tl.constexpr,
        SPLIT_K: tl.constexpr, ROWS: tl.constexpr, EVICT: tl.constexpr, HALF: tl.constexpr,
        PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for M <= ROWS <= 4, without tensor cores.
        ``q_ptr`` is ``packed`` viewed as int32 words [N, K/8]; program (i, s) owns columns
        [i*BN, (i+1)*BN) and the s-th of SPLIT_K slices of K."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        k_start, k_end = _k_slice(pid_k, K, BLOCK_K, SPLIT_K)

        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_w = tl.arange(0, BLOCK_K // 8)
        q_ptrs = q_ptr + offs_n[:, None] * stride_qn + (k_start // 8 + offs_w)[None, :]
        # scale bytes 2 per thread, the layout of the per-block sums of the words (16-byte vectors)
        offs_g = tl.max_contiguous(tl.arange(0, BLOCK_K // 16), 2)
        s_ptrs = s_ptr + offs_n[:, None] * stride_sn + (k_start // 16 + offs_g)[None, :]
        x0r = x_ptr
        x1r = x_ptr + min(1, M - 1) * stride_xm
        x2r = x_ptr + min(2, M - 1) * stride_xm
        x3r = x_ptr + min(3, M - 1) * stride_xm
        xs0 = _row_prescale(x0r, k_start, k_end, K, stride_xk, HALF, BLOCK_K)
        xs1 = xs0
        xs2 = xs0
        xs3 = xs0
        if ROWS > 1:
            xs1 = _row_prescale(x1r, k_start, k_end, K, stride_xk, HALF, BLOCK_K)
        if ROWS > 2:
            xs2 = _row_prescale(x2r, k_start, k_end, K, stride_xk, HALF, BLOCK_K)
            xs3 = _row_prescale(x3r, k_start, k_end, K, stride_xk, HALF, BLOCK_K)

        acc0 = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
        if PREFETCH:  # the next tile's weight loads are in flight while this one computes
            q_n, s_n = _bd_load(q_ptrs, s_ptrs, k_start, k_end, K, offs_w, offs_g, EVEN_K, EVICT)
        for k0 in range(k_start, k_end, BLOCK_K):
            if PREFETCH:
                q, s = q_n, s_n
                q_n, s_n = _bd_load(q_ptrs + BLOCK_K // 8, s_ptrs + BLOCK_K // 16, k0 + BLOCK_K, k_end, K,
                                    offs_w, offs_g, EVEN_K, EVICT)
            else:
                q, s = _bd_load(q_ptrs, s_ptrs, k0, k_end, K, offs_w, offs_g, EVEN_K, EVICT)
            if FAST:
                sf = s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * (1.0 / 256.0)
            else:
                sf = _e4m3_bits_to_f32(s)  # scale * 2^-8
            acc0 = _row_step(acc0, q, sf, x0r, xs0, k0, K, stride_xk, offs_w, not EVEN_K, FAST, HALF, BLOCK_N, BLOCK_K)
            if ROWS > 1:
                acc1 = _row_step(acc1, q, sf, x1r, xs1, k0, K, stride_xk, offs_w, not EVEN_K, FAST, HALF, BLOCK_N, BLOCK_K)
            if ROWS > 2:
                acc2 = _row_step(acc2, q, sf, x2r, xs2, k0, K, stride_xk, offs_w, not EVEN_K, FAST, HALF, BLOCK_N, BLOCK_K)
                acc3 = _row_step(acc3, q, sf, x3r, xs3, k0, K, stride_xk, offs_w, not EVEN_K, FAST, HALF, BLOCK_N, BLOCK_K)
            q_ptrs += BLOCK_K // 8
            s_ptrs += BLOCK_K // 16
        fix = CODE_FOLD / tl.load(gs_ptr)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        if HAS_BIAS:
            bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        else:
            bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
        _blockdot_out(tl.sum(acc0, axis=1) * (fix / xs0), 0, M, bias, y_ptr, ws_ptr, cnt_ptr, cols, col_ok, pid_n, pid_k,
                      stride_ym, stride_yn, SPLIT_K, ROWS, BLOCK_N, False)
        if ROWS > 1:
            _blockdot_out(tl.sum(acc1, axis=1) * (fix / xs1), 1, M, bias, y_ptr, ws_ptr, cnt_ptr, cols, col_ok, pid_n,
                          pid_k, stride_ym, stride_yn, SPLIT_K, ROWS, BLOCK_N, False)
        if ROWS > 2:
            _blockdot_out(tl.sum(acc2, axis=1) * (fix / xs2), 2, M, bias, y_ptr, ws_ptr, cnt_ptr, cols, col_ok, pid_n,
                          pid_k, stride_ym, stride_yn, SPLIT_K, ROWS, BLOCK_N, False)
            _blockdot_out(tl.sum(acc3, axis=1) * (fix / xs3), 3, M, bias, y_ptr, ws_ptr, cnt_ptr, cols, col_ok, pid_n,
                          pid_k, stride_ym, stride_yn, SPLIT_K, ROWS, BLOCK_N, False)
        if SPLIT_K > 1:
            # Each slice parked its partial rows; the last to arrive (counter) sums them in slice
            # order (deterministic), writes y and resets the counter for the next call.
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                for r in tl.static_range(ROWS):
                    _blockdot_out(bias, r, M, bias, y_ptr, ws_ptr, cnt_ptr, cols, col_ok, pid_n, pid_k,
                                  stride_ym, stride_yn, SPLIT_K, ROWS, BLOCK_N, True)
                tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _bd_load(q_ptrs, s_ptrs, k0, k_end, K, offs_w, offs_g, EVEN_K: tl.constexpr, EVICT: tl.constexpr):
        """The words and their scale bytes at k0 (zeros past this slice's end)."""
        ok = k0 < k_end
        if EVEN_K:  # a scalar mask keeps the 16-byte vectors
            return (tl.load(q_ptrs, mask=ok, other=0, eviction_policy=EVICT),
                    tl.load(s_ptrs, mask=ok, other=0, eviction_policy=EVICT))
        return (tl.load(q_ptrs, mask=ok & (offs_w[None, :] < (K - k0) // 8), other=0, eviction_policy=EVICT),
                tl.load(s_ptrs, mask=ok & (offs_g[None, :] < (K - k0) // 16), other=0, eviction_policy=EVICT))

    @triton.jit
    def _blockdot_out(out, r: tl.constexpr, M, bias, y_ptr, ws_ptr, cnt_ptr, cols, col_ok, pid_n, pid_k,
                      stride_ym, stride_yn, SPLIT_K: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                      FINAL: tl.constexpr):
        """Row r of this program's result: stored (SPLIT_K == 1), parked in the workspace, or
        (FINAL) summed over the parked slices and stored."""
        ws_tile = ws_ptr + pid_n * (SPLIT_K * ROWS * BLOCK_N) + r * BLOCK_N + tl.arange(0, BLOCK_N)
        y_ptrs = y_ptr + r * stride_ym + cols * stride_yn
        if FINAL:
            total = bias
            for i in tl.static_range(SPLIT_K):
                total += tl.load(ws_tile + i * (ROWS * BLOCK_N), cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=col_ok & (r < M))
        elif SPLIT_K == 1:
            tl.store(y_ptrs, (out + bias).to(y_ptr.dtype.element_ty), mask=col_ok & (r < M))
        else:
            tl.store(ws_tile + pid_k * (ROWS * BLOCK_N), out)

    def _cfg(bn, bk, warps, stages, dot=True, prefetch=False, ctas=2):
        return triton.Config(dict(BLOCK_N=bn, BLOCK_K=bk, USE_DOT=dot, PREFETCH=prefetch, CTAS_PER_SM=ctas),
                             num_warps=warps, num_stages=stages)

    # From the H200 sweep (python -m bench.bench_nvfp4_gemm --sweep; docs/kernels.md): for M == 1 the
    # FMA path is 1.4-1.6x faster than the tensor-core one, for M = 8..64 BLOCK_K=128 with 4 stages
    # beats wider tiles, and more programs per SM help long K.
    GEMV_CONFIGS = [  # USE_DOT=False / PREFETCH configs take M == 1 only
        _cfg(64, 256, 4, 1, dot=False),
        _cfg(64, 256, 4, 1, dot=False, prefetch=True),
        _cfg(64, 256, 4, 1, dot=False, prefetch=True, ctas=4),
        _cfg(64, 128, 4, 4),
        _cfg(64, 128, 4, 6, ctas=4),
        _cfg(64, 256, 4, 4),
        # autotuned only for M > 16 (lab/results/sweep_small_m_h200.md: the best per-shape configs at
        # M = 32 and 64, 5-20% faster there than the three above; none is faster at M <= 16)
        _cfg(64, 128, 4, 2, ctas=4),
        _cfg(64, 64, 4, 4),
        _cfg(128, 64, 4, 4, ctas=4),
        _cfg(128, 256, 8, 3),
    ]
    _WIDE_M_ONLY = {(64, 128, 2, 4), (64, 64, 4, 2), (128, 64, 4, 4), (128, 256, 3, 2)}

    def _prune(configs, named_args, **kwargs):
        m = named_args["M"]

        def key(c):
            return (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_stages, c.kwargs["CTAS_PER_SM"])
        return [c for c in configs if (c.kwargs["USE_DOT"] or m == 1) and (m > 16 or key(c) not in _WIDE_M_ONLY)]

    def _bcfg(bn, bk, warps, half, prefetch=True, ctas=4, evict="evict_first"):
        return triton.Config(dict(BLOCK_N=bn, BLOCK_K=bk, HALF=half, PREFETCH=prefetch, CTAS_PER_SM=ctas,
                                  EVICT=evict), num_warps=warps, num_stages=1)

    # Block-dot kernel (M <= BLOCKDOT_MAX_M): 8 rows of 16-byte words per thread and more.
    BLOCKDOT_CONFIGS = [
        _bcfg(128, 256, 4, True), _bcfg(64, 512, 4, True), _bcfg(64, 256, 4, True),
        _bcfg(128, 256, 4, True, ctas=8), _bcfg(128, 256, 4, False), _bcfg(64, 256, 4, False),
    ]
    _nvfp4_gemv_blockdot_tuned = triton.autotune(BLOCKDOT_CONFIGS, key=["ROWS", "N", "K"],
                                                 do_bench=_quick_bench)(_nvfp4_gemv_blockdot_kernel)

    _nvfp4_gemv_tuned = triton.autotune(GEMV_CONFIGS, key=["M_BUCKET", "N", "K"],
                                        prune_configs_by={"early_config_prune": _prune},
                                        do_bench=_quick_bench)(_nvfp4_gemv_kernel)


def choose_split_k(n: int, k: int, block_n: int, block_k: int, ctas_per_sm: int = 2) -> int:
    """Split K until the grid has ``ctas_per_sm`` programs per SM, keeping >= 2 K tiles a slice."""
    tiles = -(-n // block_n)
    k_tiles = -(-k // block_k)
    split = 1
    while split < MAX_SPLIT_K and tiles * split < ctas_per_sm * _sm_count() and k_tiles >= 4 * split:
        split *= 2
    return split


MAX_SPLIT_K = 8
_SMS: list[int] = []
_COUNTERS: dict[torch.device, torch.Tensor] = {}
COUNTER_SLOTS = 1 << 16  # arrival counters per device, one per N tile (N / 16 at most)


def _sm_count() -> int:
    if not _SMS:
        _SMS.append(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
                    if torch.cuda.is_available() else 8)
    return _SMS[0]


def _counters(device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters that split-K programs leave at zero again (allocated once, eagerly)."""
    buf = _COUNTERS.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("call nvfp4_gemv once outside CUDA-graph capture first (warm-up)")
        buf = _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf


def _workspace_elems(m: int, n: int, k: int, configs: list[dict]) -> int:
    most = 0
    for c in configs:
        if c.get("SPLIT_K") is not None:
            split = c["SPLIT_K"]
        else:
            split = choose_split_k(n, k, c["BLOCK_N"], c["BLOCK_K"], c.get("CTAS_PER_SM", 2))
        if split > 1:
            bm = max(16, m_bucket(m)) if c.get("USE_DOT", True) else 1
            most = max(most, -(-n // c["BLOCK_N"]) * split * bm * c["BLOCK_N"])
    return most


BLOCKDOT_MAX_M = 1  # rows nvfp4_gemv gives the block-dot kernel by default: on the H200 M = 2 is mixed and at
#                     M = 4 it is 1.3-2.5x slower than the tensor-core path (lab/results/nvfp4_decode_compare_h200.csv)


def _rows(m: int) -> int:
    return 1 if m == 1 else (2 if m == 2 else 4)


def _blockdot(x, packed, scales, global_scale, bias, y, config, opts):
    n, k, m = packed.shape[0], packed.shape[1] * 2, x.shape[0]
    rows = _rows(m)
    q = packed.view(torch.int32)
    if config is not None:
        cfg = {"HALF": False, "PREFETCH": False, "CTAS_PER_SM": 2, "EVICT": "", **config}
        cfg.pop("BLOCKDOT", None)
        launch = {key: cfg.pop(key) for key in ("num_warps", "num_stages") if key in cfg}
        configs = [cfg]
    else:
        configs = [c.all_kwargs() for c in BLOCKDOT_CONFIGS]
    most = 0
    for c in configs:
        split = c.get("SPLIT_K") or choose_split_k(n, k, c["BLOCK_N"], c["BLOCK_K"], c.get("CTAS_PER_SM", 2))
        if split > 1:
            most = max(most, -(-n // c["BLOCK_N"]) * split * rows * c["BLOCK_N"])
    ws = torch.empty(max(most, 1), dtype=torch.float32, device=x.device)
    args = (x, q, scales.view(torch.uint8), global_scale, bias if bias is not None else y, y, ws,
            _counters(x.device), m, n, k, x.stride(0), x.stride(1), q.stride(0), scales.stride(0),
            y.stride(0), y.stride(1))

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])

    if config is not None:
        if "SPLIT_K" in cfg:
            cfg["EVEN_K"] = k % cfg["BLOCK_K"] == 0
            _nvfp4_gemv_blockdot_kernel.fn[grid](*args, HAS_BIAS=bias is not None, ROWS=rows, **opts, **cfg, **launch)
        else:
            _nvfp4_gemv_blockdot_kernel[grid](*args, HAS_BIAS=bias is not None, ROWS=rows, **opts, **cfg, **launch)
    else:
        _nvfp4_gemv_blockdot_tuned[grid](*args, HAS_BIAS=bias is not None, ROWS=rows, **opts)
    return y.to(x.dtype)


def _blockdot_ok(m: int, packed: torch.Tensor) -> bool:
    """The block-dot kernel reads ``packed`` as int32 words: rows 4-byte aligned."""
    return (m <= 4 and packed.stride(0) % 4 == 0 and packed.storage_offset() % 4 == 0
            and packed.data_ptr() % 4 == 0)


def nvfp4_gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
               global_scale: torch.Tensor, bias: torch.Tensor | None = None,
               config: dict | None = None, **options) -> torch.Tensor:
    """y = x @ W^T + bias for x [M, K] with M <= 64; ``config`` pins the tile config."""
    if not HAS_TRITON:
        raise ImportError("the NVFP4 Triton kernels need triton (pip install triton)")
    n, k = packed.shape[0], packed.shape[1] * 2
    check_nvfp4_operands(x, packed, scales, global_scale, k, "x")
    m = x.shape[0]
    if m > DECODE_MAX_M:
        raise ValueError(f"nvfp4_gemv takes at most {DECODE_MAX_M} rows; got {m} (use nvfp4_gemm)")
    opts = {**launch_options(x.device), **options}
    y = torch.empty((m, n), dtype=torch.float32 if opts["INTERPRET"] else x.dtype, device=x.device)
    if m == 0:
        return y.to(x.dtype)
    use_blockdot = config.get("BLOCKDOT", False) if config is not None else m <= BLOCKDOT_MAX_M
    if use_blockdot and _blockdot_ok(m, packed):
        if config is None and opts["INTERPRET"]:
            config = dict(BLOCK_N=16, BLOCK_K=64)
        return _blockdot(x, packed, scales, global_scale, bias, y, config, opts)
    if config is not None and config.get("BLOCKDOT"):
        raise ValueError(f"the block-dot kernel takes M <= 4 and 4-byte aligned packed rows; got M={m}")
    if config is None and opts["INTERPRET"]:
        config = dict(BLOCK_N=16, BLOCK_K=32, USE_DOT=m > 1)
    if config is not None:
        cfg = {"USE_DOT": True, "PREFETCH": False, "CTAS_PER_SM": 2, **config}
        cfg.pop("BLOCKDOT", None)
        launch = {key: cfg.pop(key) for key in ("num_warps", "num_stages") if key in cfg}
        if (not cfg["USE_DOT"] or cfg["PREFETCH"]) and m != 1:
            raise ValueError(f"USE_DOT=False / PREFETCH (the FMA path) take M == 1; got M={m}")
    ws_elems = _workspace_elems(m, n, k, [cfg] if config is not None else [c.all_kwargs() for c in GEMV_CONFIGS])
    ws = torch.empty(max(ws_elems, 1), dtype=torch.float32, device=x.device)
    args = (x, packed, scales.view(torch.uint8), global_scale,
            bias if bias is not None else y, y, ws, _counters(x.device), m, n, k, m_bucket(m),
            x.stride(0), x.stride(1), packed.stride(0), scales.stride(0), y.stride(0), y.stride(1))

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])

    if config is not None:
        kernel = _nvfp4_gemv_kernel if "SPLIT_K" not in cfg else _nvfp4_gemv_kernel.fn
        if "SPLIT_K" in cfg:  # pinned split: apply the other heuristics by hand
            cfg["EVEN_K"] = k % cfg["BLOCK_K"] == 0
            cfg["BLOCK_M"] = max(16, m_bucket(m)) if cfg["USE_DOT"] else 1
        kernel[grid](*args, HAS_BIAS=bias is not None, **opts, **cfg, **launch)
    else:
        _nvfp4_gemv_tuned[grid](*args, HAS_BIAS=bias is not None, **opts)
    return y.to(x.dtype)


nvfp4_gemv_op = register_linear_op("nvfp4_gemv", nvfp4_gemv)
