"""The whole GRPO step, split per phase, against the same call's baselines: one command per table.

    python -m bench.bench_step run --models Qwen2.5-7B --formats none nvfp4 nf4 mxfp4 --engines static \\
        --lengths fixed:512 --gradient-checkpointing off on --out OUT
    python -m bench.bench_step run --models Qwen2.5-7B --formats nvfp4 --engines vllm --out OUT  # vLLM importable
    python -m bench.bench_step report OUT_A OUT_B ... --out MERGED   # table + plot from several calls' step.csv

One run: a model (a ``qerl_kit.models`` preset with random weights as ``bench.common.build`` makes it, NF4
and MXFP4 quantized from that bf16 model by ``quantize_model``, ``bnb-nf4`` by bitsandbytes' NF4
layers, the field's QLoRA kernels; or a GGUF file through
``qerl_kit.gguf_model.load_gguf``, or a model directory such as ``bench.real_model convert`` writes,
both through ``qerl_kit.build.load_base``, with GSM8K prompts from the data folder, ``$QERL_DATA``), LoRA r
``--lora-r`` on every projection, and the Trainer running ``--steps`` GRPO steps of ``--prompts`` x
``--group`` rows with ``--mu`` updates per batch in micro-batches of ``--micro-batch``, gradient
checkpointing on or off. AQN is on for NVFP4 and off for the baselines (``--aqn auto``: the paper's
recipe against plain LoRA and QLoRA). The phases are the Trainer's own ``time/*`` metrics of the steps
after the first (which pays kernel compilation and graph capture): the median of those, with the
fastest and slowest step beside it when there are several (``--steps 4``: three timed steps), which
gives each ratio of the report a range: ``rollout`` (the AQN sync; on vLLM also
wake, adapter upload and sleep, which ``sync`` shows apart), ``logprob`` (the old policy's log-probs),
``update`` (mu x forward + backward, clipping, optimizer; the clip statistics come from these
forwards) and ``other`` = step minus those three (rewards, advantages). Under ``loss.old_logp`` fold
(the default) the old policy's log-probs come from the update's own first forward and the Trainer
reports ``time/logprob`` 0.0.

Lengths (``--lengths``, several allowed): ``fixed:N`` (every row N new tokens); ``paper`` (the
paper's GSM8K preset, ``max_new_tokens`` 4096: lognormal of mean 300 and log-std 0.8 capped at 4096,
``bench.bench_live_rows.lengths_for`` seed 0, the distribution of every committed realistic-length
table with its cap raised to the preset's 4096; a mean near the 278-288 tokens the real 0.5B wrote
on GSM8K, ``bench/results/real_model_h200.md``; its longest of 128 rows is 1171 tokens);
``paper-tail`` (the same, with 4% of the rows running to the cap: the completions that never stop,
the share that reached a 512-token cap in that file's GSM8K runs, 2.6-6.1%; a stress case: given 4096
tokens the real 0.5B's completions stop, none of 256 reached 1024, ``bench/results/lengths_real05b_cpu``);
``measured:NAME`` (resampled, seeded, from a real model's measured lengths, ``bench.measured_lengths``:
``real05b`` is the real 0.5B on GSM8K at T = 1.0 with a 4096 cap, mean 293, longest 964; ``real15b`` the
real 1.5B, mean 340, longest 1219);
``lognormal:MEAN:SIGMA:CAP[:TAIL]``; ``natural:N`` (no forcing: the model's own completions up to
N, for a real model; not forced). A drawn row (every spec but ``natural``) runs to exactly its
length: ``stop_after`` on the StaticEngine, one request with ``min_tokens = max_tokens`` and
``ignore_eos`` per row on vLLM. Every row records the draw's parameters and a hash of its lengths.
``--max-new-tokens M`` scales a distribution down (mean and cap times M / cap; fixed lengths capped).

The dense-weight cache (``qerl_kit.dense_update``: 4-bit projections dequantized once for the log-prob
pass and update) is set per run, ``--dense-cache all`` (default: every 4-bit projection's dense copy, a
fixed figure where the Trainer's auto budget would depend on the free memory), ``auto`` (that budget: for
models whose dense copy does not fit beside the step, 32B on one H200) or GiB (0: off); the row
records the setting (``dense_cache``, ``dense_cache_gib``) and the most any step held
(``dense_cache_held_gib``), which the plan counts. Our engine's memory switches are flags too:
``--keep-cache on|off`` (``rollout.keep_cache``), ``--max-rows N`` (``rollout.max_rows``: N
completions decoded at a time, every row still forced to its drawn length) and ``--dense-decode
auto|on|off`` (the StaticEngine's ``dense_decode``: a same-call A/B of its dense copies) and
``--share-weights on|off`` (``rollout.share_weights``: the policy's q/k/v and gate/up stored in the
engine's fused buffers, no second copy; off by default, as in every earlier run); the row records
each (the plan counts the dense copies whatever the setting: an upper bound when off).
``--engine-off cuda_graphs compact shared_prefix fused`` turns those StaticEngine features off for the
run (recorded as ``engine_off``): with a real model's own lengths and the rollouts table, a same-call
A/B that says which part of the engine changes what it samples. ``--layout padded`` runs the Trainer's
training forward on the engine's left-padded rows under an attention mask (``completion_logprobs(aligned=
False)``), the baseline of the aligned default (recorded as ``layout``; rows from before the column ran it).

Each (model, format, engine) runs in a fresh process (``--isolate auto``: on a GPU, for honest peaks;
always for vLLM, whose memory is not given back inside one); a run that fails, runs out of memory or
whose process dies is a row with its status and error line, never dropped; one that fails after some
steps keeps how many finished (``steps_done``) and the last one's peak. Besides the step's peak, each
row has two figures read when the last step's rollout ended (CUDA): the rollout's peak
(``rollout_peak_gib``) and what stays allocated into the update (``after_rollout_gib``), so the
update's working set (peak minus the second) can be set against the plan's training parts (the row's
``plan_rollout_gib``, ``plan_kept_gib``, ``plan_training_gib``; step.md's "Memory by phase" table).
``--engines unsloth`` records why it was not run (Unsloth's whole GRPO step is ``bench/bench_trl_step.py``'s, at the same
shapes; ``bench/probe_unsloth.py`` probes its rollout path). Output:
OUT/step.csv (every run: settings, phase times, peak memory, the memory plan's figure), OUT/step.md
(GPU, date, versions, the runs, ratios against the same call's baselines, gradient checkpointing's
cost) and OUT/step.png (``bench.step_report``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from itertools import product
from pathlib import Path

import torch

from bench.child_rows import crash_line, read_rows
from bench.common import LOG, dense_cache_arg, log, package_versions
from bench.step_group import case_row, run_group
from bench.step_lengths import LENGTHS_HELP, draw_lengths
from bench.step_report import read_csv, write_csv, write_report
from qerl_kit.rollout.static.engine import DENSE_DECODE_MODES

FORMATS = ("none", "nvfp4", "nf4", "mxfp4", "bnb-nf4")
ENGINES = ("static", "vllm", "unsloth")
ENGINE_SWITCHES = ("cuda_graphs", "compact", "shared_prefix", "fused")  # StaticEngine's on/off options


def aqn_on(setting: str, fmt: str) -> bool:
    return fmt == "nvfp4" if setting == "auto" else setting == "on"


# -- the run: cases, processes, outputs -------------------------------------------------------------
def gpu_name() -> str:
    """The GPU's name from nvidia-smi, so the parent process of the isolated runs holds no CUDA context
    (its memory would be missing from theirs); torch's answer where nvidia-smi is missing; "cpu"."""
    if not torch.cuda.is_available():
        return "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
        return out[0] if out else torch.cuda.get_device_name()
    except (OSError, subprocess.SubprocessError):
        return torch.cuda.get_device_name()


