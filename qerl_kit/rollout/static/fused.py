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
The kernels themselves are in ``fused_kernels`` (it imports Triton at its top), imported at the
first launch. Tests: tests/test_engine_fused.py (each kernel against its reference, and whole
fused steps).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import Tensor

from qerl_kit.kernels.backend import interpreting

HAS_TRITON = importlib.util.find_spec("triton") is not None


def fused_available(x: Tensor) -> bool:
    """Whether the Triton kernels run for ``x``: Triton installed, and ``x`` on CUDA or on the CPU
    under ``TRITON_INTERPRET=1``."""
    if not HAS_TRITON:
        return False
    return x.is_cuda or (interpreting() and x.device.type == "cpu")


def _kernels():
    """The Triton kernels' module, imported at the first launch (it imports Triton at its top)."""
    from qerl_kit.rollout.static import fused_kernels

    return fused_kernels


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
    _kernels().add_rmsnorm_kernel[(R,)](x, r, weight, out, h, N, x.stride(0), r.stride(0), out.stride(0),
                                        h.stride(0), eps, HAS_RES=residual is not None,
                                        BLOCK=1 << (N - 1).bit_length(), num_warps=8)
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
    _kernels().rope_cache_kernel[(R, H + kvh)](q, k, v, cos, sin, q_out, k_cache, v_cache, slot,
                                               q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                                               v.stride(1), cos.stride(0), k_cache.stride(0), k_cache.stride(1),
                                               k_cache.stride(2), H, offset, HALF=D // 2, num_warps=1,
                                               enable_fp_fusion=False)  # eager's roundings: no product+sum FMA
    return q_out


def silu_mul(gate_up: Tensor, use_triton: bool | None = None) -> Tensor:
    if not (fused_available(gate_up) if use_triton is None else use_triton):
        return silu_mul_ref(gate_up)
    R, N2 = gate_up.shape
    N = N2 // 2
    out = torch.empty((R, N), dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _kernels().silu_mul_kernel[(R, -(-N // BLOCK))](gate_up, out, N, gate_up.stride(0), out.stride(0), BLOCK=BLOCK)
    return out
