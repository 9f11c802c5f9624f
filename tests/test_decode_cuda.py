"""The CUDA C decode kernel (qerl_kit/kernels/nvfp4_decode_cuda.py).

On the CPU: its arithmetic is checked exhaustively (the bit placement of every code and every
E4M3 scale, and the exactness of their product), and a lane-by-lane emulation of the kernel's
K permutation and MMA fragments (laid out as the PTX ISA defines m16n8k16) is compared with the
reference. On a GPU the kernel itself runs against the reference at real layer shapes, every row
count 1..16, with bias, strided x, the K tail, both tile widths, split and unsplit K, through the
dispatcher (where the routing table sends it) and captured in a CUDA graph.
"""

import pytest
import torch

from qerl_kit import nvfp4
from qerl_kit.kernels import nvfp4_linear, nvfp4_linear_ref, route, set_backend
from qerl_kit.kernels import nvfp4_decode_cuda as dec

CUDA = torch.cuda.is_available()
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns (in int64) -> float32 values."""
    b = bits.to(torch.int64)
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def _bf16_half(bits: torch.Tensor) -> torch.Tensor:
    """A 16-bit bf16 pattern -> its float value (float64, exact)."""
    return _bits_to_float((bits & 0xFFFF) << 16).double()


def _rotl(w: torch.Tensor, d: int) -> torch.Tensor:
    return ((w << d) | (w >> (32 - d))) & 0xFFFFFFFF if d else w


def _pair(w: torch.Tensor, p: int) -> torch.Tensor:
    """The kernel's pair(): codes at bits 4p and 16 + 4p of w -> two bf16 patterns, by rotating w
    right by 6, merging in the sign bits of one half of the pairs, rotating and masking."""
    r = _rotl(w, 26)
    mask = 0x00880088 if p < 2 else 0x88008800
    t = (w & mask) | (r & ~mask & 0xFFFFFFFF)
    return _rotl(t, {0: 12, 1: 8, 2: 4, 3: 0}[p]) & 0x81C081C0


def _scale(b: torch.Tensor) -> torch.Tensor:
    """The kernel's scale_bf16x2() (one half): E4M3 byte -> float value of the bf16 it produces."""
    f = _bits_to_float((b << 20) & 0x07F00000)
    f = f * torch.tensor(2.0**108) * torch.tensor(2.0**108)  # two float32 multiplies, as in CUDA
    return f.to(torch.bfloat16).double()  # cvt.rn.bf16x2.f32


def _e2m1(code: torch.Tensor) -> torch.Tensor:
    mag = E2M1.to(code.device)[code & 7]
    return torch.where(code >= 8, -mag, mag)


def test_code_bits_are_e2m1_times_2_pow_minus_126_for_every_byte():
    w = torch.arange(1 << 16, dtype=torch.int64)  # every pair of bytes in the low 16 bits
    w = w | (w.flip(0) << 16)                      # and other codes in the high half
    for p in range(4):
        bits = _pair(w, p)
        lo, hi = (w >> (4 * p)) & 15, (w >> (16 + 4 * p)) & 15
        assert torch.equal(_bf16_half(bits), _e2m1(lo) * 2.0**-126)
        assert torch.equal(_bf16_half(bits >> 16), _e2m1(hi) * 2.0**-126)


def test_scale_bits_are_exact_for_every_e4m3_value():
    b = torch.arange(0x7F, dtype=torch.int64)  # every non-negative finite E4M3 byte (0x7F is NaN)
    s = b.to(torch.uint8).view(torch.float8_e4m3fn).double()
    assert torch.equal(_scale(b), s * 2.0**96)


def test_code_times_scale_is_exact_and_normal():
    """fma.rn.bf16x2(code, scale, -0): every product of a code and a scale is a bf16, exactly."""
    codes = torch.arange(16, dtype=torch.int64)
    scales = torch.arange(1, 0x7F, dtype=torch.int64)
    a = (_e2m1(codes) * 2.0**-126)[:, None]
    s = _scale(scales)[None, :]
    prod = a * s
    assert torch.equal(prod.to(torch.bfloat16).double(), prod)          # no rounding
    nz = prod[prod != 0].abs()
    assert nz.min() >= 2.0**-126 and nz.max() < 2.0**127                 # normal, finite
    want = _e2m1(codes)[:, None] * scales.to(torch.uint8).view(torch.float8_e4m3fn).double()[None, :]
    assert torch.equal(prod * 2.0**30, want)


def _exact_weight(packed, scales, gs) -> torch.Tensor:
    """W [N, K] in float64 from its NVFP4 codes: e2m1 * scale / global_scale, no rounding."""
    p = packed.to(torch.int64)
    codes = torch.stack((p & 15, p >> 4), dim=-1).reshape(p.shape[0], -1)
    s = scales.double().repeat_interleave(16, dim=1)
    return _e2m1(codes) * s / gs.double()


