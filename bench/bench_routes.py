"""Per-layer NVFP4 forward: the routed path against humming-kernels, our kernels and bf16 cuBLAS.

For the linear layers of Qwen2.5 models (q/o, k/v, gate/up, down and the fused qkv and gate_up
that rollout engines run) and M rows, each cell times, alternated ``--rounds`` times (each side
keeps its best) inside CUDA graphs with the weight rotated through > 200 MB of copies (cold L2):

* ``routed``:  ``qerl_kit.kernels.nvfp4_linear`` on the auto backend (what ``NVFP4Linear`` runs);
* ``humming``: humming-kernels' GEMM on the same tensors (``nvfp4_humming.HummingGemm``);
* ``ours``:    ``nvfp4_linear(..., backend="ours")``: the routing table without humming;
* ``cuda``:    our CUDA C decode kernel where it takes the call (M <= 8): the M = 1..8 rule's input;
* ``bf16``:    ``torch.nn.functional.linear`` with a dense bf16 weight of the same shape.

It also times the eager per-call cost of an ``NVFP4Linear`` forward (``--eager``: 200
back-to-back calls at M = 8 on a 7B q/k/v-shaped layer, no graph) beside bf16 ``F.linear``.

    python -m bench.bench_routes --models Qwen2.5-7B Qwen2.5-14B --out $OUT   # part of the table
    python -m bench.bench_routes --eager --models --out $OUT                  # the eager table only

humming compiles each new layer shape at first use (13-15 s); a background process compiles the
run's shapes in order while the cells are timed, so the timing waits only for the first one.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.bench_nvfp4_gemm import copies_for, copy_bandwidth, layer_shapes, random_nvfp4, time_alternating
from bench.common import package_versions
from qerl_kit.kernels import nvfp4_linear, route
from qerl_kit.kernels.reference import nvfp4_linear_ref

MODELS = ["Qwen2.5-7B", "Qwen2.5-14B", "Qwen2.5-32B", "Qwen2.5-72B"]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048, 8192]


def versions() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return dict(gpu=props.name, sms=props.multi_processor_count, date=datetime.date.today().isoformat(),
                torch=torch.__version__, triton=triton.__version__, **package_versions(humming="humming-kernels"))


def start_compiler(shapes: list[tuple[int, int]], log: Path) -> subprocess.Popen:
    """A background process that compiles humming's kernels for these shapes, in order (the disk
    cache it fills is what this process then loads); its output goes to ``log``."""
    code = ("import torch; from qerl_kit.kernels import compile_shapes; "
            f"print(compile_shapes({shapes!r}, torch.bfloat16, 'cuda', progress=False), flush=True)")
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", code], stdout=log.open("w"), stderr=subprocess.STDOUT)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def bench_shape(n: int, k: int, ms: list[int], rounds: int) -> list[dict]:
    from qerl_kit.kernels import nvfp4_decode_cuda as dec
    from qerl_kit.kernels.nvfp4_humming import HummingGemm

    t0 = time.perf_counter()
    weights = [random_nvfp4(n, k) for _ in range(copies_for(n * k // 2 + n * k // 16))]
    hum = [HummingGemm(*w, torch.bfloat16) for w in weights]
    prep = time.perf_counter() - t0
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(2 * n * k))]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        sides = {"routed": [lambda w=w: nvfp4_linear(x, *w) for w in weights],
                 "humming": [lambda h=h: h(x) for h in hum],
                 "ours": [lambda w=w: nvfp4_linear(x, *w, backend="ours") for w in weights],
                 "bf16": [lambda d=d: F.linear(x, d) for d in dense]}
        ours_path = route("forward", x, *weights[0][:2], backend="ours")
        if m <= 8 and dec.supports(x, *weights[0][:2]) and dec.cuda_decode_status()[0] and ours_path != "cuda_decode":
            sides["cuda"] = [lambda w=w: dec.nvfp4_decode_cuda(x, *w) for w in weights]
        t = time_alternating(sides, rounds)
        xs = x[:256]
        ref = nvfp4_linear_ref(xs.float(), *weights[0])
        row = dict(M=m, N=n, K=k, route=route("forward", x, *weights[0][:2]), ours_path=ours_path,
                   **{f"{s}_us": v * 1e6 for s, v in t.items()},
                   err_routed=rel_err(nvfp4_linear(xs, *weights[0]), ref), err_humming=rel_err(hum[0](xs), ref))
        if "cuda" not in t:
            row["cuda_us"] = row["ours_us"] if ours_path == "cuda_decode" else float("nan")
        best = min(("humming", "ours", "cuda"), key=lambda s: row[f"{s}_us"] if row[f"{s}_us"] == row[f"{s}_us"] else 1e30)
        row["fastest"] = best if best != "ours" else ours_path
        rows.append(row)
        print(f"  M={m:5d} {n:6d}x{k:6d} route {row['route']:12s} routed {row['routed_us']:8.1f} humming "
              f"{row['humming_us']:8.1f} ours({ours_path}) {row['ours_us']:8.1f} cuda {row['cuda_us']:8.1f} "
              f"bf16 {row['bf16_us']:8.1f}  x{row['bf16_us'] / row['routed_us']:.2f}  err {row['err_routed']:.4f}",
              flush=True)
    del weights, hum, dense
    torch.cuda.empty_cache()
    return [dict(r, prep_s=prep) for r in rows]


def per_call_us(fn, calls: int = 200, repeats: int = 5) -> float:
    """Best of ``repeats`` of the mean host time per call of ``calls`` back-to-back eager calls."""
    best = float("inf")
    for _ in range(repeats):
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def bench_eager(n: int = 4608, k: int = 3584, m: int = 8) -> list[dict]:
    """Host cost per eager call of an NVFP4Linear forward, on each backend, against bf16."""
    from qerl_kit.kernels import set_backend
    from qerl_kit.linear import NVFP4Linear

    lin = torch.nn.Linear(k, n, bias=True, device="cuda", dtype=torch.bfloat16)
    q = NVFP4Linear.from_linear(lin)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    rows = []
    for backend in ("auto", "ours", "triton"):
        with set_backend(backend):
            kernel = route("forward", x, q.packed, q.scales)
            with torch.no_grad():
                t_nograd = per_call_us(lambda: q(x))
            t_grad = per_call_us(lambda: q(xg))
        rows.append(dict(what=f"NVFP4Linear, backend {backend} ({kernel})", no_grad_us=t_nograd, grad_us=t_grad))
    from qerl_kit.kernels import nvfp4_decode_cuda as dec
    from qerl_kit.kernels import nvfp4_gemv_triton as gv
    from qerl_kit.kernels.nvfp4_humming import gemm_for

    gemm = gemm_for(q.packed, q.scales, q.global_scale, torch.bfloat16)
    w = (q.packed, q.scales, q.global_scale)
    for what, fn in (("humming GEMM alone (HummingGemm call, no bias)", lambda: gemm(x)),
                     ("our CUDA decode kernel alone", lambda: dec.nvfp4_decode_cuda(x, *w)),
                     ("our Triton decode kernel alone", lambda: gv.nvfp4_gemv(x, *w))):
        rows.append(dict(what=what, no_grad_us=per_call_us(fn), grad_us=float("nan")))
    with torch.no_grad():
        rows.append(dict(what="bf16 nn.Linear", no_grad_us=per_call_us(lambda: lin(x)), grad_us=float("nan")))
        rows.append(dict(what="bf16 F.linear", no_grad_us=per_call_us(lambda: F.linear(x, lin.weight, lin.bias)),
                         grad_us=float("nan")))
    rows[-2]["grad_us"] = per_call_us(lambda: lin(xg))
    for r in rows:
        print(f"{r['what']:45s} no grad {r['no_grad_us']:7.1f} us   input needs grad {r['grad_us']:7.1f} us", flush=True)
    return rows


def write(out: Path, info: dict, copy_bw: float, rows: list[dict], eager: list[dict]) -> None:
    """routes.csv, eager.csv and routes.json in ``out`` (the GPU is in routes.json's info, not the names)."""
    out.mkdir(parents=True, exist_ok=True)
    if rows:
        with open(out / "routes.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows)
    if eager:
        with open(out / "eager.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(eager[0]))
            w.writeheader()
            w.writerows(eager)
    (out / "routes.json").write_text(json.dumps(dict(info=info, copy_bw=copy_bw), indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results/routes"))
    ap.add_argument("--models", nargs="*", default=MODELS)
    ap.add_argument("--ms", nargs="+", type=int, default=MS)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip", nargs="*", default=[], metavar="NxK", help="shapes measured elsewhere")
    ap.add_argument("--eager", action="store_true", help="also time the eager per-call cost")
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--report", nargs="*", metavar="CSV", help="write routes_h200.md from these runs' CSVs (CPU)")
    ap.add_argument("--eager-csv", help="with --report: the eager table's CSV")
    args = ap.parse_args()
    if args.report:
        return report(args.report, args.eager_csv, Path(args.out))
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU")
    torch.manual_seed(0)
    info = versions()
    print(info, flush=True)
    plan, seen = [], set(args.skip)
    for model in args.models:
        for proj, n, k in layer_shapes(model):
            if f"{n}x{k}" not in seen:
                seen.add(f"{n}x{k}")
                plan.append((model, proj, n, k))
    compiler = start_compiler([(n, k) for *_, n, k in plan], Path(args.out) / "compiler.log") if plan else None
    started = time.time()
    copy_bw = copy_bandwidth()
    eager = bench_eager() if args.eager else []
    rows: list[dict] = []
    for model, proj, n, k in plan:
        if time.time() - started > args.budget_s:
            print(f"time budget spent: {model} {proj} and later shapes not measured", flush=True)
            break
        print(f"{model} {proj} [{n} x {k}]", flush=True)
        rows += [dict(model=model, proj=proj, **r) for r in bench_shape(n, k, args.ms, args.rounds)]
        write(Path(args.out), info, copy_bw, rows, eager)  # partial results survive a timeout
    write(Path(args.out), info, copy_bw, rows, eager)
    if compiler is not None:
        compiler.kill()
    print(f"took {time.time() - started:.0f} s", flush=True)


# -- the committed table ---------------------------------------------------------------------------

def final_kernel(row: dict) -> str:
    """The kernel the routing table as it is now picks for a measured cell (all kernels available)."""
    from qerl_kit.kernels import routes

    m, n, k = int(row["M"]), int(row["N"]), int(row["K"])
    return next(r.kernel for r in routes.candidates("forward", m, n, k, torch.bfloat16)
                if r.kernel != "reference")


def report(csvs: list[str], eager_csv: str | None, out: Path) -> None:
    """bench/results/routes_h200.md from the runs' CSVs: per layer and M the table's kernel and its
    time (from the same alternation as the others), humming, our kernels, bf16; then the targets."""
    rows = [dict(r, run=Path(c).stem) for c in csvs for r in csv.DictReader(open(c))]
    info = json.loads(Path(csvs[0]).with_suffix(".json").read_text())["info"]
    f = float
    lines = ["# NVFP4 forward per layer: the routed path, humming-kernels, our kernels, bf16", "",
             f"GPU: {info['gpu']} ({info['sms']} SMs), {info['date']}, torch {info['torch']}, triton "
             f"{info['triton']}, humming-kernels {info['humming']}. Written by `python -m bench.bench_routes "
             "--report` from the runs' CSVs (`routes_h200/run_*.csv`, two runs: 7B + 14B, then the new "
             "shapes of 32B and 72B; 32B's q/o, k/v, qkv and gate/up are 14B's q/o, k/v, qkv and fused gate_up).", "",
             "Each cell: CUDA graphs of back-to-back calls, the weight rotated through > 200 MB of copies (cold "
             "L2), every side alternated twice and each keeping its best. `route`: the kernel today's routing "
             "table picks (`qerl_kit/kernels/routes.py`); `routed us`: that kernel's time in this cell. `ours`: "
             "the table without humming (`backend=\"ours\"`: our CUDA decode kernel, Triton, dequantize + "
             "cuBLAS); `cuda`: our CUDA decode kernel where the table without humming picks Triton (M <= 8). "
             "`x`: bf16 time / routed time. `err`: relative error of the routed output against the fp32 "
             "dequantized reference.", "",
             "| model | layer | N x K | M | route | routed us | humming us | ours us (kernel) | cuda us | bf16 us | x bf16 | err |",
             "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        kern = final_kernel(r)
        t = f(r["humming_us"]) if kern == "humming" else f(r["ours_us"])
        r["final"], r["t_final"], r["x"] = kern, t, f(r["bf16_us"]) / t
        err = f(r["err_humming"]) if kern == "humming" else f(r["err_routed"]) if r["route"] == kern else float("nan")
        cuda = "" if r["cuda_us"] in ("", "nan") or f(r["cuda_us"]) != f(r["cuda_us"]) else f"{f(r['cuda_us']):.1f}"
        lines.append(f"| {r['model'].replace('Qwen2.5-', '')} | {r['proj']} | {r['N']} x {r['K']} | {r['M']} | {kern} | "
                     f"{t:.1f} | {f(r['humming_us']):.1f} | {f(r['ours_us']):.1f} ({r['ours_path']}) | {cuda} | "
                     f"{f(r['bf16_us']):.1f} | {r['x']:.2f} | {err:.4f} |")
    lines += ["", "## Targets (issue 22)", ""]

    def count(sel, need):
        ok = [r for r in sel if r["x"] >= need]
        worst = min(sel, key=lambda r: r["x"])
        return (f"{len(ok)} of {len(sel)} cells (min {worst['x']:.2f}x: {worst['model'].replace('Qwen2.5-', '')} "
                f"{worst['proj']} at M = {worst['M']})")

    big = [r for r in rows if r["model"] != "Qwen2.5-7B"]
    lines.append("- every layer >= 1.0x bf16 at M <= 128 on the 14B-72B shapes: "
                 + count([r for r in big if int(r["M"]) <= 128], 1.0))
    lines.append("  - the same without the k/v layers (<= 8M weights): "
                 + count([r for r in big if int(r["M"]) <= 128 and int(r["N"]) * int(r["K"]) > 8 << 20], 1.0))
    lines.append("- >= 1.4x at M <= 64 on layers of >= 2^25 weights: "
                 + count([r for r in rows if int(r["M"]) <= 64 and int(r["N"]) * int(r["K"]) >= 1 << 25], 1.4))
    lines.append("- M >= 2048 >= 0.95x: " + count([r for r in rows if int(r["M"]) >= 2048], 0.95))
    wins = sum(1 for r in rows if r["final"] == "humming")
    cuda = [f(r["cuda_us"]) if r["cuda_us"] not in ("", "nan") else float("inf") for r in rows]
    best = [min(f(r["humming_us"]), f(r["ours_us"]), c) / r["t_final"] for r, c in zip(rows, cuda)]
    lines += [f"- cells the table gives humming: {wins} of {len(rows)}; the routed time against the best of "
              f"humming / ours / cuda in the cell: median {statistics.median(best):.3f}, min {min(best):.3f}", ""]
    if eager_csv:
        lines += ["## Eager cost per call (M = 8, 7B q/k/v fused shape [4608 x 3584], with bias)", "",
                  "200 back-to-back calls, no graph, best of 5 (host-bound: the GPU work is ~11 us). "
                  "Measured in its own run with no compile in the background.", "",
                  "| what | no grad us | input needs grad us |", "|---|---:|---:|"]
        for e in csv.DictReader(open(eager_csv)):
            g = "" if e["grad_us"] == "nan" else f"{f(e['grad_us']):.1f}"
            lines.append(f"| {e['what']} | {f(e['no_grad_us']):.1f} | {g} |")
        lines.append("")
    (out / "routes_h200.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-16:]))


if __name__ == "__main__":
    main()
