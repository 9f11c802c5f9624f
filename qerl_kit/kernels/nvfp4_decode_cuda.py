"""NVFP4 decode in CUDA C (M <= 16 rows): y = x @ W^T (+ bias) on ``mma.sync`` fed from registers.

vLLM's Marlin recipe on the compressed-tensors layout itself (``packed`` uint8 [N, K/2], ``scales``
e4m3 [N, K/16], ``global_scale``), with no repacked copy of the weight. The dequantized weights go
from registers straight into the MMA; Triton stages every tile through shared memory, which keeps
its decode kernels at 1.1-2.1x bf16 for a few rows (docs/kernels.md).

* **K permutation instead of repacking.** A dot product may visit K in any order if x and W
  follow the same one. Each lane loads 16-byte runs of rows g and g+8 of a 16-row tile and uses
  each 32-bit word (8 codes) for two m16n8k16 steps: codes (0, 4) and (1, 5) form one step's
  A-fragment columns, (2, 6) and (3, 7) the next one's; four ``prmt`` build the matching B (x).
* **Transposed product**, ``y^T = W x^T``: 16 weight rows on the MMA's M side, tiles of 8 rows of
  x on its N side (one tile up to 8 rows, two up to 16).
* **Exact dequantization by bit placement.** Sign to bit 15 and magnitude to bits 8..6 of a bf16
  read as ``e2m1 * 2^-126`` (10 integer instructions per word of 8 codes, see ``pair``); the scale
  byte placed into a float32 reads as ``s * 2^-120`` and, times ``2^216``, rounds to bf16 exactly;
  one ``fma.rn.bf16x2`` gives ``e2m1 * s * 2^-30`` exactly, and the float32 accumulator is
  multiplied by ``2^30 / global_scale`` at the end. The tensor cores see the NVFP4 weight exactly.
* **Split-K without atomics on y.** K slices write float32 partials; the last block to arrive at
  a tile (an int32 counter, reset by that block) sums them in slice order (deterministic) and
  writes bf16 y with the global scale and bias: one launch, no memset, CUDA-graph safe once one
  eager call has allocated the counters.
* Weights are prefetched one K step ahead in registers; x is read through L1.

Constraints (``supports``): bf16 x, ``K % 128 == 0``, ``N % 16 == 0``, 16-byte aligned rows.
Compiled at first use with NVRTC (``qerl_kit.kernels.nvrtc``), so no compiler or extra package;
``cuda_decode_status()`` says whether it runs here and why not. qerl_kit/kernels/routes.py decides
which calls reach it. ``QK_ABLATE`` leaves stages out for lab/ablate_cuda_decode.py. Tests:
tests/test_decode_cuda.py (CPU: exhaustive bit checks and a lane-level emulation; GPU: the kernel).
"""

from __future__ import annotations

import functools
import math

import torch

from qerl_kit.kernels import nvrtc
from qerl_kit.kernels.backend import register_linear_op

MAX_M = 16
K_STEP = 256  # codes per row per loop iteration (4 lanes x 2 pieces x 32 codes)
WARPS = 4

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;

#ifndef QK_ABLATE  // benchmarks only (lab/ablate_cuda_decode.py): leave a stage out to time it
#define QK_ABLATE 0  // 1: no dequantization, 2: no MMA, 4: no x loads, 8: no scale conversion,
#endif              // 16: registers capped so that 8 blocks fit per SM (a variant, not a cut)
#if QK_ABLATE & 16
#define QK_BOUNDS __launch_bounds__(128, 8)
#else
#define QK_BOUNDS __launch_bounds__(128)  // no minimum: an explicit 1 let ptxas take 90 registers, not 72
#endif

// Codes (lo at bits 4p..4p+3, hi at 16+4p..) -> two bf16 e2m1 * 2^-126: sign -> 15/31, magnitude -> 8..6/24..22.
// A sign must move 7 bits further than its magnitude, so first merge the word with itself rotated
// right by 6: t01 keeps the sign bits of codes 0, 1, 4, 5 and takes every other bit from the
// rotated copy, where each of those codes' magnitudes now lies 7 bits below its sign (t23 likewise
// for codes 2, 3, 6, 7; the bits each pair needs never collide). One rotate and one mask then give
// a pair: 10 instructions per word of 8 codes instead of 15 (nvcc shares r, t01 and t23).
template <u32 MASK> __device__ __forceinline__ u32 merge(u32 a, u32 b) {  // (a & MASK) | (b & ~MASK), one LOP3
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(d) : "r"(a), "r"(b), "n"(MASK));
    return d;
}

