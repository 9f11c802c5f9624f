"""Scoring completions with a task's reward functions, TRL's way, with errors that name the function.

``reward_scores(fn, kwargs, n)`` is the one way a reward function is called, in training and in
evaluation (``qerl_kit.evaluate``, so ``Trainer.evaluate`` and ``qerl eval`` too): ``fn(**kwargs)``
with TRL's keyword arguments, an exception it raises re-raised as a ``RewardError`` naming it (the
original chained as the cause), and what it returns checked by ``checked_scores``: a sequence of
exactly ``n`` scores, each a finite number or None ("not applicable"). A dict, a set, a string,
None, NaN, inf or a wrong count is an error naming the function, never a score.

``score_rollouts(task, rows, rollouts, group_size)`` calls every reward function that way with
TRL's keyword arguments (``prompts``, ``completions``, ``completion_ids`` and each other dataset
column as a list aligned with the completions), combines them (``grpo.combine_rewards``) and says
which completions are correct (the task's accuracy reward >= 1).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Set

import torch

from qerl_kit import grpo
from qerl_kit.config_types import short_repr
from qerl_kit.finite import finite_score

__all__ = ["RewardError", "checked_scores", "reward_scores", "score_rollouts"]


class RewardError(RuntimeError):
    """A reward function raised; the message names it, the original exception is the ``__cause__``."""


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def reward_scores(fn, kwargs: dict, n: int) -> list:
    """``fn(**kwargs)``'s ``n`` checked scores; an exception of ``fn`` becomes a ``RewardError``
    naming it and the first completion it was scoring."""
    try:
        scores = fn(**kwargs)
    except Exception as err:
        first = (kwargs.get("completions") or [None])[0]
        raise RewardError(f"reward function {_name(fn)!r} raised {short_repr(err, 60)} on a batch of {n} completions "
                          f"(the first: {short_repr(first, 60)})") from err
    return checked_scores(fn, scores, n)


def checked_scores(fn, scores, n: int) -> list:
    """A reward function's scores, one per completion, or an error that names the function."""
    name = _name(fn)
    if scores is None:
        raise TypeError(f"reward function {name!r} returned None; it must return one score (a float, or None "
                        f"for 'not applicable') per completion: a list of {n}")
    if isinstance(scores, torch.Tensor):
        scores = scores.tolist()
    if isinstance(scores, (str, bytes, Mapping, Set)):  # iterable, but their items are no scores in order
        raise TypeError(f"reward function {name!r} returned a {type(scores).__name__} ({short_repr(scores, 60)}), not a "
                        f"list of {n} scores (a float, or None for 'not applicable', per completion, in order)")
    try:
        scores = list(scores)
    except TypeError:
        raise TypeError(f"reward function {name!r} returned {type(scores).__name__}, not a list of "
                        f"{n} scores") from None
    if len(scores) != n:
        raise ValueError(f"reward function {name!r} returned {len(scores)} scores for {n} completions; "
                         "it must return exactly one per completion")
    for i, s in enumerate(scores):
        if isinstance(s, numbers.Real) and not isinstance(s, (int, float)):  # numpy's float32, int64 ...
            s = scores[i] = float(s)
        if s is not None and not isinstance(s, (int, float)):
            raise TypeError(f"reward function {name!r} returned a score of type {type(s).__name__} ({short_repr(s, 60)}) "
                            f"for completion {i}; scores are floats, or None for 'not applicable'")
        if s is not None:  # NaN, inf or an int too large: an error naming the function, never reward=inf
            finite_score(s, f"reward function {name!r}'s score for completion {i}")
    return scores


def score_rollouts(task, rows: list[dict], rollouts, group_size: int) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """(rewards [B], ``rewards/<fn>/mean|std`` metrics, correct [B] as 0/1 floats) of rollouts of ``rows``."""
    columns = {k: [row[k] for row in rows for _ in range(group_size)] for k in rows[0] if k != "prompt"}
    kwargs = dict(prompts=rollouts.prompts, completions=rollouts.texts,
                  completion_ids=rollouts.completion_id_lists(), **columns)
    n = len(rollouts.texts)
    per_fn, metrics = [], {}
    for fn in task.rewards:
        scores = reward_scores(fn, kwargs, n)
        per_fn.append(scores)
        vals = torch.tensor([float("nan") if s is None else float(s) for s in scores])
        name = getattr(fn, "__name__", type(fn).__name__)
        metrics[f"rewards/{name}/mean"] = vals.nanmean().item()
        metrics[f"rewards/{name}/std"] = vals[~vals.isnan()].std().item() if (~vals.isnan()).sum() > 1 else 0.0
    rewards = grpo.combine_rewards(per_fn, names=[getattr(fn, "__name__", type(fn).__name__) for fn in task.rewards])
    acc = task.accuracy
    acc_scores = per_fn[task.rewards.index(acc)] if acc in task.rewards else reward_scores(acc, kwargs, n)
    correct = torch.tensor([1.0 if (s is not None and s >= 1.0) else 0.0 for s in acc_scores])
    return rewards, metrics, correct
