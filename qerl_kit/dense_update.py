"""Dense base weights for the training pass, where memory allows.

The update phase calls every frozen 4-bit projection many times per step: a forward and an input
gradient per micro-batch (a second forward under gradient checkpointing), for each of the ``mu``
updates, after the log-prob pass's forwards. Each call dequantizes the weight again (on CUDA the
NVFP4 ``dense`` route and NF4's / MXFP4's ``lut4_dense``: Triton dequantize + cuBLAS; the CPU:
plain PyTorch). The frozen base never changes during a step (AQN's noise lives in the RMSNorm
scales, LoRA is separate), so one dense copy per weight per step gives the same results. ``update_cache(model, gib)`` is the
block the trainer opens around the log-prob pass and the update and leaves before the next
rollout (which needs the memory for its KV cache and reads the packed weights anyway): a
``qerl_kit.dense_cache`` block with CUDA tensors allowed, under a byte budget.

The budget (``model.dense_cache_gib``): ``0`` off; ``> 0`` that many GiB; ``None`` (auto):

* CUDA: the memory this step's block can take without cutting into what the training pass needs
  at the longest lengths the run allows. The first block of a model caches nothing and measures
  its working set; every block measures it again (what the block allocated at its peak beyond
  what was allocated on entry and what its cache held) and keeps the largest figure *per token*:
  bytes / (``tokens``: the block's widest forward, its rows x its width; the Trainer's
  ``step_phases.dense_block`` counts the widest micro-batch once trimmed). A later block takes
  the free memory (``torch.cuda.mem_get_info`` plus what PyTorch's allocator holds unused) minus
  1.25 x that rate x ``max_tokens`` (micro-batch x (P + ``rollout.max_new_tokens``): the completion
  length can grow up to the cap between steps, and the engine trims C to the batch's longest) minus
  max(1 GiB, 5% of the GPU) for allocator fragmentation. So a later step whose completions reach
  the cap still fits where the step that measured fitted, as long as its working set grows no
  faster than its tokens (activations and logits do; the 1.25 covers the rest, attention that
  grows faster than linearly in the length included only to that margin) and its prompts are no
  wider than this step's (P is the current batch's). The peak counter is not reset (benchmarks read
  it over whole steps): a block that set no new peak is charged the earlier one (with
  ``keep_cache=False``, say, the rollout's KV cache), an overstatement that only shrinks the
  cache. A step that runs out of memory anyway is not retried (its optimizer steps and RNG draws
  are already taken); set ``model.dense_cache_gib: 0`` and resume from the last checkpoint (a
  resume-neutral key, ``checkpoint.RESUME_NEUTRAL``).
* CPU: all dense projections when they take at most a quarter of the available RAM, else none.

On CUDA a block that held weights empties PyTorch's allocator cache on exit, on any exit (an error
too), when the caller says the rollout engine has its own allocator (``own_allocator``: vLLM waking
from sleep mode needs the memory back); an engine that shares PyTorch's allocator (the
StaticEngine, transformers' generate) reuses the cached blocks, and emptying would only sync the
device and make the next step allocate its working set again.

Rows below the NVFP4 dense route (under 128, ``kernels.routes``) keep their packed kernels: the
route table is unchanged, so every call computes what it computes without the cache (bit for bit
on the dense route), and at GRPO shapes the update's calls have thousands of rows anyway. A call on
a dense route takes the layers' held path (``qerl_kit.linear``): ``F.linear`` on the held W and
autograd's input gradient, one cache lookup per forward and none per backward.

``dense_projection_bytes(model)`` is the memory one block holds at most (bf16 bytes of every
quantized projection; ``memory_terms.dense_cache_all`` of a shape), for the memory planner too.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any, Iterator

import torch

from qerl_kit.config_types import DENSE_CACHE_GIB_WHY, check_value
from qerl_kit.dense_cache import DenseCacheBlock, dense_weight_cache

__all__ = ["update_cache", "cache_budget", "dense_projection_bytes", "DENSE_CACHE_GIB_WHY"]

GIB = 1 << 30
WORKING_SET_MARGIN = 1.25   # the working set is not quite linear in the tokens (attention, fixed buffers)
SLACK_MIN, SLACK_SHARE = GIB, 0.05  # allocator fragmentation: max(1 GiB, 5% of the GPU)
CPU_RAM_SHARE = 0.25        # auto on the CPU: the whole dense size if it is at most this share of free RAM

# The largest working set per token (bytes / tokens) measured in a block of each model on CUDA.
_working_set: "weakref.WeakKeyDictionary[torch.nn.Module, float]" = weakref.WeakKeyDictionary()


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
    from qerl_kit.memory_plan import layer_projections, model_shape
    from qerl_kit.memory_terms import dense_cache_all

    s = model_shape(model)
    return dense_cache_all(s, layer_projections(s), value_bytes=(dtype or torch.bfloat16).itemsize)


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


def _cuda_auto(model: torch.nn.Module, device: torch.device, max_tokens: int) -> int:
    rate = _working_set.get(model)
    if rate is None:
        return 0  # the first block measures the working set the training pass needs
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    slack = max(SLACK_MIN, int(SLACK_SHARE * total))
    return max(0, free - int(WORKING_SET_MARGIN * rate * max_tokens) - slack)


def cache_budget(model: torch.nn.Module, gib: float | None = None, device: torch.device | None = None,
                 max_tokens: int = 1) -> int:
    """The bytes an ``update_cache`` block of ``model`` may hold now (the module docstring's rule);
    ``max_tokens``: micro-batch x the longest (prompt + completion) a step of the run can train on."""
    gib = check_value("model.dense_cache_gib", gib, float | None, ge=0, why=DENSE_CACHE_GIB_WHY)
    if gib is not None:
        return int(gib * GIB)
    device = device or _device(model)
    if device.type == "cuda":
        return _cuda_auto(model, device, max_tokens)
    need = dense_projection_bytes(model)
    return need if need <= CPU_RAM_SHARE * available_ram() else 0


def _measure(model: torch.nn.Module, device: torch.device, start: int, held: int, tokens: int) -> None:
    """Keep the block's working set per token (the largest of the model's blocks): the allocator's
    peak since it was last reset, minus what was allocated on entry and what the cache held. The
    peak is the block's own when the block set it, else an earlier one (an overstatement)."""
    peak = torch.cuda.max_memory_allocated(device)
    rate = max(0, peak - start - held) / tokens
    _working_set[model] = max(_working_set.get(model, 0.0), rate)


