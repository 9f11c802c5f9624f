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
recipe against plain LoRA and QLoRA). The phases are the Trainer's own ``time/*`` metrics of the last
step (the first pays kernel compilation and graph capture): ``rollout`` (the AQN sync; on vLLM also
wake, adapter upload and sleep, which ``sync`` shows apart), ``logprob`` (the old policy's log-probs),
``update`` (mu x forward + backward, clipping, optimizer) and ``other`` = step minus those three
(rewards, advantages, and with mu > 1 the clip statistics' log-prob pass against the new policy). A
phase the Trainer does not report (no ``time/logprob`` once the old policy's log-probs come from the
update's own forward) is empty, and the step still adds up.

Lengths (``--lengths``, several allowed): ``fixed:N`` (every row N new tokens); ``paper`` (the
paper's GSM8K preset, ``max_new_tokens`` 4096: lognormal of mean 300 and log-std 0.8 capped at 4096,
``bench.bench_live_rows.lengths_for`` seed 0, the distribution of every committed realistic-length
table with its cap raised to the preset's 4096; a mean near the 278-288 tokens the real 0.5B wrote
on GSM8K, ``bench/results/real_model_h200.md``; its longest of 128 rows is 1171 tokens);
``paper-tail`` (the same, with 4% of the rows running to the cap: the completions that never stop,
the share that reached a 512-token cap in that file's GSM8K runs, 2.6-6.1%);
``lognormal:MEAN:SIGMA:CAP[:TAIL]``; ``natural:N`` (no forcing: the model's own completions up to
N, for a real model). A drawn row runs to exactly its
length: ``stop_after`` on the StaticEngine, one request with ``min_tokens = max_tokens`` and
``ignore_eos`` per row on vLLM. Every row records the draw's parameters and a hash of its lengths.
``--max-new-tokens M`` scales a distribution down (mean and cap times M / cap; fixed lengths capped).

Each (model, format, engine) runs in a fresh process (``--isolate auto``: on a GPU, for honest peaks;
always for vLLM, whose memory is not given back inside one); a run that fails, runs out of memory or
whose process dies is a row with its status and error line, never dropped. ``--engines unsloth``
records why it was not run (``bench/probe_unsloth.py`` probes Unsloth's own path). Output:
OUT/step.csv (every run: settings, phase times, peak memory, the memory plan's figure), OUT/step.md
(GPU, date, versions, the runs, ratios against the same call's baselines, gradient checkpointing's
cost) and OUT/step.png (``bench.step_report``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import traceback
from itertools import product
from pathlib import Path

import torch

from bench.bench_ddp import IdTokenizer  # random prompts are whitespace-separated token ids
from bench.bench_grpo_engines import random_reward
from bench.bench_live_rows import hash_lengths, lengths_for
from bench.common import LOG, build, free, log, random_prompts, with_lora
from bench.step_report import read_csv, write_csv, write_report

FORMATS = ("none", "nvfp4", "nf4", "mxfp4", "bnb-nf4")
# bnb-nf4: bitsandbytes' NF4 layers (bench.common.to_nf4), the field's QLoRA kernels; qerl_kit's config
# and memory plan know it as nf4
CONFIG_FORMAT = {"bnb-nf4": "nf4"}
ENGINES = ("static", "vllm", "unsloth")
PAPER = dict(mean=300.0, sigma=0.8, cap=4096)  # the paper's GSM8K preset: max_new_tokens 4096
# paper-tail: the share of GSM8K completions that never stop. The real 0.5B hit a 512-token cap on
# 2.6-6.1% of GSM8K test problems greedily and 4.0-4.7% sampled (bench/results/real_model_h200.md)
PAPER_TAIL = 0.04
LENGTHS_HELP = "fixed:N, paper, paper-tail, lognormal:MEAN:SIGMA:CAP[:TAIL] or natural:N"


# -- lengths ------------------------------------------------------------------------------------
def _lognormal(spec: str) -> tuple[float, float, int, float]:
    """(mean, sigma, cap, tail share) of ``paper``, ``paper-tail`` or ``lognormal:MEAN:SIGMA:CAP[:TAIL]``."""
    kind, _, rest = spec.partition(":")
    if kind in ("paper", "paper-tail") and not rest:
        return PAPER["mean"], PAPER["sigma"], PAPER["cap"], PAPER_TAIL if kind == "paper-tail" else 0.0
    values = [float(x) for x in rest.split(":")]
    if kind != "lognormal" or len(values) not in (3, 4):
        raise ValueError
    mean, sigma, cap, tail = (values + [0.0])[:4]
    if mean <= 0 or sigma < 0 or cap < 1 or not 0 <= tail <= 1 or cap != int(cap):
        raise ValueError
    return mean, sigma, int(cap), tail


def draw_lengths(spec: str, rows: int, max_new_tokens: int | None = None, seed: int = 0) -> dict:
    """The completion lengths ``spec`` asks for ``rows`` rows: ``lengths`` (None for ``natural``: not
    forced), ``max_length``, ``mean_length``, ``params`` (what was drawn, after scaling), ``lengths_sha``
    and ``max_new_tokens`` (the run's setting: the cap, as a real run of that preset sets it).
    ``max_new_tokens`` caps a fixed length and scales a distribution's mean and cap. A tail share
    sends that share of the rows (``round(share x rows)``, seeded choice) to the cap: the completions
    that never stop."""
    kind, _, rest = spec.partition(":")
    try:
        if kind in ("fixed", "natural"):
            n = int(rest)
            if n < 1:
                raise ValueError
            n = min(n, max_new_tokens or n)
            if kind == "natural":
                return dict(lengths=None, max_length=n, mean_length=float("nan"), params=f"natural up to {n}",
                            lengths_sha="", max_new_tokens=n)
            lengths, params, top = [n] * rows, f"fixed {n}", n
        else:
            mean, sigma, cap, tail = _lognormal(spec)
            if max_new_tokens and max_new_tokens < cap:
                mean, cap = mean * max_new_tokens / cap, max_new_tokens
            lengths = lengths_for(rows, mean, sigma, cap, seed)
            for i in random.Random(f"tail/{seed}/{rows}").sample(range(rows), round(tail * rows)):
                lengths[i] = cap
            params, top = f"lognormal mean {mean:g} sigma {sigma:g} cap {cap} seed {seed}", cap
            params += f", {tail:g} of the rows to the cap" if tail else ""
    except ValueError:
        raise ValueError(f"--lengths {spec!r}: expected {LENGTHS_HELP} (N, MEAN, CAP >= 1, SIGMA >= 0, "
                         "TAIL in [0, 1])") from None
    return dict(lengths=lengths, max_length=max(lengths), mean_length=sum(lengths) / rows, params=params,
                lengths_sha=hash_lengths(lengths), max_new_tokens=top)


# -- engines that run each row to a given length ----------------------------------------------------
def forced_static(*a, **kw):
    """A StaticEngine whose ``generate`` runs row i to ``lengths[i]`` (``stop_after``) while its
    ``lengths`` is set."""
    from qerl_kit.rollout import StaticEngine

    class ForcedStatic(StaticEngine):
        lengths = None

        def generate_ids(self, prompts, n=1, sampling=None, ignore_eos=None, stop_after=None):
            return super().generate_ids(prompts, n, sampling, ignore_eos,
                                        self.lengths if stop_after is None else stop_after)
    return ForcedStatic(*a, **kw)


def forced_vllm(*a, **kw):
    """A VLLMEngine whose ``generate`` sends each row as a request of exactly ``lengths[i]`` tokens."""
    from qerl_kit.rollout.vllm import VLLMEngine

    class ForcedVLLM(VLLMEngine):
        lengths = None

        def _generate_texts(self, prompts, n, sampling, stop_after=None):
            return super()._generate_texts(prompts, n, sampling, self.lengths if stop_after is None else stop_after)
    return ForcedVLLM(*a, **kw)


# -- one (model, format, engine): the policy, the engine, then every case ---------------------------
def is_real(model: str) -> bool:
    """A real model: a GGUF file or a model directory (else a preset name, random weights)."""
    path = Path(model).expanduser()
    return model.endswith(".gguf") or path.is_dir()


def build_policy(model: str, fmt: str, device: str, lora_r: int, dense_dir: Path | None = None):
    """(peft policy, tokenizer) of ``model`` in ``fmt``; ``dense_dir`` gets the bf16 checkpoint before
    quantization (vLLM's NF4 baseline quantizes it with bitsandbytes itself)."""
    from qerl_kit.build import load_base, quantize_base
    from qerl_kit.config import ModelConfig

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if is_real(model):  # qerl_kit's own loader: a GGUF file through load_gguf, a directory as saved
        base, tok = load_base(ModelConfig(name=model), device=device, dtype=dtype)
    else:
        base, tok = build(model, "nvfp4" if fmt == "nvfp4" else "none", device), IdTokenizer()
    if dense_dir is not None:
        base.save_pretrained(str(dense_dir), safe_serialization=True)
    if fmt == "bnb-nf4":
        from bench.common import to_nf4

        to_nf4(base)
    else:
        quantize_base(base, fmt)  # nothing for bf16 or a base built in its format already
    return with_lora(base, lora_r), tok


def make_task(model: str, peft, prompt_len: int, rows: int, seed: int):
    """GSM8K for a real model; random-id prompts with a random reward for a random one (its
    completions mean nothing; GRPO's arithmetic runs as on a task, no group of equal rewards)."""
    from qerl_kit.tasks import Task

    if is_real(model):
        from qerl_kit.config import DataConfig
        from qerl_kit.tasks import make_task as task_for

        return task_for(DataConfig(dataset="gsm8k"))
    vocab = peft.get_base_model().config.vocab_size
    data = [{"prompt": " ".join(map(str, p)), "answer": "0"}
            for p in random_prompts(max(64, rows), prompt_len, vocab, seed=3)]
    return Task("random-ids", data, [], (random_reward(seed),), lambda tok, row: row["prompt"])


def set_checkpointing(model, on: bool) -> None:
    """The Trainer turns checkpointing on and never off: a later case in the same process that runs
    without it turns it off here."""
    if not on:
        for name in ("activation_checkpointing_disable", "gradient_checkpointing_disable"):
            if hasattr(model, name):
                getattr(model, name)()
                return


def trainer_for(peft, tok, task, engine, case: dict, a: dict, max_len: int, out_dir: Path):
    from qerl_kit.config import preset
    from qerl_kit.trainer import Trainer

    set_checkpointing(peft, case["gradient_checkpointing"])
    # one AQN stage per step; the Trainer starts at step 1 (below): AQN's stage 0 is noise-free, and every
    # timed step should pay for the noise as a step of a real run does
    steps = a["steps"] + 10
    cfg = preset("tiny-cpu", total_steps=steps, save_every=0, seed=case["seed"], output_dir=str(out_dir),
                 model=dict(format=CONFIG_FORMAT.get(case["format"], case["format"]), lora_r=a["lora_r"],
                            gradient_checkpointing=case["gradient_checkpointing"]),
                 data=dict(dataset="gsm8k") if is_real(case["model"]) else {},
                 rollout=dict(batch_size=a["prompts"] * a["group"], group_size=a["group"], max_new_tokens=max_len,
                              temperature=1.0),
                 loss=dict(loss="grpo", mu=case["mu"], micro_batch=case["micro_batch"]),
                 aqn=dict(enabled=case["aqn"], stages=steps))
    trainer = Trainer(peft, tok, task, cfg, engine=engine, progress="none")
    trainer.step = 1
    return trainer


def aqn_on(setting: str, fmt: str) -> bool:
    return fmt == "nvfp4" if setting == "auto" else setting == "on"


def plan_gib(peft, case: dict, a: dict, max_len: int) -> tuple[float, str]:
    """``plan_memory``'s peak for the run's settings (GiB), or NaN and why it could not plan."""
    from qerl_kit.memory_plan import plan_memory

    try:
        plan = plan_memory(peft.get_base_model().config, fmt=CONFIG_FORMAT.get(case["format"], case["format"]),
                           lora_r=a["lora_r"], optimizer="adamw",
                           rollout_batch=a["prompts"] * a["group"], prompt_len=a["prompt_len"],
                           max_new_tokens=max_len, micro_batch=case["micro_batch"],
                           gradient_checkpointing=case["gradient_checkpointing"], group_size=a["group"])
        return plan.peak / 2**30, ""
    except Exception as err:  # noqa: BLE001 - a reference figure: say why it is missing
        return float("nan"), f"{type(err).__name__}: {err}"[:200]


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def timed_steps(trainer, steps: int, label: str) -> tuple[dict, float]:
    """``steps`` Trainer steps; the last one's metrics and its peak memory (reset before each step)."""
    for i in range(steps):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        m = trainer.train_step()
        log(f"{label} step #{i}: {m['time/step']:.2f}s (" + ", ".join(
            f"{k[5:]} {m[k]:.2f}" for k in ("time/rollout", "time/sync", "time/logprob", "time/update") if k in m)
            + f"), peak {peak_gib():.1f} GiB")
    return m, peak_gib()


def phase_times(m: dict) -> dict:
    """The step's phases from its metrics; a phase the Trainer did not report is NaN (e.g. no
    ``time/logprob`` when the old policy's log-probs come from the update's own forward)."""
    nan = float("nan")
    row = {f"time_{k}": m.get(f"time/{k}", nan) for k in ("step", "rollout", "sync", "wake", "upload", "sleep",
                                                           "logprob", "update")}
    row["time_other"] = row["time_step"] - sum(0.0 if math.isnan(row[k]) else row[k]
                                               for k in ("time_rollout", "time_logprob", "time_update"))
    row["measured_mean_length"] = m.get("completions/mean_length", nan)
    row["rollout_tokens_per_s"] = m.get("rollout/tokens_per_s", nan)
    row["aqn_sigma"] = m.get("aqn/sigma", 0.0)
    return row


def failure(err: BaseException) -> dict:
    """A failed run's status (``oom`` or ``error``) and its error line."""
    oom = isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
    return dict(status="oom" if oom else "error", error=f"{type(err).__name__}: {err}".splitlines()[0][:300])


def case_row(case: dict, a: dict, meta: dict) -> dict:
    """The settings half of a run's row (every setting, the lengths' draw, the versions)."""
    rows = a["prompts"] * a["group"]
    drawn = draw_lengths(case["lengths"], rows, a["max_new_tokens"], a["length_seed"])
    return {**meta, "case_id": case["case_id"], "model": case["model"], "format": case["format"],
            "engine": case["engine"], "lengths": case["lengths"], "length_params": drawn["params"],
            "lengths_sha": drawn["lengths_sha"], "mean_length": drawn["mean_length"],
            "max_length": drawn["max_length"], "max_new_tokens": drawn["max_new_tokens"], "prompts": a["prompts"],
            "group": a["group"], "rows": rows,
            "prompt_len": "gsm8k" if is_real(case["model"]) else a["prompt_len"], "lora_r": a["lora_r"],
            "mu": case["mu"], "micro_batch": case["micro_batch"], "gradient_checkpointing": case["gradient_checkpointing"],
            "aqn": case["aqn"], "keep_cache": a["keep_cache"], "optimizer": "adamw", "seed": case["seed"],
            "steps": a["steps"], "step_index": a["steps"] - 1, "status": "", "error": ""}


def vllm_for(peft, tok, fmt: str, a: dict, cases: list[dict], root: Path, dense_dir: Path | None):
    """Our export in vLLM (nvfp4: compressed-tensors; none: bf16; nf4 and bnb-nf4: the bf16 checkpoint
    quantized by vLLM's bitsandbytes), colocated with sleep mode, sized for the longest case."""
    from bench.bench_vllm_lengths import export

    if fmt == "mxfp4":
        raise NotImplementedError("vLLM runs no MXFP4 + LoRA export of ours (nvfp4, bf16 and nf4 only)")
    path = dense_dir if "nf4" in fmt else export(peft, "nvfp4" if fmt == "nvfp4" else "bf16", root)
    longest = max(draw_lengths(c["lengths"], a["prompts"] * a["group"], a["max_new_tokens"],
                               a["length_seed"])["max_new_tokens"] for c in cases)
    prompt = 1024 if any(is_real(c["model"]) for c in cases) else a["prompt_len"]
    extra = dict(quantization="bitsandbytes") if "nf4" in fmt else {}
    if is_real(cases[0]["model"]):  # the StaticEngine's stop ids (EOS, generation config, chat turn end)
        from qerl_kit.rollout.base import special_ids

        extra["stop_token_ids"] = special_ids(tok, peft)[1]
    return forced_vllm(path, tok, skip_tokenizer_init=True,  # our tokenizer decodes
                       gpu_memory_utilization=a["vllm_memory"], max_lora_rank=a["lora_r"],
                       max_model_len=-(-(prompt + longest + 16) // 64) * 64, max_num_seqs=a["prompts"] * a["group"],
                       **extra)


def run_group(cases: list[dict], a: dict, meta: dict, rows_path: Path) -> None:
    """One (model, format, engine): build once, then every case; each case's row is appended to
    ``rows_path`` as soon as it is known, so a process that dies keeps what it measured.

    Long because: build, per-case trainer, timing and failure bookkeeping read best in one place."""
    model, fmt, engine_kind = cases[0]["model"], cases[0]["format"], cases[0]["engine"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(tempfile.mkdtemp(prefix="bench-step-"))
    rows_n = a["prompts"] * a["group"]

    def emit(row):
        with open(rows_path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    try:
        dense_dir = root / "dense" if engine_kind == "vllm" and "nf4" in fmt else None
        peft, tok = build_policy(model, fmt, device, a["lora_r"], dense_dir)
        vllm_engine, start = None, float("nan")
        if engine_kind == "vllm":
            t = time.perf_counter()
            vllm_engine = vllm_for(peft, tok, fmt, a, cases, root, dense_dir)
            start = time.perf_counter() - t
    except Exception as err:  # noqa: BLE001 - every case of the group is a failed row
        log(f"{model} {fmt} {engine_kind}: setup failed: {err!r}\n{traceback.format_exc()}")
        for case in cases:
            emit({**case_row(case, a, meta), **failure(err)})
        return
    for case in cases:
        row = case_row(case, a, meta)
        drawn = draw_lengths(case["lengths"], rows_n, a["max_new_tokens"], a["length_seed"])
        label = f"{model} {fmt} {engine_kind} {case['lengths']} ckpt {case['gradient_checkpointing']} mu {case['mu']}"
        row["plan_gib"], row["plan_note"] = plan_gib(peft, case, a, drawn["max_new_tokens"])
        trainer = engine = None
        try:
            if vllm_engine is None:
                engine = forced_static(peft, tok, ignore_eos=drawn["lengths"] is not None, keep_cache=a["keep_cache"])
            else:
                engine, row["engine_start_s"] = vllm_engine, start
            engine.lengths, engine.ignore_eos = drawn["lengths"], drawn["lengths"] is not None  # per case
            task = make_task(model, peft, a["prompt_len"], rows_n, case["seed"])
            trainer = trainer_for(peft, tok, task, engine, case, a, drawn["max_new_tokens"],
                                  root / f"run{case['case_id']}")
            t = time.perf_counter()
            m, row["peak_gib"] = timed_steps(trainer, a["steps"], label)
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30 if device == "cuda" else float("nan")
            row.update(status="ok", wall_s=time.perf_counter() - t, **phase_times(m))
        except Exception as err:  # noqa: BLE001 - recorded, and the next case runs
            row.update(failure(err))
            log(f"{label} failed: {err!r}\n{traceback.format_exc()}")
        emit(row)
        if vllm_engine is None and engine is not None:
            engine.reset()  # its KV cache and graphs, before the next case's engine
        del trainer, engine
        free()
    if vllm_engine is not None:
        vllm_engine.close()
    import shutil

    shutil.rmtree(root, ignore_errors=True)  # exports and run directories (GBs at 7B and above)


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
    from importlib.metadata import PackageNotFoundError, version

    meta = dict(date=time.strftime("%Y-%m-%d"), run_id=f"{platform.node()}-{int(time.time())}", gpu=gpu_name())
    for key, dist in (("torch", "torch"), ("triton", "triton"), ("transformers", "transformers"),
                      ("humming", "humming-kernels"), ("vllm", "vllm"), ("bitsandbytes", "bitsandbytes")):
        try:
            meta[key] = version(dist)
        except PackageNotFoundError:
            meta[key] = "not installed"
    return meta


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
                "bench/probe_unsloth.py times its rollout and a train step")
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
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    last = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
    for case in cases:
        if case["case_id"] not in done:
            with open(rows_path, "a") as f:
                f.write(json.dumps({**case_row(case, a, meta), "status": "crashed",
                                    "error": f"process exit {rc}: {last.strip()[:300]}"}) + "\n")
    log(f"{cases[0]['model']} {cases[0]['format']} {cases[0]['engine']}: process exit {rc}")


def read_rows(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def run(args) -> list[dict]:
    """Every case of the call, then OUT/step.csv, step.md and step.png."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    rows_path.unlink(missing_ok=True)
    a = {k: getattr(args, k) for k in ("prompts", "group", "prompt_len", "lora_r", "steps", "max_new_tokens",
                                       "keep_cache", "vllm_memory", "length_seed")}
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
    r.add_argument("--steps", type=int, default=2, help="steps per run; the last is reported")
    r.add_argument("--seeds", nargs="+", type=int, default=[0])
    r.add_argument("--prompts", type=int, default=8)
    r.add_argument("--group", type=int, default=8)
    r.add_argument("--prompt-len", type=int, default=256)
    r.add_argument("--lora-r", type=int, default=32)
    r.add_argument("--aqn", default="auto", type=_choices("aqn", ("auto", "on", "off")), help="auto: on for nvfp4")
    r.add_argument("--keep-cache", default=True, type=lambda v: _choices("keep-cache", ("on", "off"))(v) == "on")
    r.add_argument("--vllm-memory", type=float, default=0.3, help="vLLM's gpu_memory_utilization")
    r.add_argument("--isolate", default="auto", type=_choices("isolate", ("auto", "on", "off")))
    r.add_argument("--budget", type=float, default=420.0, help="seconds after which no new group starts")
    r.add_argument("--limit", type=float, default=None, help="seconds after which a group's process is killed "
                   "(its unfinished runs: crashed rows); default budget + 120")
    rep = sub.add_parser("report", help="table + plot from several calls' step.csv (later rows win)")
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
