"""Benchmark the NVFP4 kernels against torch's bf16 matmul on the same GPU, in the same run.

For the linear layers of Qwen2.5-7B/14B/32B/72B (shapes from ``qerl_kit.models.PRESETS``) and
M in {1, 8, 64, 256, 2048, 8192} rows, it times

* ours:   ``qerl_kit.kernels.nvfp4_linear`` on the backend the run is on (``QERL_KERNEL_BACKEND``;
          ``ours`` for our kernels alone, ``auto`` for the routing table with humming)
* bf16:   ``torch.nn.functional.linear`` with a dense bf16 weight of the same shape
* dgrad:  ``nvfp4_dgrad`` vs ``dy @ W`` in bf16, at the training sizes (M >= 256)

and measures the ceilings in the same run: the device-to-device copy bandwidth of a 2 GiB
buffer (bytes read + written) and the TFLOP/s of an 8192^3 bf16 matmul on random data.

Timing: each measurement captures a CUDA graph of R back-to-back calls that cycle through enough
copies of the weight (> 3x the L2 size) that no call finds its weight in L2, replays it after a
warm-up, and reports the median replay time / R (CUDA events). Inputs are random, never zeros.

    python -m bench.bench_nvfp4_gemm --out bench/results          # full table
    python -m bench.bench_nvfp4_gemm --sweep --out /tmp/sweep     # tile configs
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from qerl_kit.kernels import nvfp4_dgrad, nvfp4_linear
from qerl_kit.models import PRESETS

MODELS = ["Qwen2.5-7B", "Qwen2.5-14B", "Qwen2.5-32B", "Qwen2.5-72B"]
MS = [1, 8, 64, 256, 2048, 8192]
ROTATE_BYTES = 200 << 20  # > 3x the H200's 50-60 MB L2


# -- shapes ---------------------------------------------------------------------------------------

def layer_shapes(name: str) -> list[tuple[str, int, int]]:
    """(projection, N, K) of one decoder layer; equal shapes share a row (q/o, k/v, gate/up),
    plus the fused qkv and gate_up projections that serving engines run."""
    p = PRESETS[name]
    h, inter = p["hidden_size"], p["intermediate_size"]
    hd = p.get("head_dim", h // p["num_attention_heads"])
    q, kv = p["num_attention_heads"] * hd, p["num_key_value_heads"] * hd
    shapes = {}
    for proj, n, k in [("q", q, h), ("k/v", kv, h), ("o", h, q), ("gate/up", inter, h),
                       ("down", h, inter), ("qkv (fused)", q + 2 * kv, h), ("gate_up (fused)", 2 * inter, h)]:
        shapes.setdefault((n, k), []).append(proj)
    return [("/".join(v) if v != ["q", "o"] else "q/o", n, k) for (n, k), v in shapes.items()]


# -- random operands ------------------------------------------------------------------------------

def random_nvfp4(n: int, k: int, device="cuda"):
    """Random but valid NVFP4 tensors: any byte is a pair of codes; finite positive E4M3 scales."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    scales = (torch.rand(n, k // 16, device=device) * 300 + 8).to(torch.float8_e4m3fn)
    gscale = torch.tensor([2688.0 / 0.05], device=device)  # as for a weight with amax 0.05
    return packed, scales, gscale


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# -- timing ---------------------------------------------------------------------------------------

