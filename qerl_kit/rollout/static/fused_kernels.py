"""The Triton kernels of the fused decode step (``qerl_kit.rollout.static.fused`` launches them and
holds their plain-PyTorch references and the rules they follow).

This module imports Triton at its top: ``fused`` imports it only where Triton is installed, so the
package imports without it. Under ``TRITON_INTERPRET=1`` the interpreter is patched for numpy >= 2.4
first (``qerl_kit.kernels.backend``).
"""

import triton
import triton.language as tl

from qerl_kit.kernels.backend import interpreting, patch_interpreter_for_numpy24

if interpreting():
    patch_interpreter_for_numpy24()


@triton.jit
def add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, h_ptr, N, stride_x, stride_r, stride_o, stride_h, eps,
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
def rope_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr, slot_ptr,
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
def silu_mul_kernel(gu_ptr, out_ptr, N, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    g = tl.load(gu_ptr + row * stride_g + cols, mask=m, other=0.0)
    u = tl.load(gu_ptr + row * stride_g + N + cols, mask=m, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # silu in float32, rounded like F.silu
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=m)
