"""NF4 / MXFP4 Triton kernels (qerl_kit/kernels/lut4_triton.py) against the formats' references.

Without CUDA the kernels run in Triton's CPU interpreter at small shapes (switched on before
Triton's first import, else this module re-runs itself in a subprocess, as tests/test_kernels.py).
With a GPU the same tests run compiled, and the ``gpu`` tests add the 7B shapes and CUDA graphs.

* the dequantize kernel equals ``nf4.dequantize`` / ``mxfp4.dequantize`` bit for bit;
* the GEMV equals the float32 product of x and the reference's weight (rounded to x's dtype)
  within float32 accumulation: |y - ref| <= eps_out * |ref| + 2 K 2^-24 (|x| @ |W|^T), eps_out
  the output dtype's rounding (2^-8 bf16, 2^-11 fp16, 0 fp32);
* routed ``NF4Linear`` / ``MXFP4Linear`` forward and backward equal the reference path (the
  dense path exactly, the GEMV within the bound above).
"""

import pytest
import torch

from tests import triton_interp

IN_PROCESS = triton_interp.enable()  # before Triton's first import

triton = pytest.importorskip("triton", reason="the LUT4 kernels need triton (pip install triton)")

from qerl_kit import kernels, mxfp4, nf4  # noqa: E402
from qerl_kit.kernels import lut4_triton  # noqa: E402
from qerl_kit.linear import MXFP4Linear, NF4Linear  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
MODULES = {"nf4": nf4, "mxfp4": mxfp4}
LAYERS = {"nf4": NF4Linear, "mxfp4": MXFP4Linear}
EPS = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 0.0}
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
# N = 40 is not a multiple of the tiles (16 in the interpreter, 32/64 on the GPU); K: NF4's 192 and
# MXFP4's 96 are whole blocks but not whole 64-wide tiles for MXFP4; 512 splits K (split-K path).
SHAPES = {"nf4": [(40, 192), (40, 512)], "mxfp4": [(40, 96), (40, 512)]}


@pytest.fixture(autouse=True)
def _kernels_runnable(request):
    triton_interp.skip_unless_runnable(request, IN_PROCESS, "test_lut4_kernels_in_an_interpreter_subprocess")
    kernels._forget_routes()


@pytest.mark.skipif(IN_PROCESS, reason="the kernel tests run in this process")
def test_lut4_kernels_in_an_interpreter_subprocess():
    triton_interp.rerun_in_subprocess(__file__)


def _weight(fmt, n, k, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))  # a spread of scales
    return MODULES[fmt].quantize(w).to(device)


