"""The routing table's decisions (CPU): which kernel each call takes, under each backend."""

import pytest
import torch

from qerl_kit import kernels, nvfp4
from qerl_kit.kernels import Backend, routes, set_backend
from qerl_kit.kernels.routes import ROUTES, Route, candidates, check_table

BF, FP = torch.bfloat16, torch.float16


def first(op, m, n, k, dtype=BF, allowed=routes.KERNELS):
    return next(r.kernel for r in candidates(op, m, n, k, dtype) if r.kernel in allowed)


def test_table_is_well_formed_and_ends_with_catch_alls():
    check_table()
    with pytest.raises(ValueError, match="kernel 'magic'"):
        check_table(ROUTES[:-1] + (Route("magic"),))
    with pytest.raises(ValueError, match="empty rows range"):
        check_table((Route("dense", rows=(8, 8)),) + ROUTES)
    with pytest.raises(ValueError, match="forward rows do not end"):
        check_table(tuple(r for r in ROUTES if not (r.kernel == "reference" and r.op == "forward")))


def test_every_call_finds_a_row_and_ranges_are_half_open():
    for op in ("forward", "dgrad"):
        for m in (1, 2, 7, 8, 9, 16, 17, 64, 65, 127, 128, 512, 513, 100000):
            for n, k in ((128, 256), (4608, 3584), (59136, 8192)):
                for dtype in (BF, FP):
                    assert candidates(op, m, n, k, dtype)[-1].kernel == "reference"
    r = Route("x", rows=(2, 9))
    assert not r.matches("forward", 1, 1, 1, BF) and r.matches("forward", 2, 1, 1, BF)
    assert r.matches("forward", 8, 1, 1, BF) and not r.matches("forward", 9, 1, 1, BF)
    assert not r.matches("dgrad", 4, 1, 1, BF) and not r.matches("forward", 4, 1, 1, torch.float32)


def test_humming_takes_what_it_won_in_the_committed_table():
    """Cells of bench/results/routes_h200.md: the first kernel of the table with every kernel here."""
    # one row: our decode kernels, humming only on large layers with K >= 5120
    assert first("forward", 1, 4608, 3584) == "cuda_decode"          # 7B qkv, 16M weights
    assert first("forward", 1, 7168, 5120) == "triton_gemv"          # 14B qkv: block-dot, 13.3 vs 16.9 us
    assert first("forward", 1, 37888, 3584) == "cuda_decode"         # 7B gate_up: 33.6 vs 39.6 us
    assert first("forward", 1, 5120, 27648) == "humming"             # 32B down: 34.0 vs 35.8 us
    assert first("forward", 1, 8192, 8192) == "triton_gemv"          # 72B q/o, 64M weights
    # 2-4 rows: our decode kernel, humming on >= 64M weights with K >= 5120
    assert first("forward", 2, 3584, 3584) == "cuda_decode" and first("forward", 4, 37888, 3584) == "cuda_decode"
    assert first("forward", 2, 8192, 29568) == "humming" and first("forward", 4, 8192, 8192) == "humming"
    # 5-8 rows: humming above 8M weights, but not 7B gate_up (K < 5120, >= 72M weights)
    assert first("forward", 8, 4608, 3584) == "humming"
    assert first("forward", 8, 1024, 8192) == "triton_gemv"          # 72B k/v: exactly 8M weights
    assert first("forward", 8, 37888, 3584) == "cuda_decode" and first("forward", 8, 55296, 5120) == "humming"
    # 9-511 rows: humming above 8M weights; k/v on Triton and the dense path
    for m in (16, 64, 128, 256, 511):
        assert first("forward", m, 4608, 3584) == "humming" and first("forward", m, 4608, 3584, FP) == "humming"
    assert first("forward", 64, 512, 3584) == "triton_gemv" and first("forward", 128, 1024, 5120) == "dense"
    # 512-1023 rows from 20M weights; from 1024 rows the dense path
    assert first("forward", 512, 3584, 3584) == "dense" and first("forward", 512, 5120, 5120) == "humming"
    assert first("forward", 1023, 59136, 8192) == "humming" and first("forward", 1024, 59136, 8192) == "dense"
    assert first("forward", 2048, 3584, 18944) == "dense"
    # the input gradient never takes humming
    assert all(r.kernel != "humming" for r in ROUTES if r.op == "dgrad")


def test_without_humming_the_table_is_our_kernels_rule():
    ours = routes.OURS
    assert first("forward", 1, 4608, 3584, allowed=ours) == "cuda_decode"          # 16.5M weights < 20M
    assert first("forward", 1, 4608, 5120, allowed=ours) == "triton_gemv"          # 22.5M: Triton's block-dot
    assert first("forward", 1, 37888, 3584, allowed=ours) == "cuda_decode"         # 129M >= 72M
    assert first("forward", 3, 1024, 2048, allowed=ours) == "triton_gemv"          # 2M < 4M
    assert first("forward", 8, 55296, 5120, allowed=ours) == "cuda_decode"
    assert first("forward", 8, 55296, 5120, FP, allowed=ours) == "triton_gemv"     # CUDA kernel: bf16 only
    assert first("forward", 64, 37888, 3584, allowed=ours) == "triton_tiles"       # wide N from 33 rows
    assert first("forward", 64, 4608, 3584, allowed=ours) == "triton_gemv"
    assert first("forward", 65, 4608, 3584, allowed=ours) == "triton_tiles"
    assert first("forward", 128, 4608, 3584, allowed=ours) == "dense"
    assert first("dgrad", 127, 4608, 3584, allowed=ours) == "triton_dgrad"
    assert first("dgrad", 128, 4608, 3584, allowed=ours) == "dense"


