"""The one prompt-to-reward path's scoring half: what a reward function is given, how it is called,
and which completions are correct, for training and evaluation alike.

The path: a ``Task`` renders each row's prompt (``task.prompt``) and tokenizes the batch once
(``task.encode`` -> ``Prompts``, ids + rendered texts); an engine generates from those ids; the
completions are scored here. ``Trainer`` (collect/score), ``qerl_kit.evaluate.evaluate_task``
(``Trainer.evaluate``, ``qerl eval``, the notebooks, the demo and the experiment grid) all take it.

* ``reward_kwargs(rows, n, completions, completion_ids)``: TRL's keyword arguments, built in one
  place. ``prompts`` is each completion's row's ``prompt`` column, **the question as the dataset
  holds it, not the chat-rendered text**: that is what TRL's GRPOTrainer passes, and it keeps a
  reward independent of the tokenizer's chat template and the task's prompt function (one
  completion of one problem scores the same whichever model or template produced it). The
  rendered text stays on ``Prompts.texts`` / ``Rollouts.prompts``. Every other dataset column
  comes as a list aligned with the completions (``answer=[...]``), with ``completions`` (texts) and
  ``completion_ids`` (lists of ids, stop token included).
* ``reward_scores(fn, kwargs, n)``: ``fn(**kwargs)``, an exception it raises re-raised as a
  ``RewardError`` naming it (the original chained as the cause), and what it returns checked by
  ``checked_scores``: a sequence of exactly ``n`` scores, each a finite number or None ("not
  applicable"). A dict, a set, a string, None, NaN, inf or a wrong count is an error naming the
  function, never a score.
* ``is_correct(score)``: the one correctness rule, ``score >= CORRECT_THRESHOLD`` (1.0) of the
  task's accuracy reward; None ("not applicable") is incorrect. The training ``accuracy`` metric
  and evaluation's pass@1 / pass@k both count with it.
* ``score_rollouts(task, rows, rollouts, group_size)``: training's scoring: every reward function
  of the task, combined (``grpo.combine_rewards``), and which completions are correct.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence, Set

import torch

from qerl_kit import grpo
from qerl_kit.config_types import short_repr
from qerl_kit.finite import finite_score

__all__ = ["CORRECT_THRESHOLD", "RewardError", "accuracy_scores", "checked_scores", "is_correct", "reward_kwargs",
           "reward_scores", "score_rollouts"]

CORRECT_THRESHOLD = 1.0  # a completion is correct iff its accuracy reward is >= this


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


def is_correct(score: float | None) -> bool:
    """The one correctness rule (training accuracy, pass@1, pass@k): the accuracy reward's score is
    >= ``CORRECT_THRESHOLD``; None ("not applicable") is incorrect."""
    return score is not None and score >= CORRECT_THRESHOLD


def reward_kwargs(rows: Sequence[dict], n: int, completions: Sequence[str], completion_ids: Sequence) -> dict:
    """TRL's keyword arguments for the ``len(rows) * n`` completions of ``rows``, each sampled ``n``
    times (group-contiguous): ``prompts`` (each row's ``prompt`` column, the raw question),
    ``completions``, ``completion_ids`` and every other column as a list aligned with them."""
    repeated = [row for row in rows for _ in range(n)]
    columns = [k for k in dict.fromkeys(k for row in rows for k in row) if k != "prompt"]
    return dict(prompts=[row["prompt"] for row in repeated], completions=list(completions),
                completion_ids=list(completion_ids), **{k: [row.get(k) for row in repeated] for k in columns})


def accuracy_scores(task, kwargs: dict, n: int, per_fn: Sequence[list] | None = None) -> list:
    """The scores of ``task.accuracy`` (the reward ``is_correct`` reads), taken from ``per_fn`` (the
    scores of ``task.rewards``, in order) when it is one of them, else called here."""
    acc = task.accuracy
    if per_fn is not None and acc in task.rewards:
        return per_fn[task.rewards.index(acc)]
    return reward_scores(acc, kwargs, n)


def score_rollouts(task, rows: list[dict], rollouts, group_size: int) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """(rewards [B], ``rewards/<fn>/mean|std`` metrics, correct [B] as 0/1 floats) of rollouts of ``rows``."""
    kwargs = reward_kwargs(rows, group_size, rollouts.texts, rollouts.completion_id_lists())
    n = len(rollouts.texts)
    per_fn, metrics = [], {}
    for fn in task.rewards:
        scores = reward_scores(fn, kwargs, n)
        per_fn.append(scores)
        vals = torch.tensor([float("nan") if s is None else float(s) for s in scores])
        metrics[f"rewards/{_name(fn)}/mean"] = vals.nanmean().item()
        metrics[f"rewards/{_name(fn)}/std"] = vals[~vals.isnan()].std().item() if (~vals.isnan()).sum() > 1 else 0.0
    rewards = grpo.combine_rewards(per_fn, names=[_name(fn) for fn in task.rewards])
    correct = torch.tensor([float(is_correct(s)) for s in accuracy_scores(task, kwargs, n, per_fn)])
    return rewards, metrics, correct
