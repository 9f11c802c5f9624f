"""One update pass through a 4-bit base with and without the dense-weight cache (``qerl_kit.dense_update``).

An update pass is what the trainer's update phase runs: ``mu`` times, for each micro-batch, the
policy's completion log-probs (a forward through every 4-bit projection) and a backward (an input
gradient through each, and a second forward with ``--checkpointing``). "packed" dequantizes every
weight at every call (``model.dense_cache_gib: 0``); "dense cache" opens one ``update_cache`` block
per pass, as the trainer does per step, so each weight is dequantized once per pass (its cost is
inside the timing). A bf16 + LoRA model (``--formats none``) gives the baseline. Random weights of
the preset's shape, a random LoRA, random tokens; the LoRA gradients of the two modes are compared
bit for bit. Prints a small markdown table (and writes it with ``--out``).

"routed s" is the dense-cache pass with every 4-bit call through the routed autograd Function (a
Python forward and backward per call, a route and a cache lookup in each), as before the layers took
the block's weight themselves (``qerl_kit.kernels.held_weight``: ``F.linear`` on the held W, autograd's
own input gradient, the same matmuls); "vs bf16" divides each dense-cache pass by the bf16 row's.
``--narrow`` keeps the preset's depth and structure but makes every width 64 (vocabulary 512), so the
pass's time is the host's work per call: what bounds a small model's update on a GPU, measurable on a CPU.

``--profile DIR`` then runs one more pass of each format (with the dense cache, as the trainer does)
under ``torch.profiler`` and writes DIR/profile_<format>.txt (the top kernels by their own GPU time,
CPU time on a CPU) and DIR/profile.md (each format's total and largest kernels side by side): where an
update pass through a 4-bit base spends the time a bf16 pass does not.

    python -m bench.bench_dense_cache --model Qwen2.5-0.5B --formats nvfp4 nf4 mxfp4 none   # GPU
    python -m bench.bench_dense_cache --smoke                                               # CPU, tiny
    python -m bench.bench_dense_cache --narrow --formats none nvfp4 nf4 mxfp4               # CPU, host work

``--paired`` then runs every format's dense-cache pass again in alternation (all models in memory) and
gives each round's ratio to bf16's pass of the same round: the table above times each format in its own
period, and a small model's host-bound pass follows the machine's speed (the 0.5B's NVFP4 / bf16 ratio
measured 0.78x to 1.18x in different holds). Each 4-bit format runs there twice per round: as the trainer
runs it, and "filled" (its block's dense weights made before the clock starts), so the fill's share of a
gap shows; every pass also counts its cudaMalloc calls (the allocator's new segments) and its host
thread's CPU seconds (``time.thread_time``: a pass that spends them all is bound by the host's work, one
whose seconds exceed them waited). ``--modes dense`` times the trainer's pass alone (one process per
format under a sampling profiler: ``bench/device.sh pyspy-update``).

``--after-engine NEW`` first has our StaticEngine (the Trainer's settings: CUDA graphs, the KV cache
kept) generate NEW tokens for every prompt of the batches, and keeps it alive while the passes are timed:
the process the Trainer's update runs in after our rollout. On the real 1.5B (hold 12) the update ran
1.13x slower after our rollout than after vLLM's, in both formats; the same pass with and without this
flag, one process each (``bench/device.sh engine-ab``), says whether the engine's state is the cause;
``--free-engine`` drops the engine before the passes: slow with it kept and not once freed points at what
the engine holds (memory, graphs), slow either way at what a rollout leaves in the process.
Below the table each format's dense-cache pass has its cudaMalloc calls and host-thread CPU seconds
(medians), and the objects Python's GC tracked before the passes with its collections during them (a
process holding more objects pays more per full collection): a pass that waits on new device memory, on
the host or on the GC shows it there.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import statistics
import time
from pathlib import Path

import torch

from bench.common import allocator_calls, build, free, profiled, sync, with_lora
from qerl_kit import dense_update
from qerl_kit.logprobs import completion_logprobs


# The real-model sizes the issue measures that qerl_kit.models.PRESETS lacks: overrides of the 7B preset
# (Qwen2.5-0.5B's and 1.5B's config.json: hidden, MLP width, layers, heads, tied embeddings).
SMALL = {"Qwen2.5-0.5B": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                              num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
         "Qwen2.5-1.5B": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                              num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)}


# --narrow: every width of the preset 64 (its depth and layer structure kept), a 512-token vocabulary.
NARROW = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=512)


def make_policy(preset: str, fmt: str, device: str, lora_r: int, checkpointing: bool, **overrides):
    """A random ``preset``-shaped model (a preset of qerl_kit.models or a key of ``SMALL``; config
    ``overrides`` on top) in ``fmt`` (none = bf16) with a random LoRA of rank ``lora_r``."""
    if preset not in SMALL and fmt in ("nvfp4", "none") and not overrides:
        model = build(preset, "nvfp4" if fmt == "nvfp4" else "bf16", device)  # nvfp4 built from meta
    else:
        from qerl_kit.models import build_model
        from qerl_kit.quantize import quantize_model

        base, over = ("Qwen2.5-7B", SMALL[preset]) if preset in SMALL else (preset, {})
        model = build_model(base, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device,
                            **{**over, **overrides})
        if fmt != "none":
            quantize_model(model, fmt=fmt)
    policy = with_lora(model, lora_r)
    if checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.enable_input_require_grads()
    return policy.train()


def engine_rollout(policy, batches, new: int):
    """A StaticEngine over ``policy`` (the Trainer's defaults) that has generated ``new`` tokens for
    every prompt of ``batches``: its KV cache, CUDA graphs and fused decode copies held, as after the
    Trainer's rollout. The caller keeps it alive while the passes run."""
    from qerl_kit.rollout import StaticEngine
    from qerl_kit.rollout.types import SamplingParams

    engine = StaticEngine(policy, ignore_eos=True)
    prompts = [row.tolist() for prompt, _ in batches for row in prompt]
    with torch.no_grad():
        out = engine.generate_ids(prompts, n=1, sampling=SamplingParams(max_new_tokens=new, seed=0))
    assert len(out.completion_ids) == len(prompts), (len(out.completion_ids), len(prompts))
    sync()
    return engine


def _logprobs(policy, prompt: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    """The completion log-probs of one micro-batch of unpadded rows, as the update pass computes them."""
    return completion_logprobs(policy, prompt, torch.ones_like(prompt), completion, torch.ones_like(completion))


def update_pass(policy, batches, mu: int) -> None:
    """``mu`` passes of forward + backward over ``batches`` (gradients accumulate, as between optimizer steps)."""
    for _ in range(mu):
        for prompt, completion in batches:
            _logprobs(policy, prompt, completion).mean().backward()


@contextlib.contextmanager
def routed_function():
    """Every 4-bit call through its routed autograd Function, as before the held path (the A/B baseline)."""
    from qerl_kit.linear import QuantLinear

    held = QuantLinear._forward_held
    QuantLinear._forward_held = lambda self, x: None
    try:
        yield
    finally:
        QuantLinear._forward_held = held


MODES = ("packed", "dense", "routed")  # the passes a format can be timed in (``main``'s modes)


def one_pass(policy, batches, mu: int, gib: float | None, routed: bool,
             filled: bool = False) -> tuple[float, float, int, float]:
    """(seconds, GiB the cache held, cudaMalloc calls, the host thread's CPU seconds) of one pass in its own
    ``update_cache`` block, as the trainer opens one per step. The CPU seconds (``time.thread_time``) are
    the work this thread did, launches and Python: a pass whose seconds exceed them waited (for the
    interpreter's lock, or at a read back where CUDA blocks rather than spins; a spinning wait counts as
    CPU time); one that spends them all was bound by the host. ``routed``: every 4-bit call through the
    routed autograd Function (``routed_function``). ``filled``: the block's dense weights made before the
    clock starts (a no-grad forward of the first micro-batch), so the time leaves out the block's fill (one
    dequantize per weight and the allocations that hold them): what a pass costs once its weights are dense."""
    policy.zero_grad(set_to_none=True)
    sync()
    with dense_update.update_cache(policy, gib) as block, (routed_function() if routed else contextlib.nullcontext()):
        if filled:
            with torch.no_grad():
                _logprobs(policy, *batches[0])
            sync()
        allocs, t0, c0 = allocator_calls()[0], time.perf_counter(), time.thread_time()
        update_pass(policy, batches, mu)
        sync()
        seconds, host = time.perf_counter() - t0, time.thread_time() - c0
    return seconds, block.peak_bytes / dense_update.GIB, allocator_calls()[0] - allocs, host


def timed_pass(*args, **kwargs) -> tuple[float, float, int, float]:
    """``one_pass`` under a frame of its own name, for the timed passes only (not the warm-up's compilation
    and first calls): what a sampling profiler keeps (``bench.pyspy_diff --within timed_pass``)."""
    return one_pass(*args, **kwargs)


def time_modes(policy, batches, mu: int, modes: dict[str, tuple[float | None, bool]], repeats: int) -> dict:
    """Each mode (name -> (cache budget, routed)): seconds per pass, the median of ``repeats`` passes taken in
    turns (mode after mode, so a drift of the machine's speed reaches every mode alike), after one warm-up
    pass per mode that also measures the CUDA working set the auto budget needs and the mode's peak memory;
    the GiB the cache held and the LoRA gradients of its last pass."""
    out = {}
    for name, (gib, routed) in modes.items():
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        one_pass(policy, batches, mu, gib, routed)
        peak = torch.cuda.max_memory_allocated() / dense_update.GIB if torch.cuda.is_available() else float("nan")
        out[name] = {"times": [], "allocs": [], "host": [], "peak": peak}
    for _ in range(repeats):
        for name, (gib, routed) in modes.items():
            seconds, held, allocs, host = timed_pass(policy, batches, mu, gib, routed)
            grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}
            out[name].update(gib=held, grads=grads)
            for key, value in (("times", seconds), ("allocs", allocs), ("host", host)):
                out[name][key].append(value)
    for r in out.values():  # medians: seconds, cudaMalloc calls and host-thread CPU seconds per pass
        r["s"], r["allocs"], r["host"] = (statistics.median(r.pop(key)) for key in ("times", "allocs", "host"))
    return out


def paired_passes(policies: dict, batches, mu: int, gib: float | None,
                  repeats: int) -> tuple[dict[str, list[float]], dict[str, list[int]], dict[str, list[float]]]:
    """Seconds, cudaMalloc calls and host CPU seconds of each format's dense-cache pass, ``repeats`` rounds
    in which every format runs one pass, the order rotated each round (after one warm-up round): the
    formats' passes alternate, so a drift of the machine's speed (a host-bound small model's pass follows the host's)
    reaches all of them alike, and each round's ratio compares passes a few seconds apart. Each 4-bit
    format also runs as "<format> filled": its block's weights made before the clock starts
    (``one_pass(filled=True)``), so the fill's share of the gap shows."""
    runs = [(name, name, False) for name in policies]
    runs += [(f"{name} filled", name, True) for name in policies if name != "none"]
    for _, policy, filled in runs:
        one_pass(policies[policy], batches, mu, gib, False, filled)
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    allocs: dict[str, list[int]] = {name: [] for name, _, _ in runs}
    host: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for r in range(repeats):
        for name, policy, filled in runs[r % len(runs):] + runs[:r % len(runs)]:
            seconds, _, n, cpu = one_pass(policies[policy], batches, mu, gib, False, filled)
            times[name].append(seconds)
            allocs[name].append(n)
            host[name].append(cpu)
    return times, allocs, host


def paired_markdown(times: dict[str, list[float]], allocs: dict[str, list[int]] | None = None,
                    host: dict[str, list[float]] | None = None, base: str = "none") -> list[str]:
    """Each format's median pass, its ratio to ``base``'s pass of the same round (median [min-max]), its
    median cudaMalloc calls per pass and its host thread's median CPU seconds per pass (as a share of
    the pass's own seconds, the median over rounds)."""
    lines = ["", f"## Paired: the formats' dense-cache passes in alternation ({len(times[base])} rounds)", "",
             f"| format | dense cache s (median) | per round: {base} s / this s, median [min-max] "
             "| cudaMalloc calls per pass (median) | host CPU s per pass (median; of the pass) |",
             "|---|---:|---|---:|---|"]
    for name, ts in times.items():
        ratios = sorted(b / t for b, t in zip(times[base], ts))
        mallocs = statistics.median(allocs[name]) if allocs and allocs.get(name) else float("nan")
        cpu = host.get(name) if host else None
        busy = (f"{statistics.median(cpu):.3f} ({statistics.median(c / t for c, t in zip(cpu, ts)):.0%})"
                if cpu else "–")
        lines.append(f"| {name} | {statistics.median(ts):.3f} | {statistics.median(ratios):.2f}x "
                     f"[{ratios[0]:.2f}-{ratios[-1]:.2f}x] | {mallocs:g} | {busy} |")
    return lines


def profile_pass(policy, batches, mu: int, gib: float | None, top: int = 30,
                 stacks: bool = False) -> tuple[str, list[tuple[str, float, int]]]:
    """One dense-cache pass under torch.profiler: (its key_averages table, [(name, own ms, calls)] of
    the ``top`` names by their own device time, CPU time without a GPU)."""
    def one_pass():
        with dense_update.update_cache(policy, gib):
            update_pass(policy, batches, mu)
            sync()  # the pass's kernels end inside the block, as when it was timed

    policy.zero_grad(set_to_none=True)
    _, table, rows = profiled(one_pass, top, stacks)
    return table, rows


def profile_markdown(profiles: dict[str, list[tuple[str, float, int]]], top: int = 12) -> list[str]:
    """Each format's largest kernels (own ms, calls) side by side with their sum."""
    lines = ["", "## Where a pass spends its time (torch.profiler, one pass with the dense cache)", ""]
    for fmt, rows in profiles.items():
        total = sum(ms for _, ms, _ in rows)
        lines += [f"### {fmt}: {total:.1f} ms in its top {len(rows)} names", "", "| kernel / op | own ms | calls |",
                  "|---|---:|---:|"]
        lines += [f"| `{name[:80]}` | {ms:.2f} | {n} |" for name, ms, n in rows[:top]]
        lines.append("")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="Qwen2.5-0.5B")
    ap.add_argument("--formats", nargs="+", default=["nvfp4"], help="nvfp4, nf4, mxfp4, none (bf16 + LoRA)")
    ap.add_argument("--micro-batch", type=int, default=16, help="sequences per forward/backward")
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per pass")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--completion", type=int, default=384, help="completion tokens per sequence")
    ap.add_argument("--mu", type=int, default=1)
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on")
    ap.add_argument("--gib", type=float, default=None, help="the cache budget (default: auto)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="a markdown file to write the table to")
    ap.add_argument("--smoke", action="store_true", help="CPU, the tiny model, small shapes")
    ap.add_argument("--profile", default=None, help="a folder: one more pass per format under torch.profiler")
    ap.add_argument("--stacks", action="store_true", help="with --profile: name each synchronization's Python "
                    "call site and rank the Python frames' own time (about twice the profiler's cost)")
    ap.add_argument("--narrow", action="store_true", help="every width 64, the preset's depth: the host's work")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                    help="the passes timed per format (dense: the trainer's; one alone for a sampling profiler)")
    ap.add_argument("--paired", action="store_true", help="then every format's dense-cache pass again, in alternation "
                    "(paired_passes), each round's ratio to bf16's (needs none among --formats; all models in memory)")
    ap.add_argument("--after-engine", type=int, default=0, metavar="NEW",
                    help="time the passes after our StaticEngine generated NEW tokens per prompt, the engine kept")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.collect() then gc.freeze() before the passes, as "
                    "vLLM does after its warm-up: the objects alive then leave the GC's full collections")
    ap.add_argument("--free-engine", action="store_true",
                    help="with --after-engine: drop the engine (its cache, graphs and copies freed) before the passes")
    args = ap.parse_args()
    if args.after_engine < 0:
        ap.error(f"--after-engine must be an int >= 0 (new tokens; 0: no engine); got {args.after_engine}")
    if args.free_engine and not args.after_engine:
        ap.error("--free-engine drops the engine --after-engine NEW made: give --after-engine too")
    if "dense" not in args.modes:
        ap.error(f"--modes must include dense (the trainer's pass, the table's reference); got {' '.join(args.modes)}")
    if args.paired and "none" not in args.formats:
        ap.error(f"--paired compares each format with bf16: list none among --formats (got {' '.join(args.formats)})")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.model, args.micro_batch, args.prompt, args.completion, args.lora_r, args.repeats = \
            "qwen2-tiny", 2, 8, 24, 4, 1
    if args.narrow:  # short sequences and a small rank too, each unless given
        given = {a.split("=")[0] for a in _argv()}
        for option, value in (("--micro-batch", 4), ("--prompt", 16), ("--completion", 48), ("--lora-r", 8)):
            if option not in given:
                setattr(args, option[2:].replace("-", "_"), value)
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    lines = [f"# One update pass, packed vs dense cache ({gpu}, {datetime.date.today()}, torch {torch.__version__})",
             "", f"`python -m bench.bench_dense_cache {' '.join(_argv())}`", "",
             f"{args.model}{' narrowed (every width 64, vocabulary 512)' if args.narrow else ''}, LoRA r "
             f"{args.lora_r}, {args.micro_batches} x {args.micro_batch} sequences of "
             f"{args.prompt} + {args.completion} tokens, mu {args.mu}, gradient checkpointing "
             f"{'on' if args.checkpointing else 'off'}, {torch.get_num_threads()} CPU thread(s)"
             + (f", after our StaticEngine generated {args.after_engine} tokens per prompt "
                f"({'then freed' if args.free_engine else 'kept alive'})" if args.after_engine else "")
             + (", the GC's heap frozen before the passes (gc.freeze)" if args.gc_freeze else ""), "",
             "| format | packed s | dense cache s | routed s | speed-up (packed / cache) | routed / cache "
             "| vs bf16 (cache) | cache MiB | peak GiB (packed / cache) | LoRA grads equal (packed, routed) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    print("\n".join(lines), flush=True)
    profiles: dict[str, list] = {}
    notes: list[str] = []  # per format, below the table: the dense pass's cudaMalloc calls and host CPU time
    bf16 = None  # the bf16 row's dense-cache seconds, once measured (list "none" first to compare each row)
    for fmt in args.formats:
        policy = make_policy(args.model, fmt, device, args.lora_r, args.checkpointing, **(NARROW if args.narrow else {}))
        vocab = policy.config.vocab_size
        g = torch.Generator().manual_seed(1)
        batches = [tuple(torch.randint(10, vocab - 10, (args.micro_batch, n), generator=g).to(device)
                         for n in (args.prompt, args.completion)) for _ in range(args.micro_batches)]
        modes = {"packed": (0, False), "dense": (args.gib, False), "routed": (args.gib, True)}  # (budget, routed)
        modes = {m: modes[m] for m in args.modes}
        engine = engine_rollout(policy, batches, args.after_engine) if args.after_engine else None
        if args.free_engine:  # the process after a rollout, less the engine's own state
            engine = None
            free()
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
        tracked, collected = len(gc.get_objects()), [g["collections"] for g in gc.get_stats()]
        timed = time_modes(policy, batches, args.mu, modes, args.repeats)
        collected = [g["collections"] - c for g, c in zip(gc.get_stats(), collected)]
        if args.gc_freeze:  # back to collectable: this format's model must go before the next one's loads
            gc.unfreeze()
        dense = timed["dense"]
        bf16 = dense["s"] if fmt == "none" else bf16
        row = mode_row(fmt, timed, bf16)
        print(row, flush=True)
        lines.append(row)
        notes.append(f"- {fmt}, the dense-cache pass (median of {args.repeats}): {dense['s']:.3f} s, "
                     f"{dense['allocs']:g} cudaMalloc calls, {dense['host']:.3f} s of host-thread CPU time; "
                     f"{tracked} objects tracked by Python's GC before the passes, collections of generations "
                     f"0/1/2 during them {'/'.join(map(str, collected))}")
        if args.profile:
            table, profiles[fmt] = profile_pass(policy, batches, args.mu, args.gib, stacks=args.stacks)
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            (Path(args.profile) / f"profile_{fmt}.txt").write_text(table)
        del policy, dense, timed, engine  # batches: the same random ids for --paired
        free()
    lines += [""] + notes
    print("\n".join(notes), flush=True)
    if args.paired:
        policies = {fmt: make_policy(args.model, fmt, device, args.lora_r, args.checkpointing,
                                     **(NARROW if args.narrow else {})) for fmt in args.formats}
        paired = paired_markdown(*paired_passes(policies, batches, args.mu, args.gib, args.repeats))
        print("\n".join(paired), flush=True)
        lines += paired
        del policies
        free()
    if profiles:
        lines += profile_markdown(profiles)
        (Path(args.profile) / "profile.md").write_text("\n".join(lines) + "\n")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")


def mode_row(fmt: str, timed: dict, bf16: float | None) -> str:
    """One format's row of the modes table (``time_modes``' results); a mode not run (``--modes``) reads "–"."""
    dense, packed, routed = timed["dense"], timed.get("packed"), timed.get("routed")

    def seconds(mode: dict | None) -> str:
        return "–" if mode is None else f"{mode['s']:.3f}"

    def speed_up(mode: dict | None) -> str:
        return "–" if mode is None else f"{mode['s'] / dense['s']:.2f}x"

    def same(mode: dict | None) -> str:  # its LoRA gradients equal the dense-cache pass's, bit for bit
        if mode is None:
            return "–"
        equal = mode["grads"].keys() == dense["grads"].keys() and all(
            torch.equal(mode["grads"][k], dense["grads"][k]) for k in mode["grads"])
        return "yes" if equal else "NO"

    versus = f"{dense['s'] / bf16:.2f}x" if bf16 else ""
    packed_peak = "–" if packed is None else f"{packed['peak']:.2f}"
    return (f"| {fmt} | {seconds(packed)} | {dense['s']:.3f} | {seconds(routed)} | {speed_up(packed)} | "
            f"{speed_up(routed)} | {versus} | {dense['gib'] * 1024:.1f} | {packed_peak} / {dense['peak']:.2f} | "
            f"{same(packed)}, {same(routed)} |")


def _argv() -> list[str]:
    import sys

    return sys.argv[1:]


if __name__ == "__main__":
    main()
