"""NVFP4 forward GEMMs on humming-kernels, the vLLM project's JIT-compiled W4A16 GEMM library.

humming reads our tensors as they are, through its compressed-tensors weight schema
(``format="nvfp4-pack-quantized"``, ``strategy="tensor_group"``, ``group_size=16``):
``weight_packed`` is our ``packed`` (uint8 [N, K/2]), ``weight_scale`` our ``scales`` (E4M3
[N, K/16]) and ``weight_global_scale`` our ``global_scale`` (the divisor, float32 [1]).
``transform()`` repacks them once into its own layout (the same number of bytes), and the first
use of a layer shape compiles one kernel per range of rows (about 90 ranges, 13-15 s per shape on
the H200). Compiled kernels are cached on disk by humming (``HUMMING_CACHE_DIR``, default
``~/.humming/cache``), so a second process starts in milliseconds.

* ``HummingGemm(packed, scales, global_scale, dtype)``: one weight repacked, its kernels compiled;
  calling it with x [M, K] gives y [M, N] in ``dtype``. Calls go straight to humming's launcher op
  with the row-range table resolved once (``layer(x)`` re-parses its configs on every call).
* ``gemm_for(packed, scales, global_scale, dtype)``: the ``HummingGemm`` of a weight, built on
  first use and kept while the weight tensor lives (a weak reference; an in-place write to the
  weight, such as ``load_state_dict``, rebuilds it).
* ``compile_shapes(shapes, dtype)``: compile the kernels of every (N, K) up front, with a
  progress bar; weights are repacked later, at their first call, and only where they are used.
* ``humming_status()``: (usable, reason). If humming is missing, outside the supported versions
  or its compiler is, NVFP4 matmuls fall back to qerl_kit's own kernels with one warning; a layer
  shape humming fails to build (``shape_ok``) falls back alone, with one warning of its own.

The repacked weight is a second copy of the 4-bit weight (our packed tensors stay: the input
gradient, the reference and checkpoints read them); docs/kernels.md counts what it costs.
"""

from __future__ import annotations

import functools
import importlib.metadata
import time
import warnings
import weakref

import torch

SUPPORTED = ((0, 1, 10), (0, 2, 0))  # [lowest, first unsupported): 0.1.10 is what vLLM 0.26 pins
SCHEMA = dict(quant_method="compressed-tensors", format="nvfp4-pack-quantized", type="float", num_bits=4,
              strategy="tensor_group", group_size=16, symmetric=True)
DTYPES = (torch.bfloat16, torch.float16)

_disabled: str | None = None  # why humming was turned off in this process after a failure
_failed: dict[tuple[int, int, torch.dtype], str] = {}  # (N, K, dtype) humming failed to build, and why


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


@functools.lru_cache(maxsize=None)
def _static_status() -> tuple[bool, str]:
    try:
        version = importlib.metadata.version("humming-kernels")
    except importlib.metadata.PackageNotFoundError:
        return False, "humming-kernels is not installed (pip install 'qerl_kit[gpu]')"
    lo, hi = SUPPORTED
    if not lo <= _version_tuple(version) < hi:
        return False, (f"humming-kernels {version} is outside the supported range "
                       f">={'.'.join(map(str, lo))},<{'.'.join(map(str, hi))}")
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (7, 5):
        return False, f"compute capability {major}.{minor} < 7.5 (humming needs SM75 or newer)"
    return True, f"humming-kernels {version} on {torch.cuda.get_device_name()}"


def humming_status() -> tuple[bool, str]:
    """(usable, reason): whether the humming path can run in this process."""
    if _disabled is not None:
        return False, _disabled
    return _static_status()


def disable(reason: str) -> None:
    """Turn humming off for the rest of the process, with one warning that says why."""
    global _disabled
    if _disabled is None:
        _disabled = reason
        warnings.warn(f"humming-kernels is off for this process ({reason}); NVFP4 matmuls fall back to "
                      "qerl_kit's own kernels", RuntimeWarning, stacklevel=3)


def shape_ok(n: int, k: int, dtype: torch.dtype) -> bool:
    """False once building an [n, k] layer for ``dtype`` failed in this process."""
    return (n, k, dtype) not in _failed


def _fail(n: int, k: int, dtype: torch.dtype, err: Exception) -> None:
    """Record a failed build: a missing library or compiler (ImportError, OSError) turns humming
    off for the process; anything else turns off this layer shape only. One warning each."""
    reason = (f"building a [{n} x {k}] {str(dtype).removeprefix('torch.')} layer failed: "
              f"{type(err).__name__}: {str(err)[:300]}")
    if isinstance(err, (ImportError, OSError)):
        disable(reason)
    elif (n, k, dtype) not in _failed:
        _failed[n, k, dtype] = reason
        warnings.warn(f"humming-kernels cannot take this layer shape ({reason}); its matmuls run on qerl_kit's "
                      "own kernels", RuntimeWarning, stacklevel=4)


def _reset_for_tests() -> None:
    global _disabled
    _disabled = None
    _cache.clear()
    _failed.clear()


