"""NVFP4 -> dense bf16/fp16 weight in CUDA C: the first half of the large-M ("dense") strategy.

From a few hundred rows on, the forward and the input gradient dequantize the weight into a
transient bf16 W and call cuBLAS (``nvfp4_gemm_triton.DENSE_MIN_M``). That pass reads 4.5 bits
and writes 16 bits per weight, so it is pure bandwidth: one thread per 16-code block loads its
8 bytes of codes and its scale byte and writes 32 bytes of W, coalesced along the row.

It computes exactly what the reference does (``qerl_kit.nvfp4.dequantize``): the scale over the
global scale in float32 (IEEE division), times the code's value in float32, rounded once to the
output type, so the result is bit-identical to it (NaN scale bytes give NaN, as there). The code
and scale bytes become float32 by bit placement (exact for every E2M1 code and E4M3 byte).

Compiled at first use with NVRTC (``qerl_kit.kernels.nvrtc``); when that is unavailable
``nvfp4_dequantize`` keeps its Triton kernel.
"""

from __future__ import annotations

import functools

import torch

from qerl_kit.kernels import nvrtc

SOURCE = r"""
typedef unsigned int u32;

// E2M1 code (bits 0..3) -> float32, exact: 0.5 is 2^-1, magnitudes m >= 2 are ((m >> 1) + 126, m & 1).
__device__ __forceinline__ float e2m1(u32 c) {
    const u32 m = c & 7;
    const u32 bits = m >= 2 ? (m + 252) << 22 : (m == 1 ? 0x3F000000u : 0u);
    return __uint_as_float(bits | ((c & 8) << 28));
}

// float8_e4m3fn byte -> float32, exact (subnormals m * 2^-9; 0x7F and 0xFF are NaN).
__device__ __forceinline__ float e4m3(u32 b) {
    const u32 a = b & 0x7F;
    float v = (a >> 3) ? __uint_as_float((a << 20) + (120u << 23)) : (float)(a & 7) * 0.001953125f;
    if (a == 0x7F) v = __uint_as_float(0x7FC00000u);
    return (b & 0x80) ? -v : v;
}

template <bool BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {  // lo -> the lower address
    u32 d;
    if (BF16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// W[n, 16 j .. 16 j + 15] for every (n, j): thread i takes block i of the row-major [N, K / 16] grid.
template <bool BF16>
__device__ __forceinline__ void dequant(const unsigned char* __restrict__ q, int ldq,
                                        const unsigned char* __restrict__ sc, int lds,
                                        const float* __restrict__ gsp, uint4* __restrict__ w, int ldw,
                                        int N, int KB) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)N * KB) return;
    const int n = (int)(i / KB), j = (int)(i - (long long)n * KB);
    const uint2 p = __ldg(reinterpret_cast<const uint2*>(q + (size_t)n * ldq + 8 * j));
    const float eff = __fdiv_rn(e4m3(sc[(size_t)n * lds + j]), gsp[0]);
    u32 out[8];
    #pragma unroll
    for (int b = 0; b < 8; b++) {
        const u32 byte = ((b < 4 ? p.x : p.y) >> (8 * (b & 3))) & 0xFF;  // low nibble: the even element
        out[b] = pack2<BF16>(__fmul_rn(e2m1(byte & 15), eff), __fmul_rn(e2m1(byte >> 4), eff));
    }
    uint4* dst = w + ((size_t)n * ldw + 16 * j) / 8;
    dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
    dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
}

#define ARGS const unsigned char* __restrict__ q, int ldq, const unsigned char* __restrict__ sc, int lds, \
             const float* __restrict__ gsp, uint4* __restrict__ w, int ldw, int N, int KB
extern "C" __global__ void __launch_bounds__(256) nvfp4_dequant_bf16(ARGS) { dequant<true>(q, ldq, sc, lds, gsp, w, ldw, N, KB); }
extern "C" __global__ void __launch_bounds__(256) nvfp4_dequant_f16(ARGS) { dequant<false>(q, ldq, sc, lds, gsp, w, ldw, N, KB); }
"""

THREADS = 256
NAMES = {torch.bfloat16: "nvfp4_dequant_bf16", torch.float16: "nvfp4_dequant_f16"}


@functools.lru_cache(maxsize=None)
def dequant_cuda_status() -> tuple[bool, str]:
    """(usable, reason): whether this kernel compiles and runs here, decided once per process."""
    return nvrtc.status(SOURCE, tuple(NAMES.values()), (8, 0), "cvt.rn.bf16x2.f32")


def supports(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether this kernel takes the weight (8-byte aligned rows of codes); the rest go to Triton."""
    return (packed.is_cuda and dtype in NAMES and packed.dtype == torch.uint8 and packed.stride(1) == 1
            and packed.stride(0) % 8 == 0 and packed.data_ptr() % 8 == 0 and scales.stride(1) == 1
            and packed.shape[0] * (packed.shape[1] // 8) < 2**31)


def nvfp4_dequantize_cuda(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dense W [N, K] in ``dtype`` (bf16 or fp16), bit-identical to ``qerl_kit.nvfp4.dequantize``."""
    if not supports(packed, scales, dtype):
        raise ValueError(f"nvfp4_dequantize_cuda: unsupported call (packed {tuple(packed.shape)} "
                         f"{packed.dtype} on {packed.device}, {dtype}): needs a CUDA uint8 weight with "
                         "8-byte aligned rows and a bf16 or fp16 output")
    n, k = packed.shape[0], packed.shape[1] * 2
    w = torch.empty((n, k), dtype=dtype, device=packed.device)
    if n == 0 or k == 0:
        return w
    blocks = n * (k // 16)
    device = packed.device.index if packed.device.index is not None else torch.cuda.current_device()
    kernel = nvrtc.compile_kernel(SOURCE, NAMES[dtype], device)
    kernel(grid=(-(-blocks // THREADS), 1, 1), block=(THREADS, 1, 1),
           args=[packed, packed.stride(0), scales.view(torch.uint8), scales.stride(0),
                 global_scale.to(torch.float32), w, k, n, k // 16],
           stream=torch.cuda.current_stream(packed.device))
    return w
