"""One (model, format, engine) group of ``bench.bench_step``: the policy (random weights or a real
model), its engine (our StaticEngine or vLLM, each forcing every row to its drawn length), a Trainer per
case, the timed steps and the row each case leaves (``run_group``; ``bench.bench_step worker`` runs it in
a fresh process)."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import statistics
import subprocess
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench.common import IdTokenizer, build, free, log, profiled, random_id_task, timed_steps, with_lora
from bench.step_lengths import draw_lengths

# The optimizer of the paper's GSM8K recipe (qerl_kit.config's paper-gsm8k: AdamW, lr 1e-5, gradient norm
# clipped to 0.2). Timings do not depend on it, but a run at a real model's own lengths does: under the
# tiny-cpu preset's lr 2e-3 the real 0.5B's four optimizer steps per GRPO step (mu 4) took its mean
# completion from 282 to 155 and 75 tokens in two steps, entropy 0.42 -> 1.50 (bench/results/step_h200.md,
# 2026-12-06), so each engine timed a different, collapsing policy
OPTIM = dict(lr=1e-5, max_grad_norm=0.2)

# bnb-nf4: bitsandbytes' NF4 layers (bench.common.to_nf4), the field's QLoRA kernels; qerl_kit's config
# and memory plan know it as nf4
CONFIG_FORMAT = {"bnb-nf4": "nf4"}


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


def build_policy(model: str, fmt: str, device: str, lora_r: int, dense_dir: Path | None = None,
                 dtype: torch.dtype | None = None):
    """(peft policy, tokenizer) of ``model`` in ``fmt``; ``dense_dir`` gets the bf16 checkpoint before
    quantization (vLLM's NF4 baseline quantizes it with bitsandbytes itself); a real model's ``dtype``
    defaults to bf16 on CUDA, float32 elsewhere."""
    from qerl_kit.build import load_base, quantize_base
    from qerl_kit.config import ModelConfig

    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
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
    if is_real(model):
        from qerl_kit.config import DataConfig
        from qerl_kit.tasks import make_task as task_for

        return task_for(DataConfig(dataset="gsm8k"))
    vocab = peft.get_base_model().config.vocab_size
    return random_id_task(max(64, rows), prompt_len, vocab, reward_seed=seed)


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
                            gradient_checkpointing=case["gradient_checkpointing"],
                            dense_cache_gib=dense_cache_gib(peft, a["dense_cache"])),
                 data=dict(dataset="gsm8k") if is_real(case["model"]) else {},
                 rollout=dict(batch_size=a["prompts"] * a["group"], group_size=a["group"], max_new_tokens=max_len,
                              temperature=1.0),
                 loss=dict(loss="grpo", mu=case["mu"], micro_batch=case["micro_batch"]), optim=OPTIM,
                 aqn=dict(enabled=case["aqn"], stages=steps))
    trainer = Trainer(peft, tok, task, cfg, engine=engine, progress="none")
    trainer.step = 1
    return trainer


def dense_cache_gib(peft, setting) -> float | None:
    """The run's ``model.dense_cache_gib``: ``all`` is the dense bytes of every 4-bit projection of this
    policy (0 for bf16 and bitsandbytes' layers, which the cache does not serve), ``auto`` None (the
    Trainer's budget), a number is itself."""
    from qerl_kit.dense_update import GIB, dense_projection_bytes

    if setting == "auto":
        return None
    return dense_projection_bytes(peft) / GIB if setting == "all" else float(setting)


def _humming(fmt: str) -> bool:
    """Whether NVFP4 matmuls run on humming-kernels here (its repacked copy of the weights counts)."""
    if fmt != "nvfp4" or not torch.cuda.is_available():
        return False
    from qerl_kit.kernels import nvfp4_humming

    return nvfp4_humming.humming_status()[0]


def plan_for(peft, case: dict, a: dict, max_len: int, held_gib: float = 0.0):
    """``qerl_kit.memory_plan.plan_memory`` of a StaticEngine run's settings (``plan_row``'s plan; its
    errors propagate), with the dense cache the steps held (``held_gib``)."""
    from qerl_kit.memory_plan import plan_memory

    return plan_memory(peft.get_base_model().config, fmt=CONFIG_FORMAT.get(case["format"], case["format"]),
                       lora_r=a["lora_r"], optimizer="adamw",
                       rollout_batch=a["prompts"] * a["group"], prompt_len=a["prompt_len"],
                       max_new_tokens=max_len, micro_batch=case["micro_batch"],
                       gradient_checkpointing=case["gradient_checkpointing"], group_size=a["group"],
                       engine="static", keep_cache=a["keep_cache"], max_rows=a["max_rows"],
                       humming=_humming(case["format"]), dense_cache_bytes=int(held_gib * 2**30),
                       share_weights=a["share_weights"])


def plan_row(peft, case: dict, a: dict, max_len: int, held_gib: float = 0.0) -> dict:
    """``plan_memory(...).allocated`` for the run's settings (``plan_gib``, GiB: the bound of
    ``max_memory_allocated``, as bench_memory and real_grpo compare it), with the dense cache the steps
    held (``held_gib``, the most ``memory/dense_cache_gib`` of any step), or NaN and why there is none
    (``plan_note``; vLLM's rows: the plan counts our StaticEngine, vLLM's pool is its own); and the
    plan's phases in GiB, the figures the Trainer's ``memory/*`` metrics measure:
    ``plan_rollout_gib`` (static + rollout parts: the rollout's peak), ``plan_kept_gib`` (static + the
    parts kept while training: what stays allocated into the update) and ``plan_training_gib`` (the
    training parts: the update's working set on top of that); NaN where there is no plan."""
    nan = float("nan")
    row = dict(plan_gib=nan, plan_note="", plan_rollout_gib=nan, plan_kept_gib=nan, plan_training_gib=nan)
    if case["engine"] != "static":
        return {**row, "plan_note": f"no plan: the plan counts our StaticEngine, not {case['engine']}'s memory"}
    try:
        plan = plan_for(peft, case, a, max_len, held_gib)
    except Exception as err:  # noqa: BLE001 - a reference figure: say why it is missing
        return {**row, "plan_note": f"{type(err).__name__}: {err}"[:200]}
    gib = 2**30
    return dict(row, plan_gib=plan.allocated / gib, plan_rollout_gib=(plan.static + plan.rollout) / gib,
                plan_kept_gib=(plan.static + plan.kept_bytes) / gib, plan_training_gib=plan.training / gib)


def profile_step(trainer, path: Path, label: str, top: int = 40, stacks: bool = False) -> None:
    """One more Trainer step under torch.profiler (after the timed steps, so their times are not
    touched): its top ``top`` kernels and ops by own GPU time (CPU time without a GPU) to ``path``."""
    m, table, _ = profiled(trainer.train_step, top, stacks)
    phases = ", ".join(f"{k[5:]} {m[k]:.2f} s" for k in ("time/step", "time/rollout", "time/logprob", "time/update") if k in m)
    path.write_text(f"{label}: the profiled step ({phases}; profiler overhead included)\n" + table)


def phase_times(m: dict) -> dict:
    """The step's phases from its metrics (a phase the Trainer did not report, e.g. vLLM's ``sync`` on
    our engine, is NaN; under ``loss.old_logp`` fold the Trainer reports ``time/logprob`` 0.0)."""
    nan = float("nan")
    row = {f"time_{k}": m.get(f"time/{k}", nan) for k in ("step", "rollout", "sync", "wake", "upload", "sleep",
                                                           "logprob", "update")}
    row["time_other"] = row["time_step"] - sum(0.0 if math.isnan(row[k]) else row[k]
                                               for k in ("time_rollout", "time_logprob", "time_update"))
    row["measured_mean_length"] = m.get("completions/mean_length", nan)
    row["rollout_tokens_per_s"] = m.get("rollout/tokens_per_s", nan)
    row["aqn_sigma"] = m.get("aqn/sigma", 0.0)
    row.update({f"rollout_{k}": m.get(metric, nan) for k, metric in ROLLOUT_QUALITY.items()})
    return row


# what the rollouts were, from the Trainer's metrics (the mean over the timed steps): engines that sample
# the same policy on the same prompts must agree on these within sampling noise, and ``logp_gap`` (the mean
# |engine log-prob - training forward's| of the sampled tokens, TRL's name) is small for an engine that
# computes the policy the Trainer trains; one that computes it wrongly shows it here first
ROLLOUT_QUALITY = {"reward": "reward", "accuracy": "accuracy", "entropy": "entropy", "at_cap": "completions/clipped_ratio",
                   "logp_gap": "sampling/sampling_logp_difference/mean"}


GPU_FIELDS = "temperature.gpu,clocks.sm,power.draw"


def gpu_state() -> str:
    """The GPU's temperature, SM clock and power now ("64 C, 1980 MHz, 612.5 W", nvidia-smi), and why its
    clocks are held down where the driver says ("events 0x..."): two runs of one call taken in turn can
    differ by the clocks a warmer GPU keeps, not by their code. "" without nvidia-smi or a GPU."""
    if not torch.cuda.is_available():
        return ""
    for fields in (GPU_FIELDS + ",clocks_event_reasons.active", GPU_FIELDS):
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return ""
        line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
        if line:
            v = [x.strip() for x in line.split(",")]
            return f"{v[0]} C, {v[1]} MHz, {v[2]} W" + (f", events {v[3]}" if len(v) > 3 else "")
    return ""


# the phases whose spread over the timed steps a row keeps (``steady_times``)
SPREAD = ("step", "rollout", "update")


def after_warm_up(steps: list) -> list:
    """The steps a run's figures come from: all but the first (a warm-up: compilation, graph capture, the
    dense cache's first measurement) when there are more, else the one there is."""
    return steps[1:] if len(steps) > 1 else steps


def steady_times(steps: list[dict]) -> dict:
    """A run's phase times from every step's metrics: the first step is a warm-up (compilation, graph
    capture, the dense cache's first measurement) and left out when there are more; each phase is the
    median over the rest, with ``timed_steps`` (how many) and the fastest and slowest step of
    ``SPREAD``'s phases (``time_step_min``, ``time_step_max``, ...). Two steps: the last step's times."""
    timed = [phase_times(m) for m in after_warm_up(steps)]
    quality = {f"rollout_{k}" for k in ROLLOUT_QUALITY} | {"measured_mean_length"}
    row = {k: statistics.median(r[k] for r in timed) if k.startswith("time_")
           else statistics.fmean(r[k] for r in timed) if k in quality else timed[-1][k] for k in timed[-1]}
    for k in SPREAD:
        vals = [r[f"time_{k}"] for r in timed]
        row[f"time_{k}_min"], row[f"time_{k}_max"] = min(vals), max(vals)
    row["timed_steps"] = len(timed)
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
            "aqn": case["aqn"], "keep_cache": a["keep_cache"], "max_rows": a["max_rows"] or rows,
            "dense_cache": a["dense_cache"], "dense_decode": a["dense_decode"],
            "share_weights": a["share_weights"], "lora_tiling": a["lora_tiling"],
            "lora_forward": a["lora_forward"], "layout": a["layout"], "engine_off": " ".join(a["engine_off"]),
            "optimizer": "adamw",
            "lr": OPTIM["lr"], "seed": case["seed"],
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
    """``_run_group`` with the call's grouped-LoRA tiling (``lora_tiling``), training-pass LoRA forward
    (``lora_forward``) and training-forward layout (``layout``) for its duration."""
    with lora_tiling(a["lora_tiling"]), lora_forward(a["lora_forward"]), training_layout(a["layout"]):
        _run_group(cases, a, meta, rows_path)


@contextlib.contextmanager
def lora_forward(mode: str):
    """``peft``: the policy's LoRA layers run peft's own forward (``result + B(A(x)) * scale``) for the
    block's duration, the baseline of ``qerl_kit.lora_layer.FusedLoraLinear``; ``fused``: as they are."""
    if mode == "fused":
        yield
        return
    from peft.tuners.lora.layer import Linear as PeftLoraLinear

    from qerl_kit.lora_layer import FusedLoraLinear

    fused = FusedLoraLinear.forward
    FusedLoraLinear.forward = PeftLoraLinear.forward
    try:
        yield
    finally:
        FusedLoraLinear.forward = fused


@contextlib.contextmanager
def training_layout(name: str):
    """``padded``: every ``completion_logprobs`` call in the block (the Trainer's log-prob passes and update)
    runs the engine's layout, left-padded prompt + right-padded completion under an attention mask
    (``aligned=False``), the baseline of the aligned default; ``aligned``: as it is."""
    if name == "aligned":
        yield
        return
    from qerl_kit import logprobs, old_policy

    plain = logprobs.completion_logprobs
    for module in (logprobs, old_policy):  # old_policy imports the name
        module.completion_logprobs = functools.partial(plain, aligned=False)
    try:
        yield
    finally:
        for module in (logprobs, old_policy):
            module.completion_logprobs = plain


@contextlib.contextmanager
def lora_tiling(text: str):
    """The StaticEngine's decode step with its grouped LoRA kernels cut by the ``Tiling`` ``text`` names
    (``bench.bench_lora_tiling``'s form) for the block's duration; ``default``: as they are."""
    if text == "default":
        yield
        return
    import functools

    from bench.bench_lora_tiling import lora_path, parse_tiling
    from qerl_kit.kernels.lora_triton import lora_apply_

    with lora_path(functools.partial(lora_apply_, tiling=parse_tiling(text))):
        yield


def _run_group(cases: list[dict], a: dict, meta: dict, rows_path: Path) -> None:
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
        row["dense_cache_gib"], held = dense_cache_gib(peft, a["dense_cache"]), 0.0  # the run's model.dense_cache_gib
        trainer = engine = None
        every: list[dict] = []
        try:
            if vllm_engine is None:
                engine = forced_static(peft, tok, ignore_eos=drawn["lengths"] is not None, keep_cache=a["keep_cache"],
                                       max_rows=a["max_rows"], dense_decode=a["dense_decode"],
                                       share_weights=a["share_weights"], **{k: False for k in a["engine_off"]})
            else:
                engine, row["engine_start_s"] = vllm_engine, start
            engine.lengths, engine.ignore_eos = drawn["lengths"], drawn["lengths"] is not None  # per case
            task = make_task(model, peft, a["prompt_len"], rows_n, case["seed"])
            trainer = trainer_for(peft, tok, task, engine, case, a, drawn["max_new_tokens"],
                                  root / f"run{case['case_id']}")
            t = time.perf_counter()
            row["gpu_before"] = gpu_state()
            _, row["peak_gib"], held = timed_steps(trainer, a["steps"], label, every)
            row["gpu_after"] = gpu_state()
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30 if device == "cuda" else float("nan")
            row.update(status="ok", wall_s=time.perf_counter() - t, **steady_times(every))
            if a.get("profile"):  # after the row is measured: a profiler failure is logged, the row stays ok
                try:
                    profile_step(trainer, rows_path.parent / f"profile_case{case['case_id']}.txt", label,
                                 stacks=a["profile"] == "stacks")
                except Exception as err:  # noqa: BLE001
                    log(f"{label}: the profiled step failed: {err!r}")
        except Exception as err:  # noqa: BLE001 - recorded, and the next case runs
            row.update(failure(err))
            log(f"{label} failed: {err!r}\n{traceback.format_exc()}")
            if every:  # the steps that finished: the last one's peak (a failed row's peak is theirs)
                row["peak_gib"] = every[-1]["bench/peak_gib"]
        if every:
            row["steps_done"] = len(every)
            row["rollout_peak_gib"] = every[-1].get("memory/rollout_peak_gib", float("nan"))
            row["after_rollout_gib"] = every[-1].get("memory/after_rollout_gib", float("nan"))
            timed = after_warm_up(every)  # does a steady step still call cudaMalloc?
            row["cuda_mallocs_max"] = max(m.get("bench/cuda_mallocs", 0) for m in timed)
            row["alloc_retries"] = sum(m.get("bench/alloc_retries", 0) for m in timed)
        row["dense_cache_held_gib"] = held  # the most any step held: the plan counts it
        row.update(plan_row(peft, case, a, drawn["max_new_tokens"], held))
        emit(row)
        if vllm_engine is None and engine is not None:
            engine.reset()  # its KV cache and graphs, before the next case's engine
        del trainer, engine
        free()
    if vllm_engine is not None:
        vllm_engine.close()
    import shutil

    shutil.rmtree(root, ignore_errors=True)  # exports and run directories (GBs at 7B and above)
