"""Prototype, measured, not wired in: the 17..64-row NVFP4 kernel with Hopper's asynchronous wgmma.

Why: the mma.sync prototype (``proto_cuda_gemm.py``) is correct but slower than the dispatcher at
17-64 rows; its time is per weight, issue- and latency-bound, with every warp issuing MT
``mma.sync`` per dequantized fragment (lab/results/proto_cuda_gemm_h200.md). Here the same
block, the same weight pipeline (``cp.async`` into per-warp stages), the same x staging and the
same split-K epilogue feed ``wgmma.mma_async.m64nNk16`` instead:

* A = the dequantized weights, from registers. A warpgroup (4 warps) issues one wgmma per 64
  weight rows and 16 k; warp w of the group supplies A rows 16 w .. 16 w + 15, in the layout of
  ``mma.m16n8k16``'s A fragment, which is what ``dq`` already produces. The rows are chosen so
  that warp w's two 16-row tiles (its rows 0-15 and 16-31) are A rows 16 w.. of the group's first
  and second wgmma: the accumulators then sit exactly where ``store_tile`` expects them.
* B = x^T from shared memory, K-major without swizzle: per MMA step (chunk c = 2i + h), 8-row
  groups of x rows, each two 8 x 16-byte core matrices (k slots 0-7, 8-15): leading byte offset
  128, stride byte offset 256. The k slots are permuted exactly as for mma.sync (the weights'
  K order), so ``store_x`` is the same byte permutes into a different address map, followed by
  ``fence.proxy.async`` (wgmma reads shared memory through the async proxy).
* One wgmma replaces MT ``mma.sync`` per warp: 16 issue slots per K step and warpgroup instead of
  128-256 per warp. ``OVERLAP``: the wgmmas of MMA step s run while step s + 1 is dequantized
  (two register sets, ``wgmma.wait_group 1``); without it each step waits for its own.

Compiled for sm_90a (wgmma does not exist on plain sm_90) with NVRTC: 16 HGMMA per K step,
93-179 registers, no spills. ``emulate`` replays the B layout on the CPU
(lab/tests/test_proto_wgmma_gemm.py); ``python -m lab.proto_wgmma_gemm`` checks every variant
against the reference on the GPU, then times it against the mma.sync prototype, the dispatcher
and bf16 at 32 and 64 rows (``--check``: the check alone).

Measured on the H200 (sessions 7 and 8, lab/results/proto_wgmma_gemm_h200.md): correct
(every configuration, first run); the 256-row blocks with x two K steps ahead beat the Triton
dispatcher on large layers and now ship as ``qerl_kit/kernels/nvfp4_wgmma_cuda.py`` (its
``LAYOUT`` is this file's layout, its kernels this file's ``nvfp4_wgmma_m{32,64}_w8n2_s4_x2_overlap``,
SASS identical; where it wins: lab/route_wgmma.py). The rest did not make a better kernel:
128- and 64-row blocks won a few cells (7B gate_up at 24-32 rows, 128-row blocks) and lost most
(x re-read from L2 by every block); x permuted once per call and copied by ``cp.async``
(``xd`` 0), register caps for more blocks per SM (``--occupancy``) and the serial variant lost.
"""

from __future__ import annotations

import sys

import torch

from lab import proto_cuda_gemm as base
from lab.proto_cuda_gemm_emulate import store_x_words

from lab import cuda_pipeline as cp
from lab import nvfp4_wgmma_cuda as wgk

COMMON = cp.PIPELINE

