"""What ``trainer_state.pt`` holds, checked with the rules the live objects are built with, and
restored into them all or nothing.

``checkpoint.check_state`` checks that every key is there with the right type; ``check_values`` (which
it calls) checks what the keys hold, so a resume never trains on garbage nor fails later with a bare
KeyError: the step is within the run's ``total_steps``; the optimizer's lrs, betas, eps and weight decay
obey the config's rules (``config.OptimConfig``'s fields, ``config_types.LR_RULE``) and its state tensors
(Adam's moments) are finite; the scheduler's base and current lrs obey the same lr rule; the RNG states
load into a scratch generator; the AQN state's schedule passes AQN's own constructor (the rules of
``qerl_kit.aqn.AQN``, not a copy of them). ``restore`` then loads the optimizer, scheduler, RNG, AQN
and adapter into a trainer's objects; any failure (a structure the live optimizer or scheduler does not
accept: no ``lr_lambdas``, another number of parameter groups) is a ``CheckpointError`` naming the file
and the key, and everything restored so far is put back as it was. The RNG state helpers
(``rng_state``, ``set_rng_state``) live here too; ``qerl_kit.checkpoint`` builds on this module and
this module imports nothing of it.
"""

from __future__ import annotations

import contextlib
import json
import numbers
import random
import typing
from dataclasses import fields
from pathlib import Path

import torch

from qerl_kit.adapter_files import CheckpointError, load_adapter_weights
from qerl_kit.config_types import LR_MAX, LR_RULE, ConfigError, _Rule, check_rule, short_repr

STATE_FILE = "trainer_state.pt"  # a checkpoint directory's trainer state (``qerl_kit.checkpoint``)

# The lr an optimizer group holds now: the base lr (LR_RULE) times the schedule's factor in [0, 1].
CURRENT_LR_RULE = _Rule(ge=0, le=LR_MAX, why="the scheduled lr: the base lr (at most 1) times a factor in [0, 1]")
_EPS_RULE = _Rule(gt=0, why="Adam's denominator term; 0 divides by zero where a moment is 0")
_COUNT_RULE = _Rule(ge=0)
# what AQN.state_dict() writes for each schedule value (a checkpoint holds these types exactly)
_AQN_TYPES = {"sigma_start": float, "sigma_end": float, "stages": int, "total_steps": int, "seed": int,
              "resample": str, "allow_increasing": bool}


def rng_state() -> dict:
    """The torch and Python RNG states, as a checkpoint stores them."""
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_to_tuple(state["python"]))


