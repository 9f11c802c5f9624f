"""Dequantize each frozen 4-bit weight once per block, not at every call.

A 4-bit layer dequantizes its weight at every call: the plain-PyTorch path (the CPU) and, on
CUDA, the dense routes (NVFP4's ``dense``: Triton dequantize + cuBLAS from 128 rows; NF4's and
MXFP4's ``lut4_dense``: Triton dequantize + cuBLAS above 64 rows and for every input gradient) alike.
Generation calls every layer once per token, and a training step calls it once per forward and
once per backward (a third time under gradient checkpointing), in every micro-batch of every one
of the ``mu`` updates. Inside ``dense_weight_cache()``, ``cached(tensors, dtype, make)`` keeps
the dense weight of each packed weight it has seen and returns it again; on leaving, every dense
copy is dropped, so the 4-bit model's memory is back to 4 bits between blocks.

Two users:

* generation (``qerl_kit.rollout.base.inference``): ``dense_weight_cache()``, no budget, CUDA
  tensors never cached (the CPU's plain-PyTorch path; on CUDA the decode kernels read the packed
  weight directly);
* the training pass (``qerl_kit.dense_update.update_cache``, around the log-prob pass and the
  update): ``dense_weight_cache(budget_bytes=..., cuda=True)``. A weight is cached while the
  budget allows (first come, first cached); a weight that would exceed it is refused and
  dequantized per call as without the block.

Exact: a cached weight is the tensor the uncached path computes for that call (the same function
``make`` of the same frozen buffers; ``tag`` names the function, so the NVFP4 Triton dequantize
and the plain-PyTorch one never share an entry; NF4's and MXFP4's Triton dequantize is bit for bit
the format's plain-PyTorch ``dequantize``, tested, so those paths share the tag ``nf4`` / ``mxfp4``). Keys are the packed tensors themselves (storage,
offset, shape, strides) and the entry holds them, so a freed and reused address can never hit;
the entry also records their in-place versions, and a weight changed in place inside the block is
dequantized again (its stale copy dropped), never served stale.

``block_stats()`` reads the open block (bytes held, peak, hits, misses, weights refused for the
budget); ``cache_stats()`` the process's counters since it started.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

__all__ = ["dense_weight_cache", "cached", "cached_or_none", "takes", "cache_stats", "block_stats", "DenseCacheBlock"]


@dataclass
class DenseCacheBlock:
    """One ``dense_weight_cache`` block: its budget and what it did. ``bytes_held`` drops to 0 on
    exit; ``peak_bytes`` and the counters stay readable after it (the trainer's metric)."""

    budget_bytes: int | None  # None: no limit
    cuda: bool                # whether CUDA tensors are cached too
    bytes_held: int = 0
    peak_bytes: int = 0
    hits: int = 0
    misses: int = 0           # weights dequantized and stored
    refused: int = 0          # distinct weights refused for the budget (dequantized per call instead)
    entries: dict = field(default_factory=dict, repr=False)
    _refused_keys: set = field(default_factory=set, repr=False)
    # (id of the first key tensor, dtype, tag) -> key of ``entries``: a hit without building the full key
    _by_id: dict = field(default_factory=dict, repr=False)

    def _drop(self, key) -> None:
        dense, tensors = self.entries.pop(key)[:2]
        self._by_id.pop((id(tensors[0]), key[1], key[0]), None)
        self.bytes_held -= _nbytes(dense.shape, dense.dtype)


_block: DenseCacheBlock | None = None
_stats = {"hits": 0, "misses": 0, "refused": 0}


@contextlib.contextmanager
def dense_weight_cache(enabled: bool = True, *, budget_bytes: int | None = None,
                       cuda: bool = False) -> Iterator[DenseCacheBlock | None]:
    """Cache dense weights inside this block, under ``budget_bytes`` (None: no limit), CUDA tensors
    only with ``cuda=True``. Yields the block (None when disabled). Nested blocks share the outer
    block (and its budget)."""
    global _block
    if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 0):
        raise ValueError(f"budget_bytes must be None or an int >= 0; got {budget_bytes!r}")
    if not enabled or _block is not None:
        yield _block if enabled else None
        return
    _block = block = DenseCacheBlock(budget_bytes, cuda)
    try:
        yield block
    finally:
        block.entries.clear()  # the dense copies go now, not when the caller drops the block
        block._by_id.clear()
        block.bytes_held = 0
        _block = None


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _key(tensors: Sequence[torch.Tensor], dtype: torch.dtype, tag: str) -> tuple:
    return (tag, dtype) + tuple((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
                                for t in tensors)


def _cacheable(block: DenseCacheBlock | None, tensors: Sequence[torch.Tensor]) -> bool:
    if block is None or (tensors[0].is_cuda and not block.cuda) or torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def takes(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether an open block caches the dense weight of these packed tensors (budget aside): a block
    is open, it takes their device, nothing is being compiled and they need no gradient."""
    return _cacheable(_block, tensors)


def _hit(block: DenseCacheBlock, tensors: Sequence[torch.Tensor], dtype: torch.dtype, tag: str):
    """The entry's dense weight when ``tensors`` are the very tensor objects an entry holds (the
    identity lookup: ``id`` is unique while the entry keeps them alive) at the versions it recorded;
    else None and the caller looks the full key up."""
    key = block._by_id.get((id(tensors[0]), dtype, tag))
    if key is None:
        return None
    dense, held, versions = block.entries[key]
    if len(held) != len(tensors) or any(a is not b or a._version != v for a, b, v in zip(held, tensors, versions)):
        return None
    return dense


def cached_or_none(tensors: Sequence[torch.Tensor], dtype: torch.dtype, make: Callable[[], torch.Tensor], *,
                   shape: Sequence[int] | None = None, tag: str = "") -> torch.Tensor | None:
    """The cached ``make()`` of these packed ``tensors`` (computed now on the first call), or None
    without calling ``make`` where no block is open, the block does not take these tensors, or the
    budget refuses them (``shape``: the dense weight's, so the budget is checked before computing;
    without it the weight is computed, then refused if it does not fit)."""
    block = _block
    if not _cacheable(block, tensors):
        return None
    dense = _hit(block, tensors, dtype, tag)
    if dense is not None:
        block.hits += 1
        _stats["hits"] += 1
        return dense
    key = _key(tensors, dtype, tag)
    versions = tuple(t._version for t in tensors)
    entry = block.entries.get(key)
    if entry is not None:
        if entry[2] == versions:
            block.hits += 1
            _stats["hits"] += 1
            return entry[0]
        block._drop(key)  # changed in place inside the block: the old dense copy is stale
    dense = None
    if shape is None:
        dense = make()
        shape = dense.shape
    if block.budget_bytes is not None and block.bytes_held + _nbytes(shape, dtype) > block.budget_bytes:
        if key not in block._refused_keys:
            block._refused_keys.add(key)
            block.refused += 1
            _stats["refused"] += 1
        return dense  # refused: None (the caller computes it per call), or the one computed above, uncached
    dense = make() if dense is None else dense
    block.entries[key] = (dense, tuple(tensors), versions)  # the key tensors stay alive while their entry does
    block._by_id[(id(tensors[0]), dtype, tag)] = key
    block.bytes_held += _nbytes(dense.shape, dense.dtype)
    block.peak_bytes = max(block.peak_bytes, block.bytes_held)
    block.misses += 1
    _stats["misses"] += 1
    return dense


def cached(tensors: Sequence[torch.Tensor], dtype: torch.dtype, make: Callable[[], torch.Tensor], *,
           shape: Sequence[int] | None = None, tag: str = "") -> torch.Tensor:
    """``make()`` (a dense weight computed from ``tensors``), computed once per cache block where
    the block takes it (``cached_or_none``), else at every call."""
    dense = cached_or_none(tensors, dtype, make, shape=shape, tag=tag)
    return make() if dense is None else dense


def block_stats() -> dict:
    """The open block's budget, bytes held, peak, entries, hits, misses, refused ({} outside a block)."""
    b = _block
    if b is None:
        return {}
    return {"budget_bytes": b.budget_bytes, "bytes_held": b.bytes_held, "peak_bytes": b.peak_bytes,
            "entries": len(b.entries), "hits": b.hits, "misses": b.misses, "refused": b.refused}


def cache_stats() -> dict:
    """Hits, misses and refusals since the process started (tests and benchmarks read the difference)."""
    return dict(_stats)
