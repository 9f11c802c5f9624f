"""Prototype: a Marlin-style CUDA decode kernel for NVFP4 (M <= 16 rows), to test whether
feeding ``mma.sync`` straight from registers gets past the Triton kernels' small-M limit
(docs/kernels.md, "M = 8..64"). Not used by ``NVFP4Linear``; an experiment for issue #7.

What is different from the Triton decode kernel:

* The weight is repacked once, offline, into the register layout of the m16n8k16 MMA's A
  operand (``repack``): each lane's 16-byte load holds exactly its 8 E2M1 codes for 4 K-steps of
  16, so nothing goes through shared memory and no layout conversion happens in the kernel.
* The computation is transposed, ``y^T = W x^T``: 16 weight rows fill the MMA's M side, tiles of
  8 rows of x its N side (one tile up to 8 rows, two up to 16: each dequantized fragment feeds
  both). x is staged once per block in shared memory.
* Dequantization is bit placement, exact: a code's sign goes to bit 15 and its 3 magnitude bits
  to bits 8..6 of a bf16, which reads as ``e2m1 * 2^-126`` (codes 0 and 0.5 as subnormals); one
  ``fma.rn.bf16x2`` by the block's scale times ``2^94 / global_scale`` (precomputed in bf16 by
  ``repack``) leaves ``W * 2^-32``; the float32 accumulator is multiplied by ``2^32`` at the end.
  That is 4-5 integer instructions and one bf16x2 FMA per pair of weights.
* Split-K over a 2-D grid; partial sums go to a float32 output with ``atomicAdd``.

Scales are stored as bf16 (2 bytes per 16 weights instead of 1), so the weight stream is
0.625 bytes per weight instead of 0.5625.

``emulate`` runs the kernel's exact arithmetic on the CPU from the repacked buffers (the same bit
tricks, the same lane/fragment mapping), so the layout is tested without a GPU
(lab/tests/test_proto_cuda_decode.py). On a GPU, ``CudaDecode`` compiles the source with NVRTC
through CuPy and ``python -m lab.proto_cuda_decode`` checks and times it against torch's bf16
matmul and the Triton dispatch.
"""

from __future__ import annotations

import math
import sys

import torch

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short bf16_t;  // raw bf16 bits

__device__ __forceinline__ u32 pair(u32 w, int p) {
    // lo code of pair p at bits 4p..4p+3, hi code at 16+4p..: sign -> 15/31, magnitude -> 8..6/24..22
    u32 s = (p == 0) ? (w << 12) : (p == 1) ? (w << 8) : (p == 2) ? (w << 4) : w;
    u32 m = (p == 0) ? (w << 6) : (p == 1) ? (w << 2) : (p == 2) ? (w >> 2) : (w >> 6);
    return (s & 0x80008000u) | (m & 0x01C001C0u);
}

__device__ __forceinline__ u32 fma_bf16x2(u32 a, u32 b) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}

// One 64-wide K chunk: 4 MMA steps of 16 from this lane's 16 bytes of codes (q) and scales (s),
// each step's dequantized A fragment used for MT tiles of 8 rows of x; xr points at row g of the
// staged x slice (bf16 pairs, row stride hs), col at the chunk's first pair.
template <int MT>
__device__ __forceinline__ void chunk(const uint4 q, const uint4 s, const u32* xr, int hs, int col, float (&c)[MT][4]) {
    const u32 qw[4] = {q.x, q.y, q.z, q.w};
    const u32 sg[2] = {s.x, s.y}, sh[2] = {s.z, s.w};     // rows g and g+8, steps (0,1) and (2,3)
    #pragma unroll
    for (int j = 0; j < 4; j++) {
        const u32 w = qw[j];
        const u32 scg = __byte_perm(sg[j >> 1], 0, (j & 1) ? 0x3232 : 0x1010);
        const u32 sch = __byte_perm(sh[j >> 1], 0, (j & 1) ? 0x3232 : 0x1010);
        const u32 a0 = fma_bf16x2(pair(w, 0), scg), a1 = fma_bf16x2(pair(w, 1), sch);
        const u32 a2 = fma_bf16x2(pair(w, 2), scg), a3 = fma_bf16x2(pair(w, 3), sch);
        #pragma unroll
        for (int i = 0; i < MT; i++) {
            const u32 b0 = xr[i * 8 * hs + col + j * 8], b1 = xr[i * 8 * hs + col + j * 8 + 4];
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                         "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                         : "+f"(c[i][0]), "+f"(c[i][1]), "+f"(c[i][2]), "+f"(c[i][3])
                         : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
        }
    }
}

