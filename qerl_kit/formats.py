"""The weight formats by name: ``FORMATS``, the one list of them, so experiments swap formats with one argument.

``get_format("nvfp4" | "mxfp4" | "nf4")`` returns a ``Format`` with ``quantize(w)``,
``dequantize(qt, dtype)``, ``block_size``, ``bits_per_weight`` and ``linear``, the frozen layer
class (a ``qerl_kit.linear.QuantLinear`` subclass) that ``quantize_model`` swaps in and LoRA wraps;
every quantized tensor has ``packed``, ``scales``, ``shape``, ``nbytes`` and ``dequantize(dtype)``.

Every name list of formats is read from here: the config's ``model.format``, the CLI's ``--format``
choices and the experiment grid take ``format_names(dense=True)`` (the formats plus ``none``, a bf16
base). A new format is one ``register_format(Format(...))`` call, as a loss, a task or a rollout
backend is one ``register_*`` call (docs/architecture.md); the shipped ones are ``FORMATS``' rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from qerl_kit import mxfp4, nf4, nvfp4
from qerl_kit.config_types import short_repr
from qerl_kit.linear import MXFP4Linear, NF4Linear, NVFP4Linear, QuantLinear

DENSE = "none"  # the value of model.format (and --format) for a bf16 base with LoRA: no quantization


@dataclass(frozen=True)
class Format:
    name: str
    block_size: int
    bits_per_weight: float  # packed codes plus block scales, per weight
    quantize: Callable[..., Any]
    dequantize: Callable[..., torch.Tensor]
    description: str
    linear: type[QuantLinear]  # the frozen layer that holds a weight in this format

    def error(self, w: torch.Tensor) -> float:
        """Relative Frobenius error ||W - deq(q(W))|| / ||W|| of this format on ``w``."""
        w32 = w.detach().to(torch.float32)
        deq = self.quantize(w).dequantize(torch.float32)
        return ((w32 - deq).norm() / w32.norm().clamp(min=1e-30)).item()


FORMATS: dict[str, Format] = {
    "nvfp4": Format("nvfp4", nvfp4.BLOCK_SIZE, nvfp4.BITS_PER_WEIGHT, nvfp4.quantize, nvfp4.dequantize,
                    "E2M1, blocks of 16, FP8-E4M3 scales, FP32 tensor scale", NVFP4Linear),
    "mxfp4": Format("mxfp4", mxfp4.BLOCK_SIZE, mxfp4.BITS_PER_WEIGHT, mxfp4.quantize, mxfp4.dequantize,
                    "E2M1, blocks of 32, power-of-two E8M0 scales", MXFP4Linear),
    "nf4": Format("nf4", nf4.BLOCK_SIZE, nf4.BITS_PER_WEIGHT, nf4.quantize, nf4.dequantize,
                  "NormalFloat-4 codebook, blocks of 64, FP32 absmax", NF4Linear),
}


def get_format(name: str) -> Format:
    """The format registered under ``name`` (case-insensitive); a clear error lists the choices."""
    key = name.lower() if isinstance(name, str) else None  # None, a number, a Format: named, not an AttributeError
    if key not in FORMATS:
        raise ValueError(f"unknown weight format {short_repr(name)}; choose one of {sorted(FORMATS)}")
    return FORMATS[key]


def register_format(fmt: Format) -> Format:
    """Make ``fmt.name`` a value of ``model.format``, ``--format``, ``quantize_model(fmt=)`` and the
    experiment grid, with ``fmt.linear`` the layer ``quantize_model`` swaps in (LoRA wraps it too).
    The name is a lowercase identifier other than ``none`` (the bf16 base); registering a name again
    replaces its row."""
    if not isinstance(fmt, Format):
        raise TypeError(f"register_format takes a qerl_kit.formats.Format; got {type(fmt).__name__}")
    if not (isinstance(fmt.name, str) and fmt.name.isidentifier() and fmt.name == fmt.name.lower()) or fmt.name == DENSE:
        raise ValueError(f"a format name must be a lowercase identifier other than {DENSE!r} (the bf16 base); "
                         f"got {short_repr(fmt.name)}")
    if not (isinstance(fmt.linear, type) and issubclass(fmt.linear, QuantLinear)):
        raise TypeError(f"format {fmt.name!r}: linear must be a qerl_kit.linear.QuantLinear subclass; got "
                        f"{short_repr(fmt.linear)}")
    FORMATS[fmt.name] = fmt
    return fmt


def format_names(dense: bool = True) -> tuple[str, ...]:
    """The registered format names, read now (a format registered at runtime is in), followed by
    ``none`` (a bf16 base, no quantization) when ``dense``."""
    return (*FORMATS, DENSE) if dense else tuple(FORMATS)
