"""NVFP4: the 4-bit weight format QeRL trains and rolls out on (plain-PyTorch reference).

A weight W [N, K] (N outputs, K inputs) is stored as

* ``packed``       uint8 [N, K/2]          E2M1 codes, two per byte (see ``qerl_kit.fp4``)
* ``scales``       float8_e4m3fn [N, K/16] one scale per 16 consecutive input elements of a row
* ``global_scale`` float32 [1]             one per tensor

and dequantizes as ``value = e2m1(code) * float(scale) / global_scale``. This is the
compressed-tensors ``nvfp4-pack-quantized`` convention that vLLM and llm-compressor use
(``weight_packed``, ``weight_scale``, ``weight_global_scale``); ModelOpt stores the reciprocal.

Quantization is bit-exact with compressed-tensors' min-max (RTN) path, computed the way its
functions compute it, in this order:

1. Global scale: ``amax = max|W|`` (in W's dtype), clamped below at the dtype's smallest normal;
   ``global_scale = (448 * 6) / amax`` evaluated in W's dtype, NaN or inf replaced by 1.0, then
   stored as float32. (With float16 weights whose amax is below 2688/65504 ~ 0.041 this
   overflows and the global scale falls back to 1.0, exactly as compressed-tensors does; pass
   bf16 or fp32 weights, or your own ``global_scale``, to avoid it.)
2. Block scale: ``block_amax / 6`` in W's dtype, times the float32 global scale, clamped to
   +-448 and rounded to the nearest float8_e4m3fn (round-to-nearest-even, the cast's rule).
   A block whose scale rounds to zero (an all-zero block, or one far below the tensor's amax)
   gets the scale 0.125, the smallest e4m3 step compressed-tensors substitutes, so dequantizing
   never divides by zero; its elements then round to (signed) zero or a tiny value.
3. Elements: ``W / (scale_fp8 / global_scale)`` in float32, using the already-rounded fp8 scale,
   clamped to +-6 (saturation) and rounded to the nearest E2M1 value, ties to even
   (grid 0, 0.5, 1, 1.5, 2, 3, 4, 6; ``qerl_kit.fp4`` lists the thresholds).

A caller-supplied ``global_scale`` replaces step 1, so that fused groups (q/k/v, gate/up) can
share one scale as vLLM requires: use ``shared_global_scale(*weights)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl_kit.fp4 import E2M1_MAX, codes_to_values, pack_nibbles, round_to_e2m1_codes, unpack_nibbles

BLOCK_SIZE = 16
FP8_E4M3_MAX = 448.0
FP8_E4M3_EPS = 0.125  # compressed-tensors' substitute for a zero e4m3 scale
BITS_PER_WEIGHT = 4 + 8 / BLOCK_SIZE  # 4.5, plus 32 bits per tensor
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class NVFP4Tensor:
    """A quantized 2-D weight in the compressed-tensors NVFP4 layout."""

    packed: torch.Tensor  # uint8 [N, K/2]
    scales: torch.Tensor  # float8_e4m3fn [N, K/16]
    global_scale: torch.Tensor  # float32 [1]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.global_scale))

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self, dtype)

    def to(self, device: torch.device | str) -> "NVFP4Tensor":
        return NVFP4Tensor(self.packed.to(device), self.scales.to(device), self.global_scale.to(device))


def _check_weight(w: torch.Tensor, block: int, fmt: str) -> None:
    if not isinstance(w, torch.Tensor) or w.ndim != 2:
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{fmt} quantizes 2-D weights [out_features, in_features]; got {shape}")
    if w.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fmt} needs a float32, bfloat16 or float16 weight; got {w.dtype}")
    if w.shape[1] % block:
        raise ValueError(
            f"{fmt} needs in_features divisible by its block size {block}; got {w.shape[1]} "
            f"(weight shape {tuple(w.shape)})"
        )
    if not torch.isfinite(w).all():
        bad = (~torch.isfinite(w)).sum().item()
        raise ValueError(f"{fmt} cannot quantize a weight with {bad} NaN or inf values")


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' global scale 448*6/amax, evaluated in amax's dtype, as float32 [1]."""
    amax = amax.clamp(min=torch.finfo(amax.dtype).tiny)
    gs = (FP8_E4M3_MAX * E2M1_MAX) / amax
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32).reshape(1)


def shared_global_scale(*weights: torch.Tensor) -> torch.Tensor:
    """One global scale for a fused group (q/k/v or gate/up): from the amax over all members."""
    if not weights:
        raise ValueError("shared_global_scale needs at least one weight")
    dtypes = {w.dtype for w in weights}
    if len(dtypes) != 1:
        raise TypeError(f"a fused group must share one dtype; got {sorted(map(str, dtypes))}")
    amax = torch.stack([w.detach().abs().amax() for w in weights]).amax()
    return global_scale_from_amax(amax)


def quantize(w: torch.Tensor, global_scale: torch.Tensor | float | None = None) -> NVFP4Tensor:
    """Quantize a 2-D weight [N, K] (K divisible by 16) to NVFP4, bit-exact with compressed-tensors."""
    _check_weight(w, BLOCK_SIZE, "NVFP4")
    w = w.detach()
    n, k = w.shape
    if global_scale is None:
        gs = global_scale_from_amax(w.abs().amax())
    else:
        gs = torch.as_tensor(global_scale, dtype=torch.float32, device=w.device).reshape(1)
        if not (torch.isfinite(gs).all() and (gs > 0).all()):
            raise ValueError(f"global_scale must be a positive finite number; got {gs.item()}")
    blocks = w.reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    block_amax = blocks.abs().amax(dim=-1)  # [N, K/16], in w's dtype
    six = torch.tensor(E2M1_MAX, dtype=w.dtype, device=w.device)
    scale = gs * (block_amax / six)  # float32 (tensor-tensor promotion)
    scale = scale.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    scale = torch.where(scale == 0, torch.full_like(scale, FP8_E4M3_EPS), scale)
    effective = scale / gs  # float32 [N, K/16]
    scaled = blocks.to(torch.float32) / effective.unsqueeze(-1)
    codes = round_to_e2m1_codes(scaled.clamp(-E2M1_MAX, E2M1_MAX)).reshape(n, k)
    return NVFP4Tensor(pack_nibbles(codes), scale.to(torch.float8_e4m3fn), gs)


def dequantize(qt: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """NVFP4 -> dense [N, K]: code * (scale / global_scale) in float32, then cast to ``dtype``."""
    n, k = qt.shape
    values = codes_to_values(unpack_nibbles(qt.packed)).reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    effective = qt.scales.to(torch.float32) / qt.global_scale.to(torch.float32)
    return (values * effective.unsqueeze(-1)).reshape(n, k).to(dtype)
