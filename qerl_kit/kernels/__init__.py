"""NVFP4 (and NF4, MXFP4) matmuls from the packed weight, routed by one table, with plain-PyTorch references.

The two entry points take the packed weight of an ``NVFP4Linear`` (``packed``, ``scales``,
``global_scale``) and never build a dense copy of it except on the ``dense`` path (a transient
bf16 weight, freed after the call)::

    y  = nvfp4_linear(x, packed, scales, global_scale, bias)   # x [..., K] -> [..., N]
    dx = nvfp4_dgrad(dy, packed, scales, global_scale)         # dy [..., N] -> [..., K]

Which kernel runs is decided once per call by ``route``: the backend switch (``set_backend``,
``QERL_KERNEL_BACKEND``) says which kernels may run, and the first row of the routing table
``qerl_kit.kernels.routes.ROUTES`` that matches the call and whose kernel can run it here wins.
The decision is cached per call shape, so an eager call costs a dictionary lookup before its
launch. Backends:

* ``auto`` (default): every kernel in the table (humming-kernels where installed, our CUDA C
  decode kernel and Triton kernels); the reference for CPU tensors and dtypes they do not take.
* ``ours``: the table without humming (what ran before it; the A/B baseline).
* ``triton``: our Triton kernels only (on CPU tensors under ``TRITON_INTERPRET=1``, as in CI).
* ``humming``: humming for every forward it can take (an error if it cannot run here).
* ``reference``: dequantize, then torch matmul (the oracle).

NF4 and MXFP4 weights (``packed`` and their block scales: NF4's ``absmax``, MXFP4's E8M0 bytes)
take the table's rows for their format, ``kernels/lut4_triton.py``'s decode GEMV and dequantize +
cuBLAS (bf16, fp16 and fp32 activations), the plain-PyTorch reference on the CPU. humming and our
CUDA C kernel have none for them, so every forced kernel backend (``ours``, ``triton``, ``humming``)
runs those Triton kernels, or raises one error where they cannot run::

    y  = lut4_linear(x, packed, scales, "nf4", bias)     # or "mxfp4"
    dx = lut4_dgrad(dy, packed, scales, "nf4")

``compile_shapes(shapes)`` compiles humming's kernels for weight shapes up front, with a progress
bar (else the first call of each shape compiles, 13-15 s on the H200);
``qerl_kit.quantize.prepare_kernels(model)`` does it for every NVFP4 layer shape of a model.
``kernel_status()`` says which kernel families can run here and why not;
``qerl_kit.kernel_report(model)`` shows the route every layer shape takes.

Importing this package imports neither Triton nor humming; the kernel modules load on first use.
"""

from __future__ import annotations

import torch

from qerl_kit import dense_cache
from qerl_kit.kernels import reference, routes
from qerl_kit.kernels.backend import (ENV_VAR, KERNEL_DTYPES, Backend, _parse, get_backend, interpreting, resolve,
                                      set_backend, triton_status)
from qerl_kit.kernels.reference import lut4_dgrad_ref, lut4_linear_ref, nvfp4_dgrad_ref, nvfp4_linear_ref

__all__ = [
    "Backend", "ENV_VAR", "route", "kernel_status", "compile_shapes", "get_backend", "set_backend", "resolve",
    "triton_status", "nvfp4_linear", "nvfp4_dgrad", "nvfp4_linear_ref", "nvfp4_dgrad_ref",
    "lut4_linear", "lut4_dgrad", "lut4_linear_ref", "lut4_dgrad_ref", "held_weight", "HELD_ROUTES",
]



# -- what can run here ----------------------------------------------------------------------------

def _dec():
    from qerl_kit.kernels import nvfp4_decode_cuda

    return nvfp4_decode_cuda


_hm = None  # qerl_kit.kernels.nvfp4_humming once loaded (a module lookup per call costs a microsecond)


def _humming():
    global _hm
    if _hm is None:
        from qerl_kit.kernels import nvfp4_humming

        _hm = nvfp4_humming
    return _hm


def kernel_status() -> tuple[tuple[str, bool, str], ...]:
    """(kernel family, usable here, why) for humming, the Triton kernels and our CUDA C kernel."""
    return (("humming-kernels", *_humming().humming_status()), ("Triton kernels", *triton_status()),
            ("CUDA decode kernel (1-16 rows)", *_dec().cuda_decode_status()))


