"""CUDA C kernels compiled at first use with NVRTC, through ``torch.cuda._compile_kernel``.

PyTorch's CUDA wheels ship NVRTC, so the kernels need no compiler and no extra package. The API is
private: ``status`` reports why a kernel cannot be used (no GPU, ROCm, an old GPU, a torch without
the API, a failed compile), and the routing table (qerl_kit/kernels/routes.py) then skips that
kernel. Used by ``nvfp4_decode_cuda`` and by ``lab/nvfp4_wgmma_cuda.py`` (``arch="90a"``).
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def compile_kernel(source: str, name: str, device_index: int, options: tuple[str, ...] = (), arch: str | None = None):
    """The kernel ``name`` (an ``extern "C"`` function of ``source``) built for one device, once;
    ``arch`` ("90a") builds for an architecture-specific target instead of the device's own."""
    extra = {"compute_capability": arch} if arch else {}
    with torch.cuda.device(device_index):
        return torch.cuda._compile_kernel(source, name, nvcc_options=["--std=c++17", *options], **extra)


def status(source: str, names: tuple[str, ...], min_capability: tuple[int, int], why: str,
           arch: str | None = None) -> tuple[bool, str]:
    """(usable, reason) for the kernels ``names`` of ``source`` on the current CUDA device;
    ``why`` says what needs ``min_capability``. An ``arch`` with features of one architecture
    ("90a": wgmma) runs on exactly that compute capability and no later one."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if torch.version.hip:
        return False, "ROCm: these kernels are CUDA C with NVIDIA PTX"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < min_capability:
        return False, f"compute capability {major}.{minor} < {min_capability[0]}.{min_capability[1]} ({why})"
    if arch and arch.endswith("a") and (major, minor) != min_capability:
        return False, f"compute capability {major}.{minor}: {why} is built for sm_{arch} only"
    if not hasattr(torch.cuda, "_compile_kernel"):
        return False, f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC)"
    try:
        for name in names:
            compile_kernel(source, name, torch.cuda.current_device(), arch=arch)
    except Exception as exc:  # NVRTC missing or failing: the kernel is reported unusable, not raised
        return False, f"NVRTC compile failed: {type(exc).__name__}: {exc}"
    return True, f"NVRTC, {torch.cuda.get_device_name()}"
