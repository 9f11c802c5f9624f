"""NVFP4 reference: bit-exactness with compressed-tensors, rounding rules, errors."""

import zlib

import pytest
import torch

from qerl_kit import fp4, nvfp4
from tests.ct_reference import ct_dequantize, ct_quantize

SHAPES = [(16, 16), (1, 32), (48, 64), (7, 160), (256, 512), (3, 2048)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MAGNITUDES = [1e-6, 3e-3, 0.02, 1.0, 40.0, 3e3]


def _weight(shape, dtype, magnitude, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * magnitude
    # Heavy-tailed rows and a spread of block amaxes exercise small and saturated block scales.
    w = w * torch.exp(torch.randn(shape[0], 1, generator=g) * 1.5)
    if dtype == torch.float16:  # stay finite: fp16 tops out at 65504
        w = w.clamp(-6e4, 6e4)
    return w.to(dtype)


def _assert_same(ours: nvfp4.NVFP4Tensor, ref, msg=""):
    packed, scales, gs = ref
    assert torch.equal(ours.global_scale, gs), f"global scale {ours.global_scale} vs {gs} {msg}"
    assert torch.equal(ours.scales.view(torch.uint8), scales.view(torch.uint8)), f"scales differ {msg}"
    assert torch.equal(ours.packed, packed), f"packed codes differ {msg}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("magnitude", MAGNITUDES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bit_exact_with_compressed_tensors(shape, magnitude, dtype):
    seed = zlib.crc32(repr((shape, magnitude, str(dtype))).encode())  # stable across processes
    w = _weight(shape, dtype, magnitude, seed)
    ours = nvfp4.quantize(w)
    _assert_same(ours, ct_quantize(w), f"{shape} {magnitude} {dtype}")
    deq = ct_dequantize(ours.packed, ours.scales, ours.global_scale)
    assert torch.equal(nvfp4.dequantize(ours, torch.bfloat16), deq)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_blocks_tiny_blocks_and_signed_zeros(dtype):
    w = _weight((8, 64), torch.float32, 1.0, 1)
    w[0, :16] = 0.0  # all-zero block: scale rounds to 0, replaced by 0.125
    w[1, 16:32] = -0.0  # negative zeros stay code 0 (compressed-tensors multiplies by sign)
    w[2, :32] = 1e-9 * torch.randn(32)  # blocks far below the tensor amax
    w[3, 5] = -1e-5  # a tiny negative (representable in fp16) rounds to negative zero, code 8
    w = w.to(dtype)
    ours = nvfp4.quantize(w)
    _assert_same(ours, ct_quantize(w))
    assert ours.scales[0, 0].float().item() == nvfp4.FP8_E4M3_EPS
    codes = fp4.unpack_nibbles(ours.packed)
    assert codes[1, 16:32].eq(0).all()
    assert codes[3, 5].item() == 8


def test_all_zero_tensor_matches_and_dequantizes_to_zero():
    w = torch.zeros(4, 32, dtype=torch.bfloat16)
    ours = nvfp4.quantize(w)
    _assert_same(ours, ct_quantize(w))
    assert ours.global_scale.item() == 1.0  # 2688/tiny overflows; compressed-tensors falls back to 1
    assert nvfp4.dequantize(ours).eq(0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_caller_global_scale_matches(dtype):
    a, b = _weight((32, 64), dtype, 0.05, 2), _weight((16, 64), dtype, 0.5, 3)
    gs = nvfp4.shared_global_scale(a, b)
    assert gs.item() == pytest.approx(nvfp4.quantize(b).global_scale.item())  # b holds the amax
    for w in (a, b):
        _assert_same(nvfp4.quantize(w, global_scale=gs), ct_quantize(w, gs))
    assert nvfp4.quantize(a, global_scale=float(gs)).global_scale.item() == gs.item()


def test_rounding_grid_ties_to_even_and_saturation():
    # scaled values straight onto the grid: ties go to the even mantissa
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, -0.74, -6.0])
    expected = torch.tensor([0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.5, -6.0])
    got = fp4.codes_to_values(fp4.round_to_e2m1_codes(x.clamp(-6, 6)))
    assert torch.equal(got, expected)


def test_packing_order_even_element_in_low_nibble():
    # A row holding +0.5 then -6: codes 1 and 15 -> byte 0xF1.
    w = torch.zeros(1, 16)
    w[0, 0], w[0, 1] = 0.5, -6.0
    q = nvfp4.quantize(w)
    assert q.packed[0, 0].item() == 0xF1
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (1, 8)
    assert q.scales.dtype == torch.float8_e4m3fn and q.scales.shape == (1, 1)
    assert q.global_scale.dtype == torch.float32 and q.global_scale.shape == (1,)


def test_dequantize_roundtrip_of_representable_values():
    # Values already on the grid of one block come back exactly.
    vals = torch.tensor(fp4.E2M1_VALUES * 2) * torch.tensor([1.0] * 8 + [-1.0] * 8)
    q = nvfp4.quantize(vals.reshape(1, 16))
    assert torch.equal(nvfp4.dequantize(q, torch.float32), vals.reshape(1, 16))


def test_relative_error_on_gaussian_weights_is_about_a_tenth():
    w = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    deq = nvfp4.dequantize(nvfp4.quantize(w), torch.float32)
    rel = ((w - deq).norm() / w.norm()).item()
    assert 0.08 < rel < 0.11, rel


@pytest.mark.parametrize(
    "w, match",
    [
        (torch.randn(4, 24), "divisible by its block size 16"),
        (torch.randn(64), "2-D"),
        (torch.randn(2, 4, 16), "2-D"),
        (torch.tensor([[float("nan")] * 16]), "NaN or inf"),
        (torch.tensor([[float("inf")] + [0.0] * 15]), "NaN or inf"),
    ],
)
def test_bad_inputs_raise_clear_errors(w, match):
    with pytest.raises(ValueError, match=match):
        nvfp4.quantize(w)


def test_bad_dtype_and_global_scale():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        nvfp4.quantize(torch.ones(2, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="positive finite"):
        nvfp4.quantize(torch.randn(2, 16), global_scale=0.0)
    with pytest.raises(ValueError, match="positive finite"):
        nvfp4.quantize(torch.randn(2, 16), global_scale=float("inf"))


def test_nbytes_is_about_four_and_a_half_bits_per_weight():
    q = nvfp4.quantize(torch.randn(256, 1024))
    assert q.nbytes == 256 * 512 + 256 * 64 + 4
    assert q.shape == (256, 1024)