def _runs(kernel: str, x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether ``kernel`` can take this call on this machine (installed, compiled, tensors fit)."""
    family = routes.KERNELS[kernel].family
    if family == "triton":
        if not triton_status()[0]:
            return False
        if not x2.is_cuda:  # Triton's CPU interpreter: the fused kernels only (as before the table)
            return interpreting() and kernel != "dense"
        return True
    if not x2.is_cuda:
        return family == "reference"
    if kernel == "humming":
        h = _hm or _humming()
        return h.humming_status()[0] and h.shape_ok(packed.shape[0], packed.shape[1] * 2, x2.dtype)
    if kernel == "cuda_decode":
        return _dec().supports(x2, packed, scales) and _dec().cuda_decode_status()[0]
    return family == "reference"


_decisions: dict[tuple, str] = {}


def _call_key(op: str, choice: Backend, x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
              fmt: str) -> tuple:
    """What the table's conditions and the kernels' alignment checks read of a call, and nothing else."""
    ps, ss = packed.stride(), scales.stride()
    return (op, choice, x2.device.type, x2.dtype, x2.shape[0], packed.shape[0], packed.shape[1], x2.stride(),
            x2.data_ptr() % 16, ps[0] % 16, ps[1], packed.data_ptr() % 16, ss[0] % 8, ss[1], scales.data_ptr() % 8,
            fmt)


def route(op: str, x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
          backend: Backend | str | None = None, fmt: str = "nvfp4") -> str:
    """The kernel ``op`` ("forward" or "dgrad") runs for the 2-D activation ``x2`` (x [M, K] or
    dy [M, N]) and this ``fmt`` weight (nvfp4, nf4 or mxfp4): a key of ``routes.KERNELS``. Cached
    per call shape."""
    choice = _parse(backend) if backend is not None else get_backend()
    key = _call_key(op, choice, x2, packed, scales, fmt)
    kernel = _decisions.get(key)
    if kernel is None:
        if len(_decisions) >= 8192:  # many distinct row counts (variable-length batches): start over
            _decisions.clear()
        kernel = _decisions[key] = _route(op, x2, packed, scales, choice, fmt)
    return kernel


def _check_forced_lut4(x2, choice: Backend, fmt: str) -> None:
    """A forced kernel backend (``ours``, ``triton``, ``humming``) on an NF4 / MXFP4 weight: neither
    humming nor our CUDA C kernel has an NF4/MXFP4 kernel, so each of them runs the LUT4 Triton kernels,
    and raises the same error where those cannot run (the CPU without ``TRITON_INTERPRET=1``)."""
    ok, why = triton_status()
    if not ok or not (x2.is_cuda or interpreting()):
        raise RuntimeError(f"kernel backend {choice.value!r} was forced but cannot run {fmt} on {x2.device}: {fmt} "
                           f"has no humming or CUDA C kernel, only the Triton kernels (lut4_triton), and they "
                           f"cannot run here: {why if not ok else 'CPU tensors need TRITON_INTERPRET=1'}")
    if x2.dtype not in routes.LUT4_DTYPES:
        raise TypeError(f"the {fmt} kernels take bfloat16, float16 or float32 activations; got {x2.dtype}")


def _route(op, x2, packed, scales, choice: Backend, fmt: str = "nvfp4") -> str:
    """The first row of the table for a ``fmt`` weight whose kernel this backend lets run and that can
    take the call here. NF4 / MXFP4 read their own rows (no humming, no CUDA C; fp32 activations too)."""
    if fmt not in routes.FORMATS_ROUTED:
        raise ValueError(f"the routing table has no rows for format {fmt!r}; formats: {list(routes.FORMATS_ROUTED)}")
    if choice is Backend.REFERENCE:
        return "reference"
    dtypes = KERNEL_DTYPES if fmt == "nvfp4" else routes.LUT4_DTYPES
    if choice is Backend.AUTO and (not x2.is_cuda or x2.dtype not in dtypes):
        return "reference"
    if fmt == "nvfp4" and choice is Backend.HUMMING and op == "forward":
        ok, why = _humming().humming_status()
        if not ok or not x2.is_cuda:
            raise RuntimeError(f"kernel backend 'humming' was forced but cannot run on {x2.device}: {why}")
        return "humming"
    if choice is not Backend.AUTO:  # a forced kernel backend must run here: raises why not
        if fmt == "nvfp4":
            resolve(x2, Backend.TRITON)
        else:
            _check_forced_lut4(x2, choice, fmt)
    allowed = routes.allowed(choice.value)  # the kernels of the families this backend lets run
    m, n, k = x2.shape[0], packed.shape[0], packed.shape[1] * 2
    for row in routes.candidates(op, m, n, k, x2.dtype, fmt=fmt):
        if row.kernel in allowed and _runs(row.kernel, x2, packed, scales):
            return row.kernel
    return "reference"  # no row matches (M = 0): the reference handles an empty batch


def _forget_routes() -> None:
    """Drop cached decisions (after a kernel family was turned off, or in tests)."""
    _decisions.clear()
    _held_decisions.clear()


# -- the entry points -------------------------------------------------------------------------------

def _humming_forward(x2, packed, scales, global_scale, bias):
    h = _hm or _humming()
    gemm = h.cached(packed, x2.dtype) or h.gemm_for(packed, scales, global_scale, x2.dtype)
    if gemm is None:  # humming failed for this weight: it is off now, route again without it
        _forget_routes()
        return None
    y = gemm(x2)
    return y.add_(bias) if bias is not None else y


def _cuda_decode_forward(x2, packed, scales, global_scale, bias):
    compiling = torch.compiler.is_compiling()  # torch.compile traces the custom ops; eager skips their cost
    return (torch.ops.qerl_kit.nvfp4_decode_cuda if compiling else _dec().nvfp4_decode_cuda)(
        x2, packed, scales, global_scale, bias)


def _gemv_forward(x2, packed, scales, global_scale, bias):
    from qerl_kit.kernels import nvfp4_gemv_triton as gv

    return (torch.ops.qerl_kit.nvfp4_gemv if torch.compiler.is_compiling() else gv.nvfp4_gemv)(
        x2, packed, scales, global_scale, bias)


def _gemm_forward(strategy: str):
    def forward(x2, packed, scales, global_scale, bias):
        from qerl_kit.kernels import nvfp4_gemm_triton as gm

        if torch.compiler.is_compiling():
            return torch.ops.qerl_kit.nvfp4_gemm(x2, packed, scales, global_scale, bias)
        return gm.nvfp4_gemm(x2, packed, scales, global_scale, bias, strategy=strategy)
    return forward


# The forward launcher of each kernel of ``routes.KERNELS`` that takes forwards (a test keeps the two in
# step); each returns y [M, N], or None where the kernel gave up on this weight and the call routes again.
_FORWARD = {"humming": _humming_forward, "cuda_decode": _cuda_decode_forward, "triton_gemv": _gemv_forward,
            "triton_tiles": _gemm_forward("fused"), "dense": _gemm_forward("dense"), "reference": nvfp4_linear_ref}
# The input-gradient strategy of nvfp4_dgrad_triton for each Triton kernel the dgrad rows name.
_DGRAD = {"triton_dgrad": "fused", "dense": "dense"}


def _forward(kernel: str, x2, packed, scales, global_scale, bias):
    return _FORWARD[kernel](x2, packed, scales, global_scale, bias)


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                 global_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 backend: Backend | str | None = None) -> torch.Tensor:
    """y = x @ W^T + bias with W the NVFP4 weight [N, K]; x [..., K] -> y [..., N]."""
    x2 = x if x.dim() == 2 else x.reshape(-1, packed.shape[1] * 2)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    y = _forward(route("forward", x2, packed, scales, backend), x2, packed, scales, global_scale, bias)
    if y is None:  # humming could not build this weight (now off for its shape): the next row of the table
        kernel = route("forward", x2, packed, scales, backend)
        if kernel == "humming":
            raise RuntimeError("humming was routed again after it failed to build this weight")
        y = _forward(kernel, x2, packed, scales, global_scale, bias)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], packed.shape[0])


def nvfp4_dgrad(dy: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                global_scale: torch.Tensor, backend: Backend | str | None = None) -> torch.Tensor:
    """dx = dy @ W with W the NVFP4 weight [N, K]; dy [..., N] -> dx [..., K]."""
    n, k = packed.shape[0], packed.shape[1] * 2
    dy2 = dy.reshape(-1, n)
    kernel = route("dgrad", dy2, packed, scales, backend)
    if kernel == "reference":
        dx = nvfp4_dgrad_ref(dy2, packed, scales, global_scale)
    elif torch.compiler.is_compiling():
        dx = torch.ops.qerl_kit.nvfp4_dgrad(dy2, packed, scales, global_scale)
    else:
        from qerl_kit.kernels import nvfp4_dgrad_triton as dg

        dx = dg.nvfp4_dgrad(dy2, packed, scales, global_scale, strategy=_DGRAD[kernel])
    return dx.reshape(*dy.shape[:-1], k)


# -- NF4 and MXFP4 (lut4_triton) --------------------------------------------------------------------

def _lut4():
    from qerl_kit.kernels import lut4_triton

    return lut4_triton


# The launchers of the kernels the NF4/MXFP4 rows name (a test keeps them in step with the table).
_LUT4_FORWARD = {"lut4_gemv": lambda x2, p, s, fmt, b: _lut4().lut4_gemv(x2, p, s, fmt, b),
                 "lut4_dense": lambda x2, p, s, fmt, b: _lut4().lut4_dense_linear(x2, p, s, fmt, b),
                 "reference": lut4_linear_ref}
_LUT4_DGRAD = {"lut4_dense": lambda dy2, p, s, fmt: _lut4().lut4_dense_dgrad(dy2, p, s, fmt),
               "reference": lut4_dgrad_ref}


def lut4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, fmt: str,
                bias: torch.Tensor | None = None, backend: Backend | str | None = None) -> torch.Tensor:
    """y = x @ W^T + bias with W an NF4 (``scales`` = absmax) or MXFP4 weight [N, K]; x [..., K] -> y [..., N]."""
    x2 = x if x.dim() == 2 else x.reshape(-1, packed.shape[1] * 2)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    y = _LUT4_FORWARD[route("forward", x2, packed, scales, backend, fmt)](x2, packed, scales, fmt, bias)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], packed.shape[0])


def lut4_dgrad(dy: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, fmt: str,
               backend: Backend | str | None = None) -> torch.Tensor:
    """dx = dy @ W with W an NF4 or MXFP4 weight [N, K]; dy [..., N] -> dx [..., K]."""
    dy2 = dy.reshape(-1, packed.shape[0])
    dx = _LUT4_DGRAD[route("dgrad", dy2, packed, scales, backend, fmt)](dy2, packed, scales, fmt)
    return dx.reshape(*dy.shape[:-1], packed.shape[1] * 2)


# -- the training pass inside a dense-weight block --------------------------------------------------

# The routes that compute y = F.linear(x2, W, bias) and dx = dy @ W with W one dense weight a
# ``qerl_kit.dense_cache`` block can hold, per format: (forward kernels, input-gradient kernels).
HELD_ROUTES = {"nvfp4": (("dense", "reference"), ("dense", "reference")),
               "nf4": (("lut4_dense", "reference"), ("lut4_dense", "reference")),
               "mxfp4": (("lut4_dense", "reference"), ("lut4_dense", "reference"))}


_held_decisions: dict[tuple, str] = {}  # held_weight's forward kernel per call key, "" if not held (cleared with _decisions)


def held_weight(x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None,
                fmt: str = "nvfp4") -> torch.Tensor | None:
    """The dense W an open ``qerl_kit.dense_cache`` block holds for this call (made now on its first
    call), where both the call's forward and its input gradient route to a kernel of ``HELD_ROUTES``,
    which would compute ``F.linear(x2, W, bias)`` and ``dy @ W`` with exactly this W; else None (no
    block, the block refuses the weight, a packed kernel's rows, the dense path's row chunks).

    A layer that gets a W computes ``F.linear`` itself and lets autograd take the input gradient:
    the same matmuls as the routed calls, without a Python autograd Function, a second route and a
    second cache lookup per backward (the update phase's host time, which bounds small models).
    ``global_scale`` is NVFP4's (None for NF4 / MXFP4, whose ``scales`` are their block scales).
    """
    if not dense_cache.takes((packed, scales)):
        return None
    key = _call_key("held", get_backend(), x2, packed, scales, fmt)
    kernel = _held_decisions.get(key)
    if kernel is None:
        if len(_held_decisions) >= 8192:  # as route's decisions: many distinct row counts, start over
            _held_decisions.clear()
        forward, dgrad = HELD_ROUTES[fmt]
        kernel = route("forward", x2, packed, scales, fmt=fmt)
        # The dgrad rows' kernels read the call's rows, dtype and device only, never its strides or
        # alignment (tests/test_held_weight.py keeps it so), so x2 stands for the backward's dy2 [M, N].
        held = kernel in forward and route("dgrad", x2, packed, scales, fmt=fmt) in dgrad
        kernel = _held_decisions[key] = kernel if held else ""
    if not kernel:
        return None
    # the W the forward's kernel would read (the dgrad's is bit-identical: the Triton dequantizations
    # equal the references', tests/test_kernels.py and tests/test_lut4_kernels.py)
    if fmt != "nvfp4":
        if kernel == "reference":
            return reference.lut4_dequantize(packed, scales, fmt, x2.dtype, held_only=True)
        return _lut4().held_dense_weight(packed, scales, fmt, x2.dtype)
    if kernel == "reference":
        return reference.dequantize(packed, scales, global_scale, x2.dtype, held_only=True)
    from qerl_kit.kernels import nvfp4_gemm_triton as gm

    if gm.dense_chunk_rows(x2.shape[0], packed.shape[0]) is not None:  # the dense path's pieces: not one matmul
        return None
    return gm.cached_dense_weight(packed, scales, global_scale, x2.dtype)


# -- up-front compilation ---------------------------------------------------------------------------

def compile_shapes(shapes, dtype: torch.dtype = torch.bfloat16, device="cuda",
                   progress: bool = True) -> dict[tuple[int, int], float]:
    """Compile humming's kernels for those of these (N, K) weight shapes the routing table can send
    to humming, now, with a progress bar: {(N, K): seconds}; {} when humming is not usable here.
    ``qerl_kit.quantize.prepare_kernels`` does it for every NVFP4 layer shape of a model."""
    wanted = [(n, k) for n, k in shapes if routes.may_take("humming", n, k)]
    return _humming().compile_shapes(wanted, dtype, device, progress) if wanted else {}
