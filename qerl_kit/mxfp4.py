"""MXFP4 (OCP Microscaling): E2M1 elements, blocks of 32, power-of-two E8M0 scales.

A weight W [N, K] (K divisible by 32) is stored as ``packed`` uint8 [N, K/2] (same E2M1 codes and
nibble order as NVFP4, see ``qerl_kit.fp4``) and ``scales`` uint8 [N, K/32], each a biased
E8M0 exponent: ``scale = 2 ** (byte - 127)``. ``value = e2m1(code) * scale``.

Scale rule (the one vLLM's MXFP4 reference and compressed-tensors use, a refinement of the OCP
spec's ``floor(log2(amax)) - 2``): round the block amax to a power of two, rounding *up* when its
mantissa is 1.75 or more (so amax lands on 4, not saturated past 6), then subtract 2, the E2M1
maximum exponent. An all-zero block gets the smallest scale, 2^-127. Elements round to nearest,
ties to even, saturating at 6, like NVFP4. There is no per-tensor scale, so nothing to share
across fused layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl_kit.fp4 import E2M1_MAX, codes_to_values, pack_nibbles, round_to_e2m1_codes, unpack_nibbles
from qerl_kit.nvfp4 import _check_weight

BLOCK_SIZE = 32
BITS_PER_WEIGHT = 4 + 8 / BLOCK_SIZE  # 4.25
_E8M0_BIAS = 127


@dataclass(frozen=True)
class MXFP4Tensor:
    packed: torch.Tensor  # uint8 [N, K/2]
    scales: torch.Tensor  # uint8 [N, K/32], biased E8M0 exponents

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel()

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self, dtype)

    def to(self, device: torch.device | str) -> "MXFP4Tensor":
        return MXFP4Tensor(self.packed.to(device), self.scales.to(device))


def e8m0_scales(biased: torch.Tensor) -> torch.Tensor:
    """2^(byte - 127) as float32, built from its bits (byte << 23; byte 0 is the subnormal 2^-127) so it
    is exact on every device: CUDA's ``exp2`` is off by an ulp or more near and below 2^-126."""
    bits = biased.to(torch.int32) << 23
    return torch.where(biased == 0, torch.full_like(bits, 1 << 22), bits).view(torch.float32)


def _scale_exponents(block_amax: torch.Tensor) -> torch.Tensor:
    """Unbiased E8M0 exponent per block (int32)."""
    mantissa, exponent = torch.frexp(block_amax.to(torch.float32))  # amax = m * 2^e, m in [0.5, 1)
    exponent = exponent - 1 + (mantissa >= 0.875).to(torch.int32)  # 1.75 in [1, 2) form
    exponent = exponent - 2  # floor(log2(6)): the largest E2M1 exponent
    exponent = torch.where(block_amax == 0, torch.full_like(exponent, -_E8M0_BIAS), exponent)
    return exponent.clamp(-_E8M0_BIAS, _E8M0_BIAS)


def quantize(w: torch.Tensor) -> MXFP4Tensor:
    """Quantize a 2-D weight [N, K] (K divisible by 32) to MXFP4."""
    _check_weight(w, BLOCK_SIZE, "MXFP4")
    n, k = w.shape
    blocks = w.detach().to(torch.float32).reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    exponent = _scale_exponents(blocks.abs().amax(dim=-1))
    biased = (exponent + _E8M0_BIAS).to(torch.uint8)
    scale = e8m0_scales(biased)
    codes = round_to_e2m1_codes((blocks / scale.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX))
    return MXFP4Tensor(pack_nibbles(codes.reshape(n, k)), biased)


def dequantize(qt: MXFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    n, k = qt.shape
    values = codes_to_values(unpack_nibbles(qt.packed)).reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    scale = e8m0_scales(qt.scales)
    return (values * scale.unsqueeze(-1)).reshape(n, k).to(dtype)
