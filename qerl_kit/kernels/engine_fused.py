"""Small fused kernels for one decode step, each with its plain-PyTorch reference.

A decode step at small batch is bound by the number of kernels as much as by bytes: a Hugging
Face layer launches ~100 (RMSNorm alone is six, RoPE a dozen). These three Triton kernels
replace the elementwise chains; the matmuls stay NVFP4 kernels / cuBLAS:

* ``add_rmsnorm(x, residual, weight, eps)``: ``h = residual + x`` (rounded to x's dtype, as the
  model's residual add is) and ``RMSNorm(h)`` with the exact operation order of transformers'
  Qwen2/Llama RMSNorm (float32 statistics, normalised value rounded to the input dtype, then
  times the weight); returns (normed, h). ``residual=None`` is a plain RMSNorm.
* ``rope_to_cache(q, k, v, cos, sin, k_cache, v_cache, slot, offset)``: rotary embedding of one
  token's q and k per row (rotate-half convention), k and v written straight into cache column
  ``slot - offset`` (``slot`` a device tensor); returns the rotated q, contiguous.
* ``silu_mul(gate_up)``: ``silu(gate) * up`` for gate/up concatenated along the last dimension.

``fused_available(x)`` says whether the Triton versions run for ``x`` (CUDA, or the CPU under
``TRITON_INTERPRET=1``); otherwise the references run, which is what the engine does on the CPU.
Tests: tests/test_engine_fused.py (each kernel against its reference, and whole fused steps).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import Tensor

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qerl_kit.kernels.backend import interpreting, patch_interpreter_for_numpy24

    if interpreting():
        patch_interpreter_for_numpy24()

    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, h_ptr, N, stride_x, stride_r, stride_o, stride_h, eps,
                            HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
        if HAS_RES:
            h = (x.to(tl.float32) + tl.load(r_ptr + row * stride_r + cols, mask=m, other=0.0).to(tl.float32))
            h = h.to(x.dtype)
            tl.store(h_ptr + row * stride_h + cols, h, mask=m)
        else:
            h = x
        hf = h.to(tl.float32)
        var = tl.sum(hf * hf, axis=0) / N
        normed = (hf * (1.0 / tl.sqrt(var + eps))).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=m, other=0.0)
        y = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + cols, y, mask=m)

    @triton.jit
    def _rotate(a, b, c1, c2, s1, s2, DT: tl.constexpr):
        """(a, b) halves -> x * cos + rotate_half(x) * sin, each product rounded like eager DT (the
        launch disables FMA contraction: with it, LLVM fuses a product and the sum into one FMA
        on the GPU, which skips the product's rounding and lands up to 2 ulps off eager)."""
        o1 = (a.to(tl.float32) * c1).to(DT).to(tl.float32) - (b.to(tl.float32) * s1).to(DT).to(tl.float32)
        o2 = (b.to(tl.float32) * c2).to(DT).to(tl.float32) + (a.to(tl.float32) * s2).to(DT).to(tl.float32)
        return o1.to(DT), o2.to(DT)

    @triton.jit
    def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr, slot_ptr,
                           stride_qr, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_cr,
                           stride_cache_r, stride_cache_h, stride_cache_l, H, offset, HALF: tl.constexpr):
        """Program (row, head): heads [0, H) are q heads; [H, H + KVH) are k/v heads."""
        DT: tl.constexpr = qo_ptr.dtype.element_ty
        row = tl.program_id(0)
        head = tl.program_id(1)
        d = tl.arange(0, HALF)
        c1 = tl.load(cos_ptr + row * stride_cr + d).to(tl.float32)
        c2 = tl.load(cos_ptr + row * stride_cr + HALF + d).to(tl.float32)
        s1 = tl.load(sin_ptr + row * stride_cr + d).to(tl.float32)
        s2 = tl.load(sin_ptr + row * stride_cr + HALF + d).to(tl.float32)
        if head < H:
            qb = q_ptr + row * stride_qr + head * stride_qh
            o1, o2 = _rotate(tl.load(qb + d), tl.load(qb + HALF + d), c1, c2, s1, s2, DT)
            qo = qo_ptr + (row * H + head) * (2 * HALF)
            tl.store(qo + d, o1)
            tl.store(qo + HALF + d, o2)
        else:
            kh = head - H
            slot = tl.load(slot_ptr) - offset
            kb = k_ptr + row * stride_kr + kh * stride_kh
            k1, k2 = _rotate(tl.load(kb + d), tl.load(kb + HALF + d), c1, c2, s1, s2, DT)
            dst = row * stride_cache_r + kh * stride_cache_h + slot * stride_cache_l
            tl.store(kc_ptr + dst + d, k1)
            tl.store(kc_ptr + dst + HALF + d, k2)
            vb = v_ptr + row * stride_vr + kh * stride_vh
            tl.store(vc_ptr + dst + d, tl.load(vb + d))
            tl.store(vc_ptr + dst + HALF + d, tl.load(vb + HALF + d))

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, N, stride_g, stride_o, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < N
        g = tl.load(gu_ptr + row * stride_g + cols, mask=m, other=0.0)
        u = tl.load(gu_ptr + row * stride_g + N + cols, mask=m, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # silu in float32, rounded like F.silu
        tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=m)


