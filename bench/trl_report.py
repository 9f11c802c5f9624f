"""OUT/step.md of ``bench.bench_trl_step``: the call's GPU, date, versions and settings, one line per stack
(the mean of its measured steps, the warm-up step apart), what differs between the stacks and how to set
bench_step to the same shapes."""

from __future__ import annotations

import math
from pathlib import Path

GENERATION = {"trl-nf4": "transformers generate", "trl-bf16": "transformers generate",
              "unsloth": "vLLM (Unsloth fast_generate, shared weights)"}
BASE = {"trl-nf4": "NF4 (bitsandbytes, double quant)", "trl-bf16": "bf16",
        "unsloth": "NF4 (Unsloth load_in_4bit, bitsandbytes)"}
VERSIONS = ["torch", "transformers", "peft", "trl", "datasets", "bitsandbytes", "unsloth", "unsloth_zoo", "vllm",
            "accelerate"]
MEASURED = ["step_s", "rollout_s", "generate_s", "update_s", "tokens_per_s", "peak_gib"]

DIFFERENCES = """\
## What differs between the stacks, and why

Same for every stack: the model directory, prompts (exactly the prompt length, random word tokens), rows =
prompts x group, completions of exactly `new` tokens (EOS suppressed: `min_new_tokens` on transformers'
generate, `min_tokens` + `ignore_eos` on vLLM; the lengths column is what the generation call returned), LoRA
r = alpha on all seven projections with dropout 0, one optimizer step per rollout in micro-batches
(gradient accumulation), mu = TRL's `num_iterations`, beta 0 (no reference model), AdamW (torch) at a
constant lr, betas (0.9, 0.99), no weight decay, clip 0.2, gradient norm 1, temperature 1, top-p 1, top-k off.

- **Base weights.** trl-nf4: `BitsAndBytesConfig(nf4, double quant, bf16 compute)`, QLoRA as published
  (bench_step's `bnb-nf4` runs bitsandbytes' NF4 layers with double quant off: a little less dequant
  work there). unsloth: its own 4-bit load of the same bf16 directory (bitsandbytes NF4; Unsloth may keep
  some layers in 16 bits). trl-bf16: the bf16 directory as is.
- **Generation.** trl-*: transformers' `generate` (dynamic KV cache, no CUDA graphs), the field's default;
  `--trl-vllm colocate`: TRL's vLLM colocate mode, which merges the LoRA into the weights and pushes them
  to vLLM before each rollout (vLLM quantizes an NF4 run's checkpoint with bitsandbytes itself). unsloth:
  vLLM sharing the training model's 4-bit weights, the adapter sent as a LoRA request (no weight push).
- **Gradient checkpointing.** trl-*: the Trainer's (transformers' checkpointing, TRL's reentrant setting);
  unsloth: `use_gradient_checkpointing="unsloth"` (its offloaded checkpointing), the Trainer's off.
- **Loss and log-prob kernels.** trl-*: TRL's own (a Triton kernel computes the log-probs in vocabulary
  chunks, never the full logits); unsloth: the forward, log-prob and loss code Unsloth patches into TRL's
  trainer (its chunked GRPO loss). Each is the stack's default; none is changed here.
- **Old-policy log-probs.** mu = 1 on transformers' generate: TRL takes them from the update's own forward
  (no extra pass, as qerl_kit's `old_logp = fold`); mu > 1, or any vLLM generation (TRL's importance-sampling
  correction against vLLM's sampling log-probs, on by default): a separate no-grad pass inside the rollout,
  counted in rollout s (the "extra log-prob pass" column). TRL's defaults are kept: they are the field's step.
- **Arguments a stack rewrote.** "args changed" names every batch, loss or optimizer argument the trainer
  holds after construction that differs from what was asked (Unsloth adjusts some); "none" is the same step.
- **Phases.** rollout s = TRL's `_generate_and_score_completions`: generation (generate s), rewards,
  advantages (bench_step's `other`) and, for mu > 1, that log-prob pass; update s = step s - rollout s: the
  micro-batches' forward + backward and the optimizer. bench_step's step s has the same bounds.
- **Memory.** peak GiB = `torch.cuda.max_memory_allocated` over the step (the counter reset at its start):
  what torch's allocator holds, so a vLLM engine's KV pool (`--vllm-memory` of the GPU) counts only as far
  as vLLM allocates it through torch; compare peaks across generation engines with care.
"""


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _f(v, spec=".2f") -> str:
    v = _num(v)
    return "–" if v != v else format(v, spec)


def summary(rows: list[dict]) -> list[dict]:
    """One dict per stack, in the call's order: the mean of its measured (non-warm-up) ok steps, the warm-up
    step's time, whether every step's completions had exactly ``new`` tokens, status and error."""
    out = {}
    for r in rows:
        st = out.setdefault(r["stack"], dict(stack=r["stack"], steps=[], warm=None, status=r.get("status"),
                                             error=r.get("error", ""), first=r))  # a stack's rows agree on settings
        if r.get("status") != "ok":
            st.update(status=r.get("status"), error=r.get("error", ""))
        elif r.get("warmup"):
            st["warm"] = r
        else:
            st["steps"].append(r)
    for st in out.values():
        ok = st["steps"] + ([st["warm"]] if st["warm"] else [])
        st["lengths_ok"] = bool(ok) and all(r.get("lengths_ok") for r in ok)
        st["length_range"] = (min((_num(r.get("completion_len_min")) for r in ok), default=math.nan),
                              max((_num(r.get("completion_len_max")) for r in ok), default=math.nan))
        for k in MEASURED:
            vals = [_num(r.get(k)) for r in st["steps"]]
            vals = [v for v in vals if v == v]
            st[k] = sum(vals) / len(vals) if vals else math.nan
    return list(out.values())


