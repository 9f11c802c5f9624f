"""NVFP4 x bf16 GEMM for prefill and training: y = x @ W^T + bias, W dequantized in registers.

Hopper has no FP4 tensor-core math, so this is W4A16 in the spirit of vLLM's Marlin FP4: read 4.5
bits per weight, turn them into bf16/fp16 in registers, multiply on tensor cores (``tl.dot``) with
float32 accumulation. Layout (compressed-tensors ``nvfp4-pack-quantized``, ``qerl_kit.nvfp4``)::

    x       [M, K]      bf16/fp16 activations (any strides)
    packed  [N, K/2]    uint8, byte j of row n = code(W[n, 2j]) | code(W[n, 2j+1]) << 4
    scales  [N, K/16]   float8_e4m3fn, one per 16 consecutive k of a row
    gscale  [1]         float32;  W[n, k] = e2m1(code) * scales[n, k // 16] / gscale
    y       [M, N]      x's dtype

Tiling: a program owns a BLOCK_M x BLOCK_N tile of y (grouped along M for L2 reuse) and walks K,
loading packed rows as 16-byte vectors. Low nibbles are W's even columns and high nibbles its odd
ones, so x is split instead (a register-local reshape): ``acc += x[:, 0::2] @ W[:, 0::2]^T +
x[:, 1::2] @ W[:, 1::2]^T``. ``SWAP_AB`` takes the product transposed, putting the dequantized
weight in wgmma's A slot (the one that may come from registers).

Dequantization (``dequant_nvfp4``, shared with the decode and dgrad kernels), two paths:

* FAST (GPU): inline PTX places sign and magnitude of each code into a bf16 (fp16) lane, which
  reads as e2m1 * 2^-126 (2^-14), exact for the subnormal codes too; ``fma.rn.bf16x2`` applies the
  scale (rounded to bf16 first: a weight may differ from the reference by one bf16 ulp).
* Portable (the interpreter, or ``FAST=False``): integer ops build the float32 e2m1 value, times
  the float32 scale, rounded once: bit-identical to ``nvfp4.dequantize``.

Scales are loaded as bytes and decoded arithmetically (exact, subnormals included), so the
interpreter needs no float8 support; the hardware fp8 conversion is no faster on the H200.
``nvfp4_dequantize`` writes the dense W for the "dense" strategy (then cuBLAS); inside a
``qerl_kit.dense_cache`` block that takes the weight (the training pass) that W is computed once
and reused by every later forward and input gradient of the block. Configs are autotuned per
(M bucket, N, K), the choice stored and reused (``tuning``); the launcher does no host sync
(CUDA-graph safe after a warm-up call). Registered as ``torch.ops.qerl_kit.nvfp4_gemm``;
qerl_kit/kernels/routes.py decides which calls reach the fused and dense paths. Reference:
``reference.nvfp4_linear_ref``; tests: tests/test_kernels.py.
"""

from __future__ import annotations

import importlib.util

import torch

