"""Training configuration: small frozen dataclasses, one per concern, presets, YAML loading.

``TrainConfig`` groups ``ModelConfig`` (what to train), ``DataConfig`` (the task),
``RolloutConfig`` (sampling and the engine), ``LossConfig`` (the GRPO/DAPO objective),
``FilterConfig`` (DAPO's sampling-side filters: dynamic sampling, overlong shaping, truncated
completions), ``OptimConfig`` and ``AQNConfig``, plus the run's length, seed and checkpointing. ``PRESETS`` holds the paper's recipes and a tiny CPU one;
``load_config("x.yaml")`` reads a YAML file (optionally ``preset: name`` plus overrides).

Every field is coerced to its declared type and checked against its range in ``__post_init__``,
so a config built from YAML, a dict, a preset with overrides, ``TrainConfig.replace``,
``dataclasses.replace`` or a plain constructor call obeys the same rules (docs/training.md,
"Config types and validation"):

* ``float``: ints, floats and numeric strings (``"1e-5"``: PyYAML reads ``1e-5`` without a dot
  as a string); never bools; always finite (nan/inf are refused everywhere).
* ``int``: ints, integral floats (``8.0``) and integral strings (``"8"``, ``"1e3"``); not bools,
  not ``1.5``.
* ``bool``: ``True``/``False`` and the strings true/false, yes/no, on/off, 1/0 (any case).
  ``"false"`` is False (a plain ``bool("false")`` would be True).
* ``X | None``: ``None`` and the strings ``"null"``/``"none"`` (any case) are None; else as X.
* ``str``: a non-empty string (or an ``os.PathLike``, stored as a string); a field with choices
  must be one of them. Names that a registry defines are read from it when a config is checked
  (``formats.FORMATS`` + ``none``, ``grpo.LOSSES``, ``grpo.SCALES``, ``grpo.IS_MODES``,
  ``rollout.ENGINES`` + ``auto``, ``tasks.TASKS``): this module sits above them all, and
  ``config_types`` (the coercion and value rules) imports none of them.

An unknown key, a value of the wrong type or a value out of range is a ``ConfigError`` (a
``ValueError``) whose message names the dotted key, what is allowed and the value given:
``optim.max_grad_norm must be a finite float > 0 (...); got 0``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from qerl_kit.config_types import (EVAL_SIZE_RULE, LR_RULE, NEW_TOKENS_RULE, OLD_LOGP_MODES, OPTIMIZERS,  # noqa: F401
                                   DENSE_CACHE_GIB_WHY, KERNELS_WHY, MICRO_BATCH_ORDERS, RESAMPLE, SCHEDULES,
                                   SEED_RULE, STEPS_RULE, TEMPERATURE_RULE, TOP_K_RULE, TOP_P_RULE,
                                   TRAIN_SIZE_RULE, _SIGMA, ConfigError, _bad, _check, _check_keys, _rule, _section,
                                   _validate, check_aqn_sigmas, check_lora_alpha, check_lr, check_seed, check_sigma,
                                   check_steps, check_temperature, check_value, short_repr)
from qerl_kit.config_types import LORA_ALPHA_RULE, LORA_R_RULE, nearest  # LoRA: the rules attach_lora applies too
from qerl_kit.tasks.registry import DEFAULT_EVAL_SIZE, DEFAULT_TASK, DEFAULT_TRAIN_SIZE, task_names


# The registries whose names the config's choices are: all of them sit below the config, which reads
# their names when a config is checked (so a name registered at runtime is a valid value at once).
# formats, grpo and the rollout registry import torch: imported at the first check, not with the
# config, so a bad YAML file is refused before torch loads.
def _formats() -> tuple[str, ...]:
    from qerl_kit.formats import format_names

    return format_names()


def _kernel_backends() -> tuple[str, ...]:
    from qerl_kit.kernels.backend import Backend

    return tuple(b.value for b in Backend)


def _engines() -> tuple[str, ...]:
    from qerl_kit.rollout.registry import engine_names

    return engine_names()


def _losses() -> tuple[str, ...]:  # read through the module: the names in grpo.LOSSES now
    from qerl_kit import grpo

    return tuple(grpo.LOSSES)


def _scales() -> tuple[str, ...]:
    from qerl_kit import grpo

    return tuple(grpo.SCALES)


def _is_modes() -> tuple[str, ...]:
    from qerl_kit import grpo

    return tuple(grpo.IS_MODES)


# Ranges of values that enter through the config only (the shared ones live in config_types).
BATCH_MAX = 2**20  # completions per step: each is generated and held in memory every step
TOKENS_PER_STEP_MAX = 2**28  # rollout.batch_size x rollout.max_new_tokens
_BATCH_WHY = "completions per step = prompts x rollout.group_size, each generated and held in memory every step"
GRAD_NORM_MIN = 1e-6  # below it Adam's eps (1e-8) swamps every element of the clipped gradient


@dataclass(frozen=True)
class ModelConfig:
    _prefix = "model"
    name: str = "tiny"  # "tiny" (the shipped model), a preset of qerl_kit.models, or a local HF directory
    format: str = _rule("nvfp4", choices=_formats)  # a name of formats.FORMATS, or none (bf16 LoRA)
    # LoRA rank (config_types.LORA_R_RULE, shared with attach_lora and a saved adapter's config)
    lora_r: int = field(default=16, metadata={"rule": LORA_R_RULE})
    # None: alpha = r. The adapter's scale is alpha / r: 0 makes it a no-op, < 0 flips its sign, and
    # at most LORA_SCALE_MAX x r (config_types.LORA_ALPHA_RULE and check_lora_alpha, shared with attach_lora)
    lora_alpha: float | None = field(default=None, metadata={"rule": LORA_ALPHA_RULE})
    train_norms: bool = False  # also train the RMSNorm scales before the projections
    gradient_checkpointing: bool = False
    # GiB of dense base weights kept through the log-prob pass + update (qerl_kit.dense_update):
    # None = auto (CUDA: free memory minus the measured working set per token x the longest completion;
    # CPU: all if <= 1/4 of free RAM), 0 = off; resume-neutral (the same results either way)
    dense_cache_gib: float | None = _rule(None, ge=0, why=DENSE_CACHE_GIB_WHY)
    # the kernels the 4-bit matmuls may take, for the whole process (qerl_kit.kernels.set_backend, set when
    # the policy is built): null keeps the process's (QERL_KERNEL_BACKEND, else auto); "ours" leaves humming
    # out, for bit-identical runs across processes (docs/reliability.md); resume-neutral
    kernels: str | None = _rule(None, choices=_kernel_backends, why=KERNELS_WHY)
    trust_remote_code: bool = False

    def __post_init__(self):
        _validate(self)
        check_lora_alpha("model.lora_alpha", self.lora_alpha, self.lora_r, r_key="model.lora_r")


@dataclass(frozen=True)
class DataConfig:
    _prefix = "data"
    dataset: str = DEFAULT_TASK  # a task of qerl_kit.tasks.TASKS (arith, gsm8k, math500) or a GSM8K-style .jsonl path
    # a .jsonl dataset's held-out rows from another .jsonl file; default: the file's first eval_size rows
    eval_dataset: str | None = None
    # held-out problems; 0 would make accuracy 0/0. At most DATA_ROWS_MAX: a generated task (arith,
    # countdown) makes every row up front (~70 us each), so 10**12 would never finish
    eval_size: int = field(default=DEFAULT_EVAL_SIZE, metadata={"rule": EVAL_SIZE_RULE})
    # generated tasks: exactly this many; files: at most (the first rows). 0 cannot be sampled
    train_size: int = field(default=DEFAULT_TRAIN_SIZE, metadata={"rule": TRAIN_SIZE_RULE})

    def __post_init__(self):
        _validate(self)
        names = task_names()
        if not (self.dataset in names or self.dataset.endswith(".jsonl")):
            close = nearest(self.dataset, names)
            raise _bad("data.dataset", self.dataset,
                       f"one of {', '.join(repr(n) for n in names)} (qerl_kit.tasks.TASKS) or a path ending in .jsonl",
                       f"did you mean {close!r}?" if close else "")
        # the tasks by name hold out their own split and would ignore it
        _check(self.eval_dataset is None or (self.dataset.endswith(".jsonl") and self.eval_dataset.endswith(".jsonl")),
               "data.eval_dataset", self.eval_dataset, "null, or a GSM8K-style .jsonl path when data.dataset is one",
               f"task {self.dataset!r} holds out its own rows" if not self.dataset.endswith(".jsonl") else "")


@dataclass(frozen=True)
class RolloutConfig:
    _prefix = "rollout"
    # completions per step (the paper's "train batch"), = prompts x group_size; every one is generated and
    # held in memory each step, so at most 2**20 (and batch_size x max_new_tokens at most 2**28 tokens)
    batch_size: int = _rule(64, ge=1, le=BATCH_MAX, why=_BATCH_WHY)
    # G samples per prompt; group-normalized advantages need at least two samples per prompt
    group_size: int = _rule(8, ge=2, le=BATCH_MAX, why="group-normalized advantages need at least two samples per "
                                                      "prompt; a group is part of one step's batch")
    max_new_tokens: int = field(default=64, metadata={"rule": NEW_TOKENS_RULE})  # the rules SamplingParams shares
    # Rollouts sample at T and the trainer divides the logits by T: 0 (greedy, allowed in
    # SamplingParams for evaluation) gives G identical samples, zero advantages and a division by 0;
    # below 1e-4 logits / T overflow (config_types.TEMPERATURE_RULE, shared with SamplingParams)
    temperature: float = field(default=1.0, metadata={"rule": TEMPERATURE_RULE})
    top_p: float = field(default=1.0, metadata={"rule": TOP_P_RULE})  # in (0, 1], 1 = off
    top_k: int = field(default=0, metadata={"rule": TOP_K_RULE})  # >= 0, 0 = off
    # auto (StaticEngine on a GPU, transformers' generate elsewhere) | static | hf | vllm (rollout.ENGINES)
    engine: str = _rule("auto", choices=_engines)
    # engine: vllm only. The share of the GPU vLLM may take (gpu_memory_utilization); None: planned
    # from the model, the batch and the longest prompt (memory_plan.vllm_memory_share)
    vllm_gpu_memory: float | None = _rule(None, gt=0, le=0.95, why="a share of the GPU's memory; vLLM "
                                                                   "needs the training's share to stay free")
    # engine: static (or auto on a GPU) only (qerl_kit.engine_memory). Keep the KV cache and decode graphs
    # through the update (no re-allocation or graph capture per step) or free them after each rollout (the
    # update gets their memory); None: kept when the run's memory plan fits the GPU with them
    keep_cache: bool | None = None
    # engine: static (or auto) only. The most completions decoded at once, whole groups (the KV cache's
    # rows); a larger batch is decoded in turns. None: the whole batch, or the most the memory plan fits
    max_rows: int | None = _rule(None, ge=1, why="completions decoded at once: whole groups, at least one")
    # engine: static (or auto) only. The policy's q/k/v and gate/up tensors stored in the engine's fused
    # buffers instead of the engine holding a copy (same values; saves two thirds of the linear weights'
    # memory; the decode reads the same buffer). None: shared when the memory plan needs it
    share_weights: bool | None = None

    def __post_init__(self):
        _validate(self)
        _check(self.batch_size >= self.group_size and self.batch_size % self.group_size == 0,
               "rollout.batch_size", self.batch_size,
               f"a positive multiple of rollout.group_size = {self.group_size}", "groups are never split")
        _check(self.max_rows is None or self.max_rows % self.group_size == 0, "rollout.max_rows", self.max_rows,
               f"null or a positive multiple of rollout.group_size = {self.group_size}", "groups are never split")
        for key in ("keep_cache", "max_rows", "share_weights"):  # what the StaticEngine alone reads
            _check(getattr(self, key) is None or self.engine in ("auto", "static"), f"rollout.{key}",
                   getattr(self, key), f"null with rollout.engine = {self.engine!r}",
                   "only the static engine reads it: rollout.engine static, or auto on a GPU")
        tokens = self.batch_size * self.max_new_tokens  # a step's completions, each up to max_new_tokens long
        if tokens > TOKENS_PER_STEP_MAX:
            raise ConfigError(f"rollout.batch_size x rollout.max_new_tokens must be <= 2**28 tokens per step (their "
                              f"int64 ids alone take 2 GiB, their logits and KV cache many times that); got "
                              f"{self.batch_size} x {self.max_new_tokens}", "rollout.batch_size", self.batch_size,
                              "<= 2**28 tokens per step")

    @property
    def prompts_per_step(self) -> int:
        return self.batch_size // self.group_size


@dataclass(frozen=True)
class LossConfig:
    _prefix = "loss"
    loss: str = _rule("dapo", choices=_losses)  # grpo | dapo | dr_grpo (grpo.LOSSES)
    # The PPO clip window is [1 - eps_low, 1 + eps_high]: eps_low >= 1 removes the lower bound
    # (grpo refuses it), 0 forbids any decrease of a bad token's probability.
    eps_low: float = _rule(0.2, gt=0, lt=1, why="the lower clip bound 1 - eps_low must be in (0, 1)")
    # None: eps_low (symmetric clip); DAPO's clip-higher is 0.28. 0 forbids any increase of a good token's probability.
    eps_high: float | None = _rule(None, gt=0, why="the upper clip bound is 1 + eps_high")
    # the k3 KL weight; above 10 the KL term outweighs the policy loss (of order 1) so far that the run only
    # holds on to the reference (and 1e300 x KL overflows to inf/nan); the paper uses 0 .. 0.04
    beta: float = _rule(0.0, ge=0, le=10, why="a negative KL weight rewards drifting from the reference; above 10 the "
                                              "KL term swamps the policy loss (the paper uses 0 .. 0.04)")
    scale_rewards: str = _rule("group", choices=_scales)  # group | batch | none (grpo.SCALES)
    # policy updates per rollout batch (the paper: 4 on GSM8K); each is a full pass over the batch, so
    # 10**9 would run a single step for days
    mu: int = _rule(1, ge=1, le=64, why="policy updates per rollout batch, each a full pass over it; the paper uses 1 .. 4")
    micro_batch: int = _rule(16, ge=1)  # sequences per forward/backward (gradient accumulation inside a step)
    # which rows share a micro-batch: "length" = sorted by length, so each runs on a narrower width (the
    # same losses up to float rounding), "batch" = the batch's order, "packed" = sorted, then as many rows
    # per micro-batch as fit micro_batch x the batch's width in tokens (qerl_kit.logprobs.micro_batches)
    micro_batch_order: str = _rule("length", choices=MICRO_BATCH_ORDERS)
    is_correction: str | None = _rule("token_truncate", choices=_is_modes)  # TIS mode (grpo.IS_MODES), or None
    # The importance-sampling cap C_max: on-policy tokens have rho = 1, so a cap below 1 truncates or
    # masks even those, and a cap <= 0 flips the sign of the policy loss. Finite: to turn TIS off set
    # is_correction: null.
    is_cap: float = _rule(3.0, ge=1, why="on-policy tokens have rho = 1, a lower cap truncates or masks them and "
                                         "a cap <= 0 flips the loss; to turn TIS off set loss.is_correction: null")
    # where the clean policy's log-probs come from: "fold" = the first update iteration's forward (no separate
    # pass; a model with active dropout falls back to "pass"), "pass" = a separate no-grad pass (qerl_kit.old_policy)
    old_logp: str = _rule("fold", choices=OLD_LOGP_MODES)

    def __post_init__(self):
        _validate(self)


@dataclass(frozen=True)
class FilterConfig:
    """DAPO's sampling-side filters: which groups and completions reach the loss, and length shaping."""

    _prefix = "filters"
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill
    max_sampling_rounds: int = _rule(4, ge=1, why="rollout rounds per step, the first included")
    # DAPO overlong shaping: tokens before max_new_tokens where it starts (0 = off; <= rollout.max_new_tokens)
    overlong_buffer: int = _rule(0, ge=0, why="0 = off")
    # rewards are of order 1 (DAPO's penalty is 1): above 100 the length penalty swamps every reward, and
    # 1e300 overflows float32 when it is applied
    overlong_penalty: float = _rule(1.0, ge=0, le=100, why="the size of the penalty (DAPO: 1, rewards are of order 1); "
                                                           "negative would reward overlong answers")
    mask_truncated: bool = False  # drop completions that hit max_new_tokens from the loss

    def __post_init__(self):
        _validate(self)


