"""The whole-GRPO-step table (``bench.bench_step``): the CSV's columns, the markdown table with its
ratios against the same call's baselines and gradient checkpointing's cost, and the per-phase plot.

    python -m bench.bench_step report OUT_A OUT_B ... --out MERGED

``report`` reads several calls' step.csv (vLLM runs one format per call) and writes MERGED/step.csv,
step.md and step.png. A baseline's row of a setting: the last input's wins; NVFP4 + LoRA on our
StaticEngine (the subject) keeps one row per call, so each baseline is paired with the subject row
measured in its own call where there is one. A ratio is the baseline's seconds over the subject's
(above 1: ours is faster), per phase, for rows of identical settings; "same call" says whether both
rows came from one call (one process tree, one hold).
"""

from __future__ import annotations

import csv
from pathlib import Path

# every run's row, in this order (later keys, if any, follow)
SETTINGS = ["model", "format", "engine", "lengths", "length_params", "lengths_sha", "mean_length", "max_length",
            "max_new_tokens", "prompts", "group", "rows", "prompt_len", "lora_r", "mu", "micro_batch",
            "gradient_checkpointing", "aqn", "keep_cache", "max_rows", "dense_cache", "dense_cache_gib", "dense_decode",
            "share_weights", "lora_tiling", "lora_forward", "layout", "engine_off", "optimizer", "lr", "seed", "steps",
            "step_index"]
RESULTS = ["status", "error", "time_step", "time_rollout", "time_sync", "time_wake", "time_upload", "time_sleep",
           "time_logprob", "time_update", "time_other", "measured_mean_length", "rollout_tokens_per_s", "aqn_sigma",
           "rollout_at_cap", "rollout_reward", "rollout_accuracy", "rollout_entropy", "rollout_logp_gap",
           "peak_gib", "peak_reserved_gib", "rollout_peak_gib", "after_rollout_gib", "steps_done", "dense_cache_held_gib",
           "plan_gib", "plan_note", "plan_rollout_gib", "plan_kept_gib", "plan_training_gib", "engine_start_s", "wall_s",
           "timed_steps", "time_step_min", "time_step_max", "time_rollout_min", "time_rollout_max", "time_update_min",
           "time_update_max", "gpu_before", "gpu_after"]
META = ["case_id", "run_id", "date", "gpu", "torch", "triton", "transformers", "humming", "vllm", "bitsandbytes"]
COLUMNS = META + SETTINGS + RESULTS
NUMERIC = {"dense_cache_gib", "lr", "max_rows", "mean_length", "max_length", "max_new_tokens", "prompts", "group", "rows", "lora_r", "mu", "micro_batch",
           "seed", "steps", "step_index", "case_id", *(c for c in RESULTS if c not in ("status", "error", "plan_note", "gpu_before", "gpu_after"))}
# what a setting is, without format and engine: rows that share it are compared
KEY = ["model", "lengths", "lengths_sha", "prompts", "group", "prompt_len", "lora_r", "mu", "micro_batch",
       "gradient_checkpointing", "dense_cache", "dense_decode", "share_weights", "lora_tiling", "lora_forward",
       "layout", "engine_off", "seed", "steps"]
SUBJECT = ("nvfp4", "static")
# (label, format, engine, the issue's target speed-up or None; "lengths" targets depend on the lengths)
BASELINES = [("bf16 + LoRA, ours", "none", "static", "lengths"), ("NF4 + LoRA (QLoRA), ours", "nf4", "static", 1.5),
             ("bitsandbytes NF4 + LoRA (QLoRA), ours", "bnb-nf4", "static", 1.5),
             ("MXFP4 + LoRA, ours", "mxfp4", "static", None), ("NVFP4 step driven by vLLM", "nvfp4", "vllm", 1.3),
             ("bf16 step driven by vLLM", "none", "vllm", None), ("NF4 step driven by vLLM", "nf4", "vllm", None),
             ("QLoRA step by Unsloth", "nf4", "unsloth", None)]