__device__ __forceinline__ u32 pair(u32 w, int p) {
    const u32 r = __funnelshift_r(w, w, 6);
    const u32 t = (p < 2) ? merge<0x00880088u>(w, r) : merge<0x88008800u>(w, r);
    const int d = (p == 0) ? 12 : (p == 1) ? 8 : (p == 2) ? 4 : 0;
    return (d ? __funnelshift_l(t, t, d) : t) & 0x81C081C0u;
}

__device__ __forceinline__ u32 fma_bf16x2(u32 a, u32 b) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}

// E4M3 scale byte (bits 0..7 of b) -> bf16x2 (both halves) of s * 2^96, exact.
__device__ __forceinline__ u32 scale_bf16x2(u32 b) {
#if QK_ABLATE & 8
    return b;
#endif
    float f = __uint_as_float((b << 20) & 0x07F00000u);      // s * 2^-120, exact (subnormal s too)
    f = f * 3.2451855365842673e32f * 3.2451855365842673e32f;  // * 2^108 * 2^108
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(d) : "f"(f));
    return d;
}

__device__ __forceinline__ uint4 ld_stream(const unsigned char* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ u32 ld_u16(const unsigned char* p) {
    u16 v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if QK_ABLATE & 2
    c[0] = __uint_as_float(__float_as_uint(c[0]) ^ a0 ^ a1 ^ a2 ^ a3 ^ b0 ^ b1);
    return;
#endif
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Dequantized pair p of word w times its block scale s.
__device__ __forceinline__ u32 dq(u32 w, int p, u32 s) {
#if QK_ABLATE & 1
    return w + p * s;  // keeps every word live (an xor of a0 and a2 would cancel w)
#else
    return fma_bf16x2(pair(w, p), s);
#endif
}

__device__ __forceinline__ u16 to_bf16(float f) {
    u16 d;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(d) : "f"(f));
    return d;
}

// Split K: this block's float32 partials into ws [slices, M, N]; true in the block of its tile
// that arrives last, which then sums the slices (the tile's counter is reset for the next call).
template <int NT, int MT>
__device__ __forceinline__ bool arrive_last(const float (&c)[NT][MT][4], int row, int t, int M, int N,
                                            float* __restrict__ ws, int* __restrict__ counters) {
    __shared__ int ticket;
    float* part = ws + (size_t)blockIdx.y * M * N;
    #pragma unroll
    for (int nt = 0; nt < NT; nt++)
        #pragma unroll
        for (int mt = 0; mt < MT; mt++)
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                const int n = row + 16 * nt + 8 * (e >> 1), m = 8 * mt + 2 * t + (e & 1);
                if (n < N && m < M) part[(size_t)m * N + n] = c[nt][mt][e];
            }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) ticket = atomicAdd(counters + blockIdx.x, 1);
    __syncthreads();
    if (ticket != (int)gridDim.y - 1) return false;
    if (threadIdx.x == 0) counters[blockIdx.x] = 0;       // ready for the next call
    __threadfence();
    return true;
}

