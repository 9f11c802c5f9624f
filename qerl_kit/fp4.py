"""FP4 E2M1 elements: the rounding grid and the nibble packing shared by NVFP4 and MXFP4.

An E2M1 code is 4 bits ``s e1 e0 m``: bit 3 is the sign, bits 0-2 index the magnitudes
``[0, 0.5, 1, 1.5, 2, 3, 4, 6]``. Code 8 is negative zero.

Rounding (``round_to_e2m1_codes``) is round-to-nearest, ties to the even mantissa, on that grid,
with saturation at 6. Written as thresholds on ``|x|`` this is exactly the cascade that
compressed-tensors uses::

    |x| <= 0.25 -> 0      0.25 < |x| < 0.75 -> 0.5   0.75 <= |x| <= 1.25 -> 1
    1.25 < |x| < 1.75 -> 1.5   1.75 <= |x| <= 2.5 -> 2   2.5 < |x| < 3.5 -> 3
    3.5 <= |x| <= 5 -> 4       |x| > 5 -> 6

The sign bit is set for every input below zero, so a small negative value that rounds to zero
is stored as negative zero (code 8), while an input of -0.0 is stored as +0 (code 0): exactly
what compressed-tensors does (it multiplies by ``torch.sign(x)``), which keeps our bytes identical.

Packing (``pack_nibbles``): two codes per byte along the last dimension, the even (first) element
in the low nibble: ``byte = code[2j] | code[2j+1] << 4``.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7

_LUT_CACHE: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def e2m1_lut(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 signed values of codes 0..15 (code 8 is -0.0), as a tensor on ``device``."""
    key = (torch.device(device), dtype)
    lut = _LUT_CACHE.get(key)
    if lut is None:
        mags = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        lut = torch.cat([mags, -mags]).to(device=device, dtype=dtype)
        _LUT_CACHE[key] = lut
    return lut


def round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round a float tensor (already divided by its scale) to E2M1 codes, uint8 in 0..15."""
    a = x.abs()
    idx = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return idx | ((x < 0).to(torch.uint8) << 3)


def codes_to_values(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) to their float values."""
    return e2m1_lut(codes.device, dtype)[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 codes (0..15) -> [..., K/2] bytes, even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of 4-bit codes ({codes.shape[-1]})")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] uint8 codes; inverse of ``pack_nibbles``."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