def _yes(v) -> str:
    return "–" if v is None else "yes" if v else "no"


def _changed(names) -> str:
    return "–" if names is None else ", ".join(names) or "none"


def generation(r: dict) -> str:
    if r["stack"] != "unsloth" and r.get("trl_vllm") == "colocate":
        return "vLLM (TRL colocate, weights pushed)"
    return GENERATION.get(r["stack"], "?")


def runs_table(rows: list[dict]) -> list[str]:
    lines = ["| stack | base | generation | step s | rollout s | of it generate s | update s | tokens/s | "
             "peak GiB | warm-up step s | completion lengths | extra log-prob pass | args changed | status |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|"]
    for st in summary(rows):
        r = st["first"]
        lo, hi = st["length_range"]
        lengths = "–" if lo != lo else f"{lo:.0f}-{hi:.0f} " + ("(all exact)" if st["lengths_ok"] else "(NOT exact)")
        status = "ok" if st["status"] == "ok" else f"{st['status']}: {str(st['error'])[:160]}".replace("|", "/")
        lines.append(f"| {st['stack']} | {BASE.get(st['stack'], '?')} | {generation(r)} | {_f(st['step_s'])} | "
                     f"{_f(st['rollout_s'])} | {_f(st['generate_s'])} | {_f(st['update_s'])} | "
                     f"{_f(st['tokens_per_s'], '.0f')} | {_f(st['peak_gib'])} | "
                     f"{_f(st['warm']['step_s'] if st['warm'] else math.nan)} | {lengths} | "
                     f"{_yes(r.get('old_logp_pass'))} | {_changed(r.get('args_changed'))} | "
                     f"{status} |")
    return lines


def compare_line(r: dict) -> str:
    """The bench_step call of the same shapes (its StaticEngine runs; formats none, nvfp4, bnb-nf4)."""
    ck = "on" if r.get("gradient_checkpointing") else "off"
    model = r.get("model")
    return (f"`python -m bench.bench_step run --models {model} --formats none nvfp4 bnb-nf4 --lengths "
            f"fixed:{r.get('new')} --prompts {r.get('prompts')} --group {r.get('group')} --prompt-len "
            f"{r.get('prompt_len')} --micro-batch {r.get('micro_batch')} --mu {r.get('mu')} --lora-r "
            f"{r.get('lora_r')} --gradient-checkpointing {ck}` (at 7B, 512 tokens, 8 x 8, micro-batch 8: "
            f"`bench/device.sh step7b \"none nvfp4 bnb-nf4\" {ck}`); compare step s with its step column "
            "(the last of its steps; here the mean of the steps after the warm-up)." + _caveat(r))


def _caveat(r: dict) -> str:
    """Where bench_step's call is not the same shape: it has no ``tiny`` model, and on a model directory it
    prompts with GSM8K questions (their own lengths), not random prompts of ``prompt_len`` tokens."""
    source = str(r.get("model_source", ""))
    if source == "the shipped tiny model":
        return " bench_step takes presets, GGUF files and model directories: give it the tiny model's directory."
    if source == "a model directory":
        return (" On a model directory bench_step prompts with GSM8K questions of their own lengths: the prompt "
                "shape differs from this call's.")
    return ""


def markdown(rows: list[dict]) -> str:
    if not rows:
        return "# The field's GRPO step (TRL / Unsloth)\n\nNo rows.\n"
    r = rows[0]
    settings = ", ".join(f"{k} {r.get(k)}" for k in ("model", "model_source", "prompts", "group", "rows", "new",
                                                      "prompt_len", "micro_batch", "mu", "lora_r", "loss", "lr",
                                                      "gradient_checkpointing", "steps", "seed", "trl_vllm",
                                                      "vllm_memory"))
    versions = ", ".join(f"{k} {r.get(k)}" for k in VERSIONS)
    out = ["# The field's GRPO step (TRL / Unsloth) at bench_step's shapes", "",
           f"{r.get('date')}, GPU {r.get('gpu')}; {versions}.", "", f"Settings: {settings}.", "",
           "Each stack ran in its own process; times are the mean of the steps after the first (the warm-up, "
           "shown apart), CUDA-synchronised wall clock per rollout cycle (mu optimizer steps); tokens/s = completion "
           "tokens (rows x new) per second of the whole step.", "",
           *runs_table(rows), "", "Same shapes on qerl_kit's Trainer: " + compare_line(r), "", DIFFERENCES]
    return "\n".join(out)


def write_report(rows: list[dict], out: Path) -> None:
    (Path(out) / "step.md").write_text(markdown(rows))
