"""Prototype, measured and NOT wired in: an NVFP4 CUDA kernel (mma.sync) for 17..64 rows.

Why it was tried: at 64 rows the Triton kernels run at 0.44-1.1x bf16 and the 7B NVFP4 engine
decodes batch 64 at 0.86x the bf16 engine (docs/kernels.md, "In short"), while 8 prompts x 8
samples is exactly that batch. Written in session 6 without a GPU, run and revised in session 7
(2026-11-30): it is correct, but slower than the dispatcher except on the two largest layers at
17-32 rows; its time is per weight (dequantization and ldmatrix latency that 8-16 warps per SM
do not hide, pipeline depth made no difference), so it stays here as a measured negative result
(bench/results/proto_cuda_gemm_h200.md, which also says what a kernel that wins would need).

On a GPU: ``python bench/proto_cuda_gemm.py`` checks it against the reference and times it
against bf16 and the dispatcher at 1-64 rows; ``--sweep`` adds the other pipeline depths and K
splits at 32 and 64 rows; ``--check`` runs every compiled variant against the reference at small
shapes; ``--engine`` times the 7B NVFP4 engine at batch 24-64 with and without it.

Design (the CUDA decode kernel's MMA side, ``qerl_kit/kernels/nvfp4_decode_cuda.py``, with x
shared through shared memory instead of read per lane):

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
from pathlib import Path

import torch

from qerl_kit.kernels import nvfp4_decode_cuda as dec
from qerl_kit.kernels import nvrtc

K_STEP = 128
ROWS_PER_BLOCK = 256

# The decode kernel's device helpers (bit placement, scale conversion, loads, mma, the split-K
# epilogue store_y, the ARGS/CALL parameter lists), reused as is.
_HELPERS = dec.SOURCE[:dec.SOURCE.index("// One K step's weights")]

SOURCE = _HELPERS + r"""
// Blocks of W warps (W = 8: 256 threads; W = 4: one warpgroup), each warp NT 16-row tiles of the
// weight: 16 NT W rows per block. Weights go through shared memory with cp.async, STAGES - 1 K
// steps ahead, each warp its own 16 NT rows (no block barrier for them): a warp's stage is
// 16 NT rows x 64 code bytes, then 16 NT rows x 8 scale bytes. Local row 16 nt + 8 r + g is the
// lane's row g (r = 0) or g + 8 (r = 1) of tile nt.
template <int NT> __host__ __device__ constexpr int warp_stage() { return 16 * NT * (64 + 8); }

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async8(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" :: "r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int PENDING> __device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(PENDING));
}

// This warp's rows row0 .. row0 + 16 NT - 1 of K step `it` into its stage at shared address
// `dst`; rows past N are zero-filled (source size 0).
template <int NT>
__device__ __forceinline__ void load_w(u32 dst, const unsigned char* q, int ldq, const unsigned char* sc, int lds,
                                       int row0, int N, int it, int lane) {
    #pragma unroll
    for (int j = 0; j < 2 * NT; j++) {
        const int c = lane + 32 * j, r = c >> 2, p = c & 3, n = row0 + r;
        cp_async16(dst + r * 64 + 16 * p, q + (size_t)(n < N ? n : 0) * ldq + it * 64 + 16 * p, n < N ? 16 : 0);
    }
    const int n = row0 + lane;
    if (NT == 2 || lane < 16 * NT)
        cp_async8(dst + 16 * NT * 64 + lane * 8, sc + (size_t)(n < N ? n : 0) * lds + it * 8, n < N ? 8 : 0);
}

// A lane's weights of one K step from its warp's stage: the 16 code bytes of rows g and g + 8 of
// each tile and their two scales as bf16x2 pairs (words 0-1, 2-3).
template <int NT>
__device__ __forceinline__ void load_fragments(const unsigned char* wst, int g, int t, uint4 (&qw)[NT][2],
                                               u32 (&s)[NT][2][2]) {
    #pragma unroll
    for (int nt = 0; nt < NT; nt++)
        #pragma unroll
        for (int r = 0; r < 2; r++) {
            const int lr = 16 * nt + 8 * r + g;
            qw[nt][r] = *reinterpret_cast<const uint4*>(wst + lr * 64 + 16 * t);
            const u32 sb = *reinterpret_cast<const u16*>(wst + 16 * NT * 64 + lr * 8 + 2 * t);
            s[nt][r][0] = scale_bf16x2(sb);
            s[nt][r][1] = scale_bf16x2(sb >> 8);
        }
}

