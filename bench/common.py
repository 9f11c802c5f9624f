"""What every rollout benchmark shares: the run clock and log, device sync and free, random
Qwen2.5-shaped models (bf16, NVFP4 built from meta, bitsandbytes NF4), a trained-looking LoRA, the
bytes a decode step reads, copy bandwidth, random prompts and the results writer. The benchmarks
(``bench_rollout``, ``bench_grpo_engines``, ``bench_live_rows``, ``bench_vllm_lengths``,
``bench_lora_engine``) import from here and never from each other's helpers, so bench/ has no
import circle."""

from __future__ import annotations

import csv
import gc
import json
import time
from pathlib import Path

import torch
from torch import nn

T0 = time.perf_counter()
LOG: list[str] = []


def log(msg: str) -> None:
    line = f"[{time.perf_counter() - T0:7.1f}s] {msg}"
    print(line, flush=True)
    LOG.append(line)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- models -----------------------------------------------------------------------------------
def _linear_children(model: nn.Module, skip=("lm_head",)):
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, nn.Linear) and name not in skip]


def build(preset: str, fmt: str, device: str, **overrides) -> nn.Module:
    """A random model of ``preset``'s shape (``overrides``: config sizes that replace the preset's):
    ``bf16`` dense, or ``nvfp4`` built layer by layer from meta (a bf16 copy of the whole model
    never exists, so 72B fits)."""
    from transformers import AutoModelForCausalLM

    from qerl_kit.linear import NVFP4Linear
    from qerl_kit.models import make_config

    config = make_config(preset, **overrides)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if fmt in ("bf16", "none"):
        from qerl_kit.models import build_model

        return build_model(preset, dtype=dtype, device=device, **overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    from qerl_kit import nvfp4
    from qerl_kit.quantize import FUSED_GROUPS

    def dense_like(lin):
        d = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, device=device, dtype=dtype)
        nn.init.normal_(d.weight, std=0.02)
        if d.bias is not None:
            nn.init.normal_(d.bias, std=0.02)
        return d

    for parent in list(model.modules()):  # fused groups share one global scale, as quantize_model does
        children = dict(parent.named_children())
        for group in FUSED_GROUPS:
            if all(isinstance(children.get(g), nn.Linear) for g in group):
                dense = {g: dense_like(children[g]) for g in group}
                gs = nvfp4.shared_global_scale(*(d.weight for d in dense.values()))
                for g, d in dense.items():
                    setattr(parent, g, NVFP4Linear.from_linear(d, global_scale=gs))
                del dense
    for parent, name, lin in _linear_children(model):
        setattr(parent, name, NVFP4Linear.from_linear(dense_like(lin)))
    inner = model.model
    with torch.device(device):  # inv_freq is computed in __init__ (a non-persistent buffer)
        inner.rotary_emb = type(inner.rotary_emb)(config=config)
    for module in model.modules():
        for pname, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                t = torch.empty(p.shape, dtype=p.dtype, device=device)
                t.fill_(1.0) if t.dim() == 1 else t.normal_(0, 0.02)
                setattr(module, pname, nn.Parameter(t, requires_grad=p.requires_grad))
        for bname, b in list(module.named_buffers(recurse=False)):
            if b is not None and b.is_meta:
                raise RuntimeError(f"buffer {bname} of {type(module).__name__} left on meta")
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def to_nf4(model: nn.Module) -> nn.Module:
    """bitsandbytes NF4 (double quant off, bf16 compute): the QLoRA baseline, in place."""
    import bitsandbytes as bnb

    for parent, name, lin in _linear_children(model):
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                              compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")
        q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, quant_type="nf4").to(lin.weight.device)
        if lin.bias is not None:
            q.bias = nn.Parameter(lin.bias.data, requires_grad=False)
        setattr(parent, name, q)
    free()
    return model


