"""Prototype, NOT YET RUN ON A GPU: an NVFP4 CUDA kernel for 17..64 rows (GRPO's rollout batch).

Why: at 64 rows the Triton kernels run at 0.44-1.1x bf16 and the 7B NVFP4 engine decodes batch 64
at 0.86x the bf16 engine (docs/kernels.md, "In short"), while 8 prompts x 8 samples is exactly
that batch. Written on 2026-11-30 (session 6) after that session's device time was spent: it
compiles with NVRTC for sm_90 and ``emulate`` checks its data movement on the CPU
(tests/test_proto_cuda_gemm.py), but it has never run. On a GPU, ``python bench/proto_cuda_gemm.py``
checks it against the reference and times it against bf16 and the dispatcher at 1-64 rows, and
``--sweep`` adds other K splits at 32 and 64 rows, ``--engine`` times the 7B NVFP4 engine at
batch 24-64 with and without it.

Design (the CUDA decode kernel's MMA side, ``qerl_kit/kernels/nvfp4_decode_cuda.py``, with x
shared through shared memory instead of read per lane):

* Block of 8 warps over 256 weight rows (each warp two 16-row tiles, lanes holding rows g and
  g + 8 as in the decode kernel); the product is transposed, ``y^T = W x^T``, with 4 or 8 tiles of
  8 x rows on the MMA's N side (``MT``: up to 32 or 64 rows). K steps of 128 codes.
* Weights: each lane streams its 16-byte runs of ``packed`` (32 codes of rows g and g + 8) and
  their two scale bytes from global memory into registers, one step ahead, and dequantizes them
  exactly as the decode kernel does (the same K permutation: word i of a lane gives codes
  (0, 4), (1, 5) to one m16n8k16 step and (2, 6), (3, 7) to the next).
* x: every K step, the block stages x [8 * MT rows, 128] once into shared memory (two stages,
  one barrier per step), already permuted into that K order: chunk c = 2i + h holds, for each x
  row, the 16 logical k of MMA step (i, h); the 16-byte halves of a row are XOR-swizzled by
  bit 2 of the row so that both the staging stores and the ``ldmatrix`` reads are free of bank
  conflicts. One ``ldmatrix.x4`` gives the B fragments of two x tiles. The x traffic from L2 per
  K step is 8 * MT rows x 256 bytes against 256 rows x 64 bytes of weights, equal at 64 rows.
* Split K and the epilogue are the decode kernel's (``store_y``: float32 partials, the last block
  of a tile sums them in slice order; one launch, CUDA-graph safe with counters allocated once).

Expected ceiling (not measured): 128 flops per weight at 64 rows; at ~2/3 of the bf16 GEMM's
780 TFLOP/s that is ~20 weights per clock per SM, ~2x the bf16 matmul at 64 rows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from qerl_kit.kernels import nvfp4_decode_cuda as dec
from qerl_kit.kernels import nvrtc

K_STEP = 128
ROWS_PER_BLOCK = 256
THREADS = 256

# The decode kernel's device helpers (bit placement, scale conversion, loads, mma, the split-K
# epilogue store_y, the ARGS/CALL parameter lists), reused as is.
_HELPERS = dec.SOURCE[:dec.SOURCE.index("// One K step's weights")]

SOURCE = _HELPERS + r"""
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Word index in a stage of the permuted x: chunk c (MMA step 2i + h), x row m, logical k (even).
template <int MT>
__device__ __forceinline__ int xword(int c, int m, int k) {
    return (c * 8 * MT + m) * 8 + ((((k >> 3) ^ (m >> 2)) & 1) << 2) + ((k & 7) >> 1);
}

struct Step1 { uint4 q[2][2]; u32 s[2][2]; };  // tiles x rows (g, g + 8): 32 codes, 2 scale bytes

__device__ __forceinline__ void load_w(Step1& st, const unsigned char* q, int ldq, const unsigned char* sc,
                                       int lds, int row, int N, int it, int t) {
    #pragma unroll
    for (int nt = 0; nt < 2; nt++)
        #pragma unroll
        for (int r = 0; r < 2; r++) {
            const int n = row + 16 * nt + 8 * r;
            if (n < N) {
                st.q[nt][r] = ld_stream(q + (size_t)n * ldq + it * 64 + 16 * t);
                st.s[nt][r] = ld_u16(sc + (size_t)n * lds + it * 8 + 2 * t);
            } else {
                st.q[nt][r] = make_uint4(0, 0, 0, 0);
                st.s[nt][r] = 0;
            }
        }
}

