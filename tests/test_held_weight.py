"""The training pass's held path (``qerl_kit.kernels.held_weight``, ``QuantLinear._forward_held``).

Inside a dense-weight block that holds a layer's weight, a call whose routes are dense matmuls runs
``F.linear`` on the block's W and lets autograd take the input gradient: the routed path's matmuls,
bit for bit, without the Python autograd Function (and its second route and cache lookup) per
backward. Everywhere else (no block, a refused weight, a packed kernel's rows) the layer takes the
routed path as before. Also the cache's identity lookup that makes a held call's lookup cheap.
"""

import zlib

import pytest
import torch
from torch import nn

from qerl_kit import dense_cache, kernels
from qerl_kit.kernels import routes
from qerl_kit.linear import MXFP4Linear, NF4Linear, NVFP4Linear

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LAYERS = {"nvfp4": NVFP4Linear, "nf4": NF4Linear, "mxfp4": MXFP4Linear}


def _layer(fmt, bias, seed, n=48, k=64, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return LAYERS[fmt].from_linear(lin.to(dtype))


def _input(seed, shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 2).to(dtype).requires_grad_()


def _routed(layer, x):
    """The layer's forward as before the held path: its autograd Function (``_RoutedMatmul``, or
    ``_FrozenQuantMatmul`` on the plain-PyTorch path) or its no-grad kernel call."""
    layer._forward_held = lambda v: None
    try:
        return layer(x)
    finally:
        del layer._forward_held


def _grads(fn, layer, x, dy):
    x = x.detach().clone().requires_grad_()
    y = fn(layer, x)
    y.backward(dy)
    return y.detach(), x.grad, y.grad_fn


@pytest.mark.parametrize("fmt", list(LAYERS))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(40, 64), (3, 7, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_held_path_gives_the_routed_paths_bits_without_a_python_function(fmt, bias, shape, dtype):
    seed = zlib.crc32(repr((fmt, bias, shape, dtype)).encode()) % 1000  # fresh per case, the same every run
    layer, x = _layer(fmt, bias, seed, dtype=dtype), _input(seed + 1, shape, dtype)
    dy = _input(seed + 2, (*shape[:-1], layer.out_features), dtype).detach()
    with dense_cache.dense_weight_cache() as block:
        y0, dx0, fn0 = _grads(_routed, layer, x, dy)
        y1, dx1, fn1 = _grads(lambda m, v: m(v), layer, x, dy)
        assert kernels.held_weight(x.reshape(-1, 64), layer.packed, layer.block_scales,
                                   getattr(layer, "global_scale", None), fmt) is not None
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    assert y1.abs().sum() > 0 and dx1.abs().sum() > 0
    assert "Matmul" in type(fn0).__name__ and "Matmul" not in type(fn1).__name__  # autograd's own linear
    assert block.misses == 1  # one dense W, read by the routed calls and the held forward alike


@pytest.mark.parametrize("fmt", list(LAYERS))
def test_a_bias_of_another_dtype_than_the_input_is_cast_as_on_the_routed_path(fmt):
    """A float32 layer (bias included) called with bfloat16 rows: the held W is the input's dtype and the
    bias is cast to it, so the held call gives the routed path's bits (the bias is read once per call)."""
    layer, x = _layer(fmt, True, 21), _input(22, (2, 5, 64), torch.bfloat16)
    dy = _input(23, (2, 5, layer.out_features), torch.bfloat16).detach()
    with dense_cache.dense_weight_cache():
        y0, dx0, _ = _grads(_routed, layer, x, dy)
        y1, dx1, fn1 = _grads(lambda m, v: m(v), layer, x, dy)
    assert layer.bias.dtype == torch.float32 and y1.dtype == torch.bfloat16
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and "Matmul" not in type(fn1).__name__


def test_a_bias_made_a_parameter_is_still_added_on_the_held_path():
    layer, x = _layer("nvfp4", True, 24), _input(25, (6, 64))
    layer.bias = nn.Parameter(torch.randn(layer.out_features), requires_grad=False)  # no longer a buffer
    with dense_cache.dense_weight_cache():
        y0 = _routed(layer, x)
        y1 = layer(x)
    assert "bias" not in layer._buffers and torch.equal(y0, y1)
    assert not torch.equal(y1, torch.nn.functional.linear(x, layer.dequantized_weight()))


@pytest.mark.parametrize("fmt", list(LAYERS))
def test_outside_a_block_or_over_its_budget_the_layer_takes_the_routed_path(fmt):
    layer, x = _layer(fmt, True, 5), _input(6, (4, 9, 64))
    x2 = x.reshape(-1, 64)
    scale = getattr(layer, "global_scale", None)
    for block in (None, 0):  # no block; a block whose budget refuses every weight
        if block is None:
            y = layer(x)
            assert kernels.held_weight(x2, layer.packed, layer.block_scales, scale, fmt) is None
        else:
            with dense_cache.dense_weight_cache(budget_bytes=block) as b:
                y = layer(x)
                assert kernels.held_weight(x2, layer.packed, layer.block_scales, scale, fmt) is None
            assert b.refused == 1 and b.misses == 0
        assert "Matmul" in type(y.grad_fn).__name__
        y.sum().backward()
        assert x.grad.abs().sum() > 0
        x.grad = None


def test_a_backward_in_the_block_routes_nothing_and_looks_nothing_up(monkeypatch):
    layer, x = _layer("nvfp4", False, 7), _input(8, (2, 5, 64))
    calls = []
    real_route, real_lookup = kernels.route, dense_cache.cached_or_none
    monkeypatch.setattr(kernels, "route", lambda *a, **kw: calls.append("route") or real_route(*a, **kw))
    monkeypatch.setattr(dense_cache, "cached_or_none", lambda *a, **kw: calls.append("cache") or real_lookup(*a, **kw))
    with dense_cache.dense_weight_cache():
        y = layer(x)
        assert calls  # the forward decided the route and read the block
        calls.clear()
        y.square().sum().backward()
    assert calls == [] and x.grad.abs().sum() > 0


def test_every_input_gradient_row_reads_no_alignment_so_the_forward_input_stands_for_dy():
    # held_weight decides the backward's route from the forward's x2: sound while every dgrad row's
    # kernel is a Triton one or the reference, whose ``kernels._runs`` reads only the call's device
    families = {routes.KERNELS[r.kernel].family for r in routes.ROUTES if r.op == "dgrad"}
    assert families <= {"triton", "reference"}
    assert set(kernels.HELD_ROUTES) == set(routes.FORMATS_ROUTED)
    for forward, dgrad in kernels.HELD_ROUTES.values():
        assert set(forward) | set(dgrad) <= set(routes.KERNELS)


def test_a_subclass_of_another_format_takes_the_plain_pytorch_held_path():
    class Other(NF4Linear):  # registered as its own format: the kernels know NF4's layout only
        fmt = "nf4-copy"

    base = _layer("nf4", True, 9)
    layer = Other(base.in_features, base.out_features, base.bias, base.quant_tensor())
    x, dy = _input(10, (6, 64)), _input(11, (6, base.out_features)).detach()
    with dense_cache.dense_weight_cache() as block:
        y0, dx0, _ = _grads(_routed, layer, x, dy)
        y1, dx1, fn = _grads(lambda m, v: m(v), layer, x, dy)
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and "Matmul" not in type(fn).__name__
    assert block.misses == 1


def test_the_identity_lookup_hits_only_the_very_tensors_at_their_versions():
    g = torch.Generator().manual_seed(12)
    a, b, c = (torch.randn(4, 4, generator=g) for _ in range(3))
    made = []

    def make(*ts):
        return lambda: made.append(1) or sum(t.clone() for t in ts)

    with dense_cache.dense_weight_cache() as block:
        first = dense_cache.cached_or_none((a, b), torch.float32, make(a, b), tag="t")
        assert dense_cache.cached_or_none((a, b), torch.float32, make(a, b), tag="t") is first
        other = dense_cache.cached_or_none((a, c), torch.float32, make(a, c), tag="t")  # same first tensor
        assert torch.equal(other, a + c) and not torch.equal(other, first)
        assert dense_cache.cached_or_none((a, b), torch.float32, make(a, b), tag="t") is first
        assert dense_cache.cached_or_none((a.view(4, 4), b), torch.float32, make(a, b), tag="t") is first  # full key
        b.add_(1.0)  # changed in place: recomputed, never served stale
        fresh = dense_cache.cached_or_none((a, b), torch.float32, make(a, b), tag="t")
        assert torch.equal(fresh, a + b) and not torch.equal(fresh, first)
        assert dense_cache.cached_or_none((a, b), torch.float32, make(a, b), tag="u") is not fresh  # another tag
    assert len(made) == 4 and block.misses == 4 and block.hits == 3
    assert not block._by_id and not block.entries



# ----------------------------------------------------------------------------- CUDA (skipped without a GPU)

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the dense routes and the packed kernels' rows")
@pytest.mark.parametrize("fmt", list(LAYERS))
def test_cuda_held_path_on_the_dense_route_and_packed_kernels_below_it(fmt):
    layer = _layer(fmt, True, 13, n=1024, k=512, dtype=torch.bfloat16).to("cuda")
    scale = getattr(layer, "global_scale", None)
    for rows, held in ((384, True), (16, False)):  # 384: dense routes; 16: the decode kernels' rows
        x = _input(14 + rows, (rows, 512), torch.bfloat16).detach().to("cuda").requires_grad_()
        dy = _input(15 + rows, (rows, 1024), torch.bfloat16).detach().to("cuda")
        with dense_cache.dense_weight_cache(cuda=True):
            assert (kernels.held_weight(x.detach(), layer.packed, layer.block_scales, scale, fmt) is not None) == held
            y0, dx0, _ = _grads(_routed, layer, x, dy)
            y1, dx1, fn = _grads(lambda m, v: m(v), layer, x, dy)
        assert ("Matmul" not in type(fn).__name__) == held
        assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and dx1.abs().sum() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the reference backend on GPU tensors")
@pytest.mark.parametrize("fmt", list(LAYERS))
def test_cuda_reference_backend_holds_the_references_weight(fmt):
    # a forced reference backend routes every call to the plain-PyTorch path: the held W is the reference's
    # (tag nvfp4-reference / the format's), never a Triton kernel's
    layer = _layer(fmt, False, 16, n=256, k=128, dtype=torch.bfloat16).to("cuda")
    x = _input(17, (300, 128), torch.bfloat16).detach().to("cuda").requires_grad_()
    dy = _input(18, (300, 256), torch.bfloat16).detach().to("cuda")
    with kernels.set_backend("reference"), dense_cache.dense_weight_cache(cuda=True) as block:
        y0, dx0, _ = _grads(_routed, layer, x, dy)
        y1, dx1, fn = _grads(lambda m, v: m(v), layer, x, dy)
        tags = {key[0] for key in block.entries}
    assert "Matmul" not in type(fn).__name__ and torch.equal(y0, y1) and torch.equal(dx0, dx1)
    assert tags == {"nvfp4-reference" if fmt == "nvfp4" else fmt}


def test_takes_says_whether_an_open_block_caches_these_tensors():
    t = torch.randn(4, 4)
    assert not dense_cache.takes((t,))  # no block
    with dense_cache.dense_weight_cache():
        assert dense_cache.takes((t,))
        assert not dense_cache.takes((t.clone().requires_grad_(),))  # a tensor that needs a gradient
        with torch.no_grad():
            assert dense_cache.takes((t.clone().requires_grad_(),))
    with dense_cache.dense_weight_cache(enabled=False):
        assert not dense_cache.takes((t,))
