"""Countdown: reach a target from given numbers with + - * / and parentheses, a task that needs search.

A problem gives k numbers and a target::

    Using the numbers 7, 5, 3 and 4, each at most once, with + - * / and parentheses, make 32.

and a correct completion ends in ``#### <expression>``, e.g. ``#### (7+5)*3-4``. Unlike the
arithmetic stories of ``qerl_kit.tasks.arith``, the question does not say which operations to do:
a policy has to try combinations, which is where exploration should pay (issue #28).

Design:

- **Levels** are the number of given numbers: 3, 4 or 5. The target is built from a random
  expression tree over all of them (level 3) or over all but one (levels 4 and 5: one number is a
  distractor that a solution need not use). Numbers are 1..MAX_NUMBER; every intermediate value
  of the building expression is a positive integer (division only where exact) of at most
  MAX_VALUE, no operation leaves a value unchanged (no x1, /1), and the target is
  MIN_TARGET..MAX_TARGET and not one of the given numbers.
  The building expression is the row's ``solution`` (one of possibly many).
- **Rules of scoring** (``score_countdown``): the text after the last ``####`` on its line is parsed
  as an expression of non-negative integers, + - * /, parentheses and blanks (a hand-written
  recursive-descent parser over ``Fraction``; model text is never ``eval``'d), capped at
  MAX_EXPRESSION_CHARS characters and MAX_DEPTH nested parentheses. It scores 1.0 when its exact
  value equals the target and it uses each given number at most as often as it is given (a
  number not given, or one used too often, scores 0.0). Division by zero or any parse error is 0.0.
- ``format_reward`` (the second reward, weight 1 like every task reward, see ``grpo.combine_rewards``):
  0.1 when the completion ends its last ``####`` with a well-formed expression over the given
  numbers, whatever its value: a small signal for the shape of an answer.
- **Splits** are disjoint by construction: a problem's key (sorted numbers and target) is hashed,
  and the hash alone puts it in ``"test"`` (TEST_PERCENT percent of keys) or ``"train"``, so no
  held-out problem, nor any reordering of its numbers, is in the train split. ``make_dataset``
  never repeats a key within a split and is deterministic in its arguments (string-seeded
  ``random.Random``, independent of ``PYTHONHASHSEED``).
- ``solve(numbers, target)`` (exhaustive search over pairs, for tests and analysis) finds a
  solution or says there is none.

Rows are ``{"prompt", "answer", "numbers", "target", "solution", "level"}``; ``numbers`` and
``target`` reach the reward functions as keyword arguments (TRL's convention).
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from fractions import Fraction
from typing import Any, Iterable, Sequence

__all__ = ["LEVELS", "TEST_PERCENT", "make_problem", "make_dataset", "split_of", "problem_key",
           "parse_expression", "score_countdown", "countdown_reward", "format_reward", "solve",
           "countdown_prompt"]

LEVELS: tuple[int, ...] = (3, 4, 5)
TEST_PERCENT = 20
MAX_NUMBER = 12
MAX_VALUE = 999
MIN_TARGET = 10   # smaller targets are mostly one subtraction or division away
MAX_TARGET = 200
MAX_EXPRESSION_CHARS = 200
MAX_DEPTH = 16
OPS = "+-*/"
FORMAT_SCORE = 0.1


# -- the expression parser (linear time; no eval) -------------------------------------------------
class _Parser:
    """expr := term (('+'|'-') term)*; term := atom (('*'|'/') atom)*; atom := INT | '(' expr ')'."""

    def __init__(self, text: str):
        self.s, self.i, self.depth, self.numbers = text, 0, 0, []

    def _peek(self) -> str:
        while self.i < len(self.s) and self.s[self.i] in " \t":
            self.i += 1
        return self.s[self.i] if self.i < len(self.s) else ""

    def expr(self) -> Fraction:
        value = self.term()
        while (c := self._peek()) in ("+", "-"):
            self.i += 1
            rhs = self.term()
            value = value + rhs if c == "+" else value - rhs
        return value

    def term(self) -> Fraction:
        value = self.atom()
        while (c := self._peek()) in ("*", "/"):
            self.i += 1
            rhs = self.atom()
            if c == "*":
                value *= rhs
            elif rhs == 0:
                raise ZeroDivisionError
            else:
                value /= rhs
        return value

    def atom(self) -> Fraction:
        c = self._peek()
        if c == "(":
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise ValueError("too deep")
            self.i += 1
            value = self.expr()
            if self._peek() != ")":
                raise ValueError("missing )")
            self.i += 1
            self.depth -= 1
            return value
        start = self.i
        while self.i < len(self.s) and self.s[self.i].isascii() and self.s[self.i].isdigit():
            self.i += 1
        if self.i == start:
            raise ValueError(f"expected a number at {start}")
        digits = self.s[start:self.i]
        if len(digits) > 4 or (len(digits) > 1 and digits[0] == "0"):
            raise ValueError("not a given number")
        self.numbers.append(int(digits))
        return Fraction(int(digits))


def parse_expression(text: str) -> tuple[Fraction, list[int]] | None:
    """(exact value, the integers it uses, in order) of an expression, or None when it is not one
    (bad character, unbalanced parentheses, division by zero, over the length or depth caps)."""
    text = text.strip()
    if not text or len(text) > MAX_EXPRESSION_CHARS:
        return None
    p = _Parser(text)
    try:
        value = p.expr()
    except (ValueError, ZeroDivisionError, RecursionError):
        return None
    if p._peek() != "":
        return None
    return value, p.numbers


def _answer_expression(completion: Any) -> str | None:
    """The text after the last ``####``, up to the end of its line (``str.rfind``: linear time)."""
    from qerl_kit.rewards import completion_text

    text = completion_text(completion)
    i = text.rfind("####")
    if i < 0:
        return None
    end = text.find("\n", i)
    return text[i + 4:end if end >= 0 else len(text)]


