"""Tasks by name: ``make_task(DataConfig)`` and the registry ``data.dataset`` is checked against.

``TASKS`` maps a name to a factory ``(cfg, seed: int) -> Task``, where ``cfg`` is a
``config.DataConfig`` or anything with its fields (``dataset``, ``eval_dataset``, ``eval_size``,
``train_size``): the tasks sit below the config and never import it; the config reads ``TASKS``
(and the defaults below) to check ``data.dataset``. Built in:

* ``arith``: the synthetic multi-step arithmetic of ``qerl_kit.tasks.arith`` (the shipped tiny
  model's task), ``train_size`` / ``eval_size`` rows generated from ``seed`` with disjoint
  splits, scored by ``gsm8k_reward``, prompted without GSM8K's instruction suffix (the tiny model
  knows both; prompts are ~70 tokens shorter without it);
* ``countdown``: reach a target from 3-5 given numbers with + - * / (``qerl_kit.tasks.countdown``:
  a task that needs search), generated from ``seed`` with disjoint splits, scored exactly by
  ``countdown_reward`` plus a small ``format_reward``;
* ``gsm8k``: GSM8K's train and test splits, read from ``gsm8k_train.jsonl`` / ``gsm8k_test.jsonl``
  in the data folder (``qerl_kit.data.find_data_file``: ``$QERL_DATA``, ``./data``,
  ``../shared/data``; never the hub), the first ``train_size`` train rows, the first ``eval_size``
  test rows held out, ``gsm8k_reward``, 512 new tokens. Only the test file is required: without
  ``gsm8k_train.jsonl`` the task has no training rows (``qerl eval`` is fine with that; the Trainer
  refuses it, naming the missing file);
* ``math500``: MATH-500 from ``math500_test.jsonl`` (train = its first ``train_size`` rows, eval =
  its first ``eval_size``: they overlap, for quick checks), ``math_reward``, MATH's ``\\boxed{}``
  instruction (``math_prompt``), 1024 new tokens;
* and a path to a GSM8K-style ``.jsonl`` file: held out are ``data.eval_dataset``'s first
  ``eval_size`` rows, or else the file's own first ``eval_size`` rows, which are then **not
  trained on** (training takes the rows after them; all of them held out leaves none to train on,
  which ``qerl eval`` is fine with and the Trainer refuses); training takes at most ``train_size``
  rows.

``data.eval_dataset`` is for a ``.jsonl`` dataset only (``DataConfig`` refuses it with a task by name,
which holds out its own split); a file that is not there is an error naming the key and the path.

Prompts: the model's chat template with no system message of ours (so the template's own
default applies: Qwen2.5's "You are Qwen, created by Alibaba Cloud. You are a helpful
assistant."), the question, and the task's instruction suffix (``qerl_kit.data.GSM8K_SUFFIX``:
final answer after "####"; ``MATH_SUFFIX``: in ``\\boxed{}``), as the official QeRL/verl recipes.

A new task is one ``register_task("mine", factory)`` call (docs/architecture.md).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from qerl_kit.tasks.task import Task, chat_prompt

__all__ = ["TASKS", "register_task", "make_task", "task_names", "arith_prompt", "math_prompt"]

# DataConfig's defaults (config.DataConfig reads them): the arithmetic task, 200 held-out problems, 20000 to train on
DEFAULT_TASK, DEFAULT_EVAL_SIZE, DEFAULT_TRAIN_SIZE = "arith", 200, 20000


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


def math_prompt(tokenizer: Any, row: dict) -> str:
    """A MATH problem's prompt: the chat-templated problem with MATH's instruction suffix
    (``\\boxed{}``, which ``math_reward`` reads)."""
    from qerl_kit.data import MATH_SUFFIX

    return chat_prompt(tokenizer, row, suffix=MATH_SUFFIX)


def _gsm8k(cfg, seed: int) -> Task:
    from qerl_kit import rewards
    from qerl_kit.data import find_data_file, load_gsm8k

    test = find_data_file("gsm8k", "test")
    info = {"test": str(test)}
    try:  # evaluation needs only the test split: a missing train file is said when training asks for it
        train_file = find_data_file("gsm8k", "train")
    except FileNotFoundError as err:
        train_file, info["no_train"] = None, f" ({err})"
    else:
        info["train"] = str(train_file)
    train = load_gsm8k(train_file, limit=cfg.train_size) if train_file is not None else []
    return Task("gsm8k", train, load_gsm8k(test, limit=cfg.eval_size), (rewards.gsm8k_reward,), chat_prompt,
                max_new_tokens=512, info=info)


def _math500(cfg, seed: int) -> Task:
    from qerl_kit import rewards
    from qerl_kit.data import find_data_file, load_math500

    path = find_data_file("math500", "test")
    rows = load_math500(path)
    return Task("math500", rows[:cfg.train_size], rows[:cfg.eval_size], (rewards.math_reward,), math_prompt,
                max_new_tokens=1024,
                info={"test": str(path)})


def _jsonl(cfg, seed: int) -> Task:
    from qerl_kit import rewards
    from qerl_kit.data import load_gsm8k

    path = Path(cfg.dataset)
    for key, name in (("data.dataset", cfg.dataset), ("data.eval_dataset", cfg.eval_dataset)):
        if name is not None and not Path(name).is_file():  # both, before reading either
            raise FileNotFoundError(f"{key} {name!r}: no such file")
    rows = load_gsm8k(str(path))
    if cfg.eval_dataset:
        evals, train = load_gsm8k(cfg.eval_dataset, limit=cfg.eval_size), rows
    else:  # held out means never trained on: the first eval_size rows are eval, the rest train
        evals, train = rows[:cfg.eval_size], rows[cfg.eval_size:]
    info = {"path": str(path), "eval": cfg.eval_dataset or f"the first {len(evals)} rows of {path}"}
    if not train:  # fine for `qerl eval`; the Trainer's refusal says why
        info["no_train"] = (f": data.eval_size {cfg.eval_size} holds out all {len(rows)} rows of {path}; lower it "
                            "or set data.eval_dataset")
    return Task(path.stem, train[:cfg.train_size], evals, (rewards.gsm8k_reward,), chat_prompt, max_new_tokens=512,
                info=info)


TASKS: dict[str, Callable[..., Task]] = {"arith": _arith, "countdown": _countdown, "gsm8k": _gsm8k,
                                         "math500": _math500}
# The tasks that read their rows from a data file, so that "all rows" has an end (`qerl eval` without
# --limit scores all of them; a generated task gets data.eval_size's default, its rows have no end).
FILE_TASKS: set[str] = {"gsm8k", "math500"}


def register_task(name: str, factory: Callable[..., Task], from_file: bool = False) -> None:
    """Make ``name`` a value of ``data.dataset``: ``factory(cfg, seed: int)`` returns the Task (``cfg``:
    a ``DataConfig`` or anything with its fields). ``from_file``: its rows come from a data file
    (``FILE_TASKS``), so ``qerl eval`` without ``--limit`` scores all of them."""
    if not isinstance(name, str) or not name or name.endswith(".jsonl"):
        raise ValueError(f"a task name must be a non-empty string not ending in .jsonl; got {name!r}")
    if not callable(factory):
        raise TypeError(f"the factory of task {name!r} must be callable; got {type(factory).__name__}")
    TASKS[name] = factory
    (FILE_TASKS.add if from_file else FILE_TASKS.discard)(name)


def task_names() -> tuple[str, ...]:
    return tuple(TASKS)


def make_task(cfg=None, seed: int = 0) -> Task:
    """The Task ``cfg.dataset`` names (a ``DataConfig``, or anything with its fields; default: the
    arithmetic task with DataConfig's default sizes).

    ``seed`` only picks which synthetic problems are generated; runs that compare training seeds
    keep it fixed so that every run sees the same held-out problems."""
    if cfg is None:
        cfg = SimpleNamespace(dataset=DEFAULT_TASK, eval_dataset=None, eval_size=DEFAULT_EVAL_SIZE,
                              train_size=DEFAULT_TRAIN_SIZE)
    if cfg.dataset in TASKS:
        return TASKS[cfg.dataset](cfg, seed)
    if cfg.dataset.endswith(".jsonl"):
        return _jsonl(cfg, seed)
    raise ValueError(f"data.dataset must be one of {', '.join(repr(n) for n in TASKS)} or a GSM8K-style .jsonl "
                     f"path; got {cfg.dataset!r}")
