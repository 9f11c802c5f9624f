"""NVFP4 x bf16 GEMM for prefill and training: y = x @ W^T + bias, W dequantized in registers.

Hopper has no FP4 tensor-core math, so this is a W4A16 kernel in the spirit of vLLM's Marlin FP4:
read 4.5 bits per weight, turn them into bf16 (or fp16) in registers, multiply on bf16 tensor
cores (``tl.dot``) with float32 accumulation. The reference is ``reference.nvfp4_linear_ref``.

Data layout (compressed-tensors ``nvfp4-pack-quantized``, see ``qerl_kit.nvfp4``)::

    x       [M, K]      bf16/fp16 activations (any strides)
    packed  [N, K/2]    uint8, byte j of row n = code(W[n, 2j]) | code(W[n, 2j+1]) << 4
    scales  [N, K/16]   float8_e4m3fn, one per 16 consecutive k of a row
    gscale  [1]         float32;  W[n, k] = e2m1(code) * scales[n, k // 16] / gscale
    y       [M, N]      x's dtype

Tiling. A program owns a BLOCK_M x BLOCK_N tile of y (grouped along M for L2 reuse) and walks K
in steps of BLOCK_K. Each step loads x [BLOCK_M, BLOCK_K], packed [BLOCK_N, BLOCK_K/2] (16-byte
vector loads along a row) and scales [BLOCK_N, BLOCK_K/16]. The nibbles are never interleaved:
the low nibbles are the even columns of W and the high nibbles the odd ones, so the kernel
splits x instead (a register-local reshape) and does two dots of depth BLOCK_K/2::

    acc += x[:, 0::2] @ W[:, 0::2]^T + x[:, 1::2] @ W[:, 1::2]^T

With ``SWAP_AB`` the product is computed transposed (acc^T = W @ x^T), which puts the
dequantized weight in the A slot of Hopper's wgmma, the one that may come from registers.

Dequantization (``dequant_nvfp4``), two interchangeable paths with identical inputs:

* FAST (GPU): inline PTX on 4 packed bytes at a time. ``prmt`` moves each byte into the high
  byte of a 16-bit lane; shifts and masks place the sign at bit 15 and the 3 magnitude bits at
  bf16 bits 6..8 (fp16: 9..11), which reads as e2m1's value times 2^-126 (fp16: 2^-14), exact
  also for the subnormal codes 0 and 0.5; one ``fma.rn.bf16x2`` by 2^126 restores the value
  and a second multiplies by the group's scale (rounded to bf16 first, so a weight can differ
  from the reference's float32 product by one bf16 ulp).
* Portable (the interpreter, and GPUs when FAST is off): integer ops build the float32 bits
  of the e2m1 value (no subnormals), times the float32 scale, rounded once: bit-identical to
  ``nvfp4.dequantize``.

Scales are loaded as raw bytes and decoded arithmetically (E4M3 bits shifted into an fp16, times
2^8; exact for every finite code, subnormals included), so no float8 support is needed from the
interpreter; ``NATIVE_FP8`` uses the hardware conversion instead.

The launcher checks, allocates the output with ``torch.empty`` on x's device and launches: no
host synchronisation, so it can be captured in a CUDA graph (after a warm-up call has run the
autotuner for that shape). The op is registered as ``torch.ops.qerl_kit.nvfp4_gemm``.
"""

from __future__ import annotations

