"""Typed config fields: coercion and range checks shared by the config dataclasses (qerl_kit.config).

See ``qerl_kit.config``'s docstring for the rules; every failure is a ``ConfigError`` naming the
dotted key, what is allowed and the value given.

This module is the bottom of the package: it imports no qerl_kit module at all, so every layer can
check its values with it. A field whose choices are a registry's names (formats, losses, tasks,
rollout backends) gets them as a function from ``qerl_kit.config``, which sits above the registries.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
import reprlib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Callable


class ConfigError(ValueError):
    """A config key or value that is not allowed. ``key`` is the dotted path (``optim.lr``),
    ``value`` the value given, ``allowed`` what the key accepts (None for unknown-key errors)."""

    def __init__(self, message: str, key: str | None = None, value: Any = None, allowed: str | None = None):
        super().__init__(message)
        self.key, self.value, self.allowed = key, value, allowed


class _ShortRepr(reprlib.Repr):
    """reprlib's bounded repr (it never builds the full repr of a container: a YAML alias tree of 9**9
    strings formats in microseconds), with ints too long to print shown by their size."""

    def __init__(self):
        super().__init__()
        self.maxlevel, self.maxlist, self.maxtuple, self.maxdict, self.maxset = 3, 6, 6, 6, 6
        self.maxfrozenset, self.maxdeque, self.maxarray = 6, 6, 6
        self.maxstring, self.maxother, self.maxlong = 80, 80, 40

    def repr_int(self, x, level):
        if x.bit_length() > 128:  # str() of a huge int is slow (and refused past 4300 digits)
            return f"<an int of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_SHORT = _ShortRepr()
REPR_LIMIT = 200


def short_repr(value: Any, limit: int = REPR_LIMIT) -> str:
    """``repr(value)`` cut to at most ``limit`` characters, without first building the whole repr:
    an error message never prints (or spends time on) an unbounded value. A string (a path, a key) is
    cut to ``limit`` before its repr is built; anything else goes through reprlib's bounded repr."""
    try:
        text = repr(value[:limit]) if isinstance(value, str) else _SHORT.repr(value)
    except Exception:  # noqa: BLE001 - a __repr__ that fails must not hide the error being reported
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _bad(key: str, value: Any, allowed: str, why: str = "") -> ConfigError:
    """The one error format: ``<key> must be <allowed> (<why>); got <short_repr(value)>``."""
    return ConfigError(f"{key} must be {allowed}{f' ({why})' if why else ''}; got {short_repr(value)}",
                       key, value, allowed)


def _check(cond: bool, key: str, value: Any, allowed: str, why: str = "") -> None:
    if not cond:
        raise _bad(key, value, allowed, why)


def nearest(text: Any, options, cutoff: float = 0.6) -> str | None:
    """The option closest to ``text`` (difflib), for a "did you mean ...?" hint; None when nothing is
    close, or ``text`` is no string or is 200 characters or longer (difflib is quadratic)."""
    if not isinstance(text, str) or len(text) >= 200:
        return None
    close = difflib.get_close_matches(text, [str(o) for o in options], n=1, cutoff=cutoff)
    return close[0] if close else None


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
    if isinstance(x, int) and x >= 2**32 - 1 and (x + 1) & x == 0:  # 2**63 - 1 reads better than 9.22337e+18
        return f"2**{x.bit_length()} - 1"
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
        if rule.choices is not None and out not in rule.options():  # a typo is named with its nearest choice
            close = nearest(out, rule.options())
            raise _bad(key, value, allowed, "; ".join(w for w in (rule.why, close and f"did you mean {close!r}?") if w))
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


# ---- choices that are plain values (the registries' names are checked in qerl_kit.config) ---------------
SCHEDULES = ("constant", "linear", "cosine")  # qerl_kit.optim.lr_lambda
OPTIMIZERS = ("adamw", "adamw8bit")  # qerl_kit.optim.make_optimizer
RESAMPLE = ("step", "forward")  # qerl_kit.aqn.AQN (checked there too)
OLD_LOGP_MODES = ("fold", "pass")  # qerl_kit.old_policy: where a step's old log-probs come from
MICRO_BATCH_ORDERS = ("length", "batch", "packed")  # qerl_kit.logprobs.micro_batches: which rows share a micro-batch
# model.dense_cache_gib (qerl_kit.dense_update): what the key means, in its errors
DENSE_CACHE_GIB_WHY = "GiB of dense base weights kept for the log-prob pass + update; 0 = off, null = auto"
# model.kernels (qerl_kit.kernels.set_backend): what the key means, in its errors
KERNELS_WHY = "the kernels 4-bit matmuls may take; null = the process's (QERL_KERNEL_BACKEND, else auto)"
SEED_MAX = 2**32 - 1