// This thread's share of x for K step `it`: 16-byte runs u = tid + 256 j of the [8 MT, 128] tile,
// run u = (row m, word i, lane t) with t fastest, then 8 rows, then i, then the next 8 rows.
template <int MT>
__device__ __forceinline__ void load_x(uint4 (&xs)[MT / 2], const u16* x, int M, int ldx, int it) {
    #pragma unroll
    for (int j = 0; j < MT / 2; j++) {
        const int u = threadIdx.x + THREADS_ * j;
        const int t = u & 3, m = ((u >> 7) << 3) | ((u >> 2) & 7), i = (u >> 5) & 3;
        const int mr = m < M ? m : M - 1;  // rows past M fill MMA columns that are never written
        xs[j] = __ldg(reinterpret_cast<const uint4*>(x + (size_t)mr * ldx + it * 128 + 32 * t + 8 * i));
    }
}

template <int MT>
__device__ __forceinline__ void store_x(const uint4 (&xs)[MT / 2], u32* stage) {
    #pragma unroll
    for (int j = 0; j < MT / 2; j++) {
        const int u = threadIdx.x + THREADS_ * j;
        const int t = u & 3, m = ((u >> 7) << 3) | ((u >> 2) & 7), i = (u >> 5) & 3;
        const uint4 v = xs[j];
        stage[xword<MT>(2 * i, m, 2 * t)] = __byte_perm(v.x, v.z, 0x5410);          // x0, x4
        stage[xword<MT>(2 * i, m, 2 * t + 8)] = __byte_perm(v.x, v.z, 0x7632);      // x1, x5
        stage[xword<MT>(2 * i + 1, m, 2 * t)] = __byte_perm(v.y, v.w, 0x5410);      // x2, x6
        stage[xword<MT>(2 * i + 1, m, 2 * t + 8)] = __byte_perm(v.y, v.w, 0x7632);  // x3, x7
    }
}

