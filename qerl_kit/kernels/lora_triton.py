"""Grouped LoRA for the fused decode step: every adapter of a projection group in two launches.

A fused group (q/k/v, or gate/up) computes ``y = x @ W_cat^T`` in one matmul; its LoRA then adds,
for each projection i that has an adapter, ``s_i * (x @ A_i^T) @ B_i^T`` to that projection's
columns of y. With torch ops that is a concatenation of the A's, one matmul, and one ``addmm_``
per B: five kernels for q/k/v at every layer of every decode step, each a few microseconds of
mostly launch latency. Here it is two:

* shrink: ``t = x @ [A_1; ...; A_n]^T`` as float32 partial sums over chunks of K (one program per
  16 adapter rows of one adapter and one chunk: a long K is spread over the GPU, no atomics);
* expand: sums the partials in chunk order, rounds them to ``t``, and adds
  ``y[:, off_i : off_i + n_i] += s_i * t_i @ B_i^T`` (one program per output block, or per
  ``n_blocks`` of them: ``Tiling`` sets the chunks, rows and blocks of both launches).

Both read the adapters where peft keeps them, so an optimizer's in-place update is seen by CUDA
graphs captured earlier, and both round as the torch path does: ``t`` to the adapters' dtype and
then to y's, ``y`` once after the add (float32 accumulation throughout). ``lora_apply_ref_`` is
that torch path; ``lora_apply_`` falls back to it for what the kernels do not take (more than
three adapters in a group, a rank over 128, mixed adapter dtypes, or no Triton).

The two halves are separate calls too: ``lora_shrink(x, As) -> LoraPartials`` and
``lora_expand_(y, LoraDelta(partials, Bs, offsets, scales))``. (Handing the ``LoraDelta`` to the
kernel that reads y next instead, which adds it itself, was built and measured slower on the H200:
lab/proto_lora_fused.py, lab/README.md.) Tests: tests/test_engine_fused.py (the grouped-LoRA
tests, against ``lora_apply_ref_``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from torch import Tensor

HAS_TRITON = importlib.util.find_spec("triton") is not None
MAX_ADAPTERS = 3  # q/k/v
MAX_RANK = 128
MAX_SPLITS = 32  # K chunks of the shrink, summed (unrolled) by every expand program
FLOATS = (torch.bfloat16, torch.float16, torch.float32)  # the dtypes the kernels take


@dataclass(frozen=True)
class Tiling:
    """How the two launches cut their work. ``max_splits``: the most K chunks the shrink writes partial
    sums for (more spread a long K over the GPU; every expand program reads all of them);
    ``block_m``: rows per program of either launch; ``n_blocks``: 64-column blocks per expand program, which
    sums its rows' partials once for all of them; ``reduce``: the shrink's last chunk to arrive sums the
    chunks (in order, as the expand would: the same bits) so every expand program reads one partial
    instead of all (``splitk``'s arrival counters). ``Tiling()`` is the tiling every measurement before
    2026-12-06 ran; ``lora_apply_`` picks one by row count (``tiling_for``); ``bench/bench_lora_tiling.py``
    times them all at a model's decode shapes."""

    max_splits: int = MAX_SPLITS
    block_m: int = 16
    n_blocks: int = 1
    reduce: bool = False

    def __post_init__(self):
        for key, value, allowed, says in (
                ("max_splits", self.max_splits, range(1, MAX_SPLITS + 1), f"an int in 1..{MAX_SPLITS}"),
                ("block_m", self.block_m, (16, 32, 64), "16, 32 or 64"),
                ("n_blocks", self.n_blocks, (1, 2, 4, 8), "1, 2, 4 or 8")):
            if not isinstance(value, int) or isinstance(value, bool) or value not in allowed:
                raise ValueError(f"Tiling.{key} must be {says}; got {value!r}")
        if not isinstance(self.reduce, bool):
            raise ValueError(f"Tiling.reduce must be True or False; got {self.reduce!r}")


DEFAULT_TILING = Tiling()


def tiling_for(m: int) -> Tiling:
    """The tiling ``lora_apply_`` cuts ``m`` rows with: 8 K chunks, and from 17 rows 64-row programs whose
    shrink sums its chunks (``reduce``). bench/results/lora_tiling_h100/lora_tiling.md (Qwen2.5-7B's decode groups,
    r 32, 21 tilings): the fastest at 8 rows (0.756 ms per decode step against 0.859 for ``Tiling()``)
    and, the other, at 64 and 128 rows (0.906 and 1.033 against 1.336 and 2.037: gate/up's 64 or 128
    rows in 16-row programs each summed 32 chunks); the 7B GRPO step's rollout 5.8% faster with it."""
    return _FEW_ROWS if m <= 16 else _MANY_ROWS


_FEW_ROWS = Tiling(max_splits=8)
_MANY_ROWS = Tiling(max_splits=8, block_m=64, reduce=True)


def _pad(v, fill) -> list:
    """A per-adapter list padded to MAX_ADAPTERS with ``fill`` (the kernels take three of each)."""
    return list(v) + [fill] * (MAX_ADAPTERS - len(v))

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qerl_kit.kernels.backend import interpreting, patch_interpreter_for_numpy24
    from qerl_kit.kernels.splitk import COUNTER_SLOTS, arrival_counters

    if interpreting():
        patch_interpreter_for_numpy24()

    @triton.jit
    def _pick(i, v0, v1, v2):
        """Pointer v_i for i in 0..2 (pointers of one element type)."""
        if i == 0:
            v = v0
        elif i == 1:
            v = v1
        else:
            v = v2
        return v

    @triton.jit
    def _sel(i, v0, v1, v2):
        """Scalar v_i for i in 0..2 (a select, so that Triton's specialisation of 1s cannot clash)."""
        return tl.where(i == 0, v0, tl.where(i == 1, v1, v2))

    @triton.jit
    def dot_f32(a, b, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
        """a @ b in float32. The interpreter's dot reads bfloat16 as integers, so there the operands
        are widened first (exact); float32 operands get a true float32 product (no TF32), as torch."""
        if INTERPRET:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif IEEE:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _shrink_kernel(x_ptr, p_ptr, t_ptr, cnt_ptr, a0, a1, a2, M, K, stride_xm, RT, sa0, sa1, sa2, r0, r1, r2,
                       c1, c2, CHUNK, M_BLOCKS, R_BLOCKS, SPLITS, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, REDUCE: tl.constexpr):
        """Partial products over one K chunk: p[split, m, c_i + j] = x[m, chunk] . A_i[j, chunk]. With
        REDUCE the last chunk of a tile to arrive (an int32 counter per tile, which it resets) sums the
        tile's partials in chunk order into t[m, c_i + j]: the expand then reads one partial."""
        pid_r, i, pid2 = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        split, pid_m = pid2 // M_BLOCKS, pid2 % M_BLOCKS
        a_ptr, sa = _pick(i, a0, a1, a2), _sel(i, sa0, sa1, sa2)
        r, c = _sel(i, r0, r1, r2), _sel(i, 0, c1, c2)
        if pid_r * BLOCK_R < r:
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
            acc = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
            for k0 in range(split * CHUNK, split * CHUNK + CHUNK, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                xk = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                             mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
                ak = tl.load(a_ptr + offs_r[:, None] * sa + offs_k[None, :],
                             mask=(offs_r[:, None] < r) & (offs_k[None, :] < K), other=0.0)
                acc += dot_f32(xk.to(ak.dtype), tl.trans(ak), IEEE, INTERPRET)
            tile = offs_m[:, None] * RT + (c + offs_r)[None, :]
            tile_mask = (offs_m[:, None] < M) & (offs_r[None, :] < r)
            tl.store(p_ptr + split * M * RT + tile, acc, mask=tile_mask)
            if REDUCE:  # as the split-K decode kernels do (splitk.py): deterministic, one launch
                slot = (i * R_BLOCKS + pid_r) * M_BLOCKS + pid_m
                arrived = tl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel", scope="gpu")
                if arrived == SPLITS - 1:
                    total = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
                    for sp in range(0, SPLITS):  # in chunk order: the sum the expand would make
                        total += tl.load(p_ptr + sp * M * RT + tile, mask=tile_mask, other=0.0,
                                         cache_modifier=".cg")
                    tl.store(t_ptr + tile, total, mask=tile_mask)
                    tl.atomic_xchg(cnt_ptr + slot, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _expand_kernel(y_ptr, p_ptr, a0, b0, b1, b2, M, RT, stride_ym, sb0, sb1, sb2, n0, n1, n2,
                       o0, o1, o2, r0, r1, r2, c1, c2, s0, s1, s2, SPLITS: tl.constexpr,
                       IEEE: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_R: tl.constexpr, N_BLOCKS: tl.constexpr):
        """y[m, o_i + n] += s_i * t_i[m, :] . B_i[n, :], t_i the summed partials rounded as torch does;
        one program sums t's partials once for N_BLOCKS consecutive blocks of BLOCK_N columns."""
        pid_n, i, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b_ptr, sb = _pick(i, b0, b1, b2), _sel(i, sb0, sb1, sb2)
        n, o, r = _sel(i, n0, n1, n2), _sel(i, o0, o1, o2), _sel(i, r0, r1, r2)
        c, s = _sel(i, 0, c1, c2), _sel(i, s0, s1, s2)
        if pid_n * BLOCK_N * N_BLOCKS < n:
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_r = tl.arange(0, BLOCK_R)
            t_mask = (offs_m[:, None] < M) & (offs_r[None, :] < r)
            t = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
            for split in tl.static_range(SPLITS):  # unrolled, loads in flight together; in order
                t += tl.load(p_ptr + (split * M + offs_m[:, None]) * RT + (c + offs_r)[None, :], mask=t_mask,
                             other=0.0)
            tt = t.to(a0.dtype.element_ty).to(y_ptr.dtype.element_ty)  # x @ A^T in A's dtype, then y's
            for nb in tl.static_range(N_BLOCKS):
                offs_n = (pid_n * N_BLOCKS + nb) * BLOCK_N + tl.arange(0, BLOCK_N)
                bb = tl.load(b_ptr + offs_n[:, None] * sb + offs_r[None, :],
                             mask=(offs_n[:, None] < n) & (offs_r[None, :] < r), other=0.0).to(tt.dtype)
                acc = dot_f32(tt, tl.trans(bb), IEEE, INTERPRET)
                mask = (offs_m[:, None] < M) & (offs_n[None, :] < n)
                y_ptrs = y_ptr + offs_m[:, None] * stride_ym + (o + offs_n)[None, :]
                y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
                tl.store(y_ptrs, (y + s * acc).to(y_ptr.dtype.element_ty), mask=mask)


def lora_apply_ref_(y: Tensor, x: Tensor, As: list[Tensor], Bs: list[Tensor], offsets: list[int],
                    scales: list[float]) -> Tensor:
    """y[:, offsets[i]:offsets[i] + B_i.shape[0]] += scales[i] * (x @ A_i^T) @ B_i^T, in torch ops
    (peft's order of casts: x to the adapters' dtype, t to y's dtype, B to y's dtype)."""
    A = As[0] if len(As) == 1 else torch.cat(As, dim=0)
    t = x.to(A.dtype) @ A.t()
    if t.dtype != y.dtype:
        t = t.to(y.dtype)
    r0 = 0
    for A_i, B, off, s in zip(As, Bs, offsets, scales):
        r = A_i.shape[0]
        B = B if B.dtype == y.dtype else B.to(y.dtype)
        y[:, off:off + B.shape[0]].addmm_(t[:, r0:r0 + r], B.t(), alpha=s)
        r0 += r
    return y


def kernels_take(y: Tensor, x: Tensor, As: list[Tensor], Bs: list[Tensor]) -> bool:
    """Whether the two Triton launches take this call (the rest runs ``lora_apply_ref_``)."""
    if not HAS_TRITON or not (y.is_cuda or (interpreting() and y.device.type == "cpu")):
        return False
    floats = FLOATS
    return (1 <= len(As) <= MAX_ADAPTERS and len({a.dtype for a in As}) == 1 and len({b.dtype for b in Bs}) == 1
            and As[0].dtype in floats and Bs[0].dtype in floats and x.dtype in floats and y.dtype in floats
            and all(a.shape[0] <= MAX_RANK and a.stride(1) == 1 for a in As) and all(b.stride(1) == 1 for b in Bs)
            and x.dim() == 2 and x.stride(1) == 1 and y.stride(1) == 1)


@dataclass
class LoraPartials:
    """The shrink's output: ``x @ [A_1; ...; A_n]^T`` as float32 partial sums over chunks of K.

    ``p`` [splits, M, sum(ranks)]: adapter i's columns start at ``cols[i]``; summed in split order
    and rounded to ``a_like``'s dtype (the adapters'), they are ``t_i = x @ A_i^T`` as peft has it."""

    p: Tensor
    ranks: list[int]
    a_like: Tensor  # one of the adapters' A (only its dtype is read)

    @property
    def splits(self) -> int:
        return self.p.shape[0]

    @property
    def cols(self) -> list[int]:
        return [sum(self.ranks[:i]) for i in range(len(self.ranks))]


@dataclass
class LoraDelta:
    """A projection group's expand, not yet applied: ``y[:, offsets[i]:offsets[i] + B_i.shape[0]] +=
    scales[i] * t_i @ B_i^T`` for the group's output y. ``lora_expand_`` applies it to y."""

    part: LoraPartials
    Bs: list[Tensor]
    offsets: list[int]
    scales: list[float]

    @property
    def block_r(self) -> int:
        return max(16, triton.next_power_of_2(max(self.part.ranks)))


def lora_shrink(x: Tensor, As: list[Tensor], tiling: Tiling = DEFAULT_TILING) -> LoraPartials:
    """The shrink launch of ``lora_apply_`` alone (for what ``kernels_take`` takes)."""
    m, k = x.shape
    ranks = [a.shape[0] for a in As]
    rt = sum(ranks)
    block_m, block_k = tiling.block_m, 256
    m_blocks = triton.cdiv(m, block_m)
    steps = triton.cdiv(k, block_k)
    chunk = block_k * triton.cdiv(steps, tiling.max_splits)  # K in at most max_splits chunks of 256 * j
    splits = triton.cdiv(k, chunk)
    r_blocks = triton.cdiv(max(ranks), 16)
    reduce = tiling.reduce and splits > 1 and m > 0
    partials = torch.empty((splits, m, rt), dtype=torch.float32, device=x.device)
    summed = torch.empty((1, m, rt), dtype=torch.float32, device=x.device) if reduce else partials
    part = LoraPartials(summed, ranks, As[0])  # what the expand reads: every chunk, or their sum
    if m == 0:
        return part
    if reduce and len(As) * r_blocks * m_blocks > COUNTER_SLOTS:
        raise ValueError(f"lora_shrink: {m} rows in blocks of {block_m} need more arrival counters than the "
                         f"{COUNTER_SLOTS} there are; use Tiling(reduce=False) or a larger block_m")
    pad = _pad
    cols, As3 = pad(part.cols, 0), pad(As, As[0])
    counters = arrival_counters(x.device) if reduce else partials
    _shrink_kernel[(r_blocks, len(As), splits * m_blocks)](
        x, partials, summed, counters, *As3, m, k, x.stride(0), rt, *[a.stride(0) for a in As3], *pad(ranks, 0),
        cols[1], cols[2], chunk, m_blocks, r_blocks, splits, IEEE=As[0].dtype == torch.float32,
        INTERPRET=interpreting(), BLOCK_M=block_m, BLOCK_R=16, BLOCK_K=block_k, REDUCE=reduce)
    return part


def lora_expand_ref_(y: Tensor, lora: LoraDelta) -> Tensor:
    """``lora_expand_`` in torch ops (what the kernel does not take), from the same partials."""
    part = lora.part
    t = part.p.sum(0).to(part.a_like.dtype).to(y.dtype).float()
    for B, off, s, c, r in zip(lora.Bs, lora.offsets, lora.scales, part.cols, part.ranks):
        cols = slice(off, off + B.shape[0])
        y[:, cols] = (y[:, cols].float() + s * (t[:, c:c + r] @ B.to(y.dtype).float().t())).to(y.dtype)
    return y


def lora_expand_(y: Tensor, lora: LoraDelta, tiling: Tiling = DEFAULT_TILING) -> Tensor:
    """Apply a pending expand to y in place (the expand launch of ``lora_apply_``)."""
    part, Bs = lora.part, lora.Bs
    floats = FLOATS
    if not (HAS_TRITON and (y.is_cuda or (interpreting() and y.device.type == "cpu")) and y.dtype in floats
            and y.dim() == 2 and y.stride(1) == 1 and len({b.dtype for b in Bs}) == 1 and Bs[0].dtype in floats
            and all(b.stride(1) == 1 for b in Bs) and 1 <= len(Bs) <= MAX_ADAPTERS):
        return lora_expand_ref_(y, lora)
    m, n_ad = part.p.shape[1], len(Bs)
    if m == 0:
        return y
    pad = _pad
    ranks, cols = part.ranks, pad(part.cols, 0)
    r3, n3, Bs3 = pad(ranks, 0), pad([b.shape[0] for b in Bs], 0), pad(Bs, Bs[0])
    block_m, cols_per_program = tiling.block_m, 64 * tiling.n_blocks
    _expand_kernel[(triton.cdiv(max(n3), cols_per_program), n_ad, triton.cdiv(m, block_m))](
        y, part.p, part.a_like, *Bs3, m, part.p.shape[2], y.stride(0), *[b.stride(0) for b in Bs3], *n3,
        *pad(lora.offsets, 0), *r3, cols[1], cols[2], *[float(s) for s in pad(lora.scales, 0.0)],
        SPLITS=part.splits, IEEE=y.dtype == torch.float32, INTERPRET=interpreting(), BLOCK_M=block_m, BLOCK_N=64,
        BLOCK_R=lora.block_r, N_BLOCKS=tiling.n_blocks)
    return y


def lora_apply_(y: Tensor, x: Tensor, As: list[Tensor], Bs: list[Tensor], offsets: list[int],
                scales: list[float], tiling: Tiling | None = None) -> Tensor:
    """``lora_apply_ref_`` in two launches (``lora_shrink``, ``lora_expand_``, cut as ``tiling`` says;
    None: ``tiling_for`` the row count) where ``kernels_take`` says so; y is updated in place."""
    if not kernels_take(y, x, As, Bs):
        return lora_apply_ref_(y, x, As, Bs, offsets, scales)
    if x.shape[0] == 0:
        return y
    tiling = tiling or tiling_for(x.shape[0])
    return lora_expand_(y, LoraDelta(lora_shrink(x, As, tiling), Bs, offsets, scales), tiling)
