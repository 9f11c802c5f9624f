"""The NVFP4 dense route (Triton dequantize + matmul) inside a dense-weight cache block.

The forward and the input gradient of the ``dense`` strategy read one cached W per block (made by
the route's own ``nvfp4_dequantize``), in one piece and in pieces of weight rows (wide layers), and
give the bits they give without the block. On a machine without CUDA the Triton kernels run in the
CPU interpreter (tests/triton_interp.py), where the dispatcher never routes to ``dense``, so these
tests call the strategy directly; with CUDA the same tests run compiled (and tests/test_dense_update.py
checks the routed calls).
"""

import pytest
import torch

from tests import triton_interp

IN_PROCESS = triton_interp.enable()  # before Triton's first import

triton = pytest.importorskip("triton", reason="the NVFP4 kernels need triton (pip install triton)")

from qerl_kit import dense_cache, nvfp4  # noqa: E402
from qerl_kit.kernels import nvfp4_dgrad_triton as dg  # noqa: E402
from qerl_kit.kernels import nvfp4_gemm_triton as g  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _kernels_runnable(request):
    triton_interp.skip_unless_runnable(request, IN_PROCESS, "test_in_an_interpreter_subprocess")


@pytest.mark.skipif(IN_PROCESS, reason="the kernel tests run in this process")
def test_in_an_interpreter_subprocess():
    triton_interp.rerun_in_subprocess(__file__)


def _operands(m, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    q = nvfp4.quantize(torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen))).to(DEVICE)
    x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
    dy = torch.randn(m, n, generator=gen).to(DEVICE, torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(DEVICE, torch.bfloat16)
    return q, x, dy, bias


def _count(monkeypatch):
    calls = []
    real = g.nvfp4_dequantize
    spy = lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw)  # noqa: E731
    monkeypatch.setattr(g, "nvfp4_dequantize", spy)
    monkeypatch.setattr(dg, "nvfp4_dequantize", spy)
    return calls


def _both(q, x, dy, bias):
    y = g.nvfp4_gemm(x, q.packed, q.scales, q.global_scale, bias, strategy="dense")
    dx = dg.nvfp4_dgrad(dy, q.packed, q.scales, q.global_scale, strategy="dense")
    return y, dx


@pytest.mark.parametrize("pieces", [False, True])
def test_dense_route_reads_one_cached_weight_per_block_with_identical_bits(pieces, monkeypatch):
    m, n, k = 40, 48, 64
    q, x, dy, bias = _operands(m, n, k, seed=7)
    if pieces:  # the wide-layer path: 16 weight rows at a time (the last piece too), as without the cache
        monkeypatch.setattr(g, "DENSE_CHUNK_N", 16)
        monkeypatch.setattr(g, "DENSE_CHUNK_MIN_N", 32)
        monkeypatch.setattr(g, "DENSE_CHUNK_MIN_M", 33)
        assert g.dense_chunk_rows(m, n) == 16
    calls = _count(monkeypatch)
    y0, dx0 = _both(q, x, dy, bias)
    assert len(calls) == (1 + n // 16 if pieces else 2)  # uncached: per call (the forward in pieces)
    calls.clear()
    with dense_cache.dense_weight_cache(budget_bytes=n * k * 2, cuda=True) as block:
        for _ in range(3):
            y1, dx1 = _both(q, x, dy, bias)
            assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    assert calls == [n] and (block.misses, block.hits, block.refused) == (1, 5, 0)  # one whole W, shared
    assert y0.abs().sum() > 0 and dx0.abs().sum() > 0


def test_a_weight_over_the_budget_takes_the_uncached_route(monkeypatch):
    m, n, k = 24, 32, 64
    q, x, dy, bias = _operands(m, n, k, seed=8)
    y0, dx0 = _both(q, x, dy, bias)
    calls = _count(monkeypatch)
    with dense_cache.dense_weight_cache(budget_bytes=n * k * 2 - 1, cuda=True) as block:
        for _ in range(2):
            y1, dx1 = _both(q, x, dy, bias)
            assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    assert len(calls) == 4 and block.refused == 1 and block.peak_bytes == 0
