"""The decode step's grouped LoRA (``qerl_kit.kernels.lora_triton``) under each ``Tiling``, at a model's
four projection groups and the decode row counts a GRPO rollout has, in one run.

    python -m bench.bench_lora_tiling --model Qwen2.5-7B --out bench/results/lora_tiling_h100 --grid small
    python -m bench.bench_lora_tiling --smoke --out /tmp/x      # CPU (TRITON_INTERPRET=1), tiny shapes

Each (group, rows, tiling) is one shrink + expand on random bf16 inputs (LoRA r ``--rank`` on every
projection, peft's layout), timed as microseconds per call inside a CUDA graph of 100 calls (the
engine replays its decode step as a graph); every tiling's output is checked against the torch path
first (``lora_apply_ref_``, relative error). The report sets each tiling against ``Tiling()`` (the one
every step measurement before 2026-12-06 ran; ``lora_apply_`` now picks one by row count,
``lora_triton.tiling_for``, from this benchmark's 7B run on an H100) and adds the per-layer sum of the four groups: times the layers,
the milliseconds a decode step would save. Why: the 7B NVFP4 rollout's profile on an H100 spent 705 ms of
about 2870 ms of decode GPU time in these two launches (bench/results/step_h200.md, hold 6); the expand
re-reads every K chunk's float32 partial sums in each of its programs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
from pathlib import Path

import torch

from bench.common import graph_us
from qerl_kit.kernels.lora_triton import DEFAULT_TILING, Tiling, lora_apply_, lora_apply_ref_, tiling_for
from qerl_kit.models import PRESETS

GROUPS = ("qkv", "o", "gate_up", "down")


def group_shapes(model: str) -> dict[str, tuple[int, list[int]]]:
    """(K, the output widths of the group's projections) of each fused group of one layer."""
    c = PRESETS[model]
    h, i = c["hidden_size"], c["intermediate_size"]
    d = c.get("head_dim", h // c["num_attention_heads"])
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return {"qkv": (h, [q, kv, kv]), "o": (q, [h]), "gate_up": (h, [i, i]), "down": (i, [h])}


def tilings(smoke: bool, grid_size: str = "full") -> list[Tiling]:
    """The default first, then the grid the kernels take (``small``: the splits, rows and column blocks the
    bandwidth arithmetic favours, for a short hold; a smaller one still for the CPU smoke run)."""
    if smoke:
        grid = [Tiling(max_splits=2, block_m=16, n_blocks=2), Tiling(max_splits=1, block_m=32, n_blocks=1),
                Tiling(block_m=16, n_blocks=2, reduce=True)]
    elif grid_size == "small":
        grid = [Tiling(max_splits=s, block_m=m, n_blocks=n, reduce=r)
                for s, m, n, r in itertools.product((8, 4, 2), (16, 64), (1, 4), (False, True)) if s > 2 or not r]
    else:
        grid = [Tiling(max_splits=s, block_m=m, n_blocks=n)
                for s, m, n in itertools.product((32, 8, 4, 2, 1), (16, 32, 64), (1, 4, 8))]
        grid += [Tiling(max_splits=s, block_m=m, n_blocks=n, reduce=True)  # the shrink sums its chunks
                 for s, m, n in itertools.product((32, 8, 4), (16, 64), (1, 4))]
    return [DEFAULT_TILING] + [t for t in grid if t != DEFAULT_TILING]


def parse_tiling(text: str) -> Tiling:
    """``SPLITS,BLOCK_M,N_BLOCKS[,reduce]`` (``bench_lora_engine --tiling``, ``device.sh lora-tiling``) as a Tiling."""
    parts = text.split(",")
    if len(parts) not in (3, 4) or not all(p.strip().isdigit() for p in parts[:3]) \
            or (len(parts) == 4 and parts[3].strip() != "reduce"):
        raise ValueError(f"a tiling is SPLITS,BLOCK_M,N_BLOCKS[,reduce] (e.g. 8,64,4,reduce); got {text!r}")
    return Tiling(max_splits=int(parts[0]), block_m=int(parts[1]), n_blocks=int(parts[2]), reduce=len(parts) == 4)


def tiling_text(t: Tiling) -> str:
    """``parse_tiling``'s inverse."""
    return f"{t.max_splits},{t.block_m},{t.n_blocks}" + (",reduce" if t.reduce else "")


@contextlib.contextmanager
def lora_path(fn):
    """The StaticEngine's decode step applies its LoRA with ``fn`` (``lora_apply_``'s signature) for the
    block's duration: the fused step looks ``fast.lora_apply_`` up at every call. ``bench_lora_engine``'s
    paths and ``bench_step --lora-tiling`` both go through this."""
    import qerl_kit.rollout.static.fast as fast

    original = fast.lora_apply_
    fast.lora_apply_ = fn
    try:
        yield
    finally:
        fast.lora_apply_ = original


def case(k: int, outs: list[int], m: int, rank: int, device: str, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(device, dtype)  # noqa: E731
    As = [mk(rank, k, scale=k ** -0.5) for _ in outs]
    Bs = [mk(n, rank, scale=0.01) for n in outs]
    offsets = [sum(outs[:j]) for j in range(len(outs))]
    return mk(m, k), As, Bs, offsets, mk(m, sum(outs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="Qwen2.5-7B", choices=sorted(PRESETS))
    ap.add_argument("--rows", nargs="+", type=int, default=[8, 64, 128])
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="CPU: a tiny model, two rows counts, four tilings")
    ap.add_argument("--grid", default="full", choices=("full", "small"), help="small: 21 tilings, not 57")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if a.smoke:
        a.model, a.rows, a.rank = "qwen2-tiny", [1, 5], 4
    shapes, layers = group_shapes(a.model), PRESETS[a.model]["num_hidden_layers"]
    a.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter: times mean nothing)"
    results: dict = {}  # (rows, tiling) -> {group: us}
    worst, failed = 0.0, []
    for m in a.rows:
        for gi, group in enumerate(GROUPS):
            k, outs = shapes[group]
            x, As, Bs, offsets, y = case(k, outs, m, a.rank, device, dtype, seed=m * 10 + gi)
            scales = [2.0] * len(outs)
            want = lora_apply_ref_(y.clone(), x, As, Bs, offsets, scales).float()
            for tiling in tilings(a.smoke, a.grid):
                try:  # a tiling the GPU cannot build (out of resources, say) is a missing cell, not the end
                    got = lora_apply_(y.clone(), x, As, Bs, offsets, scales, tiling).float()
                    err = ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()
                    worst = max(worst, err)
                    work = y.clone()
                    us = graph_us(lambda: lora_apply_(work, x, As, Bs, offsets, scales, tiling), replays=5,
                                  device=device)
                except Exception as e:  # noqa: BLE001
                    print(f"[tiling] rows {m} {group} {tiling}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    failed.append(f"{m} rows, {group}, {tiling}: {type(e).__name__}")
                    us = float("inf")
                results.setdefault((m, tiling), {})[group] = us
            print(f"[tiling] rows {m} {group}: default {results[(m, DEFAULT_TILING)][group]:.1f} us", flush=True)
    name = lambda t: (f"splits {t.max_splits}, block_m {t.block_m}, n_blocks {t.n_blocks}"  # noqa: E731
                      + (", reduce" if t.reduce else ""))
    lines = [f"# Grouped LoRA tilings, {a.model} decode shapes ({gpu}, {datetime.date.today()}, torch {torch.__version__})",
             "", f"LoRA r {a.rank} on every projection, {dtype}; microseconds per shrink + expand "
             f"({'in a CUDA graph of 100 calls' if device == 'cuda' else 'eager'}); largest error against the torch "
             f"path over every case: {worst:.2e} of its largest output. `python -m bench.bench_lora_tiling "
             f"--model {a.model} --out ...`.", ""]
    if failed:
        lines += [f"Failed (left out of the ranking): {'; '.join(failed[:20])}" + (" ..." if len(failed) > 20 else ""), ""]
    for m in a.rows:
        base = results[(m, DEFAULT_TILING)]
        base_sum = sum(base.values())
        ranked = sorted((t for (mm, t) in results if mm == m), key=lambda t: sum(results[(m, t)].values()))
        lines += [f"## {m} rows", "", "| tiling | " + " | ".join(GROUPS) + " | layer | per decode step, ms |",
                  "|---|" + "---:|" * (len(GROUPS) + 2)]
        best_per_group = {g: min(results[(m, t)][g] for t in ranked) for g in GROUPS}
        chosen = tiling_for(m)  # what lora_apply_ cuts m rows with
        for t in [DEFAULT_TILING] + [t for t in ranked if t != DEFAULT_TILING][:8]:
            r = results[(m, t)]
            mark = " (Tiling())" if t == DEFAULT_TILING else " (lora_apply_'s)" if t == chosen else ""
            lines.append(f"| {name(t)}{mark} | "
                         + " | ".join(f"{r[g]:.1f}" for g in GROUPS)
                         + f" | {sum(r.values()):.1f} | {sum(r.values()) * layers / 1000:.3f} |")
        lines.append("| best per group | " + " | ".join(f"{best_per_group[g]:.1f}" for g in GROUPS)
                     + f" | {sum(best_per_group.values()):.1f} | {sum(best_per_group.values()) * layers / 1000:.3f} |")
        winners = {g: min(ranked, key=lambda t: results[(m, t)][g]) for g in GROUPS}
        lines += ["", "Best per group: " + "; ".join(f"{g} {name(t)}" for g, t in winners.items()) + ".",
                  "", f"Tiling() {base_sum * layers / 1000:.3f} ms per decode step; lora_apply_'s "
                  f"({name(chosen)}) " + (f"{sum(results[(m, chosen)].values()) * layers / 1000:.3f}"
                                          if (m, chosen) in results else "not in this grid")
                  + f"; the best single tiling "
                  f"({name(ranked[0])}) {sum(results[(m, ranked[0])].values()) * layers / 1000:.3f}; the best per "
                  f"group {sum(best_per_group.values()) * layers / 1000:.3f}.", ""]
    # the one tiling fastest over every row count together (each count's decode step weighted alike), in
    # the SPLITS,BLOCK_M,N_BLOCKS[,reduce] form bench_lora_engine --tiling and bench_step --lora-tiling read
    overall = min({t for (_, t) in results}, key=lambda t: sum(sum(results[(m, t)].values()) for m in a.rows))
    lines += [f"Fastest over every row count: {name(overall)} ({tiling_text(overall)}).", ""]
    (a.out / "best.txt").write_text(tiling_text(overall) + "\n")
    (a.out / "lora_tiling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
