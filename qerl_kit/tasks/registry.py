"""Tasks by name: ``make_task(DataConfig)`` and the registry ``data.dataset`` is checked against.

``TASKS`` maps a name to a factory ``(cfg: DataConfig, seed: int) -> Task``. Built in:

* ``arith``: the synthetic multi-step arithmetic of ``qerl_kit.tasks.arith`` (the shipped tiny
  model's task), ``train_size`` / ``eval_size`` rows generated from ``seed`` with disjoint
  splits, scored by ``gsm8k_reward``, prompted without GSM8K's instruction suffix (the tiny model
  knows both; prompts are ~70 tokens shorter without it);
* ``countdown``: reach a target from 3-5 given numbers with + - * / (``qerl_kit.tasks.countdown``:
  a task that needs search), generated from ``seed`` with disjoint splits, scored exactly by
  ``countdown_reward`` plus a small ``format_reward``;
* ``gsm8k``: GSM8K's train and test splits (``qerl_kit.data.load_gsm8k``), ``gsm8k_reward``;
* ``math500``: MATH-500 (train = eval, for quick checks), ``math_reward``;
* and a path to a GSM8K-style ``.jsonl`` file (held-out rows: ``data.eval_dataset`` or its last
  ``eval_size`` rows).

A new task is one ``register_task("mine", factory)`` call (docs/architecture.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from qerl_kit.tasks.task import Task, chat_prompt

__all__ = ["TASKS", "register_task", "make_task", "task_names", "arith_prompt"]


def arith_prompt(tokenizer: Any, row: dict) -> str:
    """The arithmetic task's prompt: the chat-templated question, no instruction suffix."""
    from qerl_kit.tasks.arith import PROMPT_SUFFIX

    return chat_prompt(tokenizer, row, suffix=PROMPT_SUFFIX)


def _arith(cfg, seed: int) -> Task:
    from qerl_kit import rewards
    from qerl_kit.tasks.arith import make_dataset

    return Task("arith", make_dataset("train", cfg.train_size, seed=seed), make_dataset("test", cfg.eval_size, seed=seed),
                (rewards.gsm8k_reward,), arith_prompt, max_new_tokens=64,
                info={"seed": seed, "train_size": cfg.train_size, "eval_size": cfg.eval_size})


def _countdown(cfg, seed: int) -> Task:
    from qerl_kit.tasks import countdown

    return Task("countdown", countdown.make_dataset("train", cfg.train_size, seed=seed),
                countdown.make_dataset("test", cfg.eval_size, seed=seed),
                (countdown.countdown_reward, countdown.format_reward), countdown.countdown_prompt,
                max_new_tokens=96, info={"seed": seed, "train_size": cfg.train_size, "eval_size": cfg.eval_size})


def _gsm8k(cfg, seed: int) -> Task:
    from qerl_kit import rewards
    from qerl_kit.data import load_gsm8k

    return Task("gsm8k", load_gsm8k("train"), load_gsm8k("test")[:cfg.eval_size], (rewards.gsm8k_reward,),
                chat_prompt, max_new_tokens=512)


def _math500(cfg, seed: int) -> Task:
    from qerl_kit import rewards
    from qerl_kit.data import load_math500

    rows = load_math500("test")
    return Task("math500", rows, rows[:cfg.eval_size], (rewards.math_reward,), chat_prompt, max_new_tokens=512)


def _jsonl(cfg, seed: int) -> Task:
    from qerl_kit import rewards
    from qerl_kit.data import load_gsm8k

    path = Path(cfg.dataset)
    if not path.exists():
        raise FileNotFoundError(f"data.dataset {cfg.dataset!r}: no such file")
    train = load_gsm8k(str(path))
    evals = load_gsm8k(cfg.eval_dataset) if cfg.eval_dataset else train[-cfg.eval_size:]
    return Task(path.stem, train, evals[:cfg.eval_size], (rewards.gsm8k_reward,), chat_prompt,
                info={"path": str(path)})


TASKS: dict[str, Callable[..., Task]] = {"arith": _arith, "countdown": _countdown, "gsm8k": _gsm8k,
                                         "math500": _math500}


def register_task(name: str, factory: Callable[..., Task]) -> None:
    """Make ``name`` a value of ``data.dataset``: ``factory(cfg: DataConfig, seed: int)`` returns the Task."""
    if not isinstance(name, str) or not name or name.endswith(".jsonl"):
        raise ValueError(f"a task name must be a non-empty string not ending in .jsonl; got {name!r}")
    if not callable(factory):
        raise TypeError(f"the factory of task {name!r} must be callable; got {type(factory).__name__}")
    TASKS[name] = factory


def task_names() -> tuple[str, ...]:
    return tuple(TASKS)


def make_task(cfg=None, seed: int = 0) -> Task:
    """The Task ``cfg.dataset`` names (a ``DataConfig``; default: the arithmetic task).

    ``seed`` only picks which synthetic problems are generated; runs that compare training seeds
    keep it fixed so that every run sees the same held-out problems."""
    from qerl_kit.config import DataConfig

    cfg = cfg if cfg is not None else DataConfig()
    if cfg.dataset in TASKS:
        return TASKS[cfg.dataset](cfg, seed)
    if cfg.dataset.endswith(".jsonl"):
        return _jsonl(cfg, seed)
    raise ValueError(f"data.dataset must be one of {', '.join(repr(n) for n in TASKS)} or a GSM8K-style .jsonl "
                     f"path; got {cfg.dataset!r}")
