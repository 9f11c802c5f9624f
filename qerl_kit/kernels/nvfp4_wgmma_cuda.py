"""NVFP4 forward for 17..64 rows on Hopper (sm_90a): dequantized weights feed ``wgmma``.

At GRPO's rollout batches (8 prompts x 8 samples = 64 rows) the Triton kernels fall below bf16 on
the larger layers. This kernel, measured first as a prototype (``bench/proto_wgmma_gemm.py``),
beats them there: on the 14B/32B/72B MLP and large attention layers at 24-64 rows, 1.00-1.44x
(median 1.25x) the Triton path it replaces, 0.65-1.47x bf16; the 72B engine decodes 1.18x
faster at batch 32 and 1.07x at 64, 32B reaches bf16 at batch 32 (bench/results/route_wgmma_h200.md).
It loses on small layers, so the dispatcher sends it only what ``preferred`` says.

Design (one block = 8 warps = two warpgroups over 256 weight rows, K steps of 128 codes):

* Weights: each warp copies its 32 rows' codes and scale bytes of a K step into its own
  shared-memory stage with ``cp.async``, three steps ahead (4 stages), then each lane dequantizes
  its 16-byte run exactly as the CUDA decode kernel does (``dq``, the same K permutation), straight
  into the A fragments of ``wgmma.mma_async.m64nNk16`` (A from registers: warp w of a warpgroup
  supplies A rows 16 w .. 16 w + 15, in ``mma.m16n8k16``'s A layout).
* x: loaded two K steps ahead into registers, then stored once per K step and block into a
  shared-memory stage in that K order, K-major without swizzle (core matrices of 8 rows x 16
  bytes, leading byte offset 128, stride byte offset 256), which is B of the wgmma (N = 32 or 64
  x rows: ``MT`` 4 or 8 tiles of 8), followed by ``fence.proxy.async``.
* The product is transposed, y^T = W x^T: one wgmma per 64 weight rows and 16 k instead of MT
  ``mma.sync`` per warp; the wgmmas of MMA step s run while step s + 1 is dequantized (two
  register sets, ``wgmma.wait_group 1``).
* Split K over grid.y: float32 partials, the last block of a tile sums them in slice order, 4
  columns per load and 8 loads in flight (``store_tile``); one launch, CUDA-graph safe.

``PIPELINE`` (the block's stages, loads and epilogue, generic over the layout ``L``) is also what
``bench/proto_cuda_gemm.py`` (the mma.sync layout, measured slower) and the wgmma prototype's
variants build on. Compiled at first use with NVRTC for sm_90a (``wgmma`` exists on no other
architecture): ``wgmma_status`` says why it is off anywhere else, and the dispatcher then keeps
the Triton kernels.
"""

from __future__ import annotations

import functools

import torch

from qerl_kit.kernels import nvrtc
from qerl_kit.kernels.backend import register_linear_op
from qerl_kit.kernels.cuda_pipeline import K_STEP, PIPELINE, TILES, WARPS, launch, with_shared_memory, x_tiles

ROWS = 16 * WARPS * TILES  # weight rows per block
MIN_M, MAX_M = 17, 64
ARCH = "90a"


