"""Verifiable rewards for math RL: GSM8K numbers, MATH ``\\boxed{}`` answers, output format.

Every ``*_reward`` function has TRL's reward-function signature
``fn(prompts, completions, **columns) -> list[float | None]``: dataset columns arrive as lists
aligned with ``completions`` (``answer=[...]``), unknown keyword arguments (``completion_ids``,
``trainer_state``, ``log_extra`` ...) are ignored, and completions/prompts may be plain strings or
conversational ``[{"role": "assistant", "content": ...}]`` lists. ``None`` means "not applicable"
(the gold answer itself is unusable), as in TRL.

- ``gsm8k_reward``: final number of the completion (``#### N`` > ``\\boxed{N}`` > ``<answer>N</answer>``
  > last number) equals the gold number, compared exactly as ``fractions.Fraction``
  ("1,000" == "$1000" == "1000.0"; "0.75" == "3/4"; "0.333" != "1/3").
- ``math_reward``: last ``\\boxed{}``/``\\fbox{}`` of the completion vs. the gold answer (a bare answer or
  a full solution holding ``\\boxed``): normalized string equality first, then an exact number
  comparison for a numeric gold, else math-verify.
- ``format_reward`` / ``make_format_reward``: regex format checks (``#### N`` final line by default,
  or ``<think>...</think><answer>...</answer>``).

Deviations from TRL / official QeRL:

- The official QeRL eval compared only the FIRST CHARACTER of the answer ("75" matched gold "72").
  We compare whole numbers exactly (tests pin "75" vs "72" -> 0).
- TRL's ``accuracy_reward`` parses the whole completion with math-verify; ``math_reward`` requires a
  ``\\boxed{}`` (no box -> 0.0) and skips math-verify when the normalized strings already agree.
- math-verify's timeouts use ``signal.alarm``, which only works in the main thread. Called from any
  other thread (POSIX), the comparison runs in a helper subprocess with a hard deadline, so it
  neither crashes nor hangs. Predicted answers longer than ``MAX_ANSWER_CHARS`` score 0.0.
- Malformed model output never raises: it scores 0.0. Missing/misaligned columns (a caller bug) raise.

Time bounds: every reward, parser and format pattern here runs in time linear in its input (no
regex can backtrack super-linearly: possessive quantifiers / atomic groups, or plain ``str`` scans).
The completion is never truncated. Two length caps bound the work that is not linear:
``parse_number`` rejects cleaned number strings longer than ``MAX_NUMBER_CHARS`` (4300, Python's
default ``int(str)`` digit limit), and math-verify is never handed an answer (gold or predicted)
longer than ``MAX_ANSWER_CHARS``; its own run time is bounded by its timeouts. ``<answer>`` contents
longer than ``ANSWER_TAG_MAX_CHARS`` are not answer tags (as before). ``tests/test_rewards_adversarial.py``
times every public function on 10^5 and 10^6 character adversarial completions (docs/rewards.md,
"Time bounds"). A custom regex given to ``make_format_reward`` is the caller's responsibility.

Model text never reaches eval/exec or sympy's ``parse_expr``: a numeric gold is compared with the number
the box states (model arithmetic such as ``2*3+1`` is not evaluated), and for other golds the box goes to
math-verify's LaTeX parser only (``qerl_kit.math_equiv``). ``math_reward`` scores each distinct
(completion, gold) pair once and stops running math-verify past ``BUDGET_S`` seconds per call.
math-verify is imported lazily (``pip install math-verify`` or the ``qerl_kit[rewards]`` extra).
"""

from __future__ import annotations

import logging
import math
import re
import time
from fractions import Fraction
from itertools import accumulate, repeat
from typing import Any, Callable, Sequence

from qerl_kit.math_equiv import MAX_ANSWER_CHARS, PARSING_TIMEOUT, VERIFY_TIMEOUT, math_verify_equal

__all__ = [
    "gsm8k_reward", "math_reward", "format_reward", "think_format_reward", "make_format_reward",
    "score_gsm8k", "score_math", "extract_gsm8k_answer", "parse_number", "last_boxed",
    "completion_text", "FORMAT_PATTERNS", "MAX_ANSWER_CHARS", "BUDGET_S", "MAX_NUMBER_CHARS", "ANSWER_TAG_MAX_CHARS",
]

