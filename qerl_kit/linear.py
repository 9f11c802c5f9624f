"""Frozen quantized linear layers: packed weights as buffers, dequantize-then-matmul forward.

``NVFP4Linear`` (and ``MXFP4Linear``, ``NF4Linear``) replace ``nn.Linear`` in a model whose base
weights stay frozen while LoRA adapters train. The weight lives only in its packed form: every
forward dequantizes it to the activation dtype, multiplies, and drops the dense copy; the
backward pass dequantizes again to compute the input gradient ``dx = dy @ W``. So, outside a
``qerl_kit.dense_cache`` block, no bf16 copy of a weight outlives a call; the base never receives a
gradient.

All three go through ``qerl_kit.kernels``, whose routing table picks the kernel on CUDA: NVFP4
humming-kernels or our kernels, NF4 and MXFP4 our ``lut4_triton`` kernels (a decode GEMV for few
rows, else a Triton dequantize + cuBLAS); elsewhere (the CPU) the plain-PyTorch reference.
A forward that needs no gradient (rollouts, evaluation) skips autograd's bookkeeping. On the CPU,
generation dequantizes each weight once per call, not once per token; the training pass (log-prob
pass + update) once per step where its memory budget allows, on any device
(``qerl_kit.dense_cache``, ``qerl_kit.dense_update``).

Inside such a block, a call whose routes are dense matmuls (NVFP4's ``dense`` from 128 rows on CUDA,
NF4's / MXFP4's ``lut4_dense``, the CPU's reference) takes the *held path*: ``F.linear`` on the block's
dense W, with autograd's own input gradient (``dy @ W``), the routed path's matmuls bit for bit. It
skips the Python autograd Function and the second route and cache lookup of every backward: the
host work per call of ``nn.Linear`` plus one lookup, which is what bounds a small model's update
(``kernels.held_weight``; ``bench/results/host_pass_cpu.md``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qerl_kit import kernels, mxfp4, nf4, nvfp4
from qerl_kit.dense_cache import cached, cached_or_none


def _dense(layer: "QuantLinear", dtype: torch.dtype) -> torch.Tensor:
    """The layer's dense weight in ``dtype``: dequantized now, or once per ``qerl_kit.dense_cache`` block
    (forward and backward share it: the same function of the same buffers)."""
    tensors = tuple(getattr(layer, name) for name in layer._tensor_fields)
    return cached(tensors, dtype, lambda: layer.dequantized_weight(dtype),
                  shape=(layer.out_features, layer.in_features), tag=layer.fmt)


class _FrozenQuantMatmul(torch.autograd.Function):
    """y = x @ W^T + b with W dequantized in forward and again in backward (MXFP4, NF4: the
    plain-PyTorch path), or read from the dense-weight cache inside its block."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: "QuantLinear") -> torch.Tensor:
        ctx.layer = layer
        bias = None if layer.bias is None else layer.bias.to(x.dtype)
        return F.linear(x, _dense(layer, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ _dense(ctx.layer, grad_out.dtype)
        return grad_x, None


class _RoutedMatmul(torch.autograd.Function):
    """y = layer._linear(x) for a weight whose matmuls the kernels route (``qerl_kit.kernels``: NVFP4's
    ``nvfp4_linear`` / ``nvfp4_dgrad``, NF4's and MXFP4's ``lut4_linear`` / ``lut4_dgrad``); the input
    gradient is ``layer._dgrad(grad_out)``, from the packed weight too. The layer (passed as before the
    two were one Function, so torch.compile traces the same call) brings its own two callables."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: "QuantLinear") -> torch.Tensor:
        ctx.layer = layer
        return layer._linear(x)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None
        return ctx.layer._dgrad(grad_out), None


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
    def block_scales(self) -> torch.Tensor:
        """The per-block scales (NVFP4/MXFP4 ``scales``, NF4 ``absmax``): the kernels' second operand."""
        return getattr(self, self._tensor_fields[1])

    @property
    def qweight(self) -> torch.Tensor:
        """The packed codes (as GPTQ layers name theirs): where the weight lives, for code that asks a
        layer for its device (peft places the adapter there). Not a dense weight."""
        return self.packed

    def __getattr__(self, name: str):
        if name == "weight":  # layer.weight @ x would silently compute with packed codes
            raise AttributeError(
                f"{type(self).__name__} stores its weight in {self.fmt.upper()} (packed codes and scales) and has no "
                "dense .weight; use dequantized_weight() for a dense copy, or call the layer")
        return super().__getattr__(name)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **quant_kwargs) -> "QuantLinear":
        qweight = cls.quantize_weight(linear.weight.data, **quant_kwargs)
        return cls(linear.in_features, linear.out_features, linear.bias, qweight,
                   compute_dtype=linear.weight.dtype)

    @staticmethod
    def quantize_weight(w: torch.Tensor, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError

    def _check_input(self, x: torch.Tensor) -> None:
        # nn.Linear refuses an integer input; the dequantize-then-matmul paths would cast the weight to
        # the input's dtype and return integers (all zeros for int64 token ids), silently
        if not x.is_floating_point():
            raise TypeError(f"{type(self).__name__} takes a floating-point input, as nn.Linear does; got {x.dtype} "
                            "(token ids go through the embedding first)")

    def _held(self, x2: torch.Tensor) -> torch.Tensor | None:
        """The dense weight an open ``qerl_kit.dense_cache`` block holds for this call, whose forward and
        input gradient are then ``F.linear`` and ``dy @ W`` with it; None where the call takes another
        path. Here the plain-PyTorch path, which always computes with the dense weight."""
        tensors = tuple(getattr(self, name) for name in self._tensor_fields)
        return cached_or_none(tensors, x2.dtype, lambda: self.dequantized_weight(x2.dtype),
                              shape=(self.out_features, self.in_features), tag=self.fmt)

    def _forward_held(self, x: torch.Tensor) -> torch.Tensor | None:
        """y = F.linear(x, W) with the block's W, autograd taking the input gradient (``dy @ W``, the
        routed path's matmul), or None outside a block that holds this call's W. The matmuls are the
        routed path's, bit for bit; the host work is nn.Linear's (no Python autograd Function)."""
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        w = self._held(x2)
        if w is None:
            return None
        # from _buffers (no Module.__getattr__ per call); through the attribute where the bias is no buffer
        bias = self._buffers["bias"] if "bias" in self._buffers else self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        y = F.linear(x2, w, bias)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        y = self._forward_held(x)
        return _FrozenQuantMatmul.apply(x, self) if y is None else y

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        y = self._forward_held(x)
        if y is not None:
            return y
        if x.requires_grad and torch.is_grad_enabled():
            return _RoutedMatmul.apply(x, self)
        return self._linear(x)

    def _held(self, x2: torch.Tensor) -> torch.Tensor | None:
        b = self._buffers  # once per call of every projection: no Module.__getattr__ for each buffer
        return kernels.held_weight(x2, b["packed"], b["scales"], b["global_scale"])

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.nvfp4_linear(x, self.packed, self.scales, self.global_scale, self.bias)

    def _dgrad(self, dy: torch.Tensor) -> torch.Tensor:
        return kernels.nvfp4_dgrad(dy, self.packed, self.scales, self.global_scale)


class _LUT4Linear(QuantLinear):
    """NF4 and MXFP4 layers: the routed kernels (``qerl_kit.kernels.lut4_linear``) where the routing
    table sends the call to one (CUDA tensors), else the plain-PyTorch path (the CPU's, unchanged).
    A subclass registered as another format (its own ``fmt``) keeps the plain-PyTorch path: the
    kernels know NF4's and MXFP4's layouts only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        y = self._forward_held(x)
        if y is not None:
            return y
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self.fmt not in kernels.routes.LUT4 or kernels.route(
                "forward", x2, self.packed, self.block_scales, fmt=self.fmt) == "reference":
            return _FrozenQuantMatmul.apply(x, self)
        if x.requires_grad and torch.is_grad_enabled():
            return _RoutedMatmul.apply(x, self)
        return self._linear(x)

    def _held(self, x2: torch.Tensor) -> torch.Tensor | None:
        if self.fmt not in kernels.routes.LUT4:  # another format's subclass: the plain-PyTorch path's W
            return super()._held(x2)
        b = self._buffers
        return kernels.held_weight(x2, b["packed"], b[self._tensor_fields[1]], None, self.fmt)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.lut4_linear(x, self.packed, self.block_scales, self.fmt, self.bias)

    def _dgrad(self, dy: torch.Tensor) -> torch.Tensor:
        return kernels.lut4_dgrad(dy, self.packed, self.block_scales, self.fmt)


class MXFP4Linear(_LUT4Linear):
    fmt = "mxfp4"
    _tensor_fields = ("packed", "scales")

    @staticmethod
    def quantize_weight(w: torch.Tensor) -> mxfp4.MXFP4Tensor:
        return mxfp4.quantize(w)

    def quant_tensor(self) -> mxfp4.MXFP4Tensor:
        return mxfp4.MXFP4Tensor(self.packed, self.scales)


class NF4Linear(_LUT4Linear):
    fmt = "nf4"
    _tensor_fields = ("packed", "absmax")

    @staticmethod
    def quantize_weight(w: torch.Tensor) -> nf4.NF4Tensor:
        return nf4.quantize(w)

    def quant_tensor(self) -> nf4.NF4Tensor:
        return nf4.NF4Tensor(self.packed, self.absmax)

