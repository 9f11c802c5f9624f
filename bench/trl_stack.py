"""One stack of ``bench.bench_trl_step`` in this process: the field's GRPO step, TRL's ``GRPOTrainer`` on
transformers + peft (``trl-nf4``: a bitsandbytes NF4 base, QLoRA; ``trl-bf16``: a bf16 base) or on
Unsloth's model (``unsloth``: ``FastLanguageModel`` 4-bit + its vLLM ``fast_generate``, TRL's trainer as
Unsloth patches it), timed per rollout cycle (``run_stack``).

One measured step = one rollout of prompts x group completions and the mu optimizer steps TRL runs on it
(``num_iterations``): ``--steps`` S is ``max_steps`` = S x mu. ``StepClock`` (a TrainerCallback) takes the
CUDA-synchronised wall clock from the cycle's first ``on_step_begin`` to its last ``on_step_end`` and resets
the peak-memory counter at its start; ``_generate_and_score_completions`` (generation, rewards, advantages and,
when mu > 1, TRL's old-policy log-prob pass) and ``_generate_single_turn`` (the generation call alone, vLLM's
weight sync included) are wrapped on the instance to time the rollout and read every completion's length.

Import order matters for Unsloth: nothing here imports transformers, peft or trl at module level, and the
``unsloth`` stack imports ``unsloth`` before any of them (its patches apply at import).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def clock_callback(mu: int):
    """A ``StepClock`` TrainerCallback instance: ``cycles`` gets one dict per rollout cycle (mu optimizer
    steps): step_s, rollout_s, generate_s, peak_gib, lengths (every completion's token count)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.cycles: list[dict] = []
            self.current: dict | None = None

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step % mu == 0:  # the first optimizer step of a rollout cycle
                _sync()
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                self.current = dict(t0=time.perf_counter(), rollout_s=0.0, generate_s=0.0, lengths=[])

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % mu == 0 and self.current is not None:  # the cycle's last optimizer step
                _sync()
                cur, self.current = self.current, None
                cur["step_s"] = time.perf_counter() - cur.pop("t0")
                cur["peak_gib"] = (torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available()
                                   else float("nan"))
                self.cycles.append(cur)

        def add(self, key: str, seconds: float) -> None:
            if self.current is not None:
                self.current[key] += seconds

    return StepClock()


def wrap_timed(trainer, clock) -> None:
    """Time the rollout (``_generate_and_score_completions``) and the generation call
    (``_generate_single_turn``, whose first output is each completion's ids) on ``trainer`` itself."""
    score, single = trainer._generate_and_score_completions, getattr(trainer, "_generate_single_turn", None)

    def timed_score(*a, **kw):
        _sync()
        t = time.perf_counter()
        out = score(*a, **kw)
        _sync()
        clock.add("rollout_s", time.perf_counter() - t)
        return out

    def timed_single(*a, **kw):
        _sync()
        t = time.perf_counter()
        out = single(*a, **kw)
        _sync()
        clock.add("generate_s", time.perf_counter() - t)
        if clock.current is not None:
            clock.current["lengths"] += [len(c) for c in out[0]]
        return out

    trainer._generate_and_score_completions = timed_score
    if single is not None:
        trainer._generate_single_turn = timed_single


def seeded_reward(seed: int):
    """A reward of seeded random numbers (a random model's completions mean nothing): advantages are
    non-zero as on a real task. TRL names a reward function by ``__name__``."""
    g = torch.Generator().manual_seed(seed)

    def random_reward(completions, **_):
        return torch.rand(len(completions), generator=g).tolist()
    return random_reward


def generation_kwargs(s: dict, vllm: bool) -> dict:
    """Every completion exactly ``new`` tokens: EOS suppressed until then (transformers' generate:
    ``min_new_tokens``; vLLM's SamplingParams: ``min_tokens`` + ``ignore_eos``); TRL sets the maximum
    (``max_completion_length``)."""
    return dict(min_tokens=s["new"], ignore_eos=True) if vllm else dict(min_new_tokens=s["new"])


def uses_vllm(s: dict) -> bool:
    return s["stack"] == "unsloth" or s["trl_vllm"] == "colocate"


def grpo_config(s: dict, out_dir: Path, path_model: bool):
    """TRL's GRPOConfig for settings ``s``: one optimizer step = one rollout of prompts x group rows in
    micro-batches of ``micro_batch`` (gradient accumulation), mu = ``num_iterations``, no reference model
    (beta 0), AdamW (torch) at a constant lr with our Trainer's betas, clip and weight decay."""
    from trl import GRPOConfig

    cuda = torch.cuda.is_available()
    rows = s["prompts"] * s["group"]
    vllm = uses_vllm(s)
    kw = dict(
        output_dir=str(out_dir), seed=s["seed"], report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, use_cpu=not cuda, bf16=cuda, dataloader_num_workers=0,
        per_device_train_batch_size=s["micro_batch"], gradient_accumulation_steps=rows // s["micro_batch"],
        num_generations=s["group"], num_iterations=s["mu"], max_steps=s["steps"] * s["mu"],
        beta=0.0, loss_type=s["loss"], epsilon=0.2, scale_rewards="group", mask_truncated_completions=False,
        learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0, optim="adamw_torch",
        temperature=1.0, top_p=1.0, top_k=0, max_completion_length=s["new"],
        generation_kwargs=generation_kwargs(s, vllm), log_completions=False,
        # Unsloth checkpoints through get_peft_model(use_gradient_checkpointing="unsloth"), not the Trainer
        gradient_checkpointing=s["gradient_checkpointing"] and s["stack"] != "unsloth",
        use_vllm=vllm,
    )
    if vllm:
        kw.update(vllm_mode="colocate", vllm_gpu_memory_utilization=s["vllm_memory"],
                  vllm_max_model_length=-(-(s["prompt_len"] + s["new"] + 16) // 64) * 64)
    if path_model:  # TRL loads the model from the directory (the trl-* stacks)
        kw["model_init_kwargs"] = {"dtype": "bfloat16" if cuda else "float32"}
    return GRPOConfig(**kw)


def lora_config(s: dict):
    from peft import LoraConfig

    return LoraConfig(r=s["lora_r"], lora_alpha=s["lora_r"], lora_dropout=0.0, bias="none",
                      target_modules=PROJECTIONS, task_type="CAUSAL_LM")


def nf4_config():
    """QLoRA's quantization (Dettmers et al. 2023): NF4, double quantization of the scales, bf16 compute."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def unsloth_model(s: dict, model_dir: str):
    """Unsloth's documented GRPO model: 4-bit with its vLLM engine (``fast_inference``), then LoRA."""
    import importlib

    importlib.import_module("unsloth")  # first: its patches of transformers, peft and trl apply at import
    from unsloth import FastLanguageModel

    model, tok = FastLanguageModel.from_pretrained(
        model_name=model_dir, max_seq_length=s["prompt_len"] + s["new"] + 64, load_in_4bit=True,
        fast_inference=True, max_lora_rank=s["lora_r"], gpu_memory_utilization=s["vllm_memory"], dtype=None)
    model = FastLanguageModel.get_peft_model(
        model, r=s["lora_r"], lora_alpha=s["lora_r"], lora_dropout=0, bias="none", target_modules=PROJECTIONS,
        use_gradient_checkpointing="unsloth" if s["gradient_checkpointing"] else False, random_state=s["seed"])
    return model, tok


def build_trainer(s: dict, model_dir: str, work: Path):
    """(trainer, clock) for settings ``s`` on the checkpoint in ``model_dir``."""
    if s["stack"] == "unsloth":
        model, tok = unsloth_model(s, model_dir)  # before any other HF import of this process
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    from bench.random_checkpoint import exact_prompts

    extra = {}
    if s["stack"] != "unsloth":
        model, tok = model_dir, AutoTokenizer.from_pretrained(model_dir)
        extra["peft_config"] = lora_config(s)
        if s["stack"] == "trl-nf4":
            extra["quantization_config"] = nf4_config()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    prompts = exact_prompts(tok, s["prompts"] * s["steps"], s["prompt_len"], seed=s["seed"])
    clock = clock_callback(s["mu"])
    trainer = GRPOTrainer(model=model, reward_funcs=[seeded_reward(s["seed"])],
                          args=grpo_config(s, work / "trainer", isinstance(model, str)),
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok,
                          callbacks=[clock], **extra)
    wrap_timed(trainer, clock)
    return trainer, clock


def lora_params(model) -> dict:
    """The trainable LoRA tensors, copied to the CPU (the peak-memory counter must not see the copy)."""
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()
            if p.requires_grad and "lora_" in n}


def cycle_rows(clock, s: dict, log_history: list[dict]) -> list[dict]:
    """One row of results per measured step (rollout cycle): times, tokens/s, peak, lengths; step 1 is the
    warm-up. A length TRL logged (``completions/min_length``, ``max_length``) stands in where the generation
    call was not seen (a stack whose generation path bypasses ``_generate_single_turn``)."""
    logged = [h for h in log_history if "completions/min_length" in h]
    steps = [h for h in log_history if "grad_norm" in h]  # one entry per optimizer step (logging_steps 1)
    rows, tokens = [], s["prompts"] * s["group"] * s["new"]
    for i, c in enumerate(clock.cycles):
        mine = steps[i * s["mu"]:(i + 1) * s["mu"]]
        lens = c["lengths"]
        log = logged[i] if len(logged) > i else {}  # TRL logs completion lengths at generation steps only
        lo = min(lens) if lens else log.get("completions/min_length", math.nan)
        hi = max(lens) if lens else log.get("completions/max_length", math.nan)
        gen = c["generate_s"] if lens else math.nan
        rows.append(dict(step_index=i + 1, warmup=i == 0, step_s=c["step_s"], rollout_s=c["rollout_s"],
                         generate_s=gen, update_s=c["step_s"] - c["rollout_s"], tokens_per_s=tokens / c["step_s"],
                         rollout_tokens_per_s=tokens / c["rollout_s"] if c["rollout_s"] > 0 else math.nan,
                         peak_gib=c["peak_gib"], completions=len(lens) or s["prompts"] * s["group"],
                         completion_len_min=lo, completion_len_max=hi,
                         lengths_ok=lo == s["new"] and hi == s["new"],
                         lengths_source="generation call" if lens else "TRL's log",
                         trl_len_min=log.get("completions/min_length", math.nan),
                         trl_len_max=log.get("completions/max_length", math.nan),
                         grad_norm=max((float(h["grad_norm"]) for h in mine), default=math.nan),
                         train_loss=sum(float(h.get("loss", math.nan)) for h in mine) / max(len(mine), 1)))
    return rows


def effective(trainer, s: dict) -> dict:
    """What the trainer really runs with (Unsloth rewrites some of TRL's arguments): the batch geometry, loss,
    optimizer and precision as its ``args`` hold them after construction, ``args_changed`` naming each that is
    not what this bench asked for, and ``old_logp_pass``: whether TRL adds a no-grad log-prob pass to each
    rollout (mu > 1, or vLLM's importance-sampling correction, on by default in TRL)."""
    a, rows = trainer.args, s["prompts"] * s["group"]
    want = dict(per_device_train_batch_size=s["micro_batch"], gradient_accumulation_steps=rows // s["micro_batch"],
                generation_batch_size=rows, num_generations=s["group"], num_iterations=s["mu"], beta=0.0,
                loss_type=s["loss"], learning_rate=s["lr"], max_completion_length=s["new"], optim="adamw_torch")
    got = {k: getattr(a, k, None) for k in want}
    got["optim"] = str(getattr(got["optim"], "value", got["optim"]))
    every = a.steps_per_generation * a.num_iterations
    vllm_is = bool(getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False))
    return dict(args_changed=sorted(k for k in want if got[k] != want[k]), effective_args=got,
                old_logp_pass=a.gradient_accumulation_steps % every != 0 or vllm_is,
                vllm_is_correction=vllm_is, trainer_class=type(trainer).__name__,
                # Unsloth's own checkpointing setting ("unsloth", True or False), which its trainer follows
                unsloth_gradient_checkpointing=str(getattr(trainer.model, "_unsloth_gradient_checkpointing", None)),
                gradient_checkpointing_trainer=bool(a.gradient_checkpointing), bf16=bool(a.bf16))


def run_stack(s: dict, model_dir: str, work: Path):
    """Build, train ``steps`` rollout cycles, return (result rows, trainer). The rows carry ``lora_max_change``
    (the largest change of any LoRA weight over the run: 0 would mean no optimizer step reached it)."""
    trainer, clock = build_trainer(s, model_dir, work)
    before = lora_params(trainer.model)
    if not before:
        raise RuntimeError(f"stack {s['stack']}: the trainer's model has no trainable LoRA weights")
    trainer.train()
    after = lora_params(trainer.model)
    change = max(float((after[n] - before[n]).abs().max()) for n in before)
    rows = cycle_rows(clock, s, trainer.state.log_history)
    if len(rows) != s["steps"]:
        raise RuntimeError(f"stack {s['stack']}: {len(rows)} rollout cycles timed, wanted --steps {s['steps']}")
    extra = effective(trainer, s)
    for r in rows:
        r.update(lora_max_change=change, lora_tensors=len(before), model_class=type(trainer.model).__name__,
                 optimizer_steps=trainer.state.global_step, **extra)
    return rows, trainer