template <int MT>
__device__ __forceinline__ void compute(const Step1& st, float (&c)[2][MT][4], u32 stage_addr, int lane, int g) {
    u32 s[2][2][2];  // tile, row (g, g + 8), words 0-1 / 2-3
    #pragma unroll
    for (int nt = 0; nt < 2; nt++)
        #pragma unroll
        for (int r = 0; r < 2; r++) {
            s[nt][r][0] = scale_bf16x2(st.s[nt][r]);
            s[nt][r][1] = scale_bf16x2(st.s[nt][r] >> 8);
        }
    const int lm = lane & 7, lq = lane >> 3;  // ldmatrix: this lane's row within matrix lq
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        #pragma unroll
        for (int h = 0; h < 2; h++) {
            u32 b[MT][2];
            #pragma unroll
            for (int mp = 0; mp < MT / 2; mp++) {  // matrices: (tile 2mp, k 0-7), (2mp, 8-15), (2mp+1, ...)
                const int m = 8 * (2 * mp + (lq >> 1)) + lm;
                u32 r4[4];
                ldmatrix_x4(r4, stage_addr + 4 * xword<MT>(2 * i + h, m, 8 * (lq & 1)));
                b[2 * mp][0] = r4[0]; b[2 * mp][1] = r4[1]; b[2 * mp + 1][0] = r4[2]; b[2 * mp + 1][1] = r4[3];
            }
            #pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                const uint4 qg = st.q[nt][0], qh = st.q[nt][1];
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

// y[M, N] = x[M, K] @ W^T (+ bias), M <= 8 * MT; grid (ceil(N / 256), K slices of `ips` steps).
template <int MT>
__device__ __forceinline__ void gemm(ARGS) {
    extern __shared__ uint4 smem[];
    u32* stages = reinterpret_cast<u32*>(smem);
    const int stage_words = 8 * 8 * MT * 8;  // 8 chunks x 8 MT rows x 32 bytes
    const u32 smem_addr = (u32)__cvta_generic_to_shared(stages);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int steps = K / 128;
    const int it0 = blockIdx.y * ips, it1 = min(steps, it0 + ips);
    const int tile0 = blockIdx.x * 256;
    const int row = tile0 + warp * 32 + g;

    float c[2][MT][4];
    #pragma unroll
    for (int nt = 0; nt < 2; nt++)
        #pragma unroll
        for (int mt = 0; mt < MT; mt++) c[nt][mt][0] = c[nt][mt][1] = c[nt][mt][2] = c[nt][mt][3] = 0.f;

    Step1 cur, nxt;
    uint4 xs[MT / 2];
    load_w(cur, q, ldq, sc, lds, row, N, it0, t);
    load_x<MT>(xs, x, M, ldx, it0);
    store_x<MT>(xs, stages);
    __syncthreads();
    for (int it = it0; it < it1; it++) {
        const int s = (it - it0) & 1;
        const bool more = it + 1 < it1;
        if (more) {
            load_w(nxt, q, ldq, sc, lds, row, N, it + 1, t);
            load_x<MT>(xs, x, M, ldx, it + 1);
        }
        compute<MT>(cur, c, smem_addr + 4 * s * stage_words, lane, g);
        if (more) store_x<MT>(xs, stages + (s ^ 1) * stage_words);
        __syncthreads();
        cur = nxt;
    }

    store_y<2, MT>(c, row, t, tile0, 256, M, N, gsp, bias, has_bias, y, ldy, ws, counters);
}

extern "C" __global__ void __launch_bounds__(256) nvfp4_gemm_m32(ARGS) { gemm<4>(CALL); }
extern "C" __global__ void __launch_bounds__(256) nvfp4_gemm_m64(ARGS) { gemm<8>(CALL); }
""".replace("THREADS_", str(THREADS))


def config(m: int, n: int, k: int, sms: int = 132) -> tuple[int, int]:
    """(x tiles MT, K steps per slice): one block per SM is what the registers allow (about 170 per
    thread at MT = 8), so K is split until the grid covers the GPU about twice."""
    mt = 4 if m <= 32 else 8
    steps = k // K_STEP
    blocks_n = -(-n // ROWS_PER_BLOCK)
    slices = max(1, min(steps, round(2 * sms / blocks_n)))
    return mt, -(-steps // slices)


def shared_bytes(mt: int) -> int:
    return 2 * 8 * (8 * mt) * 32


def nvfp4_gemm_cuda(x, packed, scales, global_scale, bias=None, ips=None):
    """y = x @ W^T (+ bias) for x [17..64, K] bf16 on the GPU (any 1..64 rows work)."""
    from qerl_kit.kernels.nvfp4_gemv_triton import _counters

    m, n, k = x.shape[0], packed.shape[0], packed.shape[1] * 2
    aligned = (x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 and packed.stride(1) == 1
               and packed.stride(0) % 16 == 0 and packed.data_ptr() % 16 == 0 and scales.stride(1) == 1
               and scales.stride(0) % 2 == 0)
    if not (x.is_cuda and x.dtype == torch.bfloat16 and 1 <= m <= 64 and k % K_STEP == 0 and n % 16 == 0
            and aligned):
        raise ValueError(f"proto_cuda_gemm: needs bf16 CUDA x with 1..64 rows, K % 128 == 0, N % 16 == 0 and "
                         f"16-byte aligned rows; got x {tuple(x.shape)} {x.dtype}, weight {tuple(packed.shape)}")
    mt, auto_ips = config(m, n, k, torch.cuda.get_device_properties(x.device).multi_processor_count)
    ips = ips or auto_ips
    slices = -(-(k // K_STEP) // ips)
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    ws = torch.empty(slices * m * n if slices > 1 else 1, dtype=torch.float32, device=x.device)
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    kernel = nvrtc.compile_kernel(SOURCE, f"nvfp4_gemm_m{8 * mt}", device)
    kernel(grid=(-(-n // ROWS_PER_BLOCK), slices, 1), block=(THREADS, 1, 1), shared_mem=shared_bytes(mt),
           args=[x, m, x.stride(0), packed, packed.stride(0), scales.view(torch.uint8), scales.stride(0),
                 global_scale, bias if bias is not None else y, int(bias is not None), y, y.stride(0), ws,
                 _counters(x.device), n, k, ips],
           stream=torch.cuda.current_stream(x.device))
    return y


# -- CPU emulation of the data movement ----------------------------------------------------------

def xword(mt: int, c: int, m: int, k: int) -> int:
    """SOURCE's xword<MT>: a stage's word index for chunk c, x row m, logical k (even)."""
    return (c * 8 * mt + m) * 8 + ((((k >> 3) ^ (m >> 2)) & 1) << 2) + ((k & 7) >> 1)


def emulate(x: torch.Tensor, w: torch.Tensor, mt: int) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (float64) computed through the kernel's data movement: x staged thread
    by thread into a stage (store_x's word addresses and byte permutes), B fragments read back with
    ldmatrix's lane -> row-address rule, A fragments from the weight's K permutation (codes (2h,
    2h + 4) and (2h + 1, 2h + 5) of lane t's word i), and the m16n8k16 MMA's register layout.
    Arithmetic is float64 on dequantized values: this checks the indexing, not the bit tricks
    (tests/test_decode_cuda.py checks those)."""
    M, K = x.shape
    N = w.shape[0]
    rows = 8 * mt
    assert M <= rows and K % K_STEP == 0 and N % 16 == 0
    y = torch.zeros(rows, N, dtype=torch.float64)
    for it in range(K // K_STEP):
        stage = [None] * (8 * rows * 8)  # words: pairs of (x value, x value)
        for tid in range(THREADS):      # store_x
            for j in range(mt // 2):
                u = tid + THREADS * j
                t, m, i = u & 3, ((u >> 7) << 3) | ((u >> 2) & 7), (u >> 5) & 3
                mr = m if m < M else M - 1
                v = x[mr, it * 128 + 32 * t + 8 * i: it * 128 + 32 * t + 8 * i + 8].double()
                for word, (c, kk) in zip(((v[0], v[4]), (v[1], v[5]), (v[2], v[6]), (v[3], v[7])),
                                         ((2 * i, 2 * t), (2 * i, 2 * t + 8), (2 * i + 1, 2 * t), (2 * i + 1, 2 * t + 8))):
                    idx = xword(mt, c, m, kk)
                    assert stage[idx] is None, "two stores to one shared word"
                    stage[idx] = word
        assert all(s is not None for s in stage), "a shared word left unwritten"
        for tile0 in range(0, N, 16):   # one 16-row weight tile (any warp, any nt: the same mapping)
            for i in range(4):
                for h in range(2):
                    c = 2 * i + h
                    # ldmatrix.x4 for the tile pair mp: lane L gives the address of row (L & 7) of
                    # matrix L >> 3; thread (g, t) then receives elements (g, 2t), (g, 2t + 1) of each.
                    B = torch.zeros(16, rows, dtype=torch.float64)  # logical k x x row
                    for mp in range(mt // 2):
                        addr = {}
                        for L in range(32):
                            lm, lq = L & 7, L >> 3
                            m = 8 * (2 * mp + (lq >> 1)) + lm
                            addr[(lq, lm)] = xword(mt, c, m, 8 * (lq & 1))  # first word of a 16-byte row
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3
                            for q in range(4):  # r4[q]: matrix q, its row g, words t
                                pair = stage[addr[(q, g)] + t]
                                tile, khalf = 2 * mp + (q >> 1), q & 1
                                # b0 (khalf 0) = B[k = 2t, 2t + 1][n = g], b1 = B[2t + 8, 2t + 9][g]
                                B[8 * khalf + 2 * t, 8 * tile + g] = pair[0]
                                B[8 * khalf + 2 * t + 1, 8 * tile + g] = pair[1]
                    # A fragment of lane (g, t): a0 = W[g][k 2t, 2t+1] <- codes (2h, 2h + 4) of its word i
                    A = torch.zeros(16, 16, dtype=torch.float64)
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        base = it * 128 + 32 * t + 8 * i
                        for r in (g, g + 8):
                            wr = w[tile0 + r].double()
                            A[r, 2 * t], A[r, 2 * t + 1] = wr[base + 2 * h], wr[base + 2 * h + 4]
                            A[r, 2 * t + 8], A[r, 2 * t + 9] = wr[base + 2 * h + 1], wr[base + 2 * h + 5]
                    y[:, tile0:tile0 + 16] += (A @ B).t()
    return y[:M]


def engine(model_name: str = "Qwen2.5-7B", batches=(24, 32, 64), new: int = 128) -> None:
    """The 7B NVFP4 engine (fused decode step, CUDA graphs, LoRA r 32) with its 17..64-row
    projections on the dispatcher and then on this kernel, in one run (``--engine``)."""
    import bench_rollout as br

    from qerl_kit import kernels

    original = kernels.nvfp4_linear

    def routed(x, packed, scales, global_scale, bias=None, backend=None):
        if x.dim() == 2 and 17 <= x.shape[0] <= 64 and x.is_cuda and packed.shape[1] * 2 % K_STEP == 0:
            return nvfp4_gemm_cuda(x, packed, scales, global_scale, bias)
        return original(x, packed, scales, global_scale, bias, backend)

    for name in ("nvfp4_gemm_m32", "nvfp4_gemm_m64"):  # compiled before any graph capture
        nvrtc.compile_kernel(SOURCE, name, torch.cuda.current_device())
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


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if "--engine" in sys.argv:
        return engine()
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
            ips = config(m, n, k)[1]
            print(f"| {n} x {k} | {m} | {ips} | {err:.1e} | {t_cuda * 1e6:.1f} | {t_disp * 1e6:.1f} | "
                  f"{t_bf * 1e6:.1f} | {t_bf / t_cuda:.2f} | {t_bf / t_disp:.2f} |", flush=True)
            if sweep and m in (32, 64):  # other K splits: slices of 1..16
                steps = k // K_STEP
                for other in sorted({-(-steps // sl) for sl in (1, 2, 3, 4, 6, 8, 12, 16)} - {ips}):
                    t = time_graph([lambda w=w: nvfp4_gemm_cuda(x, *w, ips=other) for w in weights])
                    print(f"| {n} x {k} | {m} | {other} | | {t * 1e6:.1f} | | | {t_bf / t:.2f} | |", flush=True)
        del weights, dense
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