PHASES = [("rollout", "time_rollout"), ("log-probs", "time_logprob"), ("update", "time_update"), ("other", "time_other")]
FORMAT_NAMES = {"none": "bf16", "nvfp4": "NVFP4", "nf4": "NF4", "mxfp4": "MXFP4", "bnb-nf4": "bitsandbytes NF4"}


def write_csv(rows: list[dict], path: Path) -> None:
    cols = COLUMNS + [k for k in dict.fromkeys(k for r in rows for k in r) if k not in COLUMNS]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    """A step.csv's rows with numbers as floats and booleans as bools (empty cells: NaN / "")."""
    def value(k, v):
        if k in NUMERIC:
            return float(v) if v not in ("", None) else float("nan")
        if v in ("True", "False"):
            return v == "True"
        return v
    with open(path, newline="") as f:
        return [{k: value(k, v) for k, v in r.items()} for r in csv.DictReader(f)]


def merge(paths) -> list[dict]:
    """Rows of several step.csv files (or folders holding one), in input order. For the same setting,
    format, engine and AQN the later input wins, but the subject (NVFP4 + LoRA, StaticEngine) keeps
    one row per call (``run_id``): ``ratios`` pairs a baseline with the subject of its own call."""
    seen: dict[tuple, dict] = {}
    for p in map(Path, paths):
        for r in read_csv(p / "step.csv" if p.is_dir() else p):
            call = (str(r.get("run_id")),) if (r.get("format"), r.get("engine")) == SUBJECT else ()
            seen[_key(r) + tuple(str(r.get(k)) for k in ("format", "engine", "aqn")) + call] = r
    return list(seen.values())


def _ok(r: dict) -> bool:
    return r.get("status") == "ok"


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


# a setting's value in rows written before its column existed (an older step.csv read back): what those runs did
# (the training forward ran the padded, masked layout until 2026-12-06)
KEY_DEFAULTS = {"lora_tiling": "default", "lora_forward": "fused", "layout": "padded", "engine_off": ""}


def _key(r: dict) -> tuple:
    return tuple(str(r.get(k, KEY_DEFAULTS.get(k))) for k in KEY)


def _target(target, model: str, lengths: str):
    """Issue #45's target speed-up of the 7B step against this baseline (None elsewhere). The 1.5x is the
    paper's lengths': the drawn specs at its 4096 cap and a real model's own lengths there (``measured:``)."""
    if model != "Qwen2.5-7B" or target is None:
        return None
    if target != "lengths":
        return target
    return 1.2 if lengths == "fixed:512" else 1.5 if lengths in ("paper", "paper-tail") or lengths.startswith("measured:") else None


def ratios(rows: list[dict]) -> list[dict]:
    """NVFP4 + LoRA on the StaticEngine against each baseline with identical settings: baseline
    seconds / ours, per phase (above 1: ours faster); a missing or failed baseline is left out."""
    out = []
    by = {(_key(r), r["format"], r["engine"]): r for r in rows if _ok(r) and (r["format"], r["engine"]) != SUBJECT}
    subjects: dict[tuple, list[dict]] = {}
    for r in rows:
        if _ok(r) and (r["format"], r["engine"]) == SUBJECT:
            subjects.setdefault(_key(r), []).append(r)
    for key, subs in subjects.items():
        for label, bfmt, bengine, target in BASELINES:
            base = by.get((key, bfmt, bengine))
            if base is None:
                continue
            # the subject measured in the baseline's call, else the last one
            subj = next((r for r in subs if r.get("run_id") == base.get("run_id")), subs[-1])
            row = dict(model=subj["model"] + _decode_note(subj), lengths=subj["lengths"], mu=subj["mu"],
                       micro_batch=subj["micro_batch"],
                       gradient_checkpointing=subj["gradient_checkpointing"], seed=subj["seed"], baseline=label,
                       target=_target(target, subj["model"], subj["lengths"]),
                       same_call=subj.get("run_id") == base.get("run_id"))
            for name, col in [("step", "time_step")] + PHASES[:3]:
                ours, theirs = _num(subj.get(col)), _num(base.get(col))
                row[name] = theirs / ours if ours > 0 and theirs == theirs else float("nan")
            # the step ratio's range over the timed steps: slowest baseline step / fastest of ours and back
            spread = [_num(r.get(k)) for r in (base, subj) for k in ("time_step_min", "time_step_max")]
            timed = min(_num(base.get("timed_steps")), _num(subj.get("timed_steps")))
            row["step_low"], row["step_high"] = (spread[0] / spread[3], spread[1] / spread[2]) \
                if timed > 1 and all(v > 0 for v in spread) else (float("nan"), float("nan"))
            out.append(row)
    return out


