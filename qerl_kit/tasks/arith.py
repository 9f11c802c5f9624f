"""Synthetic multi-step arithmetic word problems in the shape of GSM8K, with held-out splits.

A problem of *level* k is a start value and k operations on it, told as a short story::

    Ann has 7 apples. She buys 5 more. She gives away 3. She doubles them.
    How many apples does she have now?

and its worked solution shows one line per operation and ends, as GSM8K's do, in ``#### N``::

    7+5=12
    12-3=9
    9*2=18
    #### 18

so ``qerl_kit.rewards.gsm8k_reward`` scores model output against the row's ``answer`` ("18").

Design:

- Operations: add 1..19 ("buys/gets/finds N more"), subtract ("gives away/loses/sells N"), double
  or triple ("doubles/triples them") and halve an even value ("gives away half of them"). Every
  intermediate value stays in 1..99, so each step is one- or two-digit arithmetic that a small
  character-level model can learn, and no operation leaves the value unchanged (a solution that
  skips a step never lands on the right answer by accident).
- Names (with their pronoun), objects and phrasings are drawn at random; they do not change the
  arithmetic.
- Splits are disjoint by construction: a problem's *skeleton* (start value and the operations with
  their amounts) is hashed, and the hash alone puts it in ``"test"`` (``TEST_PERCENT`` percent of
  skeletons) or ``"train"``. So no held-out question, nor any rewording of one, is in the train
  split. Within a split, ``make_dataset`` never repeats a question.
- ``make_dataset(split, n, seed, levels)`` is deterministic in its arguments (a string-seeded
  ``random.Random`` stream, independent of ``PYTHONHASHSEED``) and cycles through ``levels``, so
  every level gets ``n / len(levels)`` rows.
- ``careless_solution`` is the training-data noise that calibrates the shipped tiny model
  (``scripts/train_tiny.py``, ``docs/tiny-model.md``): with a probability per level it skips the
  last operation and reports the value before it, a "forgot the last step" slip. The rows that
  ``make_dataset`` returns are always clean.

Rows are ``{"prompt", "answer", "solution", "level"}``, the keys of ``qerl_kit.data.load_gsm8k`` rows
(plus the level).
"""

from __future__ import annotations

import hashlib
import random
from typing import Iterable, Sequence

from qerl_kit.config_types import short_repr

__all__ = ["LEVELS", "SPLITS", "TEST_PERCENT", "PROMPT_SUFFIX", "make_problem", "make_dataset", "split_of",
           "careless_solution", "skeleton_key"]

LEVELS: tuple[int, ...] = (1, 2, 3, 4)
# The instruction after the question in this task's prompts (``qerl_kit.tasks.arith_prompt``): none.
# The tiny model saw prompts with and without GSM8K's suffix; without it prompts are ~70 tokens
# shorter, so rollouts are faster.
PROMPT_SUFFIX = ""
SPLITS = ("train", "test")
TEST_PERCENT = 20          # share of skeletons (not of rows) that belong to the held-out split
MAX_VALUE = 99             # every intermediate value stays in 1..MAX_VALUE
MAX_AMOUNT = 19            # amounts added or subtracted are 1..MAX_AMOUNT

_NAMES = {"she": ("Ann", "Eve", "Fay", "Ivy", "Kim", "Mia", "Pam", "Sue", "Uma", "Zoe", "Amy", "Liz"),
          "he": ("Ben", "Cal", "Dan", "Gus", "Hal", "Max", "Ned", "Ray", "Sam", "Tom", "Wes", "Jim")}
_OBJECTS = ("apples", "pens", "coins", "cards", "eggs", "books", "shells", "stamps", "marbles",
            "cookies", "stickers", "beads")
_ADD = ("{P} buys {a} more.", "{P} gets {a} more.", "{P} finds {a} more.")
_SUB = ("{P} gives away {a}.", "{P} loses {a}.", "{P} sells {a}.")
_MUL = {2: "{P} doubles them.", 3: "{P} triples them."}
_HALF = "{P} gives away half of them."

# An operation is (symbol, amount): ("+", 5), ("-", 3), ("*", 2), ("/", 2).
Op = tuple[str, int]


