"""NVFP4 forward for 17..64 rows on Hopper (sm_90a): dequantized weights feed ``wgmma``.

At GRPO's rollout batches (8 prompts x 8 samples = 64 rows) the Triton kernels fall below bf16 on
the larger layers. This kernel beats them there. Session 8 shipped a single-role version
(``bench/proto_wgmma_gemm.py``: on the 14B/32B/72B MLP and large attention layers at 24-64 rows,
1.00-1.44x the Triton path, bench/results/route_wgmma_h200.md); session 9 gave it a producer
warpgroup, 0.78-0.98x its time on every layer measured (bench/ab_wgmma_ws.py,
bench/results/proto_wgmma_gemm_h200.md). It loses on small layers, so the dispatcher sends it
only what ``preferred`` says.

Design (one block = 12 warps over 256 weight rows, K steps of 128 codes):

* Producer (warps 0-3): per K step, waits on the stage's ``empty`` mbarrier, copies the 256
  rows' codes and scale bytes with ``cp.async`` into the consumer warps' stage regions (tracked
  by the stage's ``full`` mbarrier, ``cp.async.mbarrier.arrive``), stores x (loaded one K step
  ahead into registers) into the x stage in the weights' K order, K-major without swizzle (core
  matrices of 8 rows x 16 bytes, leading byte offset 128, stride byte offset 256: B of the
  wgmma, N = 32 or 64 x rows, ``MT`` 4 or 8 tiles of 8), ``fence.proxy.async``, and arrives on
  ``full``. Four stages.
* Consumers (warps 4-11, two warpgroups): wait on ``full``, and each lane dequantizes its 16-byte
  run exactly as the CUDA decode kernel does (``dq``, the same K permutation) straight into the A
  fragments of ``wgmma.mma_async.m64nNk16`` (A from registers: warp w of a warpgroup supplies A
  rows 16 w .. 16 w + 15, in ``mma.m16n8k16``'s A layout); the wgmmas of MMA step s run while
  step s + 1 is dequantized (two register sets). After the K step's last wgmma they arrive on
  ``empty``. No block barrier in the K loop: copies, x staging and their waits leave the
  consumers, which are what the single-role kernel's warps stalled on (ncu, session 9).
* The product is transposed, y^T = W x^T: one wgmma per 64 weight rows and 16 k.
* Split K over grid.y: float32 partials, the last block of a tile sums them in slice order, 4
  columns per load and 8 loads in flight (``store_tile``, all 384 threads); one launch,
  CUDA-graph safe.

``PIPELINE`` (``cuda_pipeline``) supplies the loads, fragments and epilogue; its single-role
``gemm`` is what the prototypes build on. Compiled at first use with NVRTC for sm_90a (``wgmma``
exists on no other architecture): ``wgmma_status`` says why it is off anywhere else, and the
dispatcher then keeps the Triton kernels.
"""

from __future__ import annotations

import functools

import torch

from qerl_kit.kernels import nvrtc
from qerl_kit.kernels.backend import register_linear_op
from lab.cuda_pipeline import K_STEP, PIPELINE, launch, warp_stage, x_tiles

CONSUMER_WARPS, TILES = 8, 2  # two consumer warpgroups, each warp two 16-row tiles
ROWS = 16 * TILES * CONSUMER_WARPS  # weight rows per block
THREADS = 32 * (4 + CONSUMER_WARPS)  # a producer warpgroup, then the consumers
STAGES = 4  # weight and x stages in flight (6 was slower: bench/results/proto_wgmma_gemm_h200.md)
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

