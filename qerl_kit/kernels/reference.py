"""Plain-PyTorch references for the NVFP4, NF4 and MXFP4 kernels (the oracles; they run on any device).

Every kernel in this package computes one of these functions from the packed weight
(``packed`` uint8 [N, K/2], ``scales`` float8_e4m3fn [N, K/16], ``global_scale`` float32 [1]; see
``qerl_kit.nvfp4``) without ever materialising the dense weight W [N, K] in memory:

* ``nvfp4_linear_ref(x, ...)``: y = x @ W^T + bias   (forward; x [..., K] -> y [..., N])
* ``nvfp4_dgrad_ref(dy, ...)``: dx = dy @ W          (input gradient; dy [..., N] -> dx [..., K])

The references dequantize W to the activation dtype (``value * scale / global_scale`` in
float32, rounded once) and call torch's matmul, exactly what ``NVFP4Linear`` does on the
reference path. ``dtype=torch.float32`` gives the float32 references the tests measure error
against. ``lut4_linear_ref`` / ``lut4_dgrad_ref`` are the same for an NF4 or MXFP4 weight (``fmt``),
the references of ``lut4_triton``'s kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qerl_kit import mxfp4, nf4, nvfp4
from qerl_kit.dense_cache import cached, cached_or_none


def dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
               dtype: torch.dtype = torch.bfloat16, held_only: bool = False) -> torch.Tensor | None:
    """Dense W [N, K] from the three NVFP4 tensors (once per ``qerl_kit.dense_cache`` block where
    the block takes it: CPU generation, the training pass). ``held_only``: the block's copy (made now
    on its first call), or None where no open block holds it, instead of a per-call one."""
    return (cached_or_none if held_only else cached)(
        (packed, scales, global_scale), dtype,
        lambda: nvfp4.dequantize(nvfp4.NVFP4Tensor(packed, scales, global_scale), dtype),
        shape=(packed.shape[0], packed.shape[1] * 2), tag="nvfp4-reference")


def nvfp4_linear_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                     global_scale: torch.Tensor, bias: torch.Tensor | None = None,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ W^T + bias, computed in ``dtype`` (x's dtype by default)."""
    dtype = dtype or x.dtype
    w = dequantize(packed, scales, global_scale, dtype)
    return F.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))


def nvfp4_dgrad_ref(dy: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                    global_scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """dx = dy @ W, computed in ``dtype`` (dy's dtype by default)."""
    dtype = dtype or dy.dtype
    return dy.to(dtype) @ dequantize(packed, scales, global_scale, dtype)


def lut4_dequantize(packed: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype = torch.bfloat16,
                    held_only: bool = False) -> torch.Tensor | None:
    """Dense W [N, K] of an NF4 (``scales`` = absmax) or MXFP4 weight: the format's own ``dequantize``
    (once per generation call on the CPU: ``qerl_kit.dense_cache``); ``held_only`` as in ``dequantize``."""
    qt = nf4.NF4Tensor(packed, scales) if fmt == "nf4" else mxfp4.MXFP4Tensor(packed, scales)
    return (cached_or_none if held_only else cached)(
        (packed, scales), dtype, lambda: qt.dequantize(dtype),
        shape=(packed.shape[0], packed.shape[1] * 2), tag=fmt)  # the layer path's key (linear._dense)


def lut4_linear_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, fmt: str,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T + bias for an NF4 / MXFP4 weight, in x's dtype (what ``_FrozenQuantMatmul`` computes)."""
    return F.linear(x, lut4_dequantize(packed, scales, fmt, x.dtype), None if bias is None else bias.to(x.dtype))


def lut4_dgrad_ref(dy: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """dx = dy @ W for an NF4 / MXFP4 weight, in dy's dtype."""
    return dy @ lut4_dequantize(packed, scales, fmt, dy.dtype)
