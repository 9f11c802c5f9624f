"""Quantized linear layers: forward equals dequantize-then-matmul, input gradients, no dense copy."""

import pytest
import torch
from torch import nn

from qerl_kit.formats import FORMATS
from qerl_kit.linear import NVFP4Linear


def _linear(in_f=64, out_f=32, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(in_f, out_f, bias=bias).to(dtype)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        if bias:
            lin.bias.normal_(0, 0.1)
    return lin


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_and_input_grad_match_dense_reference(fmt, dtype):
    lin = _linear(128, 48, dtype=dtype, seed=1)
    q = FORMATS[fmt].linear.from_linear(lin)
    w_ref = q.dequantized_weight(dtype).detach().requires_grad_(False)
    x = torch.randn(3, 5, 128, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = q(x)
    y_ref = nn.functional.linear(x_ref, w_ref, lin.bias.detach())
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert torch.equal(x.grad, x_ref.grad)


def test_no_parameters_no_dense_weight_and_state_dict_is_packed():
    q = NVFP4Linear.from_linear(_linear(64, 32, dtype=torch.bfloat16))
    assert list(q.parameters()) == []
    sd = q.state_dict()
    assert set(sd) == {"packed", "scales", "global_scale", "bias"}
    assert sd["packed"].dtype == torch.uint8 and sd["scales"].dtype == torch.float8_e4m3fn
    assert all(t.numel() < 64 * 32 for t in sd.values())  # nothing dense-weight sized
    x = torch.randn(2, 64, dtype=torch.bfloat16, requires_grad=True)
    q(x).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert not any(isinstance(v, torch.Tensor) and v.shape == (32, 64) and v.is_floating_point()
                   for v in vars(q).values())


def test_nvfp4_linear_error_is_small():
    lin = _linear(256, 128, bias=False, seed=2)
    q = NVFP4Linear.from_linear(lin)
    x = torch.randn(16, 256)
    rel = ((q(x) - lin(x)).norm() / lin(x).norm()).item()
    assert rel < 0.15, rel


def test_layer_moves_with_model_and_survives_state_dict_roundtrip():
    q = NVFP4Linear.from_linear(_linear(32, 16))
    q2 = NVFP4Linear.from_linear(_linear(32, 16, seed=7))
    q2.load_state_dict(q.state_dict())
    x = torch.randn(4, 32)
    assert torch.equal(q(x), q2(x))
    assert q.to("cpu").packed.device.type == "cpu"
