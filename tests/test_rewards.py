"""Tests for qerl_kit.rewards: extraction, exact number comparison, math-verify path, format checks,
TRL calling convention, thread safety, and gold-vs-own / gold-vs-other rates on the shared data."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path

import pytest

from qerl_kit import math_equiv as E
from qerl_kit import rewards as R
from qerl_kit.rewards import (
    completion_text, extract_gsm8k_answer, format_reward, gsm8k_reward, last_boxed, make_format_reward,
    math_reward, parse_number, score_gsm8k, score_math, think_format_reward,
)

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"shared data dir {DATA} not found")


def _jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text(encoding="utf-8").splitlines() if line.strip()]


# ----------------------------------------------------------------------------- GSM8K

def test_first_character_bug_is_not_repeated():
    # official QeRL eval compared only answer[0]: "75" matched gold "72"
    assert gsm8k_reward(None, ["The answer is 75", "#### 7", "#### 72"], answer=["72"] * 3) == [0.0, 0.0, 1.0]
    assert score_math("\\boxed{75}", "72") == 0.0


@pytest.mark.parametrize("text,value", [
    ("#### 1,000", Fraction(1000)),
    ("so she pays $18.", Fraction(18)),
    ("#### $18.00", Fraction(18)),
    ("it is 18.0", Fraction(18)),
    ("the change is -5 degrees", Fraction(-5)),
    ("3-5", Fraction(5)),              # a hyphen between numbers is not a sign
    ("temperature \u22123", Fraction(-3)),
    ("ratio 3/4", Fraction(3, 4)),
    ("\\boxed{\\frac{3}{4}}", Fraction(3, 4)),
    ("\\boxed{-\\$1{,}250}", Fraction(-1250)),
    ("about .5 of it", Fraction(1, 2)),
    ("no digits here", None),
])
def test_extract_and_normalize(text, value):
    assert extract_gsm8k_answer(text) == value


def test_extraction_precedence():
    # #### beats \boxed beats <answer> beats last number
    assert extract_gsm8k_answer("\\boxed{3} <answer>4</answer> #### 5 and then 6") == 5
    assert extract_gsm8k_answer("<answer>4</answer> \\boxed{3} then 6") == 3
    assert extract_gsm8k_answer("<answer>x = 4</answer> then 6") == 4
    assert extract_gsm8k_answer("2 then 6") == 6
    # the last "#### N" wins; a "####" without a number falls through
    assert extract_gsm8k_answer("#### 1\n... no wait\n#### 2") == 2
    assert extract_gsm8k_answer("I computed 7.\n#### unknown") == 7


@pytest.mark.parametrize("completion,gold,expected", [
    ("#### 1000", "1,000", 1.0),
    ("#### 1,000", "#### 1000", 1.0),
    ("It costs $18.", "Janet sells 9 eggs.\n#### 18", 1.0),
    ("#### 18.0", 18, 1.0),
    ("#### 0.75", "3/4", 1.0),
    ("#### 0.333", "1/3", 0.0),           # exact, no float tolerance
    ("#### 0.1", 0.1, 1.0),
    ("#### -3", "-3", 1.0),
    ("#### 3", "-3", 0.0),
    ("#### 180", "18", 0.0),
    ("", "18", 0.0),
])
def test_score_gsm8k(completion, gold, expected):
    assert score_gsm8k(completion, gold) == expected


@pytest.mark.parametrize("gold", ["no number here", "#### ", "", None, True, float("nan")])
def test_unparsable_gsm8k_gold_is_not_applicable(gold):
    assert score_gsm8k("#### 3", gold) is None


def test_trl_calling_convention():
    completions = [[{"role": "assistant", "content": "#### 4"}], "#### 5", {"role": "assistant", "content": "4"}]
    prompts = [[{"role": "user", "content": "2+2?"}], "2+2?", "2+2?"]
    got = gsm8k_reward(prompts=prompts, completions=completions, answer=["4", "4", "4"],
                       completion_ids=[[1], [2], [3]], trainer_state=object(), log_extra=None,
                       log_metric=lambda *a: None, other_column=[1, 2, 3])
    assert got == [1.0, 0.0, 1.0]
    assert math_reward(prompts, [[{"role": "assistant", "content": "\\boxed{4}"}]] * 3, answer=["4", "5", ""],
                       completion_ids=None, trainer_state=None) == [1.0, 0.0, None]
    # list-of-parts content, and a system+assistant conversation (assistant text only)
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "#### 9"}]}]) == "#### 9"
    assert completion_text([{"role": "user", "content": "7"}, {"role": "assistant", "content": "8"}]) == "8"


def test_column_errors_are_raised():
    with pytest.raises(ValueError, match="answer"):
        gsm8k_reward(None, ["#### 1"])
    with pytest.raises(ValueError, match="2 entries for 3"):
        gsm8k_reward(None, ["1", "2", "3"], answer=["1", "2"])
    assert gsm8k_reward(None, ["#### 1", "#### 2"], answer="2") == [0.0, 1.0]  # one gold for the batch
    with pytest.raises(ValueError, match="solution"):
        math_reward(None, ["\\boxed{1}"])
    # MATH-style datasets without an answer column: the solution column is used
    assert math_reward(None, ["\\boxed{2}"], solution=["so \\boxed{2}."]) == [1.0]


# ----------------------------------------------------------------------------- MATH

@pytest.mark.parametrize("text,content", [
    ("so \\boxed{\\frac{1}{2}} and \\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("\\boxed{a_{b}^{c}}", "a_{b}^{c}"),
    ("$\\boxed 5$.", "5"),
    ("\\fbox{7}", "7"),
    ("\\boxed {x}", "x"),
    ("first \\boxed{1} then truncated \\boxed{2", None),
    ("\\boxed", None),
    ("\\boxedx{3}", None),
    ("nothing", None),
])
def test_last_boxed(text, content):
    assert last_boxed(text) == content


@pytest.mark.parametrize("completion,gold,expected", [
    ("\\boxed{\\dfrac{1}{2}}", "\\frac12", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3, \\pi/2)", 1.0),
    ("\\boxed{x=5}", "5", 1.0),
    ("\\boxed{30^\\circ}", "30", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", 1.0),
    ("\\boxed{6}", "so the answer is $\\boxed{6}$.", 1.0),
    ("\\boxed{7}", "so the answer is $\\boxed{6}$.", 0.0),
    ("\\boxed{\\sqrt{2}}", "1.41421", 0.0),
    ("The answer is 6", "6", 0.0),          # no box, no reward
    ("\\boxed{}", "6", 0.0),
    ("\\boxed{6", "6", 0.0),
])
def test_score_math(completion, gold, expected):
    assert score_math(completion, gold) == expected


@pytest.mark.parametrize("gold", ["", "   ", None, "solution with an unterminated \\boxed{3", "$$"])
def test_unparsable_math_gold_is_not_applicable(gold):
    assert score_math("\\boxed{3}", gold) is None


@pytest.mark.parametrize("junk", [
    "\\boxed{\\frac{}{}}", "\\boxed{)))(((}", "\\boxed{\\begin{matrix}}", "\\boxed{" + "{" * 500 + "}" * 500 + "}",
    "\\boxed{\\sqrt[}", "\\boxed{1/0}", "\\boxed{\\x00\x00}", "\\boxed{" + "9" * 2000 + "}", "\\boxed{__import__('os')}",
])
def test_malformed_output_scores_zero_never_raises(junk):
    assert math_reward(None, [junk], answer=["3"]) == [0.0]
    assert gsm8k_reward(None, [junk], answer=["3"]) in ([0.0], [1.0])  # number extraction may find a 3


def test_pathological_input_is_bounded_in_main_thread():
    t = time.monotonic()
    assert score_math("\\boxed{9^{9^{9^{9}}}}", "3", parsing_timeout=1, verify_timeout=1) == 0.0
    assert time.monotonic() - t < 15


def _in_thread(fn):
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # pragma: no cover - reported below
            box["error"] = e

    th = threading.Thread(target=run)
    th.start()
    th.join(timeout=120)
    assert not th.is_alive(), "reward call hung in a worker thread"
    assert "error" not in box, f"reward raised in a worker thread: {box.get('error')!r}"
    return box["value"]


def test_math_reward_from_non_main_thread():
    # math-verify's signal.alarm timeouts raise ValueError outside the main thread; we must not
    t = time.monotonic()
    got = _in_thread(lambda: math_reward(None, ["\\boxed{0.5}", "\\boxed{9^{9^{9^{9}}}}", "\\boxed{3}", "\\boxed{x=5}"],
                                         answer=["\\frac12", "3", "4", "5"]))
    assert got == [1.0, 0.0, 0.0, 1.0]
    assert time.monotonic() - t < 60


def test_hung_worker_is_killed_after_deadline(monkeypatch):
    hang = "import sys, time\nsys.stdout.write('{\"ready\": true}\\n'); sys.stdout.flush()\nsys.stdin.readline(); time.sleep(600)\n"
    E._kill_worker()
    monkeypatch.setattr(E, "_WORKER_SRC", hang)
    monkeypatch.setattr(E, "_worker_deadline", lambda pt, vt: 1.0)
    t = time.monotonic()
    assert _in_thread(lambda: score_math("\\boxed{2\\sqrt{2}}", "\\sqrt{8}")) == 0.0
    assert time.monotonic() - t < 20
    assert E._worker is None  # killed; the next call starts a fresh worker
    monkeypatch.undo()
    assert _in_thread(lambda: score_math("\\boxed{2\\sqrt{2}}", "\\sqrt{8}")) == 1.0


@pytest.mark.parametrize("exc", ["timeout", RuntimeError("boom"), RecursionError()])
def test_math_verify_errors_score_zero(monkeypatch, exc):
    import math_verify
    from math_verify.errors import TimeoutException  # a BaseException, not an Exception

    def broken(*args, **kwargs):
        raise TimeoutException("slow") if exc == "timeout" else exc

    monkeypatch.setattr(math_verify, "verify", broken)
    assert score_math("\\boxed{2\\sqrt{2}}", "\\sqrt{8}") == 0.0
    assert score_math("\\boxed{1/2}", "1/2") == 1.0  # string-equal: math-verify not needed


def test_missing_math_verify_gives_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match="pip install math-verify"):
        score_math("\\boxed{2\\sqrt{2}}", "\\sqrt{8}")
    assert score_math("\\boxed{1/2}", "1/2") == 1.0  # string-equal answers need no math-verify


def test_import_is_cheap_and_lazy():
    path = Path(R.__file__)
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('qerl_rewards_probe', {str(path)!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "print(sorted(k for k in ('math_verify', 'sympy', 'torch', 'transformers') if k in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_no_eval_of_model_output():
    src = Path(R.__file__).read_text()
    for banned in ("eval(", "exec(", "sympify("):
        assert banned not in src.replace("literal_eval(", "")
    assert importlib.util.find_spec("qerl_kit.rewards") is not None


# ----------------------------------------------------------------------------- format

def test_default_format_reward():
    good = ["Step 1: 2+2=4.\n#### 4", "reasoning\n####  -1,000.\n\n", [{"role": "assistant", "content": "x\n#### 3/4"}]]
    bad = ["#### 4 because", "The answer is 4", "#### four", "reasoning #### 4", "#### 4\nmore text", ""]
    assert format_reward(None, good) == [1.0] * len(good)
    assert format_reward(None, bad) == [0.0] * len(bad)
    assert format_reward.__name__ == "format_reward"


def test_think_answer_format_and_factory():
    good = "<think>\nadd them\n</think>\n<answer>4</answer>"
    bad = ["<answer>4</answer>", "<think>a</think><answer></answer>", "hi <think>a</think><answer>4</answer>",
           "<think>a</think><answer>4</answer> trailing", "<think>a<answer>4</answer>"]
    assert think_format_reward(None, [good]) == [1.0]
    assert think_format_reward(None, bad) == [0.0] * len(bad)
    f = make_format_reward("think_answer", score=0.5)
    assert f(None, [good, bad[0]], trainer_state=None) == [0.5, 0.0]
    custom = make_format_reward(r"\AANSWER: \d+\Z", score=2.0, name="mine")
    assert custom(None, ["ANSWER: 12", "ANSWER: x"]) == [2.0, 0.0]
    assert custom.__name__ == "mine"


def test_format_patterns_are_linear_time():
    t = time.monotonic()
    evil = ["<think>" * 20000, "<think>a</think>" * 5000 + "<answer>" * 5000, "\n####" * 20000, "1," * 50000]
    format_reward(None, evil)
    think_format_reward(None, evil)
    gsm8k_reward(None, evil, answer=["1"] * len(evil))
    assert time.monotonic() - t < 5


# ----------------------------------------------------------------------------- shared data

@needs_data
def test_gsm8k_gold_solutions_against_own_and_other_answers():
    rows = _jsonl("gsm8k_test.jsonl")
    assert len(rows) == 1319
    sols = [r["answer"] for r in rows]
    finals = [s.rsplit("####", 1)[1].strip() for s in sols]
    # full solution as completion vs the full-solution gold, and vs the bare number
    assert gsm8k_reward(None, sols, answer=sols) == [1.0] * len(rows)
    assert gsm8k_reward(None, sols, answer=finals) == [1.0] * len(rows)
    shifted = sols[1:] + sols[:1]
    other = gsm8k_reward(None, shifted, answer=finals)
    zero_rate = other.count(0.0) / len(other)
    # measured: 1304/1319 = 98.86% zero; all 15 ones are neighbours with the same gold number
    same = sum(parse_number(a) == parse_number(b) for a, b in zip(finals, finals[1:] + finals[:1]))
    assert other.count(1.0) == same == 15
    assert zero_rate >= 0.97


@needs_data
def test_math500_gold_solutions_against_own_and_other_answers():
    rows = _jsonl("math500_test.jsonl")
    assert len(rows) == 500
    sols = [r["solution"] for r in rows]
    answers = [r["answer"] for r in rows]
    assert math_reward(None, sols, answer=answers) == [1.0] * 500
    assert math_reward(None, sols, solution=sols) == [1.0] * 500
    other = math_reward(None, sols[1:] + sols[:1], answer=answers)
    # measured: 497/500 = 99.4% zero; rows 186 and 403 have the same answer as the next row ("7", "3"),
    # row 22 has answer "5" and the next row's "x=5", which math-verify treats as equal.
    assert [i for i, v in enumerate(other) if v != 0.0] == [22, 186, 403]
    assert other.count(0.0) / 500 >= 0.97


@needs_data
def test_math500_math_verify_path_alone_agrees():
    # the string fast path makes the test above easy; check math-verify itself accepts every gold
    rows = _jsonl("math500_test.jsonl")
    failures = [i for i, r in enumerate(rows) if E.math_verify_equal(r["answer"], last_boxed(r["solution"])) != (True, True)]
    assert failures == []