// The end of a kernel: this thread's accumulators c (rows row + 16 nt + 8 (e >> 1), x rows
// 8 mt + 2t + (e & 1)) to bf16 y with the global scale and the bias; with several K slices
// (gridDim.y > 1) through float32 partials in ws [slices, M, N], the last block to arrive at its
// tile of block_rows rows (an int32 counter, reset by that block) summing them in slice order.
template <int NT, int MT>
__device__ __forceinline__ void store_y(const float (&c)[NT][MT][4], int row, int t, int tile0, int block_rows,
                                        int M, int N, const float* __restrict__ gsp, const u16* __restrict__ bias,
                                        int has_bias, u16* __restrict__ y, int ldy, float* __restrict__ ws,
                                        int* __restrict__ counters) {
    if (gridDim.y == 1) {
        #pragma unroll
        for (int nt = 0; nt < NT; nt++)
            #pragma unroll
            for (int mt = 0; mt < MT; mt++)
                #pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int n = row + 16 * nt + 8 * (e >> 1), m = 8 * mt + 2 * t + (e & 1);
                    if (n < N && m < M) {
                        float v = c[nt][mt][e] * 1073741824.0f / gsp[0];
                        if (has_bias) v += __uint_as_float((u32)bias[n] << 16);
                        y[(size_t)m * ldy + n] = to_bf16(v);
                    }
                }
        return;
    }
    if (!arrive_last<NT, MT>(c, row, t, M, N, ws, counters)) return;
    const int width = min(block_rows, N - tile0);
    for (int e = threadIdx.x; e < M * width; e += blockDim.x) {
        const int m = e / width, n = tile0 + e % width;
        float v = 0.f;
        for (int s = 0; s < (int)gridDim.y; s++) v += __ldcg(ws + ((size_t)s * M + m) * N + n);
        v = v * 1073741824.0f / gsp[0];
        if (has_bias) v += __uint_as_float((u32)bias[n] << 16);
        y[(size_t)m * ldy + n] = to_bf16(v);
    }
}

#define ARGS const u16* __restrict__ x, int M, int ldx, const unsigned char* __restrict__ q, int ldq, \
             const unsigned char* __restrict__ sc, int lds, const float* __restrict__ gsp, \
             const u16* __restrict__ bias, int has_bias, u16* __restrict__ y, int ldy, float* __restrict__ ws, \
             int* __restrict__ counters, int N, int K, int ips
#define CALL x, M, ldx, q, ldq, sc, lds, gsp, bias, has_bias, y, ldy, ws, counters, N, K, ips

// One K step's weights for one lane: rows g and g+8 of NT tiles, two 16-byte pieces each.
template <int NT> struct Step { uint4 q[NT][2][2]; u32 s[NT][2][2]; };

template <int NT>
__device__ __forceinline__ void load_step(Step<NT>& st, const unsigned char* q, int ldq, const unsigned char* sc,
                                          int lds, int row, int N, int K, int it, int t) {
    const bool tail = it * 256 + 128 >= K;          // K % 256 == 128: the last step has one piece
    #pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        #pragma unroll
        for (int r = 0; r < 2; r++) {
            const int n = row + 16 * nt + 8 * r;
            #pragma unroll
            for (int pc = 0; pc < 2; pc++) {
                if (n < N && !(pc == 1 && tail)) {
                    st.q[nt][r][pc] = ld_stream(q + (size_t)n * ldq + it * 128 + pc * 64 + 16 * t);
                    st.s[nt][r][pc] = ld_u16(sc + (size_t)n * lds + it * 16 + pc * 8 + 2 * t);
                } else {
                    st.q[nt][r][pc] = make_uint4(0, 0, 0, 0);
                    st.s[nt][r][pc] = 0;
                }
            }
        }
    }
}

template <int MT, int NT>
__device__ __forceinline__ void compute_step(const Step<NT>& st, float (&c)[NT][MT][4], const u16* x, int M, int ldx,
                                             int it, int K, int g, int t) {
    const int pieces = (it * 256 + 128 >= K) ? 1 : 2;
    #pragma unroll
    for (int pc = 0; pc < 2; pc++) {
        if (pc >= pieces) break;
        u32 sg[NT][2], sh[NT][2];                         // rows g / g+8: scales of words 0-1 and 2-3
        #pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            sg[nt][0] = scale_bf16x2(st.s[nt][0][pc]);  sg[nt][1] = scale_bf16x2(st.s[nt][0][pc] >> 8);
            sh[nt][0] = scale_bf16x2(st.s[nt][1][pc]);  sh[nt][1] = scale_bf16x2(st.s[nt][1][pc] >> 8);
        }
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 b[MT][4];
            #pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                const int m = g + 8 * mt;
#if QK_ABLATE & 4
                const uint4 xv = make_uint4(m, it, i, t);
#else
                // Rows past M read row M - 1: they only fill MMA columns that are never written out.
                const int mr = m < M ? m : M - 1;
                const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + (size_t)mr * ldx + it * 256 + pc * 128 + 32 * t + 8 * i));
