"""Prototype, measured and NOT wired in: an NVFP4 CUDA kernel (mma.sync) for 17..64 rows.

Why it was tried: at 64 rows the Triton kernels run at 0.44-1.1x bf16 and the 7B NVFP4 engine
decodes batch 64 at 0.86x the bf16 engine (docs/kernels.md, "In short"), while 8 prompts x 8
samples is exactly that batch. Written in session 6 without a GPU, run and revised in session 7
(2026-11-30): it is correct, but slower than the dispatcher except on the two largest layers at
17-32 rows; its time is per weight (dequantization and ldmatrix latency that 8-16 warps per SM
do not hide, pipeline depth made no difference), so it stays here as a measured negative result
(lab/results/proto_cuda_gemm_h200.md, which also says what a kernel that wins would need).

On a GPU: ``python -m lab.proto_cuda_gemm`` checks it against the reference and times it
against bf16 and the dispatcher at 1-64 rows; ``--sweep`` adds the other pipeline depths and K
splits at 32 and 64 rows; ``--check`` runs every compiled variant against the reference at small
shapes; ``--engine`` times the 7B NVFP4 engine at batch 24-64 with and without it.

Design (the CUDA decode kernel's MMA side, ``qerl_kit/kernels/nvfp4_decode_cuda.py``, with x
shared through shared memory instead of read per lane; the block pipeline is now
``qerl_kit/kernels/cuda_pipeline.py``, shared with the shipped wgmma kernel, and this file adds
the mma.sync layout):

* Block of 8 warps over 256 weight rows (each warp two 16-row tiles, lanes holding rows g and
  g + 8 as in the decode kernel); the product is transposed, ``y^T = W x^T``, with 4 or 8 tiles of
  8 x rows on the MMA's N side (``MT``: up to 32 or 64 rows). K steps of 128 codes.
* Weights: each warp copies its 32 rows' codes and scale bytes of a K step into its own
  shared-memory stage with ``cp.async``, STAGES - 1 steps ahead (2, 3, 4 or 6 stages compiled),
  then each lane reads its 16-byte run (32 codes of rows g and g + 8) and two scale bytes and
  dequantizes them exactly as the decode kernel does (the same K permutation: word i of a lane
  gives codes (0, 4), (1, 5) to one m16n8k16 step and (2, 6), (3, 7) to the next). The first
  version loaded them one step ahead into registers; it was as fast.
* x: every K step, the block stages x [8 * MT rows, 128] once into shared memory (two stages,
  one barrier per step), already permuted into that K order: chunk c = 2i + h holds, for each x
  row, the 16 logical k of MMA step (i, h); the 16-byte halves of a row are XOR-swizzled by
  bit 2 of the row so that both the staging stores and the ``ldmatrix`` reads are free of bank
  conflicts. One ``ldmatrix.x4`` gives the B fragments of two x tiles. The x traffic from L2 per
  K step is 8 * MT rows x 256 bytes against 256 rows x 64 bytes of weights, equal at 64 rows.
* Split K: float32 partials, the last block of a tile sums them in slice order, 4 columns per
  load and 8 loads in flight per thread (``store_tile``; the decode kernel's ``store_y`` reads one
  float at a time, which made the first version's epilogue half its time at 32 rows). One
  launch, CUDA-graph safe with counters allocated once.
"""

from __future__ import annotations

import functools
import sys

import torch

from lab import cuda_pipeline as cp
from qerl_kit.kernels import nvrtc
from lab.cuda_pipeline import K_STEP, shared_bytes, warp_stage, with_shared_memory, x_tiles  # noqa: F401

ROWS_PER_BLOCK = 256

