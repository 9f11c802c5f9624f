"""LoRA on the NVFP4 base through peft: round trips, gradients, reference policy, trainability."""

import copy

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from torch import nn

from qerl_kit.linear import QuantLinear
from qerl_kit.lora import (ALL_PROJECTIONS, QuantLoraLinear, attach_lora, load_lora,
                           lora_config_for, trainable_parameters)
from qerl_kit.models import build_model
from qerl_kit.quantize import quantize_model

IDS = torch.tensor([[5, 17, 99, 3, 42, 7, 250, 11], [1, 2, 3, 4, 5, 6, 7, 8]])


def _quantized(arch="qwen2-tiny", dtype=torch.float32, seed=0):
    model = build_model(arch, dtype=dtype, seed=seed)
    quantize_model(model)
    return model


def _randomize_lora(model, seed=0, std=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_((torch.randn(p.shape, generator=g) * std).to(p.dtype))


def test_attach_wraps_all_seven_projections_and_only_lora_trains():
    model = attach_lora(_quantized(), r=4)
    wrapped = [n for n, m in model.named_modules() if isinstance(m, QuantLoraLinear)]
    assert len(wrapped) == 7 * 2
    assert {n.rsplit(".", 1)[1] for n in wrapped} == set(ALL_PROJECTIONS)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    counts = trainable_parameters(model)
    assert counts["trainable"] == sum(4 * (m.in_features + m.out_features) for m in model.modules()
                                      if isinstance(m, QuantLoraLinear))
    assert not any(isinstance(m, QuantLinear) and list(m.parameters()) for m in model.modules())


def test_train_norms_flag_adds_only_the_projection_norms():
    model = attach_lora(_quantized(), r=4, train_norms=True)
    extra = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    assert len(extra) == 2 * 2
    assert all("input_layernorm" in n or "post_attention_layernorm" in n for n in extra)
    model(IDS).logits.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_peft_round_trip_and_standard_adapter_files(tmp_path):
    model = attach_lora(_quantized(), r=8, seed=0)
    _randomize_lora(model)
    with torch.no_grad():
        expected = model(IDS).logits
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert len(tensors) == 7 * 2 * 2

    loaded = load_lora(_quantized(), str(tmp_path))
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, expected)
    raw = PeftModel.from_pretrained(_quantized(), str(tmp_path), config=lora_config_for(str(tmp_path)))
    with torch.no_grad():
        assert torch.equal(raw(IDS).logits, expected)


def test_adapter_loads_onto_a_plain_bf16_model_with_stock_peft(tmp_path):
    # "other tools can load it": a dense model carrying the dequantized weights, stock peft, no config.
    model = attach_lora(_quantized(), r=8, seed=0)
    _randomize_lora(model)
    model.save_pretrained(tmp_path)
    dense = _dense_copy_of(_quantized())
    plain = PeftModel.from_pretrained(dense, str(tmp_path))
    with torch.no_grad():
        assert torch.allclose(plain(IDS).logits, model(IDS).logits, atol=1e-5, rtol=1e-4)


def _dense_copy_of(quantized: nn.Module) -> nn.Module:
    """Replace every quantized layer by an nn.Linear holding its dequantized weight."""
    model = copy.deepcopy(quantized)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear):
                lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                dtype=child.compute_dtype)
                with torch.no_grad():
                    lin.weight.copy_(child.dequantized_weight())
                    if child.bias is not None:
                        lin.bias.copy_(child.bias)
                setattr(parent, name, lin)
    return model


def test_lora_gradients_match_dense_dequantized_reference_in_bf16():
    base = _quantized(dtype=torch.bfloat16, seed=3)
    ref = _dense_copy_of(base)
    model, ref = attach_lora(base, r=8, seed=1), attach_lora(ref, r=8, seed=1)
    _randomize_lora(model, seed=2)
    _randomize_lora(ref, seed=2)
    target = torch.randint(0, 512, IDS.shape, generator=torch.Generator().manual_seed(4))
    for m in (model, ref):
        logits = m(IDS).logits.float()
        nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert grads.keys() == ref_grads.keys() and len(grads) == 28
    for name, g in grads.items():
        r = ref_grads[name]
        assert g.dtype == torch.bfloat16 and g.abs().sum() > 0, name
        rel = ((g.float() - r.float()).norm() / r.float().norm()).item()
        assert rel < 2e-2, (name, rel)  # bf16 has 8 bits of mantissa: ~4e-3 per op


def test_disabled_adapter_is_the_reference_policy():
    base = _quantized()
    with torch.no_grad():
        base_logits = base(IDS).logits
    model = attach_lora(base, r=8)
    _randomize_lora(model)
    with torch.no_grad():
        policy = model(IDS).logits
        with model.disable_adapter():
            reference = model(IDS).logits
    assert torch.equal(reference, base_logits)
    assert not torch.allclose(policy, reference)


def test_merging_into_4bit_base_is_refused():
    model = attach_lora(_quantized(), r=4)
    with pytest.raises(NotImplementedError, match="requantizing"):
        model.merge_adapter()


def test_rank_must_be_positive():
    with pytest.raises(ValueError, match=r"^r must be an int >= 1.*; got 0"):
        attach_lora(_quantized(), r=0)
