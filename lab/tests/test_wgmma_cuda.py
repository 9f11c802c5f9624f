"""Our Hopper wgmma kernel for 17..64 rows (lab/nvfp4_wgmma_cuda.py; in the lab since humming-kernels
beat it on every layer it was routed to, bench/results/routes_h200.md).

On the CPU: the rule it was routed by, the K split, the fit check and the status off Hopper; the
wgmma layout's data movement is emulated against the reference in lab/tests/test_proto_wgmma_gemm.py.
On an sm_90 GPU the kernel runs against the exact product at real layer shapes for 17..64 rows,
with bias, split and unsplit K, strided x, and captured in a CUDA graph.
"""

import pytest
import torch

from qerl_kit import nvfp4
from lab import nvfp4_wgmma_cuda as wg
from lab.nvfp4_wgmma_cuda import wgmma_status
from qerl_kit.kernels.routes import WIDE_N
from tests.test_decode_cuda import _exact, _exact_weight, _rel, _weight, assert_graph_replays_match

CUDA = torch.cuda.is_available()


def test_preferred_is_the_measured_rule():
    # where the 256-row kernel won in route_wgmma_h200.md (ratios against the dispatcher, 24/32 | 48/64 rows)
    for m in (17, 24, 32, 33, 48, 64):
        assert wg.preferred(m, 13824, 5120)            # 14B gate/up: 1.22/1.17 | 1.21/1.13
        assert wg.preferred(m, 5120, 27648)            # 32B down: 1.22/1.17 | 1.28/1.17
        assert wg.preferred(m, 29568, 8192) and wg.preferred(m, 8192, 29568) and wg.preferred(m, 10240, 8192)
        assert not wg.preferred(m, 5120, 13824)        # 14B down: 1.01/0.93 | 0.99/0.88
        assert not wg.preferred(m, 7168, 5120)         # 14B/32B qkv: 1.03/1.01 | 1.04/0.91
        assert not wg.preferred(m, 3584, 18944)        # 7B down: 0.90/0.81 | 0.84/0.72
        assert not wg.preferred(m, 5120, 5120) and not wg.preferred(m, 1024, 8192)   # small, k/v
    assert wg.preferred(32, 8192, 8192) and not wg.preferred(64, 8192, 8192)     # 72B o: 1.08 | 0.91
    for m in (17, 24, 32, 33, 48, 64):                 # wide gate_up with K >= 5120: from 33 rows, session 9's
        assert wg.preferred(m, 55296, 5120) and wg.preferred(m, 59136, 8192)  # kernel beat the tiled GEMM 1.16-1.23x
        assert not wg.preferred(m, 37888, 3584)         # 7B gate_up, K = 3584: 0.97 | 0.89-0.96
    assert not wg.preferred(32, 18944, 3584) and wg.preferred(64, 18944, 3584)     # 7B gate/up: 0.91 | 1.05
    assert not wg.preferred(64, WIDE_N, 3584) and wg.preferred(64, WIDE_N, 5120)
    assert not wg.preferred(16, 55296, 5120) and not wg.preferred(65, 8192, 29568)   # outside 17..64


