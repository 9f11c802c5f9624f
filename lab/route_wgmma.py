"""Where the wgmma prototype beats the dispatcher at 17..64 rows: every layer of Qwen2.5-7B..72B.

The wgmma prototype (``proto_wgmma_gemm.py``) won at 32 rows on the largest layers and lost on
small ones (lab/results/proto_wgmma_gemm_h200.md). This decided what of it moved into
``qerl_kit.kernels`` (``nvfp4_wgmma_cuda``); it measures, per projection shape and M in
{24, 32, 48, 64}, in one run:
the dispatcher (``nvfp4_linear``), torch's bf16 matmul and the prototype in the configurations
that won somewhere (256-row blocks, x one or two K steps ahead; 128-row blocks) at the default
K split and at half and twice as many slices. Each is checked against the dispatcher's output.

Its "rule" column is ``qerl_kit.kernels.nvfp4_wgmma_cuda.preferred``, the dispatch rule drawn
from this table (session 8, lab/results/route_wgmma_h200.md); once the kernel shipped, the
"dispatch" column includes it wherever the rule says "wgmma".

``--shipped`` times the kernel that ships now (session 9: warp-specialized) instead of the
prototype's configurations, against the Triton path it would replace (``backend="triton"``) and
bf16, with the current rule beside each cell: the table to re-draw ``preferred`` from.

``--engine MODEL [B ...] [--no-bf16]`` times that model's NVFP4 engine (CUDA graphs, LoRA r 32)
with the wgmma kernel off and on, and the bf16 engine, in one run.

    python -m lab.route_wgmma            # the session-8 table
    python -m lab.route_wgmma --shipped  # the shipped kernel against Triton
    python -m lab.route_wgmma --engine Qwen2.5-32B 32 64
"""

from __future__ import annotations

import sys

import torch

from bench.bench_nvfp4_gemm import MODELS, layer_shapes, time_graph
from lab import proto_cuda_gemm as base
from lab import proto_wgmma_gemm as wg

from lab import nvfp4_wgmma_cuda as wgk

# (warps, tiles per warp, x steps ahead): the configurations that won a cell in the sweep
CANDIDATES = ((8, 2, 2), (8, 2, 1), (4, 2, 2))
ROWS = (24, 32, 48, 64)


def table(sms: int) -> None:
    print("| model | proj | N x K | M | " + " | ".join(f"{16 * w * nt}r x{xd} us (ips)" for w, nt, xd in CANDIDATES)
          + " | dispatch us | bf16 us | best x dispatch | best x bf16 | rule |")
    print("|---|---|---|---:|" + "---:|" * (len(CANDIDATES) + 5))
    labels = _labels()
    for n, k, m, x, weights, dense in wg.layer_rows(labels, ROWS):
        cells, best = [], float("inf")
        for warps, nt, xd in CANDIDATES:
            ips = base.config(m, n, k, sms, 16 * warps * nt, per_sm=None if warps == 8 else 2)[1]
            t, i = wg.best_split(time_graph, x, weights, ips, warps=warps, nt=nt, xd=xd)
            best = min(best, t)
            cells.append(f"{t * 1e6:.1f} ({i})")
        t_disp, t_bf = wg.baselines(time_graph, x, weights, dense)
        model, proj = labels[n, k]
        print(f"| {model} | {proj} | {n} x {k} | {m} | " + " | ".join(cells)
              + f" | {t_disp * 1e6:.1f} | {t_bf * 1e6:.1f} | {t_disp / best:.2f} | {t_bf / best:.2f} | "
              f"{'wgmma' if wgk.preferred(m, n, k) else 'dispatch'} |", flush=True)


def _labels() -> dict:
    """(N, K) -> (model, projection) of its first occurrence, over the layers the kernels fit."""
    labels = {}
    for model in MODELS:
        for proj, n, k in layer_shapes(model):
            if k % base.K_STEP == 0 and n % 16 == 0:
                labels.setdefault((n, k), (model.replace("Qwen2.5-", ""), proj))
    return labels