@dataclass(frozen=True)
class OptimConfig:
    _prefix = "optim"
    lr: float = field(default=1e-5, metadata={"rule": LR_RULE})  # in [1e-9, 1]: the one lr rule (config_types)
    # AdamW multiplies the weights by 1 - lr x weight_decay every step; with lr <= 1, a decay <= 1 keeps that
    # factor in [0, 1), above it the weights flip sign and grow to inf (common values: 0 .. 0.1)
    weight_decay: float = _rule(0.0, ge=0, le=1, why="AdamW scales the weights by 1 - lr x weight_decay each step: "
                                                     "negative or above 1 they grow")
    # Adam's moment decays; torch.optim.AdamW refuses values outside [0, 1)
    betas: tuple[float, float] = _rule((0.9, 0.99), ge=0, lt=1, why="Adam's moment decay rates")
    # Gradient clipping: 0 scales every gradient to 0 (the adapter never moves), < 0 flips its sign
    # (gradient ascent). To clip rarely, set a large value.
    # Adam divides by sqrt(v) + eps (eps = 1e-8): a gradient clipped below 1e-6 in norm has elements under eps
    # and its steps shrink towards 0 (1e-300 is 0 in float32: the adapter is frozen). The paper uses 0.2.
    max_grad_norm: float = _rule(1.0, ge=GRAD_NORM_MIN, why="0 freezes the adapter, a negative norm ascends the "
                                                            "gradient, and below 1e-6 Adam's eps (1e-8) swamps it")
    schedule: str = _rule("constant", choices=SCHEDULES)  # constant | linear | cosine
    # the share of total_steps spent warming up; 1 would be warm-up only
    warmup_ratio: float = _rule(0.0, ge=0, lt=1, why="a share of total_steps")
    optimizer: str = _rule("adamw", choices=OPTIMIZERS)  # adamw | adamw8bit (bitsandbytes)

    def __post_init__(self):
        _validate(self)


