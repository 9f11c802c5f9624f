"""Where a GRPO step's CUDA memory sits when its rollout ends: a census against the memory plan.

    python -m bench.probe_memory_census --model Qwen2.5-32B --format nvfp4 --out OUT

Builds the model and StaticEngine as ``bench.bench_step`` does (random weights, LoRA r32 on every
projection, 8 prompts x 8, prompt 256, 512 forced tokens, KV cache kept), runs one step's rollout
(``Trainer._collect``) and then names every live CUDA tensor it can reach: the policy's parameters,
buffers and module attributes (the packed weights), and the engine's attributes, walked a few levels down (fused copies, KV cache, graph buffers), and humming's repacked
weights (``kernels.nvfp4_humming``'s cache). What it cannot name (a CUDA-graph pool's intermediates,
tensors held only by closures, cuBLAS workspaces) is the allocator's total less the named bytes;
``--history`` names those too, by the Python line that allocated each live block. It prints
``torch.cuda.memory_allocated`` after each stage and writes census.md beside
the plan's parts for the same settings (``bench.step_group.plan_row``'s call). A prototype for the
32B plan's shortfall (bench/results/step_h200.md); not part of the package.
"""

from __future__ import annotations

import argparse
import gc
from collections import defaultdict
from pathlib import Path

import torch

GIB = 2**30


