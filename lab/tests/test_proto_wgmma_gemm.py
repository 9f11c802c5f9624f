"""The wgmma prototype (lab/proto_wgmma_gemm.py), on the CPU: its x stage layout (every byte
written once, the staging stores free of bank conflicts, 16-byte core matrices) and its data
movement, with B read back by the descriptor rule of the PTX ISA, against the plain product."""

import pytest
import torch

from lab import proto_cuda_gemm_emulate as emu
from lab import proto_wgmma_gemm as proto


@pytest.mark.parametrize("mt", [4, 8])
def test_stage_layout_is_a_bijection_of_core_matrices_and_the_stores_hit_32_banks(mt):
    rows = 8 * mt
    offs = {proto.xoff(mt, c, m, k) for c in range(8) for m in range(rows) for k in range(16)}
    assert offs == set(range(0, 8 * rows * 32, 2))  # every bf16 slot of the 8 chunks, once
    for c in range(8):  # a core matrix (8 rows x 8 k slots) is 128 contiguous bytes
        for m0 in range(0, rows, 8):
            for k0 in (0, 8):
                core = sorted(proto.xoff(mt, c, m0 + r, k0 + k) for r in range(8) for k in range(8))
                assert core == list(range(core[0], core[0] + 128, 2)) and core[0] % 128 == 0
    # store_x: 4 stores per warp, each to 32 banks
    banks = emu.staging_banks(lambda c, m, k: proto.xoff(mt, c, m, k) // 4, mt)
    assert len(banks) == 4 * mt * 4 and all(len(b) == 32 for b in banks)


@pytest.mark.parametrize("m,mt", [(1, 4), (17, 4), (32, 4), (33, 8), (64, 8)])
def test_emulated_data_movement_gives_the_product(m, mt):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 256, generator=g)
    w = torch.randn(32, 256, generator=g)
    torch.testing.assert_close(proto.emulate(x, w, mt), x.double() @ w.double().t(), rtol=1e-12, atol=1e-12)


def test_a_wrong_descriptor_stride_is_caught_by_the_emulation():
    """The emulation must fail when the descriptor's strides disagree with the stores."""
    x, w = torch.randn(16, 128), torch.randn(16, 128)
    good = proto.emulate(x, w, 4)
    real = proto.descriptor_read
    try:
        proto.descriptor_read = lambda stage, start, n: real(stage, start, n, lbo=256, sbo=128)
        with pytest.raises(Exception):
            bad = proto.emulate(x, w, 4)
            torch.testing.assert_close(bad, good)
    finally:
        proto.descriptor_read = real


def test_source_is_the_shipped_pipeline_and_layout_and_builds_one_kernel_per_config():
    assert proto.SOURCE.startswith(proto.COMMON + proto.wgk.LAYOUT) and "struct MmaSync" not in proto.SOURCE
    assert "THREADS_" not in proto.SOURCE and 'extern "C"' not in proto.SOURCE.split("#define KERNEL")[0]
    for n in (32, 64):
        assert f"m64n{n}k16.f32.bf16.bf16" in proto.SOURCE
    names = set()
    for mt in (4, 8):
        for cfg in proto.CONFIGS:
            for variant in proto.VARIANTS:
                name = proto.kernel_name(mt, *cfg, variant)
                source = proto.kernel_source(mt, *cfg, variant)
                assert source.startswith(proto.SOURCE) and source.count("KERNEL(") == 2  # define + one use
                assert source.rstrip().endswith(f"{name})")
                names.add(name)
    assert len(names) == 2 * len(proto.CONFIGS) * len(proto.VARIANTS)
    with pytest.raises(ValueError, match="no wgmma kernel"):
        proto.kernel_source(8, 4, 1, 5, 1, "overlap")  # a depth no block is compiled for
    with pytest.raises(ValueError, match="no wgmma kernel"):
        proto.kernel_source(8, 4, 1, 4, 1, "overlap", minb=5)
    capped = proto.kernel_source(8, 8, 2, 4, 2, "overlap", minb=2)  # registers capped for two 256-row blocks
    assert capped.rstrip().endswith("KERNEL(64, 8, 2, 4, 2, 2, WgOverlap, nvfp4_wgmma_m64_w8n2_s4_x2_overlap_b2)")
    assert proto.kernel_name(8, 8, 2, 4, 2, "overlap", 1) == proto.kernel_name(8, 8, 2, 4, 2, "overlap")


@pytest.mark.parametrize("m,mt", [(5, 4), (32, 4), (33, 8), (64, 8)])
def test_x_permuted_once_per_call_is_the_stages_store_x_would_write(m, mt):
    """xd = 0 copies x from permute_x's output straight into the stages: it must hold, step by
    step, exactly the values store_x puts at each byte offset (rows past M repeating row M - 1)."""
    x = torch.randn(m, 384, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    xp = proto.permute_x(x, mt)
    assert xp.shape == (3 * 1024 * mt,)
    for it in range(3):
        stage = proto.stage_values(x, mt, it)
        got = {2 * j: xp[it * 1024 * mt + j].double() for j in range(1024 * mt)}
        assert got.keys() == stage.keys()
        assert all(got[off] == stage[off] for off in stage), it
