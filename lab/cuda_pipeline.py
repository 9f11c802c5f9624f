"""The block pipeline the NVFP4 CUDA kernels for 17..64 rows share: stages, loads, split-K epilogue.

``PIPELINE`` is CUDA C: the decode kernel's device helpers (``nvfp4_decode_cuda``: code and scale
bit placement, ``dq``, the split-K arrival) followed by one block's K loop, generic over an MMA
layout ``L<MT, NT, T>`` that supplies ``store_x`` (a thread's share of one K step of x into a
shared-memory stage), ``compute`` (one K step's dequantization and MMAs) and ``finish`` (waits
for any MMAs it left in flight, before the epilogue):

* Blocks of W warps, each warp NT 16-row tiles of the weight. Weights go through per-warp
  shared-memory stages with ``cp.async``, STAGES - 1 K steps (of 128 codes) ahead, no block
  barrier for them; each lane then reads its 16-byte run and two scale bytes (``load_fragments``).
* x (up to 8 MT rows): loaded one (``XD`` 1) or two (``XD`` 2) K steps ahead into registers and
  stored once per step and block, or (``XD`` 0) already permuted into the stage layout and copied
  with the weights by ``cp.async``.
* Split K over grid.y: float32 partials, the last block of a tile sums them in slice order, 4
  columns per load and 8 loads in flight (``store_tile``).

``nvfp4_wgmma_cuda`` ships the wgmma layout in its own warp-specialized block (a producer
warpgroup and mbarriers instead of this loop, the same loads, fragments and epilogue);
``bench/proto_cuda_gemm.py`` (mma.sync) and ``bench/proto_wgmma_gemm.py`` (the single-role wgmma
kernel that shipped in session 8, and other shapes) are measured prototypes on this loop.
``launch`` runs any of them.
"""

from __future__ import annotations

import torch

from qerl_kit.kernels import nvfp4_decode_cuda as dec

K_STEP = 128  # codes per row per K step
WARPS, TILES = 8, 2  # the default block: 8 warps x two 16-row tiles = 256 weight rows
STAGES = 4  # the default weight pipeline depth (3 K steps in flight)

# The decode kernel's device helpers (bit placement, scale conversion, dq, the split-K arrival
# arrive_last and store_y, the ARGS/CALL parameter lists), reused as is.
_HELPERS = dec.SOURCE[:dec.SOURCE.index("// One K step's weights")]

PIPELINE = _HELPERS + r"""
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

    L<MT, NT, T>::finish(c);  // MMAs the layout leaves in flight past its last K step (none by default)
    store_tile<MT, NT, T, ROWS>(c, row, t, tile0, M, N, gsp, bias, has_bias, y, ldy, ws, counters);
}

"""


def x_tiles(m: int) -> int:
    """MT, the 8-row x tiles a kernel is compiled for: 4 up to 32 rows, else 8."""
    return 4 if m <= 32 else 8


def warp_stage(nt: int = TILES) -> int:
    """Bytes of one warp's weights of one K step in shared memory (codes, then scales)."""
    return 16 * nt * (64 + 8)


def shared_bytes(mt: int, stages: int = STAGES, warps: int = WARPS, nt: int = TILES, x_stages: int = 2) -> int:
    """Dynamic shared memory of a block: ``x_stages`` x stages, then ``stages`` weight stages."""
    return x_stages * 8 * (8 * mt) * 32 + stages * warps * warp_stage(nt)


def with_shared_memory(kernel, mt: int, stages: int = STAGES, warps: int = WARPS, nt: int = TILES,
                       x_stages: int = 2):
    """``kernel`` allowed the dynamic shared memory of its shape (an opt-in from 48 KB on)."""
    if shared_bytes(mt, stages, warps, nt, x_stages) >= 48 * 1024:
        kernel.set_shared_memory_config(shared_bytes(mt, stages, warps, nt, x_stages))
    return kernel


def launch(kernel, x, packed, scales, global_scale, bias, ips: int, mt: int, stages: int = STAGES,
           warps: int = WARPS, nt: int = TILES, x_stages: int = 2, x_arg=None, threads: int | None = None,
           shared_mem: int | None = None) -> torch.Tensor:
    """Runs a kernel with the ``ARGS`` parameters (a prototype's on this loop, or the shipped
    warp-specialized wgmma one) on x [M, K]: grid (N / (16 nt warps), K slices of ``ips`` steps),
    blocks of ``threads`` (default 32 warps) with ``shared_mem`` bytes (default this loop's
    ``shared_bytes``); ``x_arg`` is what the kernel reads as x (by default x itself). Returns
    y [M, N] bf16."""
    from qerl_kit.kernels.splitk import arrival_counters

    m, n, k = x.shape[0], packed.shape[0], packed.shape[1] * 2
    rows = 16 * nt * warps
    slices = -(-(k // K_STEP) // ips)
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    ws = torch.empty(slices * m * n if slices > 1 else 1, dtype=torch.float32, device=x.device)
    kernel(grid=(-(-n // rows), slices, 1), block=(threads or 32 * warps, 1, 1),
           shared_mem=shared_mem if shared_mem is not None else shared_bytes(mt, stages, warps, nt, x_stages),
           args=[x if x_arg is None else x_arg, m, x.stride(0), packed, packed.stride(0),
                 scales.view(torch.uint8), scales.stride(0),
                 global_scale, bias if bias is not None else y, int(bias is not None), y, y.stride(0), ws,
                 arrival_counters(x.device), n, k, ips],
           stream=torch.cuda.current_stream(x.device))
    return y