@contextlib.contextmanager
def update_cache(model: torch.nn.Module, gib: float | None = None, *, tokens: int = 1, max_tokens: int | None = None,
                 own_allocator: bool = False) -> Iterator[DenseCacheBlock]:
    """Inside: each 4-bit projection of ``model`` is dequantized once and reused while the budget
    (``gib``, ``model.dense_cache_gib``) allows; every dense copy is freed on exit. Yields the block
    (``peak_bytes``, hits, misses, refused); with ``gib=0`` an empty one and nothing is cached.
    ``tokens``: micro-batch x (P + C) of this block's widest forward, ``max_tokens`` the same at the
    longest completion the run allows (default ``tokens``): the CUDA auto budget measures per token
    and reserves for ``max_tokens`` (the defaults 1, 1 measure and reserve the block's bytes as they
    are). ``own_allocator``: the rollout engine frees nothing to PyTorch's allocator (vLLM), so the
    allocator's cache is emptied on exit (CUDA only; on any exit, an error included)."""
    for key, value in (("tokens", tokens), ("max_tokens", max_tokens)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"update_cache: {key} must be an int >= 1 (micro-batch x sequence length); got {value!r}")
    device = _device(model)
    budget = cache_budget(model, gib, device, max(tokens, max_tokens or tokens))
    if gib == 0:
        yield DenseCacheBlock(budget_bytes=0, cuda=False)
        return
    cuda = device.type == "cuda"
    start = torch.cuda.memory_allocated(device) if cuda else 0
    block = None
    try:
        with dense_weight_cache(budget_bytes=budget, cuda=True) as block:
            yield block
            if cuda and gib is None:  # the working set: what the block allocated beyond its cache
                _measure(model, device, start, block.bytes_held, tokens)
    finally:  # the dense copies are gone (dense_weight_cache's own finally); give their memory back
        if cuda and own_allocator and block is not None and block.peak_bytes:
            torch.cuda.empty_cache()
