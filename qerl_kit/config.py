"""Training configuration: small frozen dataclasses, one per concern, presets, YAML loading.

``TrainConfig`` groups ``ModelConfig`` (what to train), ``RolloutConfig`` (sampling),
``LossConfig`` (GRPO/DAPO objective), ``OptimConfig`` and ``AQNConfig``, plus the run's length,
seed and checkpointing. ``PRESETS`` holds the paper's recipes and a tiny CPU one;
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
  must be one of them, taken from the registries that define them where there is one
  (``grpo.LOSSES``, ``grpo.SCALES``, ``grpo.IS_MODES``, ``formats.FORMATS``).

An unknown key, a value of the wrong type or a value out of range is a ``ConfigError`` (a
``ValueError``) whose message names the dotted key, what is allowed and the value given:
``optim.max_grad_norm must be a finite float > 0 (...); got 0``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable


class ConfigError(ValueError):
    """A config key or value that is not allowed. ``key`` is the dotted path (``optim.lr``),
    ``value`` the value given, ``allowed`` what the key accepts (None for unknown-key errors)."""

    def __init__(self, message: str, key: str | None = None, value: Any = None, allowed: str | None = None):
        super().__init__(message)
        self.key, self.value, self.allowed = key, value, allowed


def _bad(key: str, value: Any, allowed: str, why: str = "") -> ConfigError:
    """The one error format: ``<key> must be <allowed> (<why>); got <repr(value)>``."""
    return ConfigError(f"{key} must be {allowed}{f' ({why})' if why else ''}; got {value!r}", key, value, allowed)


def _check(cond: bool, key: str, value: Any, allowed: str, why: str = "") -> None:
    if not cond:
        raise _bad(key, value, allowed, why)


# ---- coercion of one value to a declared type ----------------------------------------------------
_TRUE, _FALSE, _NONE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}, {"null", "none"}
BOOL_ALLOWED = "a boolean (true/false, or the strings yes/no, on/off, 1/0 in any case)"


def _is_bool(v: Any) -> bool:
    t = type(v)  # numpy's bool scalar too (numpy.bool_; numpy.bool in numpy 2)
    return isinstance(v, bool) or (t.__module__ == "numpy" and t.__name__ in ("bool_", "bool"))


def _as_bool(v: Any) -> bool | None:
    if _is_bool(v):
        return bool(v)
    if isinstance(v, str):
        s = v.strip().lower()
        if s in _TRUE:
            return True
        if s in _FALSE:
            return False
    return None


def _as_float(v: Any) -> float | None:
    if _is_bool(v):
        return None
    try:
        if isinstance(v, numbers.Real):
            return float(v)
        if isinstance(v, str):
            return float(v.strip())
    except (ValueError, OverflowError):  # not a number; an int too large for a float
        pass
    return None


def _as_int(v: Any) -> int | None:
    if _is_bool(v):
        return None
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            v = _as_float(v)
    if isinstance(v, numbers.Real) and math.isfinite(v) and float(v).is_integer():
        return int(v)
    return None


@dataclass(frozen=True)
class _Rule:
    """The range of one field: bounds (``gt``/``ge``/``lt``/``le``), choices (a tuple or a function
    returning the registry's names), ``why`` (shown in errors), ``only_if`` (a bool field of the same
    section: the range applies only while it is true; the type always applies)."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    choices: tuple | Callable[[], tuple] | None = None
    why: str = ""
    only_if: str | None = None

    def options(self) -> tuple:
        return self.choices() if callable(self.choices) else tuple(self.choices)

    def bounds(self) -> str:
        """``> 0``, ``>= 1``, ``in (0, 1]``..., or "" when unbounded."""
        lo = ("(", ">", self.gt) if self.gt is not None else ("[", ">=", self.ge) if self.ge is not None else None
        hi = (")", "<", self.lt) if self.lt is not None else ("]", "<=", self.le) if self.le is not None else None
        if lo and hi:
            return f"in {lo[0]}{_num(lo[2])}, {_num(hi[2])}{hi[0]}"
        if lo or hi:
            return f"{(lo or hi)[1]} {_num((lo or hi)[2])}"
        return ""

    def within(self, x) -> bool:
        return ((self.gt is None or x > self.gt) and (self.ge is None or x >= self.ge)
                and (self.lt is None or x < self.lt) and (self.le is None or x <= self.le))


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def _allowed(tp: Any, rule: _Rule | None) -> str:
    """What a field accepts, in words (the ``must be ...`` part of an error)."""
    rule = rule or _Rule()
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if type(None) in args:  # X | None
        return "null or " + _allowed(next(a for a in args if a is not type(None)), rule)
    if origin is tuple:  # tuple[float, float]: the same rule for every element
        bounds = rule.bounds()
        return f"a list of {len(args)} finite floats" + (f" {bounds}" if bounds else "")
    if tp is bool:
        return BOOL_ALLOWED
    if tp is str:
        if rule.choices is not None:
            return "one of " + ", ".join(repr(c) for c in rule.options())
        return "a non-empty string"
    name = {int: "an int", float: "a finite float"}[tp]
    bounds = rule.bounds()
    return f"{name} {bounds}" if bounds else name