#endif
                b[mt][0] = __byte_perm(xv.x, xv.z, 0x5410);   // x0, x4
                b[mt][1] = __byte_perm(xv.x, xv.z, 0x7632);   // x1, x5
                b[mt][2] = __byte_perm(xv.y, xv.w, 0x5410);   // x2, x6
                b[mt][3] = __byte_perm(xv.y, xv.w, 0x7632);   // x3, x7
            }
            #pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const uint4 qg = st.q[nt][0][pc], qh = st.q[nt][1][pc];
                const u32 wg = i == 0 ? qg.x : i == 1 ? qg.y : i == 2 ? qg.z : qg.w;
                const u32 wh = i == 0 ? qh.x : i == 1 ? qh.y : i == 2 ? qh.z : qh.w;
                const u32 s0 = sg[nt][i >> 1], s1 = sh[nt][i >> 1];
                u32 a0 = dq(wg, 0, s0), a1 = dq(wh, 0, s1), a2 = dq(wg, 1, s0), a3 = dq(wh, 1, s1);
                #pragma unroll
                for (int mt = 0; mt < MT; mt++) mma(c[nt][mt], a0, a1, a2, a3, b[mt][0], b[mt][1]);
                a0 = dq(wg, 2, s0); a1 = dq(wh, 2, s1); a2 = dq(wg, 3, s0); a3 = dq(wh, 3, s1);
                #pragma unroll
                for (int mt = 0; mt < MT; mt++) mma(c[nt][mt], a0, a1, a2, a3, b[mt][2], b[mt][3]);
            }
        }
    }
}

// y[M, N] (bf16, row stride ldy) = x[M, K] @ W^T (+ bias). Block: 4 warps, each 16 * NT weight rows;
// grid (ceil(N / (64 * NT)), K slices of `ips` steps). ws: float32 [slices, M, N] when slices > 1.
template <int MT, int NT>
__device__ __forceinline__ void decode(ARGS) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int steps = (K + 255) / 256;
    const int it0 = blockIdx.y * ips, it1 = min(steps, it0 + ips);
    const int tile0 = blockIdx.x * 64 * NT;
    const int row = tile0 + warp * 16 * NT + g;

    float c[NT][MT][4];
    #pragma unroll
    for (int nt = 0; nt < NT; nt++)
        #pragma unroll
        for (int mt = 0; mt < MT; mt++) c[nt][mt][0] = c[nt][mt][1] = c[nt][mt][2] = c[nt][mt][3] = 0.f;

    if (row - g < N) {
        Step<NT> cur, nxt;                                // the next K step loads during this one
        load_step<NT>(cur, q, ldq, sc, lds, row, N, K, it0, t);
        for (int it = it0; it < it1; it++) {
            if (it + 1 < it1) {
                load_step<NT>(nxt, q, ldq, sc, lds, row, N, K, it + 1, t);
            }
            compute_step<MT, NT>(cur, c, x, M, ldx, it, K, g, t);
            cur = nxt;
        }
    }

    store_y<NT, MT>(c, row, t, tile0, 64 * NT, M, N, gsp, bias, has_bias, y, ldy, ws, counters);
}