// This thread's share of x for K step `it`: 16-byte runs u = tid + T j of the [8 MT, 128] tile
// (T threads, XR = 128 MT / T runs each), run u = (row m, word i, lane t) with t fastest, then 8
// rows, then i, then the next 8 rows.
template <int MT, int T, int XR = 128 * MT / T>
__device__ __forceinline__ void load_x(uint4 (&xs)[XR], const u16* x, int M, int ldx, int it) {
    #pragma unroll
    for (int j = 0; j < XR; j++) {
        const int u = threadIdx.x + T * j;
        const int t = u & 3, m = ((u >> 7) << 3) | ((u >> 2) & 7), i = (u >> 5) & 3;
        const int mr = m < M ? m : M - 1;  // rows past M fill MMA columns that are never written
        xs[j] = __ldg(reinterpret_cast<const uint4*>(x + (size_t)mr * ldx + it * 128 + 32 * t + 8 * i));
    }
}

// Step `it` of x already permuted into the stage layout (2048 MT bytes per step) into the stage at
// shared address `dst`, 16 bytes per copy.
template <int MT, int T>
__device__ __forceinline__ void load_x_async(u32 dst, const u16* xp, int it) {
    const unsigned char* src = reinterpret_cast<const unsigned char*>(xp) + (size_t)it * 2048 * MT;
    #pragma unroll
    for (int j = 0; j < 128 * MT / T; j++) {
        const int c = threadIdx.x + T * j;
        cp_async16(dst + 16 * c, src + 16 * c, 16);
    }
}

// The split-K epilogue for ROWS-row tiles at up to 64 rows: float32 partials, then the last block
// of a tile sums them in slice order, 4 columns per load and 8 loads in flight per thread (the
// decode kernel's store_y reads one float at a time, which is fine for its <= 16 rows and 64-128
// columns and far too slow for 64 rows x 256).
template <int MT, int NT, int T, int ROWS>
__device__ __forceinline__ void store_tile(const float (&c)[NT][MT][4], int row, int t, int tile0, int M, int N,
                                           const float* __restrict__ gsp, const u16* __restrict__ bias,
                                           int has_bias, u16* __restrict__ y, int ldy, float* __restrict__ ws,
                                           int* __restrict__ counters) {
    if (gridDim.y == 1) {
        store_y<NT, MT>(c, row, t, tile0, ROWS, M, N, gsp, bias, has_bias, y, ldy, ws, counters);
        return;
    }
    if (!arrive_last<NT, MT>(c, row, t, M, N, ws, counters)) return;
    const int w4 = min(ROWS, N - tile0) >> 2, groups = M * w4;  // N % 16 == 0: whole groups of 4
    const float gs = 1073741824.0f / gsp[0];
    for (int e0 = threadIdx.x; e0 < groups; e0 += 8 * T) {
        float4 v[8];
        #pragma unroll
        for (int j = 0; j < 8; j++) v[j] = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s = 0; s < (int)gridDim.y; s++) {
            #pragma unroll
            for (int j = 0; j < 8; j++) {
                const int e = e0 + j * T;
                if (e < groups) {
                    const int m = e / w4, n = tile0 + 4 * (e % w4);
                    const float4 p = __ldcg(reinterpret_cast<const float4*>(ws + ((size_t)s * M + m) * N + n));
                    v[j].x += p.x; v[j].y += p.y; v[j].z += p.z; v[j].w += p.w;
                }
            }
        }
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            const int e = e0 + j * T;
            if (e < groups) {
                const int m = e / w4, n = tile0 + 4 * (e % w4);
                float o[4] = {v[j].x * gs, v[j].y * gs, v[j].z * gs, v[j].w * gs};
                u16 h[4];
                #pragma unroll
                for (int i = 0; i < 4; i++) {
                    if (has_bias) o[i] += __uint_as_float((u32)bias[n + i] << 16);
                    h[i] = to_bf16(o[i]);
                }
                *reinterpret_cast<uint2*>(y + (size_t)m * ldy + n) =
                    make_uint2(h[0] | ((u32)h[1] << 16), h[2] | ((u32)h[3] << 16));
            }
        }
    }
}

