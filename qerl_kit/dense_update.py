"""Dense base weights for the training pass, where memory allows.

The update phase calls every frozen 4-bit projection many times per step: a forward and an input
gradient per micro-batch (a second forward under gradient checkpointing), for each of the ``mu``
updates, after the log-prob pass's forwards. Each call dequantizes the weight again (on CUDA the
NVFP4 ``dense`` route and NF4's / MXFP4's ``lut4_dense``: Triton dequantize + cuBLAS; the CPU:
plain PyTorch). The frozen base never changes during a step (AQN's noise lives in the RMSNorm
scales, LoRA is separate), so one dense copy per weight per step gives the same results. ``update_cache(model, gib)`` is the
block the trainer opens around the log-prob pass and the update and leaves before the next
rollout (which needs the memory for its KV cache and reads the packed weights anyway): a
``qerl_kit.dense_cache`` block with CUDA tensors allowed, under a byte budget. On CUDA a block that
held weights empties PyTorch's allocator cache on exit, so an engine with its own allocator (vLLM
waking from sleep mode) gets the memory back.

The budget (``model.dense_cache_gib``): ``0`` off; ``> 0`` that many GiB; ``None`` (auto):

* CUDA: the memory this step's block can take without cutting into what the training pass itself
  needs. The first block of a model caches nothing and measures its working set (the peak
  allocated during the block, an upper bound: a higher earlier peak only overstates it, minus
  what was allocated on entry and what the cache held); later blocks take the free memory
  (``torch.cuda.mem_get_info`` plus what PyTorch's allocator holds unused) minus 1.25x the
  largest working set measured (completion lengths vary between steps) minus max(1 GiB, 5% of the
  GPU) for allocator fragmentation. So a step that fit without the cache still fits with it.
* CPU: all dense projections when they take at most a quarter of the available RAM, else none.

Rows below the NVFP4 dense route (under 128, ``kernels.routes``) keep their packed kernels: the
route table is unchanged, so every call computes what it computes without the cache (bit for bit
on the dense route), and at GRPO shapes the update's calls have thousands of rows anyway.

``dense_projection_bytes(model)`` is the memory one block holds at most (bf16 bytes of every
quantized projection), for the memory planner too.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any, Iterator

import torch

from qerl_kit.config_types import check_value
from qerl_kit.dense_cache import DenseCacheBlock, dense_weight_cache

__all__ = ["update_cache", "cache_budget", "dense_projection_bytes", "DENSE_CACHE_GIB_WHY"]

GIB = 1 << 30
DENSE_CACHE_GIB_WHY = "GiB of dense base weights kept for the log-prob pass + update; 0 = off, null = auto"
WORKING_SET_MARGIN = 1.25   # completion lengths, and so activations, vary between steps
SLACK_MIN, SLACK_SHARE = GIB, 0.05  # allocator fragmentation: max(1 GiB, 5% of the GPU)
CPU_RAM_SHARE = 0.25        # auto on the CPU: the whole dense size if it is at most this share of free RAM

# The largest working set (bytes) measured in a block of each model on CUDA; the first block measures.
_working_set: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()


def dense_projection_bytes(model: Any, dtype: torch.dtype | None = None) -> int:
    """Bytes of the dense copies of every quantized projection in ``dtype``: the most one
    ``update_cache`` block holds. ``model``: a model object (its 4-bit layers, each in its compute
    dtype unless ``dtype`` is given), or what ``qerl_kit.memory_plan.model_shape`` takes (a preset
    name, a transformers config, a dict: the seven projections of every decoder layer, as the
    planner counts them; bf16 unless ``dtype`` is given)."""
    if isinstance(model, torch.nn.Module):
        from qerl_kit.linear import QuantLinear

        return sum(m.in_features * m.out_features * (dtype or m.compute_dtype).itemsize
                   for m in model.modules() if isinstance(m, QuantLinear))
    size = (dtype or torch.bfloat16).itemsize
    from qerl_kit.memory_plan import model_shape

    s = model_shape(model)
    h, q, kv, i = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["inter"]
    return size * s["layers"] * (2 * h * q + 2 * h * kv + 3 * h * i)


def _device(model: torch.nn.Module) -> torch.device:
    """Where the 4-bit weights live (the first 4-bit layer's codes, else the first parameter; the CPU
    for an empty model)."""
    from qerl_kit.linear import QuantLinear

    for module in model.modules():
        if isinstance(module, QuantLinear):
            return module.packed.device
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def available_ram() -> int:
    """Bytes of RAM available to a new allocation (Linux's MemAvailable; free pages elsewhere; 0 unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _cuda_auto(model: torch.nn.Module, device: torch.device) -> int:
    measured = _working_set.get(model)
    if measured is None:
        return 0  # the first block measures the working set the training pass needs
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    slack = max(SLACK_MIN, int(SLACK_SHARE * total))
    return max(0, free - int(WORKING_SET_MARGIN * measured) - slack)


def cache_budget(model: torch.nn.Module, gib: float | None = None, device: torch.device | None = None) -> int:
    """The bytes an ``update_cache`` block of ``model`` may hold now (the module docstring's rule)."""
    gib = check_value("model.dense_cache_gib", gib, float | None, ge=0, why=DENSE_CACHE_GIB_WHY)
    if gib is not None:
        return int(gib * GIB)
    device = device or _device(model)
    if device.type == "cuda":
        return _cuda_auto(model, device)
    need = dense_projection_bytes(model)
    return need if need <= CPU_RAM_SHARE * available_ram() else 0


@contextlib.contextmanager
def update_cache(model: torch.nn.Module, gib: float | None = None) -> Iterator[DenseCacheBlock]:
    """Inside: each 4-bit projection of ``model`` is dequantized once and reused while the budget
    (``gib``, ``model.dense_cache_gib``) allows; every dense copy is freed on exit. Yields the block
    (``peak_bytes``, hits, misses, refused); with ``gib=0`` an empty one and nothing is cached."""
    device = _device(model)
    budget = cache_budget(model, gib, device)
    if gib == 0:
        yield DenseCacheBlock(budget_bytes=0, cuda=False)
        return
    cuda = device.type == "cuda"
    start = torch.cuda.memory_allocated(device) if cuda else 0
    with dense_weight_cache(budget_bytes=budget, cuda=True) as block:
        yield block
        if cuda and gib is None:  # the working set: what the block allocated beyond its cache
            peak = torch.cuda.max_memory_allocated(device)
            _working_set[model] = max(_working_set.get(model, 0), peak - start - block.bytes_held)
    if cuda and block.peak_bytes:
        # Give the dense copies back to the device, not only to PyTorch's allocator: a rollout engine
        # with its own allocator (vLLM waking from sleep mode) could not use them otherwise.
        torch.cuda.empty_cache()
