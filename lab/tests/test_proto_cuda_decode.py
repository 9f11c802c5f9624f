"""The CUDA decode prototype (lab/proto_cuda_decode.py): its weight repacking and the kernel's
bit tricks and fragment mapping, emulated on the CPU, against the NVFP4 reference."""

import pytest
import torch

from lab import proto_cuda_decode as proto
from qerl_kit import nvfp4
from qerl_kit.kernels.reference import nvfp4_linear_ref


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
def test_emulated_kernel_matches_the_reference(m):
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(48, 192, generator=gen) * 0.05
    q = nvfp4.quantize(w)
    x = torch.randn(m, 192, generator=gen).to(torch.bfloat16)
    wq, ws = proto.repack(q.packed, q.scales, q.global_scale)
    got = proto.emulate(x, wq, ws, 48, 192)
    ref = nvfp4_linear_ref(x, q.packed, q.scales, q.global_scale, dtype=torch.float32)
    assert got.shape == (m, 48)
    assert _rel(got, ref) < 5e-3  # the weight is rounded to bf16, like the Triton kernels'


def test_emulation_is_exact_when_nothing_rounds():
    # power-of-two scales and a global scale of 2^94: every dequantized weight is exact in bf16,
    # so any error would be a wrong code, sign, column or row in the repacked layout
    gen = torch.Generator().manual_seed(0)
    n, k, m = 32, 128, 13
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scales = torch.exp2(torch.randint(-6, 6, (n, k // 16), generator=gen).float()).to(torch.float8_e4m3fn)
    gscale = torch.tensor([2.0 ** 94])
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    wq, ws = proto.repack(packed, scales, gscale)
    w = nvfp4.dequantize(nvfp4.NVFP4Tensor(packed, scales, gscale), torch.float64)
    ref = x.double() @ w.T
    got = proto.emulate(x, wq, ws, n, k)
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


def test_repack_rejects_shapes_the_kernel_cannot_tile():
    q = nvfp4.quantize(torch.randn(24, 64))
    with pytest.raises(ValueError, match="N % 16"):
        proto.repack(q.packed, q.scales, q.global_scale)