def _coerce(key: str, value: Any, tp: Any, rule: _Rule | None, active: bool = True) -> Any:
    """``value`` as type ``tp``, range-checked by ``rule`` (unless ``active`` is False)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if type(None) in args:  # X | None
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE):
            return None
        inner = next(a for a in args if a is not type(None))
        try:
            return _coerce(key, value, inner, rule, active)
        except ConfigError:
            raise _bad(key, value, _allowed(tp, rule), rule.why if rule else "") from None
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a section of TrainConfig
        return _section(key, tp, value)
    rule = rule or _Rule()
    allowed = _allowed(tp, rule)
    if origin is tuple:
        _check(isinstance(value, (list, tuple)) and len(value) == len(args), key, value, allowed, rule.why)
        try:
            return tuple(_coerce(f"{key}[{i}]", item, item_tp, rule, active)
                         for i, (item, item_tp) in enumerate(zip(value, args)))
        except ConfigError:
            raise _bad(key, value, allowed, rule.why) from None
    if tp is bool:
        out = _as_bool(value)
        _check(out is not None, key, value, allowed, rule.why)
        return out
    if tp is str:
        out = os.fspath(value) if isinstance(value, os.PathLike) else value
        _check(isinstance(out, str) and out != "", key, value, allowed, rule.why)
        if rule.choices is not None:
            _check(out in rule.options(), key, value, allowed, rule.why)
        return out
    out = _as_int(value) if tp is int else _as_float(value)
    _check(out is not None and (tp is int or math.isfinite(out)), key, value, allowed, rule.why)
    if active:
        _check(rule.within(out), key, value, allowed, rule.why)
    return out


def check_value(key: str, value: Any, tp: Any, **rule) -> Any:
    """Coerce and check one value as a config field would be (``tp`` a type such as ``float``,
    ``int | None``; ``rule`` the keywords of a range: gt, ge, lt, le, choices, why). For objects
    that are not configs but take the same values (``qerl_kit.aqn.AQN``)."""
    return _coerce(key, value, tp, _Rule(**rule))


def _rule(default: Any, **rule) -> Any:
    """A dataclass field with a default and a range (``_Rule``'s keywords)."""
    return field(default=default, metadata={"rule": _Rule(**rule)})


# ---- choices: from the registries that define them, read when a config is checked -----------------
def _formats() -> tuple:
    from qerl_kit.formats import FORMATS

    return (*FORMATS, "none")  # none: a bf16 base with LoRA (no quantization)


def _losses() -> tuple:
    from qerl_kit.grpo import LOSSES

    return tuple(LOSSES)


def _scales() -> tuple:
    from qerl_kit.grpo import SCALES

    return tuple(SCALES)


def _is_modes() -> tuple:
    from qerl_kit.grpo import IS_MODES

    return tuple(IS_MODES)


ENGINES = ("auto", "static", "hf")  # qerl_kit.engine.make_engine
SCHEDULES = ("constant", "linear", "cosine")  # qerl_kit.trainer._lr_lambda
OPTIMIZERS = ("adamw", "adamw8bit")  # qerl_kit.trainer._make_optimizer
RESAMPLE = ("step", "forward")  # qerl_kit.aqn.AQN (checked there too)
SEED_MAX = 2**32 - 1


# AQN's noise std: finite and > 0 (nan/inf noise destroys the norms; 0 breaks the exponential decay)
_SIGMA = _Rule(gt=0, why="a positive noise std: the schedule decays exponentially from sigma_start to "
                         "sigma_end, so neither can be 0; to train without noise turn AQN off")


def check_aqn_sigmas(sigma_start: Any, sigma_end: Any, allow_increasing: Any = False, *, prefix: str = "aqn.",
                     flag: str = "aqn.allow_increasing: true") -> tuple[float, float, bool]:
    """The AQN noise schedule's checks, shared by ``AQNConfig`` and ``qerl_kit.aqn.AQN``: both sigmas
    finite and > 0, and ``sigma_end <= sigma_start`` unless growing noise is asked for explicitly.
    Returns them coerced (floats, bool)."""
    start = _coerce(f"{prefix}sigma_start", sigma_start, float, _SIGMA)
    end = _coerce(f"{prefix}sigma_end", sigma_end, float, _SIGMA)
    allow = _coerce(f"{prefix}allow_increasing", allow_increasing, bool, None)
    if end > start and not allow:
        raise _bad(f"{prefix}sigma_end", sigma_end, f"<= {prefix}sigma_start = {start:g}",
                   f"AQN noise decays over training; noise that grows is allowed only explicitly, with {flag}")
    return start, end, allow


# ---- validation of a whole section -------------------------------------------------------------------
_HINTS: dict[type, dict[str, Any]] = {}


def _validate(obj: Any) -> None:
    """Coerce every field of a (frozen) config dataclass to its declared type, in place, and check
    its range; errors name the field as ``<section>.<field>``."""
    cls = type(obj)
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    prefix = getattr(cls, "_prefix", "")
    # fields whose range depends on another field (only_if) last, once that one is coerced
    for f in sorted(fields(obj), key=lambda f: f.metadata.get("rule", _Rule()).only_if is not None):
        rule = f.metadata.get("rule")
        active = rule is None or rule.only_if is None or getattr(obj, rule.only_if) is True
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = _coerce(key, getattr(obj, f.name), _HINTS[cls][f.name], rule, active)
        object.__setattr__(obj, f.name, value)


def _check_keys(prefix: str, given: Mapping, known: list[str]) -> None:
    """Unknown keys are an error naming them (dotted), the allowed keys and the closest match."""
    bad = [k for k in given if k not in known]
    if not bad:
        return
    dotted = [f"{prefix}.{k}" if prefix else str(k) for k in bad]
    close = {k: m[0] for k in bad if isinstance(k, str) for m in [difflib.get_close_matches(k, known, n=1)] if m}
    msg = (f"unknown config key{'s' if len(bad) > 1 else ''} {', '.join(repr(d) for d in dotted)}; "
           f"allowed{f' in {prefix!r}' if prefix else ''}: {', '.join(repr(k) for k in known)}")
    if close:
        msg += " (did you mean " + ", ".join(f"{v!r} for {k!r}" if len(bad) > 1 else repr(v)
                                             for k, v in close.items()) + "?)"
    raise ConfigError(msg, dotted[0], bad[0], None)


def _section(name: str, cls: type, value: Any):
    """A section from an instance, a mapping of its keys, or None (its defaults)."""
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    if not isinstance(value, Mapping):
        raise _bad(name, value, f"a mapping of {name} keys ({', '.join(f.name for f in fields(cls))})")
    _check_keys(name, value, [f.name for f in fields(cls)])
    return cls(**value)


# ---- the sections ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelConfig:
    _prefix = "model"
    name: str = "tiny"  # "tiny" (the shipped model), a preset of qerl_kit.models, or a local HF directory
    format: str = _rule("nvfp4", choices=_formats)  # nvfp4 | mxfp4 | nf4 | none (bf16 LoRA)
    lora_r: int = _rule(16, ge=1)  # LoRA rank: 0 would be no adapter at all
    # None: alpha = r. The adapter's scale is alpha / r: 0 makes it a no-op, < 0 flips its sign.
    lora_alpha: float | None = _rule(None, gt=0, why="the LoRA scale is alpha / r")
    train_norms: bool = False  # also train the RMSNorm scales before the projections
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False

    def __post_init__(self):
        _validate(self)


@dataclass(frozen=True)
class DataConfig:
    _prefix = "data"
    dataset: str = "arith"  # arith (the tiny task) | gsm8k | math500 | a JSONL path
    eval_dataset: str | None = None  # default: the dataset's held-out split
    eval_size: int = _rule(200, ge=1)  # held-out problems; 0 would make accuracy 0/0
    train_size: int = _rule(20000, ge=1)  # for generated tasks: an empty training set cannot be sampled

    def __post_init__(self):
        _validate(self)


@dataclass(frozen=True)
class RolloutConfig:
    _prefix = "rollout"
    batch_size: int = _rule(64, ge=1)  # completions per step (the paper's "train batch"), = prompts x group_size
    # G samples per prompt; group-normalized advantages need at least two samples per prompt
    group_size: int = _rule(8, ge=2, why="group-normalized advantages need at least two samples per prompt")
    max_new_tokens: int = _rule(64, ge=1)
    # Rollouts sample at T and the trainer divides the logits by T: 0 (greedy, allowed in
    # SamplingParams for evaluation) gives G identical samples, zero advantages and a division by 0.
    temperature: float = _rule(1.0, gt=0, why="rollouts sample at T and the trainer divides the logits by T; "
                                              "0 (greedy) would give identical samples and divide by 0")
    top_p: float = _rule(1.0, gt=0, le=1, why="a nucleus probability; 1 = off")
    top_k: int = _rule(0, ge=0, why="0 = off")
    # auto (StaticEngine on a GPU, transformers' generate elsewhere) | static | hf
    engine: str = _rule("auto", choices=ENGINES)

    def __post_init__(self):
        _validate(self)
        _check(self.batch_size >= self.group_size and self.batch_size % self.group_size == 0,
               "rollout.batch_size", self.batch_size,
               f"a positive multiple of rollout.group_size = {self.group_size}", "groups are never split")

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
    beta: float = _rule(0.0, ge=0, why="a negative KL weight rewards drifting from the reference")  # k3 KL
    scale_rewards: str = _rule("group", choices=_scales)  # group | batch | none (grpo.SCALES)
    mu: int = _rule(1, ge=1)  # policy updates per rollout batch (the paper: 4 on GSM8K)
    micro_batch: int = _rule(16, ge=1)  # sequences per forward/backward (gradient accumulation inside a step)
    is_correction: str | None = _rule("token_truncate", choices=_is_modes)  # TIS mode (grpo.IS_MODES), or None
    # The importance-sampling cap C_max: on-policy tokens have rho = 1, so a cap below 1 truncates or
    # masks even those, and a cap <= 0 flips the sign of the policy loss. Finite: to turn TIS off set
    # is_correction: null.
    is_cap: float = _rule(3.0, ge=1, why="on-policy tokens have rho = 1, a lower cap truncates or masks them and "
                                         "a cap <= 0 flips the loss; to turn TIS off set loss.is_correction: null")
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill
    max_sampling_rounds: int = _rule(4, ge=1, why="rollout rounds per step, the first included")
    # DAPO overlong shaping: tokens before max_new_tokens where it starts (0 = off; <= rollout.max_new_tokens)
    overlong_buffer: int = _rule(0, ge=0, why="0 = off")
    overlong_penalty: float = _rule(1.0, ge=0, why="the size of the penalty; negative would reward overlong answers")
    mask_truncated: bool = False  # drop completions that hit max_new_tokens from the loss

    def __post_init__(self):
        _validate(self)


@dataclass(frozen=True)
class OptimConfig:
    _prefix = "optim"
    lr: float = _rule(1e-5, gt=0, why="0 never moves the adapter, < 0 ascends the loss")
    weight_decay: float = _rule(0.0, ge=0, why="negative decay grows the weights")
    # Adam's moment decays; torch.optim.AdamW refuses values outside [0, 1)
    betas: tuple[float, float] = _rule((0.9, 0.99), ge=0, lt=1, why="Adam's moment decay rates")
    # Gradient clipping: 0 scales every gradient to 0 (the adapter never moves), < 0 flips its sign
    # (gradient ascent). To clip rarely, set a large value.
    max_grad_norm: float = _rule(1.0, gt=0, why="0 freezes the adapter, a negative norm ascends the gradient")
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
    sigma_start: float = field(default=1e-2, metadata={"rule": _SIGMA})  # finite and > 0
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
    optim: OptimConfig = field(default_factory=OptimConfig)
    aqn: AQNConfig = field(default_factory=AQNConfig)
    total_steps: int = _rule(100, ge=1)  # sets the lr schedule and AQN stages; train(steps) may stop earlier
    # The trainer derives per-step seeds as seed * 1_000_003 + ...; [0, 2**32) keeps them inside
    # torch's 64-bit seed range (and matches numpy's seed range).
    seed: int = _rule(0, ge=0, le=SEED_MAX)
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
        lc = self.loss
        _check(lc.overlong_buffer <= self.rollout.max_new_tokens, "loss.overlong_buffer", lc.overlong_buffer,
               f"<= rollout.max_new_tokens = {self.rollout.max_new_tokens}",
               "the overlong penalty zone lies inside the generation limit")

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
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def from_dict(d: Mapping[str, Any]) -> TrainConfig:
    """Build a TrainConfig from nested dicts; unknown keys are an error naming them."""
    if not isinstance(d, Mapping):
        raise _bad("config", d, "a mapping of config keys")
    d = dict(d)
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
    return from_dict(_merge(_preset_dict(name), overrides))


def _preset_dict(name: Any) -> dict[str, Any]:
    if not isinstance(name, str) or name not in PRESETS:
        raise _bad("preset", name, "one of " + ", ".join(repr(p) for p in PRESETS))
    return PRESETS[name]


def load_config(path: str | Path) -> TrainConfig:
    """Read a YAML config: ``preset: name`` (optional) plus sections overriding it."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must be a mapping; got {data!r}")
    name = data.pop("preset", None)
    try:
        if name is None:
            return from_dict(data)
        return from_dict(_merge(_preset_dict(name), data))
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}", err.key, err.value, err.allowed) from err
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from err


def save_config(config: TrainConfig, path: str | Path) -> None:
    import yaml

    d = config.to_dict()
    d["optim"]["betas"] = list(d["optim"]["betas"])
    Path(path).write_text(yaml.safe_dump(d, sort_keys=False))


__all__ = ["TrainConfig", "ModelConfig", "DataConfig", "RolloutConfig", "LossConfig", "OptimConfig",
           "AQNConfig", "ConfigError", "PRESETS", "preset", "from_dict", "load_config", "save_config",
           "check_value", "check_aqn_sigmas", "replace"]
