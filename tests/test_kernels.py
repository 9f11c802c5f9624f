"""NVFP4 Triton kernels against their plain-PyTorch references.

On a machine without CUDA the kernels run in Triton's CPU interpreter at small shapes. The
interpreter must be switched on (``TRITON_INTERPRET=1``) before Triton is first imported, and in
a full test run other modules import it earlier (peft -> torch._dynamo -> triton); then this
module re-runs itself in a subprocess with the variable set. With a GPU the same tests run
compiled, and the ``gpu`` tests add real layer shapes, the inline-PTX dequantization and CUDA
graph capture. Speed is measured in bench/bench_nvfp4_gemm.py, never here.

    python -m pytest tests/test_kernels.py -q
"""

import pytest
import torch

from tests import triton_interp

IN_PROCESS = triton_interp.enable()  # before Triton's first import

triton = pytest.importorskip("triton", reason="the NVFP4 kernels need triton (pip install triton)")

from qerl_kit import nvfp4  # noqa: E402
from qerl_kit.kernels import (Backend, backend, nvfp4_dgrad, nvfp4_dgrad_ref, nvfp4_linear,  # noqa: E402
                              nvfp4_linear_ref, set_backend)
from qerl_kit.kernels.nvfp4_dgrad_triton import nvfp4_dgrad as dgrad_kernel  # noqa: E402
from qerl_kit.kernels.nvfp4_gemm_triton import nvfp4_dequantize  # noqa: E402
from qerl_kit.kernels.nvfp4_gemm_triton import nvfp4_gemm as gemm_kernel  # noqa: E402
from qerl_kit.kernels.nvfp4_gemv_triton import nvfp4_gemv as gemv_kernel  # noqa: E402
from qerl_kit.linear import NVFP4Linear  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture(autouse=True)
def _kernels_runnable(request):
    triton_interp.skip_unless_runnable(request, IN_PROCESS, "test_kernels_in_an_interpreter_subprocess")


@pytest.mark.skipif(IN_PROCESS, reason="the kernel tests run in this process")
def test_kernels_in_an_interpreter_subprocess():
    triton_interp.rerun_in_subprocess(__file__)


MS, NS, KS = [1, 3, 16, 33], [32, 48], [64, 96]
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative error vs a float32 reference


def _weight(n, k, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))  # spread of scales
    return nvfp4.quantize(w).to(device)