def time_graph(calls: list, min_total_ms: float = 2.0, reps: int = 10) -> float:
    """Median seconds per call over graph replays of the calls (cycled)."""
    for c in calls:  # eager warm-up: compiles, autotunes
        c()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    calls[0]()
    torch.cuda.synchronize()
    est = max(time.perf_counter() - t0, 1e-6)
    r = max(len(calls), min(400, math.ceil(min_total_ms * 1e-3 / est)))
    if est * r * reps > 1.0:
        reps = max(3, int(1.0 / (est * r)))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        calls[0]()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(r):
                calls[i % len(calls)]()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / r)
    del graph
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes read + written per second copying a 2 GiB buffer: the better of cudaMemcpy
    (``copy_``) and an SM copy kernel (``torch.mul(src, 1, out=dst)``)."""
    src = torch.randn(1 << 29, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    t_memcpy = time_graph([lambda: dst.copy_(src)], reps=10)
    t_kernel = time_graph([lambda: torch.mul(src, 1.0, out=dst)], reps=10)
    return 2 * (1 << 31) / min(t_memcpy, t_kernel)


def bf16_gemm_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = time_graph([lambda: a @ b], reps=10)
    return 2 * n ** 3 / t / 1e12


def copies_for(bytes_per_copy: int) -> int:
    return max(1, min(256, math.ceil(ROTATE_BYTES / bytes_per_copy)))


# -- one shape ------------------------------------------------------------------------------------

def path_taken(kind: str, m: int, n: int, k: int) -> str:
    """The kernel the routing table sends this call to on the backend the run uses."""
    from qerl_kit.kernels import route

    a = torch.empty(m, k if kind == "forward" else n, device="cuda", dtype=torch.bfloat16)
    return route("forward" if kind == "forward" else "dgrad", a,
                 torch.empty(n, k // 2, device="cuda", dtype=torch.uint8),
                 torch.empty(n, k // 16, device="cuda", dtype=torch.float8_e4m3fn))


ROUNDS = 3  # ours and bf16 alternate this many times per cell; each side keeps its best


def time_alternating(sides: dict, rounds: int = ROUNDS) -> dict:
    """{name: seconds}: ``time_graph`` of each side's calls, the sides alternated ``rounds`` times
    in order, the best of each. Timed one after the other once, two sides saw different clock and
    power states (the same code's 72B gate_up cell at 2048 rows read 0.81x in one run and 0.94x in
    another, with bf16 itself 7% apart); alternating and keeping each side's best removes that drift."""
    times = {name: [] for name in sides}
    for _ in range(rounds):
        for name, calls in sides.items():
            times[name].append(time_graph(calls))
    return {name: min(t) for name, t in times.items()}


def time_ab(ours: list, base: list, rounds: int = ROUNDS) -> tuple[float, float]:
    """(ours, bf16) seconds, alternated (``time_alternating``)."""
    t = time_alternating({"ours": ours, "base": base}, rounds)
    return t["ours"], t["base"]


def _cell(m: int, n: int, k: int, ours: float, base: float, err: float) -> dict:
    moved = n * k // 2 + n * k // 16 + 4 + 2 * m * k + 2 * m * n
    return dict(t_ours_us=ours * 1e6, t_bf16_us=base * 1e6, speedup=base / ours, bytes=moved,
                gbps=moved / ours / 1e9, tflops=2 * m * n * k / ours / 1e12,
                tflops_bf16=2 * m * n * k / base / 1e12, rel_err=err)


