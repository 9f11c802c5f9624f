"""NVFP4 x bf16 block-dot decode kernel in Triton (M = 1..4 rows), without tensor cores.

It reads ``packed`` as int32 words (8 E2M1 codes each) and multiplies the raw codes, placed as
fp16 bits, with x; one scale multiply per 16 weights. Faster than the tensor-core and FMA paths of
``nvfp4_gemv_triton`` for one row (docs/kernels.md), which is why ``nvfp4_gemv`` sends M <=
``BLOCKDOT_MAX_M`` here by default (up to 4 with ``config=dict(BLOCKDOT=True, ...)``). Split-K and
its arrival counters are ``splitk``'s; layout and scale decoding ``nvfp4_gemm_triton``'s.
Tests: tests/test_kernels.py (``-k blockdot``; the PTX placement is checked exhaustively on the CPU).
"""

from __future__ import annotations

import torch

from qerl_kit.kernels.nvfp4_gemm_triton import HAS_TRITON
from qerl_kit.kernels.splitk import arrival_counters, choose_split_k

BLOCKDOT_MAX_M = 1  # rows nvfp4_gemv gives the block-dot kernel by default: on the H200 M = 2 is mixed and at
#                     M = 4 it is 1.3-2.5x slower than the tensor-core path (lab/results/nvfp4_decode_compare_h200.csv)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qerl_kit.kernels.nvfp4_gemm_triton import _e2m1_to_f32, _e4m3_bits_to_f32, _quick_bench
    from qerl_kit.kernels.splitk import even_k, k_slice, split_k
    from qerl_kit.kernels.tuning import autotune

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
        [i*BN, (i+1)*BN) and the s-th of SPLIT_K slices of K.

        Long because: one @triton.jit kernel is one GPU program; Triton has no list of tensors, so
        the up to four rows' pointers, prescales, accumulators and stores are written out once per
        row (ROWS is a constexpr: rows past it compile away), and a helper could not update the
        caller's accumulators, only return them. The per-row work is already in helpers (_bd_load,
        _row_step, _row_prescale, _blockdot_out); a separate reduction kernel is what the
        last-arriving slice replaces (one launch, no memset)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        k_start, k_end = k_slice(pid_k, K, BLOCK_K, SPLIT_K)

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

    def _bcfg(bn, bk, warps, half, prefetch=True, ctas=4, evict="evict_first"):
        return triton.Config(dict(BLOCK_N=bn, BLOCK_K=bk, HALF=half, PREFETCH=prefetch, CTAS_PER_SM=ctas,
                                  EVICT=evict), num_warps=warps, num_stages=1)

    # Block-dot kernel (M <= BLOCKDOT_MAX_M): 8 rows of 16-byte words per thread and more.
    BLOCKDOT_CONFIGS = [
        _bcfg(128, 256, 4, True), _bcfg(64, 512, 4, True), _bcfg(64, 256, 4, True),
        _bcfg(128, 256, 4, True, ctas=8), _bcfg(128, 256, 4, False), _bcfg(64, 256, 4, False),
    ]
    _nvfp4_gemv_blockdot_tuned = autotune("nvfp4_blockdot", BLOCKDOT_CONFIGS, key=["ROWS", "N", "K"],
                                          do_bench=_quick_bench)(_nvfp4_gemv_blockdot_kernel)


def _rows(m: int) -> int:
    """The kernel's ROWS (1, 2 or 4): one binary serves every M up to it."""
    return 1 if m == 1 else (2 if m == 2 else 4)


def nvfp4_gemv_blockdot(x, packed, scales, global_scale, bias, y, config, opts):
    """y = x @ W^T + bias into ``y`` for x [M <= 4, K] (``blockdot_ok``), called by ``nvfp4_gemv``
    after its operand checks; ``config`` pins the tile config (None: autotuned), ``opts`` are the
    device's launch options."""
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
            arrival_counters(x.device), m, n, k, x.stride(0), x.stride(1), q.stride(0), scales.stride(0),
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


def blockdot_ok(m: int, packed: torch.Tensor) -> bool:
    """The block-dot kernel reads ``packed`` as int32 words: rows 4-byte aligned."""
    return (m <= 4 and packed.stride(0) % 4 == 0 and packed.storage_offset() % 4 == 0
            and packed.data_ptr() % 4 == 0)