from qerl_kit import dense_cache
from qerl_kit.kernels.backend import register_linear_op

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qerl_kit.kernels.backend import interpreting, patch_interpreter_for_numpy24
    from qerl_kit.kernels.tuning import autotune

    if interpreting():
        patch_interpreter_for_numpy24()

    # -- dequantization helpers (shared with the GEMV and dgrad kernels) ------------------------

    # 4 packed bytes in $4, their 4 group scales as bf16x2 in $5 (bytes 0,1) and $6 (bytes 2,3).
    # Out: even (low-nibble) weights of bytes 0,1 in $0 and 2,3 in $1; odd ones in $2, $3.
    # After prmt each 16-bit lane holds one byte in its high half: high nibble at bits 12..15,
    # low nibble at 8..11. Sign -> bit 15, magnitude -> bits 6..8 reads as e2m1 * 2^-126 (bf16,
    # exact, subnormal for codes 0 and 0.5); one multiply by scale * 2^94 leaves W * 2^-32
    # (the kernels multiply their float32 accumulators by 2^32 at the end).
    _BF16_ASM = """
    {
    .reg .b32 t, a, b, z, nz;
    mov.b32 z, 0;
    mov.b32 nz, 0x80008000;
    prmt.b32 t, $4, z, 0x1404;
    shr.b32 a, t, 2; and.b32 a, a, 0x01C001C0; shl.b32 b, t, 4; and.b32 b, b, 0x80008000; or.b32 a, a, b;
    fma.rn.bf16x2 $0, a, $5, nz;
    shr.b32 a, t, 6; and.b32 a, a, 0x01C001C0; and.b32 b, t, 0x80008000; or.b32 a, a, b;
    fma.rn.bf16x2 $2, a, $5, nz;
    prmt.b32 t, $4, z, 0x3424;
    shr.b32 a, t, 2; and.b32 a, a, 0x01C001C0; shl.b32 b, t, 4; and.b32 b, b, 0x80008000; or.b32 a, a, b;
    fma.rn.bf16x2 $1, a, $6, nz;
    shr.b32 a, t, 6; and.b32 a, a, 0x01C001C0; and.b32 b, t, 0x80008000; or.b32 a, a, b;
    fma.rn.bf16x2 $3, a, $6, nz;
    }
    """
    # fp16: magnitude -> bits 9..11 reads as e2m1 * 2^-14; fp16's range is too small to fold
    # 2^14 into the scale, so it takes two multiplies (by 2^14, exact, then by the scale).
    _FP16_ASM = (_BF16_ASM.replace("0x01C001C0", "0x0E000E00")
                 .replace("shr.b32 a, t, 2;", "shl.b32 a, t, 1;").replace("shr.b32 a, t, 6;", "shr.b32 a, t, 3;")
                 .replace("mov.b32 z, 0;", "mov.b32 z, 0;\n    mov.b32 k, 0x74007400;")
                 .replace(".reg .b32 t, a, b, z, nz;", ".reg .b32 t, a, b, z, nz, k;")
                 .replace("fma.rn.bf16x2 $", "fma.rn.f16x2 a, a, k, nz; fma.rn.f16x2 $"))
    _NIBBLES_TO_BF16 = tl.constexpr(_BF16_ASM)  # jit code reads globals only as constexpr
    _NIBBLES_TO_FP16 = tl.constexpr(_FP16_ASM)
    BF16_FOLD = tl.constexpr(2.0 ** 94)  # 2^126 (subnormal encoding) * 2^-32 (kept in the acc)
    BF16_ACC_FIX = tl.constexpr(2.0 ** 32)

    @triton.jit
    def _e2m1_to_f32(c):
        """E2M1 codes (int32 0..15) -> float32 values, exact, without subnormals."""
        mag = c & 7
        bits = tl.where(mag == 0, 0, (mag + 252 - (mag == 1).to(tl.int32)) << 22)
        return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)

    @triton.jit
    def _e4m3_bits_to_f32(b):
        """float8_e4m3fn bit patterns (uint8) -> float32 value * 2^-8 (the bits read as an fp16;
        exact for every finite code, subnormals included)."""
        h = b.to(tl.uint16)
        h = ((h & 0x7F) << 7) | ((h & 0x80) << 8)
        return h.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _round_f32_to(v, DTYPE: tl.constexpr):
        """Round float32 to the bf16/fp16 grid, kept in float32 (round to nearest even).
        The interpreter's own float32 -> bfloat16 cast truncates, so bf16 is done on the bits."""
        if DTYPE == tl.bfloat16:
            b = v.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            return b.to(tl.float32, bitcast=True)
        return v.to(DTYPE).to(tl.float32)

    @triton.jit
    def dequant_nvfp4(p, s, gscale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      W_DTYPE: tl.constexpr, FAST: tl.constexpr, INTERPRET: tl.constexpr):
        """packed [BN, BK/2] uint8 + scales [BN, BK/16] -> (W[:, 0::2], W[:, 1::2]) [BN, BK/2]
        in W_DTYPE, times ``acc_fix(W_DTYPE, FAST)``'s reciprocal (2^-32 on the FAST bf16 path,
        else 1); under INTERPRET float32 holding W_DTYPE-rounded values."""
        sf = _e4m3_bits_to_f32(s)  # scale * 2^-8
        raw = 256.0
        if FAST:
            if W_DTYPE == tl.bfloat16:
                eff = (sf * (BF16_FOLD * raw / gscale)).to(W_DTYPE)  # [BN, BK/16]
            else:
                eff = (sf * (raw / gscale)).to(W_DTYPE)
            eff = tl.reshape(tl.broadcast_to(eff[:, :, None], (BLOCK_N, BLOCK_K // 16, 8)),
                             (BLOCK_N, BLOCK_K // 2))
            if W_DTYPE == tl.bfloat16:
                even, odd = tl.inline_asm_elementwise(
                    _NIBBLES_TO_BF16, "=r,=r,=r,=r,r,r,r", [p, eff],
                    dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            else:
                even, odd = tl.inline_asm_elementwise(
                    _NIBBLES_TO_FP16, "=r,=r,=r,=r,r,r,r", [p, eff],
                    dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            eff = tl.div_rn(sf * raw, gscale)  # IEEE division: exactly the reference's scale / gs
            eff = tl.reshape(tl.broadcast_to(eff[:, :, None], (BLOCK_N, BLOCK_K // 16, 8)),
                             (BLOCK_N, BLOCK_K // 2))
            c = p.to(tl.int32)
            even = _e2m1_to_f32(c & 15) * eff
            odd = _e2m1_to_f32(c >> 4) * eff
            if INTERPRET:
                even = _round_f32_to(even, W_DTYPE)
                odd = _round_f32_to(odd, W_DTYPE)
            else:
                even = even.to(W_DTYPE)
                odd = odd.to(W_DTYPE)
        return even, odd

    @triton.jit
    def acc_fix(W_DTYPE: tl.constexpr, FAST: tl.constexpr):
        """What the float32 accumulator is multiplied by after the K loop (see dequant_nvfp4)."""
        if FAST and W_DTYPE == tl.bfloat16:
            return BF16_ACC_FIX
        return 1.0

    @triton.jit
    def mma(a, b, acc, INTERPRET: tl.constexpr):
        """acc + a @ b on tensor cores. The interpreter's dot reads bfloat16 as integers, so
        there both operands (already on the bf16/fp16 grid) are multiplied in float32."""
        if INTERPRET:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def split_even_odd(x, ROWS: tl.constexpr, COLS: tl.constexpr):
        """x [ROWS, COLS] -> (x[:, 0::2], x[:, 1::2]), a register-local reshape."""
        return tl.split(tl.reshape(x, (ROWS, COLS // 2, 2)))

    # -- the kernel ---------------------------------------------------------------------------

    def even_k(args) -> bool:
        return args["K"] % args["BLOCK_K"] == 0

    @triton.heuristics({"EVEN_K": even_k})
    @triton.jit(do_not_specialize=["M", "M_BUCKET"])  # one binary for every row count
    def _nvfp4_gemm_kernel(
        # pointers
        x_ptr, p_ptr, s_ptr, gs_ptr, b_ptr, y_ptr,
        # sizes
        M, N, K, M_BUCKET,
        # strides (packed and scales are row-major with unit column stride)
        stride_xm, stride_xk, stride_pn, stride_sn, stride_ym, stride_yn,
        # meta-parameters
        HAS_BIAS: tl.constexpr, FAST: tl.constexpr, INTERPRET: tl.constexpr,
        EVEN_K: tl.constexpr,
        SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]); one BLOCK_M x BLOCK_N tile per program.

        Long because: one @triton.jit kernel is one GPU program whose 13-line signature is its
        launch ABI; the tile order, the K loop and the epilogue share the offsets, pointers and the
        accumulator, which a helper could only take as arguments and hand back as a tuple (a Triton
        helper cannot update its caller's variables). The separable steps are already helpers
        (dequant_nvfp4, split_even_odd, mma, acc_fix); a second kernel would cost a launch and a
        round trip of the tile through memory."""
        # ---- tile ordering: GROUP_M row-tiles share the same weight columns in L2 ----
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        group = GROUP_M * num_pid_n
        first_m = (pid // group) * GROUP_M
        group_m = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % group_m
        pid_n = (pid % group) // group_m

        # ---- pointers; rows past M / N are clamped (loads stay in bounds, stores are masked) ----
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_k = tl.arange(0, BLOCK_K)
        offs_j = tl.arange(0, BLOCK_K // 2)
        offs_g = tl.arange(0, BLOCK_K // 16)
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
        p_ptrs = p_ptr + offs_n[:, None] * stride_pn + offs_j[None, :]
        s_ptrs = s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :]
        gscale = tl.load(gs_ptr)

        # ---- main loop over K ----
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs)
                p = tl.load(p_ptrs)
                s = tl.load(s_ptrs)
            else:
                x = tl.load(x_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
                p = tl.load(p_ptrs, mask=offs_j[None, :] < (K - k0) // 2, other=0)
                s = tl.load(s_ptrs, mask=offs_g[None, :] < (K - k0) // 16, other=0)
            w_even, w_odd = dequant_nvfp4(p, s, gscale, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty,
                                          FAST, INTERPRET)
            x_even, x_odd = split_even_odd(x, BLOCK_M, BLOCK_K)
            if SWAP_AB:
                acc = mma(w_even, tl.trans(x_even), acc, INTERPRET)
                acc = mma(w_odd, tl.trans(x_odd), acc, INTERPRET)
            else:
                acc = mma(x_even, tl.trans(w_even), acc, INTERPRET)
                acc = mma(x_odd, tl.trans(w_odd), acc, INTERPRET)
            x_ptrs += BLOCK_K * stride_xk
            p_ptrs += BLOCK_K // 2
            s_ptrs += BLOCK_K // 16
        if SWAP_AB:
            acc = tl.trans(acc)
        acc = acc * acc_fix(x_ptr.dtype.element_ty, FAST)

        # ---- epilogue: bias, cast, masked store ----
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))

    # -- dense dequantization (the large-M strategy: transient bf16 W, then cuBLAS) -----------

    @triton.jit
    def _nvfp4_dequant_kernel(p_ptr, s_ptr, gs_ptr, w_ptr, N, K, stride_pn, stride_sn, stride_wn,
                              W_DTYPE: tl.constexpr, FAST: tl.constexpr, INTERPRET: tl.constexpr,
                              EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """W[N, K] = dequantize(packed, scales, gscale), one BLOCK_N x BLOCK_K tile per program."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_j = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        offs_g = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        rows = offs_n[:, None] < N
        if EVEN_K:  # row masks only: 16-byte vectors along K
            p = tl.load(p_ptr + offs_n[:, None] * stride_pn + offs_j[None, :], mask=rows, other=0)
            s = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :], mask=rows, other=0)
        else:
            p = tl.load(p_ptr + offs_n[:, None] * stride_pn + offs_j[None, :],
                        mask=rows & (offs_j[None, :] < K // 2), other=0)
            s = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :],
                        mask=rows & (offs_g[None, :] < K // 16), other=0)
        # (under INTERPRET w_ptr is float32 and receives values on the W_DTYPE grid)
        even, odd = dequant_nvfp4(p, s, tl.load(gs_ptr), BLOCK_N, BLOCK_K, W_DTYPE, FAST, INTERPRET)
        fix = acc_fix(W_DTYPE, FAST)  # exact power of two
        w = tl.reshape(tl.join(even.to(tl.float32) * fix, odd.to(tl.float32) * fix), (BLOCK_N, BLOCK_K))
        if EVEN_K:
            tl.store(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], w.to(w_ptr.dtype.element_ty),
                     mask=rows)
        else:
            tl.store(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], w.to(w_ptr.dtype.element_ty),
                     mask=rows & (offs_k[None, :] < K))

    # -- autotuning ---------------------------------------------------------------------------

    def _cfg(bm, bn, bk, warps, stages, swap=False, group_m=8):
        return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SWAP_AB=swap, GROUP_M=group_m),
                             num_warps=warps, num_stages=stages)

    # From the H200 sweep (python -m bench.bench_nvfp4_gemm --sweep; docs/kernels.md): BLOCK_M=256 (the
    # dequantized tile feeds 256 rows) is fastest for M >= 2048, 128x128x128 / 64x128x128 for M ~ 256;
    # the transposed (SWAP_AB) tiles are 12-18% slower, so none is listed.
    GEMM_CONFIGS = [
        _cfg(256, 128, 64, 8, 3),
        _cfg(128, 256, 64, 8, 3),
        _cfg(128, 128, 128, 8, 3),
        _cfg(64, 128, 128, 4, 4),
    ]
    INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SWAP_AB=False, GROUP_M=4)

    def _quick_bench(fn, quantiles=None):
        return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)

    _LARGE_M = {(256, 128, 64), (128, 256, 64), (128, 128, 128)}  # tiles autotuned for M > 512
    _SMALL_M = {(128, 128, 128), (64, 128, 128)}

    def _prune(configs, named_args, **kwargs):
        tiles = _LARGE_M if named_args["M"] > 512 else _SMALL_M
        return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) in tiles]

    _nvfp4_gemm_tuned = autotune("nvfp4_gemm", GEMM_CONFIGS, key=["M_BUCKET", "N", "K"], prune=_prune,
                                 do_bench=_quick_bench)(_nvfp4_gemm_kernel)


def m_bucket(m: int) -> int:
    """Autotuning key for the row count: the next power of two (so tuning runs once per bucket)."""
    return 1 << max(0, (m - 1).bit_length())


def check_nvfp4_operands(a: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                         global_scale: torch.Tensor, a_cols: int, what: str) -> None:
    if a.dim() != 2 or a.shape[1] != a_cols:
        raise ValueError(f"{what} must be 2-D with {a_cols} columns; got {tuple(a.shape)}")
    if a.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{what} must be bfloat16 or float16; got {a.dtype}")
    n, k2 = packed.shape
    if packed.dtype != torch.uint8 or scales.shape != (n, 2 * k2 // 16) or (2 * k2) % 16:
        raise ValueError(f"bad NVFP4 weight: packed {tuple(packed.shape)} {packed.dtype}, "
                         f"scales {tuple(scales.shape)}")
    if packed.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError("packed and scales need unit stride along K")
    if global_scale.numel() != 1 or global_scale.dtype != torch.float32:
        raise ValueError("global_scale must be a float32 tensor with one element")
    devices = {t.device for t in (a, packed, scales, global_scale)}
    if len(devices) != 1:
        raise ValueError(f"all operands must be on one device; got {sorted(map(str, devices))}")


def launch_options(device: torch.device) -> dict:
    """FAST (inline PTX) only on a real GPU. On the CPU (the interpreter) the kernels take the
    portable path and keep products and the output in float32 (INTERPRET): the interpreter's
    bf16 dot and casts are not exact, and the launcher rounds the output with torch."""
    on_gpu = device.type == "cuda"
    return dict(FAST=on_gpu, INTERPRET=not on_gpu)


def nvfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
                     **options) -> torch.Tensor:
    """Dense W [N, K] in ``dtype`` (bf16/fp16) from the packed weight, one fused pass; ``out``
    ([N, K] of ``dtype`` on the weight's device, unit stride along K) is written instead of a new
    tensor."""
    if not HAS_TRITON:
        raise ImportError("the NVFP4 Triton kernels need triton (pip install triton)")
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"nvfp4_dequantize writes bfloat16 or float16; got {dtype}")
    n, k = packed.shape[0], packed.shape[1] * 2
    opts = {**launch_options(packed.device), **options}
    if out is not None and (out.shape != (n, k) or out.dtype != dtype or out.stride(1) != 1
                            or out.device != packed.device):
        raise ValueError(f"nvfp4_dequantize: out must be a [{n}, {k}] {dtype} tensor on {packed.device} with "
                         f"unit stride along K; got {tuple(out.shape)} {out.dtype} on {out.device}")
    if out is not None and not opts["INTERPRET"]:
        w = out
    else:  # the interpreter's path computes in float32 and rounds once at the end
        w = torch.empty((n, k), dtype=torch.float32 if opts["INTERPRET"] else dtype, device=packed.device)
    bn, bk = (16, 32) if opts["INTERPRET"] else (32, 256)
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _nvfp4_dequant_kernel[grid](packed, scales.view(torch.uint8), global_scale, w, n, k,
                                packed.stride(0), scales.stride(0), w.stride(0),
                                W_DTYPE=tl.bfloat16 if dtype == torch.bfloat16 else tl.float16,
                                EVEN_K=k % bk == 0, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, **opts)
    if out is not None and w is not out:
        return out.copy_(w)
    return w.to(dtype)


# From this many rows on, a dense pass (``nvfp4_dequantize`` into a transient bf16 W, freed after
# the call unless a dense-weight cache block holds it) followed by cuBLAS beats the fused tiled
# kernels on the H200 (see docs/kernels.md).
DENSE_MIN_M = 128


# The dense pass on wide layers (N >= DENSE_CHUNK_MIN_N) from DENSE_CHUNK_MIN_M rows on goes
# DENSE_CHUNK_N weight rows at a time through one reused buffer: at 2048 rows 1-12% faster in
# same-run A/Bs on the H200 for 7B/32B/72B gate_up (lab/results/dense_chunks_h200.md), as fast
# at 8192, slower at 256; and the transient weight is 4096 x K instead of N x K (67 MB instead of
# 969 MB on 72B gate_up).
DENSE_CHUNK_N = 4096
DENSE_CHUNK_MIN_N = 32768
DENSE_CHUNK_MIN_M = 2048


def default_strategy(x: torch.Tensor, m: int) -> str:
    return "dense" if x.is_cuda and m >= DENSE_MIN_M else "fused"


def dense_chunk_rows(m: int, n: int) -> int | None:
    """Weight rows per dequantize-then-matmul piece of the dense strategy (None: all at once)."""
    return DENSE_CHUNK_N if n >= DENSE_CHUNK_MIN_N and m >= DENSE_CHUNK_MIN_M and n > DENSE_CHUNK_N else None


def nvfp4_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
               global_scale: torch.Tensor, bias: torch.Tensor | None = None,
               config: dict | None = None, strategy: str | None = None, **options) -> torch.Tensor:
    """y = x @ W^T + bias for x [M, K].

    ``strategy``: "fused" (this kernel; ``config`` pins its tiles, else autotuned), "dense"
    (``nvfp4_dequantize`` into a transient bf16 W, freed after the call, then cuBLAS), or None:
    "dense" on CUDA from ``DENSE_MIN_M`` rows on, else "fused" (a pinned ``config`` means fused).
    """
    if not HAS_TRITON:
        raise ImportError("the NVFP4 Triton kernels need triton (pip install triton)")
    k = packed.shape[1] * 2
    check_nvfp4_operands(x, packed, scales, global_scale, k, "x")
    m = x.shape[0]
    if strategy is None:
        strategy = "fused" if config is not None or options else default_strategy(x, m)
    if strategy == "dense":
        return _dense_gemm(x, packed, scales, global_scale, bias)
    if strategy != "fused":
        raise ValueError(f"strategy must be 'fused', 'dense' or None; got {strategy!r}")
    return _fused_gemm(x, packed, scales, global_scale, bias, config, **options)


def cached_dense_weight(packed, scales, global_scale, dtype) -> torch.Tensor | None:
    """The whole dense W from ``nvfp4_dequantize``, held by an open ``qerl_kit.dense_cache`` block that
    takes it (computed on its first call), else None. The forward and the input gradient share it."""
    return dense_cache.cached_or_none((packed, scales, global_scale), dtype,
                                      lambda: nvfp4_dequantize(packed, scales, global_scale, dtype),
                                      shape=(packed.shape[0], packed.shape[1] * 2), tag="nvfp4-triton")


def _dense_gemm(x, packed, scales, global_scale, bias):
    (m, k), n = x.shape, packed.shape[0]
    rows = dense_chunk_rows(m, n)
    whole = cached_dense_weight(packed, scales, global_scale, x.dtype)
    if rows is None:
        w = whole if whole is not None else nvfp4_dequantize(packed, scales, global_scale, x.dtype)
        return torch.nn.functional.linear(x, w, bias)
    # In pieces of weight rows as without the cache (the same matmul shapes, so the same results):
    # slices of the cached W, else each piece dequantized into one reused buffer.
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    buf = torch.empty((rows, k), dtype=x.dtype, device=x.device) if whole is None else None
    for n0 in range(0, n, rows):  # one stream: the next dequantization waits for this matmul
        n1 = min(n, n0 + rows)
        w = whole[n0:n1] if whole is not None else \
            nvfp4_dequantize(packed[n0:n1], scales[n0:n1], global_scale, x.dtype, out=buf[:n1 - n0])
        if bias is None:
            torch.mm(x, w.t(), out=y[:, n0:n1])
        else:
            torch.addmm(bias[n0:n1], x, w.t(), out=y[:, n0:n1])
    return y


def _fused_gemm(x, packed, scales, global_scale, bias, config, **options):
    n, k, m = packed.shape[0], packed.shape[1] * 2, x.shape[0]
    opts = {**launch_options(x.device), **options}
    y = torch.empty((m, n), dtype=torch.float32 if opts["INTERPRET"] else x.dtype, device=x.device)
    if m == 0:
        return y.to(x.dtype)
    args = (x, packed, scales.view(torch.uint8), global_scale,
            bias if bias is not None else y, y, m, n, k, m_bucket(m),
            x.stride(0), x.stride(1), packed.stride(0), scales.stride(0), y.stride(0), y.stride(1))

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    if config is None and opts["INTERPRET"]:
        config = INTERPRETER_CONFIG
    if config is not None:
        cfg = dict(config)
        launch = {key: cfg.pop(key) for key in ("num_warps", "num_stages") if key in cfg}
        _nvfp4_gemm_kernel[grid](*args, HAS_BIAS=bias is not None, **opts, **cfg, **launch)
    else:
        _nvfp4_gemm_tuned[grid](*args, HAS_BIAS=bias is not None, **opts)
    return y.to(x.dtype)


# -- registration: torch.ops.qerl_kit.nvfp4_gemm (torch.compile / CUDA-graph friendly) ---------

nvfp4_gemm_op = register_linear_op("nvfp4_gemm", nvfp4_gemm)
