"""The 17..64-row CUDA prototype (lab/proto_cuda_gemm.py), on the CPU: its shared-memory layouts
for x (every word written once, no bank conflicts for the staging stores or the ldmatrix reads)
and the weights, and its data movement emulated lane by lane (proto_cuda_gemm_emulate.py)
against the plain product."""

import pytest
import torch

from lab import proto_cuda_gemm as proto
from lab import proto_cuda_gemm_emulate as emu


@pytest.mark.parametrize("mt", [4, 8])
def test_stage_layout_is_a_bijection_without_bank_conflicts(mt):
    rows = 8 * mt
    words = {emu.xword(mt, c, m, k) for c in range(8) for m in range(rows) for k in range(0, 16, 2)}
    assert words == set(range(8 * rows * 8))
    # ldmatrix: each 8x8 matrix is 8 row addresses of 16 bytes; one phase reads all 8 rows, so
    # their 4-bank groups must differ.
    for c in range(8):
        for m0 in range(0, rows, 8):
            for khalf in (0, 8):
                groups = {(emu.xword(mt, c, m0 + r, khalf) % 32) // 4 for r in range(8)}
                assert len(groups) == 8, (c, m0, khalf)
    # staging: a warp's 32 lanes (t fastest, then 8 rows) store one word each per store
    assert all(len(banks) == 32 for banks in emu.staging_banks(lambda c, m, k: emu.xword(mt, c, m, k), mt))


@pytest.mark.parametrize("m,mt", [(1, 4), (17, 4), (32, 4), (33, 8), (64, 8)])
def test_emulated_data_movement_gives_the_product(m, mt):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 256, generator=g)
    w = torch.randn(32, 256, generator=g)
    y = emu.emulate(x, w, mt)
    torch.testing.assert_close(y, x.double() @ w.double().t(), rtol=1e-12, atol=1e-12)


def test_config_splits_k_to_cover_the_gpu_about_once_and_picks_the_tile():
    assert proto.config(17, 37888, 3584) == (4, 28)   # 148 blocks of 256 rows: no split
    assert proto.config(64, 55296, 5120) == (8, 40)   # 216 blocks: no split
    mt, ips = proto.config(64, 3584, 18944)
    slices = -(-(18944 // 128) // ips)
    assert mt == 8 and 14 * slices <= 132 < 14 * (slices + 1)


def test_shared_memory_fits_the_blocks_per_sm_the_launch_bounds_ask_for():
    # m32 kernels ask for 2 blocks per SM, m64 for 1; an H100/H200 SM has 228 KB (1 KB per block
    # reserved) and a block may opt in to 227 KB.
    for stages in (2, 3, 4):
        assert 2 * (proto.shared_bytes(4, stages) + 1040 + 1024) <= 228 * 1024
    assert proto.shared_bytes(8, 6) + 1040 <= 227 * 1024


def test_source_reuses_the_decode_kernels_helpers_and_defines_both_kernels():
    from qerl_kit.kernels import nvfp4_decode_cuda as dec

    assert proto.SOURCE.startswith(dec.SOURCE[:dec.SOURCE.index("// One K step's weights")])
    for mt, stages in [(4, 2), (4, 3), (4, 4), (8, 2), (8, 3), (8, 4), (8, 6)]:
        assert f"KERNEL({8 * mt}, {stages}," in proto.SOURCE
    assert "THREADS_" not in proto.SOURCE


@pytest.mark.parametrize("nt", [1, 2])
def test_weight_stage_is_written_once_and_read_as_the_lanes_rows(nt):
    """load_w fills a warp's stage (16 nt rows x 64 code bytes, then 8 scale bytes per row) once,
    and lane (g, t) of tile nt reads row 16 nt + 8 half + g: code bytes 16 t.., scale bytes 2 t.."""
    writes = emu.weight_stage_writes(nt)
    assert len(writes) == proto.warp_stage(nt) == 16 * nt * 72
    assert len(set(writes.values())) == len(writes)
    for (lane, tile, half), got in emu.weight_stage_reads(nt).items():
        g, t = lane >> 2, lane & 3
        row = 16 * tile + 8 * half + g
        assert got == [(row, 16 * t + b) for b in range(16)] + [(row, f"s{2 * t}"), (row, f"s{2 * t + 1}")]