def _wgmma_asm(n: int) -> str:
    """wgmma.mma_async m64n{n}k16, f32 += bf16 (A registers) x bf16 (B shared, K-major)."""
    regs = n // 2
    d = ", ".join(f"%{i}" for i in range(regs))
    outs = ", ".join(f'"+f"(d[{j}][{e}])' for j in range(n // 8) for e in range(4))
    return f"""
template <> __device__ __forceinline__ void wgmma<{n // 8}>(float (&d)[{n // 8}][4], u32 a0, u32 a1, u32 a2, u32 a3,
                                                  unsigned long long db) {{
    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 5}, 0;\\n"
                 "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{d}}}, "
                 "{{%{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}}}, %{regs + 4}, p, 1, 1, 0;\\n}}\\n"
                 : {outs}
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(1));
}}
"""


# The wgmma layout: store_x (a thread's share of one K step of x into a stage), compute (one K
# step's dequantization and wgmmas) and finish (the wgmmas left in flight, if any), as PIPELINE's
# gemm<L, ...> expects them.
LAYOUT = r"""
// -- The wgmma layout --
template <int MT> __device__ __forceinline__ void wgmma(float (&d)[MT][4], u32 a0, u32 a1, u32 a2, u32 a3,
                                                        unsigned long long db);
""" + _wgmma_asm(32) + _wgmma_asm(64) + r"""
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
// Keeps a register's value where it is until here (an operand of an in-flight wgmma).
__device__ __forceinline__ void keep(u32& r) { asm volatile("" : "+r"(r) :: "memory"); }
__device__ __forceinline__ void keep(float& r) { asm volatile("" : "+f"(r) :: "memory"); }

// Byte offset in an x stage: chunk c (MMA step 2i + h), x row m, k slot (0..15).
template <int MT>
__device__ __forceinline__ int xoff(int c, int m, int kslot) {
    return c * (256 * MT) + (m >> 3) * 256 + (kslot >> 3) * 128 + (m & 7) * 16 + (kslot & 7) * 2;
}

// Shared-memory descriptor of one chunk: K-major, no swizzle, LBO 128 bytes (k slots 0-7 -> 8-15),
// SBO 256 bytes (x rows 0-7 -> 8-15).
__device__ __forceinline__ unsigned long long chunk_desc(u32 addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(128 >> 4) << 16)
           | ((unsigned long long)(256 >> 4) << 32);
}

// DEPTH register sets, up to DEPTH - 1 MMA steps' wgmmas in flight while the next one is decoded
// (1: each step waits for its own); CARRY: the last ones stay in flight into the next K step
// (its first waits retire them; finish() drains them before the epilogue).
template <int MT, int NT, int T, int DEPTH, bool CARRY> struct Wgmma {
    static_assert(8 % DEPTH == 0, "a K step's 8 MMA steps cycle the register sets whole");
    static __device__ __forceinline__ void store_x(const uint4 (&xs)[128 * MT / T], u32* stage) {
        unsigned char* sb = reinterpret_cast<unsigned char*>(stage);
        #pragma unroll
        for (int j = 0; j < 128 * MT / T; j++) {
            const int u = threadIdx.x + T * j;
            const int t = u & 3, m = ((u >> 7) << 3) | ((u >> 2) & 7), i = (u >> 5) & 3;
            const uint4 v = xs[j];
            *reinterpret_cast<u32*>(sb + xoff<MT>(2 * i, m, 2 * t)) = __byte_perm(v.x, v.z, 0x5410);          // x0, x4
            *reinterpret_cast<u32*>(sb + xoff<MT>(2 * i, m, 2 * t + 8)) = __byte_perm(v.x, v.z, 0x7632);      // x1, x5
            *reinterpret_cast<u32*>(sb + xoff<MT>(2 * i + 1, m, 2 * t)) = __byte_perm(v.y, v.w, 0x5410);      // x2, x6
            *reinterpret_cast<u32*>(sb + xoff<MT>(2 * i + 1, m, 2 * t + 8)) = __byte_perm(v.y, v.w, 0x7632);  // x3, x7
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // visible to wgmma after the barrier
    }

    static __device__ __forceinline__ void compute(const unsigned char* wst, float (&c)[NT][MT][4],
                                                   u32 stage_addr, int lane, int g, int t) {
        uint4 qw[NT][2];
        u32 s[NT][2][2];  // tile, row (g, g + 8), words 0-1 / 2-3
        load_fragments<NT>(wst, g, t, qw, s);
        u32 a[DEPTH][NT][4];  // register set, tile, fragment
        #pragma unroll
        for (int step = 0; step < 8; step++) {
            const int i = step >> 1, h = step & 1, set = step % DEPTH;
            #pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const uint4 qg = qw[nt][0], qh = qw[nt][1];
                const u32 wg = i == 0 ? qg.x : i == 1 ? qg.y : i == 2 ? qg.z : qg.w;
                const u32 wh = i == 0 ? qh.x : i == 1 ? qh.y : i == 2 ? qh.z : qh.w;
                const u32 s0 = s[nt][0][i >> 1], s1 = s[nt][1][i >> 1];
                a[set][nt][0] = dq(wg, 2 * h, s0);
                a[set][nt][1] = dq(wh, 2 * h, s1);
                a[set][nt][2] = dq(wg, 2 * h + 1, s0);
                a[set][nt][3] = dq(wh, 2 * h + 1, s1);
            }
            wg_fence();  // orders the A registers just written (and the accumulators) before the wgmmas
            const unsigned long long db = chunk_desc(stage_addr + xoff<MT>(step, 0, 0));
            #pragma unroll
            for (int nt = 0; nt < NT; nt++)
                wgmma<MT>(c[nt], a[set][nt][0], a[set][nt][1], a[set][nt][2], a[set][nt][3], db);
            wg_commit();
            wg_wait<DEPTH - 1>();  // step - DEPTH + 1's wgmmas are done: its register set may be rewritten
            if (DEPTH > 1 && step >= DEPTH - 1) {
                #pragma unroll
                for (int nt = 0; nt < NT; nt++)
                    #pragma unroll
                    for (int f = 0; f < 4; f++) keep(a[(step + 1) % DEPTH][nt][f]);
            }
        }
        if (!CARRY) {
            wg_wait<0>();
            #pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                #pragma unroll
                for (int j = 0; j < (DEPTH > 1 ? DEPTH - 1 : 1); j++)  // the sets of the last steps in flight
                    #pragma unroll
                    for (int f = 0; f < 4; f++) keep(a[(7 - j) % DEPTH][nt][f]);
                #pragma unroll
                for (int mt = 0; mt < MT; mt++)
                    #pragma unroll
                    for (int e = 0; e < 4; e++) keep(c[nt][mt][e]);
            }
        }
    }

    static __device__ __forceinline__ void finish(float (&c)[NT][MT][4]) {
        if (CARRY) {
            wg_wait<0>();
            #pragma unroll
            for (int nt = 0; nt < NT; nt++)
                #pragma unroll
                for (int mt = 0; mt < MT; mt++)
                    #pragma unroll
                    for (int e = 0; e < 4; e++) keep(c[nt][mt][e]);
        }
    }
};
template <int MT, int NT, int T> using WgSerial = Wgmma<MT, NT, T, 1, false>;
template <int MT, int NT, int T> using WgOverlap = Wgmma<MT, NT, T, 2, false>;

"""

# The shipped kernels: 256-row blocks, x two K steps ahead; registers for two blocks per SM at up
# to 32 rows (MT 4), one at 64 (164 registers; capping them for two was slower: --occupancy).
SOURCE = PIPELINE + LAYOUT + r"""
extern "C" __global__ void __launch_bounds__(256, 2) nvfp4_wgmma_m32(ARGS) { gemm<WgOverlap, 4, 4, 8, 2, 2>(CALL); }
extern "C" __global__ void __launch_bounds__(256, 1) nvfp4_wgmma_m64(ARGS) { gemm<WgOverlap, 8, 4, 8, 2, 2>(CALL); }
"""


def choose_ips(m: int, n: int, k: int, sms: int | None = None) -> int:
    """K steps per slice: K is split until the grid covers the GPU about once, one block per SM.
    On all 32 cells of the route table that ``preferred`` sends here, the best of this split and
    half and twice as many slices was this one."""
    from qerl_kit.kernels.nvfp4_gemv_triton import _sm_count  # cached once per process

    sms = sms or _sm_count()
    steps = k // K_STEP
    slices = max(1, min(steps, sms // -(-n // ROWS)))
    return -(-steps // slices)


def _kernel_name(mt: int) -> str:
    return f"nvfp4_wgmma_m{8 * mt}"


@functools.lru_cache(maxsize=None)
def _compiled(mt: int, device_index: int):
    return with_shared_memory(nvrtc.compile_kernel(SOURCE, _kernel_name(mt), device_index, arch=ARCH), mt)


@functools.lru_cache(maxsize=None)
def wgmma_status() -> tuple[bool, str]:
    """(usable, reason): whether this kernel compiles and runs here, decided once per process."""
    return nvrtc.status(SOURCE, (_kernel_name(4), _kernel_name(8)), (9, 0), "wgmma", arch=ARCH)


def supports(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether a forward call fits this kernel: bf16 CUDA x of 17..64 rows, K % 128 == 0,
    N % 16 == 0, rows 16-byte aligned (codes, x) and 8-byte aligned (scales: cp.async)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and MIN_M <= x.shape[0] <= MAX_M
            and k % K_STEP == 0 and n % 16 == 0 and x.stride(1) == 1 and x.stride(0) % 8 == 0
            and x.data_ptr() % 16 == 0 and packed.stride(1) == 1 and packed.stride(0) % 16 == 0
            and packed.data_ptr() % 16 == 0 and scales.stride(1) == 1 and scales.stride(0) % 8 == 0
            and scales.data_ptr() % 8 == 0)


def preferred(m: int, n: int, k: int) -> bool:
    """Whether this kernel beat the dispatcher's Triton path at this size on the H200
    (bench/results/route_wgmma_h200.md: every Qwen2.5 7B-72B layer at 24/32/48/64 rows, this
    kernel's column against the dispatcher, in one run): layers of 2^26 weights and more with
    N >= 5120 and either N >= 8192 or K >= 16384 (1.00-1.44x); up to 32 rows also K >= 5120
    (7B's K = 3584 layers lost, 0.91-0.97x), from 33 rows more than 2^26 weights (72B o, exactly
    2^26, lost at 64 rows, 0.91x) and N below ``WIDE_N``, where the tiled Triton GEMM takes over
    and ties it. Smaller or narrower layers lost, down to 0.13x (k/v)."""
    from qerl_kit.kernels import WIDE_N

    w = n * k
    if not MIN_M <= m <= MAX_M or n < 5120 or w < 1 << 26 or (n < 8192 and k < 16384):
        return False
    return k >= 5120 if m <= 32 else (n < WIDE_N and w > 1 << 26)


def nvfp4_wgmma_cuda(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                     global_scale: torch.Tensor, bias: torch.Tensor | None = None,
                     ips: int | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) for x [17..64, K] bf16 on an sm_90 GPU; ``ips`` pins the K steps
    per slice (default ``choose_ips``)."""
    if not supports(x, packed, scales):
        raise ValueError(f"nvfp4_wgmma_cuda: unsupported call (x {tuple(x.shape)} {x.dtype}, "
                         f"weight {tuple(packed.shape)}): needs bf16 CUDA x with {MIN_M}..{MAX_M} rows, "
                         "K % 128 == 0, N % 16 == 0, 16-byte aligned rows and 8-byte aligned scale rows")
    m, n, k = x.shape[0], packed.shape[0], packed.shape[1] * 2
    ips = min(ips or choose_ips(m, n, k), k // K_STEP)
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    mt = x_tiles(m)
    return launch(_compiled(mt, device), x, packed, scales, global_scale, bias, ips, mt)


nvfp4_wgmma_cuda_op = register_linear_op("nvfp4_wgmma_cuda", nvfp4_wgmma_cuda)