# The block pipeline (stages, loads, split-K epilogue) is the shipped wgmma kernel's, generic over
# the layout; this file adds the mma.sync layout.
SOURCE = cp.PIPELINE + r"""
// -- The mma.sync layout (the kernels measured in lab/results/proto_cuda_gemm_h200.md) --
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Word index in a stage of the permuted x: chunk c (MMA step 2i + h), x row m, logical k (even).
template <int MT>
__device__ __forceinline__ int xword(int c, int m, int k) {
    return (c * 8 * MT + m) * 8 + ((((k >> 3) ^ (m >> 2)) & 1) << 2) + ((k & 7) >> 1);
}

template <int MT, int NT, int T> struct MmaSync {
    static __device__ __forceinline__ void finish(float (&)[NT][MT][4]) {}  // mma.sync is synchronous

    static __device__ __forceinline__ void store_x(const uint4 (&xs)[128 * MT / T], u32* stage) {
        #pragma unroll
        for (int j = 0; j < 128 * MT / T; j++) {
            const int u = threadIdx.x + T * j;
            const int t = u & 3, m = ((u >> 7) << 3) | ((u >> 2) & 7), i = (u >> 5) & 3;
            const uint4 v = xs[j];
            stage[xword<MT>(2 * i, m, 2 * t)] = __byte_perm(v.x, v.z, 0x5410);          // x0, x4
            stage[xword<MT>(2 * i, m, 2 * t + 8)] = __byte_perm(v.x, v.z, 0x7632);      // x1, x5
            stage[xword<MT>(2 * i + 1, m, 2 * t)] = __byte_perm(v.y, v.w, 0x5410);      // x2, x6
            stage[xword<MT>(2 * i + 1, m, 2 * t + 8)] = __byte_perm(v.y, v.w, 0x7632);  // x3, x7
        }
    }

    static __device__ __forceinline__ void compute(const unsigned char* wst, float (&c)[NT][MT][4],
                                                   u32 stage_addr, int lane, int g, int t) {
        uint4 qw[NT][2];
        u32 s[NT][2][2];  // tile, row (g, g + 8), words 0-1 / 2-3
        load_fragments<NT>(wst, g, t, qw, s);
        const int lm = lane & 7, lq = lane >> 3;  // ldmatrix: this lane's row within matrix lq
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            #pragma unroll
            for (int h = 0; h < 2; h++) {
                u32 b[MT][2];
                #pragma unroll
                for (int mp = 0; mp < MT / 2; mp++) {  // matrices (tile 2mp, k 0-7), (2mp, 8-15), (2mp+1, ..)
                    const int m = 8 * (2 * mp + (lq >> 1)) + lm;
                    u32 r4[4];
                    ldmatrix_x4(r4, stage_addr + 4 * xword<MT>(2 * i + h, m, 8 * (lq & 1)));
                    b[2 * mp][0] = r4[0]; b[2 * mp][1] = r4[1]; b[2 * mp + 1][0] = r4[2]; b[2 * mp + 1][1] = r4[3];
                }
                #pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const uint4 qg = qw[nt][0], qh = qw[nt][1];
                    const u32 wg = i == 0 ? qg.x : i == 1 ? qg.y : i == 2 ? qg.z : qg.w;
                    const u32 wh = i == 0 ? qh.x : i == 1 ? qh.y : i == 2 ? qh.z : qh.w;
                    const u32 s0 = s[nt][0][i >> 1], s1 = s[nt][1][i >> 1];
                    const u32 a0 = dq(wg, 2 * h, s0), a1 = dq(wh, 2 * h, s1);
                    const u32 a2 = dq(wg, 2 * h + 1, s0), a3 = dq(wh, 2 * h + 1, s1);
                    #pragma unroll
                    for (int mt = 0; mt < MT; mt++) mma(c[nt][mt], a0, a1, a2, a3, b[mt][0], b[mt][1]);
                }
            }
        }
    }
};

#define KERNEL(MT, S, MINB) extern "C" __global__ void __launch_bounds__(256, MINB) \
    nvfp4_gemm_m##MT##_s##S(ARGS) { gemm<MmaSync, MT / 8, S, 8, 2>(CALL); }
KERNEL(32, 2, 2) KERNEL(32, 3, 2) KERNEL(32, 4, 2)
KERNEL(64, 2, 1) KERNEL(64, 3, 1) KERNEL(64, 4, 1) KERNEL(64, 6, 1)
"""


STAGES = (2, 3, 4, 6)  # weight pipeline depths compiled (6 only for 64 rows)


