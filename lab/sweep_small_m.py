"""Sweep explicit launch configs of the NVFP4 small-M kernels (M = 8..64) against torch's bf16 matmul.

For the Qwen2.5-7B and -32B projections q/o, fused qkv, fused gate_up and down (shapes from
``qerl_kit.models.PRESETS``) and M in {8, 16, 32, 64} it measures, on one GPU:

* bf16:      ``F.linear`` with a dense bf16 weight of the same shape;
* dispatch:  ``qerl_kit.kernels.nvfp4_linear``, what ``NVFP4Linear`` runs (autotuned decode kernel);
* configs:   the decode tensor-core kernel (``_nvfp4_gemv_kernel``, USE_DOT; split-K from
             ``choose_split_k(N, K, BLOCK_N, BLOCK_K, CTAS)`` as the dispatch does) and the fused tiled
             GEMM kernel (``_nvfp4_gemm_kernel``, with and without SWAP_AB), launched directly with
             explicit meta-parameters (no autotuner).

Each config is first checked against a float32 reference on fresh random inputs (rejected if the
relative error is > 1e-2 or NaN), then timed as in bench_nvfp4_gemm.py: a CUDA graph cycling through
weight copies rotated over > 200 MB (cold L2), median replay time. Every binary is compiled once, up
front, in parallel worker processes (they fill Triton's disk cache); ``--budget`` stops starting new
work after that many seconds and still reports what it has. Results: a markdown summary on stdout and
sweep_small_m.{json,csv,md} in --out.

    python -m lab.sweep_small_m --out "${OUT:-lab/results/sweep}"   # H200, < 200 s
    TRITON_INTERPRET=1 python -m lab.sweep_small_m --smoke          # CPU, correctness only
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, wait
from pathlib import Path

_T0 = time.time()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench.bench_nvfp4_gemm import copies_for, layer_shapes, random_nvfp4, time_graph  # noqa: E402

MODELS = ["Qwen2.5-7B", "Qwen2.5-32B"]
PROJS = ["q/o", "qkv (fused)", "gate_up (fused)", "down"]
MS = [8, 16, 32, 64]
MAX_REL_ERR = 1e-2
CHECK_N, CHECK_K = 512, 1024  # operands the compile workers launch on (same specialisation as the real shapes)


def dec(bn, bk, warps, stages, ctas):
    return dict(kernel="decode", BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, CTAS=ctas)


def gem(bm, bn, bk, warps, stages, swap):
    return dict(kernel="gemm", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, SWAP_AB=swap)


# Decode kernel (BLOCK_N, BLOCK_K, num_warps, num_stages), each with CTAS = 2 and 4 (split-K target, programs
# per SM); the current dispatch autotunes over 64x128 w4 s4 c2, 64x128 w4 s6 c4 and 64x256 w4 s4 c2.
DECODE = [dec(*t, c) for t in [(32, 256, 4, 4), (64, 64, 4, 4), (64, 128, 4, 2), (64, 128, 4, 4), (64, 128, 4, 6),
                               (64, 256, 4, 3), (64, 256, 4, 4), (64, 256, 8, 4), (64, 512, 4, 3), (128, 64, 4, 4),
                               (128, 128, 4, 2), (128, 128, 4, 4), (128, 128, 8, 4), (128, 256, 4, 3), (128, 256, 8, 2),
                               (128, 256, 8, 3), (256, 64, 8, 4), (256, 128, 8, 3)] for c in (2, 4)]
# Fused tiled GEMM (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), transposed (SWAP_AB) and not; no split-K.
GEMM = [gem(*t, True) for t in [(16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 64, 4, 4), (16, 128, 128, 4, 4),
                                (16, 128, 256, 4, 3), (16, 128, 256, 8, 3), (16, 256, 64, 8, 4), (16, 256, 128, 8, 3),
                                (32, 64, 128, 4, 4), (32, 128, 128, 4, 4), (32, 128, 256, 8, 3), (32, 256, 128, 8, 3),
                                (64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 4, 4), (64, 256, 64, 8, 3),
                                (64, 256, 128, 8, 3)]]
GEMM += [gem(*t, False) for t in [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (16, 128, 256, 4, 3), (32, 128, 128, 4, 4),
                                  (64, 64, 128, 4, 4), (64, 128, 128, 4, 4), (64, 256, 64, 8, 3)]]
SMOKE = [dec(16, 32, 4, 1, 2), dec(32, 64, 4, 1, 4), gem(16, 16, 32, 4, 1, True), gem(16, 32, 64, 4, 1, False)]


def kernels():
    from qerl_kit.kernels import nvfp4_gemm_triton as gm, nvfp4_gemv_triton as gv

    return gm, gv


def name(c) -> str:
    tile = f"n{c['BLOCK_N']}k{c['BLOCK_K']}w{c['num_warps']}s{c['num_stages']}"
    if c["kernel"] == "decode":
        return f"dec {tile}c{c['CTAS']}"
    return f"gemm{'S' if c['SWAP_AB'] else ''} m{c['BLOCK_M']}{tile}"


def block_m(c, m: int) -> int:
    return max(16, kernels()[0].m_bucket(m)) if c["kernel"] == "decode" else c["BLOCK_M"]


def applies(c, m: int) -> bool:  # a GEMM row tile taller than the padded M only wastes work
    return c["kernel"] == "decode" or c["BLOCK_M"] <= max(16, kernels()[0].m_bucket(m))


def split_k(c, n: int, k: int) -> int:
    from qerl_kit.kernels.splitk import choose_split_k

    return choose_split_k(n, k, c["BLOCK_N"], c["BLOCK_K"], c["CTAS"]) if c["kernel"] == "decode" else 1


def ws_elems(c, m, n, split) -> int:
    return -(-n // c["BLOCK_N"]) * split * block_m(c, m) * c["BLOCK_N"] if c["kernel"] == "decode" and split > 1 else 1


def make_launch(c, x, w, y, ws, split):
    """A no-argument closure launching config c's kernel once: y = x @ W^T."""
    from qerl_kit.kernels.splitk import arrival_counters

    gm, gv = kernels()
    packed, scales, gs = w
    (m, k), n = x.shape, packed.shape[0]
    head = (x, packed, scales.view(torch.uint8), gs, y, y)
    strides = (x.stride(0), x.stride(1), packed.stride(0), scales.stride(0), y.stride(0), y.stride(1))
    meta = dict(HAS_BIAS=False, EVEN_K=k % c["BLOCK_K"] == 0, BLOCK_M=block_m(c, m), BLOCK_N=c["BLOCK_N"],
                BLOCK_K=c["BLOCK_K"], num_warps=c["num_warps"], num_stages=c["num_stages"],
                **gm.launch_options(x.device))
    if c["kernel"] == "decode":
        kern = gv._nvfp4_gemv_kernel.fn[(-(-n // c["BLOCK_N"]), split)]
        args = head + (ws, arrival_counters(x.device), m, n, k, gm.m_bucket(m)) + strides + (2,)
        meta.update(USE_DOT=True, PREFETCH=False, SPLIT_K=split)
    else:
        kern = gm._nvfp4_gemm_kernel.fn[(-(-m // c["BLOCK_M"]) * -(-n // c["BLOCK_N"]),)]
        args = head + (m, n, k, gm.m_bucket(m)) + strides
        meta.update(SWAP_AB=c["SWAP_AB"], GROUP_M=8)
    return lambda: kern(*args, **meta)


def compile_task(c, m, split):
    """In a worker process: compile and run (c, BLOCK_M, SPLIT_K) once; None or the error."""
    try:
        dev = "cuda" if torch.cuda.is_available() else "cpu"  # (the CPU only under TRITON_INTERPRET=1)
        w = random_nvfp4(CHECK_N, CHECK_K, dev)
        x = torch.randn(m, CHECK_K, device=dev, dtype=torch.bfloat16)
        y = torch.empty(m, CHECK_N, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
        make_launch(c, x, w, y, torch.empty(ws_elems(c, m, CHECK_N, split), device=dev), split)()
        if dev == "cuda":
            torch.cuda.synchronize()
        return None
    except Exception as e:  # out of resources, compile errors
        return f"{type(e).__name__}: {str(e)[:160]}"


def precompile(plan, jobs, timeout):
    """plan: {binary key: (config, m, split)}; returns {key: error} for the binaries that failed."""
    failed = {}
    try:
        pool = ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"))
        futs = {pool.submit(compile_task, *v): key for key, v in plan.items()}
        done, pending = wait(futs, timeout=max(timeout, 1.0))
    except Exception as e:  # no worker processes here: every binary compiles on first use instead
        print(f"precompile failed ({type(e).__name__}: {e}); compiling lazily", flush=True)
        return failed
    for f in done:  # keep resource/compile errors; CUDA faults or a broken pool: retry in this process
        err = None if f.exception() else f.result()
        if err and "CUDA" not in err:
            failed[futs[f]] = err
    print(f"precompiled {len(done)}/{len(plan)} binaries with {jobs} workers ({len(failed)} failed, "
          f"{len(pending)} left to compile lazily) at t={time.time() - _T0:.0f}s", flush=True)
    pool.shutdown(wait=not pending, cancel_futures=True)
    return failed


def rel_err(y, ref) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def geomean(v):
    return math.exp(sum(math.log(a) for a in v) / len(v)) if v else float("nan")


def measure(c, x, ref, y, ws, weights, n, k, failed, timed) -> dict:
    """Check config c on weights[0] against ref, then time it over all weight copies."""
    m = x.shape[0]
    split, bm = split_k(c, n, k), block_m(c, m)
    key = (name(c), bm, split)
    rec = dict(kernel=c["kernel"], config=name(c), block_m=bm, split=split, us=math.nan, rel_err=math.nan, status="ok")
    if key in failed:
        return dict(rec, status="failed: " + failed[key])
    try:
        y.fill_(math.nan)
        make_launch(c, x, weights[0], y, ws, split)()
        rec["rel_err"] = rel_err(y, ref)
        if not rec["rel_err"] <= MAX_REL_ERR:  # NaN is rejected too
            return dict(rec, status="rejected")
        rec["us"] = timed([make_launch(c, x, w, y, ws, split) for w in weights])
    except Exception as e:  # out of resources etc.
        failed[key] = f"{type(e).__name__}: {str(e)[:160]}"
        rec["status"] = "failed: " + failed[key]
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "lab/results/sweep")
    ap.add_argument("--budget", type=float, default=170.0, help="seconds (from start) after which no new work starts")
    ap.add_argument("--jobs", type=int,
                    help="compile worker processes (0: compile lazily; default 14 on a GPU, 0 for --smoke)")
    ap.add_argument("--ms", nargs="+", type=int, default=MS)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 4 configs, correctness only (CPU interpreter)")
    args = ap.parse_args()
    gpu = torch.cuda.is_available() and not args.smoke
    if not gpu and not args.smoke:
        sys.exit("this sweep needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
    from qerl_kit.kernels import nvfp4_linear
    from qerl_kit.kernels.reference import dequantize

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference in IEEE float32
    torch.manual_seed(0)
    if args.smoke:
        shapes, ms, configs = [("smoke", "tiny", 64, 128)], [m for m in args.ms if m <= 16] or [8, 16], SMOKE
    else:
        shapes = [(mod, p, n, k) for mod in MODELS for p, n, k in layer_shapes(mod) if p in PROJS]
        ms, configs = args.ms, DECODE + GEMM
    plan = {}  # one binary per (config, BLOCK_M, SPLIT_K): N, K and M are not specialised on
    for _, _, n, k in shapes:
        for c, m in ((c, m) for m in ms for c in configs if applies(c, m)):
            plan.setdefault((name(c), block_m(c, m), split_k(c, n, k)), (c, block_m(c, m), split_k(c, n, k)))
    jobs = min(14, os.cpu_count() or 1) if args.jobs is None and gpu else (args.jobs or 0)
    failed = precompile(plan, jobs, 0.6 * args.budget - (time.time() - _T0)) if jobs > 0 else {}
    t_compiled = time.time() - _T0

    def timed(calls):
        return time_graph(calls, min_total_ms=1.0, reps=7) * 1e6 if gpu else math.nan

    rows, summary, stopped = [], [], False
    for (model, proj, n, k), m in ((s, m) for s in shapes for m in ms):
        if stopped or time.time() - _T0 > args.budget:
            stopped = True
            break
        if m == ms[0]:  # a new shape: weights rotated through > 200 MB, the dense bf16 ones, the reference W
            weights = dense = w_ref = None
            if gpu:
                torch.cuda.empty_cache()
            q_bytes = n * k // 2 + n * k // 16
            weights = [random_nvfp4(n, k, dev) for _ in range(copies_for(q_bytes) if gpu else 1)]
            dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                     for _ in range(copies_for(2 * n * k) if gpu else 0)]
            w_ref = dequantize(*weights[0], dtype=torch.float32)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)  # fresh inputs per (shape, M)
        ref = x.float() @ w_ref.T
        y = torch.empty(m, n, device=dev, dtype=torch.bfloat16 if gpu else torch.float32)
        todo = [c for c in configs if applies(c, m)]
        ws = torch.empty(max(ws_elems(c, m, n, split_k(c, n, k)) for c in todo), device=dev)
        moved = q_bytes + 2 * m * (n + k)
        shape = dict(model=model, proj=proj, N=n, K=k, M=m)
        t_bf16 = timed([lambda d=d: F.linear(x, d) for d in dense])
        recs = [dict(kernel="dispatch", config="dispatch", block_m=0, split=0, status="ok", rel_err=math.nan,
                     us=math.nan)]
        try:
            recs[0]["rel_err"] = rel_err(nvfp4_linear(x, *weights[0], backend="triton"), ref)
            recs[0]["us"] = timed([lambda w=w: nvfp4_linear(x, *w) for w in weights])
        except Exception as e:
            recs[0]["status"] = f"failed: {type(e).__name__}: {str(e)[:160]}"
        for c in todo:
            if time.time() - _T0 > args.budget:
                stopped = True
                break
            recs.append(measure(c, x, ref, y, ws, weights, n, k, failed, timed))
        new = [dict(shape, **r, bf16_us=t_bf16, speedup=t_bf16 / r["us"], gbps=moved / r["us"] / 1e3) for r in recs]
        rows += new
        if stopped:  # a partly measured (shape, M) stays in the rows only
            break
        good = sorted((r for r in new[1:] if r["status"] == "ok"), key=lambda r: r["us"])
        summary.append(dict(shape, bf16_us=t_bf16, dispatch_us=recs[0]["us"], dispatch_err=recs[0]["rel_err"],
                            top=[{f: r[f] for f in ("config", "split", "us", "speedup", "rel_err")} for r in good[:3]]))
        print(f"[{time.time() - _T0:4.0f}s] {model} {proj} N={n} K={k} M={m}: bf16 {t_bf16:.1f}us dispatch "
              f"{recs[0]['us']:.1f}us | " + "  ".join(f"{r['config']}/sk{r['split']} {r['us']:.1f}us"
                                                       for r in good[:3]),
              flush=True)
    report(args, gpu, rows, summary, ms, dict(gpu=torch.cuda.get_device_name() if gpu else "cpu (interpreter)",
                                              torch=torch.__version__, budget_s=args.budget, binaries=len(plan),
                                              compile_s=round(t_compiled, 1), stopped_by_budget=stopped))


def report(args, gpu, rows, summary, ms, info) -> None:
    best_per_m = {}
    for m in ms:
        sel = [s for s in summary if s["M"] == m]
        nks, by_cfg = {(s["N"], s["K"]) for s in sel}, {}
        for r in rows:
            if (r["M"] == m and (r["N"], r["K"]) in nks and r["kernel"] != "dispatch" and r["status"] == "ok"
                    and r["speedup"] > 0):
                by_cfg.setdefault((r["kernel"], r["config"]), []).append(r["speedup"])
        ranked = sorted(((geomean(v), kc) for kc, v in by_cfg.items() if len(v) == len(sel)), reverse=True)
        best_per_m[m] = dict(shapes=len(sel), dispatch=geomean([s["bf16_us"] / s["dispatch_us"] for s in sel]),
                             oracle=geomean([s["top"][0]["speedup"] for s in sel if s["top"]]),
                             top=[dict(kernel=kc[0], config=kc[1], geomean_speedup=g) for g, kc in ranked[:10]])
    info["elapsed_s"] = round(time.time() - _T0, 1)
    bad = [r for r in rows if r["status"] != "ok"]
    lines = [f"# NVFP4 small-M sweep: {info['gpu']}, {len(rows)} rows, {len(bad)} rejected/failed, "
             f"compile {info['compile_s']:.0f}s, total {info['elapsed_s']:.0f}s"
             + (", STOPPED BY --budget" if info["stopped_by_budget"] else ""), ""]
    lines += [f"- {r['config']} M={r['M']} {r['N']}x{r['K']} sk{r['split']}: {r['status'][:100]} "
              f"(err {r['rel_err']:.1e})"
              for r in bad[:6]] + ([f"- ... {len(bad) - 6} more in the JSON"] if len(bad) > 6 else [])
    lines += ["", "us = median time, (x) = bf16 time / time, /skN = the decode kernel's split-K, "
              "dec cN = split-K target N programs/SM", "",
              "| shape | M | bf16 | dispatch | best | 2nd | 3rd |", "|---|---:|---:|---:|---|---|---|"]
    for s in summary:
        cells = [f"{t['config']}/sk{t['split']} {t['us']:.1f} ({t['speedup']:.2f}x)" if gpu else
                 f"{t['config']} err {t['rel_err']:.1e}" for t in s["top"]] + ["", "", ""]
        lines.append(f"| {s['model'].replace('Qwen2.5-', '')} {s['proj']} {s['N']}x{s['K']} | {s['M']} "
                     f"| {s['bf16_us']:.1f} | {s['dispatch_us']:.1f} ({s['bf16_us'] / s['dispatch_us']:.2f}x) | "
                     + " | ".join(cells[:3]) + " |")
    lines += ["", "Best single config per M: geomean x bf16 over the shapes (oracle: the best config of each shape)",
              "", "| M | shapes | dispatch | oracle | #1 | #2 | #3 | best decode | best gemm |",
              "|---:|---:|---:|---:|---|---|---|---|---|"]
    for m, b in best_per_m.items():
        fam = [next((t for t in b["top"] if t["kernel"] == f), None) for f in ("decode", "gemm")]
        cells = [f"{t['config']} {t['geomean_speedup']:.2f}x" if t else "" for t in (b["top"] + [None] * 3)[:3] + fam]
        lines.append(f"| {m} | {b['shapes']} | {b['dispatch']:.2f}x | {b['oracle']:.2f}x | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_small_m.json").write_text(json.dumps(dict(info=info, summary=summary, best_per_m=best_per_m,
                                                            rows=rows), indent=1, default=str))
    with open(out / "sweep_small_m.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["status"])
        wr.writeheader()
        wr.writerows({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows)
    (out / "sweep_small_m.md").write_text(text)
    print(text + f"\n{json.dumps(info)}\nwrote {out}/sweep_small_m.{{json,csv,md}}", flush=True)
    if args.smoke and (bad or any(not s["dispatch_err"] <= MAX_REL_ERR for s in summary)):
        sys.exit(1)


if __name__ == "__main__":
    main()
