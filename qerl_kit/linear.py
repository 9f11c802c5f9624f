"""Frozen quantized linear layers: packed weights as buffers, dequantize-then-matmul forward.

``NVFP4Linear`` (and ``MXFP4Linear``, ``NF4Linear``) replace ``nn.Linear`` in a model whose base
weights stay frozen while LoRA adapters train. The weight lives only in its packed form: every
forward dequantizes it to the activation dtype, multiplies, and drops the dense copy; the
backward pass dequantizes again to compute the input gradient ``dx = dy @ W``. So no bf16 copy of
a weight outlives a call, and the base never receives a gradient.

This module is the plain-PyTorch reference path that runs everywhere; the fused Triton kernels
for CUDA come in behind the same layer (``qerl_kit.kernels``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qerl_kit import mxfp4, nf4, nvfp4


class _FrozenQuantMatmul(torch.autograd.Function):
    """y = x @ W^T + b with W dequantized on the fly in forward and again in backward.

    NVFP4 layers go through ``qerl_kit.kernels`` (fused Triton kernels on CUDA, which never build
    the dense weight; this same reference elsewhere, see ``qerl_kit.kernels.backend``); MXFP4
    and NF4 always take the reference path.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: "QuantLinear") -> torch.Tensor:
        ctx.layer = layer
        bias = None if layer.bias is None else layer.bias.to(x.dtype)
        if layer.fmt == "nvfp4":
            from qerl_kit import kernels

            if kernels.resolve(x) is kernels.Backend.TRITON:
                return kernels.nvfp4_linear(x, layer.packed, layer.scales, layer.global_scale, bias,
                                            backend=kernels.Backend.TRITON)
        return F.linear(x, layer.dequantized_weight(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_x = None
        if ctx.needs_input_grad[0]:
            layer = ctx.layer
            if layer.fmt == "nvfp4":
                from qerl_kit import kernels

                if kernels.resolve(grad_out) is kernels.Backend.TRITON:
                    grad_x = kernels.nvfp4_dgrad(grad_out, layer.packed, layer.scales,
                                                 layer.global_scale, backend=kernels.Backend.TRITON)
                    return grad_x, None
            grad_x = grad_out @ layer.dequantized_weight(grad_out.dtype)
        return grad_x, None


class QuantLinear(nn.Module):
    """Base class: a frozen linear layer whose weight is stored in a 4-bit format."""

    fmt: str = ""
    _tensor_fields: tuple[str, ...] = ()

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None,
                 qweight, compute_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = compute_dtype
        for name in self._tensor_fields:
            self.register_buffer(name, getattr(qweight, name))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    # Subclasses rebuild their format's tensor from the buffers.
    def quant_tensor(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A fresh dense copy of the weight [out, in] (for references and tests; not cached)."""
        return self.quant_tensor().dequantize(dtype or self.compute_dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The packed codes, so code that asks a layer for ``.weight`` (device, dtype) finds a tensor.

        This is *not* a dense weight: use ``dequantized_weight()`` for that.
        """
        return self.packed

    @classmethod
    def from_linear(cls, linear: nn.Linear, **quant_kwargs) -> "QuantLinear":
        qweight = cls.quantize_weight(linear.weight.data, **quant_kwargs)
        return cls(linear.in_features, linear.out_features, linear.bias, qweight,
                   compute_dtype=linear.weight.dtype)

    @staticmethod
    def quantize_weight(w: torch.Tensor, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FrozenQuantMatmul.apply(x, self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={self.fmt}")


class NVFP4Linear(QuantLinear):
    fmt = "nvfp4"
    _tensor_fields = ("packed", "scales", "global_scale")

    @staticmethod
    def quantize_weight(w: torch.Tensor, global_scale=None) -> nvfp4.NVFP4Tensor:
        return nvfp4.quantize(w, global_scale=global_scale)

    def quant_tensor(self) -> nvfp4.NVFP4Tensor:
        return nvfp4.NVFP4Tensor(self.packed, self.scales, self.global_scale)


class MXFP4Linear(QuantLinear):
    fmt = "mxfp4"
    _tensor_fields = ("packed", "scales")

    @staticmethod
    def quantize_weight(w: torch.Tensor) -> mxfp4.MXFP4Tensor:
        return mxfp4.quantize(w)

    def quant_tensor(self) -> mxfp4.MXFP4Tensor:
        return mxfp4.MXFP4Tensor(self.packed, self.scales)


class NF4Linear(QuantLinear):
    fmt = "nf4"
    _tensor_fields = ("packed", "absmax")

    @staticmethod
    def quantize_weight(w: torch.Tensor) -> nf4.NF4Tensor:
        return nf4.quantize(w)

    def quant_tensor(self) -> nf4.NF4Tensor:
        return nf4.NF4Tensor(self.packed, self.absmax)


LINEAR_CLASSES: dict[str, type[QuantLinear]] = {
    "nvfp4": NVFP4Linear, "mxfp4": MXFP4Linear, "nf4": NF4Linear,
}
