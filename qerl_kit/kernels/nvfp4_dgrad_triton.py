"""NVFP4 input gradient: dx = dy @ W from the packed weight (the fused kernel: no bf16 copy of W).

LoRA training keeps the base frozen, so the base layer's backward needs only the input gradient
dx [M, K] = dy [M, N] @ W [N, K]. The reduction runs over N (W's rows) and the output columns
are W's columns, so the packed layout is read "the other way" from the forward. The layout and
dequantization helpers are ``nvfp4_gemm_triton``'s; the reference is
``reference.nvfp4_dgrad_ref``.

Tiling. A program owns dx[BLOCK_M rows, BLOCK_K columns] (grouped along M for L2 reuse of the
weight tile) and walks N in steps of BLOCK_N. Each step loads dy [BLOCK_M, BLOCK_N], packed
[BLOCK_N, BLOCK_K/2] (16-byte vectors along a weight row) and scales [BLOCK_N, BLOCK_K/16], and
dequantizes into the even and odd columns of W, which give the even and odd columns of dx::

    dx[:, 0::2] += dy @ W[:, 0::2]        dx[:, 1::2] += dy @ W[:, 1::2]

The two accumulators are interleaved once, in registers, before the store. With ``SWAP_AB`` the
products are taken transposed (dx^T = W^T @ dy^T), which puts the weight in wgmma's A slot.
Configs are autotuned per (M bucket, N, K), the choice stored and reused (``tuning``); the
launcher does no host sync. Registered as ``torch.ops.qerl_kit.nvfp4_dgrad``;
qerl_kit/kernels/routes.py decides which calls reach the fused and dense paths; the dense path reads
the W an open ``qerl_kit.dense_cache`` block holds (``nvfp4_gemm_triton.cached_dense_weight``).
Tests: tests/test_kernels.py.
"""

from __future__ import annotations

import torch