def test_choose_ips_splits_k_to_cover_the_gpu_once():
    for m, n, k in [(24, 27648, 5120), (64, 8192, 29568), (32, 8192, 8192), (48, 7168, 5120), (17, 59136, 8192)]:
        ips = wg.choose_ips(m, n, k, sms=132)
        steps = k // wg.K_STEP
        slices = -(-steps // ips)
        assert 1 <= ips <= steps and (slices - 1) * ips < steps   # every slice has work
        assert -(-n // wg.ROWS) * slices <= 132 or slices == 1     # at most one block per SM
    # the route table's best splits (lab/results/route_wgmma_h200.md)
    assert wg.choose_ips(64, 8192, 29568, sms=132) == 58    # 72B down: 32 tiles x 4 slices
    assert wg.choose_ips(32, 8192, 8192, sms=132) == 16     # 72B o: 32 tiles x 4 slices
    assert wg.choose_ips(24, 27648, 5120, sms=132) == 40    # 14B gate_up: 108 tiles, K unsplit
    assert wg.choose_ips(48, 7168, 5120, sms=132) == 10     # 14B qkv: 28 tiles x 4 slices


def test_cpu_calls_never_take_it_and_the_status_says_why():
    q = nvfp4.quantize(torch.randn(5120, 128))
    x = torch.randn(32, 128, dtype=torch.bfloat16)
    assert not wg.supports(x, q.packed, q.scales)
    with pytest.raises(ValueError, match="17..64 rows"):
        wg.nvfp4_wgmma_cuda(x, q.packed, q.scales, q.global_scale)
    if not CUDA:
        assert wgmma_status() == (False, "no CUDA device")


def test_status_keeps_sm90a_code_off_other_gpus(monkeypatch):
    """sm_90a code (wgmma) runs on compute capability 9.0 only: older and newer GPUs get a reason
    and keep Triton, without a compile attempt."""
    from qerl_kit.kernels import nvrtc

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(nvrtc, "compile_kernel", lambda *a, **k: pytest.fail("compiled on a GPU it cannot run on"))
    for cap, why in [((8, 9), "compute capability 8.9 < 9.0 (wgmma)"),
                     ((10, 0), "compute capability 10.0: wgmma is built for sm_90a only"),
                     ((12, 0), "compute capability 12.0: wgmma is built for sm_90a only")]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda cap=cap: cap)
        assert nvrtc.status(wg.SOURCE, ("nvfp4_wgmma_m32",), (9, 0), "wgmma", arch=wg.ARCH) == (False, why)


def test_source_holds_the_two_shipped_kernels_on_the_shared_pipeline():
    from lab import cuda_pipeline as cp

    assert wg.SOURCE.startswith(cp.PIPELINE) and wg.LAYOUT in wg.SOURCE and wg.WARP_SPECIALIZED in wg.SOURCE
    for name, mt in [("nvfp4_wgmma_m32", 4), ("nvfp4_wgmma_m64", 8)]:   # a producer + two consumer warpgroups
        assert f"__launch_bounds__(384, 1) {name}(ARGS) {{ gemm_ws<{mt}, 4>(CALL); }}" in wg.SOURCE
    assert wg.THREADS == 384 and wg.ROWS == 256
    asm = wg._wgmma_asm(64)  # 32 accumulators, then A's 4 registers, B's descriptor (%36) and scale-d (%37)
    assert asm.count('"+f"') == 32 and "%36, p, 1, 1, 0" in asm and "setp.ne.b32 p, %37, 0" in asm
    # 4 x stages (8 chunks x 64 rows x 32 bytes) + 4 weight stages of 8 consumer warps (32 rows x 72
    # bytes) + 8 mbarriers; under the 227 KB a block may opt into
    assert wg.shared_bytes(8) == 4 * (8 * 64 * 32) + 4 * 8 * (32 * 72) + 8 * 8 == 139328 < 227 * 1024
    assert wg.shared_bytes(4) == 4 * (8 * 32 * 32) + 4 * 8 * (32 * 72) + 8 * 8
    # the producer's copies land where each consumer warp's load_fragments reads its rows: codes of
    # local row r at (r >> 5) * warp_stage + (r & 31) * 64, scales after the warp's 32 code rows
    assert "waddr + s * WB + (r >> 5) * WSB + (r & 31) * 64 + 16 * p" in wg.SOURCE
    assert "waddr + s * WB + (r >> 5) * WSB + 16 * NT * 64 + (r & 31) * 8" in wg.SOURCE
    assert "qw[nt][r] = *reinterpret_cast<const uint4*>(wst + lr * 64 + 16 * t);" in cp.PIPELINE
    assert "wst + 16 * NT * 64 + lr * 8 + 2 * t" in cp.PIPELINE


# -- GPU ------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA or not wgmma_status()[0],
                         reason=f"needs the wgmma kernel: {wgmma_status()[1]}" if CUDA else "needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k", [(7168, 5120), (8192, 8192), (5120, 27648), (55296, 5120), (272, 1024)], ids=str)
def test_gpu_matches_exact_product(n, k):
    q = _weight(n, k, seed=n + k)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    w = _exact_weight(q.packed, q.scales, q.global_scale)
    steps = k // wg.K_STEP
    for m in (17, 24, 32, 33, 48, 64):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        ref = _exact(x, q, bias, w)
        for ips in (None, steps, 1, 3):                        # default, unsplit, most slices, ragged
            y = wg.nvfp4_wgmma_cuda(x, q.packed, q.scales, q.global_scale, bias, ips=ips)
            assert y.dtype == torch.bfloat16 and y.shape == (m, n)
            assert _rel(y, ref) < 3e-3, (m, ips)                # bf16 output rounding only
            for r in (0, m // 2, m - 1):
                assert _rel(y[r], ref[r]) < 4e-3, (m, ips, r)


@pytest.mark.gpu
@gpu
def test_gpu_strided_rows_determinism_and_graph_replay():
    q = _weight(8192, 8192, seed=5)
    buf = torch.randn(32, 8448, device="cuda").to(torch.bfloat16)
    x = buf[:, :8192]                                      # row stride 8448
    assert wg.supports(x, q.packed, q.scales)
    y = wg.nvfp4_wgmma_cuda(x, q.packed, q.scales, q.global_scale)
    assert _rel(y, _exact(x, q)) < 3e-3
    assert torch.equal(y, wg.nvfp4_wgmma_cuda(x.contiguous(), q.packed, q.scales, q.global_scale))
    assert not wg.supports(torch.randn(32, 8192, device="cuda").half(), q.packed, q.scales)   # fp16
    assert not wg.supports(torch.randn(16, 8192, device="cuda").bfloat16(), q.packed, q.scales)
    x = torch.randn(48, 8192, device="cuda").to(torch.bfloat16)
    assert_graph_replays_match(wg.nvfp4_wgmma_cuda, x, q,
                               run=lambda x: wg.nvfp4_wgmma_cuda(x, q.packed, q.scales, q.global_scale))