# The shipped wgmma layout (qerl_kit/kernels/nvfp4_wgmma_cuda.py), here compiled one kernel per
# configuration (block shape, depth, x placement, register cap, overlapped or serial).
SOURCE = COMMON + wgk.LAYOUT + r"""
// One kernel per NVRTC program (kernel_source): compiling every variant in one source would
// build all of them for each name.
#define KERNEL(MT, W, NT, S, XD, MINB, V, NAME) extern "C" __global__ void __launch_bounds__(32 * W, MINB) \
    NAME(ARGS) { gemm<V, MT / 8, S, W, NT, XD>(CALL); }
template <int MT, int NT, int T> using WgDeep4 = Wgmma<MT, NT, T, 4, false>;
template <int MT, int NT, int T> using WgCarry = Wgmma<MT, NT, T, 2, true>;
template <int MT, int NT, int T> using WgDeep4Carry = Wgmma<MT, NT, T, 4, true>;
"""

# How many MMA steps' wgmmas may be in flight while the next is decoded, and whether they stay in
# flight into the next K step: serial 1 (each step waits for its own), overlap 2 (the shipped
# kernel), deep4 up to 3 (four register sets); the carry variants also skip the drain at the end
# of every K step (written in session 8 after the GPU time was spent; compiled, not yet run).
VARIANTS = ("serial", "overlap", "deep4", "carry", "deep4carry")
POLICIES = dict(zip(VARIANTS, ("WgSerial", "WgOverlap", "WgDeep4", "WgCarry", "WgDeep4Carry")))
# ``--depth``: the 256-row, x-two-steps-ahead kernel (the shipped one) in these variants.
DEPTHS = ("overlap", "deep4", "carry", "deep4carry")
# Kernels: (warps, 16-row tiles per warp, weight stages, x steps ahead). 8 x 2 = 256 weight rows
# per block (two warpgroups, the measured shape), 4 x 2 = 128 and 4 x 1 = 64 (one warpgroup).
# x steps ahead 0: x permuted once per call into the stage layout (``permute_x``) and copied with
# the weights by cp.async, through as many stages as the weights.
CONFIGS = ((8, 2, 2, 1), (8, 2, 4, 1), (4, 2, 4, 1), (4, 1, 4, 1), (8, 2, 4, 2), (4, 2, 4, 2), (4, 1, 4, 2),
           (8, 2, 4, 0), (4, 2, 4, 0), (4, 1, 4, 0))


def default_minb(mt: int, warps: int) -> int:
    """Blocks per SM the registers are capped for (``__launch_bounds__``' second argument) unless
    asked otherwise: one 256-row block at 64 x rows (164 registers), else two."""
    return 1 if (warps, mt) == (8, 8) else 2


def kernel_name(mt: int, warps: int, nt: int, stages: int, xd: int, variant: str, minb: int | None = None) -> str:
    cap = "" if minb in (None, default_minb(mt, warps)) else f"_b{minb}"
    return f"nvfp4_wgmma_m{8 * mt}_w{warps}n{nt}_s{stages}_x{xd}_{variant}{cap}"


def kernel_source(mt: int, warps: int, nt: int, stages: int, xd: int, variant: str, minb: int | None = None) -> str:
    """SOURCE plus the one kernel of this configuration (registers capped for ``minb`` blocks per
    SM; ``default_minb`` when None). Blocks and x placements are CONFIGS'; stages 2-4 each."""
    if ((warps, nt) not in {c[:2] for c in CONFIGS} or xd not in (0, 1, 2) or stages not in (2, 3, 4)
            or variant not in VARIANTS or mt not in (4, 8) or minb not in (None, 1, 2, 3, 4)):
        raise ValueError(f"no wgmma kernel for MT={mt}, {warps} warps x {nt} tiles, {stages} stages, "
                         f"x {xd} steps ahead, {variant}, {minb} blocks per SM")
    minb = minb or default_minb(mt, warps)
    policy = POLICIES[variant]
    name = kernel_name(mt, warps, nt, stages, xd, variant, minb)
    return SOURCE + f"KERNEL({8 * mt}, {warps}, {nt}, {stages}, {xd}, {minb}, {policy}, {name})\n"