from qerl_kit.kernels.nvfp4_gemm_triton import (HAS_TRITON, check_nvfp4_operands, default_strategy,
                                                cached_dense_weight, launch_options, m_bucket, nvfp4_dequantize)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qerl_kit.kernels.nvfp4_gemm_triton import _quick_bench, acc_fix, dequant_nvfp4, mma
    from qerl_kit.kernels.tuning import autotune

    def even_n(args) -> bool:
        return args["N"] % args["BLOCK_N"] == 0

    @triton.heuristics({"EVEN_N": even_n})
    @triton.jit(do_not_specialize=["M", "M_BUCKET"])  # one binary for every row count
    def _nvfp4_dgrad_kernel(
        # pointers
        dy_ptr, p_ptr, s_ptr, gs_ptr, dx_ptr,
        # sizes
        M, N, K, M_BUCKET,
        # strides
        stride_dym, stride_dyn, stride_pn, stride_sn, stride_dxm, stride_dxk,
        # meta-parameters
        FAST: tl.constexpr, INTERPRET: tl.constexpr,
        EVEN_N: tl.constexpr, SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """dx[M, K] = dy[M, N] @ W[N, K]; one BLOCK_M x BLOCK_K tile of dx per program.

        Long because: one @triton.jit kernel is one GPU program whose 12-line signature is its
        launch ABI; the tile order, the N loop and the column interleave share the offsets, pointers
        and two accumulators, which a helper could only take as arguments and hand back as a tuple
        (a Triton helper cannot update its caller's variables). The separable steps are already
        helpers (dequant_nvfp4, mma, acc_fix)."""
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_k = tl.cdiv(K, BLOCK_K)
        group = GROUP_M * num_pid_k
        first_m = (pid // group) * GROUP_M
        group_m = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % group_m
        pid_k = (pid % group) // group_m

        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        offs_n = tl.arange(0, BLOCK_N)
        # packed columns / scale groups of this dx tile, clamped to K (stores are masked)
        offs_j = (pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)) % (K // 2)
        offs_g = (pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)) % (K // 16)
        dy_ptrs = dy_ptr + offs_m[:, None] * stride_dym + offs_n[None, :] * stride_dyn
        p_ptrs = p_ptr + offs_n[:, None] * stride_pn + offs_j[None, :]
        s_ptrs = s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :]
        gscale = tl.load(gs_ptr)

        if SWAP_AB:
            acc_even = tl.zeros((BLOCK_K // 2, BLOCK_M), dtype=tl.float32)
            acc_odd = tl.zeros((BLOCK_K // 2, BLOCK_M), dtype=tl.float32)
        else:
            acc_even = tl.zeros((BLOCK_M, BLOCK_K // 2), dtype=tl.float32)
            acc_odd = tl.zeros((BLOCK_M, BLOCK_K // 2), dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            if EVEN_N:
                dy = tl.load(dy_ptrs)
                p = tl.load(p_ptrs)
                s = tl.load(s_ptrs)
            else:  # rows of W past N read as zero codes, columns of dy as zero
                dy = tl.load(dy_ptrs, mask=offs_n[None, :] < N - n0, other=0.0)
                p = tl.load(p_ptrs, mask=offs_n[:, None] < N - n0, other=0)
                s = tl.load(s_ptrs, mask=offs_n[:, None] < N - n0, other=0)
            w_even, w_odd = dequant_nvfp4(p, s, gscale, BLOCK_N, BLOCK_K, dy_ptr.dtype.element_ty,
                                          FAST, INTERPRET)
            if SWAP_AB:
                dy_t = tl.trans(dy)
                acc_even = mma(tl.trans(w_even), dy_t, acc_even, INTERPRET)
                acc_odd = mma(tl.trans(w_odd), dy_t, acc_odd, INTERPRET)
            else:
                acc_even = mma(dy, w_even, acc_even, INTERPRET)
                acc_odd = mma(dy, w_odd, acc_odd, INTERPRET)
            dy_ptrs += BLOCK_N * stride_dyn
            p_ptrs += BLOCK_N * stride_pn
            s_ptrs += BLOCK_N * stride_sn
        if SWAP_AB:
            acc_even = tl.trans(acc_even)
            acc_odd = tl.trans(acc_odd)
        acc = tl.reshape(tl.join(acc_even, acc_odd), (BLOCK_M, BLOCK_K))  # interleave columns
        acc = acc * acc_fix(dy_ptr.dtype.element_ty, FAST)

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        dx_ptrs = dx_ptr + rows[:, None] * stride_dxm + cols[None, :] * stride_dxk
        tl.store(dx_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < K))

    def _cfg(bm, bn, bk, warps, stages, swap=False, group_m=8):
        return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SWAP_AB=swap, GROUP_M=group_m),
                             num_warps=warps, num_stages=stages)

    # From the H200 sweep (docs/kernels.md): 128x64x128 (4 stages) and 256x64x128 are fastest;
    # SWAP_AB and BLOCK_N=128 are slower.
    DGRAD_CONFIGS = [
        _cfg(128, 64, 128, 8, 4),
        _cfg(256, 64, 128, 8, 3),
        _cfg(64, 64, 128, 4, 4),
    ]
    INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SWAP_AB=False, GROUP_M=4)

    def _prune(configs, named_args, **kwargs):
        skip = 64 if named_args["M"] > 512 else 256  # BLOCK_M
        return [c for c in configs if c.kwargs["BLOCK_M"] != skip]

    _nvfp4_dgrad_tuned = autotune("nvfp4_dgrad", DGRAD_CONFIGS, key=["M_BUCKET", "N", "K"], prune=_prune,
                                  do_bench=_quick_bench)(_nvfp4_dgrad_kernel)


def nvfp4_dgrad(dy: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                global_scale: torch.Tensor, config: dict | None = None, strategy: str | None = None,
                **options) -> torch.Tensor:
    """dx = dy @ W for dy [M, N]. ``strategy`` as in ``nvfp4_gemm``: "fused" (this kernel,
    ``config`` pins its tiles), "dense" (transient bf16 W + cuBLAS) or None (dense on CUDA from
    ``DENSE_MIN_M`` rows on, else fused)."""
    if not HAS_TRITON:
        raise ImportError("the NVFP4 Triton kernels need triton (pip install triton)")
    n = packed.shape[0]
    check_nvfp4_operands(dy, packed, scales, global_scale, n, "dy")
    m = dy.shape[0]
    if strategy is None:
        strategy = "fused" if config is not None or options else default_strategy(dy, m)
    if strategy == "dense":
        return _dense_dgrad(dy, packed, scales, global_scale)
    if strategy != "fused":
        raise ValueError(f"strategy must be 'fused', 'dense' or None; got {strategy!r}")
    return _fused_dgrad(dy, packed, scales, global_scale, config, **options)


def _dense_dgrad(dy, packed, scales, global_scale):
    w = cached_dense_weight(packed, scales, global_scale, dy.dtype)  # the forward's, inside a cache block
    return dy @ (w if w is not None else nvfp4_dequantize(packed, scales, global_scale, dy.dtype))


def _fused_dgrad(dy, packed, scales, global_scale, config, **options):
    n, k, m = packed.shape[0], packed.shape[1] * 2, dy.shape[0]
    opts = {**launch_options(dy.device), **options}
    dx = torch.empty((m, k), dtype=torch.float32 if opts["INTERPRET"] else dy.dtype, device=dy.device)
    if m == 0:
        return dx.to(dy.dtype)
    args = (dy, packed, scales.view(torch.uint8), global_scale, dx,
            m, n, k, m_bucket(m), dy.stride(0), dy.stride(1), packed.stride(0), scales.stride(0),
            dx.stride(0), dx.stride(1))

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(k, meta["BLOCK_K"]),)

    if config is None and opts["INTERPRET"]:
        config = INTERPRETER_CONFIG
    if config is not None:
        cfg = dict(config)
        launch = {key: cfg.pop(key) for key in ("num_warps", "num_stages") if key in cfg}
        _nvfp4_dgrad_kernel[grid](*args, **opts, **cfg, **launch)
    else:
        _nvfp4_dgrad_tuned[grid](*args, **opts)
    return dx.to(dy.dtype)


@torch.library.custom_op("qerl_kit::nvfp4_dgrad", mutates_args=())
def nvfp4_dgrad_op(dy: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                   global_scale: torch.Tensor) -> torch.Tensor:
    return nvfp4_dgrad(dy, packed, scales, global_scale)


@nvfp4_dgrad_op.register_fake
def _(dy, packed, scales, global_scale):
    return dy.new_empty((dy.shape[0], packed.shape[1] * 2))
