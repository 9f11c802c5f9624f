"""peft's LoRA ``Linear`` with the adapter's product added inside the GEMM: the training pass's LoRA.

peft computes ``result + lora_B(lora_A(dropout(x))) * scaling``: besides the two small matmuls, a
multiply and an add over the whole ``[tokens, out_features]`` output, and in the backward pass
another multiply of the output's gradient by ``scaling``. On a GRPO micro-batch those are three
extra passes over tensors as large as the projection's output (at 7B, gate/up: 6144 x 18944 per
micro-batch), for each of the seven projections, in the forward, the checkpointed recompute and the
backward. ``FusedLoraLinear`` computes the same sum as

    h = lora_A(dropout(x))                                   # [tokens, r]
    y = addmm(base(x), h, lora_B.weight.T, alpha=scaling)    # scale and add in the GEMM's epilogue

so the only full-size work left is the base GEMM and the one that adds the adapter (the backward's
scale multiplies [tokens, r] and [r, out] tensors); the product is rounded to the compute dtype
once, where peft rounds it three times. Its host work per call is peft's (tiny layers on one CPU
thread, fp32, forward + backward: the same microseconds). Everything else (several or
disabled adapters, ``adapter_names`` batches, DoRA and other variants, LoRA biases, autocast, mixed
dtypes) goes to peft's own ``forward`` unchanged.

``PlainLinear`` is the key that registers it for ``torch.nn.Linear`` itself (the bf16 baseline),
not for its subclasses: bitsandbytes' ``Linear4bit`` is one, and keeps peft's own layer (the
field's QLoRA, as the step benchmark's NF4 baseline measures it).
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear as PeftLoraLinear


_LARGEST = {dt: torch.finfo(dt).max for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


class _ExactLinear(type):
    def __instancecheck__(cls, obj) -> bool:
        return type(obj) is torch.nn.Linear


class PlainLinear(metaclass=_ExactLinear):
    """``isinstance(m, PlainLinear)``: ``m`` is a ``torch.nn.Linear`` and not of a subclass (peft's
    custom-module dispatch matches with isinstance)."""


class FusedLoraLinear(PeftLoraLinear):
    """peft's LoRA Linear, y = base(x) + B(A(dropout(x))) * scale, the add done by the GEMM."""

    def _fused_adapter(self, x: torch.Tensor, args, kwargs) -> str | None:
        """The one vanilla adapter the fused path computes, or None: peft's forward then runs. (Plain
        attribute reads: this runs at every call of every projection, where the host bounds a small
        model's training pass.)"""
        if args or kwargs or self._disable_adapters or self.merged_adapters or torch.is_autocast_enabled(x.device.type):
            return None
        name = self.active_adapter
        if not isinstance(name, str):
            if len(name) != 1:
                return None
            name = name[0]
        if name not in self.lora_A or name in getattr(self, "lora_variant", ()):  # DoRA and the like
            return None
        b = self.lora_B[name]
        if b.bias is not None or not x.dtype == self.lora_A[name].weight.dtype == b.weight.dtype:
            return None
        # addmm refuses an alpha its dtype cannot hold; peft's multiply makes the inf that the run's
        # non-finite check then names (model.lora_alpha / r beyond the dtype's range)
        if not abs(self.scaling[name]) <= _LARGEST.get(x.dtype, 0.0):
            return None
        return name

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        name = self._fused_adapter(x, args, kwargs)
        if name is None:
            return super().forward(x, *args, **kwargs)
        result = self.base_layer(x)
        lora_b, scale = self.lora_B[name].weight, self.scaling[name]
        h = self.lora_A[name](self.lora_dropout[name](x))
        if result.dtype != lora_b.dtype:  # a base computing in another dtype: peft's sum, in its dtype
            return (result + self.lora_B[name](h) * scale).to(result.dtype)
        # the scale in the GEMM too (alpha): no multiply over the output in the forward or the backward
        out = torch.addmm(result.reshape(-1, result.shape[-1]), h.reshape(-1, h.shape[-1]), lora_b.t(), alpha=scale)
        return out.view(result.shape)