logger = logging.getLogger(__name__)

MAX_NUMBER_CHARS = 4300  # parse_number: longer (cleaned) number strings are not numbers (None)
ANSWER_TAG_MAX_CHARS = 2000  # <answer>...</answer> contents longer than this are not answer tags
# math-verify seconds one math_reward call may spend (all completions together); see math_reward
BUDGET_S = 10.0
_clock = time.monotonic  # a seam for tests
RewardFn = Callable[..., "list[float | None]"]

# ----------------------------------------------------------------------------- text helpers

def completion_text(x: Any) -> str:
    """Plain text of a completion or prompt: a string, a message dict, or a list of messages.

    For conversational input the assistant messages are joined (all messages if none is an
    assistant's); list-of-parts content (``[{"type": "text", "text": ...}]``) is flattened.
    """
    if x is None:
        return ""
    if isinstance(x, str):
        return x
    if isinstance(x, dict):
        c = x.get("content", x.get("text", ""))
        if isinstance(c, (list, tuple)):
            return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in c)
        return "" if c is None else str(c)
    if isinstance(x, (list, tuple)):
        msgs = [m for m in x if isinstance(m, dict) and m.get("role") == "assistant"] or list(x)
        return "\n".join(completion_text(m) for m in msgs)
    return str(x)


def _column(name: str, values: Any, n: int) -> list:
    if values is None:
        raise ValueError(f"this reward function needs a {name!r} column (got none); pass "
                         f"{name}=[...] aligned with completions, or add the column to the dataset")
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        values = [values] * n  # a single gold for the whole batch
    values = list(values)
    if len(values) != n:
        raise ValueError(f"column {name!r} has {len(values)} entries for {n} completions")
    return values


# ----------------------------------------------------------------------------- GSM8K numbers

# A number: optional sign and $, "1,000"-style groups or plain digits, optional decimals, optional
# "/d" fraction. Atomic: once a number has matched (its greedy, longest form) no caller backtracks
# into it, so a pattern that follows it cannot retry shorter numbers (linear time).
_NUM = r"(?<![\w.])(?>-?\$?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:/\d+)?)"
_NUM_RE = re.compile(_NUM)
_HASH_RE = re.compile(r"####[ \t]*+(" + _NUM + r")")
_LATEX_FRAC_RE = re.compile(r"\\[dt]?frac\{(-?\d++)\}\{(-?\d++)\}")
_NUMBER_FULL_RE = re.compile(r"-?(?:\d++(?:\.\d++)?+|\.\d++)(?:/\d++)?+")


