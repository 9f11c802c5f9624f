"""NVFP4 x bf16 decode kernels in Triton (M = 1..64 rows): y = x @ W^T + bias, memory-bound.

In decode every weight byte serves only M rows, so the job is to stream ``packed`` and ``scales``
at full memory bandwidth with few instructions per weight. Layout and dequantization helpers are
``nvfp4_gemm_triton``'s (see its docstring).

* Grid over N times a split of K: a program owns BLOCK_N output features for all M rows and one
  slice of K. Slices write float32 partial tiles; the last to arrive (an int32 counter per N tile,
  reset by it) sums them in slice order (deterministic) and writes y: one launch, no memset
  (the split and the counters: ``splitk``).
* ``packed`` tiles [BLOCK_N, BLOCK_K/2] are loaded as 16-byte vectors along a row; a software
  pipeline (``num_stages``, or ``PREFETCH``) keeps the next tile's loads in flight.
* M = 1, ``USE_DOT=False``: no tensor cores; the dequantized even/odd weights times x's even/odd
  columns in float32 FMAs, reduced along K at the end.
* M = 2..64, ``USE_DOT=True``: the product is taken transposed, acc[BLOCK_N, BLOCK_M] = W @ x^T,
  so the weight fills the MMA's M side and the few rows of x its narrow N side (BLOCK_M = 16, 32
  or 64; rows past M are clamped on load and dropped on store).
* M <= ``BLOCKDOT_MAX_M`` by default (up to 4 with ``config=dict(BLOCKDOT=True, ...)``):
  ``nvfp4_gemv`` hands the call to the block-dot kernel (``nvfp4_blockdot_triton``), which
  multiplies the raw E2M1 codes with x and is faster than both paths above for one row.

Configs are autotuned per (M bucket, N, K), the choice stored and reused (``tuning``); the
launcher does no host sync, so a warmed-up call can be captured in a CUDA graph. Registered
as ``torch.ops.qerl_kit.nvfp4_gemv``; qerl_kit/kernels/routes.py decides which calls reach it.
Tests: tests/test_kernels.py (Triton's interpreter on the CPU; real shapes and CUDA graphs on a GPU).
"""

from __future__ import annotations

import torch

from qerl_kit.kernels.backend import register_linear_op
from qerl_kit.kernels.nvfp4_blockdot_triton import BLOCKDOT_MAX_M, blockdot_ok, nvfp4_gemv_blockdot
from qerl_kit.kernels.nvfp4_gemm_triton import (HAS_TRITON, check_nvfp4_operands, launch_options,
                                                m_bucket)
from qerl_kit.kernels.splitk import arrival_counters, choose_split_k

DECODE_MAX_M = 64  # the most rows nvfp4_gemv takes (nvfp4_gemm takes any number)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qerl_kit.kernels.nvfp4_gemm_triton import _quick_bench, acc_fix, dequant_nvfp4, mma, split_even_odd
    from qerl_kit.kernels.splitk import even_k, k_slice, split_k
    from qerl_kit.kernels.tuning import autotune

    def block_m(args) -> int:
        """Launch heuristic: the MMA's narrow side (16, 32 or 64 rows), 1 on the FMA path."""
        return max(16, args["M_BUCKET"]) if args["USE_DOT"] else 1

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
        and the s-th of SPLIT_K slices of K.

        Long because: one @triton.jit kernel is one GPU program whose 14-line signature is its
        launch ABI; the prefetching and plain K loops and the split-K epilogue share the offsets,
        pointers and accumulator, which a helper could only take as arguments and hand back as a
        tuple (a Triton helper cannot update its caller's variables). The separable steps are
        already helpers (k_slice, _load_next, _fma_step, dequant_nvfp4, mma); a separate reduction
        kernel is what the last-arriving slice replaces (one launch, no memset)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        k_start, k_end = k_slice(pid_k, K, BLOCK_K, SPLIT_K)

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

    _nvfp4_gemv_tuned = autotune("nvfp4_gemv", GEMV_CONFIGS, key=["M_BUCKET", "N", "K"], prune=_prune,
                                 do_bench=_quick_bench)(_nvfp4_gemv_kernel)


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
    if use_blockdot and blockdot_ok(m, packed):
        if config is None and opts["INTERPRET"]:
            config = dict(BLOCK_N=16, BLOCK_K=64)
        return nvfp4_gemv_blockdot(x, packed, scales, global_scale, bias, y, config, opts)
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
            bias if bias is not None else y, y, ws, arrival_counters(x.device), m, n, k, m_bucket(m),
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
