"""The 17..64-row CUDA prototype (bench/proto_cuda_gemm.py), on the CPU: its shared-memory layout
for x (every word written once, no bank conflicts for the staging stores or the ldmatrix reads)
and its data movement emulated lane by lane against the plain product."""

import importlib.util
from pathlib import Path

import pytest
import torch

spec = importlib.util.spec_from_file_location(
    "proto_cuda_gemm", Path(__file__).resolve().parents[1] / "bench" / "proto_cuda_gemm.py")
proto = importlib.util.module_from_spec(spec)
spec.loader.exec_module(proto)


@pytest.mark.parametrize("mt", [4, 8])
def test_stage_layout_is_a_bijection_without_bank_conflicts(mt):
    rows = 8 * mt
    words = {proto.xword(mt, c, m, k) for c in range(8) for m in range(rows) for k in range(0, 16, 2)}
    assert words == set(range(8 * rows * 8))
    # ldmatrix: each 8x8 matrix is 8 row addresses of 16 bytes; one phase reads all 8 rows, so
    # their 4-bank groups must differ.
    for c in range(8):
        for m0 in range(0, rows, 8):
            for khalf in (0, 8):
                groups = {(proto.xword(mt, c, m0 + r, khalf) % 32) // 4 for r in range(8)}
                assert len(groups) == 8, (c, m0, khalf)
    # staging: a warp's 32 lanes (t fastest, then 8 rows) store one word each per store
    for warp in range(proto.THREADS * (mt // 2) // 32):
        for which in range(4):
            banks = set()
            for lane in range(32):
                u = warp * 32 + lane
                t, m, i = u & 3, ((u >> 7) << 3) | ((u >> 2) & 7), (u >> 5) & 3
                c, k = 2 * i + (which >> 1), 2 * t + 8 * (which & 1)
                banks.add(proto.xword(mt, c, m, k) % 32)
            assert len(banks) == 32, (warp, which)


@pytest.mark.parametrize("m,mt", [(1, 4), (17, 4), (32, 4), (33, 8), (64, 8)])
def test_emulated_data_movement_gives_the_product(m, mt):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 256, generator=g)
    w = torch.randn(32, 256, generator=g)
    y = proto.emulate(x, w, mt)
    torch.testing.assert_close(y, x.double() @ w.double().t(), rtol=1e-12, atol=1e-12)


def test_config_splits_k_to_cover_the_gpu_and_picks_the_tile():
    assert proto.config(17, 37888, 3584) == (4, 14)   # 148 blocks of 256 rows x 2 slices: 2 per SM
    assert proto.config(64, 3584, 18944)[0] == 8
    mt, ips = proto.config(64, 3584, 18944)
    slices = -(-(18944 // 128) // ips)
    assert 14 * slices >= 132 and (slices - 1) * ips < 18944 // 128


def test_source_reuses_the_decode_kernels_helpers_and_defines_both_kernels():
    from qerl_kit.kernels import nvfp4_decode_cuda as dec

    assert proto.SOURCE.startswith(dec.SOURCE[:dec.SOURCE.index("// One K step's weights")])
    assert 'nvfp4_gemm_m32' in proto.SOURCE and 'nvfp4_gemm_m64' in proto.SOURCE
    assert "THREADS_" not in proto.SOURCE
