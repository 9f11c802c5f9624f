"""CPU emulation of the mma.sync prototype's data movement (lab/proto_cuda_gemm.py): the x
stage layout, ldmatrix's reads, the weights' K permutation and shared-memory stage, lane by lane
(lab/tests/test_proto_cuda_gemm.py). Plain Python and torch: no GPU."""

from __future__ import annotations

import torch

from lab.proto_cuda_gemm import K_STEP


def weight_stage_writes(nt: int) -> dict:
    """SOURCE's load_w<NT> for one warp: shared byte offset -> (local row, byte of the row's 64
    code bytes, or "s" + byte of its 8 scale bytes) of one K step."""
    out = {}
    for lane in range(32):
        for j in range(2 * nt):
            c = lane + 32 * j
            r, p = c >> 2, c & 3
            for b in range(16):
                out[r * 64 + 16 * p + b] = (r, 16 * p + b)
        if nt == 2 or lane < 16 * nt:
            for b in range(8):
                out[16 * nt * 64 + lane * 8 + b] = (lane, f"s{b}")
    return out


def weight_stage_reads(nt: int) -> dict:
    """SOURCE's compute for one warp: (lane, tile, row half) -> the 16 code bytes and 2 scale
    bytes it reads, as (local row, byte) pairs through weight_stage_writes."""
    writes = weight_stage_writes(nt)
    reads = {}
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for tile in range(nt):
            for half in range(2):
                lr = 16 * tile + 8 * half + g
                codes = [writes[lr * 64 + 16 * t + b] for b in range(16)]
                scales = [writes[16 * nt * 64 + lr * 8 + 2 * t + b] for b in range(2)]
                reads[lane, tile, half] = codes + scales
    return reads

def run_of(u: int) -> tuple[int, int, int]:
    """SOURCE's load_x/store_x: 16-byte run u of x [8 MT, 128] -> (lane t, x row m, word i), t
    fastest, then 8 rows, then i, then the next 8 rows."""
    return u & 3, ((u >> 7) << 3) | ((u >> 2) & 7), (u >> 5) & 3


def store_x_words(x: torch.Tensor, mt: int, it: int):
    """store_x of K step ``it``, whichever thread does it: (chunk c, x row m, k slot, (value,
    value)) for every 4-byte word written; rows past M repeat row M - 1. Both layouts (xword,
    proto_wgmma_gemm.xoff) place these words."""
    M = x.shape[0]
    for u in range(128 * mt):
        t, m, i = run_of(u)
        k0 = it * K_STEP + 32 * t + 8 * i
        v = x[min(m, M - 1), k0:k0 + 8].double()
        for (lo, hi), (c, ks) in zip(((0, 4), (1, 5), (2, 6), (3, 7)),
                                     ((2 * i, 2 * t), (2 * i, 2 * t + 8), (2 * i + 1, 2 * t), (2 * i + 1, 2 * t + 8))):
            yield c, m, ks, (v[lo], v[hi])


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
        for c, m, kk, word in store_x_words(x, mt, it):
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


def staging_banks(word_of, mt: int) -> list:
    """For each warp and each of store_x's four stores: the set of shared-memory banks its 32
    lanes write, with ``word_of(c, m, k)`` the 4-byte word a layout gives chunk c, x row m and
    k slot k (32 distinct banks: no conflict)."""
    out = []
    for warp in range(128 * mt // 32):
        for which in range(4):
            banks = set()
            for lane in range(32):
                t, m, i = run_of(warp * 32 + lane)
                banks.add(word_of(2 * i + (which >> 1), m, 2 * t + 8 * (which & 1)) % 32)
            out.append(banks)
    return out