# The block: a producer warpgroup (warps 0-3) feeding two consumer warpgroups (warps 4-11) through
# full/empty mbarrier rings, no block barrier in the K loop (module docstring).
WARP_SPECIALIZED = r"""
// -- Warp specialization: mbarriers --
__device__ __forceinline__ void mbar_init(u32 a, u32 n) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(a), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 a) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" :: "r"(a) : "memory");
}
// The barrier's current phase also waits for the cp.async copies this thread issued so far.
__device__ __forceinline__ void cp_mbar_arrive(u32 a) {
    asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" :: "r"(a) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 a, u32 parity) {
    asm volatile("{\n.reg .pred P1;\nLAB_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
                 "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}" :: "r"(a), "r"(parity) : "memory");
}

// y[M, N] = x[M, K] @ W^T (+ bias), M <= 8 * MT; grid (ceil(N / 256), K slices of `ips` steps),
// 384 threads. Shared memory: S x stages (2048 MT bytes, the wgmma B layout), S weight stages
// (8 consumer warps x warp_stage<2>, the layout load_fragments reads), then the full[S] and
// empty[S] mbarriers.
template <int MT, int S>
__device__ __forceinline__ void gemm_ws(ARGS) {
    constexpr int NT = 2, CW = 8, ROWS = 16 * NT * CW, WSB = warp_stage<NT>(), XB = 2048 * MT, WB = CW * WSB;
    extern __shared__ uint4 smem[];
    unsigned char* sb = reinterpret_cast<unsigned char*>(smem);
    const u32 base = (u32)__cvta_generic_to_shared(smem);
    const u32 waddr = base + S * XB, bar = base + S * XB + S * WB;  // full[s]: bar + 8 s, empty[s]: bar + 8 (S + s)
    const int steps = K / 128;
    const int it0 = blockIdx.y * ips, it1 = min(steps, it0 + ips);
    const int tile0 = blockIdx.x * ROWS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; s++) {
            mbar_init(bar + 8 * s, 128);        // the producer's 128 threads (and their tracked copies)
            mbar_init(bar + 8 * (S + s), 256);  // the consumers' 256 threads
        }
    }
    __syncthreads();

    float c[NT][MT][4];
    #pragma unroll
    for (int nt = 0; nt < NT; nt++)
        #pragma unroll
        for (int mt = 0; mt < MT; mt++) c[nt][mt][0] = c[nt][mt][1] = c[nt][mt][2] = c[nt][mt][3] = 0.f;
    int row = N;  // the producer has no rows of its own: the epilogue skips them
    if (warp < 4) {  // producer: x one K step ahead in registers, weights by cp.async
        uint4 xs[MT];
        if (it0 < it1) load_x<MT, 128>(xs, x, M, ldx, it0);
        for (int it = it0; it < it1; it++) {
            const int i = it - it0, s = i % S;
            mbar_wait(bar + 8 * (S + s), ((i / S) & 1) ^ 1);  // the consumers released the stage (round 0: at once)
            #pragma unroll
            for (int j = 0; j < 8; j++) {  // 256 rows x 64 code bytes: 1024 copies of 16 bytes
                const int ci = threadIdx.x + 128 * j, r = ci >> 2, p = ci & 3, n = tile0 + r;
                cp_async16(waddr + s * WB + (r >> 5) * WSB + (r & 31) * 64 + 16 * p,
                           q + (size_t)(n < N ? n : 0) * ldq + it * 64 + 16 * p, n < N ? 16 : 0);
            }
            #pragma unroll
            for (int j = 0; j < 2; j++) {  // 256 rows x 8 scale bytes
                const int r = threadIdx.x + 128 * j, n = tile0 + r;
                cp_async8(waddr + s * WB + (r >> 5) * WSB + 16 * NT * 64 + (r & 31) * 8,
                          sc + (size_t)(n < N ? n : 0) * lds + it * 8, n < N ? 8 : 0);
            }
            cp_mbar_arrive(bar + 8 * s);
            WgOverlap<MT, NT, 128>::store_x(xs, reinterpret_cast<u32*>(sb + s * XB));  // ends in fence.proxy.async
            mbar_arrive(bar + 8 * s);
            if (it + 1 < it1) load_x<MT, 128>(xs, x, M, ldx, it + 1);
        }
    } else {  // consumers: the shipped decoding and wgmma layout
        const int cw = warp - 4;
        row = tile0 + cw * 16 * NT + g;
        for (int it = it0; it < it1; it++) {
            const int i = it - it0, s = i % S;
            mbar_wait(bar + 8 * s, (i / S) & 1);
            WgOverlap<MT, NT, 256>::compute(sb + S * XB + s * WB + cw * WSB, c, base + s * XB, lane, g, t);
            mbar_arrive(bar + 8 * (S + s));  // compute() ended with wgmma.wait_group 0: the stage is free
        }
    }
    store_tile<MT, NT, 384, ROWS>(c, row, t, tile0, M, N, gsp, bias, has_bias, y, ldy, ws, counters);
}
"""