@dataclass(frozen=True)
class AQNConfig:
    _prefix = "aqn"
    enabled: bool = True
    sigma_start: float = field(default=1e-2, metadata={"rule": _SIGMA})  # finite, in (0, 10]
    sigma_end: float = field(default=5e-4, metadata={"rule": _SIGMA})  # and <= sigma_start unless allow_increasing
    # a noise-free stage 0 plus a decay over stages 1..K-1 needs K >= 3 (checked only while enabled:
    # a run without AQN keeps the default and may be shorter than it)
    stages: int = _rule(10, ge=3, only_if="enabled", why="a noise-free stage 0 and a decay over stages 1..K-1; "
                                                          "checked while aqn.enabled is true")
    resample: str = _rule("step", choices=RESAMPLE)  # step: once per rollout step | forward: every forward
    allow_increasing: bool = False  # let sigma_end exceed sigma_start (noise that grows): only on purpose

    def __post_init__(self):
        _validate(self)
        check_aqn_sigmas(self.sigma_start, self.sigma_end, self.allow_increasing)


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    filters: FilterConfig = field(default_factory=FilterConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    aqn: AQNConfig = field(default_factory=AQNConfig)
    total_steps: int = field(default=100, metadata={"rule": STEPS_RULE})  # sets the lr schedule and AQN stages; train(steps) may stop earlier
    # The trainer derives per-step seeds as seed * 1_000_003 + ...; [0, 2**32) keeps them inside
    # torch's 64-bit seed range (and matches numpy's seed range).
    seed: int = field(default=0, metadata={"rule": SEED_RULE})
    save_every: int = _rule(25, ge=0, why="0 = never")
    keep_checkpoints: int = _rule(2, ge=0, why="0 = keep all")
    eval_every: int = _rule(0, ge=0, why="0 = never during training")
    output_dir: str = "runs/train"  # qerl demo writes runs/demo
    log_tensorboard: bool = False

    def __post_init__(self):
        _validate(self)  # sections given as mappings become section objects here
        if self.aqn.enabled:
            _check(self.total_steps >= self.aqn.stages, "total_steps", self.total_steps,
                   f"at least aqn.stages = {self.aqn.stages}", "every AQN stage needs at least one step")
        fc = self.filters
        _check(fc.overlong_buffer <= self.rollout.max_new_tokens, "filters.overlong_buffer", fc.overlong_buffer,
               f"<= rollout.max_new_tokens = {self.rollout.max_new_tokens}",
               "the overlong penalty zone lies inside the generation limit")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **sections) -> "TrainConfig":
        """A copy with sections replaced: ``cfg.replace(optim={"lr": 3e-5}, total_steps=50)``."""
        return from_dict(_merge(self.to_dict(), sections))


