"""Which kernels may run an NVFP4 matmul: the backend switch the routing table is read under.

The choice can be forced (``qerl_kit.kernels`` routes each call within it):

* ``Backend.AUTO`` (the default): every kernel of the routing table (humming-kernels, our CUDA C
  decode kernel and Triton kernels) for CUDA tensors, the reference everywhere else (CPU tensors, dtypes the
  kernels do not take).
* ``Backend.OURS``: the table without humming: our CUDA C decode kernel and Triton kernels.
* ``Backend.TRITON``: our Triton kernels only. On CPU tensors this works only under
  ``TRITON_INTERPRET=1`` (set before Triton is imported), which is how CI tests the kernels.
* ``Backend.HUMMING``: humming for every forward (an error where it cannot run), Triton for the
  input gradient.
* ``Backend.REFERENCE``: dequantize to a dense tensor, then ``torch`` matmul. This is torchao's
  ``EMULATED`` preference: slow, runs anywhere, the numerics oracle.

Force it with the environment variable ``QERL_KERNEL_BACKEND=auto|ours|triton|humming|reference``
(read at import) or in code with ``set_backend("triton")``, which also works as a context manager::

    with set_backend("reference"):
        y_ref = layer(x)

Whether Triton is usable is decided once (``triton_status()``, cached, with a reason string);
importing this module never imports Triton.
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import os

import torch

ENV_VAR = "QERL_KERNEL_BACKEND"
KERNEL_DTYPES = (torch.bfloat16, torch.float16)  # activation dtypes the kernels take


class Backend(str, enum.Enum):
    AUTO = "auto"
    """The routing table's kernels for CUDA tensors, the reference otherwise."""
    OURS = "ours"
    """The routing table without humming-kernels: our CUDA C decode kernel and Triton kernels."""
    TRITON = "triton"
    """Our Triton kernels only (CPU tensors only under ``TRITON_INTERPRET=1``)."""
    HUMMING = "humming"
    """humming-kernels for every forward, Triton for the input gradient."""
    REFERENCE = "reference"
    """Dequantize then ``torch`` matmul (torchao's EMULATED): the oracle, runs anywhere."""


def _parse(value: "Backend | str | None") -> Backend:
    if value is None:
        return Backend.AUTO
    if isinstance(value, Backend):
        return value
    try:
        return Backend(str(value).strip().lower())
    except ValueError:
        choices = ", ".join(b.value for b in Backend)
        raise ValueError(f"unknown kernel backend {value!r}; choose one of: {choices}") from None


_forced: Backend = _parse(os.environ.get(ENV_VAR) or None)


@functools.lru_cache(maxsize=None)
def triton_status() -> tuple[bool, str]:
    """(usable, reason): whether the Triton kernels can run in this process, decided once."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install triton)"
    if interpreting():
        return True, "TRITON_INTERPRET=1: kernels run in Triton's CPU interpreter"
    if not torch.cuda.is_available():
        return False, "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on the CPU)"
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        return False, f"compute capability {major}.x < 8.0 (the kernels use bf16 tensor cores)"
    return True, f"CUDA device {torch.cuda.get_device_name()}"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def patch_interpreter_for_numpy24() -> None:
    """Work around triton#9171 (fixed upstream by #9172, after Triton 3.6): under NumPy >= 2.4
    the interpreter's ``int(tensor)`` fails on its 1-element scalars, so ``range(0, K, BLOCK)``
    raises. Called by the kernel modules when they load under ``TRITON_INTERPRET=1``."""
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor
    if getattr(original, "_qerl_numpy24", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._qerl_numpy24 = True
    interp._patch_lang_tensor = patched


def get_backend() -> Backend:
    """The backend set by ``set_backend`` or ``QERL_KERNEL_BACKEND`` (``AUTO`` by default)."""
    return _forced


class set_backend:  # noqa: N801 - used like a function, also a context manager
    """Force a backend for the whole process; as a context manager, restore the old one on exit."""

    def __init__(self, backend: "Backend | str | None"):
        global _forced
        self.previous = _forced
        _forced = _parse(backend)

    def __enter__(self) -> Backend:
        return _forced

    def __exit__(self, *exc) -> None:
        global _forced
        _forced = self.previous


def resolve(x: torch.Tensor, backend: "Backend | str | None" = None) -> Backend:
    """TRITON (some kernel of ours or humming's) or REFERENCE for an activation ``x`` (``backend``
    overrides the forced/auto choice); a forced kernel backend that cannot run on ``x`` raises."""
    choice = _parse(backend) if backend is not None else _forced
    if choice is Backend.REFERENCE:
        return Backend.REFERENCE
    ok, reason = triton_status()
    runnable = ok and (x.is_cuda or (interpreting() and x.device.type == "cpu"))
    if choice is Backend.AUTO:
        return Backend.TRITON if runnable and x.is_cuda and x.dtype in KERNEL_DTYPES else Backend.REFERENCE
    if not runnable:
        raise RuntimeError(f"kernel backend 'triton' was forced but cannot run on {x.device}: {reason}")
    if x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"the NVFP4 Triton kernels take bfloat16 or float16 activations; got {x.dtype}")
    return Backend.TRITON


def register_linear_op(name: str, launcher):
    """``torch.ops.qerl_kit.<name>(x, packed, scales, global_scale, bias=None) -> y [M, N]`` around a
    kernel launcher, with the fake (shape-only) implementation torch.compile and graph capture need."""

    def op(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
        return launcher(x, packed, scales, global_scale, bias)

    op.__name__ = f"{name}_op"
    custom = torch.library.custom_op(f"qerl_kit::{name}", op, mutates_args=())
    custom.register_fake(lambda x, packed, scales, global_scale, bias=None: x.new_empty((x.shape[0], packed.shape[0])))
    return custom
