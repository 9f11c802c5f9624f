"""kernel_report: the backend, each kernel family's status here, and each NVFP4 layer shape's path."""

import pytest
import torch

from qerl_kit import kernels
from qerl_kit.kernels import Backend
from qerl_kit.kernels.report import LABELS, KernelReport, kernel_report

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def tiny():
    from qerl_kit.tiny import load_tiny

    model, _ = load_tiny(quantize="nvfp4")
    return model


def test_status_names_every_kernel_family_and_why_one_is_off():
    report = kernel_report()
    assert [name for name, _, _ in report.kernels] == [
        "Triton kernels", "CUDA decode kernel (1-8 rows)", "wgmma kernel (17-64 rows, sm_90)"]
    assert report.layers == () and report.rows == ()
    assert report.backend == kernels.get_backend().value
    if not CUDA:
        assert report.kernels[1][1:] == (False, "no CUDA device") and report.kernels[2][1:] == (False, "no CUDA device")
        assert "wgmma kernel (17-64 rows, sm_90): off (no CUDA device)" in str(report)


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


def test_paths_follow_the_dispatcher_when_the_kernels_run(tiny, monkeypatch):
    monkeypatch.setattr(kernels, "resolve", lambda x, backend=None: Backend.TRITON)   # as on a GPU
    report = kernel_report(tiny, rows=(1, 8, 64, 256, 2048), dtype=torch.bfloat16)
    for _, n, _, paths in report.layers:
        # the Triton rule on tensors that are not CUDA: decode up to 64 rows on these narrow layers,
        # then the tiled kernel (the dense path and the CUDA kernels need CUDA tensors)
        assert paths == ("decode", "decode", "decode", "fused", "fused") and n < kernels.WIDE_N
    text = str(report)
    assert "Triton decode" in text and "Triton tiles" in text and "256 rows" in text


def test_html_escapes_and_labels_every_path():
    report = KernelReport(backend="auto", device="cuda:0", kernels=(("<k>", False, "a & b"),),
                          rows=(1, 64), layers=(("q<", 5120, 5120, ("cuda", "wgmma")),))
    page = report._repr_html_()
    assert "&lt;k&gt;" in page and "a &amp; b" in page and "q&lt;" in page and "<b>off</b>" in page
    assert "<td>CUDA decode</td><td>wgmma</td>" in page
    assert set(LABELS) == {"reference", "cuda", "wgmma", "decode", "fused", "dense"}