def versions() -> dict:
    """The GPU, date and package versions every row carries (a report of several calls shows each)."""
    return dict(date=time.strftime("%Y-%m-%d"), run_id=f"{platform.node()}-{int(time.time())}", gpu=gpu_name(),
                **package_versions(torch="torch", triton="triton", transformers="transformers",
                                   humming="humming-kernels", vllm="vllm", bitsandbytes="bitsandbytes"))


def plan_cases(args) -> list[list[dict]]:
    """Every run, grouped by (model, format, engine), in the order the arguments give them."""
    groups = []
    for model, fmt, engine in product(args.models, args.formats, args.engines):
        cases = [dict(model=model, format=fmt, engine=engine, lengths=ln, gradient_checkpointing=ck == "on", mu=mu,
                      micro_batch=mb, seed=seed, aqn=aqn_on(args.aqn, fmt))
                 for ln, ck, mu, mb, seed in product(args.lengths, args.gradient_checkpointing, args.mu,
                                                     args.micro_batch, args.seeds)]
        groups.append(cases)
    for i, case in enumerate(c for g in groups for c in g):
        case["case_id"] = i
    return groups


def not_run(cases: list[dict], left: float) -> tuple[str, str] | None:
    """(status, why) of a group that does not run: Unsloth (see the module docstring), or no time left."""
    import importlib.util

    if cases[0]["engine"] == "unsloth":
        if importlib.util.find_spec("unsloth") is None:
            return ("not installed", "unsloth is not importable here (bench/make_unsloth_carry.sh carries it; "
                    "bench/probe_unsloth.py probes it)")
        return ("not run", "Unsloth's GRPO step is TRL's GRPOTrainer around its own model, not qerl_kit's Trainer; "
                "bench/bench_trl_step.py times it at the same shapes (bench/device.sh step-trl)")
    if left <= 0:
        return "skipped", "the call's --budget was spent before this group started"
    return None


