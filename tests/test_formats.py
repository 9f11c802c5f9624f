"""MXFP4 and NF4 references and the shared format interface."""

import pytest
import torch

from qerl_kit import fp4, mxfp4, nf4
from qerl_kit.formats import FORMATS, get_format


def _w(shape, seed=0, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_interface_roundtrip_and_sizes(name):
    fmt = get_format(name)
    w = _w((64, 256), seed=3, scale=0.02).to(torch.bfloat16)
    q = fmt.quantize(w)
    assert q.shape == (64, 256)
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (64, 128)
    deq = fmt.dequantize(q, torch.float32)
    assert deq.shape == w.shape and deq.dtype == torch.float32
    assert torch.equal(q.dequantize(torch.float32), deq)
    assert q.nbytes * 8 / w.numel() == pytest.approx(fmt.bits_per_weight, abs=0.01)
    assert 0.05 < fmt.error(w) < 0.13


def test_get_format_errors_name_choices():
    with pytest.raises(ValueError, match="nvfp4"):
        get_format("int3")
    assert get_format("NVFP4").name == "nvfp4"


@pytest.mark.parametrize("name, block", [("mxfp4", 32), ("nf4", 64)])
def test_block_divisibility_error(name, block):
    with pytest.raises(ValueError, match=f"block size {block}"):
        get_format(name).quantize(torch.randn(4, block + 16))


def test_every_e8m0_byte_is_its_exact_power_of_two():
    """mxfp4.e8m0_scales builds 2^(byte - 127) from bits: exact for every byte, the subnormal 2^-127
    (byte 0) and 2^-126 included, where CUDA's exp2 is an ulp off; byte 255 is inf."""
    import math

    got = mxfp4.e8m0_scales(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    assert got.dtype == torch.float32
    assert [float(v) for v in got[:255]] == [math.ldexp(1.0, b - 127) for b in range(255)]
    assert math.isinf(float(got[255]))


def test_mxfp4_scales_are_powers_of_two_and_amax_never_saturates_badly():
    w = _w((16, 128), seed=1)
    q = mxfp4.quantize(w)
    scale = torch.exp2(q.scales.float() - 127)
    blocks = w.reshape(16, 4, 32)
    amax = blocks.abs().amax(-1)
    ratio = amax / scale  # where the block max lands on the E2M1 axis
    assert (ratio <= 7.0).all() and (ratio >= 1.75).all()
    # elements on the grid times a power of two come back exactly
    grid = torch.tensor(fp4.E2M1_VALUES * 4).reshape(1, 32) * 2.0**-3
    assert torch.equal(mxfp4.dequantize(mxfp4.quantize(grid), torch.float32), grid)


def test_mxfp4_rounds_amax_with_mantissa_at_least_1_75_up():
    row = torch.zeros(1, 32)
    row[0, 0] = 7.5  # 1.875 * 2^2 -> scale exponent 3 - 2 = 1, 7.5/2 = 3.75 -> 4 -> 8
    q = mxfp4.quantize(row)
    assert q.scales.item() - 127 == 1
    assert mxfp4.dequantize(q, torch.float32)[0, 0].item() == 8.0
    row[0, 0] = 7.0  # 1.75 * 2^2 rounds up too
    assert mxfp4.quantize(row).scales.item() - 127 == 1
    row[0, 0] = 6.5  # 1.625 * 2^2 stays: exponent 0, 6.5 saturates to 6
    assert mxfp4.quantize(row).scales.item() - 127 == 0


def test_mxfp4_zero_block_gets_smallest_scale():
    q = mxfp4.quantize(torch.zeros(2, 32))
    assert q.scales.eq(0).all()
    assert mxfp4.dequantize(q).eq(0).all()


def test_nf4_codebook_nearest_and_nibble_order():
    book = torch.tensor(nf4.NF4_CODEBOOK)
    assert book.shape == (16,) and book[7] == 0 and book[0] == -1 and book[15] == 1
    row = torch.zeros(1, 64)
    row[0, 0], row[0, 1] = 1.0, -1.0  # absmax 1: codes 15 then 0 -> byte 0xF0 (first = high)
    row[0, 2], row[0, 3] = 0.08, 0.5
    q = nf4.quantize(row)
    assert q.absmax.item() == 1.0
    assert q.packed[0, 0].item() == 0xF0
    assert q.packed[0, 1].item() == (8 << 4) | 12  # 0.08 -> 0.0796 (code 8), 0.5 -> 0.4407 (code 12)
    w = _w((8, 128), seed=5)
    deq = nf4.dequantize(nf4.quantize(w), torch.float32)
    # every dequantized value is the nearest codebook entry times the block absmax
    absmax = w.reshape(8, 2, 64).abs().amax(-1, keepdim=True)
    normed = (w.reshape(8, 2, 64) / absmax).unsqueeze(-1)
    nearest = book[(normed - book).abs().argmin(-1)]
    assert torch.allclose(deq.reshape(8, 2, 64), nearest * absmax, atol=1e-6)


def test_error_ordering_on_gaussian_weights():
    w = _w((512, 1024), seed=9)
    errs = {name: fmt.error(w) for name, fmt in FORMATS.items()}
    assert errs["nvfp4"] < errs["mxfp4"]  # finer blocks and FP8 scales beat power-of-two scales
    assert abs(errs["nf4"] - errs["nvfp4"]) < 0.02
