"""lora_layer.FusedLoraLinear: peft's LoRA sum with the add done by the GEMM, the same outputs and
gradients as peft's own layer, on a bf16 model's nn.Linear and on the NVFP4 base; peft's forward
for everything the fused path does not take."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch import nn

from qerl_kit.lora import QuantLoraLinear, attach_lora, register_quant_layers
from qerl_kit.lora_layer import FusedLoraLinear, PlainLinear
from qerl_kit.models import build_model
from qerl_kit.quantize import quantize_model


def _pair(dtype, alpha=12, dropout=0.0, seed=0):
    """(peft's own, fused): two LoRA wraps of one random two-layer model, the same random adapters
    (B not zero), r 8, alpha 12: a scale of 1.5, not a power of two."""
    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(64, 96, bias=True), nn.Linear(96, 48)).to(dtype)
    config = dict(r=8, lora_alpha=alpha, lora_dropout=dropout, target_modules=["0", "1"])
    # the adapters in the base's dtype, as attach_lora makes them (peft would make bf16 adapters fp32)
    ref = get_peft_model(copy.deepcopy(base), LoraConfig(**config), autocast_adapter_dtype=False)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    fused = get_peft_model(copy.deepcopy(base), register_quant_layers(LoraConfig(**config)),
                           autocast_adapter_dtype=False)
    fused.load_state_dict(ref.state_dict())
    return ref, fused


def _run(model, x):
    x = x.clone().requires_grad_()
    y = model(x)
    (y.float() * torch.linspace(-1, 1, y.shape[-1])).square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads


@pytest.fixture
def peft_forward_calls(monkeypatch):
    calls = []
    forward = PeftLoraLinear.forward
    monkeypatch.setattr(PeftLoraLinear, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    return calls


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_fused_outputs_and_gradients_are_peft_s(dtype, tol, peft_forward_calls):
    ref, fused = _pair(dtype)
    assert all(type(m) is FusedLoraLinear for m in (fused.base_model.model[0], fused.base_model.model[1]))
    x = torch.randn(3, 5, 64, dtype=dtype)
    want, got = _run(ref, x), _run(fused, x)
    assert len(peft_forward_calls) == 2  # peft's forward ran for ref's two layers only: fused took its own
    scale = want[0].abs().max()
    assert (got[0] - want[0]).abs().max() <= tol * scale
    assert (got[1] - want[1]).abs().max() <= tol * want[1].abs().max()
    assert got[2].keys() == want[2].keys() and len(got[2]) == 4  # A and B of each layer
    for name, g in want[2].items():
        assert (got[2][name] - g).abs().max() <= tol * g.abs().max(), name


def test_dropout_in_training_draws_the_same_mask_as_peft():
    ref, fused = _pair(torch.float32, dropout=0.3)
    ref.train(), fused.train()
    x = torch.randn(4, 64)
    torch.manual_seed(5)
    want = ref(x)
    torch.manual_seed(5)
    got = fused(x)
    torch.manual_seed(6)
    other = fused(x)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(other, want)  # the dropout is live: another mask gives another output


def test_what_the_fused_path_does_not_take_goes_to_peft(peft_forward_calls):
    ref, fused = _pair(torch.float32)
    x = torch.randn(2, 64)
    with fused.disable_adapter(), ref.disable_adapter():  # the reference policy: the base alone
        torch.testing.assert_close(fused(x), ref(x))
    assert len(peft_forward_calls) == 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(fused(x), ref(x))
    assert len(peft_forward_calls) == 8
    fused.add_adapter("second", LoraConfig(r=4, target_modules=["0", "1"]))
    fused.base_model.set_adapter(["default", "second"])
    fused(x)
    assert len(peft_forward_calls) == 10  # two active adapters: peft sums them


def test_a_scale_beyond_the_dtype_s_range_goes_to_peft_s_multiply(peft_forward_calls):
    # addmm would refuse alpha = 1e300 in float32; peft's forward makes the inf the run's check names
    ref, fused = _pair(torch.float32)
    for layer in fused.base_model.model:
        layer.scaling = {k: 1e300 for k in layer.scaling}
    out = fused(torch.randn(2, 64))
    assert len(peft_forward_calls) == 2 and not torch.isfinite(out).all()


def test_a_base_of_another_dtype_gets_peft_s_sum_in_its_dtype():
    ref, fused = _pair(torch.float32)
    for model in (ref, fused):  # bf16 bases under fp32 adapters: the layer's output is the base's dtype
        for layer in model.base_model.model:
            layer.base_layer.to(torch.bfloat16)
    layer = fused.base_model.model[0]
    x = torch.randn(2, 64)
    got = layer.base_layer.forward
    layer.base_layer.forward = lambda t: got(t.to(torch.bfloat16))
    ref.base_model.model[0].base_layer.forward = layer.base_layer.forward
    want = ref.base_model.model[0](x)
    out = layer(x)
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out, want)


def test_a_bf16_adapter_still_merges_into_a_plain_linear():
    _, fused = _pair(torch.float32)
    x = torch.randn(2, 64)
    with torch.no_grad():
        unmerged = fused(x)
        merged = fused.merge_and_unload()(x)
    torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-5)


def test_plain_linear_is_nn_linear_itself_not_a_subclass():
    class Sub(nn.Linear):
        pass

    assert isinstance(nn.Linear(2, 2), PlainLinear)
    assert not isinstance(Sub(2, 2), PlainLinear) and not isinstance(nn.Conv1d(1, 1, 1), PlainLinear)


def test_the_nvfp4_base_takes_the_fused_path_with_peft_s_results(peft_forward_calls):
    model = build_model("qwen2-tiny", dtype=torch.float32, seed=0)
    quantize_model(model)
    fused = attach_lora(copy.deepcopy(model), r=8, alpha=12, seed=0)
    with torch.no_grad():
        for name, p in fused.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    layers = [m for m in fused.modules() if isinstance(m, QuantLoraLinear)]
    assert layers and all(isinstance(m, FusedLoraLinear) for m in layers)
    ids = torch.tensor([[5, 17, 99, 3, 42, 7, 250, 11]])
    got = fused(ids).logits
    assert not peft_forward_calls
    for m in layers:  # the same layers through peft's own forward
        m.forward = lambda x, _m=m: PeftLoraLinear.forward(_m, x)
    want = fused(ids).logits
    assert len(peft_forward_calls) == len(layers)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
