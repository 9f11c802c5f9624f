"""quantize_model on Qwen2 / Qwen3 / Llama models built from small configs."""

import pytest
import torch
from torch import nn

from qerl_kit.linear import MXFP4Linear, NF4Linear, NVFP4Linear, QuantLinear
from qerl_kit.models import build_model
from qerl_kit.quantize import memory_report, quantize_model

ARCHS = ["qwen2-tiny", "qwen3-tiny", "llama-tiny"]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_linear_converted_except_lm_head(arch):
    model = build_model(arch, dtype=torch.bfloat16)
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    report = quantize_model(model)
    assert len(report.layers) == n_linear - 1 == 7 * model.config.num_hidden_layers
    assert report.skipped == ["lm_head"]
    assert type(model.lm_head) is nn.Linear
    assert sum(isinstance(m, NVFP4Linear) for m in model.modules()) == len(report.layers)
    assert all(0.05 < layer.rel_error < 0.15 for layer in report.layers)


def test_fused_groups_share_one_global_scale():
    model = build_model("qwen2-tiny", dtype=torch.bfloat16)
    quantize_model(model)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.q_proj.global_scale.item() == attn.k_proj.global_scale.item() == attn.v_proj.global_scale.item()
        assert mlp.gate_proj.global_scale.item() == mlp.up_proj.global_scale.item()
    # without sharing, members of a group get their own (different) scales
    model2 = build_model("qwen2-tiny", dtype=torch.bfloat16)
    quantize_model(model2, share_fused_scales=False)
    scales = {model2.model.layers[0].self_attn.q_proj.global_scale.item(),
              model2.model.layers[0].self_attn.k_proj.global_scale.item(),
              model2.model.layers[0].self_attn.v_proj.global_scale.item()}
    assert len(scales) > 1


def test_logits_close_to_original_and_weights_3_5x_smaller():
    # A small Qwen2 with realistic weight scale (std 0.02 init) in bf16.
    model = build_model("qwen2-tiny", dtype=torch.bfloat16, hidden_size=128, intermediate_size=352,
                        num_hidden_layers=3)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits.float()
    report = quantize_model(model)
    with torch.no_grad():
        out = model(ids).logits.float()
    rel = ((out - ref).norm() / ref.norm()).item()
    # measured 0.15-0.17 on this random model; weight noise of ~0.095 per layer compounds over 3 layers
    assert rel < 0.25, rel
    # the error is far below the logits' own spread: a different random model is ~1.4 away
    other = build_model("qwen2-tiny", dtype=torch.bfloat16, hidden_size=128, intermediate_size=352,
                        num_hidden_layers=3, seed=1)
    with torch.no_grad():
        far = ((other(ids).logits.float() - ref).norm() / ref.norm()).item()
    assert rel < far / 4
    assert report.compression >= 3.5, report.compression


@pytest.mark.parametrize("fmt, cls", [("mxfp4", MXFP4Linear), ("nf4", NF4Linear)])
def test_other_formats_convert_a_model(fmt, cls):
    model = build_model("llama-tiny", dtype=torch.bfloat16)
    report = quantize_model(model, fmt=fmt)
    assert report.fmt == fmt
    assert all(isinstance(m, cls) for m in model.modules() if isinstance(m, QuantLinear))
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_unconvertible_layer_is_named_and_model_untouched():
    model = build_model("qwen2-tiny")
    model.model.layers[1].mlp.down_proj = nn.Linear(120, 64)  # 120 is not divisible by 16
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj.*in_features=120"):
        quantize_model(model)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    report = quantize_model(model, skip=("lm_head", "down_proj"))
    assert "model.layers.1.mlp.down_proj" in report.skipped


def test_nan_weights_are_named():
    model = build_model("qwen2-tiny")
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="o_proj.*NaN"):
        quantize_model(model)


def test_report_renders_and_memory_report_counts_kinds():
    model = build_model("qwen2-tiny", dtype=torch.bfloat16)
    before = memory_report(model)
    assert before.packed == 0 and before.scales == 0
    report = quantize_model(model)
    text, html = str(report), report._repr_html_()
    assert "model.layers.0.self_attn.q_proj" in text and "<table>" in html and "lm_head" in text
    after = memory_report(model)
    packed = sum(m.packed.numel() for m in model.modules() if isinstance(m, NVFP4Linear))
    assert after.packed == packed
    assert after.scales > 0 and after.total < before.total
    assert after.packed + after.scales == report.bytes_after  # global scales count as scales in both
    assert "<table>" in after._repr_html_()