def _check(completion: Any, numbers: Sequence[int]) -> Fraction | None:
    """The value of the completion's answer if it is a well-formed expression over ``numbers``."""
    expr = _answer_expression(completion)
    if expr is None:
        return None
    parsed = parse_expression(expr)
    if parsed is None:
        return None
    value, used = parsed
    if Counter(used) - Counter(int(n) for n in numbers):  # a number not given, or used too often
        return None
    return value


def score_countdown(completion: Any, numbers: Sequence[int], target: int) -> float:
    """1.0 when the completion's ``#### expression`` uses the given numbers (each at most once)
    and equals ``target`` exactly; else 0.0. Never raises on model output."""
    try:
        value = _check(completion, numbers)
    except Exception:  # noqa: BLE001 - model output must never crash a training step
        return 0.0
    return 1.0 if value is not None and value == int(target) else 0.0


def _columns(n: int, numbers, target) -> tuple[list, list]:
    if numbers is None or target is None:
        raise ValueError("countdown rewards need the rows' 'numbers' and 'target' columns")
    if len(numbers) != n or len(target) != n:
        raise ValueError(f"countdown rewards: {n} completions but {len(numbers)} 'numbers' and "
                         f"{len(target)} 'target' values")
    return list(numbers), list(target)


def countdown_reward(prompts: Sequence[Any] | None = None, completions: Sequence[Any] = (),
                     numbers: Sequence[Sequence[int]] | None = None, target: Sequence[int] | None = None,
                     **kwargs: Any) -> list[float]:
    """TRL reward: ``score_countdown`` of each completion against its row's numbers and target."""
    nums, targets = _columns(len(completions), numbers, target)
    return [score_countdown(c, n, t) for c, n, t in zip(completions, nums, targets)]


def format_reward(prompts: Sequence[Any] | None = None, completions: Sequence[Any] = (),
                  numbers: Sequence[Sequence[int]] | None = None, target: Sequence[int] | None = None,
                  **kwargs: Any) -> list[float]:
    """TRL reward: FORMAT_SCORE when the last ``####`` holds a well-formed expression over the given
    numbers (right or wrong), else 0.0."""
    nums, _ = _columns(len(completions), numbers, target)
    out = []
    for c, n in zip(completions, nums):
        try:
            out.append(FORMAT_SCORE if _check(c, n) is not None else 0.0)
        except Exception:  # noqa: BLE001
            out.append(0.0)
    return out


# -- generation -----------------------------------------------------------------------------
def problem_key(numbers: Iterable[int], target: int) -> str:
    return ",".join(map(str, sorted(numbers))) + f"->{target}"


def split_of(numbers: Iterable[int], target: int) -> str:
    """``"test"`` for TEST_PERCENT percent of problem keys, ``"train"`` for the rest (by hash)."""
    h = int.from_bytes(hashlib.sha256(problem_key(numbers, target).encode()).digest()[:8], "big")
    return "test" if h % 100 < TEST_PERCENT else "train"


def _combine(rng: random.Random, a: tuple[int, str], b: tuple[int, str]) -> tuple[int, str] | None:
    """A random operation on two (value, text) operands that keeps the building rules, or None."""
    (x, sx), (y, sy) = a, b
    for op in rng.sample(OPS, len(OPS)):
        if op == "+":
            v = x + y
        elif op == "-":
            if x <= y:
                continue
            v = x - y
        elif op == "*":
            if x == 1 or y == 1:
                continue
            v = x * y
        else:
            if y == 1 or x % y:
                continue
            v = x // y
        if 0 < v <= MAX_VALUE:
            return v, f"({sx}{op}{sy})"
    return None