_SECTIONS = {f.name: f.type for f in fields(TrainConfig)}
_SECTION_CLASSES = {"model": ModelConfig, "data": DataConfig, "rollout": RolloutConfig,
                    "loss": LossConfig, "filters": FilterConfig, "optim": OptimConfig, "aqn": AQNConfig}
def _merge(base: dict, over: dict) -> dict:
    """``over`` on top of ``base``, section by section. An empty section (``None``: a YAML ``model:``
    whose keys are all commented out) overrides nothing: the base's (the preset's) values stay, never
    the dataclass defaults."""
    out = dict(base)
    for key, value in over.items():
        if value is None and isinstance(out.get(key), Mapping):
            continue
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def from_dict(d: Mapping[str, Any]) -> TrainConfig:
    """Build a TrainConfig from nested dicts; unknown keys are an error naming them."""
    if not isinstance(d, Mapping):
        raise _bad("config", d, "a mapping of config keys")
    _check_keys("", d, list(_SECTIONS))
    return TrainConfig(**{k: _section(k, _SECTION_CLASSES[k], v) if k in _SECTION_CLASSES else v
                          for k, v in d.items()})


PRESETS: dict[str, dict[str, Any]] = {
    # The shipped tiny model on the synthetic arithmetic task, sized for a 2-core CPU.
    "tiny-cpu": dict(
        model=dict(name="tiny", format="nvfp4", lora_r=16),
        data=dict(dataset="arith", eval_size=200),
        rollout=dict(batch_size=64, group_size=8, max_new_tokens=64, temperature=1.0),
        loss=dict(loss="dapo", micro_batch=64),
        optim=dict(lr=2e-3, max_grad_norm=1.0),
        aqn=dict(enabled=True, sigma_start=1e-2, sigma_end=5e-4, stages=10),
        total_steps=30, save_every=10, eval_every=0),
    # Paper Table 4, GSM8K with GRPO (batch 128 = 16 prompts x G 8, mu = 4, lr 1e-5, r 32). The paper's
    # AdamW-8bit is optim.optimizer: adamw8bit (needs bitsandbytes); the presets use torch's AdamW,
    # which runs everywhere (a LoRA adapter's optimizer state is small either way).
    "paper-gsm8k": dict(
        model=dict(name="Qwen/Qwen2.5-7B-Instruct", format="nvfp4", lora_r=32, gradient_checkpointing=True),
        data=dict(dataset="gsm8k", eval_size=1319),
        rollout=dict(batch_size=128, group_size=8, max_new_tokens=4096, temperature=1.0),
        loss=dict(loss="grpo", eps_low=0.2, eps_high=0.2, mu=4, micro_batch=8),
        optim=dict(lr=1e-5, schedule="cosine", warmup_ratio=0.1, max_grad_norm=0.2),
        aqn=dict(enabled=True, sigma_start=1e-2, sigma_end=5e-4, stages=10),
        total_steps=600, save_every=50),
    # Paper Table 4, BigMath with DAPO (G 16, mu 1, clip-higher 0.28, response 8192).
    "paper-bigmath": dict(
        model=dict(name="Qwen/Qwen2.5-7B-Instruct", format="nvfp4", lora_r=32, gradient_checkpointing=True),
        data=dict(dataset="math500", eval_size=500),
        rollout=dict(batch_size=128, group_size=16, max_new_tokens=8192, temperature=1.0),
        loss=dict(loss="dapo", eps_low=0.2, eps_high=0.28, mu=1, micro_batch=4),
        filters=dict(dynamic_sampling=True),
        optim=dict(lr=1e-5, schedule="cosine", warmup_ratio=0.1, max_grad_norm=0.2),
        aqn=dict(enabled=True, sigma_start=1e-2, sigma_end=5e-4, stages=10),
        total_steps=1000, save_every=50),
    # A real model on one GPU (issue #42's study): the 0.5B GGUF that ../shared/tools/fetch-real-model
    # puts in ~/.cache/qerl-models, GSM8K from the data folder, 8 prompts x 8 samples of 256 tokens,
    # one update per batch; a step is a few seconds on an H200 (docs/real-models.md).
    "real-gsm8k": dict(
        model=dict(name="~/.cache/qerl-models/qwen2.5-coder-0.5b-instruct.gguf", format="nvfp4", lora_r=16),
        data=dict(dataset="gsm8k", eval_size=1319),
        rollout=dict(batch_size=64, group_size=8, max_new_tokens=256, temperature=1.0),
        loss=dict(loss="grpo", eps_low=0.2, eps_high=0.28, mu=1, micro_batch=16),
        optim=dict(lr=5e-5, schedule="constant", max_grad_norm=1.0),
        aqn=dict(enabled=True, sigma_start=1e-2, sigma_end=5e-4, stages=5),
        total_steps=100, save_every=10),
}