class HummingGemm:
    """One NVFP4 weight [N, K] in humming's layout, with its compiled kernels: ``self(x) -> y``."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                 dtype: torch.dtype = torch.bfloat16):
        from humming.kernel.humming import HummingKernel
        from humming.layer import HummingLayer

        if dtype not in DTYPES:
            raise TypeError(f"humming takes bfloat16 or float16 activations; got {dtype}")
        self.n, self.k, self.dtype = packed.shape[0], packed.shape[1] * 2, dtype
        with torch.device(packed.device):  # the layer's parameters are allocated on the weight's GPU
            layer = HummingLayer(shape_n=self.n, shape_k=self.k, weight_config=dict(SCHEMA), torch_dtype=dtype)
        layer.load_from_tensors({"weight_packed": packed, "weight_scale": scales,
                                 "weight_global_scale": global_scale.reshape(1).float()})
        layer.transform()
        self.layer = layer
        # The row-range -> kernel table (compiles on first use of this layer configuration), and the
        # launcher op's arguments in this humming version's order.
        if getattr(layer, "humming_config", None) is not None:  # humming >= 0.1.11
            self.configs = HummingKernel.prepare_kernels(layer.humming_config.to_str(), None, None, packed.device)
            self._op = torch.ops.humming.launch_kernel.default
            scale2 = getattr(layer, "weight_scale_2", None)
            self._before = (layer.weight, layer.weight_scale, scale2, None, None, None, None, None)
            self._after = (None, None, None, None, layer.locks, 1, 0)
        else:  # humming 0.1.10
            meta = layer.humming_metas[""]
            self.configs = HummingKernel.prepare_kernels(meta.to_str(), None, None)
            self._op = torch.ops.humming.launch_kernel
            gs = getattr(layer, meta.global_scale_name, None)
            self._before = (layer.weight, None, None, layer.weight_scale, None, None, gs)
            self._after = (None, None, None, None, layer.locks, 1, 0)

    @property
    def nbytes(self) -> int:
        """Bytes of the repacked weight (the extra memory this copy costs)."""
        return sum(t.numel() * t.element_size() for t in self.layer.state_dict().values())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """y = x @ W^T for x [M, K] (rows may be strided; the last dim must be contiguous)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        return self._op(self.configs, x, *self._before, *self._after)


# (id of the packed tensor, dtype) -> (weak ref to it, its version counter at build, HummingGemm)
_cache: dict[tuple[int, torch.dtype], tuple[weakref.ref, int, HummingGemm]] = {}


def cached(packed: torch.Tensor, dtype: torch.dtype) -> HummingGemm | None:
    """The weight's ``HummingGemm`` if one is built and still matches the tensor (cheap: no build)."""
    hit = _cache.get((id(packed), dtype))
    if hit is not None and hit[0]() is packed and hit[1] == packed._version:
        return hit[2]
    return None


def gemm_for(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
             dtype: torch.dtype) -> HummingGemm | None:
    """The ``HummingGemm`` of this weight for ``dtype`` activations, built on first use; None when
    humming is off here or fails for this weight (then it is off for the process, with a warning)."""
    gemm = cached(packed, dtype)
    if gemm is not None:
        return gemm
    n, k = packed.shape[0], packed.shape[1] * 2
    if not humming_status()[0] or not shape_ok(n, k, dtype):
        return None
    if packed.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("an NVFP4 weight met humming for the first time inside a CUDA graph capture: "
                           "run one eager call per weight first (or qerl_kit.kernels.prepare_model)")
    try:
        gemm = HummingGemm(packed, scales, global_scale, dtype)
    except Exception as e:  # noqa: BLE001 - any failure (import, JIT compile, schema) means: use ours
        _fail(n, k, dtype, e)
        return None
    key = (id(packed), dtype)
    _cache[key] = (weakref.ref(packed, lambda _ref, key=key: _cache.pop(key, None)), packed._version, gemm)
    return gemm


def compile_shapes(shapes, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda",
                   progress: bool = True) -> dict[tuple[int, int], float]:
    """Compile humming's kernels for every (N, K) in ``shapes`` (seconds per shape; a shape already
    in humming's disk cache takes milliseconds). Each shape is built once on a random weight, so
    the real weights only repack at their first call. Returns {} when humming is off here."""
    from tqdm.auto import tqdm

    if not humming_status()[0]:
        return {}
    shapes = sorted({(int(n), int(k)) for n, k in shapes})
    seconds = {}
    # the bar shows only once a shape takes a while: shapes in humming's disk cache load in milliseconds
    bar = tqdm(shapes, desc="compiling humming kernels", unit="shape", disable=not progress, delay=1.0)
    for n, k in bar:
        bar.set_postfix_str(f"{n} x {k}", refresh=False)  # a refresh would print a cached shape's bar
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
        # generic scales (not all powers of two, which humming may compile a special case for)
        scales = (torch.rand(n, k // 16, device=device) * 300 + 8).to(torch.float8_e4m3fn)
        t0 = time.perf_counter()
        try:
            HummingGemm(packed, scales, torch.ones(1, device=device), dtype)
        except Exception as e:  # noqa: BLE001
            _fail(n, k, dtype, e)
            if not humming_status()[0]:
                return seconds
            continue
        seconds[n, k] = time.perf_counter() - t0
        del packed, scales
    return seconds
