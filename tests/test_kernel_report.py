"""kernel_report: the backend, each kernel family's status here, and each NVFP4 layer shape's path."""

import pytest
import torch

from qerl_kit import kernels
from qerl_kit.kernel_report import KernelReport, kernel_report

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def tiny():
    from qerl_kit.tiny import load_tiny

    model, _ = load_tiny(quantize="nvfp4")
    return model


def test_status_names_every_kernel_family_and_why_one_is_off():
    report = kernel_report()
    assert [name for name, _, _ in report.kernels] == [
        "humming-kernels", "Triton kernels", "CUDA decode kernel (1-16 rows)"]
    assert report.layers == () and report.rows == ()
    assert report.backend == kernels.get_backend().value
    if not CUDA:
        assert report.kernels[2][1:] == (False, "no CUDA device") and not report.kernels[0][1]
        assert "CUDA decode kernel (1-16 rows): off (no CUDA device)" in str(report)


def test_layers_share_a_row_per_shape_and_cpu_calls_take_the_reference(tiny):
    report = kernel_report(tiny, rows=(1, 64))
    shapes = {(n, k): names for names, n, k, _ in report.layers}
    cfg = tiny.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    assert shapes[(cfg.hidden_size, cfg.hidden_size)] == "self_attn.q_proj, self_attn.o_proj"
    assert shapes[(cfg.num_key_value_heads * hd, cfg.hidden_size)] == "self_attn.k_proj, self_attn.v_proj"
    assert shapes[(cfg.hidden_size, cfg.intermediate_size)] == "mlp.down_proj"
    assert report.rows == (1, 64) and report.device == "cpu"
    # on the CPU the auto backend runs the reference (what nvfp4_linear does there)
    assert all(paths == ("reference", "reference") for *_, paths in report.layers)
    assert all(p == ("reference",) for *_, p in kernel_report(tiny, rows=(8,), backend="reference").layers)


def test_paths_come_from_the_routing_table_when_the_kernels_run(tiny, monkeypatch):
    """With every kernel runnable (faked, as on a GPU with humming), the report shows the table's
    first row for each shape and row count; these tiny layers (< 8M weights) stay on our kernels."""
    monkeypatch.setattr(kernels, "_runs", lambda kernel, *a: True)
    monkeypatch.setattr(kernels, "_route", lambda op, x2, p, s, choice, fmt="nvfp4": next(
        r.kernel for r in kernels.routes.candidates(op, x2.shape[0], p.shape[0], p.shape[1] * 2, x2.dtype)))
    kernels._forget_routes()
    try:
        report = kernel_report(tiny, rows=(1, 8, 64, 256, 2048), dtype=torch.bfloat16)
    finally:
        kernels._forget_routes()
    for _, n, k, paths in report.layers:
        assert n * k < 8 << 20
        assert paths == ("cuda_decode", "triton_gemv", "triton_gemv", "dense", "dense")
    text = str(report)
    assert "CUDA decode" in text and "Triton decode" in text and "dequant + cuBLAS" in text and "256 rows" in text


def test_html_escapes_and_labels_every_path():
    report = KernelReport(backend="auto", device="cuda:0", kernels=(("<k>", False, "a & b"),),
                          rows=(1, 64), layers=(("q<", 5120, 5120, ("cuda_decode", "humming")),))
    page = report._repr_html_()
    assert "&lt;k&gt;" in page and "a &amp; b" in page and "q&lt;" in page and "<b>off</b>" in page
    assert "<td>CUDA decode</td><td>humming</td>" in page


@pytest.mark.parametrize("fmt", ["nf4", "mxfp4"])
def test_nf4_and_mxfp4_layers_are_reported_with_their_own_rows(fmt, monkeypatch):
    """The real router, with only the machine faked (Triton usable, CPU tensors interpreted): every
    forced kernel backend runs the LUT4 Triton kernels (humming and CUDA C have none for NF4/MXFP4),
    the GEMV at one row (MXFP4: up to 16) and the dense path above; unfaked, the CPU takes the reference."""
    from qerl_kit.tiny import load_tiny

    model, _ = load_tiny(quantize=fmt)
    assert all(paths == ("reference",) for *_, paths in kernel_report(model, rows=(8,)).layers)  # the CPU
    monkeypatch.setattr(kernels, "interpreting", lambda: True)
    monkeypatch.setattr(kernels, "triton_status", lambda: (True, "faked"))
    kernels._forget_routes()
    try:
        reports = [kernel_report(model, rows=(1, 16, 64, 65, 2048), dtype=torch.float32, backend=b)
                   for b in ("triton", "ours", "humming")]
        assert all(p == ("reference",) for *_, p in kernel_report(model, rows=(8,), backend="reference").layers)
    finally:
        kernels._forget_routes()
    for report in reports:
        gemv_rows = 2 if fmt == "mxfp4" else 1  # of rows 1, 16, 64, 65, 2048
        assert report.layers and all(paths == ("lut4_gemv",) * gemv_rows + ("lut4_dense",) * (5 - gemv_rows)
                                     for *_, paths in report.layers)
    assert "Triton LUT4 decode" in str(reports[0]) and "LUT4 dequant + cuBLAS" in str(reports[0])
