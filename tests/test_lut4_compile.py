"""The NF4/MXFP4 Triton kernels compile for the H200 (sm_90) on a machine without a GPU, at the
tile configs the launchers use (every BLOCK_M of the GEMV; K = 3584 and Qwen2.5-0.5B's K = 896),
without spilling registers to the stack, the one-row GEMV and the dequantize with 16-byte loads.

Triton compiles ahead of time with its bundled ptxas (``triton.compile`` of an ``ASTSource`` for a
``GPUTarget``); the interpreter tests (tests/test_lut4_kernels.py) cannot catch what only the GPU
compiler sees (layouts, tl.dot shapes, register pressure, vectorized loads). The compile runs in a subprocess with
``TRITON_INTERPRET`` unset (under the interpreter ``@triton.jit`` functions cannot be compiled).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import os, re, subprocess, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qerl_kit.kernels import lut4_triton as L
from bench.bench_lut4_sweep import candidates

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}

def compiled(fn, types, consts, **options):
    """(registers, stack bytes, 16-byte global loads) of ``fn`` compiled for sm_90. Pointers and the
    sizes / row strides are marked divisible by 16, as the JIT specializes them at a call with
    aligned tensors (real layer shapes)."""
    sig = {**types, **{k: "constexpr" for k in consts}}
    aligned = [a for a, t in types.items() if t.startswith("*") or a in ("N", "K") or a.startswith("stride_") and
               not a.endswith(("k", "yn"))]
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs={(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    kernel = triton.compile(src, target=TARGET, options=options)
    vector_loads = len(re.findall(r"ld\.global[.\w]*\.v4", kernel.asm["ptx"]))
    path = "/tmp/qerl_lut4_%d.cubin" % os.getpid()
    open(path, "wb").write(kernel.asm["cubin"])
    usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    os.remove(path)
    return (int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1)),
            vector_loads)

# (rows, K): every BLOCK_M (1, 16, 32, 64) at 7B's K = 3584, and one row and 64 rows at Qwen2.5-0.5B's
# K = 896 (not a multiple of 256: the one-row BLOCK_K and the dequantize's BLOCK_K become 128)
GEMV = [(1, 3584), (8, 3584), (32, 3584), (64, 3584), (1, 896), (64, 896)]
for fmt in ("nf4", "mxfp4"):
    scales = "*fp32" if fmt == "nf4" else "*u8"
    lut = "*fp32" if fmt == "nf4" else "*u8"  # MXFP4: packed, a dummy pointer (lut4_triton.lut)
    for dt in ("bf16", "fp16", "fp32"):
        for m, k in GEMV:
            cfg = L.gemv_config(m, 4608, k, fmt, interpret=False)
            types = dict(x_ptr=PTR[dt], p_ptr="*u8", s_ptr=scales, lut_ptr=lut, b_ptr=PTR[dt], y_ptr=PTR[dt],
                         ws_ptr="*fp32", cnt_ptr="*i32", M="i32", N="i32", K="i32", stride_xm="i32", stride_xk="i32",
                         stride_pn="i32", stride_sn="i32", stride_ym="i32", stride_yn="i32")
            consts = dict(FMT=L.FORMAT_IDS[fmt], BS=L.BLOCK_SIZES[fmt], HAS_BIAS=True, INTERPRET=False,
                          IEEE=dt == "fp32", EVEN_K=k % cfg["BLOCK_K"] == 0, USE_DOT=cfg["USE_DOT"],
                          SPLIT_K=cfg["SPLIT_K"], BLOCK_M=L.gemv_block_m(m, cfg["USE_DOT"]),
                          BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"])
            regs, stack, vec = compiled(L._lut4_gemv_kernel, types, consts, num_warps=cfg["num_warps"],
                                        num_stages=cfg["num_stages"])
            print("gemv", fmt, dt, m, k, consts["EVEN_K"], regs, vec, stack)
            if dt == "bf16" and cfg["USE_DOT"] and k == 3584:  # every candidate bench_lut4_sweep times
                for name, over in candidates(fmt, m).items():
                    c = {**cfg, **over}
                    split = L.choose_split_k(4608, k, c["BLOCK_N"], c["BLOCK_K"], 2)  # as lut4_gemv picks it
                    regs, stack, vec = compiled(
                        L._lut4_gemv_kernel, types,
                        dict(consts, BLOCK_K=c["BLOCK_K"], SPLIT_K=split),
                        num_warps=c["num_warps"], num_stages=c["num_stages"])
                    print("variant", fmt, dt, m, k, name, regs, vec, stack)
        types = dict(p_ptr="*u8", s_ptr=scales, lut_ptr=lut, w_ptr=PTR[dt], N="i32", K="i32", stride_pn="i32",
                     stride_sn="i32", stride_wn="i32")
        for k in (3584, 896):
            bn, bk = L.dequant_config(k, interpret=False)
            for even_n in (True, False):
                consts = dict(FMT=L.FORMAT_IDS[fmt], BS=L.BLOCK_SIZES[fmt], EVEN_N=even_n, EVEN_K=k % bk == 0,
                              BLOCK_N=bn, BLOCK_K=bk)
                regs, stack, vec = compiled(L._lut4_dequant_kernel, types, consts, num_warps=4)
                print("dequant", fmt, dt, even_n, k, consts["EVEN_K"], regs, vec, stack)
'''


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spilling():
    pytest.importorskip("triton.compiler", reason="needs triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0 and "ImportError" in proc.stderr and "GPUTarget" in proc.stderr:
        pytest.skip("this Triton has no ahead-of-time GPUTarget API")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("gemv", "dequant"))]
    assert len(rows) == 2 * 3 * (6 + 4)
    variants = [line.split() for line in proc.stdout.splitlines() if line.startswith("variant")]
    # bench_lut4_sweep's candidates at the MMA row counts of K = 3584 (8, 32, 64 rows), bf16: each format's
    # 6 + 4 + 4 (BLOCK_K 256 only up to 16 rows)
    assert len(variants) == 2 * (6 + 4 + 4), len(variants)
    assert not [v for v in variants if int(v[-1]) != 0], f"register spills in the sweep's candidates: {variants}"
    # BLOCK_K divides K at every shape here (3584, 896): whole tiles, no masks along K
    assert all(r[5] == "True" for r in rows), [r for r in rows if r[5] != "True"]
    spilled = [r for r in rows if int(r[-1]) != 0]
    print("\n".join(" ".join(r) for r in rows))
    assert not spilled, f"register spills (bytes of stack): {spilled}"
    # one row and the dequantize: packed rows stream as 16-byte vectors (no software pipeline moves
    # them through shared memory), at K = 896 too
    scalar = [r for r in rows if (r[0] == "dequant" or r[3] == "1") and int(r[-2]) == 0]
    assert not scalar, f"no 16-byte loads of the packed weight: {scalar}"
    assert {r[4] for r in rows if r[0] == "gemv" and r[3] == "1"} == {"3584", "896"}