def checkpointing_cost(rows: list[dict]) -> list[dict]:
    """Per format / engine / setting with runs both with and without gradient checkpointing: the
    update's and the step's time on over off, and the two peaks."""
    runs = {}
    for r in rows:
        if _ok(r):
            k = tuple(str(r.get(c)) for c in KEY if c != "gradient_checkpointing") + (r["format"], r["engine"])
            runs.setdefault(k, {})[bool(r["gradient_checkpointing"])] = r
    out = []
    for pair in runs.values():
        if True in pair and False in pair:
            on, off = pair[True], pair[False]
            out.append(dict(model=on["model"], format=on["format"], engine=on["engine"], lengths=on["lengths"],
                            mu=on["mu"], micro_batch=on["micro_batch"], update_off=_num(off["time_update"]),
                            update_on=_num(on["time_update"]),
                            update_cost=_num(on["time_update"]) / _num(off["time_update"]),
                            step_cost=_num(on["time_step"]) / _num(off["time_step"]),
                            peak_off=_num(off.get("peak_gib")), peak_on=_num(on.get("peak_gib"))))
    return out


def _f(v, spec=".2f") -> str:
    v = _num(v)
    return "–" if v != v else format(v, spec)


def _spread(r: dict, phase: str) -> str:
    """' [fastest-slowest]' of a phase over a run's timed steps, where it timed more than one (square
    brackets: the round ones after a vLLM row's rollout are its sync + sleep)."""
    lo, hi = _num(r.get(f"time_{phase}_min")), _num(r.get(f"time_{phase}_max"))
    return f" [{lo:.2f}-{hi:.2f}]" if _num(r.get("timed_steps")) > 1 and lo == lo and hi == hi else ""


def _decode_note(r: dict) -> str:
    """The run's settings other than the defaults, in the label: the StaticEngine's dense decode copies
    (on/off, not auto), shared weights, a LoRA tiling, peft's LoRA forward, the padded training layout, engine
    features turned off."""
    mode = r.get("dense_decode")
    notes = [f"dense decode {mode}" if mode in ("on", "off") else "",
             "shared weights" if str(r.get("share_weights")) == "True" else "",  # a bool, or its text read back
             f"LoRA tiling {r['lora_tiling']}" if r.get("lora_tiling") not in (None, "", "default") else "",
             "peft's LoRA forward" if r.get("lora_forward") == "peft" else "",
             "padded layout" if r.get("layout") == "padded" else "",
             f"without {r['engine_off']}" if r.get("engine_off") else ""]
    note = ", ".join(n for n in notes if n)
    return f" ({note})" if note else ""


def _label(r: dict) -> str:
    return f"{FORMAT_NAMES.get(r['format'], r['format'])} + LoRA, {r['engine']}{_decode_note(r)}"