// y[M, N] (float32, zeroed, += by atomics) = x[M, K] @ W^T for M <= 8 * MT. Block: 4 warps, each
// 16 output features; grid (N / 64, K splits of chunks_per_split 64-wide chunks).
template <int MT>
__device__ __forceinline__ void decode(const bf16_t* __restrict__ x, int M, int ldx,
                                       const uint4* __restrict__ wq, const uint4* __restrict__ ws,
                                       float* __restrict__ y, int N, int K, int chunks_per_split)
{
    extern __shared__ u32 xs[];                  // [8 * MT][hs] bf16 pairs
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int KC = K / 64;
    const int kc0 = blockIdx.y * chunks_per_split;
    const int kc1 = min(KC, kc0 + chunks_per_split);
    if (kc0 >= kc1) return;
    const int hs = chunks_per_split * 32 + 4;            // u32 per row (+16 bytes: no bank conflicts)
    const int pairs = (kc1 - kc0) * 32;                  // u32 per row of this slice
    for (int i = threadIdx.x; i < 8 * MT * pairs; i += blockDim.x) {
        const int r = i / pairs, c = i - r * pairs;
        u32 v = 0;
        if (r < M) v = *reinterpret_cast<const u32*>(x + (size_t)r * ldx + (size_t)kc0 * 64 + 2 * c);
        xs[r * hs + c] = v;
    }
    __syncthreads();
    const int ntile = blockIdx.x * 4 + warp;
    if (ntile >= N / 16) return;
    float c[MT][4] = {};
    const uint4* wp = wq + ((size_t)ntile * KC + kc0) * 32 + lane;
    const uint4* sp = ws + ((size_t)ntile * KC + kc0) * 8 + g;
    const u32* xr = xs + g * hs + t;
    int kc = kc0;
    for (; kc + 4 <= kc1; kc += 4) {                     // four 16-byte loads in flight per lane
        uint4 q[4], s[4];
        #pragma unroll
        for (int u = 0; u < 4; u++) { q[u] = __ldg(wp + u * 32); s[u] = __ldg(sp + u * 8); }
        wp += 128; sp += 32;
        #pragma unroll
        for (int u = 0; u < 4; u++) chunk<MT>(q[u], s[u], xr, hs, (kc + u - kc0) * 32, c);
    }
    for (; kc < kc1; kc++, wp += 32, sp += 8) chunk<MT>(__ldg(wp), __ldg(sp), xr, hs, (kc - kc0) * 32, c);
    const float fix = 4294967296.0f;                     // 2^32
    const int n = ntile * 16 + g;
    #pragma unroll
    for (int i = 0; i < MT; i++) {
        const int m = 8 * i + 2 * t;
        if (m < M)     { atomicAdd(y + (size_t)m * N + n, c[i][0] * fix); atomicAdd(y + (size_t)m * N + n + 8, c[i][2] * fix); }
        if (m + 1 < M) { atomicAdd(y + (size_t)(m + 1) * N + n, c[i][1] * fix); atomicAdd(y + (size_t)(m + 1) * N + n + 8, c[i][3] * fix); }
    }
}

#define ARGS const bf16_t* __restrict__ x, int M, int ldx, const uint4* __restrict__ wq, \
             const uint4* __restrict__ ws, float* __restrict__ y, int N, int K, int chunks_per_split
