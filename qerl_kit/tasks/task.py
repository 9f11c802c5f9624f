"""``Task``: what an RL run trains on, in one object.

A task is its training rows, its held-out rows, its reward functions, the function that turns a
row into the prompt text the policy sees, and which reward counts as "correct". The Trainer, the
evaluation, the demo, the experiment grid and the notebooks all take a Task, so a prompt is
rendered the same way everywhere (``task.prompt(tokenizer, row)``) and tokenized once
(``task.encode(tokenizer, rows)`` -> ``qerl_kit.rollout.Prompts``).

Rows are dicts with at least a ``prompt`` (the question) column; every other column (``answer``,
``level``, ...) reaches the reward functions as a keyword argument, as in TRL. Every row of a split
has the same columns (``qerl_kit.data.check_columns``, checked here and when a file loads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from qerl_kit.data import chat_prompt, check_columns

__all__ = ["Task", "chat_prompt"]


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
        rewards = (self.rewards,) if callable(self.rewards) else tuple(self.rewards)
        object.__setattr__(self, "rewards", rewards)
        object.__setattr__(self, "train", list(self.train))
        object.__setattr__(self, "eval", list(self.eval or []))
        if not rewards:
            raise ValueError(f"task {self.name!r} needs at least one reward function")
        for fn in rewards + ((self.accuracy_fn,) if self.accuracy_fn is not None else ()):
            if not callable(fn):
                raise TypeError(f"task {self.name!r}: reward functions must be callable; got {fn!r}")
        if not callable(self.prompt_fn):
            raise TypeError(f"task {self.name!r}: prompt_fn must be callable (tokenizer, row) -> str; "
                            f"got {self.prompt_fn!r}")
        for split in ("train", "eval"):
            missing = [i for i, row in enumerate(getattr(self, split)) if "prompt" not in row]
            if missing:
                raise ValueError(f"task {self.name!r}: {split} rows {missing[:5]} have no 'prompt' column")
            # one set of columns per split: a batch's columns are taken from its first row
            check_columns((f"task {self.name!r}: {split} row {i}", row) for i, row in enumerate(getattr(self, split)))

    @property
    def accuracy(self) -> Callable:
        """The reward function whose score >= 1 counts as a correct completion."""
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

    def evaluate(self, model: Any, tokenizer: Any, rows: Sequence[dict] | None = None, **kwargs):
        """``qerl_kit.evaluate.evaluate`` on the held-out rows (or ``rows``) with this task's prompts and
        accuracy reward; keyword arguments as there (samples, temperature, engine, ...)."""
        from qerl_kit.evaluate import evaluate

        rows = self.eval if rows is None else rows
        if not rows:
            raise ValueError(f"task {self.name!r} has no held-out rows to evaluate on; pass rows=")
        if self.max_new_tokens is not None:
            kwargs.setdefault("max_new_tokens", self.max_new_tokens)
        return evaluate(model, tokenizer, rows, self.accuracy, prompt_fn=self.prompt, **kwargs)

    def with_rows(self, train: Sequence[dict] | None = None, eval: Sequence[dict] | None = None) -> "Task":
        """The same task on other rows (a subset, a curriculum)."""
        import dataclasses

        return dataclasses.replace(self, train=self.train if train is None else train,
                                   eval=self.eval if eval is None else eval)

    def __repr__(self) -> str:
        names = ", ".join(getattr(f, "__name__", type(f).__name__) for f in self.rewards)
        return f"Task({self.name!r}, {len(self.train)} train rows, {len(self.eval)} eval rows, rewards [{names}])"
