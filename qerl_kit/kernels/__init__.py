"""Fused NVFP4 kernels (Triton) behind a backend switch, with plain-PyTorch references.

The two entry points take the packed weight of an ``NVFP4Linear`` (``packed``, ``scales``,
``global_scale``) and never build a dense copy of it on the Triton path::

    y  = nvfp4_linear(x, packed, scales, global_scale, bias)   # x [..., K] -> [..., N]
    dx = nvfp4_dgrad(dy, packed, scales, global_scale)         # dy [..., N] -> [..., K]

Which implementation runs is decided by ``backend`` (``set_backend``, ``QERL_KERNEL_BACKEND``):
Triton on CUDA when it imports, the reference (dequantize + torch matmul) elsewhere. On ``auto``,
bf16 forward calls with at most ``CUDA_DECODE_MAX_M`` rows go to the CUDA C decode kernel
(``nvfp4_decode_cuda``, compiled with NVRTC at first use) when it compiles, the shape fits and it
beat Triton at that size on the H200 (``nvfp4_decode_cuda.preferred``);
forcing ``triton`` keeps them on Triton. Likewise, on ``auto``, bf16 forward calls of 17..64 rows
go to the Hopper wgmma kernel (``nvfp4_wgmma_cuda``, sm_90a only) on the large layers where it
beat Triton on the H200 (``nvfp4_wgmma_cuda.preferred``). Otherwise, forward calls with at most ``DECODE_MAX_M``
rows go to the Triton decode kernel
(``nvfp4_gemv_triton``: a block-dot CUDA-core kernel for one row, tensor cores for 2..64),
except wide layers (N >= ``WIDE_N``) with more than 32 rows; the rest go to
``nvfp4_gemm_triton``, which runs its fused tiled kernel below ``DENSE_MIN_M`` rows and, from
there on, a fused dequantization pass into a transient bf16 weight (freed after the call; on wide
layers from 2048 rows, 4096 weight rows at a time through one buffer)
followed by cuBLAS, which was faster on the H200 (docs/kernels.md).
The input gradient (``nvfp4_dgrad_triton``) follows the same rule.
Each kernel is also a ``torch.ops.qerl_kit.*`` custom op, so ``torch.compile`` and CUDA graphs can
capture it (run one eager call per shape first: that is when the autotuner picks a config).

``kernel_report(model)`` says which of these each NVFP4 layer shape of a model takes at a few row
counts on this machine, and why a kernel family is off.

Importing this package does not import Triton; the kernel modules load on first use.
"""

from __future__ import annotations

import torch

from qerl_kit.kernels.backend import (ENV_VAR, Backend, _parse, get_backend, resolve, set_backend,
                                      triton_status)
from qerl_kit.kernels.reference import nvfp4_dgrad_ref, nvfp4_linear_ref
from qerl_kit.kernels.report import KernelReport, kernel_report

DECODE_MAX_M = 64
# From bench/results/sweep_small_m_h200.md: at 33..64 rows the tiled GEMM (64x128x128) beat the
# decode kernel on the fused gate/up layers (N = 37888 and 55296: 0.91-0.97x bf16 against
# 0.69-0.79x) and lost on N <= 7168.
WIDE_N = 32768
CUDA_DECODE_MAX_M = 8  # rows sent to nvfp4_decode_cuda on the auto backend (where it wins: preferred())

__all__ = [
    "Backend", "ENV_VAR", "DECODE_MAX_M", "WIDE_N", "CUDA_DECODE_MAX_M", "forward_kernel", "forward_path",
    "cuda_decode_status", "wgmma_status", "kernel_report", "KernelReport", "get_backend", "set_backend", "resolve", "triton_status", "nvfp4_linear", "nvfp4_dgrad", "nvfp4_linear_ref", "nvfp4_dgrad_ref",
]


def _ops():
    # Importing the kernel modules registers torch.ops.qerl_kit.nvfp4_{gemm,gemv,dgrad,decode_cuda,wgmma_cuda}.
    from qerl_kit.kernels import (nvfp4_decode_cuda, nvfp4_dgrad_triton, nvfp4_gemm_triton,  # noqa: F401
                                  nvfp4_gemv_triton, nvfp4_wgmma_cuda)

    return torch.ops.qerl_kit