// y[M, N] = x[M, K] @ W^T (+ bias), M <= 8 * MT; grid (ceil(N / ROWS), K slices of `ips` steps).
// Shared memory: two x stages, then STAGES weight stages of W warps. L<MT, NT, T> is the x layout
// and the MMA: store_x (a thread's share of one K step of x into a stage) and compute (one step).
template <template <int, int, int> class L, int MT, int STAGES, int W, int NT, int XD = 1>
__device__ __forceinline__ void gemm(ARGS) {
    constexpr int T = 32 * W, ROWS = 16 * NT * W, WS = warp_stage<NT>(), XR = 128 * MT / T;
    extern __shared__ uint4 smem[];
    u32* stages = reinterpret_cast<u32*>(smem);
    const int stage_words = 8 * 8 * MT * 8;  // 8 chunks x 8 MT rows x 32 bytes
    const u32 smem_addr = (u32)__cvta_generic_to_shared(stages);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int steps = K / 128;
    const int it0 = blockIdx.y * ips, it1 = min(steps, it0 + ips);
    const int tile0 = blockIdx.x * ROWS;
    const int row0 = tile0 + warp * 16 * NT, row = row0 + g;
    constexpr int XS = XD == 0 ? STAGES : 2;  // x stages: a ring like the weights' when copied by cp.async
    const int wbytes = XS * stage_words * 4 + warp * WS;  // this warp's stage 0
    const unsigned char* wsmem = reinterpret_cast<const unsigned char*>(smem) + wbytes;
    const u32 waddr = smem_addr + wbytes;

    float c[NT][MT][4];
    #pragma unroll
    for (int nt = 0; nt < NT; nt++)
        #pragma unroll
        for (int mt = 0; mt < MT; mt++) c[nt][mt][0] = c[nt][mt][1] = c[nt][mt][2] = c[nt][mt][3] = 0.f;

    #pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (it0 + s < it1) {
            load_w<NT>(waddr + s * W * WS, q, ldq, sc, lds, row0, N, it0 + s, lane);
            if constexpr (XD == 0) load_x_async<MT, T>(smem_addr + s * stage_words * 4, x, it0 + s);
        }
        cp_commit();
    }
    if constexpr (XD == 0) {  // x already in stage layout (permuted once per call): cp.async with the weights
        int ws_ = 0;  // weight and x stage of step it
        for (int it = it0; it < it1; it++) {
            cp_wait<STAGES - 2>();  // this thread's copies of step it have landed
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // ... for wgmma's reads too
            __syncthreads();  // everyone's copies of step it are in; everyone is done with step it - 1
            const int next = ws_ == 0 ? STAGES - 1 : ws_ - 1;  // the stages step it - 1 used
            if (it + STAGES - 1 < it1) {
                load_w<NT>(waddr + next * W * WS, q, ldq, sc, lds, row0, N, it + STAGES - 1, lane);
                load_x_async<MT, T>(smem_addr + next * stage_words * 4, x, it + STAGES - 1);
            }
            cp_commit();
            L<MT, NT, T>::compute(wsmem + ws_ * W * WS, c, smem_addr + 4 * ws_ * stage_words, lane, g, t);
            ws_ = ws_ == STAGES - 1 ? 0 : ws_ + 1;
        }
    } else if constexpr (XD == 1) {  // x loaded one K step ahead (the measured kernels)
        uint4 xs[XR];
        load_x<MT, T>(xs, x, M, ldx, it0);
        L<MT, NT, T>::store_x(xs, stages);
        __syncthreads();
        int ws_ = 0;  // weight stage of step it
        for (int it = it0; it < it1; it++) {
            const int xs_ = (it - it0) & 1;
            const bool more = it + 1 < it1;
            cp_wait<STAGES - 2>();  // step it's weights have landed
            __syncwarp();
            const int next = ws_ == 0 ? STAGES - 1 : ws_ - 1;  // the stage step it - 1 used
            if (it + STAGES - 1 < it1)
                load_w<NT>(waddr + next * W * WS, q, ldq, sc, lds, row0, N, it + STAGES - 1, lane);
            cp_commit();
            if (more) load_x<MT, T>(xs, x, M, ldx, it + 1);
            L<MT, NT, T>::compute(wsmem + ws_ * W * WS, c, smem_addr + 4 * xs_ * stage_words, lane, g, t);
            if (more) L<MT, NT, T>::store_x(xs, stages + (xs_ ^ 1) * stage_words);
            __syncthreads();
            ws_ = ws_ == STAGES - 1 ? 0 : ws_ + 1;
        }
    } else {  // x loaded two K steps ahead: two register sets, the loop unrolled by two
        uint4 xa[XR], xb[XR];
        load_x<MT, T>(xa, x, M, ldx, it0);
        L<MT, NT, T>::store_x(xa, stages);
        if (it0 + 1 < it1) load_x<MT, T>(xa, x, M, ldx, it0 + 1);
        if (it0 + 2 < it1) load_x<MT, T>(xb, x, M, ldx, it0 + 2);
        __syncthreads();
        int ws_ = 0;  // weight stage of step it
        // Step it with buf holding x of step it + 1: computes, stages that x, reloads buf with it + 3.
        auto step = [&](int it, uint4 (&buf)[XR]) {
            const int xs_ = (it - it0) & 1;
            cp_wait<STAGES - 2>();
            __syncwarp();
            const int next = ws_ == 0 ? STAGES - 1 : ws_ - 1;
            if (it + STAGES - 1 < it1)
                load_w<NT>(waddr + next * W * WS, q, ldq, sc, lds, row0, N, it + STAGES - 1, lane);
            cp_commit();
            L<MT, NT, T>::compute(wsmem + ws_ * W * WS, c, smem_addr + 4 * xs_ * stage_words, lane, g, t);
            if (it + 1 < it1) {
                L<MT, NT, T>::store_x(buf, stages + (xs_ ^ 1) * stage_words);
                if (it + 3 < it1) load_x<MT, T>(buf, x, M, ldx, it + 3);
            }
            __syncthreads();
            ws_ = ws_ == STAGES - 1 ? 0 : ws_ + 1;
        };
        for (int it = it0; it < it1; it += 2) {
            step(it, xa);
            if (it + 1 < it1) step(it + 1, xb);
        }
    }

    store_tile<MT, NT, T, ROWS>(c, row, t, tile0, M, N, gsp, bias, has_bias, y, ldy, ws, counters);
}