def with_lora(model: nn.Module, r: int):
    from qerl_kit.lora import attach_lora

    peft = attach_lora(model, r=r, seed=0)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)  # a trained-looking adapter, never zeros
    return peft


def weight_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads: every parameter and quantized buffer but the embedding table
    (one row per token) and LoRA's small matrices counted in full."""
    skip = {id(p) for n, p in model.named_parameters() if "embed_tokens" in n}
    total = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    total += sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "rotary" not in n)
    head = model.get_output_embeddings().weight if hasattr(model, "get_output_embeddings") else None
    if head is not None and id(head) in skip:  # tied head: it is read every step
        total += head.numel() * head.element_size()
    return total


def copy_bandwidth(device: str) -> float:
    """Bytes (read + written) per second of a large device-to-device copy, same run."""
    n = (1 << 30) if device == "cuda" else (1 << 24)
    a = torch.randn(n // 4, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync()
    reps = 20
    t = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    sync()
    return 2 * a.numel() * 4 * reps / (time.perf_counter() - t)


def graph_us(fn, reps: int = 100, replays: int = 3, device: str = "cuda") -> float:
    """Microseconds per call of ``fn``, captured ``reps`` times in one CUDA graph and replayed
    ``replays`` times after a warm replay (how the engine runs its decode step); eager, one timed call
    after a warm one, where ``device`` is the CPU or there is no GPU."""
    fn()
    if device == "cpu" or not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / (replays * reps) * 1e6


# -- prompts -------------------------------------------------------------------------------------
def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (batch, length), generator=g).tolist()


class IdTokenizer:
    """Prompts are whitespace-separated token ids; no EOS, so completions run to max_new_tokens."""

    eos_token_id = None
    pad_token_id = 0

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[int(t) for t in s.split()] for s in texts]}

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(str(int(t)) for t in r) for r in rows]


def random_reward(seed: int = 0):
    """A reward of random numbers (the random models' completions have no meaning): GRPO's arithmetic
    runs as on a real task, with no group of equal rewards."""
    g = torch.Generator().manual_seed(seed)

    def reward(completions, **_):
        return torch.rand(len(completions), generator=g).tolist()
    return reward


