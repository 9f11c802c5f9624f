"""The adapter's optimizer and learning-rate schedule, from ``OptimConfig``."""

from __future__ import annotations

import math
from typing import Callable

import torch

__all__ = ["make_optimizer", "lr_lambda"]


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