// -- The mma.sync layout (the kernels measured in bench/results/proto_cuda_gemm_h200.md) --
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


def warp_stage(nt: int = 2) -> int:
    """Bytes of one warp's weights of one K step in shared memory (codes, then scales)."""
    return 16 * nt * (64 + 8)


def x_tiles(m: int) -> int:
    """MT, the 8-row x tiles a kernel is compiled for: 4 up to 32 rows, else 8."""
    return 4 if m <= 32 else 8


def config(m: int, n: int, k: int, sms: int = 132, rows: int = ROWS_PER_BLOCK, per_sm: int | None = None):
    """(x tiles MT, K steps per slice) for blocks of ``rows`` weight rows: MT = 4 runs two blocks
    of 256 rows per SM, MT = 8 one, so K is split until the grid covers the GPU about once."""
    mt = x_tiles(m)
    steps = k // K_STEP
    blocks_n = -(-n // rows)
    per_sm = per_sm or (2 if mt == 4 else 1)
    slices = max(1, min(steps, (per_sm * sms) // blocks_n))
    return mt, -(-steps // slices)


def shared_bytes(mt: int, stages: int = 4, warps: int = 8, nt: int = 2, x_stages: int = 2) -> int:
    return x_stages * 8 * (8 * mt) * 32 + stages * warps * warp_stage(nt)


@functools.lru_cache(maxsize=None)  # compiled and allowed its shared memory once, not per launch
def kernel_for(mt: int, stages: int, device: int, warps: int = 8, nt: int = 2):
    if (warps, nt) != (8, 2):
        raise ValueError("the mma.sync kernels are compiled for blocks of 8 warps x 2 tiles only")
    return with_shared_memory(nvrtc.compile_kernel(SOURCE, f"nvfp4_gemm_m{8 * mt}_s{stages}", device), mt, stages)


def with_shared_memory(kernel, mt: int, stages: int, warps: int = 8, nt: int = 2, x_stages: int = 2):
    """``kernel`` allowed the dynamic shared memory of its shape (an opt-in from 48 KB on)."""
    if shared_bytes(mt, stages, warps, nt, x_stages) >= 48 * 1024:
        kernel.set_shared_memory_config(shared_bytes(mt, stages, warps, nt, x_stages))
    return kernel


def nvfp4_gemm_cuda(x, packed, scales, global_scale, bias=None, ips=None, stages=4, kernel_for=kernel_for,
                    warps=8, nt=2, x_stages=2, x_arg=None):
    """y = x @ W^T (+ bias) for x [17..64, K] bf16 on the GPU (any 1..64 rows work), in blocks of
    ``warps`` warps x ``nt`` 16-row tiles; ``kernel_for(mt, stages, device, warps, nt)`` gives the
    compiled kernel (another layout's, for bench/proto_wgmma_gemm.py); ``x_arg`` is what the kernel
    reads as x (by default x itself) and ``x_stages`` how many x stages its shared memory holds."""
    from qerl_kit.kernels.nvfp4_gemv_triton import _counters

    m, n, k = x.shape[0], packed.shape[0], packed.shape[1] * 2
    aligned = (x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 and packed.stride(1) == 1
               and packed.stride(0) % 16 == 0 and packed.data_ptr() % 16 == 0 and scales.stride(1) == 1
               and scales.stride(0) % 8 == 0 and scales.data_ptr() % 8 == 0)
    if not (x.is_cuda and x.dtype == torch.bfloat16 and 1 <= m <= 64 and k % K_STEP == 0 and n % 16 == 0
            and aligned):
        raise ValueError(f"proto_cuda_gemm: needs bf16 CUDA x with 1..64 rows, K % 128 == 0, N % 16 == 0 and "
                         f"16-byte aligned rows; got x {tuple(x.shape)} {x.dtype}, weight {tuple(packed.shape)}")
    rows = 16 * nt * warps
    mt, auto_ips = config(m, n, k, torch.cuda.get_device_properties(x.device).multi_processor_count, rows)
    ips = ips or auto_ips
    slices = -(-(k // K_STEP) // ips)
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    ws = torch.empty(slices * m * n if slices > 1 else 1, dtype=torch.float32, device=x.device)
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    kernel = kernel_for(mt, stages, device, warps, nt)
    kernel(grid=(-(-n // rows), slices, 1), block=(32 * warps, 1, 1),
           shared_mem=shared_bytes(mt, stages, warps, nt, x_stages),
           args=[x if x_arg is None else x_arg, m, x.stride(0), packed, packed.stride(0),
                 scales.view(torch.uint8), scales.stride(0),
                 global_scale, bias if bias is not None else y, int(bias is not None), y, y.stride(0), ws,
                 _counters(x.device), n, k, ips],
           stream=torch.cuda.current_stream(x.device))
    return y


def engine(model_name: str = "Qwen2.5-7B", batches=(24, 32, 64), new: int = 128, linear=None, warm=None) -> None:
    """The 7B NVFP4 engine (fused decode step, CUDA graphs, LoRA r 32) with its 17..64-row
    projections on the dispatcher and then on ``linear`` (this file's kernel by default), in one
    run (``--engine``); ``warm()`` compiles what ``linear`` launches before any graph capture."""
    import bench_rollout as br

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
    from bench_nvfp4_gemm import random_nvfp4

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
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if "--engine" in sys.argv:
        return engine()
    if "--check" in sys.argv:
        sys.exit(1 if check() else 0)
    from bench_nvfp4_gemm import copies_for, random_nvfp4, time_graph

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