def _randn(*shape, dtype, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _check(out, ref32, dtype):
    assert out.dtype == dtype and out.shape == ref32.shape
    assert torch.isfinite(out).all()
    assert _rel(out, ref32) < TOL[dtype]


# -- every kernel, several shapes, fresh inputs ----------------------------------------------------

@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("m", MS)
def test_forward_kernels_match_reference(m, n, k):
    q = _weight(n, k, seed=m * 1000 + n * 10 + k)
    x = _randn(m, k, dtype=torch.bfloat16, seed=m + n + k)
    bias = _randn(n, dtype=torch.bfloat16, seed=7)
    ref32 = nvfp4_linear_ref(x, q.packed, q.scales, q.global_scale, bias, dtype=torch.float32)
    _check(gemm_kernel(x, q.packed, q.scales, q.global_scale, bias), ref32, torch.bfloat16)
    _check(gemv_kernel(x, q.packed, q.scales, q.global_scale, bias), ref32, torch.bfloat16)
    y = gemv_kernel(x, q.packed, q.scales, q.global_scale, None)
    _check(y, nvfp4_linear_ref(x, q.packed, q.scales, q.global_scale, dtype=torch.float32), torch.bfloat16)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("m", MS)
def test_dgrad_kernel_matches_reference(m, n, k):
    q = _weight(n, k, seed=m * 999 + n + k)
    dy = _randn(m, n, dtype=torch.bfloat16, seed=m * n + k)
    ref32 = nvfp4_dgrad_ref(dy, q.packed, q.scales, q.global_scale, dtype=torch.float32)
    _check(dgrad_kernel(dy, q.packed, q.scales, q.global_scale), ref32, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tile_variants_and_fp16(dtype):
    """Transposed (swap-AB) products, wider tiles, ragged K/N, and fp16 activations."""
    m, n, k = 33, 48, 96
    q = _weight(n, k, seed=11)
    x = _randn(m, k, dtype=dtype, seed=12)
    dy = _randn(m, n, dtype=dtype, seed=13)
    bias = _randn(n, dtype=dtype, seed=14)
    ref = nvfp4_linear_ref(x, q.packed, q.scales, q.global_scale, bias, dtype=torch.float32)
    dref = nvfp4_dgrad_ref(dy, q.packed, q.scales, q.global_scale, dtype=torch.float32)
    for swap in (False, True):
        cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SWAP_AB=swap, GROUP_M=2)
        _check(gemm_kernel(x, q.packed, q.scales, q.global_scale, bias, config=cfg), ref, dtype)
        _check(dgrad_kernel(dy, q.packed, q.scales, q.global_scale, config=cfg), dref, dtype)
    for strategy in ("fused", "dense"):  # dense: a transient dequantized W, then torch's matmul
        _check(gemm_kernel(x, q.packed, q.scales, q.global_scale, bias, strategy=strategy), ref, dtype)
        _check(dgrad_kernel(dy, q.packed, q.scales, q.global_scale, strategy=strategy), dref, dtype)
    for rows, use_dot, split, prefetch in [(1, False, 1, False), (1, False, 2, True), (1, True, 2, False),
                                           (2, True, 1, False), (33, True, 3, False)]:
        cfg = dict(BLOCK_N=32, BLOCK_K=32, USE_DOT=use_dot, SPLIT_K=split,  # split-K: last slice sums
                   PREFETCH=prefetch)
        for _ in range(2):  # the second call finds the arrival counters reset by the first
            y = gemv_kernel(x[:rows], q.packed, q.scales, q.global_scale, bias, config=cfg)
            _check(y, ref[:rows], dtype)


def test_dense_strategy_in_pieces_of_weight_rows_matches_the_one_piece_product(monkeypatch):
    """Wide layers at many rows dequantize DENSE_CHUNK_N rows at a time into one reused buffer
    (the last piece ragged), with and without bias, and give the one-piece product."""
    from qerl_kit.kernels import nvfp4_gemm_triton as g

    m, n, k = 33, 40, 64
    q = _weight(n, k, seed=21)
    x = _randn(m, k, dtype=torch.bfloat16, seed=22)
    bias = _randn(n, dtype=torch.bfloat16, seed=23)
    whole = {b is None: gemm_kernel(x, q.packed, q.scales, q.global_scale, b, strategy="dense")
             for b in (None, bias)}
    assert g.dense_chunk_rows(m, n) is None
    monkeypatch.setattr(g, "DENSE_CHUNK_N", 16)
    monkeypatch.setattr(g, "DENSE_CHUNK_MIN_N", 32)
    monkeypatch.setattr(g, "DENSE_CHUNK_MIN_M", 33)
    assert g.dense_chunk_rows(m, n) == 16 and g.dense_chunk_rows(m - 1, n) is None
    calls = []
    real = g.nvfp4_dequantize
    monkeypatch.setattr(g, "nvfp4_dequantize", lambda *a, **kw: calls.append(kw["out"].shape) or real(*a, **kw))
    for b in (None, bias):
        ref = nvfp4_linear_ref(x, q.packed, q.scales, q.global_scale, b, dtype=torch.float32)
        y = gemm_kernel(x, q.packed, q.scales, q.global_scale, b, strategy="dense")
        _check(y, ref, torch.bfloat16)
        torch.testing.assert_close(y, whole[b is None], rtol=1e-2, atol=1e-2)
    assert calls == [(16, k), (16, k), (8, k)] * 2
    with pytest.raises(ValueError, match="out must be"):
        real(q.packed, q.scales, q.global_scale, torch.bfloat16, out=torch.empty(n, k + 16, dtype=torch.bfloat16))


def test_blockdot_code_placement_in_its_ptx_is_e2m1_times_2_pow_minus_14():
    """The block-dot kernel's inline PTX (``_PAIRS_F16``) emulated with the constants read from it,
    for every pair of code bytes: pair p holds codes p and p + 4 of the word as fp16 e2m1 * 2^-14."""
    import re

    from qerl_kit.kernels import nvfp4_blockdot_triton as g

    ptx = g._PAIRS_F16
    rot = int(re.search(r"shf\.r\.wrap\.b32 r, \$1, \$1, (\d+);", ptx).group(1))
    masks = [int(m, 16) for m in re.findall(r"lop3\.b32 w\d, \$1, r, (0x[0-9A-Fa-f]+), 0xE4;", ptx)]
    shifts = {int(h): int(d) for h, d in re.findall(r"shf\.l\.wrap\.b32 h(\d), w\d, w\d, (\d+);", ptx)}
    sources = {int(h): int(w) for h, w in re.findall(r"h(\d), w(\d), w\d", ptx)}
    sources[3] = int(re.search(r"and\.b32 h3, w(\d), ", ptx).group(1))
    keep = {int(m, 16) for m in re.findall(r"and\.b32 h\d, \w+, (0x[0-9A-Fa-f]+);", ptx)}
    assert len(masks) == 2 and len(keep) == 1
    keep = keep.pop()

    def rotl(w, d):
        return ((w << d) | (w >> (32 - d))) & 0xFFFFFFFF if d % 32 else w

    w = torch.arange(1 << 16, dtype=torch.int64)
    w = w | (w.flip(0) << 16)  # every pair of bytes, other codes in the high half
    r = rotl(w, 32 - rot)
    merged = [(w & m) | (r & (~m & 0xFFFFFFFF)) for m in masks]
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)

    def value(code):
        return torch.where(code >= 8, -e2m1[code & 7], e2m1[code & 7]) * 2.0**-14

    def as_f16(bits):
        b = (bits & 0xFFFF).to(torch.int32)
        return torch.where(b >= 2**15, b - 2**16, b).to(torch.int16).view(torch.float16).double()

    for p in range(4):
        bits = rotl(merged[sources[p]], shifts.get(p, 0)) & keep
        assert torch.equal(as_f16(bits), value((w >> (4 * p)) & 15)), p
        assert torch.equal(as_f16(bits >> 16), value((w >> (16 + 4 * p)) & 15)), p