def _strip_outer(expr: str) -> str:
    """Drop the outermost parentheses of a built expression (always a pair around the whole)."""
    return expr[1:-1] if expr.startswith("(") and expr.endswith(")") else expr


def make_problem(rng: random.Random, level: int) -> dict | None:
    """One problem of ``level`` given numbers, or None when this draw broke a building rule."""
    if level not in LEVELS:
        raise ValueError(f"countdown level {level!r}; allowed: {LEVELS}")
    numbers = [rng.randint(1, MAX_NUMBER) for _ in range(level)]
    used = numbers if level == 3 else rng.sample(numbers, level - 1)
    pool = [(n, str(n)) for n in used]
    rng.shuffle(pool)
    while len(pool) > 1:  # join two random operands until one expression is left
        i, j = rng.sample(range(len(pool)), 2)
        joined = _combine(rng, pool[i], pool[j])
        if joined is None:
            return None
        pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [joined]
    target, expr = pool[0]
    if not MIN_TARGET <= target <= MAX_TARGET or target in numbers:
        return None  # a given number as the target needs no search
    solution = _strip_outer(expr)
    parsed = parse_expression(solution)
    assert parsed is not None and parsed[0] == target, (solution, target)
    return {"numbers": numbers, "target": target, "solution": solution, "level": level}


def question(numbers: Sequence[int], target: int) -> str:
    listed = ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"
    return (f"Using the numbers {listed}, each at most once, with + - * / and parentheses, make {target}. "
            "End with #### and the expression.")


EXHAUSTED_AFTER = 5000  # draws in a row without a new problem of a level: that level is used up


def make_dataset(split: str, n: int, seed: int = 0, levels: Sequence[int] = LEVELS) -> list[dict]:
    """``n`` distinct problems of ``split``, cycling through ``levels``; deterministic in the arguments.

    A level can run out: there are only about 1,800 distinct level-3 problems per split. A level
    that gives no new problem in ``EXHAUSTED_AFTER`` draws in a row is used up and the cycle goes
    on over the others (so a large training pool holds every level-3 problem and more of the
    larger levels); when every level is used up, a ``ValueError`` says how many were found."""
    if split not in ("train", "test"):
        raise ValueError(f"countdown split {split!r}; allowed: train, test")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"countdown n must be an int >= 0; got {n!r}")
    levels = tuple(levels)
    for lv in levels:
        if lv not in LEVELS:
            raise ValueError(f"countdown level {lv!r}; allowed: {LEVELS}")
    rng = random.Random(f"countdown/{split}/{seed}/{levels}")
    rows, seen = [], set()
    live, misses, turn = list(levels), dict.fromkeys(levels, 0), 0
    while len(rows) < n:
        if not live:
            raise ValueError(f"countdown n={n}: only {len(rows)} distinct {split} problems exist at levels {levels}")
        level = live[turn % len(live)]
        p = make_problem(rng, level)
        key = None if p is None else problem_key(p["numbers"], p["target"])
        if key is None or key in seen or split_of(p["numbers"], p["target"]) != split:
            misses[level] += 1
            if misses[level] >= EXHAUSTED_AFTER:
                live.remove(level)
            continue
        misses[level] = 0
        turn += 1
        seen.add(key)
        rows.append({"prompt": question(p["numbers"], p["target"]), "answer": str(p["target"]), **p})
    return rows


def countdown_prompt(tokenizer: Any, row: dict) -> str:
    """The task's prompt: the chat-templated question, no GSM8K instruction suffix."""
    from qerl_kit.tasks.task import chat_prompt

    return chat_prompt(tokenizer, row, suffix="")


# -- exhaustive search ------------------------------------------------------------------------
def solve(numbers: Sequence[int], target: int) -> str | None:
    """An expression over a subset of ``numbers`` (each at most once) equal to ``target``, or None.
    Exhaustive over pairs of operands (fine for up to 5 numbers)."""
    target = Fraction(target)
    seen: set = set()

    def search(items: tuple) -> str | None:
        for v, s in items:
            if v == target:
                return s
        key = tuple(sorted(v for v, _ in items))
        if key in seen or len(items) < 2:
            return None
        seen.add(key)
        for i in range(len(items)):
            for j in range(len(items)):
                if i == j:
                    continue
                (x, sx), (y, sy) = items[i], items[j]
                rest = tuple(it for k, it in enumerate(items) if k not in (i, j))
                cands = [(x + y, f"({sx}+{sy})"), (x - y, f"({sx}-{sy})"), (x * y, f"({sx}*{sy})")]
                if y != 0:
                    cands.append((x / y, f"({sx}/{sy})"))
                for c in cands:
                    found = search(rest + (c,))
                    if found is not None:
                        return found
        return None

    found = search(tuple((Fraction(n), str(n)) for n in numbers))
    return None if found is None else _strip_outer(found)