def isolated(args, cases: list[dict]) -> bool:
    if cases[0]["engine"] == "vllm" or args.isolate == "on":
        return True
    return args.isolate == "auto" and torch.cuda.is_available()


def run_isolated(cases: list[dict], a: dict, meta: dict, out: Path, timeout: float) -> None:
    """``run_group`` in a fresh process; cases it left without a row become ``crashed`` rows."""
    spec = out / f"group{cases[0]['case_id']}.json"
    spec.write_text(json.dumps(dict(cases=cases, args=a, meta=meta)))
    rows_path = out / "rows.jsonl"
    log_path = out / f"group{cases[0]['case_id']}_log.txt"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as logf:
        try:
            rc = subprocess.run([sys.executable, "-m", "bench.bench_step", "worker", str(spec), str(rows_path)],
                                stdout=logf, stderr=subprocess.STDOUT, env=env, timeout=max(timeout, 1)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout (killed at the call's --limit)"
    spec.unlink()
    done = {r["case_id"] for r in read_rows(rows_path)}
    last = crash_line(log_path)
    for case in cases:
        if case["case_id"] not in done:
            with open(rows_path, "a") as f:
                f.write(json.dumps({**case_row(case, a, meta), "status": "crashed",
                                    "error": f"process exit {rc}: {last}"}) + "\n")
    log(f"{cases[0]['model']} {cases[0]['format']} {cases[0]['engine']}: process exit {rc}")


def run_settings(args) -> dict:
    """The call's settings every case reads (``step_group``'s ``a``), from the parsed ``run`` arguments."""
    return {k: getattr(args, k) for k in ("prompts", "group", "prompt_len", "lora_r", "steps", "max_new_tokens",
                                          "keep_cache", "max_rows", "vllm_memory", "length_seed", "dense_cache",
                                          "dense_decode", "share_weights", "lora_tiling", "lora_forward", "layout",
                                          "profile", "engine_off")}


def run(args) -> list[dict]:
    """Every case of the call, then OUT/step.csv, step.md and step.png."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    rows_path.unlink(missing_ok=True)
    a = run_settings(args)
    meta, start, first_line = versions(), time.perf_counter(), len(LOG)  # this call's clock and log lines
    limit = args.budget + 120 if args.limit is None else args.limit
    for cases in plan_cases(args):
        skip = not_run(cases, args.budget - (time.perf_counter() - start))
        if skip:
            with open(rows_path, "a") as f:
                for case in cases:
                    f.write(json.dumps({**case_row(case, a, meta), "status": skip[0], "error": skip[1]}) + "\n")
        elif isolated(args, cases):
            run_isolated(cases, a, meta, out, limit - (time.perf_counter() - start))
        else:
            run_group(cases, a, meta, rows_path)
    write_csv(read_rows(rows_path), out / "step.csv")
    rows = read_csv(out / "step.csv")  # the table from the CSV, as ``report`` builds it
    write_report(rows, out)
    (out / "log.txt").write_text("\n".join(LOG[first_line:]))
    log(f"wrote {out}/step.csv, step.md, step.png ({len(rows)} runs)")
    return rows


def _choices(kind: str, allowed):
    def check(value: str) -> str:
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"{kind} {value!r}: allowed {', '.join(allowed)}")
        return value
    return check


def _lengths(value: str) -> str:
    draw_lengths(value, 1)  # refused here, naming the spec and what is allowed
    return value


def _lora_tiling(value: str) -> str:
    if value != "default":
        from bench.bench_lora_tiling import parse_tiling

        try:
            parse_tiling(value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"lora-tiling: {err}") from None
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure (one table)")
    r.add_argument("--out", default=os.environ.get("OUT", "bench/results/step"))
    r.add_argument("--models", nargs="+", default=["Qwen2.5-7B"], help="qerl_kit.models presets or GGUF paths")
    r.add_argument("--formats", nargs="+", default=["none", "nvfp4"], type=_choices("format", FORMATS))
    r.add_argument("--engines", nargs="+", default=["static"], type=_choices("engine", ENGINES))
    r.add_argument("--lengths", nargs="+", default=["fixed:512"], type=_lengths, help=LENGTHS_HELP)
    r.add_argument("--max-new-tokens", type=int, default=None, help="cap / scale every length (small test runs)")
    r.add_argument("--length-seed", type=int, default=0)
    r.add_argument("--mu", nargs="+", type=int, default=[1])
    r.add_argument("--micro-batch", nargs="+", type=int, default=[8])
    r.add_argument("--gradient-checkpointing", nargs="+", default=["off"], type=_choices("checkpointing", ("off", "on")))
    r.add_argument("--steps", type=int, default=2, help="steps per run; the first is a warm-up, the median of the rest is reported")
    r.add_argument("--seeds", nargs="+", type=int, default=[0])
    r.add_argument("--prompts", type=int, default=8)
    r.add_argument("--group", type=int, default=8)
    r.add_argument("--prompt-len", type=int, default=256)
    r.add_argument("--lora-r", type=int, default=32)
    r.add_argument("--aqn", default="auto", type=_choices("aqn", ("auto", "on", "off")), help="auto: on for nvfp4")
    r.add_argument("--keep-cache", default=True, type=lambda v: _choices("keep-cache", ("on", "off"))(v) == "on")
    r.add_argument("--max-rows", type=int, default=None,
                   help="our engine decodes at most this many completions at once (rollout.max_rows); default all")
    r.add_argument("--dense-decode", default="auto", type=_choices("dense-decode", DENSE_DECODE_MODES),
                   help="the StaticEngine's dense_decode (auto: bf16 copies of the small 4-bit groups where the "
                        "routes table says cuBLAS wins; off: every decode through the 4-bit kernels)")
    r.add_argument("--share-weights", default=False,
                   type=lambda v: _choices("share-weights", ("on", "off"))(v) == "on",
                   help="the StaticEngine's share_weights (on: the policy's q/k/v and gate/up are the fused "
                        "plan's buffers, no second copy; off, the default: the engine holds its own copy)")
    r.add_argument("--lora-tiling", default="default", type=_lora_tiling,
                   help="SPLITS,BLOCK_M,N_BLOCKS[,reduce]: the StaticEngine's decode step runs its grouped LoRA "
                        "kernels cut by this lora_triton.Tiling (bench.bench_lora_tiling picks one); default: "
                        "the kernels' own")
    r.add_argument("--lora-forward", default="fused", type=_choices("lora-forward", ("fused", "peft")),
                   help="the training pass's LoRA layers: fused (the default: the adapter added in the GEMM, "
                        "qerl_kit.lora_layer) or peft (peft's own forward, a multiply and an add over each output)")
    r.add_argument("--layout", default="aligned", type=_choices("layout", ("aligned", "padded")),
                   help="the training forward's layout: aligned (the default: each row from column 0, causal, no "
                        "mask) or padded (the engine's left-padded rows under an attention mask, its baseline)")
    r.add_argument("--engine-off", nargs="+", default=[], type=_choices("engine-off", ENGINE_SWITCHES),
                   help="StaticEngine features turned off for the run (a same-call A/B that takes the engine apart: "
                        "cuda_graphs, compact (live-row compaction), shared_prefix (one prompt prefix per group), "
                        "fused (the fused decode plan)); the row records them")
    r.add_argument("--dense-cache", default="all", type=dense_cache_arg,
                   help="model.dense_cache_gib per run: all (every 4-bit projection's dense copy), auto (the "
                        "Trainer's budget) or GiB (0: off)")
    r.add_argument("--profile", nargs="?", const="ops", default=None, choices=["ops", "stacks"],
                   help="one more step per run under torch.profiler, after the timed ones (which it does not "
                        "change): OUT/profile_case<N>.txt, its top kernels by own GPU time and host time, the "
                        "synchronizations counted; '--profile stacks' also names their Python call sites")
    r.add_argument("--vllm-memory", type=float, default=0.3, help="vLLM's gpu_memory_utilization")
    r.add_argument("--isolate", default="auto", type=_choices("isolate", ("auto", "on", "off")))
    r.add_argument("--budget", type=float, default=420.0, help="seconds after which no new group starts")
    r.add_argument("--limit", type=float, default=None, help="seconds after which a group's process is killed "
                   "(its unfinished runs: crashed rows); default budget + 120")
    rep = sub.add_parser("report", help="table + plot from several calls' step.csv")
    rep.add_argument("inputs", nargs="+", help="step.csv files or the folders holding them")
    rep.add_argument("--out", required=True)
    w = sub.add_parser("worker", help="internal: one (model, format, engine) group in this process")
    w.add_argument("spec")
    w.add_argument("rows")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "run":
        for key in ("steps", "prompts", "group", "prompt_len", "lora_r"):
            if getattr(args, key) < 1:
                raise SystemExit(f"--{key.replace('_', '-')} {getattr(args, key)}: must be >= 1")
        if min(args.mu + args.micro_batch) < 1:
            raise SystemExit(f"--mu {args.mu} / --micro-batch {args.micro_batch}: every value must be >= 1")
        if args.max_rows is not None and (args.max_rows < 1 or args.max_rows % args.group):
            raise SystemExit(f"--max-rows {args.max_rows}: must be a positive multiple of --group {args.group} "
                             "(the engine decodes whole groups)")
        run(args)
    elif args.cmd == "report":
        from bench.step_report import report_main

        report_main(args.inputs, Path(args.out))
    else:
        spec = json.loads(Path(args.spec).read_text())
        run_group(spec["cases"], spec["args"], spec["meta"], Path(args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