# ---- one check per concept: the ranges that can work, shared by every entry point ---------------------
# The config section, SamplingParams, AQN, the trainer's controls, the CLI and the widgets all go through
# these rules (a config field through its ``_Rule``, everything else through the ``check_*`` functions),
# so a value is accepted or refused the same way wherever it comes from.
RNG_SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed (and vLLM's per-request seed) take a signed 64-bit int
TEMPERATURE_MIN = 1e-4
LR_MAX = 1.0
SIGMA_MAX = 10.0

# The config's seed stays below 2**32: the trainer derives per-step seeds from it (seed * 1_000_003 +
# ...), which must stay inside the generators' 64-bit range (and numpy's seed range is [0, 2**32)).
SEED_RULE = _Rule(ge=0, le=SEED_MAX, why="per-step seeds are derived from it and must stay inside the "
                                         "generators' 64-bit range")
# A seed handed to a generator as it is (SamplingParams, AQN): what torch's and vLLM's generators accept.
RNG_SEED_RULE = _Rule(ge=0, le=RNG_SEED_MAX, why="a generator seed is a signed 64-bit int")
STEPS_RULE = _Rule(ge=1, why="the number of training steps to run; fewer than 1 trains nothing")
# Adam moves each weight by about lr per step. A float32 LoRA weight of ~1e-2 is resolved to 2**-30 ~ 9.3e-10
# (its ulp), so a step below 1e-9 rounds away: the adapter never moves (1e-300 is 0 in float32 outright).
LR_MIN = 1e-9
LR_RULE = _Rule(ge=LR_MIN, le=LR_MAX, why="Adam moves each weight by about lr per step and LoRA weights are ~1e-2: "
                                          "below 1e-9 (their float32 resolution) a step rounds away and the adapter "
                                          "never moves, above 1 one step destroys it (the paper uses 1e-5)")
NEW_TOKENS_RULE = _Rule(ge=1, why="tokens to generate")
TOP_P_RULE = _Rule(gt=0, le=1, why="a nucleus probability; 1 = off")
TOP_K_RULE = _Rule(ge=0, why="0 = off")
TEMPERATURE_RULE = _Rule(ge=TEMPERATURE_MIN, why="logits are divided by T and must stay finite in float32; "
                                                 "below 1e-4 sampling is greedy in all but name")
# AQN's noise std: finite and > 0 (nan/inf noise destroys the norms; 0 breaks the exponential decay), and
# at most SIGMA_MAX: noise is added to RMSNorm scales of order 1, so a sigma above 10 replaces them by
# noise (the shipped tiny model already breaks at sigma ~1; the paper uses 1e-2 .. 5e-4).
_SIGMA_WHY = "above 10 the noise swamps RMSNorm scales of order 1; the paper uses 1e-2 .. 5e-4"
_SIGMA = _Rule(gt=0, le=SIGMA_MAX, why="a positive noise std: 0 breaks the exponential decay from sigma_start to sigma_end, "
                                       "so turn AQN off for no noise; " + _SIGMA_WHY)
_SIGMA_NOW = _Rule(ge=0, le=SIGMA_MAX, why="0 = no noise; " + _SIGMA_WHY)  # one sigma applied now (a probe)


# A generated task (arith, countdown) makes every row up front (~70 us each): 10**6 rows take a minute or
# two, 10**12 would never finish. A data file with fewer rows gives all it has.
DATA_ROWS_MAX = 10**6
_ROWS_WHY = "a generated task makes every row up front; a data file with fewer rows gives all it has"
EVAL_SIZE_RULE = _Rule(ge=1, le=DATA_ROWS_MAX, why="held-out problems: 0 would make accuracy 0/0; " + _ROWS_WHY)
TRAIN_SIZE_RULE = _Rule(ge=1, le=DATA_ROWS_MAX, why="an empty training set cannot be sampled; " + _ROWS_WHY)
# The adapter's output is scaled by alpha / r and Adam moves its weights by ~lr per step, so the scale
# multiplies the effective lr: above 1000 (lr 1e-5 acting as 1e-2) the first steps blow the logits up.
LORA_SCALE_MAX = 1000
LORA_R_RULE = _Rule(ge=1)  # LoRA rank: 0 would be no adapter at all
LORA_ALPHA_RULE = _Rule(gt=0, why="the LoRA scale is alpha / r")  # and at most LORA_SCALE_MAX x r (check_lora_alpha)


def check_lora_alpha(key: str, alpha: Any, r: int, r_key: str = "r") -> float | None:
    """LoRA's alpha for rank ``r``: None (alpha = r) or a finite float in (0, 1000 x r]: the adapter's
    scale alpha / r is 0 (a no-op) at 0, flips its sign below, and multiplies the effective lr."""
    why = ("the LoRA scale alpha / r multiplies the adapter's output and so its effective lr: 0 is a no-op, < 0 "
           "flips its sign, above 1000 lr 1e-5 acts as 1e-2")
    alpha = _coerce(key, alpha, float | None, _Rule(gt=0, why=why))
    _check(alpha is None or alpha <= LORA_SCALE_MAX * r, key, alpha,
           f"null or a finite float in (0, {_num(LORA_SCALE_MAX * r)}] ({LORA_SCALE_MAX} x {r_key} = {r})", why)
    return alpha


def check_rule(key: str, value: Any, tp: Any, rule: _Rule) -> Any:
    """``value`` coerced to ``tp`` and checked against one of the shared rules above (``TOP_P_RULE`` ...),
    as a config field with that rule is."""
    return _coerce(key, value, tp, rule)


def check_seed(key: str, value: Any, rng: bool = True) -> int:
    """A seed: an int in [0, 2**63 - 1] when it goes to a generator as it is (``rng``), in
    [0, 2**32 - 1] for the config's seed (per-step seeds are derived from it)."""
    return _coerce(key, value, int, RNG_SEED_RULE if rng else SEED_RULE)


def check_steps(key: str, value: Any) -> int:
    """A number of training steps to run: an int >= 1."""
    return _coerce(key, value, int, STEPS_RULE)


def check_lr(key: str, value: Any) -> float:
    """A learning rate: a finite float in (0, 1]."""
    return _coerce(key, value, float, LR_RULE)


def check_temperature(key: str, value: Any, greedy: bool = False) -> float:
    """A sampling temperature: a finite float >= 1e-4, or 0 (greedy) where ``greedy`` is allowed
    (evaluation; rollouts for training divide by T)."""
    if greedy:
        t = _as_float(value)
        if t == 0:
            return 0.0
        if t is None or not math.isfinite(t) or t < TEMPERATURE_MIN:
            raise _bad(key, value, f"0 (greedy) or a finite float >= {TEMPERATURE_MIN:g}", TEMPERATURE_RULE.why)
    return _coerce(key, value, float, TEMPERATURE_RULE)


def check_sigma(key: str, value: Any, zero: bool = False) -> float:
    """An AQN noise std: a finite float in (0, 10] (a schedule's sigma_start/sigma_end), or in [0, 10]
    for one sigma applied now (``zero``: 0 = no noise)."""
    return _coerce(key, value, float, _SIGMA_NOW if zero else _SIGMA)


def check_names(key: str, given: Any, available: Any, matches: Callable[[str, str], bool] | None = None,
                what: str = "module", shown: Any = None, empty: bool = True) -> tuple[str, ...]:
    """Names that must each match something: ``given`` as a tuple of non-empty strings, every one of
    which matches at least one of ``available`` (by ``matches(name, candidate)``, default equality).
    A name that matches nothing (``lm_hed``, ``q_prj``) is an error listing the names that exist
    (``shown``, e.g. the leaf names of ``available``'s dotted paths; default ``available``). ``empty``:
    whether no names at all is allowed."""
    if isinstance(given, str):  # one name where a list is expected: ("lm_head") is a string
        given = (given,)
    try:
        names = tuple(given)
    except TypeError:
        raise _bad(key, given, f"a list of {what} names") from None
    _check(empty or len(names) > 0, key, given, f"a non-empty list of {what} names")
    for name in names:
        _check(isinstance(name, str) and name != "", key, given, f"a list of non-empty {what} names")
    available = sorted(set(available))
    matches = matches or (lambda name, candidate: name == candidate)
    missing = [n for n in names if not any(matches(n, a) for a in available)]
    if missing:
        listed = sorted(set(shown)) if shown is not None else available
        close = {n: nearest(n, listed) for n in missing[:5]}
        hint = "; ".join(f"did you mean {c!r} for {short_repr(n)}?" for n, c in close.items() if c)
        shown = ", ".join(short_repr(a, 60) for a in listed[:40]) + (" ..." if len(listed) > 40 else "")
        raise ConfigError(f"{key}: {', '.join(short_repr(n, 60) for n in missing[:5])} "
                          f"match{'es' if len(missing) == 1 else ''} no {what}; the {what} names are: {shown}"
                          + (f" ({hint})" if hint else ""), key, missing[0], f"names of {what}s")
    return names


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
    # keys as given may be anything YAML makes (long strings, numbers): every one printed bounded
    dotted = [(f"{prefix}.{k}" if prefix else k) if isinstance(k, str) else short_repr(k) for k in bad]
    shown = ", ".join(short_repr(d, 80) for d in dotted[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    close = {k: m for k in bad[:5] if (m := nearest(k, known))}
    msg = (f"unknown config key{'s' if len(bad) > 1 else ''} {shown}; "
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