def kernel_for(variant: str, xd: int = 1, minb: int | None = None):
    """A ``kernel_for(mt, stages, device, warps, nt)`` for ``base.nvfp4_gemm_cuda`` that builds
    this file's kernels for sm_90a."""
    def build(mt: int, stages: int, device: int, warps: int = 8, nt: int = 2):
        name = kernel_name(mt, warps, nt, stages, xd, variant, minb)
        if (name, device) not in _cache:
            source = kernel_source(mt, warps, nt, stages, xd, variant, minb)
            with torch.cuda.device(device):
                kernel = torch.cuda._compile_kernel(source, name, compute_capability="90a",
                                                    nvcc_options=["--std=c++17"])
            _cache[name, device] = base.with_shared_memory(kernel, mt, stages, warps, nt, x_stages(xd, stages))
        return _cache[name, device]
    return build


_cache: dict = {}


def x_stages(xd: int, stages: int) -> int:
    return stages if xd == 0 else 2


def nvfp4_gemm_wgmma(x, packed, scales, global_scale, bias=None, ips=None, stages=4, variant="overlap",
                     warps=8, nt=2, xd=1, minb=None):
    """y = x @ W^T (+ bias) for x [1..64, K] bf16 on an sm_90 GPU, in blocks of ``warps`` warps x
    ``nt`` 16-row tiles (256, 128 or 64 weight rows), x loaded ``xd`` K steps ahead (0: permuted
    into the stage layout first, then copied by cp.async)."""
    x_arg = permute_x(x, base.x_tiles(x.shape[0])) if xd == 0 else None
    return base.nvfp4_gemm_cuda(x, packed, scales, global_scale, bias, ips, stages, kernel_for(variant, xd, minb),
                                warps, nt, x_stages(xd, stages), x_arg)


_perm_cache: dict = {}


