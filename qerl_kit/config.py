"""Training configuration: small frozen dataclasses, one per concern, presets, YAML loading.

``TrainConfig`` groups ``ModelConfig`` (what to train), ``RolloutConfig`` (sampling),
``LossConfig`` (GRPO/DAPO objective), ``OptimConfig`` and ``AQNConfig``, plus the run's length,
seed and checkpointing. ``PRESETS`` holds the paper's recipes and a tiny CPU one;
``load_config("x.yaml")`` reads a YAML file (optionally ``preset: name`` plus overrides).
An unknown key or an impossible value is a ``ValueError`` that names it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(frozen=True)
class ModelConfig:
    name: str = "tiny"  # "tiny" (the shipped model), a preset of qerl_kit.models, or a local HF directory
    format: str = "nvfp4"  # nvfp4 | mxfp4 | nf4 | none (bf16 LoRA)
    lora_r: int = 16
    lora_alpha: float | None = None  # None: alpha = r
    train_norms: bool = False  # also train the RMSNorm scales before the projections
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False

    def __post_init__(self):
        _check(self.format in ("nvfp4", "mxfp4", "nf4", "none"),
               f"model.format must be nvfp4, mxfp4, nf4 or none; got {self.format!r}")
        _check(self.lora_r >= 1, f"model.lora_r must be >= 1; got {self.lora_r}")


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "arith"  # arith (the tiny task) | gsm8k | math500 | a JSONL path
    eval_dataset: str | None = None  # default: the dataset's held-out split
    eval_size: int = 200
    train_size: int = 20000  # for generated tasks

    def __post_init__(self):
        _check(self.eval_size >= 1, f"data.eval_size must be >= 1; got {self.eval_size}")


@dataclass(frozen=True)
class RolloutConfig:
    batch_size: int = 64  # completions per step (the paper's "train batch"), = prompts x group_size
    group_size: int = 8  # G samples per prompt
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    engine: str = "auto"  # auto (StaticEngine on a GPU, transformers' generate elsewhere) | static | hf

    def __post_init__(self):
        _check(self.engine in ("auto", "static", "hf"), f"rollout.engine must be auto, static or hf; got {self.engine!r}")
        _check(self.group_size >= 2, f"rollout.group_size must be >= 2 (group-normalized advantages "
                                     f"need at least two samples per prompt); got {self.group_size}")
        _check(self.batch_size >= self.group_size and self.batch_size % self.group_size == 0,
               f"rollout.batch_size ({self.batch_size}) must be a positive multiple of "
               f"rollout.group_size ({self.group_size}): groups are never split")
        _check(self.max_new_tokens >= 1, f"rollout.max_new_tokens must be >= 1; got {self.max_new_tokens}")
        _check(self.temperature > 0, f"rollout.temperature must be > 0 for RL sampling; got {self.temperature}")
        _check(0 < self.top_p <= 1, f"rollout.top_p must be in (0, 1]; got {self.top_p}")

    @property
    def prompts_per_step(self) -> int:
        return self.batch_size // self.group_size


@dataclass(frozen=True)
class LossConfig:
    loss: str = "dapo"  # grpo | dapo | dr_grpo
    eps_low: float = 0.2
    eps_high: float | None = None  # None: eps_low (symmetric clip); DAPO's clip-higher is 0.28
    beta: float = 0.0  # k3 KL to the reference (adapter disabled)
    scale_rewards: str = "group"  # group | batch | none
    mu: int = 1  # policy updates per rollout batch (the paper: 4 on GSM8K)
    micro_batch: int = 16  # sequences per forward/backward (gradient accumulation inside a step)
    is_correction: str | None = "token_truncate"  # TIS mode, or None to disable
    is_cap: float = 3.0
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill
    max_sampling_rounds: int = 4
    overlong_buffer: int = 0  # DAPO overlong shaping: tokens before max_new_tokens where it starts
    overlong_penalty: float = 1.0
    mask_truncated: bool = False  # drop completions that hit max_new_tokens from the loss

    def __post_init__(self):
        _check(self.loss in ("grpo", "dapo", "dr_grpo"), f"loss.loss must be grpo, dapo or dr_grpo; got {self.loss!r}")
        _check(self.scale_rewards in ("group", "batch", "none"),
               f"loss.scale_rewards must be group, batch or none; got {self.scale_rewards!r}")
        _check(self.mu >= 1 and self.micro_batch >= 1, "loss.mu and loss.micro_batch must be >= 1")
        _check(self.is_correction in (None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
               f"loss.is_correction must be a TIS mode or null; got {self.is_correction!r}")
        _check(self.beta >= 0 and self.eps_low > 0, "loss.beta must be >= 0 and loss.eps_low > 0")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = 1.0
    schedule: str = "constant"  # constant | linear | cosine
    warmup_ratio: float = 0.0
    optimizer: str = "adamw"  # adamw | adamw8bit (bitsandbytes)

    def __post_init__(self):
        _check(self.lr > 0, f"optim.lr must be > 0; got {self.lr}")
        _check(self.schedule in ("constant", "linear", "cosine"), f"optim.schedule: unknown {self.schedule!r}")
        _check(self.optimizer in ("adamw", "adamw8bit"), f"optim.optimizer: unknown {self.optimizer!r}")
        _check(0 <= self.warmup_ratio < 1, f"optim.warmup_ratio must be in [0, 1); got {self.warmup_ratio}")


@dataclass(frozen=True)
class AQNConfig:
    enabled: bool = True
    sigma_start: float = 1e-2
    sigma_end: float = 5e-4
    stages: int = 10
    resample: str = "step"

    def __post_init__(self):
        if self.enabled:
            _check(self.stages >= 3, f"aqn.stages must be >= 3; got {self.stages}")
            _check(self.sigma_start > 0 and self.sigma_end > 0, "aqn sigmas must be positive")


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    aqn: AQNConfig = field(default_factory=AQNConfig)
    total_steps: int = 100  # sets the lr schedule and AQN stages; train(steps) may stop earlier
    seed: int = 0
    save_every: int = 25  # 0: never
    keep_checkpoints: int = 2
    eval_every: int = 0  # 0: never during training
    output_dir: str = "runs/latest"
    log_tensorboard: bool = False

    def __post_init__(self):
        _check(self.total_steps >= 1, f"total_steps must be >= 1; got {self.total_steps}")
        _check(self.save_every >= 0 and self.eval_every >= 0, "save_every and eval_every must be >= 0")
        if self.aqn.enabled:
            _check(self.total_steps >= self.aqn.stages,
                   f"total_steps ({self.total_steps}) must be at least aqn.stages ({self.aqn.stages})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **sections) -> "TrainConfig":
        """A copy with sections replaced: ``cfg.replace(optim={"lr": 3e-5}, total_steps=50)``."""
        return from_dict(_merge(self.to_dict(), sections))


_SECTIONS = {f.name: f.type for f in fields(TrainConfig)}
_SECTION_CLASSES = {"model": ModelConfig, "data": DataConfig, "rollout": RolloutConfig,
                    "loss": LossConfig, "optim": OptimConfig, "aqn": AQNConfig}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def from_dict(d: dict[str, Any]) -> TrainConfig:
    """Build a TrainConfig from nested dicts; unknown keys are an error naming them."""
    d = dict(d)
    unknown = set(d) - set(_SECTIONS)
    _check(not unknown, f"unknown config key(s): {sorted(unknown)}; known: {sorted(_SECTIONS)}")
    kwargs: dict[str, Any] = {}
    for name, cls in _SECTION_CLASSES.items():
        if name in d:
            section = d.pop(name) or {}
            _check(isinstance(section, dict), f"config section {name!r} must be a mapping")
            known = {f.name for f in fields(cls)}
            bad = set(section) - known
            _check(not bad, f"unknown key(s) in section {name!r}: {sorted(bad)}; known: {sorted(known)}")
            if "betas" in section:
                section = {**section, "betas": tuple(section["betas"])}
            kwargs[name] = cls(**section)
    return TrainConfig(**kwargs, **d)


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
    # Paper Table 4, GSM8K with GRPO (batch 128 = 16 prompts x G 8, mu = 4, lr 1e-5, r 32).
    "paper-gsm8k": dict(
        model=dict(name="Qwen/Qwen2.5-7B-Instruct", format="nvfp4", lora_r=32, gradient_checkpointing=True),
        data=dict(dataset="gsm8k", eval_size=1319),
        rollout=dict(batch_size=128, group_size=8, max_new_tokens=4096, temperature=1.0),
        loss=dict(loss="grpo", eps_low=0.2, eps_high=0.2, mu=4, micro_batch=8),
        optim=dict(lr=1e-5, optimizer="adamw8bit", schedule="cosine", warmup_ratio=0.1, max_grad_norm=0.2),
        aqn=dict(enabled=True, sigma_start=1e-2, sigma_end=5e-4, stages=10),
        total_steps=600, save_every=50),
    # Paper Table 4, BigMath with DAPO (G 16, mu 1, clip-higher 0.28, response 8192).
    "paper-bigmath": dict(
        model=dict(name="Qwen/Qwen2.5-7B-Instruct", format="nvfp4", lora_r=32, gradient_checkpointing=True),
        data=dict(dataset="math500", eval_size=500),
        rollout=dict(batch_size=128, group_size=16, max_new_tokens=8192, temperature=1.0),
        loss=dict(loss="dapo", eps_low=0.2, eps_high=0.28, mu=1, micro_batch=4, dynamic_sampling=True),
        optim=dict(lr=1e-5, optimizer="adamw8bit", schedule="cosine", warmup_ratio=0.1, max_grad_norm=0.2),
        aqn=dict(enabled=True, sigma_start=1e-2, sigma_end=5e-4, stages=10),
        total_steps=1000, save_every=50),
}


def preset(name: str, **overrides) -> TrainConfig:
    """A named preset (``tiny-cpu``, ``paper-gsm8k``, ``paper-bigmath``) with nested overrides."""
    _check(name in PRESETS, f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return from_dict(_merge(PRESETS[name], overrides))


def load_config(path: str | Path) -> TrainConfig:
    """Read a YAML config: ``preset: name`` (optional) plus sections overriding it."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    _check(isinstance(data, dict), f"{path}: a config file must be a mapping")
    name = data.pop("preset", None)
    try:
        return preset(name, **data) if name else from_dict(data)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from err


def save_config(config: TrainConfig, path: str | Path) -> None:
    import yaml

    d = config.to_dict()
    d["optim"]["betas"] = list(d["optim"]["betas"])
    Path(path).write_text(yaml.safe_dump(d, sort_keys=False))


__all__ = ["TrainConfig", "ModelConfig", "DataConfig", "RolloutConfig", "LossConfig", "OptimConfig",
           "AQNConfig", "PRESETS", "preset", "from_dict", "load_config", "save_config", "replace"]
