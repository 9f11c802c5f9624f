"""NF4 (QLoRA's NormalFloat-4): a 16-value codebook, blocks of 64, one absmax scale per block.

A weight W [N, K] (K divisible by 64) is stored as ``packed`` uint8 [N, K/2] and ``absmax``
float32 [N, K/64]. Each element is divided by its block's absmax and mapped to the nearest of
the 16 NormalFloat values (bitsandbytes' codebook, quantiles of N(0, 1) scaled to [-1, 1] with
an exact zero); ``value = NF4[code] * absmax``.

Layout follows bitsandbytes' ``quantize_4bit(quant_type="nf4", blocksize=64)`` without double
quantization: blocks are 64 consecutive elements of the row-major tensor (the same thing as
64 input elements of a row here, since K is a multiple of 64), the *first* element of a pair goes
in the *high* nibble, and an all-zero block has absmax 0 (its codes dequantize to 0).
Ties between two codebook values go to the lower code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl_kit.nvfp4 import _check_weight

BLOCK_SIZE = 64
BITS_PER_WEIGHT = 4 + 32 / BLOCK_SIZE  # 4.5 (bitsandbytes' double quantization would give ~4.127)

NF4_CODEBOOK = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip


@dataclass(frozen=True)
class NF4Tensor:
    packed: torch.Tensor  # uint8 [N, K/2], first element in the high nibble
    absmax: torch.Tensor  # float32 [N, K/64]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    @property
    def scales(self) -> torch.Tensor:
        return self.absmax

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.absmax.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self, dtype)

    def to(self, device: torch.device | str) -> "NF4Tensor":
        return NF4Tensor(self.packed.to(device), self.absmax.to(device))


_BOOK_CACHE: dict[torch.device, torch.Tensor] = {}


def _codebook(device: torch.device) -> torch.Tensor:
    """The 16 NF4 levels on ``device``, made once per device: a host-to-device copy in every
    dequantize would also break CUDA-graph capture of a decode step."""
    device = torch.device(device)
    book = _BOOK_CACHE.get(device)
    if book is None:
        book = _BOOK_CACHE[device] = torch.tensor(NF4_CODEBOOK, dtype=torch.float32, device=device)
    return book


def quantize(w: torch.Tensor) -> NF4Tensor:
    """Quantize a 2-D weight [N, K] (K divisible by 64) to NF4."""
    _check_weight(w, BLOCK_SIZE, "NF4")
    n, k = w.shape
    blocks = w.detach().to(torch.float32).reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    absmax = blocks.abs().amax(dim=-1)
    normed = blocks / torch.where(absmax == 0, torch.ones_like(absmax), absmax).unsqueeze(-1)
    book = _codebook(w.device)
    midpoints = (book[1:] + book[:-1]) / 2
    codes = torch.bucketize(normed, midpoints, right=False).to(torch.uint8).reshape(n, k // 2, 2)
    packed = (codes[..., 0] << 4) | codes[..., 1]
    return NF4Tensor(packed, absmax)


def dequantize(qt: NF4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    n, k = qt.shape
    codes = torch.stack((qt.packed >> 4, qt.packed & 0x0F), dim=-1).reshape(n, k)
    values = _codebook(qt.packed.device)[codes.long()].reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    return (values * qt.absmax.unsqueeze(-1)).reshape(n, k).to(dtype)