def _copies(n: int, k: int) -> tuple[list, list]:
    """Enough NVFP4 and bf16 copies of an [n, k] weight that every timed call reads from HBM."""
    weights = [random_nvfp4(n, k) for _ in range(copies_for(n * k // 2 + n * k // 16))]
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(2 * n * k))]
    return weights, dense


def bench_forward(m: int, n: int, k: int) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weights, dense = _copies(n, k)
    ours, base = time_ab([lambda w=w: nvfp4_linear(x, *w) for w in weights],
                         [lambda w=w: F.linear(x, w) for w in dense])
    return _cell(m, n, k, ours, base, check_error(x, weights[0]))


def bench_dgrad(m: int, n: int, k: int) -> dict:
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    weights, dense = _copies(n, k)
    ours, base = time_ab([lambda w=w: nvfp4_dgrad(dy, *w) for w in weights], [lambda w=w: dy @ w for w in dense])
    return _cell(m, n, k, ours, base, float("nan"))


def check_error(x, w) -> float:
    """Relative error of the kernel against a float32 reference on these inputs (bf16 tolerance)."""
    from qerl_kit.kernels.reference import nvfp4_linear_ref

    xs = x[:256]
    ref = nvfp4_linear_ref(xs.float(), *w)
    y = nvfp4_linear(xs, *w).float()
    return ((y - ref).norm() / ref.norm()).item()


# -- the full table -------------------------------------------------------------------------------

def target(m: int, row: dict, copy_bw: float) -> str:
    if m <= 16:
        ok = row["speedup"] >= 3 and row["gbps"] * 1e9 >= 0.7 * copy_bw
        return "yes" if ok else "no"
    if m >= 2048:
        return "yes" if row["speedup"] >= 0.85 else "no"
    return ""


def run_full(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    import triton

    info = dict(gpu=props.name, sms=props.multi_processor_count, date=datetime.date.today().isoformat(),
                torch=torch.__version__, triton=triton.__version__)
    print(info, flush=True)
    copy_bw = copy_bandwidth()
    peak = bf16_gemm_tflops()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s, bf16 GEMM {peak:.0f} TFLOP/s", flush=True)
    rows, measured = [], {}
    started = time.time()
    # Every shape's M <= 64 cells first, then the large ones: right after seconds of full-power
    # GEMMs the SM clock is still lowered, which slowed the issue-bound decode kernels by up to 28%
    # when M = 1 of one layer followed M = 8192 of the one before (bf16's GEMV, memory-bound, not).
    phases = [[m for m in args.ms if m <= 64], [m for m in args.ms if m > 64]]
    place = {(model, proj): i for model in args.models for i, (proj, _, _) in enumerate(layer_shapes(model))}
    for model, ms in ((model, ms) for ms in phases for model in args.models):
        if time.time() - started > args.budget_s:
            print(f"time budget spent; {model} and later models not measured", flush=True)
            break
        for proj, n, k in layer_shapes(model):
            for m in ms:
                for kind in ("forward", "dgrad"):
                    if kind == "dgrad" and m < 256:
                        continue
                    key = (kind, m, n, k)  # 14B and 32B share shapes: measure each once
                    if key not in measured:
                        measured[key] = (bench_forward if kind == "forward" else bench_dgrad)(m, n, k)
                        measured[key]["path"] = path_taken(kind, m, n, k)
                    row = dict(model=model, proj=proj, kind=kind, M=m, N=n, K=k, **measured[key])
                    row["bw_frac"] = row["gbps"] * 1e9 / copy_bw
                    row["tc_frac"] = row["tflops"] / peak
                    row["target_met"] = target(m, row, copy_bw) if kind == "forward" else (
                        "yes" if m >= 2048 and row["speedup"] >= 0.85 else ("no" if m >= 2048 else ""))
                    rows.append(row)
                    print(f"{model:12s} {proj:22s} {kind:7s} M={m:5d} N={n:6d} K={k:6d} "
                          f"ours {row['t_ours_us']:9.1f}us bf16 {row['t_bf16_us']:9.1f}us "
                          f"x{row['speedup']:5.2f} {row['gbps']:7.0f}GB/s ({row['bw_frac']:.0%}) "
                          f"{row['tflops']:6.1f}TF ({row['tc_frac']:.0%}) {row['target_met']}",
                          flush=True)
        torch.cuda.empty_cache()
        rows.sort(key=lambda r: (args.models.index(r["model"]), place[r["model"], r["proj"]], r["M"]))
        write_results(out, info, copy_bw, peak, rows, quiet=True)  # partial results survive a timeout
    print(f"benchmark took {time.time() - started:.0f}s", flush=True)
    write_results(out, info, copy_bw, peak, rows)


def write_results(out: Path, info: dict, copy_bw: float, peak: float, rows: list[dict],
                  quiet: bool = False) -> None:
    fields = list(rows[0])
    with open(out / "nvfp4_gemm_h200.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()})
    lines = [
        "# NVFP4 kernels vs torch bf16 matmul",
        "",
        f"GPU: {info['gpu']} ({info['sms']} SMs), date {info['date']}, torch {info['torch']}, "
        f"triton {info['triton']}.",
        f"Same-run ceilings: device-to-device copy {copy_bw / 1e12:.2f} TB/s (bytes read + written), "
        f"bf16 GEMM 8192^3 {peak:.0f} TFLOP/s (random data).",
        "",
        "Times are medians of CUDA-graph replays with the weight rotated through > 200 MB of copies "
        f"(cold L2); ours and bf16 alternate {ROUNDS} times per cell and each keeps its best. "
        "`path`: the routing table's kernel (qerl_kit/kernels/routes.py; humming where installed, "
        "`cuda_decode` our CUDA C decode kernel, `triton_gemv` the Triton decode kernel, `triton_tiles` / "
        "`triton_dgrad` the fused Triton kernels, `dense` Triton dequantization into a transient bf16 W, "
        "then cuBLAS). `x bf16` = bf16 time / our time. "
        "`BW` = (packed + scales + x + y bytes) / time, as a fraction of the copy bandwidth. "
        "`TC` = our TFLOP/s as a fraction of the bf16 GEMM's. "
        "Targets: M <= 16: x bf16 >= 3 and BW >= 70%; M >= 2048: x bf16 >= 0.85.",
        "",
    ]
    for kind in ("forward", "dgrad"):
        sel = [r for r in rows if r["kind"] == kind]
        if not sel:
            continue
        lines += [f"## {kind}", "",
                  "| model | proj | M | N | K | path | ours us | bf16 us | x bf16 | BW | TC | target |",
                  "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
        for r in sel:
            lines.append(f"| {r['model'].replace('Qwen2.5-', '')} | {r['proj']} | {r['M']} | {r['N']} | {r['K']} | "
                         f"{r['path']} | {r['t_ours_us']:.1f} | {r['t_bf16_us']:.1f} | {r['speedup']:.2f} | "
                         f"{r['bw_frac']:.0%} | {r['tc_frac']:.0%} | {r['target_met']} |")
        lines.append("")
    lines += summary(rows)
    (out / "nvfp4_gemm_h200.md").write_text("\n".join(lines) + "\n")
    if not quiet:
        print("\n".join(summary(rows)))


def summary(rows: list[dict]) -> list[str]:
    lines = ["## Summary", ""]
    for kind, ms in [("forward", [1, 8]), ("forward", [64]), ("forward", [256]), ("forward", [2048, 8192]),
                     ("dgrad", [256]), ("dgrad", [2048, 8192])]:
        sel = [r for r in rows if r["kind"] == kind and r["M"] in ms]
        if not sel:
            continue
        sp = [r["speedup"] for r in sel]
        bw = [r["bw_frac"] for r in sel]
        met = [r["target_met"] for r in sel if r["target_met"]]
        lines.append(f"- {kind} M in {ms}: x bf16 median {statistics.median(sp):.2f} "
                     f"(min {min(sp):.2f}, max {max(sp):.2f}); BW median {statistics.median(bw):.0%}"
                     + (f"; target met {met.count('yes')}/{len(met)}" if met else ""))
    return lines + [""]


# -- tile-config sweep (tuning aid; not part of the committed results) ----------------------------

def run_sweep(args) -> None:
    from qerl_kit.kernels.nvfp4_dgrad_triton import nvfp4_dgrad as dgrad
    from qerl_kit.kernels.nvfp4_gemm_triton import nvfp4_gemm as gemm
    from qerl_kit.kernels.nvfp4_gemv_triton import nvfp4_gemv as gemv

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    copy_bw = copy_bandwidth()
    peak = bf16_gemm_tflops()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s, bf16 GEMM {peak:.0f} TFLOP/s", flush=True)

    def g(bn, bk, w, s, dot=True, **kw):
        return dict(BLOCK_N=bn, BLOCK_K=bk, USE_DOT=dot, num_warps=w, num_stages=s, **kw)

    def t(bm, bn, bk, w, s, swap=False, **kw):
        return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SWAP_AB=swap, GROUP_M=8, num_warps=w,
                    num_stages=s, **kw)

    gemv_m1 = [g(32, 512, 4, 4, False), g(16, 1024, 4, 4, False), g(64, 256, 4, 4, False),
               g(64, 256, 4, 4), g(64, 256, 4, 4, SPLIT_K=1), g(64, 512, 4, 3), g(128, 256, 8, 3),
               g(128, 256, 4, 3), g(64, 256, 4, 4, FAST=False)]
    gemv_dot = [g(64, 256, 4, 4), g(64, 256, 4, 4, SPLIT_K=1), g(64, 512, 4, 3), g(128, 256, 8, 3),
                g(128, 256, 4, 3), g(64, 128, 4, 4)]
    gemm_cfgs = [t(128, 128, 64, 8, 4), t(128, 256, 64, 8, 3), t(256, 128, 64, 8, 3),
                 t(128, 128, 128, 8, 3), t(64, 128, 128, 4, 4),
                 t(128, 128, 64, 8, 4, True), t(128, 256, 64, 8, 3, True), t(256, 128, 64, 8, 3, True),
                 t(128, 128, 128, 8, 3, True), t(64, 256, 64, 8, 3, True)]
    dgrad_cfgs = [t(128, 64, 128, 8, 4), t(128, 64, 256, 8, 3), t(128, 128, 128, 8, 3),
                  t(64, 64, 128, 4, 4), t(256, 64, 128, 8, 3),
                  t(128, 64, 128, 8, 4, True), t(128, 64, 256, 8, 3, True), t(128, 128, 64, 8, 4, True)]
    plan = []
    for n, k in [(4608, 3584), (3584, 18944), (8192, 29568), (37888, 3584)]:
        plan += [("gemv", 1, n, k, c) for c in gemv_m1]
        plan += [("gemv", 8, n, k, c) for c in gemv_dot]
        plan += [("gemv", 64, n, k, c) for c in gemv_dot  # these two spill or overflow smem at BM=64
                 if c["BLOCK_K"] <= 256 and not (c["BLOCK_N"] == 128 and c["num_warps"] == 4)]
        plan += [("gemm", 64, n, k, c) for c in (t(64, 128, 128, 4, 4, True), t(64, 256, 64, 8, 3, True))]
    for n, k in [(37888, 3584), (3584, 18944), (8192, 8192)]:
        plan += [("gemm", m, n, k, c) for m in (2048, 8192) for c in gemm_cfgs]
        plan += [("gemm", 256, n, k, c) for c in gemm_cfgs[3:8]]
        plan += [("dgrad", m, n, k, c) for m in (2048, 8192) for c in dgrad_cfgs]
    fns = dict(gemv=gemv, gemm=gemm, dgrad=dgrad)
    rows, cache = [], {}
    started = time.time()
    for kind, m, n, k, cfg in plan:
        if time.time() - started > args.budget_s:
            print("sweep budget spent; stopping", flush=True)
            break
        key = (n, k)
        if key not in cache:
            cache.clear()
            torch.cuda.empty_cache()
            q_bytes = n * k // 2 + n * k // 16
            cache[key] = [random_nvfp4(n, k) for _ in range(copies_for(q_bytes))]
        weights = cache[key]
        a = torch.randn(m, k if kind != "dgrad" else n, device="cuda", dtype=torch.bfloat16)
        opts = {kk: cfg[kk] for kk in ("FAST",) if kk in cfg}
        conf = {kk: v for kk, v in cfg.items() if kk not in opts}
        fn = fns[kind]
        try:
            sec = time_graph([lambda w=w: fn(a, *w, config=conf, **opts) for w in weights], reps=5)
        except Exception as e:  # out of resources, compile errors: record and go on
            print(f"{kind} M={m} N={n} K={k} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        moved = n * k // 2 + n * k // 16 + 2 * m * (n + k)
        row = dict(kind=kind, M=m, N=n, K=k, cfg=str(cfg), us=sec * 1e6, bw_frac=moved / sec / copy_bw,
                   tc_frac=2 * m * n * k / sec / 1e12 / peak)
        rows.append(row)
        print(f"{kind:5s} M={m:5d} N={n:6d} K={k:6d} {sec * 1e6:9.1f}us BW {row['bw_frac']:5.0%} "
              f"TC {row['tc_frac']:5.0%}  {cfg}", flush=True)
    with open(out / "sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"sweep took {time.time() - started:.0f}s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--ms", nargs="+", type=int, default=MS)
    ap.add_argument("--sweep", action="store_true", help="time explicit tile configs instead")
    ap.add_argument("--budget-s", type=float, default=600.0,
                    help="stop starting new work (sweep configs, models) after this many seconds")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU")
    torch.manual_seed(0)
    (run_sweep if args.sweep else run_full)(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
