"""Decode attention: one new query token per row, over a KV cache whose prompt part is shared.

In a GRPO batch every prompt is decoded n times, so n rows share the prompt's keys and values.
The rollout engine's cache therefore has two parts per layer
(``qerl_kit.rollout.static.decoder.KVCache``):

* the **prefix**, ``pk``/``pv`` [prompts, kv_heads, P, D]: each prompt's P (padded) positions,
  stored once, not n times (the cache's memory for the prompt falls n-fold);
* the **rows' own slots**, ``k``/``v`` [rows, kv_heads, S, D]: the completion tokens;

and ``prompt_row`` [rows] says which prompt a row continues. Key position j < P of row r is
``pk[prompt_row[r], :, j]``, position j >= P is ``k[r, :, j - P]``. Without a prefix (P = 0) the
cache is the plain [rows, kv_heads, L, D] layout.

``decode_attention(q, k, v, key_bias, length, scale, prefix=)`` attends q [rows, kv_heads, G, D]
(the G query heads of one kv head side by side, so K/V are never expanded) over key positions
[0, length), with ``key_bias`` [rows, >= length] added to the scores (0 where a row may attend,
-inf elsewhere: left padding, unwritten slots). The Triton kernel is split-KV (flash-decoding):
the grid is (row, kv head, split), each program reads one chunk of the keys once, for all G
query heads, with an online softmax, and a second small kernel merges the splits' partial results
by their log-sum-exp; the split count is chosen so that about two programs run per SM, so a few
long rows still fill the GPU. It reads only positions below ``length``, and the prefix part of
rows of one prompt hits the same cache lines (L2) instead of n copies in memory.

``decode_attention_ref`` is the plain-PyTorch reference (the prefix gathered per row, scores and
softmax in float32, probabilities rounded to the values' dtype, as the generic decode path always
computed); ``impl="sdpa"`` is ``scaled_dot_product_attention`` on the plain layout (the A/B
baseline the engine used before). Tests: tests/test_decode_attention.py (kernel against reference
on random inputs, with and without a prefix, one and several splits, masked keys).
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

HAS_TRITON = importlib.util.find_spec("triton") is not None
IMPLS = ("auto", "triton", "torch", "sdpa")
BLOCK_N = 64  # keys per inner step of the kernel


class Prefix(NamedTuple):
    """One layer's shared prompt keys/values and each row's prompt."""

    k: Tensor           # [prompts, kv_heads, P, D]
    v: Tensor           # [prompts, kv_heads, P, D]
    prompt_row: Tensor  # [rows] long


if HAS_TRITON:
    import triton
    import triton.language as tl

    from qerl_kit.kernels.backend import interpreting, patch_interpreter_for_numpy24
    from qerl_kit.kernels.lora_triton import dot_f32  # float32 dot, widened under the interpreter

    if interpreting():
        patch_interpreter_for_numpy24()

    @triton.jit
    def _attend_block(q, k_base, v_base, bias_base, start, end, pos0, stride_l, m_i, l_i, acc, scale,
                      D: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
        """Online-softmax update with keys [start, start + BLOCK) of one buffer (masked at ``end``);
        ``pos0`` is the buffer's first key position (its index into the row's bias)."""
        offs_n = start + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, D)
        nmask = offs_n < end
        kt = tl.load(k_base + offs_n[None, :] * stride_l + offs_d[:, None], mask=nmask[None, :], other=0.0)
        s = dot_f32(q, kt, IEEE, INTERPRET) * scale  # [G, BLOCK] float32
        bias = tl.load(bias_base + pos0 + offs_n, mask=nmask, other=float("-inf")).to(tl.float32)
        s = s + bias[None, :]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block of masked keys only: no NaN
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_base + offs_n[:, None] * stride_l + offs_d[None, :], mask=nmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + dot_f32(p.to(vt.dtype), vt, IEEE, INTERPRET)
        return m_new, l_i, acc

    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, pk_ptr, pv_ptr, prow_ptr, bias_ptr, o_ptr, m_ptr, l_ptr,
                       length, P, chunk, G, scale,
                       s_qr, s_qh, s_qg, s_kr, s_kh, s_kl, s_pb, s_ph, s_pl, s_br,
                       s_or, s_oh, s_og, s_os,
                       GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr,
                       IEEE: tl.constexpr, INTERPRET: tl.constexpr):
        """Program (row, kv head, split): keys [split * chunk, min(length, (split + 1) * chunk))."""
        r, h, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        gmask = offs_g < G
        q = tl.load(q_ptr + r * s_qr + h * s_qh + offs_g[:, None] * s_qg + offs_d[None, :],
                    mask=gmask[:, None], other=0.0)
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, length)
        m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, D], dtype=tl.float32)
        bias_base = bias_ptr + r * s_br
        # the shared prompt part: positions [lo, min(hi, P)) of this row's prompt
        b = tl.load(prow_ptr + r)
        pk_base = pk_ptr + b * s_pb + h * s_ph
        pv_base = pv_ptr + b * s_pb + h * s_ph
        p_end = tl.minimum(hi, P)
        for start in range(lo, p_end, BLOCK):
            m_i, l_i, acc = _attend_block(q, pk_base, pv_base, bias_base, start, p_end, 0, s_pl, m_i, l_i, acc,
                                          scale, D, BLOCK, IEEE, INTERPRET)
        # the row's own part: positions [max(lo, P), hi), stored at index position - P
        k_base = k_ptr + r * s_kr + h * s_kh
        v_base = v_ptr + r * s_kr + h * s_kh
        for start in range(tl.maximum(lo, P) - P, hi - P, BLOCK):
            m_i, l_i, acc = _attend_block(q, k_base, v_base, bias_base, start, hi - P, P, s_kl, m_i, l_i, acc,
                                          scale, D, BLOCK, IEEE, INTERPRET)
        out = o_ptr + r * s_or + h * s_oh + offs_g[:, None] * s_og + offs_d[None, :]
        if SPLIT:  # unnormalised partials; _merge_kernel combines the splits
            tl.store(out + sp * s_os, acc, mask=gmask[:, None])
            ml = (r * tl.num_programs(1) + h) * tl.num_programs(2) * GP + sp * GP + offs_g
            tl.store(m_ptr + ml, m_i)
            tl.store(l_ptr + ml, l_i)
        else:
            tl.store(out, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=gmask[:, None])

    @triton.jit
    def _merge_kernel(part_ptr, m_ptr, l_ptr, o_ptr, NS, G,
                      s_pr, s_ph, s_pg, s_ps, s_or, s_oh, s_og,
                      GP: tl.constexpr, D: tl.constexpr):
        """Program (row, kv head): o = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s."""
        r, h = tl.program_id(0), tl.program_id(1)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        gmask = offs_g < G
        m = tl.full([GP], float("-inf"), dtype=tl.float32)
        lsum = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, D], dtype=tl.float32)
        ml0 = (r * tl.num_programs(1) + h) * NS * GP
        for s in range(0, NS):
            m_s = tl.load(m_ptr + ml0 + s * GP + offs_g)
            l_s = tl.load(l_ptr + ml0 + s * GP + offs_g)
            a_s = tl.load(part_ptr + r * s_pr + h * s_ph + s * s_ps + offs_g[:, None] * s_pg + offs_d[None, :],
                          mask=gmask[:, None], other=0.0)
            m_new = tl.maximum(m, m_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha, beta = tl.exp(m - m_safe), tl.exp(m_s - m_safe)
            acc = acc * alpha[:, None] + a_s * beta[:, None]
            lsum = lsum * alpha + l_s * beta
            m = m_new
        out = o_ptr + r * s_or + h * s_oh + offs_g[:, None] * s_og + offs_d[None, :]
        tl.store(out, (acc / lsum[:, None]).to(o_ptr.dtype.element_ty), mask=gmask[:, None])


def triton_available(x: Tensor) -> bool:
    if not HAS_TRITON:
        return False
    return x.is_cuda or (interpreting() and x.device.type == "cpu")


def _check(q: Tensor, k: Tensor, v: Tensor, key_bias: Tensor, length: int, prefix: Prefix | None) -> int:
    """Shapes agree; returns P (0 without a prefix)."""
    R, KVH, G, D = q.shape
    P = 0 if prefix is None else prefix.k.shape[2]
    if k.shape[:2] != (R, KVH) or k.shape[3] != D or v.shape != k.shape:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)} disagree")
    if not 0 < length <= P + k.shape[2] or key_bias.shape[0] != R or key_bias.shape[1] < length:
        raise ValueError(f"decode_attention: length {length} must be in (0, {P + k.shape[2]}] and key_bias "
                         f"{tuple(key_bias.shape)} must have {R} rows of >= {length} keys")
    if prefix is not None:
        if prefix.k.shape[1] != KVH or prefix.k.shape[3] != D or prefix.v.shape != prefix.k.shape \
                or prefix.prompt_row.shape != (R,):
            raise ValueError(f"decode_attention: prefix k/v {tuple(prefix.k.shape)}/{tuple(prefix.v.shape)} and "
                             f"prompt_row {tuple(prefix.prompt_row.shape)} do not fit q {tuple(q.shape)}")
    return P


def decode_attention_ref(q: Tensor, k: Tensor, v: Tensor, key_bias: Tensor, length: int, scale: float,
                         prefix: Prefix | None = None) -> Tensor:
    """The reference: [rows, kv_heads, G, D] out; see the module docstring for the arguments."""
    P = _check(q, k, v, key_bias, length, prefix)
    keys, values = k[:, :, :max(0, length - P)], v[:, :, :max(0, length - P)]
    if prefix is not None:
        keys = torch.cat([prefix.k[prefix.prompt_row][:, :, :min(P, length)], keys], 2)
        values = torch.cat([prefix.v[prefix.prompt_row][:, :, :min(P, length)], values], 2)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale + key_bias[:, None, None, :length].float()
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_splits(programs: int, length: int, device: torch.device) -> int:
    """Splits of the keys so that about two programs run per SM (at least one block of keys each)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return max(1, min(_cdiv(2 * sms, max(programs, 1)), _cdiv(length, BLOCK_N)))


