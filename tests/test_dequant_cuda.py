"""The CUDA C dequantization kernel (qerl_kit/kernels/nvfp4_dequant_cuda.py).

On the CPU its two bit conversions are emulated line by line and checked exhaustively (every E2M1
code, every E4M3 byte, NaN included). On a GPU the kernel must be bit-identical to the reference
``nvfp4.dequantize`` (bf16 and fp16, subnormal, negative and NaN scale bytes, strided weights),
and the dense strategy built on it must match the reference product.
"""

import pytest
import torch

from qerl_kit import nvfp4
from qerl_kit.fp4 import codes_to_values
from qerl_kit.kernels import nvfp4_dequant_cuda as dq
from qerl_kit.kernels import set_backend

CUDA = torch.cuda.is_available()


def _as_float(bits: torch.Tensor) -> torch.Tensor:
    b = bits.to(torch.int64) & 0xFFFFFFFF
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def _e2m1(c: torch.Tensor) -> torch.Tensor:
    """The kernel's e2m1(): code -> float32 bits -> value."""
    m = c & 7
    bits = torch.where(m >= 2, (m + 252) << 22, torch.where(m == 1, torch.full_like(m, 0x3F000000), 0))
    return _as_float(bits | ((c & 8) << 28))


def _e4m3(b: torch.Tensor) -> torch.Tensor:
    """The kernel's e4m3(): float8_e4m3fn byte -> float32."""
    a = b & 0x7F
    v = torch.where(a >> 3 > 0, _as_float((a << 20) + (120 << 23)), (a & 7).float() * 0.001953125)
    v = torch.where(a == 0x7F, torch.tensor(float("nan")), v)
    return torch.where(b & 0x80 > 0, -v, v)


def test_code_conversion_is_exact_for_every_code():
    codes = torch.arange(16)
    got, want = _e2m1(codes), codes_to_values(codes.to(torch.uint8))
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), codes >= 8)  # -0.0 for code 8, as sign * 0


def test_scale_conversion_is_exact_for_every_e4m3_byte():
    b = torch.arange(256)
    want = b.to(torch.uint8).view(torch.float8_e4m3fn).float()
    got = _e4m3(b)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got).sum() == 2
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok], want[ok])
    assert torch.equal(torch.signbit(got[ok]), torch.signbit(want[ok]))


def test_unusable_without_a_gpu_and_rejects_cpu_weights():
    q = nvfp4.quantize(torch.randn(16, 64))
    assert not dq.supports(q.packed, q.scales, torch.bfloat16)
    if not CUDA:
        assert dq.dequant_cuda_status() == (False, "no CUDA device")
    with pytest.raises(ValueError, match="needs a CUDA uint8 weight"):
        dq.nvfp4_dequantize_cuda(q.packed, q.scales, q.global_scale)


# -- GPU ------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA or not dq.dequant_cuda_status()[0],
                         reason=f"needs the CUDA dequant kernel: {dq.dequant_cuda_status()[1]}"
                         if CUDA else "needs a CUDA GPU")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int16
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(view), b.view(view))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k", [(48, 16), (512, 3584), (3584, 18944), (1000, 272)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_bit_identical_to_the_reference(n, k, dtype):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g) * torch.exp(2 * torch.randn(n, 1, generator=g))
    q = nvfp4.quantize(w).to("cuda")
    got = dq.nvfp4_dequantize_cuda(q.packed, q.scales, q.global_scale, dtype)
    assert _same_bits(got, nvfp4.dequantize(q, dtype))


@pytest.mark.gpu
@gpu
def test_gpu_every_scale_byte_and_strided_codes():
    n, k = 256, 4096                        # every scale byte appears, NaN and negative ones too
    g = torch.Generator().manual_seed(3)
    wide = torch.randint(0, 256, (n, k // 2 + 64), generator=g, dtype=torch.uint8)
    packed = wide[:, 32:32 + k // 2]        # row stride k/2 + 64, 32-byte offset
    scales = torch.arange(n * k // 16, dtype=torch.int64).remainder(256).to(torch.uint8)
    scales = scales.view(n, k // 16).view(torch.float8_e4m3fn)
    q = nvfp4.NVFP4Tensor(packed, scales, torch.tensor([0.37]))
    ref = nvfp4.dequantize(q, torch.bfloat16)
    packed_gpu = wide.cuda()[:, 32:32 + k // 2]
    assert packed_gpu.stride(0) == k // 2 + 64 and dq.supports(packed_gpu, scales, torch.bfloat16)
    got = dq.nvfp4_dequantize_cuda(packed_gpu, scales.cuda(), q.global_scale.cuda())
    assert torch.equal(torch.isnan(got.cpu()), torch.isnan(ref))
    assert _same_bits(got.cpu().nan_to_num(), ref.nan_to_num())


@pytest.mark.gpu
@gpu
def test_gpu_dense_strategy_uses_it_and_triton_when_forced():
    from qerl_kit.kernels.nvfp4_gemm_triton import nvfp4_dequantize, nvfp4_gemm

    q = nvfp4.quantize(torch.randn(1024, 2048)).to("cuda")
    ref = nvfp4.dequantize(q, torch.bfloat16)
    assert _same_bits(nvfp4_dequantize(q.packed, q.scales, q.global_scale), ref)   # auto: this kernel
    with set_backend("triton"):                       # forced: the Triton kernel (within bf16 rounding)
        tri = nvfp4_dequantize(q.packed, q.scales, q.global_scale)
    assert ((tri.float() - ref.float()).abs() <= ref.float().abs() * 2**-7).all()
    x = torch.randn(512, 2048, device="cuda").to(torch.bfloat16)
    y = nvfp4_gemm(x, q.packed, q.scales, q.global_scale, strategy="dense")
    assert torch.equal(y, torch.nn.functional.linear(x, ref))