def config(m: int, n: int, k: int, sms: int = 132, rows: int = ROWS_PER_BLOCK, per_sm: int | None = None):
    """(x tiles MT, K steps per slice) for blocks of ``rows`` weight rows: MT = 4 runs two blocks
    of 256 rows per SM, MT = 8 one, so K is split until the grid covers the GPU about once."""
    mt = x_tiles(m)
    steps = k // K_STEP
    blocks_n = -(-n // rows)
    per_sm = per_sm or (2 if mt == 4 else 1)
    slices = max(1, min(steps, (per_sm * sms) // blocks_n))
    return mt, -(-steps // slices)


@functools.lru_cache(maxsize=None)  # compiled and allowed its shared memory once, not per launch
def kernel_for(mt: int, stages: int, device: int, warps: int = 8, nt: int = 2):
    if (warps, nt) != (8, 2):
        raise ValueError("the mma.sync kernels are compiled for blocks of 8 warps x 2 tiles only")
    return with_shared_memory(nvrtc.compile_kernel(SOURCE, f"nvfp4_gemm_m{8 * mt}_s{stages}", device), mt, stages)


def nvfp4_gemm_cuda(x, packed, scales, global_scale, bias=None, ips=None, stages=4, kernel_for=kernel_for,
                    warps=8, nt=2, x_stages=2, x_arg=None):
    """y = x @ W^T (+ bias) for x [17..64, K] bf16 on the GPU (any 1..64 rows work), in blocks of
    ``warps`` warps x ``nt`` 16-row tiles; ``kernel_for(mt, stages, device, warps, nt)`` gives the
    compiled kernel (another layout's, for lab/proto_wgmma_gemm.py); ``x_arg`` is what the kernel
    reads as x (by default x itself) and ``x_stages`` how many x stages its shared memory holds."""
    m, n, k = x.shape[0], packed.shape[0], packed.shape[1] * 2
    aligned = (x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 and packed.stride(1) == 1
               and packed.stride(0) % 16 == 0 and packed.data_ptr() % 16 == 0 and scales.stride(1) == 1
               and scales.stride(0) % 8 == 0 and scales.data_ptr() % 8 == 0)
    if not (x.is_cuda and x.dtype == torch.bfloat16 and 1 <= m <= 64 and k % K_STEP == 0 and n % 16 == 0
            and aligned):
        raise ValueError(f"proto_cuda_gemm: needs bf16 CUDA x with 1..64 rows, K % 128 == 0, N % 16 == 0 and "
                         f"16-byte aligned rows; got x {tuple(x.shape)} {x.dtype}, weight {tuple(packed.shape)}")
    mt, auto_ips = config(m, n, k, torch.cuda.get_device_properties(x.device).multi_processor_count, 16 * nt * warps)
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return cp.launch(kernel_for(mt, stages, device, warps, nt), x, packed, scales, global_scale, bias,
                     ips or auto_ips, mt, stages, warps, nt, x_stages, x_arg)


def engine(model_name: str = "Qwen2.5-7B", batches=(24, 32, 64), new: int = 128, linear=None, warm=None) -> None:
    """The 7B NVFP4 engine (fused decode step, CUDA graphs, LoRA r 32) with its 17..64-row
    projections on the dispatcher and then on ``linear`` (this file's kernel by default), in one
    run (``--engine``); ``warm()`` compiles what ``linear`` launches before any graph capture."""
    from bench import bench_rollout as br

    from qerl_kit import kernels

    original = kernels.nvfp4_linear
    linear = linear or nvfp4_gemm_cuda

    def routed(x, packed, scales, global_scale, bias=None, backend=None):
        if x.dim() == 2 and 17 <= x.shape[0] <= 64 and x.is_cuda and packed.shape[1] * 2 % K_STEP == 0:
            return linear(x, packed, scales, global_scale, bias)
        return original(x, packed, scales, global_scale, bias, backend)

    if warm is not None:
        warm()
    else:
        for mt in (4, 8):
            kernel_for(mt, 4, torch.cuda.current_device())
    model = br.with_lora(br.build(model_name, "nvfp4", "cuda"), 32)
    print(f"| {model_name} batch | dispatcher ms/step | this kernel ms/step |")
    print("|---:|---:|---:|")
    try:
        for batch in batches:
            prompts = br.random_prompts(batch, 256, 152064)
            ms = []
            for fn in (original, routed):
                kernels.nvfp4_linear = fn  # the fused step looks it up at every call
                ms.append(br.engine_run(model, prompts, new)["ms_per_step"])
            print(f"| {batch} | {ms[0]:.2f} | {ms[1]:.2f} |", flush=True)
    finally:
        kernels.nvfp4_linear = original


def check() -> int:
    """``--check``: every compiled pipeline depth against the reference at small shapes (partial
    256-row tiles, 1..16 K steps, K splits of 1, 3 and all steps, with bias), and a second call
    bit-identical to the first. Returns the number of failures."""
    from bench.bench_nvfp4_gemm import random_nvfp4

    from qerl_kit.kernels.reference import nvfp4_linear_ref

    torch.manual_seed(1)
    bad = 0
    for n, k in [(256, 128), (512, 256), (272, 1024), (1040, 2048)]:
        w = random_nvfp4(n, k)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for m in (1, 5, 17, 32, 33, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = nvfp4_linear_ref(x.float(), *w, bias.float())
            for stages in STAGES if m > 32 else STAGES[:3]:
                for ips in (None, 1, 3, k // K_STEP):
                    got = nvfp4_gemm_cuda(x, *w, bias, ips=ips, stages=stages)
                    err = ((got.float() - ref).norm() / ref.norm()).item()
                    same = torch.equal(got, nvfp4_gemm_cuda(x, *w, bias, ips=ips, stages=stages))
                    if err > 1e-2 or not same:
                        bad += 1
                        print(f"FAIL N={n} K={k} M={m} stages={stages} ips={ips}: rel err {err:.1e}, "
                              f"repeatable {same}", flush=True)
    print(f"check: {bad} failures", flush=True)
    return bad


def main() -> None:
    if "--engine" in sys.argv:
        return engine()
    if "--check" in sys.argv:
        sys.exit(1 if check() else 0)
    from bench.bench_nvfp4_gemm import copies_for, random_nvfp4, time_graph

    from qerl_kit.kernels import nvfp4_linear
    from qerl_kit.kernels.reference import nvfp4_linear_ref

    sweep = "--sweep" in sys.argv
    torch.manual_seed(0)
    shapes = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (55296, 5120), (8192, 29568)]
    print("| N x K | M | ips | rel err | cuda us | dispatch us | bf16 us | cuda x bf16 | dispatch x bf16 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, k in shapes:
        q_bytes = n * k // 2 + n * k // 16
        weights = [random_nvfp4(n, k) for _ in range(copies_for(q_bytes))]
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2))]
        for m in (1, 17, 32, 48, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = nvfp4_linear_ref(x.float(), *weights[0])
            got = nvfp4_gemm_cuda(x, *weights[0]).float()
            err = ((got - ref).norm() / ref.norm()).item()
            t_cuda = time_graph([lambda w=w: nvfp4_gemm_cuda(x, *w) for w in weights])
            t_disp = time_graph([lambda w=w: nvfp4_linear(x, *w) for w in weights])
            t_bf = time_graph([lambda d=d: torch.nn.functional.linear(x, d) for d in dense])
            mt, ips = config(m, n, k)
            print(f"| {n} x {k} | {m} | {ips} | {err:.1e} | {t_cuda * 1e6:.1f} | {t_disp * 1e6:.1f} | "
                  f"{t_bf * 1e6:.1f} | {t_bf / t_cuda:.2f} | {t_bf / t_disp:.2f} |", flush=True)
            if sweep and m in (32, 64):  # other pipeline depths and K splits (slices of 1..16)
                steps = k // K_STEP
                for stages in STAGES if mt == 8 else STAGES[:3]:
                    for other in sorted({-(-steps // sl) for sl in (1, 2, 3, 4, 6, 8, 12, 16)} | {ips}):
                        if (stages, other) == (4, ips):
                            continue
                        t = time_graph([lambda w=w: nvfp4_gemm_cuda(x, *w, ips=other, stages=stages)
                                        for w in weights])
                        print(f"| {n} x {k} | {m} | {other} s{stages} | | {t * 1e6:.1f} | | | {t_bf / t:.2f} | |",
                              flush=True)
        del weights, dense
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
