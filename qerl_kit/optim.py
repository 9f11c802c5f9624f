"""The adapter's optimizer and learning-rate schedule, from ``OptimConfig``."""

from __future__ import annotations

import math
from typing import Callable

import torch

from qerl_kit.config_types import _bad, check_steps

__all__ = ["make_optimizer", "lr_lambda", "steps_to_run"]


def make_optimizer(params, cfg) -> torch.optim.Optimizer:
    """AdamW (torch's), or bitsandbytes' 8-bit AdamW for ``optimizer="adamw8bit"``."""
    if cfg.optimizer == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as err:
            raise ImportError("optim.optimizer='adamw8bit' needs bitsandbytes: pip install "
                              "'qerl_kit[gpu]' (or pick optimizer='adamw')") from err
        return bnb.optim.AdamW8bit(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def lr_lambda(cfg, total_steps: int) -> Callable[[int], float]:
    """The multiplier of the base lr at each step: linear warm-up, then constant, linear or cosine."""
    warmup = int(cfg.warmup_ratio * total_steps)

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(total_steps - warmup, 1)
        if cfg.schedule == "linear":
            return max(0.0, 1 - frac)
        if cfg.schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        return 1.0
    return fn


def steps_to_run(key: str, config, done: int, steps: int | None) -> int:
    """The steps ``Trainer.train(steps)`` (or ``qerl train --steps``, named by ``key``) runs from step
    ``done`` of ``config`` (a TrainConfig): ``steps`` checked, default up to ``total_steps``.

    A linear or cosine schedule reaches lr 0 at ``total_steps`` (``lr_lambda``), so steps past it
    would run and report success without ever moving the adapter: they are refused, saying which
    steps and how to go on (a constant schedule keeps its lr past ``total_steps``: allowed)."""
    total, schedule = config.total_steps, config.optim.schedule
    if steps is None:
        return total - done
    steps = check_steps(key, steps)
    if schedule != "constant" and done + steps > total:
        raise _bad(key, steps, f"at most {max(total - done, 0)} (this run is at step {done} of total_steps = {total})",
                   f"steps {max(done, total) + 1}..{done + steps} would run at lr 0: the {schedule} schedule decays the "
                   f"lr to 0 at total_steps; raise total_steps or use optim.schedule: constant")
    return steps