def runs_table(rows: list[dict]) -> list[str]:
    lines = ["| model | format / engine | lengths (mean / max) | ckpt | mu | micro | seed | step s | rollout "
             "(of it vLLM's sync + sleep) | log-probs | update | other | peak GiB | plan GiB | status |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (str(r["model"]), str(r["lengths"]), str(r["gradient_checkpointing"]),
                                         _num(r["mu"]), _num(r["micro_batch"]), _num(r["seed"]), _label(r))):
        sync = sum(x for x in (_num(r.get("time_sync")), _num(r.get("time_sleep"))) if x == x) \
            if _num(r.get("time_sync")) == _num(r.get("time_sync")) else float("nan")  # vLLM rows only
        status = "ok" if _ok(r) else f"{r.get('status')}: {str(r.get('error', ''))[:120]}".replace("|", "/")
        mean = r.get("mean_length") if _num(r.get("mean_length")) == _num(r.get("mean_length")) \
            else r.get("measured_mean_length")  # natural lengths: the mean the model wrote
        lines.append(f"| {r['model']} | {_label(r)} | {r['lengths']} ({_f(mean, '.0f')} / "
                     f"{_f(r.get('max_length'), '.0f')}) | {'on' if r['gradient_checkpointing'] else 'off'} | "
                     f"{_f(r['mu'], '.0f')} | {_f(r['micro_batch'], '.0f')} | {_f(r['seed'], '.0f')} | "
                     f"{_f(r.get('time_step'))}{_spread(r, 'step')} | {_f(r.get('time_rollout'))}{_spread(r, 'rollout')}"
                     + (f" ({_f(sync)})" if sync == sync else "") + f" | {_f(r.get('time_logprob'))} | "
                     f"{_f(r.get('time_update'))}{_spread(r, 'update')} | {_f(r.get('time_other'))} | {_f(r.get('peak_gib'))} | "
                     f"{_f(r.get('plan_gib'))} | {status} |")
    return lines


