"""One small interface over the weight formats, so experiments swap formats with one argument.

``get_format("nvfp4" | "mxfp4" | "nf4")`` returns a ``Format`` with ``quantize(w)``,
``dequantize(qt, dtype)``, ``block_size`` and ``bits_per_weight``; every quantized tensor has
``packed``, ``scales``, ``shape``, ``nbytes`` and ``dequantize(dtype)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from qerl_kit import mxfp4, nf4, nvfp4
from qerl_kit.config_types import short_repr


@dataclass(frozen=True)
class Format:
    name: str
    block_size: int
    bits_per_weight: float  # packed codes plus block scales, per weight
    quantize: Callable[..., Any]
    dequantize: Callable[..., torch.Tensor]
    description: str

    def error(self, w: torch.Tensor) -> float:
        """Relative Frobenius error ||W - deq(q(W))|| / ||W|| of this format on ``w``."""
        w32 = w.detach().to(torch.float32)
        deq = self.quantize(w).dequantize(torch.float32)
        return ((w32 - deq).norm() / w32.norm().clamp(min=1e-30)).item()


FORMATS: dict[str, Format] = {
    "nvfp4": Format("nvfp4", nvfp4.BLOCK_SIZE, nvfp4.BITS_PER_WEIGHT, nvfp4.quantize, nvfp4.dequantize,
                    "E2M1, blocks of 16, FP8-E4M3 scales, FP32 tensor scale"),
    "mxfp4": Format("mxfp4", mxfp4.BLOCK_SIZE, mxfp4.BITS_PER_WEIGHT, mxfp4.quantize, mxfp4.dequantize,
                    "E2M1, blocks of 32, power-of-two E8M0 scales"),
    "nf4": Format("nf4", nf4.BLOCK_SIZE, nf4.BITS_PER_WEIGHT, nf4.quantize, nf4.dequantize,
                  "NormalFloat-4 codebook, blocks of 64, FP32 absmax"),
}


def get_format(name: str) -> Format:
    """The format registered under ``name`` (case-insensitive); a clear error lists the choices."""
    key = name.lower() if isinstance(name, str) else None  # None, a number, a Format: named, not an AttributeError
    if key not in FORMATS:
        raise ValueError(f"unknown weight format {short_repr(name)}; choose one of {sorted(FORMATS)}")
    return FORMATS[key]
