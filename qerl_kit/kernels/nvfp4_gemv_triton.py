"""NVFP4 x bf16 decode kernel (M = 1..64 rows): y = x @ W^T + bias, memory-bound.

In decode every weight byte is used by only M rows, so the kernel's job is to stream ``packed``
and ``scales`` at full memory bandwidth while spending as few instructions as possible per
weight. It is the GEMV-shaped sibling of ``nvfp4_gemm_triton`` (same layout and dequantization
helpers, see that module's docstring):

* Grid over N only: a program owns BLOCK_N output features for *all* M rows and walks the whole
  K. Small BLOCK_N (16..64) gives enough programs to cover every SM even for N ~ 3.5k without
  split-K, so there is no workspace, no second reduction launch, and the result is deterministic.
* Each step loads packed [BLOCK_N, BLOCK_K/2] bytes as 16-byte vectors along a row, a deep
  software pipeline (``num_stages``) keeps several tiles in flight per SM.
* M = 1 (``USE_DOT=False``): no tensor cores; the dequantized even/odd weights are multiplied
  with x's even/odd columns in float32 and reduced along K at the end (a pure GEMV).
* M = 2..64 (``USE_DOT=True``): the product is taken transposed, acc[BLOCK_N, BLOCK_M] =
  W @ x^T, so the weight fills the MMA's M side and the few rows of x sit in its narrow N side
  (BLOCK_M = 16, 32 or 64; rows past M are clamped on load and dropped on store).

The op is registered as ``torch.ops.qerl_kit.nvfp4_gemv``; the launcher does no host sync.
"""

from __future__ import annotations

import torch

from qerl_kit.kernels.nvfp4_gemm_triton import (HAS_TRITON, check_nvfp4_operands, launch_options,
                                                m_bucket)

DECODE_MAX_M = 64  # rows handled by this kernel; more go to the GEMM

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qerl_kit.kernels.nvfp4_gemm_triton import _quick_bench, dequant_nvfp4, mma, split_even_odd

    def even_k(args) -> bool:
        return args["K"] % args["BLOCK_K"] == 0

    @triton.heuristics({"EVEN_K": even_k})
    @triton.jit(do_not_specialize=["M", "M_BUCKET"])  # one binary for every row count
    def _nvfp4_gemv_kernel(
        # pointers
        x_ptr, p_ptr, s_ptr, gs_ptr, b_ptr, y_ptr,
        # sizes
        M, N, K, M_BUCKET,
        # strides
        stride_xm, stride_xk, stride_pn, stride_sn, stride_ym, stride_yn,
        # meta-parameters
        HAS_BIAS: tl.constexpr, FAST: tl.constexpr, NATIVE_FP8: tl.constexpr,
        INTERPRET: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """y[M, N] = x[M, K] @ W[N, K]^T (+ bias); program i owns columns [i*BN, (i+1)*BN)."""
        pid_n = tl.program_id(0)
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_m = tl.arange(0, BLOCK_M) % M
        offs_k = tl.arange(0, BLOCK_K)
        offs_j = tl.arange(0, BLOCK_K // 2)
        offs_g = tl.arange(0, BLOCK_K // 16)
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
        p_ptrs = p_ptr + offs_n[:, None] * stride_pn + offs_j[None, :]
        s_ptrs = s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :]
        gscale = tl.load(gs_ptr)

        if USE_DOT:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
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
            if USE_DOT:
                acc = mma(w_even, tl.trans(x_even), acc, INTERPRET)
                acc = mma(w_odd, tl.trans(x_odd), acc, INTERPRET)
            else:  # BLOCK_M == 1: broadcast the single row of x over BLOCK_N weight rows
                acc += w_even.to(tl.float32) * x_even.to(tl.float32)
                acc += w_odd.to(tl.float32) * x_odd.to(tl.float32)
            x_ptrs += BLOCK_K * stride_xk
            p_ptrs += BLOCK_K // 2
            s_ptrs += BLOCK_K // 16
        if USE_DOT:
            out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
        else:
            out = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]

        rows = tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            out += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))

    def _cfg(bn, bk, warps, stages, dot=True):
        return triton.Config(dict(BLOCK_N=bn, BLOCK_K=bk, USE_DOT=dot), num_warps=warps, num_stages=stages)

    GEMV_CONFIGS = [  # USE_DOT=False configs serve M == 1 only, USE_DOT=True ones M > 1
        _cfg(16, 512, 4, 4, dot=False),
        _cfg(32, 256, 4, 4, dot=False),
        _cfg(32, 512, 4, 3, dot=False),
        _cfg(16, 512, 4, 4),
        _cfg(32, 256, 4, 4),
        _cfg(64, 256, 4, 3),
    ]

    def _prune(configs, named_args, **kwargs):
        use_dot = named_args["M"] > 1
        return [c for c in configs if c.kwargs["USE_DOT"] == use_dot]

    _nvfp4_gemv_tuned = triton.autotune(GEMV_CONFIGS, key=["M_BUCKET", "N", "K"],
                                        prune_configs_by={"early_config_prune": _prune},
                                        do_bench=_quick_bench)(_nvfp4_gemv_kernel)


def _block_m(m: int) -> int:
    return 1 if m == 1 else max(16, m_bucket(m))


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
    args = (x, packed, scales if opts["NATIVE_FP8"] else scales.view(torch.uint8), global_scale,
            bias if bias is not None else y, y, m, n, k, m_bucket(m),
            x.stride(0), x.stride(1), packed.stride(0), scales.stride(0), y.stride(0), y.stride(1))
    block_m = _block_m(m)

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]),)

    if config is None and opts["INTERPRET"]:
        config = dict(BLOCK_N=16, BLOCK_K=32, USE_DOT=m > 1)
    if config is not None:
        cfg = dict(config)
        launch = {key: cfg.pop(key) for key in ("num_warps", "num_stages") if key in cfg}
        if cfg.get("USE_DOT", True) == (m == 1):
            raise ValueError(f"USE_DOT={cfg.get('USE_DOT', True)} does not fit M={m} (False iff M == 1)")
        _nvfp4_gemv_kernel[grid](*args, HAS_BIAS=bias is not None, BLOCK_M=block_m, **opts, **cfg, **launch)
    else:
        _nvfp4_gemv_tuned[grid](*args, HAS_BIAS=bias is not None, BLOCK_M=block_m, **opts)
    return y.to(x.dtype)


@torch.library.custom_op("qerl_kit::nvfp4_gemv", mutates_args=())
def nvfp4_gemv_op(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                  global_scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return nvfp4_gemv(x, packed, scales, global_scale, bias)


@nvfp4_gemv_op.register_fake
def _(x, packed, scales, global_scale, bias=None):
    return x.new_empty((x.shape[0], packed.shape[0]))