def _to_tuple(x):
    """Python's RNG state with its lists back as tuples (a saved state holds lists)."""
    return tuple(_to_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


@contextlib.contextmanager
def _named(path, key: str):
    """Any error inside is a ``CheckpointError`` naming ``path`` and ``key`` (and the error's own words)."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - torch, random and AQN raise several types for a bad state
        raise CheckpointError(f"{path}: {key!r} cannot be loaded ({type(err).__name__}: {str(err)[:300]}): "
                              "the file is damaged") from err


def _typed(key: str, value, tp, rule: _Rule | None):
    """``value`` checked by ``rule`` as a config field of type ``tp`` is, and of that type already (a
    checkpoint holds what the objects wrote: the string "0.1" where a float belongs is damage)."""
    items = value if typing.get_origin(tp) is tuple and isinstance(value, (list, tuple)) else [value]
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is str:
        ok = isinstance(value, str)
    else:
        kind = int if tp is int else numbers.Real
        ok = all(isinstance(v, kind) and not isinstance(v, bool) for v in items)
    if not ok:
        name = getattr(tp, "__name__", None) or str(tp)
        raise ConfigError(f"{key} must be of type {name}; got {short_repr(value)}", key, value, name)
    return check_rule(key, value, tp, rule or _Rule())


def _optimizer_values(opt: dict) -> None:
    from qerl_kit.config import OptimConfig

    rules = {f.name: f.metadata.get("rule") for f in fields(OptimConfig)}
    checks = {"lr": (float, CURRENT_LR_RULE), "initial_lr": (float, LR_RULE), "eps": (float, _EPS_RULE),
              "betas": (tuple[float, float], rules["betas"]), "weight_decay": (float, rules["weight_decay"])}
    for i, group in enumerate(opt["param_groups"]):
        if not isinstance(group, dict):
            raise ConfigError(f"optimizer.param_groups[{i}] must be a dict; got {short_repr(group)}")
        for name, (tp, rule) in checks.items():
            if name in group:
                _typed(f"optimizer.param_groups[{i}].{name}", group[name], tp, rule)
    for pid, entry in opt["state"].items():
        for name, t in (entry.items() if isinstance(entry, dict) else ()):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                bad = int((~torch.isfinite(t)).sum())
                if bad:
                    raise ConfigError(f"optimizer.state[{pid}].{name} must be finite; got {bad} NaN/inf of "
                                      f"{t.numel()} values (the next step would turn the adapter to NaN)")
                if name == "exp_avg_sq" and bool((t < 0).any()):
                    raise ConfigError(f"optimizer.state[{pid}].{name} must be >= 0 (a mean of squared gradients); "
                                      f"got {int((t < 0).sum())} negative values")


def _scheduler_values(sched: dict) -> None:
    for name, rule in (("base_lrs", LR_RULE), ("_last_lr", CURRENT_LR_RULE)):
        if name in sched:
            if not isinstance(sched[name], (list, tuple)):
                raise ConfigError(f"scheduler.{name} must be a list of lrs; got {short_repr(sched[name])}")
            for i, lr in enumerate(sched[name]):
                _typed(f"scheduler.{name}[{i}]", lr, float, rule)
    for name in ("last_epoch", "_step_count"):
        if name in sched:
            _typed(f"scheduler.{name}", sched[name], int, _COUNT_RULE)


def checked_aqn(aqn: dict):
    """The AQN a checkpoint's AQN state describes, built by AQN's constructor (its rules: stages >= 3,
    total_steps >= stages, sigmas in (0, 10], a known resample mode...), with its generator state loaded."""
    from qerl_kit.aqn import AQN

    if not (isinstance(aqn.get("config"), dict) and isinstance(aqn.get("generator"), torch.Tensor)):
        raise ConfigError(f"aqn must hold 'config' (the schedule) and 'generator' (a uint8 tensor); got keys "
                          f"{short_repr(sorted(map(str, aqn)))}")
    config = aqn["config"]
    unknown = sorted(str(k) for k in config if k not in _AQN_TYPES)
    if unknown:
        raise ConfigError(f"aqn.config has unknown keys {short_repr(unknown)}; allowed: {', '.join(_AQN_TYPES)}")
    for name, value in config.items():
        _typed(f"aqn.config.{name}", value, _AQN_TYPES[name], None)
    # the order sigma_end <= sigma_start is not checked here: a run may have allowed growing noise (the
    # resumed AQN keeps the allow_increasing of the config it is built with)
    built = AQN(**{"allow_increasing": True, **config})
    built._generator.set_state(aqn["generator"])
    return built


def check_values(state: dict, path) -> None:
    """The values inside a trainer state (its keys and types already checked by ``check_state``)."""
    if "config" in state:
        config = json.loads(state["config"])
        total, optim = config.get("total_steps"), config.get("optim")
        # a constant schedule may train on past total_steps (optim.steps_to_run); the others end there
        constant = isinstance(optim, dict) and optim.get("schedule") == "constant"
        if isinstance(total, int) and state["step"] > total and not constant:
            raise CheckpointError(f"{path}: 'step' must be <= the run's total_steps = {total}; got "
                                  f"{short_repr(state['step'])}: the file is damaged")
    history = json.loads(state["history"])  # a row per step: the last one's step is the state's
    last = history[-1].get("step") if history and isinstance(history[-1], dict) else 0
    if last != state["step"]:
        raise CheckpointError(f"{path}: 'step' is {short_repr(state['step'])} but the last row of its 'history' "
                              f"is step {short_repr(last)}: the file is damaged")
    with _named(path, "optimizer"):
        _optimizer_values(state["optimizer"])
    with _named(path, "scheduler"):
        _scheduler_values(state["scheduler"])
    with _named(path, "rng.torch"):
        torch.Generator().set_state(state["rng"]["torch"])
    with _named(path, "rng.python"):
        random.Random().setstate(_to_tuple(state["rng"]["python"]))
    if state["aqn"] is not None:
        with _named(path, "aqn"):
            checked_aqn(state["aqn"])


def _scheduler_structure(saved: dict, scheduler) -> None:
    """What ``LambdaLR.load_state_dict`` would take silently but is not its state: the keys that define
    where the schedule is missing (it would restart; other keys may differ between torch versions),
    attributes a scheduler state never holds (``optimizer``), lists of another length than this trainer's."""
    live = scheduler.state_dict()
    missing = sorted(k for k in ("base_lrs", "last_epoch", "_last_lr", "lr_lambdas") if k in live and k not in saved)
    foreign = sorted(k for k in saved if k not in live and hasattr(scheduler, k))
    if missing or foreign:
        raise ConfigError(f"scheduler lacks {short_repr(missing)}" if missing else
                          f"scheduler sets {short_repr(foreign)}, which a scheduler state never holds")
    for name in ("base_lrs", "_last_lr", "lr_lambdas"):
        if name in live and (saved[name] != live[name] if name == "lr_lambdas" else
                             len(saved[name]) != len(live[name])):
            raise ConfigError(f"scheduler.{name} must be like this trainer's ({short_repr(live[name])}); "
                              f"got {short_repr(saved[name])}")


def _optimizer_flags(saved: dict, optimizer) -> None:
    """The optimizer's switches (``maximize``: gradient ascent, ``amsgrad``...) as the live optimizer has them."""
    for i, (group, live) in enumerate(zip(saved["param_groups"], optimizer.param_groups)):
        for name, value in live.items():
            if isinstance(value, bool) and name in group and group[name] != value:
                raise ConfigError(f"optimizer.param_groups[{i}].{name} must be {value} as this trainer's "
                                  f"optimizer has it; got {short_repr(group[name])}")


def restore(state: dict, checkpoint: str | Path, model, optimizer, scheduler, aqn=None,
            total_steps: int | None = None, schedule: str | None = None) -> None:
    """Load a checked trainer state (``checkpoint.load_state``) and the checkpoint's adapter into a
    trainer's objects, all or nothing: a failure is a ``CheckpointError`` naming the file and the key,
    and what was loaded before it is put back. ``total_steps``: this run's (a checkpoint past it has
    nothing left to train, unless ``schedule`` is "constant", whose lr goes on past it)."""
    path = Path(checkpoint) / STATE_FILE
    if total_steps is not None and state["step"] > total_steps and schedule != "constant":
        raise CheckpointError(f"{path}: 'step' is {state['step']}, past this run's total_steps = {total_steps}: "
                              "raise total_steps to train on from it")
    with _named(path, "optimizer"):
        _optimizer_flags(state["optimizer"], optimizer)
    with _named(path, "scheduler"):
        _scheduler_structure(state["scheduler"], scheduler)
    before = (optimizer.state_dict(), scheduler.state_dict(), rng_state(), aqn.state_dict() if aqn else None)
    try:
        with _named(path, "optimizer"):
            optimizer.load_state_dict(state["optimizer"])
        with _named(path, "scheduler"):
            scheduler.load_state_dict(state["scheduler"])
        with _named(path, "rng"):
            set_rng_state(state["rng"])
        if aqn is not None and state["aqn"] is not None:
            with _named(path, "aqn"):
                built = checked_aqn(state["aqn"])  # values coerced as the constructor coerces them
                aqn.load_state_dict({"config": {k: getattr(built, k) for k in state["aqn"]["config"]},
                                     "generator": state["aqn"]["generator"]})
        load_adapter_weights(model, checkpoint)
    except BaseException:
        optimizer.load_state_dict(before[0])
        scheduler.load_state_dict(before[1])
        set_rng_state(before[2])
        if aqn is not None:
            aqn.load_state_dict(before[3])
        raise