def parse_number(s: str) -> Fraction | None:
    """Exact value of one number string ("1,000", "$18.00", "-3/4", "18."), else None.

    A cleaned string longer than ``MAX_NUMBER_CHARS`` (4300, Python's default ``int(str)`` digit
    limit) is None, checked before any regex, also when ``sys.set_int_max_str_digits`` has lifted the
    limit (``int(str)`` is quadratic in the number of digits)."""
    s = s.strip().rstrip(".").replace(",", "").replace("$", "").replace("\\%", "").rstrip("%").strip()
    if len(s) > MAX_NUMBER_CHARS or not _NUMBER_FULL_RE.fullmatch(s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _clean_latex_number(s: str) -> str:
    s = s.replace("\u2212", "-").replace("{,}", ",").replace("\\$", "$").replace("\\!", "").replace("\\,", "")
    return _LATEX_FRAC_RE.sub(r"\1/\2", s)


def _number_in_span(span: str) -> Fraction | None:
    """The span as a whole number if it is one, else the last number inside it."""
    span = _clean_latex_number(span)
    whole = parse_number(span)
    if whole is not None:
        return whole
    nums = _NUM_RE.findall(span)
    return parse_number(nums[-1]) if nums else None


def _last_answer_tag(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` of at most ``ANSWER_TAG_MAX_CHARS`` characters,
    the same tag as the last match of ``re.findall(r"<answer>((?:(?!</answer>).){0,2000}?)</answer>",
    text, re.S)`` (left to right, non-overlapping: a tag's content may hold ``<answer>``), found with
    ``str.find`` in linear time (the regex rescans up to 2000 characters per ``<answer>``)."""
    last = None
    pos, close = 0, -1  # close: first "</answer>" at or after the current content start
    while (s := text.find("<answer>", pos)) >= 0:
        body = s + 8
        if close < body and (close := text.find("</answer>", body)) < 0:
            break  # no closing tag after here: no later <answer> can match either
        if close - body <= ANSWER_TAG_MAX_CHARS:
            last, pos = (body, close), close + 9
        else:  # every <answer> before close - 2000 - 8 is too far from this (its first) closing tag
            pos = max(s + 1, close - ANSWER_TAG_MAX_CHARS - 8)
    return None if last is None else text[last[0]:last[1]]


def extract_gsm8k_answer(text: str) -> Fraction | None:
    """Model's final number: ``#### N``, else last ``\\boxed{N}``, else the last ``<answer>N</answer>``
    (contents of at most ``ANSWER_TAG_MAX_CHARS``), else the last number in the text. Returns None
    when there is no number at all. Linear time; the whole text is searched (no cap)."""
    text = completion_text(text)
    hashes = _HASH_RE.findall(text)
    if hashes and (v := parse_number(hashes[-1])) is not None:
        return v
    boxed = last_boxed(text)
    if boxed is not None and (v := _number_in_span(boxed)) is not None:
        return v
    tag = _last_answer_tag(text)
    if tag is not None and (v := _number_in_span(tag)) is not None:
        return v
    nums = _NUM_RE.findall(_clean_latex_number(text))
    return parse_number(nums[-1]) if nums else None


def _gsm8k_gold(gold: Any) -> Fraction | None:
    if isinstance(gold, bool) or gold is None:
        return None
    if isinstance(gold, (int, Fraction)):
        return Fraction(gold)
    if isinstance(gold, float):
        return Fraction(str(gold)) if math.isfinite(gold) else None
    s = str(gold)
    if "####" in s:
        m = _HASH_RE.findall(s)
        return parse_number(m[-1]) if m else None
    return parse_number(_clean_latex_number(s))


def score_gsm8k(completion: Any, gold: Any) -> float | None:
    """1.0 / 0.0 for one completion; None when ``gold`` (a ``#### N`` solution or a number) has no
    parsable final number."""
    g = _gsm8k_gold(gold)
    if g is None:
        return None
    try:
        return 1.0 if extract_gsm8k_answer(completion) == g else 0.0
    except Exception:  # never let model output crash a training step
        logger.debug("gsm8k scoring failed", exc_info=True)
        return 0.0


def gsm8k_reward(prompts: Sequence[Any] | None = None, completions: Sequence[Any] = (),
                 answer: Sequence[Any] | None = None, **kwargs: Any) -> list[float | None]:
    """TRL reward: 1.0 when the completion's final number equals the gold ``answer`` number."""
    golds = _column("answer", answer, len(completions))
    return [score_gsm8k(c, g) for c, g in zip(completions, golds)]


# ----------------------------------------------------------------------------- MATH \boxed answers

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BLANKS_RE = re.compile(r"[ \t]*+")
_SPACED_END_RE = re.compile(r"[$\n]")
_ESCAPE_RE = re.compile(r"\\[\s\S]")  # a backslash and the character it escapes
_BRACE_DELTA = {"{": 1, "}": -1}
_BRACE_CHUNK = 1 << 14


def _last_box_end(text: str) -> int | None:
    """End of the last ``_BOX_RE`` match (``\\boxed``/``\\fbox`` not followed by a letter), found
    from the end with ``str.rfind`` (the two words cannot overlap, so this is finditer's last match)."""
    best = None
    for word in ("\\boxed", "\\fbox"):
        e = len(text)
        while (i := text.rfind(word, 0, e)) >= 0:
            k = i + len(word)
            if k == len(text) or not ("A" <= text[k] <= "Z" or "a" <= text[k] <= "z"):
                best = k if best is None else max(best, k)
                break
            e = i
    return best


def _closing_brace(text: str, j: int) -> int | None:
    """Index of the ``}`` that closes the ``{`` at ``text[j]`` (``\\`` escapes the next character),
    else None. Linear, and C-speed: escape pairs are blanked in one ``re.sub``, chunks whose ``}``
    count cannot bring the depth to 0 are skipped with ``str.count``, the others are scanned with
    ``itertools.accumulate`` (no Python step per character)."""
    seg = text[j:]
    if "\\" in seg:
        seg = _ESCAPE_RE.sub("  ", seg)  # same length: indices stay aligned
    depth = 0
    for a in range(0, len(seg), _BRACE_CHUNK):
        chunk = seg[a:a + _BRACE_CHUNK]
        closes = chunk.count("}")
        if closes == 0 or depth - closes > 0:
            depth += chunk.count("{") - closes
            continue
        acc = list(accumulate(map(_BRACE_DELTA.get, chunk, repeat(0, len(chunk))), initial=depth))
        try:
            return j + a + acc.index(0, 1) - 1  # acc[i]: depth after chunk[i - 1]
        except ValueError:
            depth = acc[-1]
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` (balanced braces, ``\\{`` skipped) or of
    ``\\boxed 5`` (up to ``$`` or end of line). None if absent or the last one is unterminated."""
    text = completion_text(text)
    i = _last_box_end(text)
    if i is None:
        return None
    j = _BLANKS_RE.match(text, i).end()
    if j >= len(text):
        return None
    if text[j] != "{":
        if j == i:  # "\boxed5" is not the spaced form
            return None
        end = _SPACED_END_RE.search(text, j)
        content = text[j:end.start() if end else len(text)].strip()
        return content or None
    k = _closing_brace(text, j)
    return None if k is None else text[j + 1:k]


_TEXT_WRAP_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*+)\}")


def _normalize_latex(s: str) -> str:
    """Conservative string normalization: equal outputs are the same answer."""
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s)
    s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s)
    s = re.sub(r"\\[!,;: ]", "", s)
    s = re.sub(r"\^\{?\\circ\}?", "", s)
    s = _TEXT_WRAP_RE.sub(r"\1", s)
    s = s.replace("\\%", "").replace("{,}", ",")
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".")


def _gold_answer(gold: Any) -> str | None:
    if gold is None or isinstance(gold, bool):
        return None
    s = str(gold)
    if _BOX_RE.search(s):
        b = last_boxed(s)
        s = b if b is not None else ""
    s = s.strip().strip("$").strip()
    return s or None


_LHS_RE = re.compile(r"[A-Za-z]\w{0,20}+=")  # "x=" before a stated value
_FRAC_DIGITS_RE = re.compile(r"\\frac(\d)(\d)")  # \frac12


def _as_number(s: str) -> Fraction | None:
    """The answer as an exact number when it states one ("7", "7.0", "\\frac{14}{2}", "\\frac12",
    "1,000", "x=5", "30^\\circ", "50\\%"), else None: "2*3+1", "\\sqrt{49}" and "9^{9^9}" are not numbers."""
    s = _normalize_latex(s)
    m = _LHS_RE.match(s)
    return parse_number(_clean_latex_number(_FRAC_DIGITS_RE.sub(r"\1/\2", s[m.end():] if m else s)))


def _score_math(completion: Any, gold: Any, pt: int, vt: int, verify: bool) -> tuple[float | None, bool]:
    """(score, whether math-verify was needed but not run because ``verify`` is False)."""
    g = _gold_answer(gold)
    if g is None:
        return None, False
    try:
        p = last_boxed(completion)
        if p is None or not p.strip() or len(p) > MAX_ANSWER_CHARS:
            return 0.0, False
        if _normalize_latex(p) == _normalize_latex(g):
            return 1.0, False
        number = _as_number(g)
        if number is not None:  # a number: the answer must state it; model arithmetic is not evaluated
            return (1.0 if _as_number(p) == number else 0.0), False
        if not verify:
            return 0.0, True
        res = math_verify_equal(g, p, pt, vt)
    except ImportError:
        raise
    except Exception:
        logger.debug("math scoring failed", exc_info=True)
        return 0.0, False
    if res is None:
        return 0.0, False
    gold_ok, equal = res
    if not gold_ok:
        return None, False
    return (1.0 if equal else 0.0), False


def score_math(completion: Any, gold: Any, *, parsing_timeout: int = PARSING_TIMEOUT,
               verify_timeout: int = VERIFY_TIMEOUT) -> float | None:
    """1.0 / 0.0 for one completion's last ``\\boxed{}`` against ``gold`` (bare answer or a solution
    with ``\\boxed``); None when the gold has no usable answer. A numeric gold is compared exactly
    with the number the box states (``_as_number``); other golds go to math-verify."""
    return _score_math(completion, gold, parsing_timeout, verify_timeout, True)[0]


def math_reward(prompts: Sequence[Any] | None = None, completions: Sequence[Any] = (),
                answer: Sequence[Any] | None = None, solution: Sequence[Any] | None = None,
                budget_s: float = BUDGET_S, **kwargs: Any) -> list[float | None]:
    """TRL reward: last ``\\boxed{}`` vs. the ``answer`` column (else ``solution``), via math-verify.

    Each distinct (completion, gold) pair is scored once. math-verify runs while the call has spent
    less than ``budget_s`` seconds; past it, answers that would need math-verify score 0.0 and a
    warning says how many (docs/rewards.md, "Time bounds")."""
    if answer is None and solution is None:
        raise ValueError("math_reward needs an 'answer' (bare answer) or 'solution' (with \\boxed) column")
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not budget_s >= 0:
        raise ValueError(f"budget_s must be a number of seconds >= 0; got {str(budget_s)[:40]!r}")
    golds = _column("answer" if answer is not None else "solution",
                    answer if answer is not None else solution, len(completions))
    start, seen, skipped, out = _clock(), {}, 0, []
    for c, g in zip(completions, golds):
        text = completion_text(c)
        key = (text, _gold_answer(g))
        if key not in seen:
            seen[key], was_skipped = _score_math(text, g, PARSING_TIMEOUT, VERIFY_TIMEOUT,
                                                 _clock() - start < budget_s)
            skipped += was_skipped
        out.append(seen[key])
    if skipped:
        logger.warning("math_reward: the per-call budget of %.3g s ran out; %d answer(s) that needed math-verify "
                       "scored 0.0", budget_s, skipped)
    return out


# ----------------------------------------------------------------------------- format

FORMAT_PATTERNS: dict[str, str] = {
    # last non-empty line is "#### <number>" (GSM8K / tiny-task shape). Possessive quantifiers and the
    # atomic number: no backtracking between the blanks, the optional "." and the trailing whitespace
    # (the old "[ \t]*\.?\s*\Z" was quadratic in trailing blanks followed by any other character).
    "final_answer": r"(?:\A|\n)[ \t]*+####[ \t]*+" + _NUM + r"[ \t]*+\.?+\s*+\Z",
    # exactly: <think>...</think> then <answer>...</answer>, nothing else (tempered tokens, possessive:
    # a body stops at its first closing tag and is never rescanned)
    "think_answer": r"\A\s*+<think>(?:(?!</think>)[\s\S])*+</think>\s*+"
                    r"<answer>(?:(?!</answer>)[\s\S])++</answer>\s*+\Z",
}


def make_format_reward(pattern: str = "final_answer", score: float = 1.0, *, flags: int = 0,
                       name: str | None = None) -> RewardFn:
    """TRL reward giving ``score`` when ``re.search(pattern, completion)`` matches, else 0.0.

    ``pattern`` is a key of ``FORMAT_PATTERNS`` or your own regex (anchor it with ``\\A``/``\\Z``).
    """
    key = pattern if pattern in FORMAT_PATTERNS else None
    rx = re.compile(FORMAT_PATTERNS[key] if key else pattern, flags)
    score = float(score)

    def reward(prompts: Sequence[Any] | None = None, completions: Sequence[Any] = (),
               **kwargs: Any) -> list[float | None]:
        return [score if rx.search(completion_text(c)) else 0.0 for c in completions]

    reward.__name__ = reward.__qualname__ = name or (f"format_reward_{key}" if key else "format_reward")
    reward.__doc__ = f"TRL format reward: {score} if the completion matches {rx.pattern!r}, else 0.0."
    return reward


format_reward = make_format_reward("final_answer", name="format_reward")
think_format_reward = make_format_reward("think_answer", name="think_format_reward")