def preset(name: str, **overrides) -> TrainConfig:
    """A named preset (``tiny-cpu``, ``paper-gsm8k``, ``paper-bigmath``) with nested overrides."""
    return from_dict(_merge(_preset_dict(name), overrides))


def _preset_dict(name: Any) -> dict[str, Any]:
    if not isinstance(name, str) or name not in PRESETS:
        raise _bad("preset", name, "one of " + ", ".join(repr(p) for p in PRESETS))
    return PRESETS[name]


def load_config(path: str | Path) -> TrainConfig:
    """Read a YAML config: ``preset: name`` (optional) plus sections overriding it."""
    from qerl_kit.config_yaml import read_yaml

    data = read_yaml(path) or {}  # a key given twice, bad YAML syntax: a ConfigError naming path:line
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must be a mapping; got {short_repr(data)}")
    has_preset = "preset" in data
    name = data.pop("preset", None)
    try:
        if not has_preset:
            return from_dict(data)
        return from_dict(_merge(_preset_dict(name), data))  # an empty `preset:` is refused, not ignored
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}", err.key, err.value, err.allowed) from err
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from err


def save_config(config: TrainConfig, path: str | Path) -> None:
    import yaml

    d = config.to_dict()
    d["optim"]["betas"] = list(d["optim"]["betas"])
    Path(path).write_text(yaml.safe_dump(d, sort_keys=False))


__all__ = ["TrainConfig", "ModelConfig", "DataConfig", "RolloutConfig", "LossConfig", "FilterConfig", "OptimConfig",
           "AQNConfig", "ConfigError", "PRESETS", "preset", "from_dict", "load_config", "save_config",
           "check_value", "check_aqn_sigmas", "check_lr", "check_seed", "check_sigma", "check_steps",
           "check_temperature", "replace"]