def _apply(v: int, op: Op) -> int:
    sym, a = op
    return {"+": v + a, "-": v - a, "*": v * a, "/": v // a}[sym]


def _random_op(rng: random.Random, v: int) -> Op:
    """One operation whose result stays in 1..MAX_VALUE and differs from ``v``."""
    while True:
        r = rng.random()
        if r < 0.35:
            op = ("+", rng.randint(1, MAX_AMOUNT))
        elif r < 0.70:
            if v < 2:
                continue
            op = ("-", rng.randint(1, min(MAX_AMOUNT, v - 1)))
        elif r < 0.90:
            op = ("*", rng.choice((2, 3)))
        else:
            if v % 2:
                continue
            op = ("/", 2)
        if 1 <= _apply(v, op) <= MAX_VALUE:
            return op


def skeleton_key(start: int, ops: Sequence[Op]) -> str:
    """Canonical text of a problem's arithmetic, e.g. ``"7|+5|-3|*2"`` (what the split hashes)."""
    return "|".join([str(start)] + [f"{s}{a}" for s, a in ops])


def split_of(start: int, ops: Sequence[Op]) -> str:
    """``"test"`` or ``"train"``, a pure function of the skeleton (never of wording or seed)."""
    h = int.from_bytes(hashlib.sha256(skeleton_key(start, ops).encode()).digest()[:8], "big")
    return "test" if h % 100 < TEST_PERCENT else "train"


def _story(rng: random.Random, start: int, ops: Sequence[Op]) -> str:
    pron = rng.choice(("she", "he"))
    name, obj = rng.choice(_NAMES[pron]), rng.choice(_OBJECTS)
    P = pron.capitalize()
    parts = [f"{name} has {start} {obj}."]
    for sym, a in ops:
        if sym == "+":
            parts.append(rng.choice(_ADD).format(P=P, a=a))
        elif sym == "-":
            parts.append(rng.choice(_SUB).format(P=P, a=a))
        elif sym == "*":
            parts.append(_MUL[a].format(P=P))
        else:
            parts.append(_HALF.format(P=P))
    parts.append(f"How many {obj} does {pron} have now?")
    return " ".join(parts)


def _solution(start: int, ops: Sequence[Op]) -> tuple[str, int]:
    lines, v = [], start
    for op in ops:
        r = _apply(v, op)
        lines.append(f"{v}{op[0]}{op[1]}={r}")
        v = r
    return "\n".join(lines + [f"#### {v}"]), v


def _check_level(level, key: str = "level") -> int:
    """A level this generator makes: one of ``LEVELS`` (the operations a story holds), an int, never a
    bool; the tiny model was trained and calibrated on exactly these (``docs/tiny-model.md``)."""
    if isinstance(level, bool) or not isinstance(level, int) or level not in LEVELS:
        each = "each be" if key == "levels" else "be"
        raise ValueError(f"arith {key} must {each} one of {LEVELS} (operations per story); got {short_repr(level)}")
    return level


def make_problem(rng: random.Random, level: int) -> tuple[dict, str]:
    """One random problem of ``level`` operations and the split its skeleton belongs to."""
    _check_level(level)
    start = rng.randint(2, 20)
    ops, v = [], start
    for _ in range(level):
        op = _random_op(rng, v)
        ops.append(op)
        v = _apply(v, op)
    solution, answer = _solution(start, ops)
    row = {"prompt": _story(rng, start, ops), "answer": str(answer), "solution": solution,
           "level": level}
    return row, split_of(start, ops)


def make_dataset(split: str = "train", n: int = 256, seed: int = 0,
                 levels: Iterable[int] = LEVELS) -> list[dict]:
    """``n`` distinct problems of ``split`` ("train" or "test"), levels cycling through ``levels``.

    Deterministic in (split, n, seed, levels); a prefix of a longer list for the same arguments
    but ``n``. ``n`` is an int >= 0 and every level one of ``LEVELS`` (a ``ValueError`` otherwise,
    as ``countdown.make_dataset`` refuses its levels).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {short_repr(split)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:  # 2.5 or -1 would give 3 rows or none, silently
        raise ValueError(f"arith n must be an int >= 0 (the number of rows); got {short_repr(n)}")
    if isinstance(levels, (str, bytes)) or not isinstance(levels, Iterable):
        raise ValueError(f"arith levels must be a list of levels from {LEVELS}; got {short_repr(levels)}")
    levels = tuple(levels)
    if not levels:
        raise ValueError(f"arith levels must be a non-empty list of levels from {LEVELS}; got []")
    for level in levels:
        _check_level(level, "levels")
    rng = random.Random(f"qerl-arith:{split}:{seed}")
    rows: list[dict] = []
    seen: set[str] = set()
    misses = 0
    while len(rows) < n:
        level = levels[len(rows) % len(levels)]
        row, where = make_problem(rng, level)
        if where != split or row["prompt"] in seen:
            misses += 1
            if misses > 100 * n + 10_000:
                raise ValueError(f"could not find {n} distinct {split} problems of levels {levels}")
            continue
        seen.add(row["prompt"])
        rows.append(row)
    return rows


def careless_solution(row: dict, rng: random.Random, p_skip: float) -> str:
    """The row's solution, or with probability ``p_skip`` (levels >= 2 only) the same working with
    the last operation left out and the value before it as the final answer (a wrong answer)."""
    if row["level"] < 2 or rng.random() >= p_skip:
        return row["solution"]
    lines = row["solution"].split("\n")
    steps = lines[:-1]
    kept = steps[:-1]
    return "\n".join(kept + [f"#### {kept[-1].rsplit('=', 1)[1]}"])