def emulate(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """The kernel lane by lane on the CPU: x [M <= 16, K] bf16 -> y [M, N] float64 (before the
    bf16 store). Fragments as the PTX ISA lays out mma.m16n8k16 (row.col): lane = 4 g + t;
    A: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..); B: b0 (k 2t..2t+1, n g),
    b1 (k 2t+8.., n g); C: c0, c1 (g, 2t..2t+1), c2, c3 (g+8, 2t..2t+1)."""
    m, k = x.shape
    n = packed.shape[0]
    words = packed.view(torch.int32).to(torch.int64) & 0xFFFFFFFF      # [N, K/8]
    sbytes = scales.view(torch.uint8).to(torch.int64)                  # [N, K/16]
    xs = torch.zeros(16, k, dtype=torch.float64)
    xs[:m] = x.double()
    y = torch.zeros(16, n, dtype=torch.float64)
    for tile in range(n // 16):
        for it in range(-(-k // 256)):
            for pc in range(2 if it * 256 + 128 < k else 1):
                for i in range(4):
                    A = [torch.zeros(16, 16, dtype=torch.float64) for _ in range(2)]
                    B = [torch.zeros(16, 16, dtype=torch.float64) for _ in range(2)]  # [k, n]
                    for g in range(8):
                        for t in range(4):
                            k0 = it * 256 + pc * 128 + 32 * t + 8 * i          # the word's first code
                            rows = (tile * 16 + g, tile * 16 + g + 8)
                            for h in range(2):                                 # two MMA steps per word
                                for r, row in enumerate(rows):
                                    w = words[row, k0 // 8]
                                    s = _scale(sbytes[row, k0 // 16])
                                    for side, p in enumerate((2 * h, 2 * h + 1)):   # a0/a1, then a2/a3
                                        bits = _pair(w, p)
                                        col = 2 * t + 8 * side
                                        A[h][g + 8 * r, col] = _bf16_half(bits) * s
                                        A[h][g + 8 * r, col + 1] = _bf16_half(bits >> 16) * s
                                xk = [k0 + j for j in (0, 4, 1, 5, 2, 6, 3, 7)]   # the four prmt
                                for mt in range(2):
                                    B[h][2 * t, g + 8 * mt] = xs[g + 8 * mt, xk[4 * h]]
                                    B[h][2 * t + 1, g + 8 * mt] = xs[g + 8 * mt, xk[4 * h + 1]]
                                    B[h][2 * t + 8, g + 8 * mt] = xs[g + 8 * mt, xk[4 * h + 2]]
                                    B[h][2 * t + 9, g + 8 * mt] = xs[g + 8 * mt, xk[4 * h + 3]]
                    for h in range(2):
                        y[:, tile * 16:(tile + 1) * 16] += (A[h] @ B[h]).T
    return (y[:m] * 2.0**30 / gs.double())


@pytest.mark.parametrize("m,k", [(1, 256), (5, 384), (16, 512)])
def test_emulated_kernel_matches_the_reference(m, k):
    """The K permutation and fragment mapping compute x @ W^T exactly (K % 256 == 128: the tail)."""
    g = torch.Generator().manual_seed(m + k)
    w = torch.randn(32, k, generator=g) * torch.exp(torch.randn(32, 1, generator=g))
    q = nvfp4.quantize(w)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    exact = x.double() @ _exact_weight(q.packed, q.scales, q.global_scale).T
    got = emulate(x, q.packed, q.scales, q.global_scale)
    assert torch.allclose(got, exact, rtol=1e-12, atol=1e-12 * exact.abs().max().item())


def test_cpu_tensors_never_take_the_cuda_kernel():
    q = nvfp4.quantize(torch.randn(32, 128))
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    assert not dec.supports(x, q.packed, q.scales)
    y = nvfp4_linear(x, q.packed, q.scales, q.global_scale)
    assert torch.equal(y, nvfp4_linear_ref(x, q.packed, q.scales, q.global_scale))
    if not CUDA:
        assert dec.cuda_decode_status() == (False, "no CUDA device")


def test_choose_config_covers_the_gpu_and_keeps_slices_nonempty():
    for m, n, k in [(1, 512, 3584), (8, 37888, 3584), (16, 5120, 27648), (1, 8192, 29568)]:
        nt, ips = dec.choose_config(m, n, k, sms=132)
        steps = -(-k // dec.K_STEP)
        slices = -(-steps // ips)
        assert nt in (1, 2) and 1 <= ips <= steps
        assert (slices - 1) * ips < steps                  # the last slice has work
        assert -(-n // (64 * nt)) * slices >= 132 or slices == steps
    # several rows: about 4 blocks per SM, 6 for K of 16384 and more (72B down: 116 K steps)
    assert dec.choose_config(4, 8192, 8192, sms=132) == (1, 8)       # 128 N blocks x 4 slices
    assert dec.choose_config(4, 8192, 29568, sms=132) == (1, 20)     # 128 N blocks x 6 slices


# -- GPU ------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA or not dec.cuda_decode_status()[0],
                         reason=f"needs the CUDA decode kernel: {dec.cuda_decode_status()[1]}"
                         if CUDA else "needs a CUDA GPU")


def _weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    return nvfp4.quantize(w).to("cuda")


def _exact(x, q, bias=None, w=None):
    """float64 x @ W^T with W's exact NVFP4 values (the kernel's products are exact), on x's device."""
    w = _exact_weight(q.packed, q.scales, q.global_scale) if w is None else w
    y = x.double() @ w.T
    return y + bias.double() if bias is not None else y


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k", [(3584, 3584), (512, 3584), (37888, 3584), (3584, 18944), (8192, 29568),
                                 (48, 384)], ids=str)
def test_gpu_matches_exact_product(n, k):
    q = _weight(n, k, seed=n + k)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    w = _exact_weight(q.packed, q.scales, q.global_scale)
    for m in range(1, 17):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        ref = _exact(x, q, bias, w)
        for nt, ips in [(None, None), (1, 10**6), (2, 1), (1, 3)]:   # default, unsplit, most slices
            y = dec.nvfp4_decode_cuda(x, q.packed, q.scales, q.global_scale, bias, nt=nt, ips=ips)
            assert y.dtype == torch.bfloat16 and y.shape == (m, n)
            assert _rel(y, ref) < 3e-3, (m, nt, ips)           # bf16 output rounding only
            for r in range(m):
                assert _rel(y[r], ref[r]) < 4e-3, (m, nt, ips, r)


def assert_strided_deterministic_and_dispatched(kernel, path, x, q):
    """A CUDA kernel on x with a row stride: the exact product, bitwise equal on contiguous x,
    what ``nvfp4_linear`` runs on the auto backend (``path``), and Triton when forced. Returns y."""
    y = kernel(x, q.packed, q.scales, q.global_scale)
    assert _rel(y, _exact(x, q)) < 3e-3
    assert torch.equal(y, kernel(x.contiguous(), q.packed, q.scales, q.global_scale))
    assert route("forward", x, q.packed, q.scales) == path
    assert route("forward", x, q.packed, q.scales, backend="triton") == "triton_gemv"
    assert torch.equal(y, nvfp4_linear(x, q.packed, q.scales, q.global_scale))   # auto -> this kernel
    with set_backend("triton"):                          # forcing Triton keeps Triton
        assert _rel(nvfp4_linear(x, q.packed, q.scales, q.global_scale), _exact(x, q)) < 1e-2
    return y


def assert_graph_replays_match(kernel, x, q, run=None):
    """``run(x)`` (default: ``nvfp4_linear`` on the ``ours`` backend, where the table sends this
    call to ``kernel``) captured in a CUDA graph: three replays on new x, each bitwise equal to an
    eager call of ``kernel``."""
    if run is None:
        def run(x):
            return nvfp4_linear(x, q.packed, q.scales, q.global_scale, backend="ours")
    run(x)  # warm-up: compiles, allocates the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = run(x)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device="cuda").to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, kernel(x, q.packed, q.scales, q.global_scale))


@pytest.mark.gpu
@gpu
def test_gpu_strided_rows_determinism_and_dispatch():
    q = _weight(4608, 3584, seed=5)
    buf = torch.randn(3, 4096, device="cuda").to(torch.bfloat16)
    x = buf[:, :3584]                                    # row stride 4096
    assert dec.supports(x, q.packed, q.scales)
    assert_strided_deterministic_and_dispatched(dec.nvfp4_decode_cuda, "cuda_decode", x, q)
    odd = torch.randn(2, 3584 + 64, device="cuda").to(torch.bfloat16)[:, 64:]  # fine: 128-byte offset
    assert dec.supports(odd, q.packed, q.scales)
    assert not dec.supports(torch.randn(2, 3584, device="cuda").half(), q.packed, q.scales)  # fp16 -> Triton
    assert not dec.supports(torch.randn(17, 3584, device="cuda").bfloat16(), q.packed, q.scales)


@pytest.mark.gpu
@gpu
def test_gpu_captures_in_a_cuda_graph_with_split_k():
    q = _weight(3584, 18944, seed=9)
    x = torch.randn(4, 18944, device="cuda").to(torch.bfloat16)
    assert dec.choose_config(4, 3584, 18944)[1] < -(-18944 // dec.K_STEP)   # the split path
    assert_graph_replays_match(dec.nvfp4_decode_cuda, x, q)