def cuda_decode_status() -> tuple[bool, str]:
    """(usable, reason): whether the CUDA C decode kernel compiles and runs here (decided once)."""
    from qerl_kit.kernels.nvfp4_decode_cuda import cuda_decode_status as status

    return status()


def wgmma_status() -> tuple[bool, str]:
    """(usable, reason): whether the Hopper wgmma kernel compiles and runs here (decided once)."""
    from qerl_kit.kernels.nvfp4_wgmma_cuda import wgmma_status as status

    return status()


def _cuda_path(x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, backend) -> str | None:
    """"cuda" (``nvfp4_decode_cuda``, up to ``CUDA_DECODE_MAX_M`` rows) or "wgmma"
    (``nvfp4_wgmma_cuda``) where a CUDA C kernel takes this call on the auto backend: the call fits
    it, it beat Triton at this size (its ``preferred``) and it compiles here; None otherwise."""
    choice = _parse(backend) if backend is not None else get_backend()
    if choice is not Backend.AUTO or not x2.is_cuda:
        return None
    from qerl_kit.kernels import nvfp4_decode_cuda as dec
    from qerl_kit.kernels import nvfp4_wgmma_cuda as wg

    m, n, k = x2.shape[0], packed.shape[0], packed.shape[1] * 2
    for path, kernel, status, max_m in (("cuda", dec, dec.cuda_decode_status, CUDA_DECODE_MAX_M),
                                        ("wgmma", wg, wg.wgmma_status, wg.MAX_M)):
        if m <= max_m and kernel.preferred(m, n, k) and kernel.supports(x2, packed, scales) and status()[0]:
            return path
    return None


def forward_kernel(m: int, n: int) -> str:
    """Which Triton kernel module takes a forward of ``m`` rows into ``n`` features: "decode"
    (``nvfp4_gemv_triton``) or "gemm" (``nvfp4_gemm_triton``, fused or dense by its own rule)."""
    return "decode" if m <= 32 or (m <= DECODE_MAX_M and n < WIDE_N) else "gemm"


def forward_path(x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                 backend: Backend | str | None = None) -> str:
    """Which kernel ``nvfp4_linear`` runs for ``x2`` [M, K] off the reference backend: "cuda"
    (``nvfp4_decode_cuda``), "wgmma" (``nvfp4_wgmma_cuda``), "decode" (``nvfp4_gemv_triton``) or
    "gemm" (``nvfp4_gemm_triton``)."""
    return _cuda_path(x2, packed, scales, backend) or forward_kernel(x2.shape[0], packed.shape[0])


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                 global_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 backend: Backend | str | None = None) -> torch.Tensor:
    """y = x @ W^T + bias with W the NVFP4 weight [N, K]; x [..., K] -> y [..., N]."""
    if resolve(x, backend) is Backend.REFERENCE:
        return nvfp4_linear_ref(x, packed, scales, global_scale, bias)
    k = packed.shape[1] * 2
    x2 = x.reshape(-1, k)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    ops = _ops()
    op = {"cuda": ops.nvfp4_decode_cuda, "wgmma": ops.nvfp4_wgmma_cuda, "decode": ops.nvfp4_gemv,
          "gemm": ops.nvfp4_gemm}[forward_path(x2, packed, scales, backend)]
    return op(x2, packed, scales, global_scale, bias).reshape(*x.shape[:-1], packed.shape[0])


def nvfp4_dgrad(dy: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                global_scale: torch.Tensor, backend: Backend | str | None = None) -> torch.Tensor:
    """dx = dy @ W with W the NVFP4 weight [N, K]; dy [..., N] -> dx [..., K]."""
    if resolve(dy, backend) is Backend.REFERENCE:
        return nvfp4_dgrad_ref(dy, packed, scales, global_scale)
    dy2 = dy.reshape(-1, packed.shape[0])
    dx = _ops().nvfp4_dgrad(dy2, packed, scales, global_scale)
    return dx.reshape(*dy.shape[:-1], packed.shape[1] * 2)