@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
def test_blockdot_decode_kernel(half):
    """The block-dot decode kernel (M <= 4): split-K, prefetch, ragged K, bias, fp16 activations,
    and (half) the per-row power-of-two prescale of x (products in fp16 on the GPU)."""
    n, k = 48, 96
    q = _weight(n, k, seed=41)
    bias = _randn(n, dtype=torch.bfloat16, seed=42)
    for rows, split, prefetch, dtype in [(1, 1, False, torch.bfloat16), (2, 2, True, torch.bfloat16),
                                         (3, 3, False, torch.float16), (4, 1, True, torch.bfloat16)]:
        x = _randn(rows, k, dtype=dtype, seed=43 + rows) * (1000.0 if rows == 2 else 1.0)  # large rows too
        b = bias.to(dtype)
        ref = nvfp4_linear_ref(x, q.packed, q.scales, q.global_scale, b, dtype=torch.float32)
        cfg = dict(BLOCKDOT=True, BLOCK_N=32, BLOCK_K=64, SPLIT_K=split, PREFETCH=prefetch, HALF=half)
        for _ in range(2):  # the second call finds the arrival counters reset by the first
            _check(gemv_kernel(x, q.packed, q.scales, q.global_scale, b, config=cfg), ref, dtype)


def test_strided_and_batched_inputs_through_the_dispatcher():
    q = _weight(32, 64, seed=3)
    x = _randn(2, 5, 128, dtype=torch.bfloat16, seed=4)[..., ::2]  # non-contiguous last dim
    with set_backend("triton"):
        y = nvfp4_linear(x, q.packed, q.scales, q.global_scale)
        dx = nvfp4_dgrad(y, q.packed, q.scales, q.global_scale)
    ref = nvfp4_linear_ref(x, q.packed, q.scales, q.global_scale, dtype=torch.float32)
    assert y.shape == (2, 5, 32) and _rel(y, ref) < TOL[torch.bfloat16]
    dref = nvfp4_dgrad_ref(y, q.packed, q.scales, q.global_scale, dtype=torch.float32)
    assert dx.shape == (2, 5, 64) and _rel(dx, dref) < TOL[torch.bfloat16]