def ratio_table(rows: list[dict]) -> list[str]:
    rs = ratios(rows)
    if not rs:
        return ["No NVFP4 + LoRA StaticEngine run has a baseline run with the same settings here."]
    lines = ["| model | lengths | ckpt | mu | micro | seed | against | step | rollout | log-probs | update | "
             "target (issue #45, 7B) | same call | step over the timed steps |",
             "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in rs:
        met = "" if r["target"] is None else f"≥ {r['target']}x " + ("met" if r["step"] >= r["target"] else "not met")
        lines.append(f"| {r['model']} | {r['lengths']} | {'on' if r['gradient_checkpointing'] else 'off'} | "
                     f"{_f(r['mu'], '.0f')} | {_f(r['micro_batch'], '.0f')} | {_f(r['seed'], '.0f')} | {r['baseline']} | "
                     + " | ".join(f"{_f(r[k])}x" for k in ("step", "rollout", "log-probs", "update"))
                     + f" | {met} | {'yes' if r['same_call'] else 'no'} | "
                     + (f"{r['step_low']:.2f}-{r['step_high']:.2f}x |" if r["step_low"] == r["step_low"] else "– |"))
    return lines


def checkpointing_table(rows: list[dict]) -> list[str]:
    cs = checkpointing_cost(rows)
    if not cs:
        return ["No setting ran both with and without gradient checkpointing here."]
    lines = ["| model | format / engine | lengths | mu | micro | update off | update on | update on / off | "
             "step on / off | peak off / on GiB |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for c in cs:
        lines.append(f"| {c['model']} | {_label(c)} | {c['lengths']} | {_f(c['mu'], '.0f')} | "
                     f"{_f(c['micro_batch'], '.0f')} | {_f(c['update_off'])} | {_f(c['update_on'])} | "
                     f"{_f(c['update_cost'])}x | {_f(c['step_cost'])}x | {_f(c['peak_off'])} / {_f(c['peak_on'])} |")
    return lines


def header(rows: list[dict]) -> list[str]:
    """GPU, date, versions and length draws of every call the rows come from."""
    calls = {}
    for r in rows:
        calls.setdefault(r.get("run_id"), r)
    lines = ["# The whole GRPO step, per phase", ""]
    for run_id, r in calls.items():
        lines.append(f"- call `{run_id}`: {r.get('gpu')}, {r.get('date')}; torch {r.get('torch')}, triton "
                     f"{r.get('triton')}, transformers {r.get('transformers')}, humming-kernels {r.get('humming')}, "
                     f"vLLM {r.get('vllm')}, bitsandbytes {r.get('bitsandbytes')}")
    draws = {(r["lengths"], r.get("length_params"), r.get("lengths_sha"), r.get("rows")) for r in rows}
    for spec, params, sha, n in sorted(draws, key=str):
        lines.append(f"- lengths `{spec}`: {params}, {_f(n, '.0f')} rows" + (f", sha `{sha}`" if sha else ""))
    lines += ["", "Seconds per step (the Trainer's `time/*`): the last of two steps, or with more (`--steps`) the "
              "median over all but the first (a warm-up), the fastest and slowest in square brackets; rollout includes the AQN sync (vLLM: wake, "
              "adapter upload and sleep, in brackets); other = step - rollout - log-probs - update. Peak: "
              "`torch.cuda.max_memory_allocated` over the last step alone (its counter is reset before each step; "
              "`bench.bench_memory`'s peaks, in tests/data/measured_peaks.json, span every step, the first's "
              "compilation and graph capture included); with vLLM its pool is its own. Plan: "
              "`qerl_kit.memory_plan.plan_memory(...).allocated` for the same settings (engine, keep_cache, "
              "humming) and the dense-weight cache the steps held (`dense_cache_held_gib`, the most "
              "`memory/dense_cache_gib` of any step; the run's `model.dense_cache_gib` is `dense_cache_gib`, "
              "set by `--dense-cache`), the bound of the peak; none for vLLM rows.", ""]
    models = {str(r.get("model")) for r in rows}
    if "Qwen2.5-0.5B" in models and any(m.endswith(".gguf") or m.startswith("/") for m in models):
        lines += ["The `Qwen2.5-0.5B` preset ties its output layer to the embedding; the real 0.5B (GGUF) carries "
                  "its own `output.weight` (untied: 151936 x 896 bf16 more, about 0.25 GiB), so its peaks sit "
                  "that much higher at equal settings.", ""]
    return lines


def gpu_table(rows: list[dict]) -> list[str]:
    """Each run's GPU state before and after its steps, in the order the runs ran (where recorded)."""
    seen = [r for r in rows if r.get("gpu_before") or r.get("gpu_after")]
    if not seen:
        return []
    lines = ["", "## The GPU before and after each run's steps (nvidia-smi: temperature, SM clock, power, clock "
             "events)", "", "| call | case | model | format / engine | ckpt | before | after |", "|---|---:|---|---|---|---|---|"]
    for r in sorted(seen, key=lambda r: (str(r.get("run_id")), _num(r.get("case_id")))):
        lines.append(f"| {r.get('run_id')} | {_f(r.get('case_id'), '.0f')} | {r['model']} | {_label(r)} | "
                     f"{'on' if r['gradient_checkpointing'] else 'off'} | {r.get('gpu_before') or '–'} | "
                     f"{r.get('gpu_after') or '–'} |")
    return lines


def memory_table(rows: list[dict]) -> list[str]:
    """Each run's memory by phase against the plan's (runs with the Trainer's ``memory/*`` figures: CUDA): the
    rollout's peak (plan: static + rollout parts), what stays allocated into the update (plan: static +
    kept parts) and the update's working set on top of it (the step's peak minus that; plan: training
    parts). A measured figure above its plan's is where the plan misses something."""
    seen = [r for r in rows if _num(r.get("after_rollout_gib")) == _num(r.get("after_rollout_gib"))]
    if not seen:
        return []
    lines = ["", "## Memory by phase against the plan (GiB, measured (plan))", "",
             "| model | format / engine | ckpt | rollout peak | after the rollout | the update's working set | "
             "step peak | steps done |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in seen:
        work = _num(r.get("peak_gib")) - _num(r.get("after_rollout_gib"))
        lines.append(f"| {r['model']} | {_label(r)} | {'on' if r['gradient_checkpointing'] else 'off'} | "
                     f"{_f(r.get('rollout_peak_gib'))} ({_f(r.get('plan_rollout_gib'))}) | "
                     f"{_f(r.get('after_rollout_gib'))} ({_f(r.get('plan_kept_gib'))}) | "
                     f"{_f(work)} ({_f(r.get('plan_training_gib'))}) | {_f(r.get('peak_gib'))} ({_f(r.get('plan_gib'))}) | "
                     f"{_f(r.get('steps_done'), '.0f')} |")
    return lines


def rollouts_table(rows: list[dict]) -> list[str]:
    """What each run's rollouts were (runs that sampled their own lengths: ``natural``): engines sampling one
    policy on the same prompts should agree here within sampling noise, so a speed comparison of them is one of
    the same work, and the gap between an engine's log-probs of its tokens and the training forward's is
    small; where they do not, the engine computes another policy than the one trained."""
    seen = [r for r in rows if _ok(r) and str(r.get("lengths", "")).startswith("natural")
            and _num(r.get("rollout_entropy")) == _num(r.get("rollout_entropy"))]
    if not seen:
        return []
    lines = ["", "## What the rollouts were (their own lengths; the mean over the timed steps)", "",
             "| model | format / engine | lengths | mean length | at the cap | reward | accuracy | entropy | "
             "engine vs training log-prob gap | tokens / s |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in seen:
        lines.append(f"| {r['model']} | {_label(r)} | {r['lengths']} | {_f(r.get('measured_mean_length'), '.0f')} | "
                     f"{_f(r.get('rollout_at_cap'))} | {_f(r.get('rollout_reward'), '.3f')} | "
                     f"{_f(r.get('rollout_accuracy'), '.3f')} | {_f(r.get('rollout_entropy'), '.3f')} | "
                     f"{_f(r.get('rollout_logp_gap'), '.3f')} | {_f(r.get('rollout_tokens_per_s'), '.0f')} |")
    return lines


def markdown(rows: list[dict]) -> str:
    return "\n".join(header(rows) + ["## Runs", ""] + runs_table(rows) + rollouts_table(rows)
                     + ["", "## NVFP4 + LoRA (StaticEngine) against the baselines: baseline s / ours", ""]
                     + ratio_table(rows) + ["", "## Gradient checkpointing's cost", ""]
                     + checkpointing_table(rows) + memory_table(rows) + gpu_table(rows)) + "\n"


def _segments(r: dict) -> list[tuple[str, float]]:
    """A run's stacked-bar segments in seconds: the rollout without vLLM's wake, upload and sleep,
    those three (the AQN sync on ours stays inside the rollout), log-probs, update, other."""
    def v(col):
        x = _num(r.get(col))
        return max(0.0, x) if x == x else 0.0
    held = v("time_sync") + v("time_sleep")
    return [("rollout", max(0.0, v("time_rollout") - held)), ("wake + upload + sleep (vLLM)", held),
            ("log-probs", v("time_logprob")), ("update", v("time_update")), ("other", v("time_other"))]


def plot(rows: list[dict], path: Path, columns: int = 4) -> Path | None:
    """Stacked per-phase bars per format / engine, one panel per setting (model, lengths, ckpt, mu,
    micro-batch, seed), ``columns`` panels a row; None when no run succeeded."""
    ok = [r for r in rows if _ok(r)]
    if not ok:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        import seaborn as sns

        sns.set_theme(style="whitegrid")
    except ImportError:
        pass
    panels: dict[tuple, list[dict]] = {}
    for r in ok:
        panels.setdefault(_key(r), []).append(r)
    ncols = min(columns, len(panels))
    nrows = -(-len(panels) // ncols)
    width = max(4.5, 2 + 1.1 * max(map(len, panels.values())))
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, 4.2 * nrows), squeeze=False)
    for ax, runs in zip(axes.flat, panels.values()):
        runs = sorted(runs, key=_label)
        bottom = [0.0] * len(runs)
        for i, name in enumerate(n for n, _ in _segments(runs[0])):
            vals = [_segments(r)[i][1] for r in runs]
            ax.bar(range(len(runs)), vals, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(runs)), [_label(r).replace(", ", "\n") for r in runs], fontsize=8)
        r = runs[0]
        ax.set_title(f"{r['model']}, {r['lengths']}, ckpt {'on' if r['gradient_checkpointing'] else 'off'}, "
                     f"mu {_f(r['mu'], '.0f')}, micro {_f(r['micro_batch'], '.0f')}", fontsize=9)
        ax.set_ylabel("seconds per GRPO step")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_report(rows: list[dict], out: Path) -> None:
    (out / "step.md").write_text(markdown(rows))
    plot(rows, out / "step.png")


def report_main(inputs, out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    rows = merge(inputs)
    write_csv(rows, out / "step.csv")
    write_report(rows, out)
    print(markdown(rows))
    return rows