def _randn(*shape, dtype, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _assert_within_fp32_accumulation(y, x, w, bias=None):
    """y against x @ w^T (+ bias) in float32, w already the reference's weight in x's dtype."""
    ref = x.float() @ w.float().T + (0 if bias is None else bias.float())
    bound = EPS[y.dtype] * ref.abs() + 2 * x.shape[1] * 2.0 ** -24 * (x.float().abs() @ w.float().abs().T) + 1e-30
    err = (y.float() - ref).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}, bound there {bound[err == err.max()]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", ["nf4", "mxfp4"])
def test_dequantize_kernel_is_the_reference_bit_for_bit(fmt, dtype):
    for i, (n, k) in enumerate(SHAPES[fmt] + [(48, 256)]):  # the last: whole tiles (the kernel's unmasked path)
        q = _weight(fmt, n, k, seed=i)
        got = lut4_triton.lut4_dequantize(q.packed, q.scales, fmt, dtype)
        ref = q.dequantize(dtype)
        assert got.dtype == dtype and torch.equal(got.view(BITS[dtype]), ref.view(BITS[dtype])), (fmt, n, k)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the interpreter's numpy: 6 * 2^127 is inf
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_every_mxfp4_scale_byte_decodes_as_the_reference(dtype):
    """All 255 E8M0 bytes (0: the subnormal 2^-127; 254: 2^127, overflowing bf16 products to inf)."""
    n, k = 255, 32
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8).to(DEVICE)
    scales = torch.arange(255, dtype=torch.uint8).reshape(n, 1).to(DEVICE)
    got = lut4_triton.lut4_dequantize(packed, scales, "mxfp4", dtype)
    ref = mxfp4.MXFP4Tensor(packed, scales).dequantize(dtype)
    assert torch.equal(got.view(BITS[dtype]), ref.view(BITS[dtype]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", ["nf4", "mxfp4"])
def test_gemv_matches_the_reference(fmt, dtype):
    for i, (n, k) in enumerate(SHAPES[fmt]):
        q = _weight(fmt, n, k, seed=10 + i)
        w = q.dequantize(dtype)
        bias = _randn(n, dtype=dtype, seed=20 + i)
        for m in (1, 3, 16, 17, 64) if dtype != torch.float16 else (1, 3, 33):  # BLOCK_M 1, 16, 16, 32, 64
            x = _randn(m, k, dtype=dtype, seed=30 + m)
            y = lut4_triton.lut4_gemv(x, q.packed, q.scales, fmt, bias if m != 3 else None)
            assert y.shape == (m, n) and y.dtype == dtype
            _assert_within_fp32_accumulation(y, x, w, bias if m != 3 else None)


def test_gemv_refuses_what_it_does_not_take():
    q = _weight("nf4", 32, 128, seed=1)
    with pytest.raises(ValueError, match="at most 64 rows"):
        lut4_triton.lut4_gemv(_randn(65, 128, dtype=torch.float32, seed=2), q.packed, q.scales, "nf4")
    with pytest.raises(ValueError, match=r"unit stride along K .*packed strides \(1, 32\)"):
        lut4_triton.lut4_gemv(_randn(2, 128, dtype=torch.float32, seed=2), q.packed.T.contiguous().T, q.scales, "nf4")
    with pytest.raises(TypeError, match="float64"):
        lut4_triton.lut4_gemv(_randn(2, 128, dtype=torch.float64, seed=2), q.packed, q.scales, "nf4")
    with pytest.raises(ValueError, match="bad MXFP4 weight"):
        lut4_triton.lut4_gemv(_randn(2, 128, dtype=torch.float32, seed=2), q.packed, q.scales, "mxfp4")
    with pytest.raises(ValueError, match="formats"):
        lut4_triton.lut4_dequantize(q.packed, q.scales, "nvfp4")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", ["nf4", "mxfp4"])
def test_routed_layer_forward_and_backward_match_the_reference_path(fmt, dtype):
    """The GEMV's rows (one row for NF4, 2 x 7 = 14 for MXFP4) take the GEMV (and the dense input gradient),
    5 x 13 = 65 rows the dense path both ways."""
    n, k = SHAPES[fmt][0]
    g = torch.Generator().manual_seed(5)
    dense = torch.nn.Linear(k, n)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(n, k, generator=g))
        dense.bias.copy_(torch.randn(n, generator=g))
    layer = LAYERS[fmt].from_linear(dense).to(DEVICE)
    w = layer.dequantized_weight(dtype)
    gemv_shape = (1, 1, k) if fmt == "nf4" else (2, 7, k)  # routes.ROUTES: NF4's GEMV at one row, MXFP4's to 16
    for shape, kernel in ((gemv_shape, "lut4_gemv"), ((5, 13, k), "lut4_dense")):
        x = _randn(*shape, dtype=dtype, seed=6).requires_grad_()
        up = _randn(*shape[:-1], n, dtype=dtype, seed=7)
        with kernels.set_backend("reference"):
            y_ref = layer(x)
            (dx_ref,) = torch.autograd.grad(y_ref, x, up)
        with kernels.set_backend("triton"):
            assert kernels.route("forward", x.detach().reshape(-1, k), layer.packed, layer.block_scales,
                                 fmt=fmt) == kernel
            y = layer(x)
            (dx,) = torch.autograd.grad(y, x, up)
            with torch.no_grad():
                y_nograd = layer(x)
        assert torch.equal(dx, dx_ref)  # both dense: the same weight, the same matmul
        assert torch.equal(y, y_nograd)
        if kernel == "lut4_dense":
            assert torch.equal(y, y_ref)
        else:
            _assert_within_fp32_accumulation(y, x.detach(), w, layer.bias.to(dtype))


@pytest.mark.parametrize("fmt", ["nf4", "mxfp4"])
def test_the_kernel_and_the_reference_share_one_dense_cache_entry(fmt):
    """Bit-identical dequantizations share the tag ``fmt``: a block dequantizes each weight once."""
    from qerl_kit.dense_cache import block_stats, dense_weight_cache
    from qerl_kit.kernels import reference

    q = _weight(fmt, 40, 192, seed=12)
    with dense_weight_cache(cuda=True):
        first = reference.lut4_dequantize(q.packed, q.scales, fmt, torch.bfloat16)
        assert lut4_triton._dense_weight(q.packed, q.scales, fmt, torch.bfloat16) is first
        assert (block_stats()["misses"], block_stats()["hits"]) == (1, 1)
    with dense_weight_cache(cuda=True):  # the other way round: the kernel's entry serves the reference
        first = lut4_triton._dense_weight(q.packed, q.scales, fmt, torch.float32)
        assert reference.lut4_dequantize(q.packed, q.scales, fmt, torch.float32) is first
        assert torch.equal(first, q.dequantize(torch.float32))


def test_block_k_and_block_m_follow_the_shape():
    """BLOCK_K: the widest of 256/128/64 dividing K (whole tiles: 16-byte loads); BLOCK_M: 16..64."""
    assert [lut4_triton.k_tile(k) for k in (3584, 896, 192, 96, 18944)] == [256, 128, 64, 256, 256]
    assert lut4_triton.gemv_config(1, 896, 896, "nf4", interpret=False)["BLOCK_K"] == 128
    assert lut4_triton.dequant_config(896, interpret=False) == (32, 128)
    assert [lut4_triton.gemv_block_m(m, True) for m in (2, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    assert lut4_triton.gemv_block_m(1, False) == 1


def test_the_nf4_table_is_the_codebook_cache_and_mxfp4_reads_none(monkeypatch):
    q = _weight("nf4", 16, 64, seed=3)
    assert lut4_triton.lut("nf4", q.packed) is nf4._codebook(q.packed.device)
    packed = torch.zeros(16, 16, dtype=torch.uint8)
    assert lut4_triton.lut("mxfp4", packed) is packed  # a dummy pointer: MXFP4 decodes from the bits
    # the first NF4 call on a CUDA device during graph capture would upload the table: an error instead
    fake = torch.device("cuda", 7)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(nf4, "_codebook", lambda device: pytest.fail("uploaded during capture"))
    with pytest.raises(RuntimeError, match="outside CUDA-graph capture first"):
        lut4_triton.lut("nf4", type("P", (), {"device": fake})())


@pytest.mark.skipif(CUDA, reason="the CPU's own path")
@pytest.mark.parametrize("fmt", ["nf4", "mxfp4"])
def test_cpu_layers_keep_the_plain_pytorch_path(fmt):
    """Under the default backend a CPU call routes to the reference and computes what it always did."""
    layer = LAYERS[fmt].from_linear(torch.nn.Linear(128, 24))
    x = _randn(5, 128, dtype=torch.float32, seed=8)
    assert kernels.route("forward", x, layer.packed, layer.block_scales, fmt=fmt) == "reference"
    ref = torch.nn.functional.linear(x, layer.dequantized_weight(torch.float32), layer.bias)
    assert torch.equal(layer(x), ref)


# -- GPU only ------------------------------------------------------------------------------------------

REAL = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]  # 7B qkv, o, gate_up, down


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", REAL, ids=str)
@pytest.mark.parametrize("fmt", ["nf4", "mxfp4"])
def test_gpu_real_shapes(fmt, n, k):
    q = _weight(fmt, n, k, seed=n + k)
    w = q.dequantize(torch.bfloat16)
    assert torch.equal(lut4_triton.lut4_dequantize(q.packed, q.scales, fmt, torch.bfloat16).view(torch.int16),
                       w.view(torch.int16))
    for m in (1, 8, 16, 40, 64):
        x = _randn(m, k, dtype=torch.bfloat16, seed=m)
        _assert_within_fp32_accumulation(lut4_triton.lut4_gemv(x, q.packed, q.scales, fmt), x, w)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["nf4", "mxfp4"])
def test_gpu_gemv_replays_in_a_cuda_graph(fmt):
    q = _weight(fmt, 4608, 3584, seed=4)
    x = _randn(8, 3584, dtype=torch.bfloat16, seed=9)
    lut4_triton.lut4_gemv(x, q.packed, q.scales, fmt)  # warm-up: compiles, allocates counters and the table
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = lut4_triton.lut4_gemv(x, q.packed, q.scales, fmt)
    assert lut4_triton.gemv_config(8, 4608, 3584, fmt, interpret=False)["SPLIT_K"] > 1  # the counters matter
    for seed in (10, 11):  # new input each replay: it is read, and the counters are back at zero
        x.copy_(_randn(8, 3584, dtype=torch.bfloat16, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, lut4_triton.lut4_gemv(x, q.packed, q.scales, fmt))  # split-K sums in order


@pytest.mark.skipif(CUDA, reason="the CPU smoke run; on a GPU: python -m bench.bench_lut4")
def test_bench_runs_its_smoke_shape_in_the_interpreter(tmp_path):
    from bench import bench_lut4

    before = kernels.get_backend()
    bench_lut4.main(["--smoke", "--out", str(tmp_path)])
    table = (tmp_path / "lut4.md").read_text()
    assert "| tiny | 1 | 64 | 128 |" in table and "lut4_gemv" in table and "lut4_dense" in table
    header = table.splitlines()[2]
    forced = ("nf4_gemv_us", "mxfp4_gemv_us", "nf4_dense_us", "mxfp4_dense_us")  # the table's two choices
    for side in forced:
        assert f" {side} " in header, header
    cells = {line.split("|")[2].strip(): line for line in table.splitlines() if line.startswith("| tiny |")}
    assert set(cells) == {"1", "3", "65"}
    cols = [c.strip() for c in header.split("|")[1:-1]]
    for m in ("1", "3"):  # at the GEMV's row counts both choices are timed, above them neither
        row = [c.strip() for c in cells[m].split("|")[1:-1]]
        assert all(float(row[cols.index(c)]) > 0 for c in forced)
    row65 = [c.strip() for c in cells["65"].split("|")[1:-1]]
    assert all(row65[cols.index(c)] == "" for c in forced)
    assert kernels.get_backend() is before  # the run's backend switch is restored


@pytest.mark.skipif(CUDA, reason="the CPU smoke run; on a GPU: python -m bench.bench_lut4_sweep")
def test_sweep_times_every_candidate_and_the_dense_path_and_checks_them(tmp_path):
    """bench_lut4_sweep: today's config, the BLOCK_K / stage variants and the dense path, per format;
    every candidate's error bounded, the fastest named."""
    from bench import bench_lut4_sweep as sweep

    nf4_names, mx_names = sweep.candidates("nf4", 8), sweep.candidates("mxfp4", 8)
    assert nf4_names["default"] == {} and len(nf4_names) == len(mx_names) == 6  # BLOCK_K 256 to 16 rows
    assert len(sweep.candidates("nf4", 64)) == len(sweep.candidates("mxfp4", 64)) == 4
    assert "k64-s1" not in nf4_names and "k64-s3" in nf4_names  # today's NF4 config (one stage) is "default"
    assert "k64-s3" not in mx_names and "k64-s1" in mx_names  # MXFP4's (three stages)
    assert sweep.candidates("nf4", 64)["k64-s3"]["num_warps"] == 8  # gemv_config's 8 warps above 32 rows
    sweep.main(["--smoke", "--out", str(tmp_path)])
    lines = (tmp_path / "sweep.md").read_text().splitlines()
    cols = [c.strip() for c in lines[2].split("|")[1:-1]]
    rows = {r[0]: r for r in ([c.strip() for c in line.split("|")[1:-1]] for line in lines[4:])}
    assert set(rows) == {"nf4", "mxfp4"}
    assert rows["nf4"][cols.index("k64-s3_us")] and not rows["mxfp4"][cols.index("k64-s3_us")]
    for r in rows.values():
        assert float(r[cols.index("dense_us")]) > 0 and float(r[cols.index("worst_rel_err")]) < 1e-2
        assert f"{r[cols.index('best')]}_us" in cols  # one of the timed candidates
    with pytest.raises(SystemExit):
        sweep.main(["--smoke", "--ms", "1", "--out", str(tmp_path)])  # one row is the FMA path, not swept


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["nf4", "mxfp4"])
def test_gpu_auto_backend_routes_layers_to_the_kernels(fmt):
    """On CUDA the default backend sends NF4/MXFP4 layers to lut4_gemv (one row; MXFP4 up to 16, NF4 too
    from 64M weights, not this layer's 1.8M) and the dense path, in bf16 and fp32, and the layer's output
    is the routed kernel's."""
    layer = LAYERS[fmt].from_linear(torch.nn.Linear(3584, 512)).cuda()
    for dtype in (torch.bfloat16, torch.float32):
        gemv = "lut4_gemv" if fmt == "mxfp4" else "lut4_dense"  # at 2-16 rows
        for m, kernel in ((1, "lut4_gemv"), (8, gemv), (16, gemv), (17, "lut4_dense"), (64, "lut4_dense"),
                          (2048, "lut4_dense")):
            x = _randn(m, 3584, dtype=dtype, seed=m)
            assert kernels.route("forward", x, layer.packed, layer.block_scales, fmt=fmt) == kernel
            with torch.no_grad():
                y = layer(x)
            _assert_within_fp32_accumulation(y, x, layer.dequantized_weight(dtype), layer.bias.to(dtype))