def test_dequantization_is_exact_for_every_code_and_scale_byte():
    """Every packed byte (both nibbles) under every finite E4M3 scale byte: the weight the kernel
    multiplies equals the reference's (portable path; the GPU test covers the FAST path)."""
    k = 512
    finite = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    n = finite.numel()  # 254 rows, one scale byte each
    packed = torch.arange(256, dtype=torch.uint8).repeat(n, 1).to(DEVICE)  # every byte in every row
    scales = finite[:, None].expand(n, k // 16).contiguous().view(torch.float8_e4m3fn).to(DEVICE)
    gs = torch.tensor([3.0], device=DEVICE)
    # x = identity picks out W^T one product at a time (exact in float32 accumulation)
    eye = torch.eye(k, dtype=torch.float32, device=DEVICE)
    w_ref = nvfp4_linear_ref(eye, packed, scales, gs, dtype=torch.float32)  # [k, n] = W^T
    cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SWAP_AB=False, GROUP_M=8)
    for dtype in (torch.bfloat16, torch.float16):
        w_kernel = gemm_kernel(eye.to(dtype), packed, scales, gs, config=cfg, FAST=False)
        expect = w_ref.to(dtype)
        assert torch.equal(w_kernel, expect), f"{dtype}: {(w_kernel != expect).sum().item()} weights differ"
        dense = nvfp4_dequantize(packed, scales, gs, dtype, FAST=False)  # the dense strategy's kernel
        assert torch.equal(dense.T, expect)


def test_zero_rows_and_shape_errors():
    q = _weight(32, 64, seed=5)
    x = torch.empty(0, 64, dtype=torch.bfloat16, device=DEVICE)
    assert gemm_kernel(x, q.packed, q.scales, q.global_scale).shape == (0, 32)
    with pytest.raises(ValueError, match="columns"):
        gemm_kernel(torch.zeros(2, 32, dtype=torch.bfloat16, device=DEVICE), q.packed, q.scales,
                    q.global_scale)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        gemv_kernel(torch.zeros(2, 64, device=DEVICE), q.packed, q.scales, q.global_scale)


# -- the backend switch and NVFP4Linear ------------------------------------------------------------