import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qerl_kit.kernels.backend import interpreting, patch_interpreter_for_numpy24

    if interpreting():
        patch_interpreter_for_numpy24()

    # -- dequantization helpers (shared with the GEMV and dgrad kernels) ------------------------

    # 4 packed bytes in $4, their 4 group scales as bf16x2 in $5 (bytes 0,1) and $6 (bytes 2,3).
    # Out: even (low-nibble) weights of bytes 0,1 in $0 and 2,3 in $1; odd ones in $2, $3.
    _NIBBLES_TO_BF16 = """
    {
    .reg .b32 t, a, b, z, k, nz;
    mov.b32 z, 0;
    mov.b32 k, 0x7E807E80;
    mov.b32 nz, 0x80008000;
    prmt.b32 t, $4, z, 0x1404;
    shr.b32 a, t, 2; and.b32 a, a, 0x01C001C0; shl.b32 b, t, 4; and.b32 b, b, 0x80008000; or.b32 a, a, b;
    fma.rn.bf16x2 a, a, k, nz; fma.rn.bf16x2 $0, a, $5, nz;
    shr.b32 a, t, 6; and.b32 a, a, 0x01C001C0; and.b32 b, t, 0x80008000; or.b32 a, a, b;
    fma.rn.bf16x2 a, a, k, nz; fma.rn.bf16x2 $2, a, $5, nz;
    prmt.b32 t, $4, z, 0x3424;
    shr.b32 a, t, 2; and.b32 a, a, 0x01C001C0; shl.b32 b, t, 4; and.b32 b, b, 0x80008000; or.b32 a, a, b;
    fma.rn.bf16x2 a, a, k, nz; fma.rn.bf16x2 $1, a, $6, nz;
    shr.b32 a, t, 6; and.b32 a, a, 0x01C001C0; and.b32 b, t, 0x80008000; or.b32 a, a, b;
    fma.rn.bf16x2 a, a, k, nz; fma.rn.bf16x2 $3, a, $6, nz;
    }
    """
    # The same for fp16: magnitude bits to 9..11, exponent fix 2^14 (0x7400).
    _NIBBLES_TO_FP16 = (_NIBBLES_TO_BF16.replace("0x7E807E80", "0x74007400")
                        .replace("0x01C001C0", "0x0E000E00")
                        .replace("shr.b32 a, t, 2;", "shl.b32 a, t, 1;")
                        .replace("shr.b32 a, t, 6;", "shr.b32 a, t, 3;")
                        .replace("bf16x2", "f16x2"))

    @triton.jit
    def _e2m1_to_f32(c):
        """E2M1 codes (int32 0..15) -> float32 values, exact, without subnormals."""
        mag = c & 7
        bits = tl.where(mag == 0, 0, (mag + 252 - (mag == 1).to(tl.int32)) << 22)
        return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)

    @triton.jit
    def _e4m3_bits_to_f32(b):
        """float8_e4m3fn bit patterns (uint8) -> float32: the bits as an fp16, times 2^8."""
        h = b.to(tl.uint16)
        h = ((h & 0x7F) << 7) | ((h & 0x80) << 8)
        return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0

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
                      W_DTYPE: tl.constexpr, FAST: tl.constexpr, NATIVE_FP8: tl.constexpr,
                      INTERPRET: tl.constexpr):
        """packed [BN, BK/2] uint8 + scales [BN, BK/16] -> (W[:, 0::2], W[:, 1::2]) [BN, BK/2]
        in W_DTYPE (under INTERPRET: float32 holding W_DTYPE-rounded values)."""
        if NATIVE_FP8:
            sf = s.to(tl.float32)
        else:
            sf = _e4m3_bits_to_f32(s)
        eff = sf / gscale  # [BN, BK/16]
        eff = tl.reshape(tl.broadcast_to(eff[:, :, None], (BLOCK_N, BLOCK_K // 16, 8)),
                         (BLOCK_N, BLOCK_K // 2))
        if FAST:
            if W_DTYPE == tl.bfloat16:
                even, odd = tl.inline_asm_elementwise(
                    _NIBBLES_TO_BF16, "=r,=r,=r,=r,r,r,r", [p, eff.to(tl.bfloat16)],
                    dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            else:
                even, odd = tl.inline_asm_elementwise(
                    _NIBBLES_TO_FP16, "=r,=r,=r,=r,r,r,r", [p, eff.to(tl.float16)],
                    dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
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
        HAS_BIAS: tl.constexpr, FAST: tl.constexpr, NATIVE_FP8: tl.constexpr, INTERPRET: tl.constexpr,
        EVEN_K: tl.constexpr,
        SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]); one BLOCK_M x BLOCK_N tile per program."""
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
                                          FAST, NATIVE_FP8, INTERPRET)
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

        # ---- epilogue: bias, cast, masked store ----
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))

    # -- autotuning ---------------------------------------------------------------------------

    def _cfg(bm, bn, bk, warps, stages, swap=False, group_m=8):
        return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SWAP_AB=swap, GROUP_M=group_m),
                             num_warps=warps, num_stages=stages)

    GEMM_CONFIGS = [
        _cfg(128, 128, 64, 8, 4),
        _cfg(128, 256, 64, 8, 3),
        _cfg(128, 128, 128, 8, 3),
        _cfg(64, 128, 128, 4, 4),
    ]
    INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SWAP_AB=False, GROUP_M=4)

    def _quick_bench(fn, quantiles=None):
        return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)

    _nvfp4_gemm_tuned = triton.autotune(GEMM_CONFIGS, key=["M_BUCKET", "N", "K"],
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
    return dict(FAST=on_gpu, NATIVE_FP8=False, INTERPRET=not on_gpu)


def nvfp4_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
               global_scale: torch.Tensor, bias: torch.Tensor | None = None,
               config: dict | None = None, **options) -> torch.Tensor:
    """y = x @ W^T + bias for x [M, K]; ``config`` pins the tile config (else autotuned)."""
    if not HAS_TRITON:
        raise ImportError("the NVFP4 Triton kernels need triton (pip install triton)")
    n, k = packed.shape[0], packed.shape[1] * 2
    check_nvfp4_operands(x, packed, scales, global_scale, k, "x")
    m = x.shape[0]
    opts = {**launch_options(x.device), **options}
    y = torch.empty((m, n), dtype=torch.float32 if opts["INTERPRET"] else x.dtype, device=x.device)
    if m == 0:
        return y.to(x.dtype)
    args = (x, packed, scales.view(torch.uint8) if not opts["NATIVE_FP8"] else scales, global_scale,
            bias if bias is not None else y, y, m, n, k, m_bucket(m),
            x.stride(0), x.stride(1), packed.stride(0), scales.stride(0), y.stride(0), y.stride(1))

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    if config is None and interpreting():
        config = INTERPRETER_CONFIG
    if config is not None:
        cfg = dict(config)
        launch = {key: cfg.pop(key) for key in ("num_warps", "num_stages") if key in cfg}
        _nvfp4_gemm_kernel[grid](*args, HAS_BIAS=bias is not None, **opts, **cfg, **launch)
    else:
        _nvfp4_gemm_tuned[grid](*args, HAS_BIAS=bias is not None, **opts)
    return y.to(x.dtype)


# -- registration: torch.ops.qerl_kit.nvfp4_gemm (torch.compile / CUDA-graph friendly) ---------

@torch.library.custom_op("qerl_kit::nvfp4_gemm", mutates_args=())
def nvfp4_gemm_op(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                  global_scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return nvfp4_gemm(x, packed, scales, global_scale, bias)


@nvfp4_gemm_op.register_fake
def _(x, packed, scales, global_scale, bias=None):
    return x.new_empty((x.shape[0], packed.shape[0]))