# The shipped kernels: one 384-thread block per SM (registers: 136 at 32 rows, 168 at 64).
SOURCE = PIPELINE + LAYOUT + WARP_SPECIALIZED + r"""
extern "C" __global__ void __launch_bounds__(384, 1) nvfp4_wgmma_m32(ARGS) { gemm_ws<4, 4>(CALL); }
extern "C" __global__ void __launch_bounds__(384, 1) nvfp4_wgmma_m64(ARGS) { gemm_ws<8, 4>(CALL); }
"""


def shared_bytes(mt: int) -> int:
    """Dynamic shared memory of a block: STAGES x and weight stages, then 2 STAGES mbarriers."""
    return STAGES * (2048 * mt + CONSUMER_WARPS * warp_stage(TILES)) + 16 * STAGES


def choose_ips(m: int, n: int, k: int, sms: int | None = None) -> int:
    """K steps per slice: K is split until the grid covers the GPU about once, one block per SM.
    On all 32 cells of the route table that ``preferred`` sends here, the best of this split and
    half and twice as many slices was this one."""
    from qerl_kit.kernels.splitk import sm_count  # cached once per process

    sms = sms or sm_count()
    steps = k // K_STEP
    slices = max(1, min(steps, sms // -(-n // ROWS)))
    return -(-steps // slices)


def _kernel_name(mt: int) -> str:
    return f"nvfp4_wgmma_m{8 * mt}"


@functools.lru_cache(maxsize=None)
def _compiled(mt: int, device_index: int):
    kernel = nvrtc.compile_kernel(SOURCE, _kernel_name(mt), device_index, arch=ARCH)
    kernel.set_shared_memory_config(shared_bytes(mt))  # over 48 KB: an opt-in
    return kernel


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
    """Whether this kernel beat the dispatcher's Triton path at this size on the H200.
    Session 8's rule (bench/results/route_wgmma_h200.md: every Qwen2.5 7B-72B layer at
    24/32/48/64 rows, the single-role kernel against the dispatcher, in one run): layers of 2^26
    weights and more with N >= 5120 and either N >= 8192 or K >= 16384 (1.00-1.44x); up to 32
    rows also K >= 5120 (7B's K = 3584 layers lost, 0.91-0.97x), from 33 rows more than 2^26
    weights (72B o, exactly 2^26, lost at 64 rows, 0.91x). Session 9 (the warp-specialized
    kernel, 0.79-0.98x the single-role one's time wherever both were timed) adds the wide layers
    (N >= ``WIDE_N``, where the dispatcher runs the tiled Triton GEMM) from 33 rows when K >= 5120:
    32B and 72B gate_up 1.16-1.23x at 33/48/64 rows, 7B gate_up (K = 3584) 0.89-0.96x
    (bench/results/proto_wgmma_gemm_h200.md). Smaller or narrower layers lost, down to 0.13x (k/v)."""
    from qerl_kit.kernels.routes import WIDE_N

    w = n * k
    if not MIN_M <= m <= MAX_M or n < 5120 or w < 1 << 26 or (n < 8192 and k < 16384):
        return False
    if m <= 32:
        return k >= 5120
    return k >= 5120 if n >= WIDE_N else w > 1 << 26


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
    return launch(_compiled(mt, device), x, packed, scales, global_scale, bias, ips, mt,
                  warps=CONSUMER_WARPS, nt=TILES, threads=THREADS, shared_mem=shared_bytes(mt))


nvfp4_wgmma_cuda_op = register_linear_op("nvfp4_wgmma_cuda", nvfp4_wgmma_cuda)
