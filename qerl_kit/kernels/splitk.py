"""Split-K for the NVFP4 decode kernels: how many slices of K, and the arrival counters.

A decode call has few rows, so a grid over N alone leaves most SMs idle; the Triton decode kernels
(``nvfp4_gemv_triton``, ``nvfp4_blockdot_triton``) and the CUDA one (``nvfp4_decode_cuda``) split K
into slices. Each slice parks a float32 partial tile; the last to arrive (an int32 counter per N
tile, reset by it) sums them in slice order and writes y: one launch, no memset, deterministic.
This module holds the host-side choice of the split, the counters, and the Triton pieces both
Triton kernels share (the slice bounds and the launch heuristics).
"""

from __future__ import annotations

import torch

from qerl_kit.kernels.nvfp4_gemm_triton import HAS_TRITON

MAX_SPLIT_K = 8
COUNTER_SLOTS = 1 << 16  # arrival counters per device, one per N tile (N / 16 at most)
_SMS: list[int] = []
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def sm_count() -> int:
    """Streaming multiprocessors of the current CUDA device (8 without one), read once per process."""
    if not _SMS:
        _SMS.append(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
                    if torch.cuda.is_available() else 8)
    return _SMS[0]


def choose_split_k(n: int, k: int, block_n: int, block_k: int, ctas_per_sm: int = 2) -> int:
    """Split K until the grid has ``ctas_per_sm`` programs per SM, keeping >= 2 K tiles a slice."""
    tiles = -(-n // block_n)
    k_tiles = -(-k // block_k)
    split = 1
    while split < MAX_SPLIT_K and tiles * split < ctas_per_sm * sm_count() and k_tiles >= 4 * split:
        split *= 2
    return split


def arrival_counters(device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters that split-K programs leave at zero again (allocated once, eagerly)."""
    buf = _COUNTERS.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("call nvfp4_gemv once outside CUDA-graph capture first (warm-up)")
        buf = _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf


if HAS_TRITON:
    import triton
    import triton.language as tl

    def even_k(args) -> bool:
        """Launch heuristic: K is a whole number of BLOCK_K tiles (no masks on K)."""
        return args["K"] % args["BLOCK_K"] == 0

    def split_k(args) -> int:
        """Launch heuristic: SPLIT_K from the shape and the config's CTAS_PER_SM."""
        return choose_split_k(args["N"], args["K"], args["BLOCK_N"], args["BLOCK_K"], args["CTAS_PER_SM"])

    @triton.jit
    def k_slice(pid_k, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        """[k_start, k_end): the pid_k-th of SPLIT_K slices of K, whole BLOCK_K tiles each."""
        k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_start = pid_k * k_per_split
        return k_start, min(K, k_start + k_per_split)