def shipped_table() -> None:
    """Per layer and M in ROWS: the shipped kernel at ``choose_ips``'s K split and at half and
    twice as many slices (checked against the Triton path and the dispatcher), the Triton path, bf16,
    and the rule."""
    from qerl_kit.kernels import nvfp4_linear

    print("| model | proj | N x K | M | shipped us (K steps per slice) | Triton us | bf16 us | "
          "shipped x Triton | shipped x bf16 | rule |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    labels = _labels()
    for n, k, m, x, weights, dense in wg.layer_rows(labels, ROWS):
        ref = nvfp4_linear(x, *weights[0], backend="triton").float()
        err = ((wgk.nvfp4_wgmma_cuda(x, *weights[0]).float() - ref).norm() / ref.norm()).item()
        if err > 1e-2:
            print(f"FAIL {n} x {k} M={m}: rel err {err:.1e} against the Triton path", flush=True)
        t, ips = wg.best_split(time_graph, x, weights, wgk.choose_ips(m, n, k), kernel=wgk.nvfp4_wgmma_cuda)
        t_tri = time_graph([lambda q=q: nvfp4_linear(x, *q, backend="triton") for q in weights])
        t_bf = time_graph([lambda d=d: torch.nn.functional.linear(x, d) for d in dense])
        model, proj = labels[n, k]
        print(f"| {model} | {proj} | {n} x {k} | {m} | {t * 1e6:.1f} ({ips}) | {t_tri * 1e6:.1f} | "
              f"{t_bf * 1e6:.1f} | {t_tri / t:.2f} | {t_bf / t:.2f} | "
              f"{'wgmma' if wgk.preferred(m, n, k) else 'Triton'} |", flush=True)


def engine(model_name: str, batches=(32, 64), new: int = 128, bf16: bool = True) -> None:
    """``model_name``'s NVFP4 engine (fused decode step, CUDA graphs, LoRA r 32) at each batch with
    the wgmma kernel off (``preferred`` patched to False: the previous dispatch) and on, and the
    bf16 engine, in one run (each run captures its own graphs, so the dispatch is re-decided)."""
    from bench import bench_rollout as br

    rule = wgk.preferred
    rows = {}
    model = br.with_lora(br.build(model_name, "nvfp4", "cuda"), 32)
    try:
        for batch in batches:
            prompts = br.random_prompts(batch, 256, 152064)
            for on in (False, True):
                wgk.preferred = rule if on else (lambda m, n, k: False)
                rows.setdefault(batch, []).append(br.engine_run(model, prompts, new)["ms_per_step"])
    finally:
        wgk.preferred = rule
    del model
    br.free()
    if bf16:
        model = br.with_lora(br.build(model_name, "bf16", "cuda"), 32)
        for batch in batches:
            rows[batch].append(br.engine_run(model, br.random_prompts(batch, 256, 152064), new)["ms_per_step"])
        del model
        br.free()
    print(f"| {model_name} batch | NVFP4 without wgmma ms/step | NVFP4 with wgmma ms/step | bf16 ms/step | "
          "with / without | NVFP4 (with) / bf16 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch, ms in rows.items():
        ms = ms + [float("nan")] * (3 - len(ms))
        print(f"| {batch} | {ms[0]:.2f} | {ms[1]:.2f} | {ms[2]:.2f} | {ms[0] / ms[1]:.2f}x | {ms[2] / ms[1]:.2f}x |",
              flush=True)


def main() -> None:
    if "--engine" in sys.argv:
        args = sys.argv[sys.argv.index("--engine") + 1:]
        batches = tuple(int(b) for b in args[1:] if b.isdigit()) or (32, 64)
        return engine(args[0], batches, bf16="--no-bf16" not in sys.argv)
    if "--shipped" in sys.argv:
        return shipped_table()
    table(torch.cuda.get_device_properties(0).multi_processor_count)


if __name__ == "__main__":
    main()
