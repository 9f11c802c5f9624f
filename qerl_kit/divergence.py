"""A run that diverges says so: reward collapsing while the policy's entropy explodes.

Seen with ``lr: 10``: reward 0.469 -> 0 -> 0 -> 0 while entropy went 0.021 -> 2.06 and every
completion ran to the token limit; nothing was said. ``divergence_warning(history)`` is a pure
function of the metric rows (``reward`` and ``entropy`` per step); the trainer calls it after every
step and, on the step where the pattern first appears, warns (``RuntimeWarning``) and puts the
message in that step's row as ``warning`` (so ``metrics.jsonl`` holds it too).

The rule, over the last ``WINDOW`` steps (the current one included):

* reward collapse: the best reward of the earlier steps is at least ``MIN_PEAK_REWARD`` (there was
  something to lose) and the current reward is at most ``REWARD_DROP`` times it;
* entropy explosion: the current entropy is at least ``ENTROPY_RISE`` times the lowest entropy of
  the earlier steps and at least ``MIN_ENTROPY_RISE`` nats above it (a rise from 0.01 to 0.05 is
  noise, not divergence).

Both must hold. A collapse without the entropy rise (a task gone hard, a reward bug) or entropy
rising while the reward holds (exploration) is not flagged.
"""

from __future__ import annotations

import math
import warnings
from typing import Sequence

__all__ = ["WINDOW", "MIN_PEAK_REWARD", "REWARD_DROP", "ENTROPY_RISE", "MIN_ENTROPY_RISE", "diverging",
           "divergence_warning", "note"]

WINDOW = 5               # steps looked at, the current one included
MIN_PEAK_REWARD = 0.1    # an earlier reward at least this high
REWARD_DROP = 0.25       # current reward <= this share of that peak
ENTROPY_RISE = 3.0       # current entropy >= this many times the earlier minimum
MIN_ENTROPY_RISE = 0.5   # ... and at least this many nats above it


def _num(row: dict, key: str) -> float | None:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def diverging(history: Sequence[dict], i: int = -1) -> tuple[float, float, float, float] | None:
    """(peak reward, current reward, lowest entropy, current entropy) if step ``i`` of ``history``
    shows the collapse-and-explosion pattern over its window, else None."""
    i = i % len(history) if history else 0
    if not history or i == 0:
        return None
    now, earlier = history[i], history[max(0, i - WINDOW + 1):i]
    reward, entropy = _num(now, "reward"), _num(now, "entropy")
    rewards = [r for r in (_num(row, "reward") for row in earlier) if r is not None]
    entropies = [e for e in (_num(row, "entropy") for row in earlier) if e is not None]
    if reward is None or entropy is None or not rewards or not entropies:
        return None
    peak, low = max(rewards), min(entropies)
    collapsed = peak >= MIN_PEAK_REWARD and reward <= REWARD_DROP * peak
    exploded = entropy >= ENTROPY_RISE * low and entropy - low >= MIN_ENTROPY_RISE
    return (peak, reward, low, entropy) if collapsed and exploded else None


def divergence_warning(history: Sequence[dict]) -> str | None:
    """The warning for the last row of ``history`` when the pattern starts there (not on the
    steps after it, which would repeat it), else None."""
    found = diverging(history)
    if found is None or (len(history) > 1 and diverging(history, len(history) - 2) is not None):
        return None
    peak, reward, low, entropy = found
    step = history[-1].get("step", len(history))
    return (f"step {step}: training is diverging: reward fell from {peak:.3g} to {reward:.3g} while entropy rose "
            f"from {low:.3g} to {entropy:.3g} within {WINDOW} steps; the policy is drifting to noise. Lower "
            "optim.lr (or raise loss.beta) and resume from an earlier checkpoint")


def note(history: list[dict], warn: bool = True) -> str | None:
    """The trainer's call after each step: the warning (if any) goes into the last row as
    ``warning`` (written to metrics.jsonl with it) and, with ``warn``, out as a ``RuntimeWarning``."""
    message = divergence_warning(history)
    if message is not None:
        history[-1]["warning"] = message
        if warn:
            warnings.warn(message, RuntimeWarning, stacklevel=3)
    return message
