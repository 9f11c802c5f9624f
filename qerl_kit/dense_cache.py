"""Dequantize each frozen 4-bit weight once per generation call on the CPU, not at every token.

A 4-bit layer's plain-PyTorch path (the only one on the CPU) dequantizes its weight at every call:
fine for one training forward, ruinous for generation, where each new token calls every layer
again (a 0.5B NVFP4 model spent most of each decode step dequantizing). Inside
``dense_weight_cache()``, ``cached(tensors, dtype, make)`` keeps the dense weight of each packed
weight it has seen and returns it again; on leaving, every dense copy is dropped, so the 4-bit
model's memory is back to 4 bits between calls. The rollout engines enter it around generation
when the model is on the CPU (``qerl_kit.rollout.base.inference``).

Exact: a cached weight is the same tensor the uncached path would compute (the same function of
the same frozen buffers). Keys are the packed tensors themselves (storage, shape, strides,
in-place version) and the entry holds them, so a freed and reused address can never hit. CUDA
tensors are never cached: the GPU kernels read the packed weight directly.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch

__all__ = ["dense_weight_cache", "cached", "cache_stats"]

_cache: dict | None = None
_stats = {"hits": 0, "misses": 0}


@contextlib.contextmanager
def dense_weight_cache(enabled: bool = True) -> Iterator[None]:
    """Cache dense weights inside this block (nested blocks share the outer cache)."""
    global _cache
    if not enabled or _cache is not None:
        yield
        return
    _cache = {}
    try:
        yield
    finally:
        _cache = None


def _key(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> tuple:
    return (dtype,) + tuple((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
                             t._version) for t in tensors)


def cached(tensors: Sequence[torch.Tensor], dtype: torch.dtype, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()`` (a dense weight computed from ``tensors``), computed once per cache block on the CPU."""
    if _cache is None or tensors[0].is_cuda or torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return make()
    key = _key(tensors, dtype)
    hit = _cache.get(key)
    if hit is not None:
        _stats["hits"] += 1
        return hit[0]
    _stats["misses"] += 1
    dense = make()
    _cache[key] = (dense, tuple(tensors))  # the key tensors stay alive while their entry does
    return dense


def cache_stats() -> dict:
    """Hits and misses since the process started (tests and benchmarks read the difference)."""
    return dict(_stats)