def _tensors(obj, prefix: str, depth: int, seen: set, out: dict, device: str = "cuda") -> None:
    """Every ``device`` tensor reachable from ``obj`` through attributes, dicts, lists and tuples,
    ``depth`` levels down, recorded once (by storage) under the first path that reached it."""
    if depth < 0 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.device.type == device:
            key = obj.untyped_storage().data_ptr()
            out.setdefault(key, (prefix, obj.untyped_storage().nbytes(), str(obj.dtype), tuple(obj.shape)))
        return
    if isinstance(obj, torch.nn.Module):
        items = list(obj._parameters.items()) + list(obj._buffers.items()) + \
            [(k, v) for k, v in vars(obj).items() if not k.startswith("_")] + list(obj._modules.items())
    elif isinstance(obj, dict):
        items = [(str(k), v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(obj)]
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__.split(".")[0] in (
            "qerl_kit", "bench", "humming", "peft", "transformers"):
        items = list(vars(obj).items())
    else:
        return
    for k, v in items:
        if v is not None:
            _tensors(v, f"{prefix}.{k}" if prefix else k, depth - 1, seen, out, device)


def _group(path: str) -> str:
    """A census line: the path with layer numbers folded, so 64 layers' copies sum in one line."""
    parts = [(p.replace(p.strip("[]"), "N") if p.strip("[]").isdigit() else p) for p in path.split(".")]
    return ".".join(parts)  # (a humming copy's "[engine.fused.1]" folds as "[engine.fused.N]")


def walk(roots: dict, depth: int = 12, device: str = "cuda", found: dict | None = None) -> dict:
    """{storage pointer: (path, bytes, dtype, shape)} of every ``device`` tensor the roots reach, added
    to ``found`` (a storage already in it keeps its path)."""
    found = {} if found is None else found
    seen: set = set()
    for name, obj in roots.items():
        _tensors(obj, name, depth, seen, found, device)
    return found


def humming_roots(cache: dict, found: dict) -> dict:
    """humming's repacked weights (``kernels.nvfp4_humming._cache``) keyed by the path of the weight each
    one repacks (``found``: ``walk`` of the policy and the engine), so a census line says whose copy it
    is: the engine's fused buffers' or the policy's own projections'."""
    out = {}
    for (ident, _dtype), (ref, _version, gemm) in cache.items():
        packed = ref()
        where = None if packed is None else found.get(packed.untyped_storage().data_ptr())
        out[f"[{where[0] if where else f'unnamed.{ident}'}]"] = gemm
    return out


def census(roots: dict, depth: int = 12, device: str = "cuda", found: dict | None = None) -> tuple[list, int]:
    """(lines of (group, GiB, count, example dtype/shape), named bytes) over the roots' tensors and the
    ones ``found`` already holds (a ``walk`` of other roots)."""
    found = walk(roots, depth, device, found)
    sums: dict = defaultdict(lambda: [0, 0, ""])
    for path, nbytes, dtype, shape in found.values():
        g = sums[_group(path)]
        g[0] += nbytes
        g[1] += 1
        g[2] = g[2] or f"{dtype} {shape}"
    lines = sorted(((k, v[0] / GIB, v[1], v[2]) for k, v in sums.items()), key=lambda x: -x[1])
    return lines, sum(n for _, n, _, _ in found.values())


OURS = ("/qerl_kit/", "/humming/", "/bench/")


def allocation_sites(snapshot: dict, ours=OURS, frames: int = 2) -> list[tuple[str, float, int]]:
    """(site, GiB, blocks) of the live allocations in a ``torch.cuda.memory._snapshot()`` taken with
    ``_record_memory_history`` on, largest first: a site is the innermost ``frames`` stack frames in
    files under ``ours`` (the code that asked for the memory, not torch's internals); blocks
    allocated before history was on, or with no such frame, fall under ``(no stack)``."""
    sums: dict = defaultdict(lambda: [0, 0])
    for seg in snapshot.get("segments", []):
        for block in seg.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            mine = [f for f in block.get("frames", []) if any(o in f.get("filename", "") for o in ours)]
            site = " < ".join(f"{f['filename'].rsplit('/', 2)[-2]}/{f['filename'].rsplit('/', 1)[-1]}:{f['line']} "
                              f"{f.get('name', '')}" for f in mine[:frames]) or "(no stack)"
            sums[site][0] += block["size"]
            sums[site][1] += 1
    return sorted(((k, v[0] / GIB, v[1]) for k, v in sums.items()), key=lambda x: -x[1])


def pool_gib(snapshot: dict) -> dict[str, float]:
    """Live bytes (GiB) of a ``torch.cuda.memory_snapshot()`` by pool: PyTorch's default pool (pool id
    (0, 0)) and the private pools CUDA-graph captures allocate from, which hold what a captured step
    allocated (its static outputs and any block it never freed) for as long as the graph lives."""
    out = {"default pool": 0.0, "CUDA-graph pools": 0.0}
    for seg in snapshot.get("segments", []):
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        live = sum(b["size"] for b in seg.get("blocks", []) if b.get("state") == "active_allocated")
        out["default pool" if pool == (0, 0) else "CUDA-graph pools"] += live / GIB
    return out


def main(argv=None) -> int:
    from bench.step_group import build_policy, forced_static, make_task, plan_for, trainer_for

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="Qwen2.5-32B")
    p.add_argument("--format", default="nvfp4")
    p.add_argument("--dense-decode", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--share-weights", action="store_true",
                   help="the StaticEngine's share_weights: the policy's q/k/v and gate/up stored in its fused buffers")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new", type=int, default=512, help="forced completion length")
    p.add_argument("--history", action="store_true",
                   help="record every allocation's Python stack (torch.cuda.memory._record_memory_history) and "
                        "group the live ones by the qerl_kit/humming line that made them")
    p.add_argument("--device", default="cuda", help="cpu: the walk alone, on a small preset (no allocator figures)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    stages = []

    cuda = a.device == "cuda"

    def mark(stage):
        if cuda:
            torch.cuda.synchronize()
        stages.append((stage, torch.cuda.memory_allocated() / GIB if cuda else 0.0,
                       torch.cuda.max_memory_allocated() / GIB if cuda else 0.0))
        print(f"[census] {stage}: allocated {stages[-1][1]:.2f} GiB, peak {stages[-1][2]:.2f}", flush=True)

    if cuda and a.history:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    peft, tok = build_policy(a.model, a.format, a.device, 32)
    gc.collect()
    mark("model + LoRA")
    P, C = a.prompt_len, a.new
    args = dict(prompts=8, group=8, prompt_len=P, lora_r=32, steps=1, keep_cache=True, max_rows=64,
                dense_cache="auto", max_new_tokens=C, share_weights=a.share_weights)
    case = dict(model=a.model, format=a.format, engine="static", gradient_checkpointing=True, mu=1, micro_batch=8,
                seed=0, aqn=a.format == "nvfp4")
    engine = forced_static(peft, tok, ignore_eos=True, keep_cache=True, max_rows=64, dense_decode=a.dense_decode,
                           share_weights=a.share_weights)
    engine.lengths = [C] * 64
    mark("engine")
    trainer = trainer_for(peft, tok, make_task(a.model, peft, P, 64, 0), engine, case, args, C, a.out / "run")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer._collect(trainer.step)
    gc.collect()
    mark("after one rollout")
    from qerl_kit.kernels import nvfp4_humming

    found = walk({"policy": peft, "engine": engine}, device=a.device)
    humming = humming_roots(nvfp4_humming._cache, found)  # named by the weight each one repacks
    lines, named = census({"humming": humming}, device=a.device, found=found)
    snap = torch.cuda.memory._snapshot() if cuda else {}
    sites = allocation_sites(snap) if a.history else []
    pools = pool_gib(snap)
    plan = plan_for(peft, case, args, C)  # the bench rows' plan: the same settings, humming where it runs
    total = stages[-1][1]
    shared = ", shared weights" if a.share_weights else ""
    md = [f"# Memory census after one rollout: {a.model} {a.format}, dense decode {a.dense_decode}{shared}", "",
          f"GPU: {torch.cuda.get_device_name() if cuda else 'none (cpu)'}; torch {torch.__version__}", "",
          "| stage | allocated GiB | peak GiB |", "|---|---:|---:|"]
    md += [f"| {s} | {x:.2f} | {y:.2f} |" for s, x, y in stages]
    md += ["", f"Named tensors: {named / GIB:.2f} GiB of {total:.2f} allocated; unnamed {total - named / GIB:.2f} GiB "
           "(CUDA-graph pools, closures, the cuBLAS workspaces). Live by pool: "
           + ", ".join(f"{k} {v:.2f} GiB" for k, v in pools.items()) + ".", "", "| tensors (layer numbers as N; the 40 largest) | MiB | count | dtype, shape (one of them) |",
           "|---|---:|---:|---|"]
    md += [f"| `{k}` | {g * 1024:.1f} | {n} | {ex} |" for k, g, n, ex in lines[:40]]
    if sites:
        md += ["", "Live allocations by the line that made them (`--history`; innermost qerl_kit/humming/bench "
               "frames, the 40 largest):", "", "| site | GiB | blocks |", "|---|---:|---:|"]
        md += [f"| `{k}` | {g:.3f} | {n} |" for k, g, n in sites[:40]]
    md += ["", f"Plan: rollout peak {(plan.static + plan.rollout) / GIB:.2f}, kept {(plan.static + plan.kept_bytes) / GIB:.2f} "
           "GiB; its parts:", "", "| plan part | GiB |", "|---|---:|"] + [f"| {k} | {v / GIB:.3f} |"
                                                                       for k, v in plan.parts.items()]
    (a.out / "census.md").write_text("\n".join(md) + "\n")
    print("\n".join(md[:120]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