def test_dispatcher_on_cpu_takes_the_reference_or_the_forced_triton_kernels():
    q = nvfp4.quantize(torch.randn(96, 256) * 0.02)
    x = torch.randn(5, 256, dtype=BF)
    assert kernels.route("forward", x, q.packed, q.scales) == "reference"
    assert kernels.route("forward", x, q.packed, q.scales, backend="reference") == "reference"
    with pytest.raises(RuntimeError, match="kernel backend 'humming' was forced but cannot run on cpu"):
        kernels.route("forward", x, q.packed, q.scales, backend="humming")
    with set_backend("ours"):
        assert kernels.get_backend() is Backend.OURS
    with pytest.raises(ValueError, match="unknown kernel backend 'fast'; choose one of: auto, ours, triton, humming"):
        set_backend("fast")


def test_forced_backends_skip_kernels_they_exclude(monkeypatch):
    """On a machine where every kernel runs (faked), each backend takes its own subset."""
    q = nvfp4.quantize(torch.randn(4608, 256) * 0.02)
    x = torch.randn(64, 256, dtype=BF)
    monkeypatch.setattr(kernels, "_runs", lambda kernel, *a: True)
    monkeypatch.setattr(kernels, "resolve", lambda x, backend=None: Backend.TRITON)
    kernels._forget_routes()
    try:
        assert kernels.route("forward", x, q.packed, q.scales, backend="ours") == "triton_gemv"
        assert kernels.route("forward", x, q.packed, q.scales, backend="triton") == "triton_gemv"
        assert kernels.route("dgrad", torch.randn(64, 4608, dtype=BF), q.packed, q.scales, backend="humming") == "triton_dgrad"
    finally:
        kernels._forget_routes()


@pytest.mark.parametrize("fmt", routes.LUT4)
def test_nf4_and_mxfp4_take_the_lut4_rows(fmt):
    """The decode GEMV where it beat the dense path (one row; MXFP4 up to 16 rows, NF4 up to 16 from 64M
    weights), the dense path beyond, the input gradient always dense; fp32 activations too; never an
    NVFP4 kernel, and the NVFP4 rows never take an NF4/MXFP4 weight."""
    for dtype in (BF, FP, torch.float32):
        for n, k in ((4608, 3584), (37888, 3584)):  # a 7B's fused q/k/v (16.5M weights) and gate/up (136M)
            # NF4's GEMV at 2-16 rows from 64M weights only; MXFP4's at every size
            last_gemv = 16 if fmt == "mxfp4" or n * k >= 64 * 2**20 else 1
            kinds = lambda op, m: [r.kernel for r in candidates(op, m, n, k, dtype, fmt=fmt)]  # noqa: E731
            assert kinds("forward", 1) == kinds("forward", last_gemv) == ["lut4_gemv", "lut4_dense", "reference"]
            assert kinds("forward", last_gemv + 1) == kinds("forward", 64) == kinds("forward", 8192) == [
                "lut4_dense", "reference"]
            assert kinds("dgrad", 1) == kinds("dgrad", 4096) == ["lut4_dense", "reference"]
    assert [r.kernel for r in candidates("forward", 8, 4608, 3584, BF, fmt=fmt)][0] == (
        "lut4_gemv" if fmt == "mxfp4" else "lut4_dense")
    assert candidates("forward", 8, 4608, 3584, torch.float64, fmt=fmt) == []
    assert all(set(r.formats) <= set(routes.LUT4) if r.kernel.startswith("lut4_") else fmt not in r.formats or
               r.kernel == "reference" for r in ROUTES)
    with pytest.raises(ValueError, match="forward rows of nf4 do not end"):  # the row NF4 and MXFP4 share
        check_table(tuple(r for r in ROUTES if not (r.kernel == "reference" and r.op == "forward" and fmt in r.formats)))
    # a catch-all reference row that leaves out a dtype the format's kernel rows take (fp32) is refused
    narrow = tuple(Route("reference", op=r.op, dtypes=(BF,), why=r.why, formats=r.formats)
                   if r.kernel == "reference" and r.op == "dgrad" and fmt in r.formats else r for r in ROUTES)
    with pytest.raises(ValueError, match=r"dgrad rows of nf4 end with a reference row for dtypes "
                                         r".*missing \[torch.float16, torch.float32\]"):
        check_table(narrow)


def test_nf4_on_the_cpu_routes_to_the_reference_unless_a_kernel_backend_is_forced():
    from qerl_kit import nf4

    q = nf4.quantize(torch.randn(96, 256))
    x = torch.randn(5, 256)
    assert kernels.route("forward", x, q.packed, q.absmax, fmt="nf4") == "reference"
    assert kernels.route("dgrad", torch.randn(5, 96), q.packed, q.absmax, fmt="nf4", backend="reference") == "reference"
    with pytest.raises(ValueError, match="no rows for format 'int4'"):
        kernels.route("forward", x, q.packed, q.absmax, fmt="int4")
    if not kernels.backend.interpreting():  # every forced kernel backend: one behaviour, one message
        for forced in ("triton", "ours", "humming"):
            with pytest.raises(RuntimeError, match=f"kernel backend '{forced}' was forced but cannot run nf4 on "
                               "cpu: nf4 has no humming or CUDA C kernel, only the Triton kernels"):
                kernels.route("forward", x, q.packed, q.absmax, fmt="nf4", backend=forced)
