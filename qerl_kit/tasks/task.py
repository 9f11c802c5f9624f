"""``Task``: what an RL run trains on, in one object.

A task is data: its training rows, its held-out rows, its reward functions, the function that
turns a row into the prompt text the policy sees, and which reward counts as "correct". The
Trainer, the evaluation (``qerl_kit.evaluate.evaluate_task(task, model, tokenizer)``, a function
over a task), the demo, the experiment grid and the notebooks all take a Task, so a prompt is
rendered the same way everywhere (``task.prompt(tokenizer, row)``) and tokenized once
(``task.encode(tokenizer, rows)`` -> ``qerl_kit.rollout.Prompts``); the completions are scored
the same way too (``qerl_kit.scoring``).

Rows are dicts with at least a ``prompt`` (the question) column; every other column (``answer``,
``level``, ...) reaches the reward functions as a keyword argument, as in TRL. Every row of a split
has the same columns (``qerl_kit.data.check_columns``, checked here and when a file loads).

A task is checked when it is made, so a mistake is named there rather than at a later training
step: each split a list of rows whose ``prompt`` is a non-empty string (``qerl_kit.data.check_rows``:
never one dict, whose keys would be the rows, nor a string); ``rewards`` one callable or a list of
them (a string is named as given); ``max_new_tokens`` None or an int >= 1 (the rule of every
completion budget, ``config_types.NEW_TOKENS_RULE``). Errors start with ``task '<name>':``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Iterable, Mapping
from typing import Any, Callable, Sequence

from qerl_kit.config_types import NEW_TOKENS_RULE, check_rule, check_value, short_repr
from qerl_kit.data import chat_prompt, check_columns, check_rows

__all__ = ["Task", "chat_prompt"]


def _reward_fns(where: str, rewards: Any) -> tuple[Callable, ...]:
    """One reward function or a list of them, as a non-empty tuple of callables. A string is refused as
    given (iterating it would name its first character), as is a dict (its keys are not functions)."""
    if callable(rewards):
        return (rewards,)
    if isinstance(rewards, (str, bytes, Mapping)) or not isinstance(rewards, Iterable):
        hint = (" (pass the function itself, e.g. qerl_kit.rewards.gsm8k_reward, not its name)"
                if isinstance(rewards, str) else "")
        raise TypeError(f"{where}: rewards must be a reward function (a callable) or a list of them; "
                        f"got {short_repr(rewards)}{hint}")
    fns = tuple(rewards)
    if not fns:
        raise ValueError(f"{where} needs at least one reward function")
    for i, fn in enumerate(fns):
        if not callable(fn):
            raise TypeError(f"{where}: rewards[{i}] must be a callable reward function; got {short_repr(fn)}")
    return fns


@dataclass(frozen=True)
class Task:
    name: str
    train: Sequence[dict]
    eval: Sequence[dict]
    rewards: tuple[Callable, ...]
    prompt_fn: Callable[[Any, dict], str] = chat_prompt
    accuracy_fn: Callable | None = None     # None: the first reward (correct iff its score >= 1)
    max_new_tokens: int | None = None       # a completion budget that fits the task, if it has one
    info: dict = field(default_factory=dict)  # where the rows came from (split sizes, seed, path)

    def __post_init__(self):
        name = check_value("task name", self.name, str)
        where = f"task {name!r}"
        object.__setattr__(self, "rewards", _reward_fns(where, self.rewards))
        if self.accuracy_fn is not None and not callable(self.accuracy_fn):
            raise TypeError(f"{where}: accuracy_fn must be None (the first reward) or a callable reward function; "
                            f"got {short_repr(self.accuracy_fn)}")
        if not callable(self.prompt_fn):
            raise TypeError(f"{where}: prompt_fn must be callable (tokenizer, row) -> str; "
                            f"got {short_repr(self.prompt_fn)}")
        # the shared rule of every completion budget (rollout.max_new_tokens, --max-new-tokens, SamplingParams)
        object.__setattr__(self, "max_new_tokens",
                           check_rule(f"{where}: max_new_tokens", self.max_new_tokens, int | None, NEW_TOKENS_RULE))
        for split in ("train", "eval"):
            value = getattr(self, split)
            rows = check_rows(f"{where}: {split}", [] if split == "eval" and value is None else value)
            object.__setattr__(self, split, rows)
            # one set of columns per split: a batch's columns are taken from its first row
            check_columns((f"{where}: {split} row {i}", row) for i, row in enumerate(rows))

    @property
    def accuracy(self) -> Callable:
        """The reward function whose score decides a correct completion (``qerl_kit.scoring.is_correct``: >= 1)."""
        return self.accuracy_fn or self.rewards[0]

    def prompt(self, tokenizer: Any, row: dict) -> str:
        """The prompt text of one row."""
        text = self.prompt_fn(tokenizer, row)
        if not isinstance(text, str):
            raise TypeError(f"task {self.name!r}: prompt_fn returned {type(text).__name__}, not the prompt text")
        return text

    def encode(self, tokenizer: Any, rows: Sequence[dict]):
        """``Prompts`` (token ids + texts) of these rows: rendered by ``prompt`` and tokenized once."""
        from qerl_kit.rollout.types import Prompts

        return Prompts.encode(tokenizer, [self.prompt(tokenizer, row) for row in rows])

    def longest_prompt(self, tokenizer: Any, sample: int = 2000) -> int:
        """Tokens of the longest prompt among the first ``sample`` train and eval rows, rendered and
        tokenized as the rollouts will be (what an engine's context and KV cache must hold)."""
        rows = list(self.train[:sample]) + list(self.eval[:sample])
        return max(map(len, self.encode(tokenizer, rows).ids), default=0)

    def with_rows(self, train: Sequence[dict] | None = None, eval: Sequence[dict] | None = None) -> "Task":
        """The same task on other rows (a subset, a curriculum)."""
        import dataclasses

        return dataclasses.replace(self, train=self.train if train is None else train,
                                   eval=self.eval if eval is None else eval)

    def __repr__(self) -> str:
        names = ", ".join(getattr(f, "__name__", type(f).__name__) for f in self.rewards)
        return f"Task({self.name!r}, {len(self.train)} train rows, {len(self.eval)} eval rows, rewards [{names}])"