extern "C" __global__ void __launch_bounds__(128) nvfp4_decode_m8(ARGS) { decode<1>(x, M, ldx, wq, ws, y, N, K, chunks_per_split); }
extern "C" __global__ void __launch_bounds__(128) nvfp4_decode_m16(ARGS) { decode<2>(x, M, ldx, wq, ws, y, N, K, chunks_per_split); }
"""

FOLD = 2.0 ** 94  # scale fold (see the docstring); the accumulator is multiplied by 2^32


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """packed [N, K/2] uint8 (low nibble = even column) -> codes [N, K] uint8 (0..15)."""
    p = packed.to(torch.int32)
    return torch.stack((p & 15, p >> 4), dim=-1).reshape(packed.shape[0], -1)


def repack(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors NVFP4 (packed [N, K/2] uint8, scales [N, K/16] e4m3, global scale) ->
    (wq int32 [N/16, K/64, 32, 4], ws bf16 [N/16, K/64, 8, 8]) in the kernel's fragment order."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if n % 16 or k % 64:
        raise ValueError(f"the prototype needs N % 16 == 0 and K % 64 == 0; got N={n}, K={k}")
    c = _codes(packed).reshape(n // 16, 16, k // 64, 4, 16).permute(0, 2, 3, 1, 4)  # [nt, kc, j, row, col]
    lane = torch.arange(32, device=packed.device)
    g, t = lane // 4, lane % 4
    rows = torch.stack((g, g + 8, g, g + 8))                  # pair p -> row within the tile
    cols = torch.stack((2 * t, 2 * t, 2 * t + 8, 2 * t + 8))  # pair p -> first column of the pair
    word = torch.zeros(n // 16, k // 64, 4, 32, dtype=torch.int64, device=packed.device)
    for p in range(4):
        lo = c[..., rows[p], cols[p]].to(torch.int64)         # [nt, kc, j, 32 lanes]
        hi = c[..., rows[p], cols[p] + 1].to(torch.int64)
        word |= (lo << (4 * p)) | (hi << (16 + 4 * p))
    word = word.transpose(2, 3)                                # [nt, kc, lane, j]
    wq = torch.where(word < 2**31, word, word - 2**32).to(torch.int32)
    eff = (scales.to(torch.float32) * (FOLD / global_scale.to(torch.float32))).to(torch.bfloat16)  # [N, K/16]
    eff = eff.reshape(n // 16, 2, 8, k // 64, 4)              # [nt, half (g / g+8), g, kc, j]
    ws = eff.permute(0, 3, 2, 1, 4).reshape(n // 16, k // 64, 8, 8)
    return wq.contiguous(), ws.contiguous()


def _bf16_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    return (bits.to(torch.int32) << 16).view(torch.float32)


def emulate(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The kernel's arithmetic on the CPU: x [M <= 16, K] bf16 -> y [M, N] float32."""
    m = x.shape[0]
    rows = 8 * -(-m // 8)                                      # 8 or 16: the kernel's tiles of x
    w = wq.to(torch.int64) & 0xFFFFFFFF                        # [nt, kc, lane, j]
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    sbits = ws.view(torch.int16).to(torch.int32) & 0xFFFF      # [nt, kc, g, 8]
    y = torch.zeros(n // 16, 16, rows, dtype=torch.float32)    # [nt, row, m]
    xp = torch.zeros(rows, k, dtype=torch.float32)
    xp[:m] = x.to(torch.float32)
    shifts = [(12, 6), (8, 2), (4, -2), (0, -6)]
    for kc in range(k // 64):
        for j in range(4):
            word = w[:, kc, :, j]                              # [nt, 32]
            a = []
            for p, (ss, ms) in enumerate(shifts):
                s_part = (word << ss) & 0x80008000
                m_part = ((word << ms) if ms >= 0 else (word >> -ms)) & 0x01C001C0
                bits = s_part | m_part
                row_half = p % 2                               # pairs 0, 2: row g; 1, 3: row g+8
                sc = sbits[:, kc, :, row_half * 4 + j][:, g]   # [nt, 32]
                sc = _bf16_bits_to_float(sc)
                lo = _bf16_bits_to_float(bits & 0xFFFF) * sc
                hi = _bf16_bits_to_float((bits >> 16) & 0xFFFF) * sc
                a.append((lo.to(torch.bfloat16).float(), hi.to(torch.bfloat16).float()))  # fma.rn.bf16x2
            k0 = kc * 64 + j * 16
            # A [nt, 16 rows, 16 cols] from the fragments
            A = torch.zeros(n // 16, 16, 16)
            for p in range(4):
                r = g + 8 * (p % 2)
                col = 2 * t + 8 * (p // 2)
                A[:, r, col] = a[p][0]
                A[:, r, col + 1] = a[p][1]
            y += torch.einsum("trk,mk->trm", A, xp[:, k0:k0 + 16])
    return (y * 2.0 ** 32).permute(2, 0, 1).reshape(rows, n)[:m]


class CudaDecode:
    """The kernel compiled with NVRTC through CuPy; ``__call__(x, wq, ws, n, k) -> y`` float32,
    for x of at most 16 rows (8-row tiles: the m8 kernel up to 8 rows, m16 up to 16)."""

    def __init__(self, chunks_per_split: int | None = None):
        import cupy

        self.cp = cupy
        module = cupy.RawModule(code=SOURCE, options=("--std=c++17",))
        self.kernels = {1: module.get_function("nvfp4_decode_m8"), 2: module.get_function("nvfp4_decode_m16")}
        self.chunks_per_split = chunks_per_split

    def split(self, n: int, k: int, tiles: int) -> int:
        """64-wide K chunks per program: about 6 blocks per SM, and x's staged slice (8 * tiles
        rows) under the 48 KB of shared memory a launch gets without opting in."""
        most = (48 * 1024 // (8 * tiles * 4) - 4) // 32
        if self.chunks_per_split:
            return min(self.chunks_per_split, most)
        want = max(1, math.ceil(132 * 6 / math.ceil(n / 64)))
        return min(most, max(2, math.ceil((k // 64) / want)))

    def __call__(self, x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, n: int, k: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        cp = self.cp
        m = x.shape[0]
        if not 1 <= m <= 16:
            raise ValueError(f"the prototype takes 1 to 16 rows; got {m}")
        tiles = -(-m // 8)
        cps = self.split(n, k, tiles)
        grid = (math.ceil(n / 64), math.ceil((k // 64) / cps))
        y = torch.zeros(m, n, dtype=torch.float32, device=x.device) if out is None else out.zero_()
        smem = 8 * tiles * (cps * 32 + 4) * 4
        stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        with stream:
            self.kernels[tiles](grid, (128,), (x.data_ptr(), cp.int32(m), cp.int32(x.stride(0)), wq.data_ptr(),
                                              ws.data_ptr(), y.data_ptr(), cp.int32(n), cp.int32(k), cp.int32(cps)),
                                shared_mem=smem)
        return y


def main() -> None:
    from bench.bench_nvfp4_gemm import copies_for, random_nvfp4, time_graph

    from qerl_kit.kernels import nvfp4_linear
    from qerl_kit.kernels.reference import nvfp4_linear_ref

    sweep = "--sweep" in sys.argv
    torch.manual_seed(0)
    shapes = [(3584, 3584), (37888, 3584), (3584, 18944), (55296, 5120), (1024, 3584), (8192, 29568)]
    splits = (None, 1, 2, 4, 8, 16, 32) if sweep else (None,)
    decs = {c: CudaDecode(c) for c in splits}
    print("| N x K | M | split | rel err | cuda us | zero us | triton us | bf16 us | cuda x bf16 | triton x bf16 | cuda GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, k in shapes:
        q_bytes = n * k // 2 + n * k // 16
        weights = [random_nvfp4(n, k) for _ in range(copies_for(q_bytes))]
        packs = [repack(*w) for w in weights]
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies_for(n * k * 2))]
        for m in (1, 4, 8, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = nvfp4_linear_ref(x, *weights[0], dtype=torch.float32)
            outs = [torch.empty(m, n, device="cuda", dtype=torch.float32) for _ in packs]
            t_tri = time_graph([lambda w=w: nvfp4_linear(x, *w) for w in weights])
            t_bf = time_graph([lambda d=d: torch.nn.functional.linear(x, d) for d in dense])
            t_zero = time_graph([lambda o=o: o.zero_() for o in outs])
            for c, dec in decs.items():
                got = dec(x, *packs[0], n, k)
                torch.cuda.synchronize()
                err = ((got - ref).norm() / ref.norm()).item()
                t_cuda = time_graph([lambda p=p, o=o: dec(x, *p, n, k, out=o) for p, o in zip(packs, outs)])
                gbs = (n * k * 0.625 + m * k * 2 + m * n * 4) / t_cuda / 1e9
                tc, tz, tt, tb = t_cuda * 1e6, t_zero * 1e6, t_tri * 1e6, t_bf * 1e6
                split = dec.split(n, k, -(-m // 8))
                print(f"| {n} x {k} | {m} | {split}{'' if c else '*'} | {err:.1e} | {tc:.1f} | {tz:.1f} | {tt:.1f} | {tb:.1f} | "
                      f"{tb / tc:.2f} | {tb / tt:.2f} | {gbs:.0f} |", flush=True)
        del weights, packs, dense


if __name__ == "__main__":
    main()