def package_versions(**dists: str) -> dict:
    """{key: the installed version of distribution ``dists[key]``, or "not installed"} for result files."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for key, dist in dists.items():
        try:
            out[key] = version(dist)
        except PackageNotFoundError:
            out[key] = "not installed"
    return out


def random_id_task(rows: int, length: int, vocab: int, reward_seed: int = 0):
    """A Task of ``rows`` prompts of ``length`` random ids (seed 3, as every bench's) with ``random_reward``:
    GRPO steps on a random-weight model, prompts passed through as text (``IdTokenizer`` reads them back)."""
    from qerl_kit.tasks import Task

    data = [{"prompt": " ".join(map(str, p)), "answer": "0"} for p in random_prompts(rows, length, vocab, seed=3)]
    return Task("random-ids", data, [], (random_reward(reward_seed),), lambda tok, row: row["prompt"])


def dense_cache_arg(value: str) -> str:
    """``--dense-cache``: ``all`` (every 4-bit projection's dense copy), ``auto`` (the Trainer's own budget
    from the free memory: what a user's run does; 32B-sized models where ``all`` does not fit) or GiB >= 0 (0: off)."""
    import argparse

    try:
        if value in ("all", "auto") or float(value) >= 0:
            return value
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"dense-cache {value!r}: allowed all, auto or GiB >= 0 (0: off)")


# -- timed Trainer steps --------------------------------------------------------------------------
def peak_gib() -> float:
    """``torch.cuda.max_memory_allocated`` in GiB (NaN without a GPU)."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def allocator_calls() -> tuple[int, int]:
    """(cudaMalloc calls, allocation retries) PyTorch's caching allocator has made so far (its own
    counters, read on the host without a synchronization; (0, 0) without a GPU). A retry frees every
    cached block and calls cudaMalloc again: each synchronizes the device."""
    if not torch.cuda.is_available():
        return 0, 0
    stats = torch.cuda.memory_stats()
    return int(stats.get("segment.all.allocated", 0)), int(stats.get("num_alloc_retries", 0))


class GCClock:
    """Python's cyclic-GC collections per generation and the seconds they took, while entered (a
    ``gc.callbacks`` hook): in a host-bound step a full (generation 2) collection over a large heap stops
    the host for tenths of a second, and vLLM, run in the process, freezes the heap it finds
    (``gc.freeze``) so its collections skip it."""

    def __init__(self):
        self.counts, self.seconds, self._t0 = [0, 0, 0], [0.0, 0.0, 0.0], None

    def _hook(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            g = info["generation"]
            self.counts[g] += 1
            self.seconds[g] += time.perf_counter() - self._t0
            self._t0 = None

    def __enter__(self) -> "GCClock":
        gc.callbacks.append(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._hook)


# Profiler events that make the host wait for the device: a tensor read back (``.item()``, ``bool(t)``,
# ``.tolist()``, ``nonzero``) and the runtime's explicit synchronizations. In a host-bound pass each one
# drains the device's queue and then idles the device while the host launches again.
SYNC_KEYS = ("aten::_local_scalar_dense", "aten::nonzero", "cudaStreamSynchronize", "cudaDeviceSynchronize",
             "cudaEventSynchronize")


def _sync_sites(prof, frames: int = 4) -> list[str]:
    """'count x event: the Python frames that called it' for each sync event (SYNC_KEYS) and call site,
    most frequent first (the frames from the event's parents, which ``with_stack`` records)."""
    import collections

    sites = collections.Counter()
    for e in prof.events():
        if not any(k in e.name for k in SYNC_KEYS):
            continue
        where, parent = [], e.cpu_parent
        while parent is not None and len(where) < frames:
            if ".py(" in parent.name:
                where.append(parent.name.strip())
            parent = parent.cpu_parent
        sites[(e.name, " <- ".join(where) or "(no Python frames)")] += 1
    return [f"{n:6d} x {name}: {where}" for (name, where), n in sites.most_common()]


def profiled(fn, top: int = 40, stacks: bool = False):
    """``fn()`` under torch.profiler (CPU and, where there is one, the GPU; synced before the profile
    ends): (its result, a text report, and the ``top`` names by their own device time, CPU time without
    a GPU, as [(name, own ms, calls)]). The report: the wall time under the profiler, the
    synchronizations counted (``SYNC_KEYS``), the key_averages table of the ``top`` names by own device
    time and, on a GPU, a second one by own host time: where a host-bound pass spends its time.
    ``stacks``: the profiler records Python frames too (``with_stack``), so each synchronization is
    named with its call site and the host table ranks the Python frames' own code beside the aten
    ops; it about doubles the profiler's own cost (a tiny model's pass on this CPU: 4.1 s -> 9.3 s).
    Either way the report attributes time; the timed runs measure it."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                 with_stack=stacks) as prof:
        result = fn()
        sync()
    wall = time.perf_counter() - t0
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    try:
        averages = prof.key_averages()
    except UnicodeDecodeError as err:  # torch 2.13 can record an undecodable name with the Python tracer on
        if not stacks:
            raise
        raise RuntimeError("torch.profiler could not read back its own events recorded with Python stacks "
                           f"({err}); profile without stacks") from err
    events = sorted(averages, key=lambda e: getattr(e, attr), reverse=True)
    rows = [(e.key, getattr(e, attr) / 1e3, e.count) for e in events[:top] if getattr(e, attr) > 0]
    aten = sum(e.self_cpu_time_total for e in averages if e.key.startswith("aten::")) / 1e6
    python = sum(e.self_cpu_time_total for e in averages if ".py(" in e.key) / 1e6
    sites = _sync_sites(prof)
    syncs = sum(int(line.split("x", 1)[0]) for line in sites)
    text = [f"wall {wall:.3f} s under the profiler; host time in aten ops {aten:.3f} s"
            + (f", in Python frames' own code {python:.3f} s" if stacks else "")
            + f"; {syncs} reads back or synchronizations (on a GPU the host waits for the device at each)"]
    text += [f"  {line}" for line in sites[:15]]
    text += ["", f"by own {'device' if cuda else 'CPU'} time:",
             averages.table(sort_by=attr, row_limit=top, max_name_column_width=90)]
    if cuda:
        text += ["by own host time:", averages.table(sort_by="self_cpu_time_total", row_limit=top,
                                                     max_name_column_width=90)]
    return result, "\n".join(text), rows


def timed_steps(trainer, steps: int, label: str, every: list | None = None) -> tuple[dict, float, float]:
    """``steps`` Trainer steps: the last one's metrics, its peak memory (GiB; the Trainer restarts CUDA's
    peak counter at each step's start, so it is the last step's alone) and the most dense-cache GiB any step held
    (``memory/dense_cache_gib``); ``every``, a list, gets every step's metrics appended, with its peak
    (``bench/peak_gib``; the Trainer's own ``memory/*`` figures on CUDA: the rollout's peak, what stays
    allocated into the update), so a run that fails later keeps them."""
    held = 0.0
    prepare, marks, own = getattr(trainer, "_prepare", None), [], "_prepare" in vars(trainer)

    def marked(*args, **kwargs):  # the update's start (after the rollout, rewards, old policy): the cudaMalloc count then
        out = prepare(*args, **kwargs)
        marks.append((allocator_calls()[0], sum(clock.seconds)))
        return out
    if prepare is not None:  # a Trainer (a test's stand-in may have no phases)
        trainer._prepare = marked
    try:
        for i in range(steps):
            before = allocator_calls()
            marks.clear()
            with GCClock() as clock:
                m = {**trainer.train_step(), "bench/peak_gib": peak_gib()}
            mallocs, retries = (b - a for a, b in zip(before, allocator_calls()))
            m["bench/cuda_mallocs"], m["bench/alloc_retries"] = mallocs, retries
            m["bench/cuda_mallocs_before_update"] = marks[0][0] - before[0] if marks else None
            m["bench/gc_s"], m["bench/gc_collections"] = sum(clock.seconds), "/".join(map(str, clock.counts))
            m["bench/gc_s_update"] = sum(clock.seconds) - marks[0][1] if marks else None
            if every is not None:
                every.append(m)
            held = max(held, m.get("memory/dense_cache_gib", 0.0))
            split = f" ({m['bench/cuda_mallocs_before_update']} before the update)" if marks else ""
            log(f"{label} step #{i}: {m['time/step']:.2f}s (" + ", ".join(
                f"{k[5:]} {m[k]:.2f}" for k in ("time/rollout", "time/sync", "time/sleep", "time/logprob", "time/update")
                if k in m) + f"), peak {peak_gib():.1f} GiB, {mallocs} cudaMalloc calls{split}, {retries} retries, "
                f"GC {m['bench/gc_s']:.2f} s (collections {m['bench/gc_collections']} of generations 0/1/2"
                + (f"; {m['bench/gc_s_update']:.2f} s in the update)" if marks else ")"))
    finally:  # the trainer as it was (its class's method again, unless it had its own)
        if own:
            trainer._prepare = prepare
        elif prepare is not None:
            del trainer._prepare
    return m, peak_gib(), held


# -- output -------------------------------------------------------------------------------------
def write(results: dict, out: Path, log: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    for key in ("rollout", "step"):
        rows = results.get(key) or []
        if rows:
            with open(out / f"{key}.csv", "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
                w.writeheader()
                w.writerows(rows)
    if log:
        (out / "log.txt").write_text("\n".join(LOG))