def test_backend_switch_env_context_and_errors(monkeypatch):
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert backend._parse("Triton") is Backend.TRITON and backend._parse(None) is Backend.AUTO
    with pytest.raises(ValueError, match="unknown kernel backend"):
        set_backend("cuda")
    before = backend.get_backend()
    with set_backend("reference") as chosen:
        assert chosen is Backend.REFERENCE and backend.resolve(x) is Backend.REFERENCE
        with set_backend(Backend.TRITON):
            assert backend.get_backend() is Backend.TRITON
        assert backend.get_backend() is Backend.REFERENCE
    assert backend.get_backend() is before
    assert backend.resolve(x, "auto") is Backend.REFERENCE  # AUTO never picks Triton for CPU tensors
    assert backend.resolve(x.float(), "auto") is Backend.REFERENCE
    if not CUDA:
        with pytest.raises(TypeError, match="bfloat16 or float16"):
            backend.resolve(x.float(), "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        backend.triton_status.cache_clear()
        try:
            assert backend.triton_status()[0] is False
            with pytest.raises(RuntimeError, match="cannot run on cpu"):
                backend.resolve(x, "triton")
        finally:
            monkeypatch.undo()
            backend.triton_status.cache_clear()


@pytest.mark.parametrize("rows", [3, 70])  # decode kernel and tiled GEMM
def test_nvfp4_linear_forward_and_backward_through_kernels(rows):
    torch.manual_seed(rows)
    lin = torch.nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    layer = NVFP4Linear.from_linear(lin).to(DEVICE)
    x = torch.randn(2, rows, 64, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    g = torch.randn(2, rows, 48, dtype=torch.bfloat16, device=DEVICE)
    with set_backend("triton"):
        y = layer(x)
        y.backward(g)
    x_ref = x.detach().float().requires_grad_(True)
    w = layer.dequantized_weight(torch.float32)
    y_ref = torch.nn.functional.linear(x_ref, w, layer.bias.float())
    y_ref.backward(g.float())
    assert _rel(y, y_ref) < TOL[torch.bfloat16] and _rel(x.grad, x_ref.grad) < TOL[torch.bfloat16]


def test_forced_triton_routes_by_rows_and_width():
    from qerl_kit.kernels import route
    from qerl_kit.kernels.routes import WIDE_N

    def kernel(m, n):
        q = _weight(n, 64, seed=n)
        return route("forward", _randn(m, 64, dtype=torch.bfloat16, seed=m), q.packed, q.scales, backend="triton")

    # from 128 rows the table sends CUDA tensors to the dense path (dequantize + cuBLAS, also ours);
    # the interpreter, which cannot run it, keeps the tiles
    wide = "dense" if CUDA else "triton_tiles"
    assert [kernel(m, 64) for m in (1, 8, 32, 33, 64, 65, 127, 200)] == \
        ["triton_gemv"] * 5 + ["triton_tiles"] * 2 + [wide]
    # the wide fused gate/up widths take the tiled kernel from 33 rows (dense needs CUDA tensors)
    assert [kernel(m, WIDE_N) for m in (32, 33)] == ["triton_gemv", "triton_tiles"]


def test_ops_are_registered_with_fake_implementations():
    q = _weight(32, 64, seed=9)
    x = _randn(3, 64, dtype=torch.bfloat16, seed=10)
    ops = torch.ops.qerl_kit
    for op, args in [(ops.nvfp4_gemv, (x, q.packed, q.scales, q.global_scale, None)),
                     (ops.nvfp4_gemm, (x, q.packed, q.scales, q.global_scale, None)),
                     (ops.nvfp4_dgrad, (x[:, :32].contiguous(), q.packed, q.scales, q.global_scale))]:
        torch.library.opcheck(op, args, test_utils="test_faketensor")


# -- GPU only: real layer shapes, the inline-PTX path, CUDA graphs ---------------------------------

REAL = [(3584, 3584), (4608, 3584), (18944, 3584), (3584, 18944), (1024, 8192), (37888, 3584)]  # N x K (Qwen2.5)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", REAL, ids=lambda v: str(v))
def test_gpu_real_shapes(n, k):
    q = _weight(n, k, seed=n + k, device="cuda")
    bias = _randn(n, dtype=torch.bfloat16, seed=1, device="cuda")
    torch.empty(64 << 20, device="cuda").fill_(float("nan"))  # poison the allocator's free blocks
    for m in (1, 8, 24, 48, 64, 256, 2048):  # 24 and 48: the configs tried only above 16 rows
        x = _randn(m, k, dtype=torch.bfloat16, seed=m, device="cuda")
        ref = nvfp4_linear_ref(x, q.packed, q.scales, q.global_scale, bias, dtype=torch.float32)
        _check(nvfp4_linear(x, q.packed, q.scales, q.global_scale, bias), ref, torch.bfloat16)
        dy = _randn(m, n, dtype=torch.bfloat16, seed=m + 1, device="cuda")
        dref = nvfp4_dgrad_ref(dy, q.packed, q.scales, q.global_scale, dtype=torch.float32)
        _check(nvfp4_dgrad(dy, q.packed, q.scales, q.global_scale), dref, torch.bfloat16)
        if m >= 256:  # the strategy the dispatcher did not take, too
            for strategy in ("fused", "dense"):
                _check(gemm_kernel(x, q.packed, q.scales, q.global_scale, bias, strategy=strategy), ref,
                       torch.bfloat16)
                _check(dgrad_kernel(dy, q.packed, q.scales, q.global_scale, strategy=strategy), dref,
                       torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_fast_dequant_matches_portable_path(dtype):
    """Inline-PTX dequantization vs the exact integer path: weights within one ulp, outputs close."""
    n, k = 512, 1024
    q = _weight(n, k, seed=21, device="cuda")
    eye = torch.eye(k, dtype=dtype, device="cuda")
    fast = gemm_kernel(eye, q.packed, q.scales, q.global_scale, FAST=True).float()
    exact = gemm_kernel(eye, q.packed, q.scales, q.global_scale, FAST=False).float()
    assert torch.equal(exact, nvfp4_linear_ref(eye.float(), q.packed, q.scales, q.global_scale).to(dtype).float())
    ulp = torch.finfo(dtype).eps * exact.abs()
    assert ((fast - exact).abs() <= ulp + 1e-30).all()
    dense = nvfp4_dequantize(q.packed, q.scales, q.global_scale, dtype).float().T  # FAST path
    assert ((dense - exact).abs() <= ulp + 1e-30).all()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", REAL, ids=lambda v: str(v))
def test_gpu_blockdot_variants_real_shapes(n, k):
    """Both block-dot variants (float32 and fp16 products) at real shapes, M = 1..4, incl. rows
    of very large and very small activations (the fp16 path rescales x per row)."""
    q = _weight(n, k, seed=n * 3 + k, device="cuda")
    bias = _randn(n, dtype=torch.bfloat16, seed=2, device="cuda")
    for m in (1, 2, 3, 4):
        x = _randn(m, k, dtype=torch.bfloat16, seed=m + 50, device="cuda")
        x[0, :7] *= 3000.0  # outlier channels
        if m > 1:
            x[1] *= 1e-6
        ref = nvfp4_linear_ref(x, q.packed, q.scales, q.global_scale, bias, dtype=torch.float32)
        for half in (False, True):
            for bn, bk in ((128, 256), (64, 512)):
                cfg = dict(BLOCKDOT=True, BLOCK_N=bn, BLOCK_K=bk, HALF=half, PREFETCH=True, CTAS_PER_SM=4)
                y = gemv_kernel(x, q.packed, q.scales, q.global_scale, bias, config=cfg)
                _check(y, ref, torch.bfloat16)
                for r in range(m):  # every row on its own scale, too
                    assert _rel(y[r], ref[r]) < TOL[torch.bfloat16], (half, bn, bk, m, r)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gpu_decode_rows_capture_in_a_cuda_graph(m):
    q = _weight(3584, 3584, seed=61, device="cuda")
    x = _randn(m, 3584, dtype=torch.bfloat16, seed=62, device="cuda")
    # our kernels (bitwise deterministic); humming's graphs are tested in test_humming.py, within bf16
    nvfp4_linear(x, q.packed, q.scales, q.global_scale, backend="ours")  # warm-up: autotunes
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = nvfp4_linear(x, q.packed, q.scales, q.global_scale, backend="ours")
    for seed in (63, 64):
        x.copy_(_randn(m, 3584, dtype=torch.bfloat16, seed=seed, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_graph, nvfp4_linear(x, q.packed, q.scales, q.global_scale, backend="ours"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_decode_captures_in_a_cuda_graph():
    q = _weight(4608, 3584, seed=31, device="cuda")
    x = _randn(8, 3584, dtype=torch.bfloat16, seed=32, device="cuda")
    y_eager = nvfp4_linear(x, q.packed, q.scales, q.global_scale, backend="ours")  # warm-up: autotunes
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = nvfp4_linear(x, q.packed, q.scales, q.global_scale, backend="ours")
    x.copy_(_randn(8, 3584, dtype=torch.bfloat16, seed=33, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_graph, nvfp4_linear(x, q.packed, q.scales, q.global_scale, backend="ours"))
    assert not torch.equal(y_graph, y_eager)
