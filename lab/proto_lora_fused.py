"""A projection group's LoRA expand done by the kernel that reads the projection's output.

``lora_apply_`` adds a group's LoRA in two launches, shrink and expand. At batch 1-8 each launch
is mostly fixed latency, so here the expand has no launch of its own: the shrink
(``lora_triton.lora_shrink``) leaves its float32 partials, and the engine's next elementwise
kernel, which reads y anyway, adds ``s_i * t_i @ B_i^T`` to the columns it reads:

* ``add_rmsnorm_lora``: residual add + RMSNorm of ``x + delta`` (o_proj's and down_proj's LoRA;
  one program per row, the whole row at once as ``add_rmsnorm``, all of B read by each row);
* ``rope_to_cache_lora``: RoPE + cache write of ``q/k/v + delta`` (q/k/v's LoRA; one program per
  16 rows and one head);
* ``silu_mul_lora``: ``silu(gate + delta) * (up + delta)`` (gate/up's LoRA; one program per 16
  rows and 64 columns).

Each computes y's value as the expand kernel writes it (t summed in split order and rounded to the
adapters' dtype, then to y's; ``acc = t @ B^T`` in float32; ``y + s * acc`` rounded to y's dtype)
and then runs the consumer's own arithmetic on it, so results are those of expand-then-consumer.
RoPE and SiLU compute ``acc`` with the expand's own 16-row float32 dot (bit for bit the separate
path's values on the GPU); RMSNorm, one row per program, sums the rank-r products itself, in
another order (float32 rounding: a bf16 y may differ in its last bit, rarely). ``lora`` is a
``lora_triton.LoraDelta`` whose offsets are columns of the consumer's input (for RoPE: of
``[q | k | v]`` flattened, as the fused q/k/v matmul lays them out). What the kernels do not take
(overlapping adapter columns, a head size that is not a power of two >= 16, no Triton for the
tensor) runs the separate expand on a copy, then the plain consumer.
Its tests (tests/test_lora_fused.py) and the engine wiring (StaticEngine(lora_fusion=True)) are in
commit 17a5638; measured slower than the separate expand on the H200 (lab/README.md), removed after.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qerl_kit.rollout.static import fused as ef
from qerl_kit.kernels.lora_triton import FLOATS, HAS_TRITON, LoraDelta, _pad, lora_expand_

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qerl_kit.kernels.backend import interpreting
    from qerl_kit.kernels.lora_triton import dot_f32

    @triton.jit
    def _t_tile(rows, rmask, i: tl.constexpr, p_ptr, a_ptr, rs, cs, LM, RT, DT: tl.constexpr,
                SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
        """t_i of ``rows`` [BLOCK_M, BLOCK_R]: partials summed in split order, rounded as the expand does."""
        kr = tl.arange(0, BLOCK_R)
        mask = rmask[:, None] & (kr[None, :] < rs[i])
        t = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
        for split in tl.static_range(SPLITS):
            t += tl.load(p_ptr + (split * LM + rows[:, None]) * RT + (cs[i] + kr)[None, :], mask=mask, other=0.0)
        return t.to(a_ptr.dtype.element_ty).to(DT)

    @triton.jit
    def _acc(tt, cols, i: tl.constexpr, bs, sbs, ns, offs, rs, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
             INTERPRET: tl.constexpr):
        """tt @ B_i[cols - o_i]^T in float32 [BLOCK_M, len(cols)] (0 where adapter i has no column)."""
        kr = tl.arange(0, BLOCK_R)
        rel = cols - offs[i]
        cov = (rel >= 0) & (rel < ns[i])
        bb = tl.load(bs[i] + rel[:, None] * sbs[i] + kr[None, :], mask=cov[:, None] & (kr[None, :] < rs[i]),
                     other=0.0).to(tt.dtype)
        return dot_f32(tt, tl.trans(bb), IEEE, INTERPRET), cov

    @triton.jit
    def _plus(y, s, acc, FMA: tl.constexpr):
        """y + s * acc in float32. FMA: as one fused multiply-add, which is what the expand kernel's
        ``y + s * acc`` compiles to; for kernels launched without FMA contraction (RoPE)."""
        if FMA:
            out = tl.fma(acc, s + tl.zeros_like(acc), y.to(tl.float32))  # tl.fma does not broadcast
        else:
            out = y.to(tl.float32) + s * acc
        return out

    @triton.jit
    def _onto(y, cols, lo, hi, rows, rmask, p_ptr, a_ptr, bs, sbs, ns, offs, rs, cs, ss, LM, RT,
              N_AD: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
              IEEE: tl.constexpr, INTERPRET: tl.constexpr, FMA: tl.constexpr):
        """The tile y [BLOCK_M, BLOCK_N] of columns ``cols`` (all in [lo, hi)) with every adapter's
        delta on the columns it covers, rounded to y's dtype as the expand rounds them."""
        for i in tl.static_range(N_AD):
            if (lo < offs[i] + ns[i]) & (offs[i] < hi):
                tt = _t_tile(rows, rmask, i, p_ptr, a_ptr, rs, cs, LM, RT, y.dtype, SPLITS, BLOCK_M, BLOCK_R)
                acc, cov = _acc(tt, cols, i, bs, sbs, ns, offs, rs, BLOCK_R, IEEE, INTERPRET)
                y = tl.where(cov[None, :], _plus(y, ss[i], acc, FMA).to(y.dtype), y)
        return y

    @triton.jit
    def _add_rmsnorm_lora_kernel(x_ptr, r_ptr, w_ptr, out_ptr, h_ptr, N, stride_x, stride_r, stride_o, stride_h, eps,
                                 p_ptr, a_ptr, bs, sbs, ns, offs, rs, cs, ss, LM, RT, HAS_RES: tl.constexpr,
                                 N_AD: tl.constexpr, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, RC: tl.constexpr,
                                 BLOCK: tl.constexpr):
        """One row, whole, as ``_add_rmsnorm_kernel`` (same arithmetic after the delta). The row's
        delta t . B[n] for every column n: float32 products, RC ranks at a time (a one-row dot,
        so no tensor-core tile: the rank-r sum may round differently from the expand's)."""
        DT: tl.constexpr = x_ptr.dtype.element_ty
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
        NC: tl.constexpr = BLOCK_R // RC
        for i in tl.static_range(N_AD):
            rel = cols - offs[i]
            cov = m & (rel >= 0) & (rel < ns[i])
            kr = tl.arange(0, BLOCK_R)
            t = tl.zeros((BLOCK_R,), tl.float32)
            for split in tl.static_range(SPLITS):  # in split order, as the expand sums them
                t += tl.load(p_ptr + (split * LM + row) * RT + cs[i] + kr, mask=kr < rs[i], other=0.0)
            tt = tl.reshape(t.to(a_ptr.dtype.element_ty).to(DT).to(tl.float32), (NC, RC))
            acc = tl.zeros((BLOCK,), tl.float32)
            for c in tl.static_range(NC):
                if c * RC < rs[i]:
                    tc = tl.sum(tl.where((tl.arange(0, NC) == c)[:, None], tt, 0.0), axis=0)  # ranks c*RC + [0, RC)
                    kc = c * RC + tl.arange(0, RC)
                    bb = tl.load(bs[i] + rel[:, None] * sbs[i] + kc[None, :], mask=cov[:, None] & (kc < rs[i])[None, :],
                                 other=0.0)
                    acc += tl.sum(bb.to(DT).to(tl.float32) * tc[None, :], axis=1)
            x = tl.where(cov, (x.to(tl.float32) + ss[i] * acc).to(DT), x)
        if HAS_RES:
            h = (x.to(tl.float32) + tl.load(r_ptr + row * stride_r + cols, mask=m, other=0.0).to(tl.float32))
            h = h.to(DT)
        else:
            h = x
        tl.store(h_ptr + row * stride_h + cols, h, mask=m)
        hf = h.to(tl.float32)
        var = tl.sum(hf * hf, axis=0) / N
        normed = (hf * (1.0 / tl.sqrt(var + eps))).to(DT)
        w = tl.load(w_ptr + cols, mask=m, other=0.0)
        y = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + cols, y, mask=m)

    @triton.jit
    def _rope_lora_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr, slot_ptr, R,
                          stride_qr, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_cr,
                          stride_cache_r, stride_cache_h, stride_cache_l, H, KVH, offset,
                          p_ptr, a_ptr, bs, sbs, ns, offs, rs, cs, ss, LM, RT, N_AD: tl.constexpr,
                          SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
                          D: tl.constexpr, BLOCK_M: tl.constexpr):
        """Program (16 rows, head): heads [0, H) are q heads, [H, H + KVH) k/v heads. A head is
        loaded whole and also half-swapped (yp[d] = y[(d + D/2) % D], its delta computed the same
        way), so x * cos + rotate_half(x) * sin has the roundings of ``_rotate``."""
        DT: tl.constexpr = qo_ptr.dtype.element_ty
        pid_m, head = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rm = rows < R
        d = tl.arange(0, D)
        dp = (d + D // 2) % D
        m2 = rm[:, None]
        c = tl.load(cos_ptr + rows[:, None] * stride_cr + d[None, :], mask=m2, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + rows[:, None] * stride_cr + d[None, :], mask=m2, other=0.0).to(tl.float32)
        sign = tl.where(d < D // 2, -1.0, 1.0)[None, :]
        col0 = head * D  # q head h: columns h * D of [q | k | v]; k head kh: (H + kh) * D
        if head < H:
            base = q_ptr + rows[:, None] * stride_qr + head * stride_qh
        else:
            base = k_ptr + rows[:, None] * stride_kr + (head - H) * stride_kh
        y = tl.load(base + d[None, :], mask=m2, other=0.0)
        yp = tl.load(base + dp[None, :], mask=m2, other=0.0)
        y = _onto(y, col0 + d, col0, col0 + D, rows, rm, p_ptr, a_ptr, bs, sbs, ns, offs, rs, cs, ss, LM, RT,
                  N_AD, SPLITS, BLOCK_M, BLOCK_R, IEEE, INTERPRET, True)
        yp = _onto(yp, col0 + dp, col0, col0 + D, rows, rm, p_ptr, a_ptr, bs, sbs, ns, offs, rs, cs, ss, LM, RT,
                   N_AD, SPLITS, BLOCK_M, BLOCK_R, IEEE, INTERPRET, True)
        o = ((y.to(tl.float32) * c).to(DT).to(tl.float32) + sign * (yp.to(tl.float32) * s).to(DT).to(tl.float32))
        o = o.to(DT)
        if head < H:
            tl.store(qo_ptr + (rows[:, None] * H + head) * D + d[None, :], o, mask=m2)
        else:
            kh = head - H
            slot = tl.load(slot_ptr) - offset
            dst = rows[:, None] * stride_cache_r + kh * stride_cache_h + slot * stride_cache_l + d[None, :]
            tl.store(kc_ptr + dst, o, mask=m2)
            vcol = (H + KVH + kh) * D
            v = tl.load(v_ptr + rows[:, None] * stride_vr + kh * stride_vh + d[None, :], mask=m2, other=0.0)
            v = _onto(v, vcol + d, vcol, vcol + D, rows, rm, p_ptr, a_ptr, bs, sbs, ns, offs, rs, cs, ss, LM, RT,
                      N_AD, SPLITS, BLOCK_M, BLOCK_R, IEEE, INTERPRET, True)
            tl.store(vc_ptr + dst, v, mask=m2)

    @triton.jit
    def _silu_mul_lora_kernel(gu_ptr, out_ptr, R, N, stride_g, stride_o, p_ptr, a_ptr, bs, sbs, ns, offs, rs, cs, ss,
                              LM, RT, N_AD: tl.constexpr, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr,
                              IEEE: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr):
        """Program (columns, 16 rows): gate columns j and up columns N + j, deltas added, silu x up."""
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = rows < R
        mask = rm[:, None] & (cols < N)[None, :]
        ptrs = gu_ptr + rows[:, None] * stride_g + cols[None, :]
        g = tl.load(ptrs, mask=mask, other=0.0)
        u = tl.load(ptrs + N, mask=mask, other=0.0)
        lo = pid_n * BLOCK_N
        hi = tl.minimum(lo + BLOCK_N, N)
        g = _onto(g, cols, lo, hi, rows, rm, p_ptr, a_ptr, bs, sbs, ns, offs, rs, cs, ss, LM, RT, N_AD, SPLITS,
                  BLOCK_M, BLOCK_R, IEEE, INTERPRET, False)
        u = _onto(u, N + cols, N + lo, N + hi, rows, rm, p_ptr, a_ptr, bs, sbs, ns, offs, rs, cs, ss, LM, RT, N_AD,
                  SPLITS, BLOCK_M, BLOCK_R, IEEE, INTERPRET, False)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # as _silu_mul_kernel
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :],
                 (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def _kernel_args(lora: LoraDelta) -> tuple:
    """(p, a_like, Bs, B row strides, widths, offsets, ranks, first columns of t, scales, M, RT),
    the per-adapter values as tuples of MAX_ADAPTERS (padded), as the fused consumers take them."""
    pad = lambda v, fill: tuple(_pad(v, fill))  # noqa: E731 - tuples: Triton's tuple arguments
    part = lora.part
    return (part.p, part.a_like, pad(lora.Bs, lora.Bs[0]), pad([b.stride(0) for b in lora.Bs], 0),
            pad([b.shape[0] for b in lora.Bs], 0), pad(lora.offsets, 0), pad(part.ranks, 0),
            pad(part.cols, 0), pad([float(s) for s in lora.scales], 0.0), part.p.shape[1], part.p.shape[2])


def fused_takes(y_like: Tensor, lora: LoraDelta, rows: int) -> bool:
    """Whether a fused consumer can add ``lora`` to its input (of y_like's dtype and device, ``rows`` rows)."""
    floats = FLOATS
    Bs = lora.Bs
    if not (ef.fused_available(y_like) and y_like.dtype in floats and 1 <= len(Bs) <= 3
            and len({b.dtype for b in Bs}) == 1 and Bs[0].dtype in floats and all(b.stride(1) == 1 for b in Bs)
            and lora.part.p.shape[1] == rows and lora.part.p.device == y_like.device):
        return False
    spans = sorted((o, o + b.shape[0]) for o, b in zip(lora.offsets, Bs))
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint columns: one rounding per element


def _meta(lora: LoraDelta, dtype: torch.dtype) -> dict:
    return dict(N_AD=len(lora.Bs), SPLITS=lora.part.splits, BLOCK_R=lora.block_r, IEEE=dtype == torch.float32,
                INTERPRET=interpreting())


def add_rmsnorm_lora(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, lora: LoraDelta,
                     use_triton: bool | None = None) -> tuple[Tensor, Tensor]:
    """``add_rmsnorm(x + delta, residual, weight, eps)``, delta = ``lora`` on x's columns."""
    R, N = x.shape
    if not ((use_triton is None or use_triton) and x.stride(1) == 1 and fused_takes(x, lora, R)):
        return ef.add_rmsnorm(lora_expand_(x.clone(), lora), residual, weight, eps, use_triton=use_triton)
    out = torch.empty_like(x)
    h = torch.empty_like(x)
    r = residual if residual is not None else x
    if R:
        block = triton.next_power_of_2(N)
        rc = min(16, max(2, 16384 // block))  # B tiles [block, rc]: 64 values a thread at 8 warps
        _add_rmsnorm_lora_kernel[(R,)](x, r, weight, out, h, N, x.stride(0), r.stride(0), out.stride(0), h.stride(0),
                                       eps, *_kernel_args(lora), HAS_RES=residual is not None, N_AD=len(lora.Bs),
                                       SPLITS=lora.part.splits, BLOCK_R=lora.block_r, RC=rc, BLOCK=block, num_warps=8)
    return out, h


def rope_to_cache_lora(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                       slot: Tensor, lora: LoraDelta, use_triton: bool | None = None, offset: int = 0) -> Tensor:
    """``rope_to_cache`` of q/k/v + delta, delta = ``lora`` on the columns of ``[q | k | v]`` flattened."""
    R, H, D = q.shape
    kvh = k.shape[1]
    strided = all(t.stride(-1) == 1 for t in (q, k, v, cos, sin, k_cache, v_cache))
    if not ((use_triton is None or use_triton) and strided and D >= 16 and D & (D - 1) == 0
            and v_cache.stride() == k_cache.stride() and fused_takes(q, lora, R)):
        qkv = lora_expand_(torch.cat([q.reshape(R, -1), k.reshape(R, -1), v.reshape(R, -1)], dim=1), lora)
        q2, k2, v2 = qkv.split([H * D, kvh * D, kvh * D], dim=1)
        return ef.rope_to_cache(q2.view(R, H, D), k2.view(R, kvh, D), v2.view(R, kvh, D), cos, sin, k_cache,
                                v_cache, slot, use_triton=use_triton, offset=offset)
    q_out = torch.empty((R, H, D), dtype=q.dtype, device=q.device)
    if R:
        block_m = 16
        _rope_lora_kernel[(triton.cdiv(R, block_m), H + kvh)](
            q, k, v, cos, sin, q_out, k_cache, v_cache, slot, R, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            H, kvh, offset, *_kernel_args(lora), **_meta(lora, q.dtype), D=D, BLOCK_M=block_m, num_warps=4,
            enable_fp_fusion=False)  # the rotation's roundings, as rope_to_cache
    return q_out


def silu_mul_lora(gate_up: Tensor, lora: LoraDelta, use_triton: bool | None = None) -> Tensor:
    """``silu_mul(gate_up + delta)``, delta = ``lora`` on gate_up's columns."""
    R, N2 = gate_up.shape
    if not ((use_triton is None or use_triton) and gate_up.stride(1) == 1 and fused_takes(gate_up, lora, R)):
        return ef.silu_mul(lora_expand_(gate_up.clone(), lora), use_triton=use_triton)
    N = N2 // 2
    out = torch.empty((R, N), dtype=gate_up.dtype, device=gate_up.device)
    if R:
        block_m, block_n = 16, 64
        _silu_mul_lora_kernel[(triton.cdiv(N, block_n), triton.cdiv(R, block_m))](
            gate_up, out, R, N, gate_up.stride(0), out.stride(0), *_kernel_args(lora), **_meta(lora, gate_up.dtype),
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
    return out


# -- what the engine calls: the plain consumer when nothing is pending ------------------------
def add_rmsnorm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, use_triton: bool | None = None,
                lora: LoraDelta | None = None) -> tuple[Tensor, Tensor]:
    """``fused.add_rmsnorm``, with ``lora`` (the pending expand of the projection that
    produced x) added to x first."""
    if lora is None:
        return ef.add_rmsnorm(x, residual, weight, eps, use_triton=use_triton)
    return add_rmsnorm_lora(x, residual, weight, eps, lora, use_triton)


def rope_to_cache(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                  slot: Tensor, use_triton: bool | None = None, offset: int = 0,
                  lora: LoraDelta | None = None) -> Tensor:
    """``fused.rope_to_cache``, with ``lora`` (q/k/v's pending expand, on the columns of
    ``[q | k | v]`` flattened) added first."""
    if lora is None:
        return ef.rope_to_cache(q, k, v, cos, sin, k_cache, v_cache, slot, use_triton=use_triton, offset=offset)
    return rope_to_cache_lora(q, k, v, cos, sin, k_cache, v_cache, slot, lora, use_triton, offset)


def silu_mul(gate_up: Tensor, use_triton: bool | None = None, lora: LoraDelta | None = None) -> Tensor:
    """``fused.silu_mul``, with ``lora`` (gate/up's pending expand) added first."""
    if lora is None:
        return ef.silu_mul(gate_up, use_triton=use_triton)
    return silu_mul_lora(gate_up, lora, use_triton)