def fused_available(x: Tensor) -> bool:
    if not HAS_TRITON:
        return False
    return x.is_cuda or (interpreting() and x.device.type == "cpu")


# -- references -------------------------------------------------------------------------------
def add_rmsnorm_ref(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    h = x if residual is None else residual + x
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return weight * normed, h


def rope_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [R, heads, D], cos/sin [R, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


def rope_to_cache_ref(q, k, v, cos, sin, k_cache, v_cache, slot, offset: int = 0) -> Tensor:
    col = slot - offset if offset else slot
    k_cache.index_copy_(2, col, rope_ref(k, cos, sin)[:, :, None])
    v_cache.index_copy_(2, col, v[:, :, None])
    return rope_ref(q, cos, sin).contiguous()


def silu_mul_ref(gate_up: Tensor) -> Tensor:
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


# -- dispatch ---------------------------------------------------------------------------------
def add_rmsnorm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float,
                use_triton: bool | None = None) -> tuple[Tensor, Tensor]:
    """(RMSNorm(residual + x) * weight, residual + x) for x [R, N] (rows contiguous)."""
    if not (fused_available(x) if use_triton is None else use_triton):
        return add_rmsnorm_ref(x, residual, weight, eps)
    R, N = x.shape
    out = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x
    r = residual if residual is not None else x
    _add_rmsnorm_kernel[(R,)](x, r, weight, out, h, N, x.stride(0), r.stride(0), out.stride(0), h.stride(0), eps,
                              HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(N), num_warps=8)
    return out, h


def rope_to_cache(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                  slot: Tensor, use_triton: bool | None = None, offset: int = 0) -> Tensor:
    """q [R, H, D], k/v [R, KVH, D] (any row/head strides, last dim contiguous); cos/sin [R, D];
    caches [R, KVH, L, D]; slot [1] long. Returns rotated q [R, H, D]; writes k, v at cache column
    ``slot - offset`` (``offset``: the shared prefix's length, whose slots are not in this cache)."""
    if not (fused_available(q) if use_triton is None else use_triton):
        return rope_to_cache_ref(q, k, v, cos, sin, k_cache, v_cache, slot, offset)
    R, H, D = q.shape
    kvh = k.shape[1]
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin), ("k_cache", k_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"rope_to_cache: {name} must be contiguous in its last dimension")
    q_out = torch.empty((R, H, D), dtype=q.dtype, device=q.device)
    _rope_cache_kernel[(R, H + kvh)](q, k, v, cos, sin, q_out, k_cache, v_cache, slot,
                                     q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                     cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                     H, offset, HALF=D // 2, num_warps=1,
                                     enable_fp_fusion=False)  # eager's roundings: no product+sum FMA
    return q_out


def silu_mul(gate_up: Tensor, use_triton: bool | None = None) -> Tensor:
    if not (fused_available(gate_up) if use_triton is None else use_triton):
        return silu_mul_ref(gate_up)
    R, N2 = gate_up.shape
    N = N2 // 2
    out = torch.empty((R, N), dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _silu_mul_kernel[(R, triton.cdiv(N, BLOCK))](gate_up, out, N, gate_up.stride(0), out.stride(0), BLOCK=BLOCK)
    return out