def decode_attention(q: Tensor, k: Tensor, v: Tensor, key_bias: Tensor, length: int, scale: float,
                     prefix: Prefix | None = None, impl: str = "auto", splits: int | None = None) -> Tensor:
    """Attention of one query token per row: q [rows, kv_heads, G, D] -> [rows, kv_heads, G, D].

    ``impl``: ``auto`` (the Triton kernel where it runs: CUDA, or the CPU under
    ``TRITON_INTERPRET=1``; else the reference), ``triton``, ``torch`` (the reference) or ``sdpa``
    (``scaled_dot_product_attention``; plain layout only). ``splits`` overrides the kernel's split
    count (tests)."""
    if impl not in IMPLS:
        raise ValueError(f"decode_attention: impl={impl!r}; allowed: {', '.join(IMPLS)}")
    P = _check(q, k, v, key_bias, length, prefix)
    R, KVH, G, D = q.shape
    if impl == "sdpa":
        if prefix is not None:
            raise ValueError("decode_attention: impl='sdpa' reads the plain layout only (no shared prefix)")
        return F.scaled_dot_product_attention(q, k[:, :, :length], v[:, :, :length],
                                              attn_mask=key_bias[:, None, None, :length].to(q.dtype), scale=scale)
    fits = D >= 16 and D & (D - 1) == 0 and k.stride(-1) == 1 and q.stride(-1) == 1 and key_bias.stride(-1) == 1
    if impl == "torch" or (impl == "auto" and not (triton_available(q) and fits)):
        return decode_attention_ref(q, k, v, key_bias, length, scale, prefix)
    if not fits:
        raise ValueError(f"decode_attention: the Triton kernel needs a power-of-two head_dim >= 16 (got {D}) "
                         "and rows contiguous in their last dimension")
    pk, pv, prow = (prefix.k, prefix.v, prefix.prompt_row) if prefix is not None else (k, v, None)
    if prow is None:
        prow = torch.zeros(R, dtype=torch.long, device=q.device)  # read by no loop: P = 0
    if pk.stride(-1) != 1 or pk.stride() != pv.stride() or k.stride() != v.stride():
        raise ValueError("decode_attention: k and v (and the prefix's) must share one layout")
    ns = splits or num_splits(R * KVH, length, q.device)
    chunk = _cdiv(_cdiv(length, ns), BLOCK_N) * BLOCK_N  # whole blocks per split
    ns = _cdiv(length, chunk)
    GP = max(16, triton.next_power_of_2(G))
    out = torch.empty((R, KVH, G, D), dtype=q.dtype, device=q.device)
    ieee = q.dtype == torch.float32
    interp = interpreting()
    if ns == 1:
        part, m, l_ = out, out, out  # m/l unused
        s_os = 0
    else:
        part = torch.empty((R, KVH, ns, G, D), dtype=torch.float32, device=q.device)
        m = torch.empty((R, KVH, ns, GP), dtype=torch.float32, device=q.device)
        l_ = torch.empty_like(m)
        s_os = part.stride(2)
    po = (part.stride(0), part.stride(1), part.stride(-2), s_os)
    _decode_kernel[(R, KVH, ns)](q, k, v, pk, pv, prow, key_bias, part, m, l_, length, P, chunk, G, scale,
                                 q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                                 pk.stride(0), pk.stride(1), pk.stride(2), key_bias.stride(0), *po,
                                 GP=GP, D=D, BLOCK=BLOCK_N, SPLIT=ns > 1, IEEE=ieee, INTERPRET=interp,
                                 num_warps=4, num_stages=2)
    if ns > 1:
        _merge_kernel[(R, KVH)](part, m, l_, out, ns, G, part.stride(0), part.stride(1), part.stride(3),
                                part.stride(2), out.stride(0), out.stride(1), out.stride(2), GP=GP, D=D,
                                num_warps=4)
    return out