extern "C" __global__ void QK_BOUNDS nvfp4_decode_m8_n1(ARGS) { decode<1, 1>(CALL); }
extern "C" __global__ void QK_BOUNDS nvfp4_decode_m8_n2(ARGS) { decode<1, 2>(CALL); }
extern "C" __global__ void QK_BOUNDS nvfp4_decode_m16_n1(ARGS) { decode<2, 1>(CALL); }
extern "C" __global__ void QK_BOUNDS nvfp4_decode_m16_n2(ARGS) { decode<2, 2>(CALL); }
"""


def _kernel_name(m: int, nt: int) -> str:
    return f"nvfp4_decode_m{8 if m <= 8 else 16}_n{nt}"


def _compiled(name: str, device_index: int, ablate: int = 0):
    return nvrtc.compile_kernel(SOURCE, name, device_index, (f"-DQK_ABLATE={ablate}",) if ablate else ())


@functools.lru_cache(maxsize=None)
def cuda_decode_status() -> tuple[bool, str]:
    """(usable, reason): whether this kernel compiles and runs here, decided once per process."""
    return nvrtc.status(SOURCE, ("nvfp4_decode_m8_n1", "nvfp4_decode_m16_n1"), (8, 0), "bf16 mma.sync")


def supports(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether a forward call fits this kernel (dtype, rows, shape, strides and alignment)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and 1 <= x.shape[0] <= MAX_M
            and k % 128 == 0 and n % 16 == 0 and x.stride(1) == 1 and x.stride(0) % 8 == 0
            and x.data_ptr() % 16 == 0 and packed.stride(1) == 1 and packed.stride(0) % 16 == 0
            and packed.data_ptr() % 16 == 0 and scales.stride(1) == 1 and scales.stride(0) % 2 == 0
            and scales.data_ptr() % 2 == 0)


def choose_config(m: int, n: int, k: int, sms: int | None = None) -> tuple[int, int]:
    """(16-row tiles per warp, K steps per slice) for an [n, k] weight and m rows, from the H200
    sweep (lab/results/cuda_decode_sweep_h200.md): one row wants two tiles per warp on layers of
    16M weights and more and about 8 blocks per SM; 2..8 rows one tile and about 4 blocks per SM,
    6 when K has 100 steps of 256 or more (72B down: 6-10% faster at 2-8 rows, 32B down 1%; 7B
    down, 74 steps, is 0-3% slower with 6: lab/results/cuda_decode_slices_h200.md)."""
    from qerl_kit.kernels.splitk import sm_count  # cached once per process

    sms = sms or sm_count()
    nt = 2 if m == 1 and n * k >= (16 << 20) else 1
    blocks_n = -(-n // (64 * nt))
    steps = -(-k // K_STEP)
    per_sm = 8 if m == 1 else (6 if steps >= 100 and m <= 8 else 4)
    slices = max(1, min(steps, round(per_sm * sms / blocks_n)))
    return nt, -(-steps // slices)


def nvfp4_decode_cuda(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                      global_scale: torch.Tensor, bias: torch.Tensor | None = None,
                      nt: int | None = None, ips: int | None = None, ablate: int = 0) -> torch.Tensor:
    """y = x @ W^T (+ bias) for x [M <= 16, K] bf16; ``nt``/``ips`` pin the config and ``ablate``
    leaves stages out (``QK_ABLATE`` in SOURCE; wrong results, for lab/ablate_cuda_decode.py)."""
    if not supports(x, packed, scales):
        raise ValueError(f"nvfp4_decode_cuda: unsupported call (x {tuple(x.shape)} {x.dtype}, "
                         f"weight {tuple(packed.shape)}): needs bf16 CUDA x with 1..{MAX_M} rows, "
                         "K % 128 == 0, N % 16 == 0 and 16-byte aligned rows")
    m, n, k = x.shape[0], packed.shape[0], packed.shape[1] * 2
    auto_nt, auto_ips = choose_config(m, n, k)
    nt, ips = nt or auto_nt, ips or auto_ips
    slices = math.ceil(-(-k // K_STEP) / ips)
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    ws = torch.empty(slices * m * n if slices > 1 else 1, dtype=torch.float32, device=x.device)
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    kernel = _compiled(_kernel_name(m, nt), device, ablate)
    _launch(kernel, x, packed, scales, global_scale, bias, y, ws, nt, ips, slices)
    return y


def _launch(kernel, x, packed, scales, global_scale, bias, y, ws, nt, ips, slices) -> None:
    from qerl_kit.kernels.splitk import arrival_counters

    m, n, k = x.shape[0], packed.shape[0], packed.shape[1] * 2
    kernel(grid=(-(-n // (64 * nt)), slices, 1), block=(32 * WARPS, 1, 1),
           args=[x, m, x.stride(0), packed, packed.stride(0), scales.view(torch.uint8), scales.stride(0),
                 global_scale, bias if bias is not None else y, int(bias is not None), y, y.stride(0), ws,
                 arrival_counters(x.device), n, k, ips],
           stream=torch.cuda.current_stream(x.device))


nvfp4_decode_cuda_op = register_linear_op("nvfp4_decode_cuda", nvfp4_decode_cuda)