def permute_x(x: torch.Tensor, mt: int) -> torch.Tensor:
    """x [M, K] -> every K step's x stage, as store_x would write it (rows past M repeat row
    M - 1): [K / 128 * 1024 MT] bf16, one gather through an index cached per shape."""
    m, k = x.shape
    key = (m, k, mt, x.device)
    if key not in _perm_cache:
        c, row, ks = torch.meshgrid(torch.arange(8), torch.arange(8 * mt), torch.arange(16), indexing="ij")
        i, h = c >> 1, c & 1
        t, hi, khalf = (ks & 7) >> 1, ks & 1, ks >> 3
        k_in_step = 32 * t + 8 * i + 2 * h + khalf + 4 * hi  # the logical k that store_x puts there
        slot = xoff(mt, c, row, ks) // 2
        src = torch.empty(8 * 8 * mt * 16, dtype=torch.long)
        src[slot.flatten()] = (row.clamp(max=m - 1) * k + k_in_step).flatten()
        steps = torch.arange(k // base.K_STEP).unsqueeze(1)
        _perm_cache[key] = (src.unsqueeze(0) + steps * base.K_STEP).flatten().to(x.device)
    return x.contiguous().reshape(-1)[_perm_cache[key]]


# -- CPU emulation of the x stage as wgmma's descriptor reads it ----------------------------------

def xoff(mt: int, c: int, m: int, kslot: int) -> int:
    """SOURCE's xoff<MT>: byte offset of (chunk c, x row m, k slot) in a stage."""
    return c * (256 * mt) + (m >> 3) * 256 + (kslot >> 3) * 128 + (m & 7) * 16 + (kslot & 7) * 2


def descriptor_read(stage: dict, start: int, n: int, lbo: int = 128, sbo: int = 256) -> list:
    """B [16 k slots][n x rows] as a K-major, unswizzled wgmma descriptor reads it (PTX ISA,
    "Shared Memory Matrix Layout": core matrices of 8 rows x 16 bytes, LBO between the two core
    matrices along K, SBO between 8-row groups)."""
    return [[stage[start + (col >> 3) * sbo + (k >> 3) * lbo + (col & 7) * 16 + (k & 7) * 2] for col in range(n)]
            for k in range(16)]


def stage_values(x: torch.Tensor, mt: int, it: int) -> dict:
    """Byte offset -> x value of K step ``it``'s stage as store_x writes it (two values per word)."""
    stage: dict = {}
    for c, m, ks, (lo, hi) in store_x_words(x, mt, it):
        off = xoff(mt, c, m, ks)
        assert off not in stage and off + 2 not in stage, "two stores to one shared word"
        stage[off], stage[off + 2] = lo, hi
    assert len(stage) == 16 * 8 * mt * 8, "a shared word left unwritten"
    return stage


def emulate(x: torch.Tensor, w: torch.Tensor, mt: int) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (float64) through the kernel's data movement: store_x's byte
    permutes into xoff's addresses, B read back through the descriptor rule, A from the weights'
    K permutation (lane t's word i gives k slots 2t, 2t+1 / 2t+8, 2t+9 of step (i, h) codes
    (2h, 2h+4) / (2h+1, 2h+5)), D = A B per 64-row wgmma."""
    M, K = x.shape
    N = w.shape[0]
    rows = 8 * mt
    assert M <= rows and K % base.K_STEP == 0 and N % 16 == 0
    y = torch.zeros(rows, N, dtype=torch.float64)
    for it in range(K // base.K_STEP):
        stage = stage_values(x, mt, it)
        for step in range(8):
            i, h = step >> 1, step & 1
            B = torch.tensor(descriptor_read(stage, xoff(mt, step, 0, 0), rows), dtype=torch.float64)
            for tile0 in range(0, N, 16):
                A = torch.zeros(16, 16, dtype=torch.float64)
                base_k = it * 128 + 8 * i
                for t in range(4):
                    wr = w[tile0:tile0 + 16].double()
                    k0 = base_k + 32 * t
                    A[:, 2 * t], A[:, 2 * t + 1] = wr[:, k0 + 2 * h], wr[:, k0 + 2 * h + 4]
                    A[:, 2 * t + 8], A[:, 2 * t + 9] = wr[:, k0 + 2 * h + 1], wr[:, k0 + 2 * h + 5]
                y[:, tile0:tile0 + 16] += (A @ B).t()
    return y[:M]


# -- GPU: check and time ---------------------------------------------------------------------------

# What ``check`` runs: every configuration overlapped, and the serial variant on both block sizes.
CHECKED = ([("overlap", c) for c in CONFIGS] + [("serial", (8, 2, 4, 1)), ("serial", (4, 1, 4, 1))]
           + [(v, (8, 2, 4, 2)) for v in DEPTHS[1:]])


def check() -> int:
    """The CHECKED kernels against the reference at small shapes, twice (bit-identical)."""
    from bench.bench_nvfp4_gemm import random_nvfp4

    from qerl_kit.kernels.reference import nvfp4_linear_ref

    torch.manual_seed(1)
    bad = 0
    for n, k in [(256, 128), (272, 1024), (1040, 2048)]:
        w = random_nvfp4(n, k)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for m in (1, 17, 32, 33, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = nvfp4_linear_ref(x.float(), *w, bias.float())
            for variant, (warps, nt, stages, xd) in CHECKED:
                for ips in (None, 1, k // base.K_STEP):
                    kw = dict(ips=ips, stages=stages, variant=variant, warps=warps, nt=nt, xd=xd)
                    got = nvfp4_gemm_wgmma(x, *w, bias, **kw)
                    err = ((got.float() - ref).norm() / ref.norm()).item()
                    same = torch.equal(got, nvfp4_gemm_wgmma(x, *w, bias, **kw))
                    if err > 1e-2 or not same:
                        bad += 1
                        print(f"FAIL N={n} K={k} M={m} {kw}: rel err {err:.1e}, repeatable {same}", flush=True)
    print(f"check: {bad} failures", flush=True)
    return bad


def block_for(n: int) -> tuple[int, int]:
    """(warps, tiles per warp) for a layer of ``n`` weight rows: a first guess for ``--engine``
    (64-row blocks where 256-row ones leave the GPU short of blocks), to be replaced by the sweep."""
    return (4, 1) if n <= 8192 else (8, 2)


def routed_linear(x, packed, scales, global_scale, bias=None):
    warps, nt = block_for(packed.shape[0])
    return nvfp4_gemm_wgmma(x, packed, scales, global_scale, bias, warps=warps, nt=nt)


def warm_all() -> None:
    """Compiles every kernel the engine may launch (before CUDA-graph capture)."""
    device = torch.cuda.current_device()
    for warps, nt in {block_for(n) for n in (512, 1 << 20)}:
        for mt in (4, 8):
            kernel_for("overlap")(mt, 4, device, warps, nt)


def profile() -> None:
    """``--profile``: eager calls for a profiler wrapped around the process, 3 of each: at 64 rows
    on 32B gate_up and 7B qkv the 256-row (x two steps ahead) and 64-row (x permuted) kernels,
    at 32 rows on 32B gate_up the 256-row one, then the dispatcher and bf16 on the same x. Session 8
    ran it as ``ncu --kernel-name-base function --section SpeedOfLight --section WarpStateStats
    --section Occupancy --section MemoryWorkloadAnalysis --section SchedulerStats --section
    LaunchStats python -m lab.proto_wgmma_gemm --profile`` (the dispatcher then had no wgmma path;
    it now sends 32B gate_up at 32 rows to the shipped kernel). What it did not show, and the next
    question (the kernel issues every 2.7 cycles with 2 warps per scheduler, but wgmma depth,
    occupancy and x staging each changed little): where the warps stall, by reason and by
    instruction, ``ncu -k regex:wgmma --section WarpStateStats --section SourceCounters --metrics
    regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio python ... --profile``."""
    from bench.bench_nvfp4_gemm import random_nvfp4

    from qerl_kit.kernels import nvfp4_linear

    torch.manual_seed(0)
    for n, k, m, configs in [(55296, 5120, 64, [(8, 2, 4, 2), (4, 1, 4, 0)]), (4608, 3584, 64, [(4, 1, 4, 0), (8, 2, 4, 2)]),
                             (55296, 5120, 32, [(8, 2, 4, 2)])]:
        w = random_nvfp4(n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for warps, nt, stages, xd in configs:
            for _ in range(3):
                nvfp4_gemm_wgmma(x, *w, stages=stages, warps=warps, nt=nt, xd=xd)
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            nvfp4_linear(x, *w)
            torch.nn.functional.linear(x, dense)
    torch.cuda.synchronize()


# ``--occupancy``: (warps, tiles, stages, x steps ahead, blocks per SM the registers are capped for).
# The measured shapes ran one 256-row block per SM at 64 x rows (164 registers): 2 warps per
# scheduler, 0.5 eligible, and 216 blocks of 72B gate_up in 1.64 waves (ncu, session 8).
OCCUPANCY = ((8, 2, 4, 1, 1), (8, 2, 4, 2, 1), (8, 2, 4, 1, 2), (8, 2, 4, 2, 2), (8, 2, 3, 0, 2), (4, 2, 4, 2, 3),
             (4, 1, 4, 2, 4), (4, 1, 2, 0, 4), (4, 1, 3, 0, 4))


def blocks_per_sm(mt: int, warps: int, nt: int, stages: int, xd: int, minb: int) -> int:
    """What fits per SM: ``minb`` (registers) or fewer where shared memory runs out first."""
    smem = base.shared_bytes(mt, stages, warps, nt, x_stages(xd, stages)) + 1024  # + the driver's reserve
    return max(1, min(minb, 228 * 1024 // smem))


def best_split(time_graph, x, weights, ips: int, kernel=None, **kw) -> tuple[float, int]:
    """(seconds, K steps per slice): the fastest of ``ips``'s K split and half and twice as many
    slices, ``kernel(**kw)`` (default ``nvfp4_gemm_wgmma``) over ``weights``; checked against the
    dispatcher."""
    from qerl_kit.kernels import nvfp4_linear

    kernel = kernel or nvfp4_gemm_wgmma
    steps = x.shape[1] // base.K_STEP
    slices = -(-steps // ips)
    tried = {}
    for sl in sorted({slices, max(1, slices // 2), min(steps, 2 * slices)}):
        i = -(-steps // sl)
        tried[i] = time_graph([lambda q=q, i=i: kernel(x, *q, ips=i, **kw) for q in weights])
    ref = nvfp4_linear(x, *weights[0]).float()
    err = ((kernel(x, *weights[0], **kw).float() - ref).norm() / ref.norm()).item()
    if err > 1e-2:
        print(f"FAIL {tuple(weights[0][0].shape)} M={x.shape[0]} {kw}: rel err {err:.1e}", flush=True)
    best = min(tried, key=tried.get)
    return tried[best], best


def weights_for(n: int, k: int):
    """Enough random NVFP4 and bf16 copies of an [n, k] layer that each timed call reads it from HBM."""
    from bench.bench_nvfp4_gemm import copies_for, random_nvfp4

    return ([random_nvfp4(n, k) for _ in range(copies_for(n * k // 2 + n * k // 16))],
            [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2))])


def layer_rows(shapes, ms=(32, 64)):
    """(n, k, m, x, weights, dense) for each layer shape and row count: one layer's copies at a
    time, released before the next layer's are made."""
    for n, k in shapes:
        weights, dense = weights_for(n, k)
        for m in ms:
            yield n, k, m, torch.randn(m, k, device="cuda", dtype=torch.bfloat16), weights, dense
        weights.clear()  # the caller's references are these lists: emptied, the copies are freed
        dense.clear()
        torch.cuda.empty_cache()


def baselines(time_graph, x, weights, dense) -> tuple[float, float]:
    """(dispatcher, bf16) seconds on the same x."""
    from qerl_kit.kernels import nvfp4_linear

    return (time_graph([lambda q=q: nvfp4_linear(x, *q) for q in weights]),
            time_graph([lambda d=d: torch.nn.functional.linear(x, d) for d in dense]))


def table(shapes, time_graph, sms: int, columns) -> None:
    """Per layer and M in {32, 64}: each of ``columns`` ((header, nvfp4_gemm_wgmma keywords,
    blocks per SM)) at the K split that fills that many blocks per SM once (``best_split``: and
    half and twice as many slices), against the dispatcher and bf16."""
    print("| N x K | M | " + " | ".join(h for h, _, _ in columns) + " | dispatch us | bf16 us | best x bf16 |")
    print("|---|---:|" + "---:|" * (len(columns) + 3))
    for n, k, m, x, weights, dense in layer_rows(shapes):
        cells, best = [], float("inf")
        for _, kw, per_sm in columns:
            rows = 16 * kw.get("nt", 2) * kw.get("warps", 8)
            ips = base.config(m, n, k, sms, rows, per_sm=per_sm(base.x_tiles(m)))[1]
            t, i = best_split(time_graph, x, weights, ips, **kw)
            best = min(best, t)
            cells.append(f"{t * 1e6:.1f} ({i})")
        t_disp, t_bf = baselines(time_graph, x, weights, dense)
        print(f"| {n} x {k} | {m} | " + " | ".join(cells) + f" | {t_disp * 1e6:.1f} | {t_bf * 1e6:.1f} | "
              f"{t_bf / best:.2f} |", flush=True)


def occupancy_columns():
    return [(f"{16 * w * nt}r s{s} x{xd} b{b}", dict(stages=s, warps=w, nt=nt, xd=xd, minb=b),
             lambda mt, w=w, nt=nt, s=s, xd=xd, b=b: blocks_per_sm(mt, w, nt, s, xd, b))
            for w, nt, s, xd, b in OCCUPANCY]


def depth_columns():
    # one block per SM, as the shipped kernel's choose_ips
    return [(v, dict(variant=v, warps=8, nt=2, xd=2), lambda mt: 1) for v in DEPTHS]


def main() -> None:
    """The check, then per layer and M in {32, 64}: the overlapped variant in each block shape
    (default K split), the mma.sync prototype, the dispatcher and bf16; ``--sweep`` adds K splits
    per block shape; ``--engine`` times the 7B engine with ``routed_linear`` at 17-64 rows and
    ``--profile`` runs the kernels for a profiler (neither runs the check); ``--occupancy`` times
    OCCUPANCY's register caps and depths and ``--depth`` the DEPTHS variants, each checked at the
    shape it is timed on."""
    if "--profile" in sys.argv:
        return profile()
    if "--engine" in sys.argv:
        return base.engine(linear=routed_linear, warm=warm_all)
    # Timings follow even after failures: a layout bug does not change the speed much.
    timed = "--occupancy" in sys.argv or "--depth" in sys.argv
    failures = 0 if timed else check()  # --occupancy and --depth check what they time
    if "--check" in sys.argv:
        sys.exit(1 if failures else 0)
    from bench.bench_nvfp4_gemm import time_graph

    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (55296, 5120), (8192, 29568)]
    if timed:
        return table(shapes, time_graph, sms,
                     occupancy_columns() if "--occupancy" in sys.argv else depth_columns())
    blocks = [(8, 2), (4, 2), (4, 1)]
    cols = [(w_, nt, xd) for w_, nt in blocks for xd in (0, 1, 2)]  # xd 0 includes permute_x's gather
    print("| N x K | M | " + " | ".join(f"{16 * nt * w_} rows x{xd} us (ips)" for w_, nt, xd in cols)
          + " | mma.sync us | dispatch us | bf16 us | best wgmma x bf16 | dispatch x bf16 |")
    print("|---|---:|" + "---:|" * (len(cols) + 5))
    for n, k, m, x, weights, dense in layer_rows(shapes):
        cells, best = [], float("inf")
        for w_, nt, xd in cols:
            ips = base.config(m, n, k, sms, 16 * nt * w_, per_sm=None if w_ == 8 else 2)[1]
            t = time_graph([lambda q=q, i=ips, a=w_, b=nt, d=xd: nvfp4_gemm_wgmma(x, *q, ips=i, warps=a, nt=b,
                                                                                 xd=d) for q in weights])
            best = min(best, t)
            cells.append(f"{t * 1e6:.1f} ({ips})")
            if "--sweep" in sys.argv:  # other K splits: 1, 2, 4, 8 slices
                steps = k // base.K_STEP
                for other in sorted({-(-steps // sl) for sl in (1, 2, 4, 8)} - {ips}):
                    t2 = time_graph([lambda q=q, i=other, a=w_, b=nt, d=xd: nvfp4_gemm_wgmma(
                        x, *q, ips=i, warps=a, nt=b, xd=d) for q in weights])
                    print(f"  sweep {n} x {k} M={m} {16 * nt * w_} rows x{xd} ips {other}: {t2 * 1e6:.1f} us",
                          flush=True)
                    best = min(best, t2)
        t_sync = time_graph([lambda q=q: base.nvfp4_gemm_cuda(x, *q, stages=2) for q in weights])
        t_disp, t_bf = baselines(time_graph, x, weights, dense)
        print(f"| {n} x {k} | {m} | " + " | ".join(cells) + f" | {t_sync * 1e6:.1f} | {t_disp * 1e6:.1f} | "
              f"{t_bf * 1e6:.1f} | {t_bf / best:.2f} | {t_bf / t_disp:.2f} |", flush=True)


if __name__ == "__main__":
    main()
